"""Communicators over subsets of a stage's replicas, and averages over them.

Every sync strategy averages over some set of ranks: all replicas (all-reduce), the group the
scheduler formed (sdpipe), a gossip pair (adpsgd); clipping sums a norm over a pipeline's stages.
Those sets change every round, so communicators are made on demand by their members only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from sdpipe_cli.runtime import store
from sdpipe_cli.runtime.bootstrap import Joined, connect_store
from sdpipe_cli.sync import quantized
from sdpipe_cli.sync.traffic import Traffic

__all__ = ["GroupCache", "average_changes", "average_parameters", "average_tensors", "flatten",
           "for_worker", "mean_of_changes", "sum_in_int8", "unflatten"]


class GroupCache:
    """Communicators over subsets of ranks, created on first use by their members only.

    Groups change every round, so they are made on demand and cached, and only the members take
    part: no global collective per round. ``dist.new_group(..., use_local_synchronization=True)``
    is not usable for this: it names a group after its ranks *and the number of groups the calling
    process made before*, so two members with different histories rendezvous under different names
    and hang. Here a group's rendezvous keys are named after its ranks (and their incarnations),
    so members always meet.

    A communicator that failed is forgotten, and its members may need one over the same ranks
    again. Its rendezvous keys are still in the store and hold the dead communicator's addresses,
    so a second rendezvous under the same name could connect to them. Callers that can fail and
    retry (sdpipe's rounds) pass a ``tag`` that both members know, such as the round that first
    needed the communicator; it names the rendezvous of that creation only, not the cache entry.
    """

    def __init__(self, store: dist.Store, rank: int, backend: str, timeout: float,
                 delay: Callable[[list[int], int], float] | None = None,
                 traffic: Traffic | None = None):
        self.store, self.rank, self.backend = store, rank, backend
        self.timeout = timedelta(seconds=timeout)
        self.delay = delay  # emulated network: seconds an all-reduce of N bytes over ranks takes
        self.traffic = traffic or Traffic()  # what this worker's collectives moved, by link
        self._groups: dict[tuple[tuple[int, int], ...], Any] = {}  # by _key

    @staticmethod
    def _key(ranks: list[int], incarnations: list[int] | None) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(zip(ranks, incarnations or [0] * len(ranks))))

    def get(self, ranks: list[int], incarnations: list[int] | None = None, tag: str = ""):
        key = self._key(ranks, incarnations)
        if key not in self._groups:
            name = "-".join(f"{r}.{g}" if g else str(r) for r, g in key) + (f"@{tag}" if tag else "")
            prefix = dist.PrefixStore(f"groups/{name}/", self.store)
            me, size = [r for r, _ in key].index(self.rank), len(key)
            if self.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self._groups[key] = dist.ProcessGroupNCCL(prefix, me, size, options)
            else:
                self._groups[key] = dist.ProcessGroupGloo(prefix, me, size, self.timeout)
        return self._groups[key]

    def all_reduce(self, tensor: torch.Tensor, ranks: list[int], op=dist.ReduceOp.SUM,
                   incarnations: list[int] | None = None, tag: str = "") -> None:
        """In-place all-reduce of ``tensor`` over ``ranks`` (this rank must be one of them)."""
        start, nbytes = time.perf_counter(), tensor.numel() * tensor.element_size()
        if self.delay is not None:
            time.sleep(self.delay(ranks, nbytes))
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.get(ranks, incarnations, tag).allreduce([tensor], options).wait()
        self.traffic.all_reduce(ranks, nbytes, time.perf_counter() - start)

    def all_to_all(self, rows: torch.Tensor, ranks: list[int],
                   incarnations: list[int] | None = None, tag: str = "") -> torch.Tensor:
        """Row i of ``rows`` (one a member, in rank order) to the i-th member; returns the rows
        received, row i from the i-th member (this member's own row kept)."""
        out = torch.empty_like(rows)
        self._exchange(out, ranks, incarnations, tag, lambda group: group.alltoall_base(
            out, rows, [], [], dist.AllToAllOptions()))
        return out

    def all_gather(self, row: torch.Tensor, ranks: list[int],
                   incarnations: list[int] | None = None, tag: str = "") -> torch.Tensor:
        """Every member's ``row`` (a vector, of one length on all), row i the i-th member's."""
        out = row.new_empty(len(ranks) * row.numel())
        self._exchange(out, ranks, incarnations, tag,
                       lambda group: group._allgather_base(out, row.reshape(-1)))
        return out.view(len(ranks), -1)

    def _exchange(self, out: torch.Tensor, ranks: list[int], incarnations: list[int] | None,
                  tag: str, collective: Callable[[Any], Any]) -> None:
        """Run an all-to-all or all-gather whose result is ``out``, emulated and counted. Each
        moves (k-1)/k of the result's bytes through a member's link in k-1 steps, half a ring
        all-reduce of them: two cost one emulated all-reduce of the payload."""
        start, nbytes = time.perf_counter(), out.numel() * out.element_size()
        if self.delay is not None:
            time.sleep(self.delay(ranks, nbytes) / 2)
        collective(self.get(ranks, incarnations, tag)).wait()
        self.traffic.exchange(ranks, nbytes, time.perf_counter() - start)

    def broadcast(self, tensor: torch.Tensor, ranks: list[int], root: int,
                  incarnations: list[int] | None = None, tag: str = "") -> None:
        """In-place broadcast of ``tensor`` from rank ``root`` to the other ``ranks``."""
        start, nbytes = time.perf_counter(), tensor.numel() * tensor.element_size()
        if self.delay is not None:
            time.sleep(self.delay(ranks, nbytes))
        group_ranks = [r for r, _ in self._key(ranks, incarnations)]
        options = dist.BroadcastOptions()
        options.rootRank = group_ranks.index(root)
        self.get(ranks, incarnations, tag).broadcast([tensor], options).wait()
        chain = [root] + [r for r in group_ranks if r != root]
        self.traffic.broadcast(ranks, nbytes, root == self.rank, chain[-1] == self.rank,
                               time.perf_counter() - start)

    def forget(self, ranks: list[int], incarnations: list[int] | None = None) -> None:
        """Drop a communicator that failed (a member died or timed out); it cannot be used again,
        and one over the same ranks is made anew, under a new ``tag``, when next needed."""
        self._groups.pop(self._key(ranks, incarnations), None)


def statistics(module: nn.Module) -> list[torch.Tensor]:
    """The module's floating-point buffers: normalisation layers' running statistics, which are
    part of a replica as much as its weights (BatchNorm evaluates with them). Integer buffers
    (BatchNorm's batch count) stay each replica's own.

    They are returned as ``.data`` aliases: an average written into them must not count as an
    in-place change for autograd, because under asynchronous 1F1B a micro-batch in flight saved
    them in its graph (BatchNorm's backward reads them only in eval mode, so the change is
    harmless to it)."""
    return [b.data for b in module.buffers() if b.is_floating_point()]


def average_parameters(module: nn.Module, groups: GroupCache, ranks: list[int]) -> None:
    """Replace each parameter (and running statistic) by the mean over ``ranks`` (one flat
    all-reduce, exact weights 1/n).

    The all-reduce works on a flat copy; the parameters change only once it completed.
    """
    average_tensors(list(module.parameters()) + statistics(module), groups, ranks)


def average_tensors(tensors: list[torch.Tensor], groups: GroupCache, ranks: list[int],
                    consensus: int = 0, incarnations: list[int] | None = None,
                    tag: str = "", shares: Sequence[tuple[int, float]] = ()) -> float | None:
    """Replace each tensor by its mean over ``ranks``, in one flat all-reduce.

    ``shares``: runs of (count, share) from the first tensor: those ``count`` tensors are
    replaced by the weighted mean in which this member counts ``share`` (every member passes
    its own; they sum to 1); the tensors after the runs by the plain mean.
    With ``consensus = n``, the first n tensors are the stage's weights, and their consensus
    distance before averaging is returned: sqrt(mean over members of ||w_p - w_mean||^2) /
    ||w_mean|| (one more all-reduce, of two numbers). ``incarnations``, ``tag``: see
    :class:`GroupCache`.
    """
    with torch.no_grad():
        flat = flatten(tensors)
        own = flat.clone() if consensus else None
        weighted, index = 0, 0  # elements and tensors of flat under a share
        for count, share in shares:
            size = sum(t.numel() for t in tensors[index:index + count])
            flat[weighted:weighted + size] *= share
            weighted, index = weighted + size, index + count
        groups.all_reduce(flat, ranks, incarnations=incarnations, tag=tag)
        flat[weighted:] /= len(ranks)
        distance = None
        if consensus:
            own = cast(torch.Tensor, own)  # the copy taken above whenever consensus is
            n = sum(t.numel() for t in tensors[:consensus])
            sums = torch.stack([(own[:n] - flat[:n]).pow(2).sum(), flat[:n].pow(2).sum()])
            groups.all_reduce(sums, ranks, incarnations=incarnations, tag=tag)  # n x ||w_mean||^2 too
            distance = math.sqrt(float(sums[0]) / len(ranks)) / max(
                math.sqrt(float(sums[1]) / len(ranks)), 1e-30)
        unflatten(flat, tensors)
    return distance


def mean_of_changes(flat: torch.Tensor, residual: torch.Tensor, groups: GroupCache,
                    ranks: list[int], precision: str, share: float | None = None,
                    incarnations: list[int] | None = None, tag: str = "") -> None:
    """Replace ``flat`` (this member's float32 vector) by the mean over ``ranks`` of the
    members' vectors, sent in ``precision``: ``bf16`` (a bfloat16 all-reduce, half of float32's
    bytes) or ``int8`` (a scale per chunk, :func:`sum_in_int8`: about a quarter).

    Meant for *changes* (since a shared anchor, or DiLoCo's outer gradient), whose rounding
    loses little, never for weights, whose small updates it would lose. ``residual``: what
    rounding lost of this member's vectors so far; it is added before rounding and replaced by
    what this rounding lost (error feedback), so a member's contribution is delayed by rounding,
    never dropped. The sum is rounded too (bfloat16's ring sums in bfloat16; int8's shards are
    rounded again before the all-gather); that error is of the same order, the same on every
    member, and not fed back. ``share``: this member's weight in a weighted mean
    (:func:`average_tensors`' ``shares``); 0 takes the group's mean without counting, and drops
    its own vector.
    """
    if precision not in ("bf16", "int8"):
        raise ValueError(f"changes are sent in bf16 or int8, not {precision}")
    with torch.no_grad():
        flat.add_(residual)
        scaled = flat if share is None else flat * share
        if precision == "int8":
            codes, scales = quantized.quantize(_padded(scaled, len(ranks)))
            sent = quantized.dequantize(codes, scales)[:flat.numel()]
        else:
            low = scaled.to(torch.bfloat16)
            sent = low.float()
        lost = (flat - sent if share is None
                else flat - sent / share if share > 0 else torch.zeros_like(flat))
        # kept only once the round completed: a failed round leaves this member as it was
        if precision == "int8":
            total = sum_in_int8(codes, scales, groups, ranks, incarnations, tag)[:flat.numel()]
        else:
            groups.all_reduce(low, ranks, incarnations=incarnations, tag=tag)
            total = low
        residual.copy_(lost)
        flat.copy_(total)
        if share is None:
            flat /= len(ranks)


def sum_in_int8(codes: torch.Tensor, scales: torch.Tensor, groups: GroupCache, ranks: list[int],
                incarnations: list[int] | None = None, tag: str = "") -> torch.Tensor:
    """The sum over ``ranks`` of the members' vectors, each given as int8 ``codes`` and
    ``scales`` (:func:`~sdpipe_cli.sync.quantized.quantize`, its chunks a multiple of the
    members), with only int8 on the wire: the i-th member is sent every member's i-th shard
    (all-to-all), sums them in float32, rounds its sum to int8 again, and every member gathers
    every rounded shard (all-gather). Each member sends 2(k-1)/k of the payload, as a ring
    all-reduce would, and all decode the same bytes: their sums are equal to the bit."""
    k = len(ranks)
    mine = quantized.unpack(groups.all_to_all(quantized.pack(codes, scales, k), ranks,
                                              incarnations, tag))
    shard = quantized.dequantize(*mine).reshape(k, -1).sum(dim=0)
    row = quantized.pack(*quantized.quantize(shard), 1)
    return quantized.dequantize(*quantized.unpack(groups.all_gather(row, ranks, incarnations, tag)))


def _padded(flat: torch.Tensor, parts: int) -> torch.Tensor:
    """``flat`` with zeros after it to whole chunks, ``parts`` shards of as many each."""
    extra = quantized.padded(flat.numel(), parts) - flat.numel()
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat


def average_changes(tensors: list[torch.Tensor], anchor: torch.Tensor, residual: torch.Tensor,
                    groups: GroupCache, ranks: list[int], precision: str,
                    share: float | None = None, incarnations: list[int] | None = None,
                    tag: str = "") -> None:
    """Replace each tensor by ``anchor`` plus the mean over ``ranks`` of the members' changes
    since it, in ``precision`` with error feedback (:func:`mean_of_changes`; ``residual``,
    ``share``).

    Every member must hold the same ``anchor`` (the stage's weights at its last global sync;
    :mod:`~sdpipe_cli.core.meetings`); the members leave the round identical. ``anchor`` and
    ``residual`` are flat float32 vectors of the tensors' total size.
    """
    with torch.no_grad():
        change = flatten(tensors).sub_(anchor)
        mean_of_changes(change, residual, groups, ranks, precision, share, incarnations, tag)
        unflatten(change.add_(anchor), tensors)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 vector of ``tensors``, on the first one's device (a copy)."""
    device = tensors[0].device
    return torch.cat([t.detach().reshape(-1).to(device, torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy :func:`flatten`'s vector back into ``tensors``, in place."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def for_worker(ctx: Joined, timeout: float) -> GroupCache:
    """A joined worker's communicators, with the emulated all-reduce time when links are
    emulated; a ``timeout`` other than ``run.timeout`` gets its own store connection."""
    client = connect_store(timeout) if timeout != ctx.settings.run.timeout else ctx.client
    cluster = ctx.plan.cluster
    return GroupCache(dist.PrefixStore(store.PG_PREFIX, client), ctx.where.rank, ctx.backend,
                      timeout, delay=cluster.allreduce_s if cluster.links_emulated else None,
                      traffic=Traffic(lambda ranks: cluster.slowest_link(ranks).kind))
