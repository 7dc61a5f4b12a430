"""Group weight averaging with real processes: symmetric, weight-preserving, and trained end to end."""

from __future__ import annotations

import datetime
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sdpipe_cli.config.run_file import load_run_config
from sdpipe_cli.core.meetings import INT8_CHUNK
from sdpipe_cli.model.models import build_stage_module
from sdpipe_cli.sync import quantized
from sdpipe_cli.sync.groups import GroupCache, average_changes, average_tensors
from tests.helpers import free_port, kill_leftovers, make_doc, metrics, sdpipe, write_profile

pytestmark = pytest.mark.multiprocess

WORLD = 4
ROUNDS = 12



def _run_ranks(target, world: int, timeout: float) -> dict:
    """Run ``target(rank, port, results)`` in ``world`` processes (forks of the session's fork
    server: torch imported once); fail if one hangs past ``timeout`` or exits non-zero."""
    ctx = mp.get_context("forkserver")
    results = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, f"{target.__name__}: {len(hung)} process(es) hung"
    assert [p.exitcode for p in procs] == [0] * world
    return results


def _random_groups(seed: int) -> list[list[list[int]]]:
    """The same random partitions into groups on every rank (like the scheduler's decisions)."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(ROUNDS):
        ranks = list(range(WORLD))
        rng.shuffle(ranks)
        cuts = sorted(rng.sample(range(1, WORLD), rng.randint(0, WORLD - 1)))
        edges = [0, *cuts, WORLD]
        rounds.append([sorted(ranks[a:b]) for a, b in zip(edges, edges[1:])])
    return rounds


def _averaging_worker(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(100 + rank)
    module = torch.nn.Linear(5, 3)
    groups = GroupCache(dist.PrefixStore("pg/", store), rank, "gloo", 60)
    log, distances = [], []
    for round_groups in _random_groups(7):
        group = next(g for g in round_groups if rank in g)
        distance = 0.0
        if len(group) > 1:
            params = list(module.parameters())
            distance = average_tensors(params, groups, group, consensus=len(params))
        flat = torch.nn.utils.parameters_to_vector(module.parameters()).detach()
        gathered = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        log.append(torch.stack(gathered))
        distances.append(distance)
    results[rank] = torch.stack(log)
    results[f"distance{rank}"] = distances
    dist.destroy_process_group()


def test_group_averaging_is_symmetric_and_preserves_the_mean():
    """Members of a group end equal; the mean over all replicas never moves (W_k doubly stochastic);
    the consensus distance each member gets is the group's, computed from the states before."""
    results = _run_ranks(_averaging_worker, WORLD, timeout=120)
    history = results[0]  # rounds x WORLD x params, as seen by rank 0
    initial = []
    for r in range(WORLD):
        torch.manual_seed(100 + r)
        initial.append(torch.nn.utils.parameters_to_vector(torch.nn.Linear(5, 3).parameters()))
    mean0 = torch.stack(initial).detach().mean(0)
    before = torch.stack(initial).detach()
    for k, round_groups in enumerate(_random_groups(7)):
        state = history[k]
        torch.testing.assert_close(state.mean(0), mean0, rtol=0, atol=1e-6)
        for group in round_groups:
            for member in group[1:]:
                assert torch.equal(state[member], state[group[0]])
            if len(group) > 1:
                w = before[group]
                expected = ((w - w.mean(0)).pow(2).sum(1).mean().sqrt() / w.mean(0).norm()).item()
                for member in group:
                    assert results[f"distance{member}"][k] == pytest.approx(expected, rel=1e-4)
        before = state


SHARES = {"weights": [0.5, 0.5, 0.0], "grads": [0.25, 0.25, 0.5]}  # of ranks 0, 1, 2


def _shares_worker(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
    groups = GroupCache(dist.PrefixStore("pg/", store), rank, "gloo", 30)
    weights, grads, state = (torch.full((4,), float(10 ** i * (rank + 1))) for i in range(3))
    average_tensors([weights, grads, state], groups, [0, 1, 2],
                    shares=[(1, SHARES["weights"][rank]), (1, SHARES["grads"][rank])])
    results[rank] = (weights.clone(), grads.clone(), state.clone())


def test_shares_weigh_each_member_and_the_rest_is_the_plain_mean():
    """``sync.stale``: a stale member (rank 2) counts 0 in the weights' mean; any shares that
    sum to 1 weigh the gradients; tensors after the shared runs take the plain mean."""
    results = _run_ranks(_shares_worker, 3, timeout=60)
    w = sum(s * (r + 1) for r, s in enumerate(SHARES["weights"]))
    g = sum(s * 10 * (r + 1) for r, s in enumerate(SHARES["grads"]))
    for rank in range(3):
        weights, grads, state = results[rank]
        torch.testing.assert_close(weights, torch.full((4,), w))
        torch.testing.assert_close(grads, torch.full((4,), g))
        torch.testing.assert_close(state, torch.full((4,), 200.0))


def _changes_worker(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
    groups = GroupCache(dist.PrefixStore("pg/", store), rank, "gloo", 30)
    torch.manual_seed(0)
    anchor = torch.randn(1000)  # the same on every rank, as after a global sync
    torch.manual_seed(1 + rank)
    weights = anchor + torch.randn(1000) * 1e-3 * (rank + 1)
    change = weights - anchor  # as the member sees it, to float32's last bit
    residual = torch.zeros(1000)
    average_changes([weights], anchor, residual, groups, [0, 1, 2], "bf16")
    sent_before = groups.traffic.summary()["same_node"]["sent_bytes"]
    results[rank] = (change, weights.clone(), residual.clone(), sent_before)
    # the pulled member (share 0) takes the group's state and keeps nothing of its own change
    shares = [0.5, 0.5, 0.0]
    w2 = anchor + change
    r2 = torch.ones(1000) if rank == 2 else torch.zeros(1000)  # pulled: its residual is dropped
    average_changes([w2], anchor, r2, groups, [0, 1, 2], "bf16", share=shares[rank])
    results[f"pulled{rank}"] = (w2.clone(), r2.clone())


def test_bf16_changes_average_around_the_anchor_and_keep_what_rounding_lost():
    """``sync.precision=bf16``: every member ends with anchor + the mean change to within
    bfloat16's rounding of the changes (not of the weights), all alike; what rounding took from
    a member's change is its residual, so change = what it sent + residual exactly; and the
    all-reduce moved 2 bytes a value (2(k-1)/k of them, a ring)."""
    results = _run_ranks(_changes_worker, 3, timeout=60)
    changes = torch.stack([results[r][0] for r in range(3)])
    torch.manual_seed(0)
    anchor = torch.randn(1000)
    expected = anchor + changes.mean(0)
    for r in range(3):
        _, weights, residual, sent = results[r]
        assert torch.equal(weights, results[0][1])
        error = (weights - expected).abs().max().item()
        assert error < changes.abs().max().item() * 2 ** -7
        # the weights themselves in bfloat16 would have been off by far more
        assert error < (expected - expected.to(torch.bfloat16).float()).abs().max().item() / 10
        assert residual.abs().max().item() <= changes[r].abs().max().item() * 2 ** -8
        assert 0 < residual.abs().max().item()
        sent_values = (changes[r] - residual).to(torch.bfloat16).float()
        torch.testing.assert_close(sent_values + residual, changes[r], rtol=0, atol=1e-9)
        assert sent == int(2 * 2 / 3 * 1000 * 2)  # float32 would be twice that
    w = (changes[0] + changes[1]) / 2 + anchor
    for r in range(3):
        w2, r2 = results[f"pulled{r}"]
        torch.testing.assert_close(w2, w, rtol=0, atol=changes.abs().max().item() * 2 ** -7)
        assert (r2 == 0).all() if r == 2 else r2.abs().max() <= changes[r].abs().max() * 2 ** -8


INT8_N = 3000  # values of the stage: 12 chunks of 256 once padded, 4 a member's shard


def _int8_changes(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor every member shares, and member ``rank``'s change: chunks of magnitudes 1e-3
    down to 1e-6 (each keeps its own scale), larger for higher ranks."""
    torch.manual_seed(0)
    anchor = torch.randn(INT8_N)
    torch.manual_seed(1 + rank)
    magnitude = 10.0 ** -(3 + torch.arange(INT8_N) // INT8_CHUNK % 4)
    return anchor, torch.randn(INT8_N) * magnitude * (rank + 1)


def _int8_worker(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
    groups = GroupCache(dist.PrefixStore("pg/", store), rank, "gloo", 30)
    anchor, change = _int8_changes(rank)
    weights = anchor + change
    change = weights - anchor  # as the member sees it, to float32's last bit
    residual = torch.zeros(INT8_N)
    average_changes([weights], anchor, residual, groups, [0, 1, 2], "int8")
    results[rank] = (change, weights.clone(), residual.clone(), groups.traffic.summary())
    w2, r2 = anchor + change, torch.ones(INT8_N) if rank == 2 else torch.zeros(INT8_N)
    average_changes([w2], anchor, r2, groups, [0, 1, 2], "int8", share=[0.5, 0.5, 0.0][rank])
    results[f"pulled{rank}"] = (w2.clone(), r2.clone())


def _half_steps(x: torch.Tensor) -> torch.Tensor:
    """Per value, half the int8 step of its chunk (its chunk's largest magnitude / 127)."""
    padded = torch.cat([x, x.new_zeros(-x.numel() % INT8_CHUNK)]).reshape(-1, INT8_CHUNK)
    steps = padded.abs().amax(dim=1, keepdim=True).expand_as(padded) / 127
    return steps.reshape(-1)[:x.numel()] / 2 * (1 + 1e-4)


def test_int8_changes_meet_the_float_mean_within_the_rounding_and_agree_to_the_bit():
    """``sync.precision=int8`` over 3 real processes: every member ends with the same weights,
    bit for bit; what a member sent is its change less its residual, off by at most half its
    chunk's step; the group's mean of what was sent is rounded once more (each shard's sum) and
    stays within half a step of that sum; so the weights are the anchor plus the float mean of
    the true changes within those bounds. On the wire: int8 codes and a float32 scale per 256
    values, 2(k-1)/k of them per member, a little over half of bfloat16's ring."""
    results = _run_ranks(_int8_worker, 3, timeout=60)
    anchor, _ = _int8_changes(0)
    changes = torch.stack([results[r][0] for r in range(3)])
    residuals = torch.stack([results[r][2] for r in range(3)])
    sent = changes - residuals
    summed = sent.sum(0)
    mean = results[0][1] - anchor
    arithmetic = anchor.abs().max().item() * 2 ** -23  # anchor + mean, rounded to float32
    for r in range(3):
        assert torch.equal(results[r][1], results[0][1])
        assert bool((residuals[r].abs() <= _half_steps(changes[r])).all())
    assert residuals.abs().max() > 0
    assert bool(((mean - summed / 3).abs() <= _half_steps(summed) / 3 + arithmetic).all())
    bound = (sum(_half_steps(c) for c in changes) + _half_steps(summed)) / 3 + arithmetic
    assert bool(((mean - changes.mean(0)).abs() <= bound).all())
    # the small chunks keep their own step: off by far less than one scale for all would allow
    small = slice(3 * INT8_CHUNK, 4 * INT8_CHUNK)  # the magnitudes 1e-6
    assert (mean - changes.mean(0))[small].abs().max() < changes.abs().max() / 127 / 2 / 100
    payload = quantized.padded(INT8_N, 3) * (1 + 4 / INT8_CHUNK)  # codes and scales
    for r in range(3):
        assert results[r][3]["same_node"]["sent_bytes"] == int(2 * 2 / 3 * payload)  # two phases
        assert results[r][3]["same_node"]["calls"] == 2
    assert int(2 * 2 / 3 * payload) < 0.55 * (2 * 2 / 3 * INT8_N * 2)  # bfloat16's ring
    # a pulled member (share 0) takes the group's weighted mean and drops its own change
    pulled = [results[f"pulled{r}"] for r in range(3)]
    assert all(torch.equal(w, pulled[0][0]) for w, _ in pulled)
    assert bool((pulled[2][1] == 0).all())
    half = (changes[0] + changes[1]) / 2
    bound = (_half_steps(changes[0]) + _half_steps(changes[1]) + _half_steps(half * 2)) / 2
    assert bool(((pulled[0][0] - anchor - half).abs() <= bound + arithmetic).all())


def _retag_worker(rank: int, port: int, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=20))
    groups = GroupCache(dist.PrefixStore("pg/", store), rank, "gloo", 20)
    t = torch.tensor([float(rank + 1)])
    groups.all_reduce(t, [0, 1], tag="r1")
    got = [t.item()]
    groups.forget([0, 1])  # the round failed somewhere: both drop the communicator
    store.add("forgot", 1)
    while store.add("forgot", 0) < 2:
        time.sleep(0.01)
    if rank == 1:
        time.sleep(0.5)  # rank 0 makes the new one first, rank 1's old address still in the store
    t = torch.tensor([float(10 * (rank + 1))])
    groups.all_reduce(t, [0, 1], tag="r7")
    results[rank] = got + [t.item()]


def test_a_forgotten_group_is_made_again_under_its_new_tag_whoever_comes_first():
    """A communicator that failed is made again under a new rendezvous name (the round's tag): a
    member that makes it before its peer waits for the peer's new address rather than connecting
    to the one the dead communicator left in the store."""
    results = _run_ranks(_retag_worker, 2, timeout=60)
    assert dict(results) == {0: [3.0, 30.0], 1: [3.0, 30.0]}


def _fresh_stages(run_dir) -> dict[int, torch.nn.Module]:
    cfg = load_run_config(run_dir / "config.yaml")
    return {s: build_stage_module(cfg, s) for s in range(cfg.pipeline.stages)}


@pytest.mark.parametrize("meetings, per_block", [((), False),
                                                 (("sync.every=2", "sync.precision=bf16"), False),
                                                 ((), True)])
def test_lr_zero_changes_nothing_anywhere(run_dir, tmp_path, meetings, per_block):
    """With lr = 0 only averaging acts, and averaging equal replicas must give them back
    (up to float32 rounding of the sum: 3x/3 need not be x to the last bit). With bf16 changes
    every 2 steps, the changes are zero and each member adds their mean to its anchor: an
    anchor that differed between replicas would move every one of them. ``per_block``: a run
    that may re-plan in place averages each block as a unit of its own."""
    extra = ()
    if per_block:
        doc = make_doc({"local:0": (1.0, [3.0] * 6)}, model="mlp", microbatch=2)
        extra = ("fault.on_slowdown=replan", f"profile={write_profile(tmp_path, doc)}",
                 "sync.global_every=3")  # group rounds between the global syncs
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "train.lr=0", "train.steps=10",
                 "model=mlp", "data=synthetic", "train.batch_size=8", "cluster.pipelines=3",
                 "run.save_final=true", *meetings, *extra)
    assert out.returncode == 0, out.stderr
    fresh = _fresh_stages(run_dir)
    sizes = {g["size"] for g in metrics(run_dir, "group")}
    assert 3 in sizes  # the final global sync, at least
    if per_block:  # a round per block (segments 0-5)
        assert {g["stage"] for g in metrics(run_dir, "group")} == set(range(6))
    files = sorted((run_dir / "final").glob("*.pt"))
    assert len(files) == 6
    for path in files:
        stage = int(path.stem.split("-s")[1])
        saved = torch.load(path, weights_only=True)
        for name, value in fresh[stage].state_dict().items():
            torch.testing.assert_close(saved[name], value, rtol=1e-6, atol=1e-7)


def _final_val(run_dir) -> float:
    evals = metrics(run_dir, "eval")
    last = {}
    for e in evals:
        last[e["pipeline"]] = e["val_loss"]
    return sum(last.values()) / len(last)


def _losses(run_dir) -> dict[tuple[int, int], float]:
    return {(m["pipeline"], m["step"]): m["loss"] for m in metrics(run_dir, "train")}


P4S2 = ("model=mlp", "data=synthetic", "cluster.pipelines=4", "pipeline.stages=2",
        "train.steps=20", "train.batch_size=8", "train.eval_every=0")


@pytest.fixture(scope="module")
def allreduce_4x2_run(tmp_path_factory):
    """The reference: gradient all-reduce on P = 4, S = 2, AdamW, default clipping (shared by
    three tests)."""
    run_dir = tmp_path_factory.mktemp("allreduce") / "run"
    out = sdpipe("train", f"run.dir={run_dir}", "sync=allreduce", *P4S2)
    assert out.returncode == 0, out.stderr
    return run_dir


def _learns_like_allreduce_and_ends_identical(run_dir, allreduce_4x2_run,
                                              within: float = 1.1) -> None:
    """P4S2: the loss falls as all-reduce's does (final val within ``within``x), the budget is
    exact (4 x 20 pipeline-iterations) and the final global sync leaves every replica of a stage
    identical."""
    first = [m["loss"] for m in metrics(run_dir, "train") if m["step"] == 1]
    val = {"sdpipe": _final_val(run_dir), "allreduce": _final_val(allreduce_4x2_run)}
    assert val["sdpipe"] < min(first) - 1.0
    assert val["sdpipe"] < val["allreduce"] * within, val
    done = metrics(run_dir, "done")
    for stage in (0, 1):
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 4 * 20


def test_full_groups_reproduce_allreduce(allreduce_4x2_run, tmp_path):
    """sync.average=weights_grads with a full group every round (connect_every=1) takes exactly
    all-reduce's steps, AdamW and clipping included: the same loss at every step, and the
    replicas never drift (consensus 0 at every global sync). They start alike and stay alike, so
    every group round (not the global syncs) averages the gradients only, as all-reduce does."""
    run_dir = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "sync.connect_every=1",
                 "sync.global_every=5", *P4S2)
    assert out.returncode == 0, out.stderr
    ours, reference = _losses(run_dir), _losses(allreduce_4x2_run)
    assert ours.keys() == reference.keys() and len(ours) == 4 * 20
    worst = max(abs(ours[k] - reference[k]) for k in ours)
    assert worst < 1e-4, worst
    consensus = metrics(run_dir, "consensus")
    assert {c["stage"] for c in consensus} == {0, 1}
    assert all(c["consensus"] < 1e-6 for c in consensus), consensus
    groups = metrics(run_dir, "group")
    assert all(g["twins"] == (g["group"] == "group") for g in groups), groups


def test_weight_averaging_after_sgd_steps_is_allreduce(tmp_path):
    """The paper's rule (sync.average=weights) is exact for SGD with momentum: its update is
    linear in the gradient. (Clipping each replica's gradient is not linear: off here; so is
    the late merge, sync.overlap, which averages what the replicas held a step before.)"""
    common = ("model=mlp", "data=synthetic", "cluster.pipelines=2", "pipeline.stages=2",
              "train.steps=20", "train.batch_size=8", "train.eval_every=0",
              "train.optimizer=sgd", "train.lr=0.1", "train.grad_clip=0")
    runs = {}
    for name, extra in (("allreduce", ("sync=allreduce",)),
                        ("weights", ("sync=sdpipe", "sync.average=weights",
                                     "sync.connect_every=1", "sync.overlap=0"))):
        runs[name] = tmp_path / name
        out = sdpipe("train", f"run.dir={runs[name]}", *common, *extra)
        assert out.returncode == 0, out.stderr
    ours, reference = _losses(runs["weights"]), _losses(runs["allreduce"])
    assert ours.keys() == reference.keys() and len(ours) == 2 * 20
    assert max(abs(ours[k] - reference[k]) for k in ours) < 1e-4
    assert reference[(0, 20)] < reference[(0, 1)] - 1.0  # and SGD did train


def test_four_pipelines_two_stages_converge_like_allreduce(allreduce_4x2_run, tmp_path):
    """P = 4, S = 2, default (partial) groups: sdpipe's loss falls as all-reduce's does, the
    consensus distance is measured at global syncs, and the global sync at the end leaves every
    replica of a stage identical."""
    run_dir = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "sync.global_every=10", *P4S2)
    assert out.returncode == 0, out.stderr
    _learns_like_allreduce_and_ends_identical(run_dir, allreduce_4x2_run)
    sizes = [g["size"] for g in metrics(run_dir, "group")]
    assert sizes and max(sizes) == 4
    consensus = metrics(run_dir, "consensus")
    globals_ = [g for g in metrics(run_dir, "group") if g["group"] == "global"]
    assert len(consensus) == len(globals_) >= 2
    assert all(0 <= c["consensus"] < 0.5 for c in consensus)


@pytest.fixture(scope="module")
def meetings_4x2_run(tmp_path_factory):
    """P4S2 meeting after every 4th step in bf16, a global sync and a checkpoint every 8 steps
    (sync.wire_share=0.5 lets global syncs come that often): one run for the two tests below,
    read-only (the resume works on a copy)."""
    run_dir = tmp_path_factory.mktemp("meetings") / "run"
    out = sdpipe("train", f"run.dir={run_dir}", "sync=sdpipe", "sync.every=4",
                 "sync.precision=bf16", "sync.global_every=8", "sync.wire_share=0.5",
                 "sync.overlap=0", "checkpoint.every=8", *P4S2)
    leftovers = kill_leftovers(run_dir)
    assert out.returncode == 0, out.stderr
    assert not leftovers, f"orphan processes left by the run: {leftovers}"
    return run_dir


def test_meetings_every_four_steps_in_bf16_train_and_leave_the_replicas_identical(
        allreduce_4x2_run, meetings_4x2_run):
    """sync.every=4, sync.precision=bf16: replicas meet after every 4th step only (the run's
    last blocks are cut to end together, core/blocks.py), a group round sends 2 bytes a value
    and a global sync 4 (exact), the loss falls about as all-reduce's, the budget is exact, and
    the final global sync leaves every replica of a stage identical. (That the anchor is alike
    on every member: the lr = 0 test above.)"""
    run_dir = meetings_4x2_run
    groups = metrics(run_dir, "group")
    assert groups and all(g["every"] == 4 for g in groups)
    met = [m for m in metrics(run_dir, "train") if "group_size" in m]
    _meet_every(4, met, start={p: 0 for p in range(4)})
    done = metrics(run_dir, "done")
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 4 * 20
    # the lines are the last stage's: a member sent 2(k-1)/k of the payload (a ring)
    values = sum(p.numel() for p in _fresh_stages(run_dir)[1].parameters())
    per_value = {}
    for m in met:
        k = m["group_size"]
        if k > 1:
            per_value.setdefault(m["group_kind"], set()).add(
                round(m["sent_bytes"] / (2 * (k - 1) / k) / values, 2))
    assert per_value == {"group": {2.0}, "global": {4.0}}, per_value
    # 5 meetings in 20 steps: on a loaded machine (the suite's two workers at once) its groups
    # shrink, and its final val loss moves more than every step's would (3.72 to 3.83 two runs
    # at a time, once 4.41 in the suite: 1.125x all-reduce's 3.92)
    _learns_like_allreduce_and_ends_identical(run_dir, allreduce_4x2_run, within=1.2)


def _meet_every(every: int, met: list[dict], start: dict[int, int]) -> None:
    """Each pipeline's first meeting falls on the first multiple of ``every`` after where it
    started (``start``, per pipeline): its first block is the period's. (Later blocks are the
    period's until the run's end nears, where they are cut to end together and share out the
    budget, core/blocks.py: how early that comes depends on how far the pipelines' paces drift
    apart, which a loaded machine decides; tests/unit/test_wire.py checks the rule itself.)
    ``met``: the step lines with a round."""
    for p, begin in start.items():
        steps = sorted({m["step"] for m in met if m["pipeline"] == p})
        assert steps and steps[0] == (begin // every + 1) * every, (p, steps)


def test_meetings_checkpoint_at_global_syncs_and_resume_to_the_exact_budget(meetings_4x2_run,
                                                                           tmp_path):
    """sync.every=4: checkpoints fall on global syncs, which fall on meetings; the run ends on
    its exact budget; a resume from the first, with a larger budget, converts them back to
    meetings for the scheduler, meets again after every 4th step and ends on the exact new
    budget, every replica of a stage identical. (How many global
    syncs a run holds depends on how far its pipelines drift apart: under load, only the one
    at its end; the first checkpoint and a larger budget work for every timing.)"""
    import shutil

    run = meetings_4x2_run
    saved = metrics(run, "checkpoint")
    assert saved and sum(d["steps"] for d in metrics(run, "done") if d["stage"] == 0) == 4 * 20
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    on_disk = [copy / "checkpoints" / f"step_{m['step']}" for m in saved]
    on_disk = [folder for folder in on_disk if folder.is_dir()]  # checkpoint.keep pruned the rest
    for folder in on_disk[1:]:  # as if killed after the first
        shutil.rmtree(folder)
    again = sdpipe("resume", str(copy), "train.steps=28")
    assert again.returncode == 0, again.stderr[-3000:]
    lines = metrics(copy)
    resumed_at = max(i for i, m in enumerate(lines) if m["kind"] == "resume")
    met = [m for m in lines[resumed_at:] if m["kind"] == "train" and "group_size" in m]
    _meet_every(4, met, start={int(p): k for p, k in saved[0]["steps"].items()})
    done = [m for m in lines[resumed_at:] if m["kind"] == "done"]
    for stage in (0, 1):
        assert len({d["param_digest"] for d in done if d["stage"] == stage}) == 1
    assert sum(d["steps"] for d in done if d["stage"] == 0) == 4 * 28
