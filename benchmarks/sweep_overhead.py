"""Sweep overhead (issue 32): a 16-trial ``raydlrm tune`` sweep against the same 16 trainings
run one after another by hand (``python -m raydlrm train``, one process and one Ray start each),
and the same sweep with ASHA stopping the trailing trials.

The trials differ only in ``training.learning_rate`` (a grid of ``--trials`` log-spaced values, so
both ways train exactly the same jobs); the data is Adult's ``fit``/``valid`` split
(``benchmarks/baselines.py``), one epoch each, evaluating every ``--eval-every`` steps. Wall
times of the three, one after another, on this machine; run it with nothing else running.

    .venv/bin/python benchmarks/sweep_overhead.py --out /tmp/bench/sweep_overhead.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from baselines import validation_split

import raydlrm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/adult.toml")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/sweep_overhead.json"))
    args = parser.parse_args()
    fit, valid = validation_split(raydlrm.load_config(args.config).data)
    tag = time.strftime("%m%d%H%M")
    rates = [float(f"{r:.3g}") for r in np.logspace(-4, -1.5, args.trials)]
    common = [
        f"data.train_path={json.dumps(fit)}",
        f"data.eval_path={json.dumps(valid)}",
        "training.num_epochs=1",
        f"training.eval_every_steps={args.eval_every}",
        f"tracking.registered_model_name={json.dumps('overhead')}",
    ]
    grid = f"training.learning_rate=grid({', '.join(map(str, rates))})"
    results = {"rates": rates}
    for scheduler in ("fifo", "asha"):
        start = time.perf_counter()
        sweep = raydlrm.tune(
            args.config,
            overrides=[*common, f"tune.scheduler={json.dumps(scheduler)}",
                       f"run.name={json.dumps(f'overhead-{tag}-{scheduler}')}"],
            search=[grid],
            num_trials=1,
        )  # fmt: skip
        results[scheduler] = {
            "seconds": time.perf_counter() - start,
            "trials": len(sweep.trials),
            "stopped_early": sum(t["status"] == "stopped early" for t in sweep.trials),
            "best": sweep.best_config,
            "best_auc": sweep.best_metrics.get("eval/auc"),
        }
        print(scheduler, json.dumps(results[scheduler]), flush=True)
    start = time.perf_counter()
    for i, rate in enumerate(rates):
        subprocess.run(
            [sys.executable, "-m", "raydlrm", "train", "--config", args.config]
            + [a for o in common for a in ("--set", o)]
            + ["--set", f"training.learning_rate={rate}"]
            + ["--set", f"run.name={json.dumps(f'overhead-{tag}-byhand-{i}')}"],
            capture_output=True,
            check=True,
        )
    results["by_hand"] = {"seconds": time.perf_counter() - start, "trials": len(rates)}
    print("by hand", json.dumps(results["by_hand"]), flush=True)
    for s in ("fifo", "asha"):
        print(f"{s} sweep / by hand: {results[s]['seconds'] / results['by_hand']['seconds']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
