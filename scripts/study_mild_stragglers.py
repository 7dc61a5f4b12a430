"""What a mild straggler costs in loss per sample under each membership rule, in one process.

Four replicas of the default model (gpt_tiny on the stdlib corpus, AdamW, the default lr
schedule, batch 16 each); replicas 0-2 take one time unit an iteration, replica 3 (the
straggler) ``ratio`` units. Each rule decides who averages with whom, and when, as sdpipe's
group rounds do (weights and gradients averaged, then each member's own AdamW step); the run
stops at an equal budget of samples (4 x ``--steps`` replica-iterations), ends on the average of
the four, and reports its validation loss. No system effect: only who meets whom, and with what.

Rules:
  allreduce  lock-step, every replica every round: the reference (the straggler sets the pace,
             which costs time, not loss per sample)
  solo       what the policy does today: the fast three meet every round; the straggler meets
             them only when their round comes within ``reach`` x its iteration after it is
             ready (it waits that long, then goes on alone with its own gradient)
  deferred   the straggler never waits: when it is ready it leaves its weights and gradient for
             the fast ones' next round, goes on computing from the weights it has, and takes
             that round's result when it arrives (its next gradient is one round stale)
  deferred_grad  as deferred, but its weights do not count in the round's mean (they are a round
             behind the others'): only its gradient does

    python scripts/study_mild_stragglers.py --ratios 1.3 1.6 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._report import add_markdown_option, publish, rows_table  # noqa: E402
from sdpipe_cli.cli.commands import composed  # noqa: E402
from sdpipe_cli.data.corpus import load_corpus  # noqa: E402
from sdpipe_cli.model import models  # noqa: E402
from sdpipe_cli.model.optim import ADAMW_BETAS, lr_at  # noqa: E402

P, FAST, SLOW = 4, (0, 1, 2), 3
RULES = ("allreduce", "solo", "deferred", "deferred_grad")


class Replicas:
    """The four replicas, their optimizers and data streams, and what a round does to them."""

    def __init__(self, cfg, corpus, seed: int):
        torch.manual_seed(seed)
        first = torch.nn.Sequential(*models.build(cfg.model)[0])
        self.nets = [copy.deepcopy(first) for _ in range(P)]
        t = cfg.train
        self.train_cfg, self.batch, self.clip = t, int(t.batch_size), float(t.grad_clip)
        self.opts = [torch.optim.AdamW(n.parameters(), lr=t.lr, betas=ADAMW_BETAS,
                                       weight_decay=t.weight_decay) for n in self.nets]
        self.data, self.seq = corpus.train.long(), int(cfg.model.seq_len)
        self.gens = [torch.Generator().manual_seed(1000 * (seed + 1) + p) for p in range(P)]
        self.done = 0  # replica-iterations taken
        val = corpus.val.long()
        g = torch.Generator().manual_seed(123)
        ix = torch.randint(0, len(val) - self.seq - 1, (256,), generator=g)
        self.val = (torch.stack([val[i:i + self.seq] for i in ix]),
                    torch.stack([val[i + 1:i + self.seq + 1] for i in ix]))

    def gradient(self, p: int) -> list[torch.Tensor]:
        """Replica ``p``'s gradient on its next batch, at its weights now."""
        ix = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.gens[p])
        x = torch.stack([self.data[i:i + self.seq] for i in ix])
        y = torch.stack([self.data[i + 1:i + self.seq + 1] for i in ix])
        net = self.nets[p]
        net.zero_grad()
        models.cross_entropy(net(x), y).backward()
        return [q.grad.detach().clone() for q in net.parameters()]

    def weights(self, p: int) -> list[torch.Tensor]:
        return [q.detach().clone() for q in self.nets[p].parameters()]

    def step(self, p: int, weights: list[torch.Tensor] | None, grad: list[torch.Tensor]) -> None:
        """Replica ``p`` takes ``weights`` (None: keeps its own), then its AdamW step with
        ``grad``, clipped as training clips, at the run's global progress."""
        net, opt = self.nets[p], self.opts[p]
        with torch.no_grad():
            for q, w, g in zip(net.parameters(), weights or [None] * len(grad), grad):
                if w is not None:
                    q.copy_(w)
                q.grad = g.clone()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), self.clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(self.done / P, self.train_cfg)
        opt.step()

    def round(self, members: list[tuple[int, list, list]], takers: list[int],
              weighed: int | None = None) -> None:
        """``members`` (replica, weights, gradient) averaged (the weights of the first ``weighed``
        only; None: all); each of ``takers`` takes the mean weights and its step with the mean
        gradient."""
        mean_w = [torch.stack(ws).mean(0) for ws in zip(*(w for _, w, _ in members[:weighed]))]
        mean_g = [torch.stack(gs).mean(0) for gs in zip(*(g for _, _, g in members))]
        for p in takers:
            self.step(p, mean_w if len(members) > 1 else None, mean_g)

    def final_loss(self) -> float:
        """The validation loss of the four replicas' average (the run's last global sync)."""
        net = copy.deepcopy(self.nets[0])
        with torch.no_grad():
            for q, *qs in zip(net.parameters(), *(n.parameters() for n in self.nets)):
                q.copy_(torch.stack(qs).mean(0))
            x, y = self.val
            return float(models.cross_entropy(net(x), y))


def run(rule: str, ratio: float, reach: float, cfg, corpus, seed: int, steps: int) -> dict:
    reps, budget = Replicas(cfg, corpus, seed), P * steps
    met = rounds = 0
    if rule == "allreduce":
        while reps.done < budget:
            grads = [reps.gradient(p) for p in range(P)]
            reps.round([(p, reps.weights(p), grads[p]) for p in range(P)], list(range(P)))
            reps.done += P
        return {"loss": reps.final_loss(), "slow_share": 0.25, "met": 1.0}
    t_fast, t_slow = 1.0, ratio
    deposit = None  # deferred: the straggler's (weights, gradient) left for the next round
    deferring = rule.startswith("deferred")
    pending = reps.gradient(SLOW) if deferring else None  # its gradient in flight
    slow_done = 0
    while reps.done < budget:
        if t_slow <= t_fast:  # the straggler is ready first, or with the fast ones
            rounds += 1
            if deferring:
                deposit = (reps.weights(SLOW), pending)
                pending = reps.gradient(SLOW)  # its next iteration, from the weights it has
                t_slow += ratio
            elif t_fast - t_slow <= reach * ratio:  # it waits for the fast ones' round
                t_slow = t_fast + ratio
                grads = {p: reps.gradient(p) for p in (*FAST, SLOW)}
                reps.round([(p, reps.weights(p), grads[p]) for p in grads], list(grads))
                reps.done += P
                slow_done += 1
                met += 1
                t_fast += 1.0
                continue
            else:  # alone: its own step
                reps.step(SLOW, None, reps.gradient(SLOW))
                t_slow += ratio
            reps.done += 1
            slow_done += 1
            continue
        members = [(p, reps.weights(p), reps.gradient(p)) for p in FAST]
        takers, weighed = list(FAST), None
        if deposit is not None:
            members.append((SLOW, *deposit))
            takers.append(SLOW)
            weighed = len(FAST) if rule == "deferred_grad" else None
            deposit = None
            met += 1
        reps.round(members, takers, weighed)
        reps.done += len(FAST)
        t_fast += 1.0
    return {"loss": reps.final_loss(), "slow_share": slow_done / max(1, reps.done),
            "met": met / max(1, rounds)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.3, 1.6])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--steps", type=int, default=200, help="iterations of an average replica")
    ap.add_argument("--reach", type=float, default=0.25,
                    help="solo: how much of its iteration the straggler waits for the others")
    ap.add_argument("--json", type=Path)
    add_markdown_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = composed([f"train.steps={args.steps}"], False)
    corpus = load_corpus(cfg.data, 0)
    results, began = [], time.time()
    for ratio in args.ratios:
        for seed in args.seeds:
            for rule in args.rules:
                if rule == "allreduce" and any(r["rule"] == rule and r["seed"] == seed
                                               for r in results):
                    continue  # the straggler does not change lock-step's arithmetic
                out = run(rule, ratio, args.reach, cfg, corpus, seed, args.steps)
                results.append({"rule": rule, "ratio": ratio, "seed": seed, **out})
                print(json.dumps(results[-1]), flush=True)
    reference = {r["seed"]: r["loss"] for r in results if r["rule"] == "allreduce"}
    rows = []
    for ratio in args.ratios:
        for rule in args.rules:
            runs = [r for r in results if r["rule"] == rule
                    and (r["ratio"] == ratio or rule == "allreduce")]
            if not runs:
                continue
            rel = [r["loss"] / reference[r["seed"]] for r in runs if r["seed"] in reference]
            rows.append({"straggler": f"{ratio:g}x", "rule": rule, "seeds": len(runs),
                         "final val": statistics.mean(r["loss"] for r in runs),
                         "vs all-reduce": statistics.mean(rel) if rel else None,
                         "straggler's share": statistics.mean(r["slow_share"] for r in runs),
                         "its rounds met": statistics.mean(r["met"] for r in runs)})
    publish(f"{args.steps} iterations of an average replica, {time.time() - began:.0f} s\n\n"
            + rows_table(rows), args.markdown)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
