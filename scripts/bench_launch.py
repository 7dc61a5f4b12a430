"""What one short launch costs, in CPU seconds, by process: the test suite's unit of cost.

    python scripts/bench_launch.py                      # 10 launches of the small MLP, P = S = 2, 1 step
    python scripts/bench_launch.py --launches 20 --steps 4 -- model=gpt_tiny data=stdlib

**Why.** The suite (``python -m pytest``) is bound by this machine's two cores, and most of its
CPU goes to launches of short runs, which cost much the same however short (their start and end,
not their steps). This runs them as the integration tests do (``tests/helpers.sdpipe``): the
command's ``main()`` in this process, its children forked from one fork server that imported
torch once (started by the first launch, a warm-up not counted). Compare two checkouts by running
it in each, back to back: the machine is shared and noisy, so take the median of several
launches, and more than one run.

**Reported**, the median over the launches: wall seconds; CPU seconds of the whole machine
(``/proc/stat``, every process: others' too), of this process (the launcher: composing,
checking, the store, supervising, the summary), and of each child by its role (the scheduler,
the workers), read from ``psutil`` every few milliseconds while the child lives and found by the
pid files the launcher writes (``logs/<name>.pid``): a child's last milliseconds before it exits
may be missed. The sampler's own polling shows in the launcher's figure (a few percent).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil

SAMPLE_S = 0.005


def machine_cpu() -> float:
    """CPU seconds every process of the machine has used since boot (idle and iowait left out)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class Children:
    """The run's children's own CPU seconds by name, sampled until :meth:`stop`."""

    def __init__(self, logs: Path):
        self.logs, self.cpu, self._stop = logs, {}, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        procs: dict[str, psutil.Process] = {}
        while not self._stop.is_set():
            for pid_file in self.logs.glob("*.pid") if self.logs.is_dir() else []:
                name = pid_file.stem
                try:
                    if name not in procs:
                        procs[name] = psutil.Process(int(pid_file.read_text().split()[0]))
                    times = procs[name].cpu_times()
                    self.cpu[name] = times.user + times.system
                except (ValueError, IndexError, OSError, psutil.Error):
                    continue  # not written yet, or ended
            time.sleep(SAMPLE_S)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.cpu


def launch(run_dir: Path, overrides: list[str]) -> dict[str, float]:
    """One ``sdpipe train`` in this process, its output kept from the console."""
    from sdpipe_cli.cli.parsing import main

    shutil.rmtree(run_dir, ignore_errors=True)
    children = Children(run_dir / "logs")
    me = psutil.Process()
    said = io.StringIO()
    wall, machine, own = time.perf_counter(), machine_cpu(), sum(me.cpu_times()[:2])
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = main(["train", f"run.dir={run_dir}", *overrides])
    row = {"wall": time.perf_counter() - wall, "machine": machine_cpu() - machine,
           "launcher": sum(me.cpu_times()[:2]) - own}
    cpu = children.stop()
    if code != 0:
        raise SystemExit(f"the launch failed: {said.getvalue()[-2000:]}")
    row["scheduler"] = cpu.get("scheduler", 0.0)
    row["workers"] = sum(v for k, v in cpu.items() if k.isdigit())
    row["per worker"] = row["workers"] / max(1, sum(k.isdigit() for k in cpu))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--pipelines", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="more overrides (after --)")
    args = parser.parse_args(argv)
    overrides = ["model=mlp", "data=synthetic", f"train.steps={args.steps}", "train.eval_every=0",
                 f"cluster.pipelines={args.pipelines}", f"pipeline.stages={args.stages}",
                 *args.overrides]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-launch-")) / "run"
    try:
        launch(run_dir, overrides)  # starts the fork server: not counted
        rows = [launch(run_dir, overrides) for _ in range(args.launches)]
    finally:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    print(f"{args.launches} launches of {' '.join(overrides)}; medians:")
    for key in rows[0]:
        values = [r[key] for r in rows]
        print(f"  {key:>10}: {statistics.median(values):6.3f} s "
              f"(range {min(values):.3f}-{max(values):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
