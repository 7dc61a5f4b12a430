"""Where sdpipe's loss per sample goes: a recorded run's group decisions replayed in one process.

A sdpipe run with a straggler ends a few per cent above all-reduce's loss at equal samples. Four
things could cost it: the straggler's stale *weights* pulling its groups back when it joins, its
stale *gradients* (computed at weights several updates old), the *pattern* (groups of 2-3 instead
of P, so more, noisier steps, and replicas that drift apart between global syncs), and chance.
Live runs cannot separate them: each run's groups follow its own timing. This script takes the
recorded decisions of one run (every round's members, their iterations, the run's progress; see
``sync.replay``) and replays them in one process, with no timing at all: P replicas of every
stage, the run's model, data order, optimizer, learning-rate schedule and clipping, each round
applied when its members' gradients exist. Then it changes one thing at a time:

==============  ===============================================================================
``recorded``    the decisions as recorded, the run's rule (``sync.average``, ``sync.stale``)
``allreduce``   every pipeline in every round, at ``train.steps`` iterations each: all-reduce
``average``     every member counts the same (``sync.stale=average``, the paper's mean)
``pull_weights`` stale members (the scheduler's view, :mod:`sdpipe_cli.core.grouping.freshness`)
                take the group's weights without pushing theirs; their gradients count
``pull``        stale members count in neither average: they take the group's weights and step
``fresh``       (oracle) the straggler computes every gradient at the freshest replica's weights:
                no stale weights, no stale gradients, the same samples and groups
``drop``        (oracle) the straggler's samples are dropped: it takes the group's weights and
                gives nothing, and takes no step of its own
``own-lr``      each replica's learning rate from its own iteration, not the run's progress
``no-global``   global syncs average weights and gradients only (not the optimizer state)
``paper``       the paper's rule on the same groups: local step, then the group averages weights
==============  ===============================================================================

and prints each one's validation loss over the recorded run's final one and over ``allreduce``'s.
``recorded`` must come close to the live run's own loss (same decisions; the tied embedding is
averaged with the first stage's group here, and float sums differ): that is the check that the
replay is the run. The straggler is the pipeline with the largest ``cluster.slowdown``
(``--straggler`` to name another).

A replay is exact, so its figures carry no timing noise, but training is chaotic: a small change
early moves the final loss by a few per cent either way. So a rule is judged over many replays:
``--seeds`` replays each recorded pattern of groups with other model and data seeds (the initial
weights and the data order; the groups stay the recorded ones), and the table gives each
variant's mean ratio to all-reduce's loss at the same seed, with its standard deviation.

    python scripts/gap_decomposition.py RUN_DIR [RUN_DIR ...] [--variants recorded,allreduce,...]
        [--seeds 0,1,2] [--markdown PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402

from sdpipe_cli import analysis  # noqa: E402
from sdpipe_cli.config.run_file import load_run_config  # noqa: E402
from sdpipe_cli.core.grouping import Freshness  # noqa: E402
from sdpipe_cli.core.partition import stage_ranges  # noqa: E402
from sdpipe_cli.data import sources  # noqa: E402
from sdpipe_cli.data.feed import Feed  # noqa: E402
from sdpipe_cli.model import models, optim  # noqa: E402

VARIANTS = ("recorded", "allreduce", "average", "pull_weights", "pull", "fresh", "drop", "own-lr",
            "no-global", "paper")


@dataclass
class Round:
    stage: int
    number: int
    kind: str
    members: list[int]
    iterations: list[int]
    done: int
    twins: bool
    weight_shares: tuple[float, ...] = ()
    grad_shares: tuple[float, ...] = ()


def recorded_rounds(run: Path) -> list[Round]:
    lines = analysis.read_metrics(run / "metrics.jsonl")
    rounds = [Round(int(m["stage"]), int(m["round"]), m["group"], [int(p) for p in m["members"]],
                    [int(k) for k in m["iterations"]], int(m["done"]), bool(m.get("twins")),
                    tuple(m.get("weight_shares", ())), tuple(m.get("grad_shares", ())))
              for m in analysis.of_kind(lines, "group")]
    return sorted(rounds, key=lambda r: (r.stage, r.number))


def allreduce_rounds(pipelines: int, stages: int, steps: int) -> list[Round]:
    """Every pipeline in every round: gradient all-reduce (the replicas start and stay equal)."""
    everyone = list(range(pipelines))
    return [Round(s, k + 1, "group", everyone, [k] * pipelines, pipelines * (k + 1), True)
            for s in range(stages) for k in range(steps)]


class Replay:
    """P replicas of every stage of one model, in one process, driven by a list of rounds."""

    def __init__(self, cfg, variant: str, straggler: int):
        self.cfg, self.variant, self.straggler = cfg, variant, straggler
        self.P, self.S = int(cfg.cluster.pipelines), int(cfg.pipeline.stages)
        self.M = int(cfg.pipeline.microbatches)
        self.rule = "weights" if variant == "paper" else cfg.sync.average
        self.loss_fn = models.loss_function(cfg.model)
        self.models, self.params, self.opts = [], [], []  # [p] model, [p][s] params, [p][s] optim
        for _ in range(self.P):
            torch.manual_seed(cfg.train.seed)  # every replica starts equal, as in the run
            blocks, _names = models.build(cfg.model)
            model = torch.nn.Sequential(*blocks)
            seen: set[int] = set()
            per_stage = []
            for start, stop in stage_ranges(list(cfg.pipeline.partition), len(blocks)):
                own = []
                for block in blocks[start:stop]:
                    for p in block.parameters():
                        if id(p) not in seen:  # a tied weight goes with the first stage holding it
                            seen.add(id(p))
                            own.append(p)
                per_stage.append(own)
            self.models.append(model)
            self.params.append(per_stage)
            self.opts.append([optim.build_optimizer(ps, cfg.train) for ps in per_stage])
        self.feeds = [Feed(cfg, p, self.P) for p in range(self.P)]
        self.last_done = [[0] * self.S for _ in range(self.P)]
        rule = variant if variant in ("average", "pull_weights", "pull") else "average"
        self.freshness = Freshness(self.P, self.S, rule)
        self.steps_taken = [0] * self.P
        self.samples = [0] * self.P

    # -- one pipeline's iteration --------------------------------------------------------------
    def gradient(self, p: int, k: int) -> None:
        if self.variant == "fresh" and p == self.straggler:
            front = max((q for q in range(self.P) if q != p), key=lambda q: self.steps_taken[q])
            with torch.no_grad():
                for a, b in zip(self.models[p].parameters(), self.models[front].parameters()):
                    a.copy_(b)
        model = self.models[p]
        model.zero_grad(set_to_none=False)
        for p_ in model.parameters():
            if p_.grad is None:
                p_.grad = torch.zeros_like(p_)
        batch = self.feeds[p].batch(k)
        for x, y in zip(batch.inputs.chunk(self.M), batch.targets.chunk(self.M)):
            (self.loss_fn(model(x), y) / self.M).backward()
        self.samples[p] += int(batch.inputs.shape[0])

    def step(self, p: int, k: int, dones: list[int]) -> None:
        params = list(self.models[p].parameters())
        norm = optim.clip_gradients(params, self.cfg.train.grad_clip or float("inf"))
        if not math.isfinite(norm):
            raise FloatingPointError(f"pipeline {p} iteration {k}: the gradient norm is {norm}")
        if self.variant == "drop" and p == self.straggler:
            return
        for s in range(self.S):
            if self.variant == "own-lr":
                position = float(k)
            else:
                position = dones[s] / self.P - (1.0 if self.rule == "weights_grads" else 0.0)
            optim.set_lr(self.opts[p][s], optim.lr_at(position, self.cfg.train))
            self.opts[p][s].step()
        self.steps_taken[p] += 1

    # -- one round -----------------------------------------------------------------------------
    def average(self, r: Round, grads: bool) -> None:
        s, members = r.stage, r.members
        if len(members) > 1:
            self._mix(r, grads)
        for q in members:
            self.last_done[q][s] = r.done
        self.freshness.note(s, members, r.done)

    def _mix(self, r: Round, grads: bool) -> None:
        s, members = r.stage, r.members
        weight_w = {q: 1.0 for q in members}
        weight_g = {q: 1.0 for q in members}
        if self.variant == "recorded" and r.weight_shares:
            weight_w = dict(zip(members, r.weight_shares))
            weight_g = dict(zip(members, r.grad_shares))
        elif self.variant in ("average", "pull_weights", "pull") and not r.twins:
            shares = self.freshness.shares(s, members, r.done)
            if shares[0]:
                weight_w, weight_g = dict(zip(members, shares[0])), dict(zip(members, shares[1]))
        if (self.variant in ("drop", "fresh") and self.straggler in members
                and any(q != self.straggler for q in members)):
            weight_w[self.straggler] = 0.0
            if self.variant == "drop":
                weight_g[self.straggler] = 0.0
        with torch.no_grad():
            for i in range(len(self.params[members[0]][s])):
                tensors = [self.params[q][s][i] for q in members]
                if not (r.twins and grads):
                    mean = _weighted([t.data for t in tensors], [weight_w[q] for q in members])
                    for t in tensors:
                        t.data.copy_(mean)
                if grads:
                    mean = _weighted([t.grad for t in tensors], [weight_g[q] for q in members])
                    for t in tensors:
                        t.grad.copy_(mean)
                if r.kind == "global" and self.variant != "no-global":
                    states = [self.opts[q][s].state[t] for q, t in zip(members, tensors)]
                    for key in states[0]:
                        if torch.is_tensor(states[0][key]):
                            mean = torch.stack([st[key] for st in states]).float().mean(0)
                            for st in states:
                                st[key].copy_(mean.to(st[key].dtype))

    def run(self, rounds: list[Round]) -> None:
        """Apply every round once its members' gradients (weights_grads) or steps (weights) of
        the round's iteration exist; a pipeline's next iteration begins once every stage's round
        of its last one was applied."""
        queue = {s: [r for r in rounds if r.stage == s] for s in range(self.S)}
        at = {s: 0 for s in range(self.S)}
        next_iteration = [0] * self.P  # the iteration each pipeline computes next
        ready: dict[int, int] = {}  # pipeline -> iteration whose gradient (and step) exists
        applied: dict[tuple[int, int], dict[int, int]] = {}  # (p, k) -> {stage: done}
        total = sum(len(q) for q in queue.values())
        while sum(at.values()) < total:
            moved = False
            for s in range(self.S):
                while at[s] < len(queue[s]):
                    r = queue[s][at[s]]
                    if not all(self._prepare(q, k, ready, next_iteration)
                               for q, k in zip(r.members, r.iterations)):
                        break
                    self.average(r, grads=self.rule == "weights_grads")
                    at[s] += 1
                    moved = True
                    for q, k in zip(r.members, r.iterations):
                        done = applied.setdefault((q, k), {})
                        done[s] = r.done
                        if len(done) == self.S:
                            if self.rule == "weights_grads":
                                self.step(q, k, [done[t] for t in range(self.S)])
                            next_iteration[q] = k + 1
                            ready.pop(q, None)
                            del applied[(q, k)]
            if not moved:
                raise RuntimeError(f"the recorded rounds cannot be ordered: stuck at {at}")

    def _prepare(self, q: int, k: int, ready: dict[int, int], next_iteration: list[int]) -> bool:
        if ready.get(q) == k:
            return True
        if next_iteration[q] != k or q in ready:
            return False
        self.gradient(q, k)
        if self.rule == "weights":  # the paper's rule: the local step before the round
            self.step(q, k, [self.last_done[q][s] for s in range(self.S)])
        ready[q] = k
        return True

    @torch.no_grad()
    def validation_loss(self) -> float:
        count = sources.val_count(self.cfg)
        losses = []
        for model in self.models:
            model.eval()
            values = [float(self.loss_fn(model(b.inputs), b.targets))
                      for b in self.feeds[0].validation(count)]
            losses.append(sum(values) / len(values))
        return sum(losses) / len(losses)

    def close(self) -> None:
        for feed in self.feeds:
            feed.close()


def _weighted(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = sum(weights)
    if total == 0:
        weights, total = [1.0] * len(tensors), float(len(tensors))
    if all(w == weights[0] for w in weights):
        return torch.stack(tensors).mean(0)
    return sum(w * t for w, t in zip(weights, tensors)) / total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="recorded sdpipe runs (run folders)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", default=None,
                        help="model and data seeds to replay each pattern with (default: the run's)")
    parser.add_argument("--straggler", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    _report.add_markdown_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    results = []
    allreduce: dict[tuple[int, int], float] = {}  # (seed, steps) -> its loss
    for run in args.runs:
        recorded_cfg = load_run_config(run / "config.yaml")
        slowdown = list(recorded_cfg.cluster.slowdown or [1.0] * int(recorded_cfg.cluster.pipelines))
        straggler = args.straggler if args.straggler is not None else max(
            range(len(slowdown)), key=lambda p: slowdown[p])
        rounds = recorded_rounds(run)
        seeds = ([int(x) for x in args.seeds.split(",")] if args.seeds
                 else [int(recorded_cfg.train.seed)])
        for seed in seeds:
            cfg = recorded_cfg.copy()
            cfg.train.seed = seed
            row = {"run": run.name, "seed": seed, "live": None}
            if seed == int(recorded_cfg.train.seed):
                row["live"] = analysis.final_val_loss(analysis.read_metrics(run / "metrics.jsonl"))
            for variant in variants:
                started = time.perf_counter()
                if variant == "allreduce" and (seed, int(cfg.train.steps)) in allreduce:
                    row[variant] = allreduce[(seed, int(cfg.train.steps))]  # no pattern in it
                    continue
                replay = Replay(cfg, variant, straggler)
                try:
                    replay.run(allreduce_rounds(replay.P, replay.S, int(cfg.train.steps))
                               if variant == "allreduce" else rounds)
                    row[variant] = replay.validation_loss()
                except FloatingPointError as err:
                    row[variant] = float("nan")
                    print(f"{run.name} seed {seed} {variant}: {err}", flush=True)
                finally:
                    replay.close()
                if variant == "allreduce":
                    allreduce[(seed, int(cfg.train.steps))] = row[variant]
                print(f"{run.name} seed {seed} {variant:12s} val {_report.loss(row[variant])}  samples "
                      f"{replay.samples}  {time.perf_counter() - started:.0f} s", flush=True)
            results.append(row)
    table = _table(results, variants)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        _report.write_markdown(args.markdown, table)
    return 0


def _table(results: list[dict], variants: list[str]) -> str:
    """Per variant: the mean loss, and the mean and sd of its ratio to all-reduce's at the same
    seed (the pattern's effect without the seed's)."""
    base = "allreduce" if "allreduce" in variants else None
    lines = [f"{len(results)} replays (pattern x seed)", "",
             "| variant | val loss (mean) | / all-reduce's, mean (sd) | worst | best |",
             "|---|---|---|---|---|"]
    for variant in ["live", *variants]:
        rows = [r for r in results if r.get(variant) is not None]
        if not rows:
            continue
        values = [r[variant] for r in rows]
        cells = ["", "", ""]
        if base:
            ratios = [r[variant] / r[base] for r in rows]
            sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
            cells = [f"{_report.ratio(statistics.mean(ratios), 3)} ({_report.num(sd, '.3f')})",
                     _report.ratio(max(ratios), 3), _report.ratio(min(ratios), 3)]
        lines.append(f"| {variant} | {_report.loss(statistics.mean(values))} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
