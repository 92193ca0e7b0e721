"""Fixed overhead of a small training run on a local Ray instance: by how often Ray Train's
controller polls its workers (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``; Ray's default 2 s,
raydlrm's default for a local instance 0.5 s), and by the workers' priority next to busy
programs (``RAY_worker_niceness``; Ray's default 15, raydlrm's default for a local instance 0).

The controller's poll paces the start of a run, each ``ray.train.report`` (a barrier the
controller releases) and the end of the run, so a small run spends seconds waiting on it. Ray
starts its workers at niceness 15, below every program at the default priority: ``--busy N``
runs N busy loops (plain Python, niceness 0) beside the job, as a benchmark, a second test run
or a build would. Each repeat runs, in a fresh process with the settings made before Ray
starts, a warm-up job and then the measured job: 2 workers, 4 steps of 128 rows, a report
every 2 steps and a checkpoint at the end. Settings alternate. Prints the median wall time of
``raydlrm.train`` per setting.

Usage::

    python benchmarks/train_overhead.py [--repeats 3] [--intervals 2.0 0.5 0.25]
    python benchmarks/train_overhead.py --intervals 0.5 --niceness 15 0 --busy 0 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time
from pathlib import Path
import raydlrm

root = Path(sys.argv[1])
def config(name):
    return {
        "data": {"train_path": str(root / "data" / "train"), "eval_path": None,
                 "batch_size": 128, "table_size": 500,
                 "synthetic": {"generate": "if_missing", "num_train_rows": 2048,
                               "num_eval_rows": 0,
                               "rows_per_file": 1024, "max_cardinality": 400}},
        "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
        "training": {"max_steps": 4, "log_every_steps": 2},
        "run": {"storage_path": str(root / "runs"), "name": name},
        "tracking": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
                     "registered_model_name": None},
        "ray": {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False},
    }
raydlrm.train(config("warm-up"))
started = time.perf_counter()
raydlrm.train(config("measured"))
print(json.dumps(time.perf_counter() - started))
"""


def _measure(interval: float, niceness: int, busy: int) -> float:
    """One repeat of a setting: the measured job's wall time in a fresh process."""
    env = {
        **os.environ,
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(interval),
        "RAY_worker_niceness": str(niceness),
    }
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="raydlrm-overhead-") as root:
            child = subprocess.run(
                [sys.executable, "-c", _CHILD, root], capture_output=True, text=True, env=env
            )
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    if child.returncode:
        sys.exit(
            f"the run with interval {interval} s, niceness {niceness}, {busy} busy failed:\n"
            f"{child.stderr[-3000:]}"
        )
    return float(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--intervals", type=float, nargs="+", default=[2.0, 0.5, 0.25])
    parser.add_argument("--niceness", type=int, nargs="+", default=[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    settings = list(itertools.product(args.intervals, args.niceness, args.busy))
    runs: dict[tuple[float, int, int], list[float]] = {s: [] for s in settings}
    for _ in range(args.repeats):
        for setting in settings:
            runs[setting].append(_measure(*setting))
    print(
        json.dumps(
            {
                f"interval={i} niceness={n} busy={b}": {
                    "median_seconds": round(statistics.median(values), 2),
                    "seconds": [round(v, 2) for v in values],
                }
                for (i, n, b), values in runs.items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
