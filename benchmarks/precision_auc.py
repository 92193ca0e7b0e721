"""Effect of fp16 embedding tables on final AUC and training throughput, against fp32.

Trains the same job with ``sharding.weights_precision = fp32`` and ``fp16`` (fbgemm's TBE keeps
fp16 weights, rounds each updated row to fp16, and keeps the fused optimizer state in fp32), on
two data sets: the synthetic Criteo-shaped data (``configs/quickstart.toml``) and the Adult
census-income table (``configs/adult.toml``; write it first with ``benchmarks/adult.py``). Each
(data set, precision) pair is trained with ``--seeds`` training seeds (``training.seed``: the
initial weights and the epoch shuffles; the data are the same), 2 workers, and the runs are
interleaved seed-major (fp32 seed 0, fp16 seed 0, fp32 seed 1, ...) so that load changes on a
shared machine hit both precisions alike. The only difference between the two runs of a seed is
the tables' precision, so their AUC difference is its effect plus the run-to-run noise, which the
spread over seeds bounds.

Per run: held-out AUC and log loss, train AUC and the steady-state train samples/s from the
run's final metrics (:func:`raydlrm.train`), the wall time and the load average before it. Per
data set and precision: mean and [min, max] over seeds; per data set: the paired fp16 - fp32
differences of AUC and log loss and the fp16 / fp32 ratio of samples/s (mean and [min, max] over
seeds).

One local Ray instance for all runs, with the State API pinned to its own dashboard
(``RAY_API_SERVER_ADDRESS``: otherwise Ray Train's placement-group cleaner may ask another job's
Ray instance on a shared machine whether the run is alive, and kill it); each run gets its own
temporary directory (its ``mlflow.db`` and ``runs/``, removed after the run) and registers no
model. A failed run is retried ``--retries`` times (same seed, fresh directory); the JSON records
the attempts. The configs' data paths are resolved against the current directory (run from the
repository root); the synthetic data are generated there first if missing. Prints Markdown
tables and writes every figure to ``--out`` (JSON).

Usage::

    python benchmarks/precision_auc.py [--seeds 3] [--precisions fp32,fp16]
        [--datasets synthetic=configs/quickstart.toml,adult=configs/adult.toml]
        [--set section.key=value ...] [--retries 1] [--out /tmp/precision_auc.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

import raydlrm
from raydlrm.platform.config import JobConfig, load_config
from raydlrm.platform.preflight import prepare_data

DEFAULT_DATASETS = "synthetic=configs/quickstart.toml,adult=configs/adult.toml"
# Figures summarized per (data set, precision): run key -> table heading.
FIGURES = {"eval_auc": "eval AUC", "eval_log_loss": "eval log loss", "samples_per_s": "samples/s"}


def _absolute(path: str | None) -> str | None:
    """A local path made absolute (the runs' working directories are elsewhere); URIs as is."""
    return path if path is None or "://" in path else str(Path(path).resolve())


def _job(
    config: str, work: Path, *, dataset: str, precision: str, seed: int, overrides: list[str]
) -> JobConfig:
    """``config`` with the run's precision and seed, MLflow and run storage under ``work``."""
    job = load_config(
        config,
        overrides=[
            f"sharding.weights_precision={precision}",
            f"training.seed={seed}",
            f"run.name=precision-auc-{dataset}-{precision}-seed{seed}",
            "run.progress=off",
            "tracking.experiment_name=raydlrm-precision-auc",
            *overrides,
        ],
    )
    job.data.train_path = _absolute(job.data.train_path)
    job.data.eval_path = _absolute(job.data.eval_path)
    job.run.storage_path = str(work / "runs")
    job.tracking.tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
    job.tracking.registered_model_name = None
    return job


def _run(job: JobConfig, *, dataset: str, precision: str, seed: int) -> dict[str, Any]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = raydlrm.train(job)
    wall = time.perf_counter() - start
    m = result.metrics
    row = {
        "dataset": dataset,
        "precision": precision,
        "seed": seed,
        "eval_auc": m["eval/auc"],
        "eval_log_loss": m["eval/log_loss"],
        "train_auc": m["train/auc"],
        "samples_per_s": m["train/samples_per_second"],
        "steps": m["step"],
        "wall_s": wall,
        "load_average_1min_before": load,
        "run_id": result.run_id,
    }
    print(
        f"  [{dataset} {precision} seed {seed}] eval/auc={row['eval_auc']:.4f} "
        f"log_loss={row['eval_log_loss']:.4f} samples/s={row['samples_per_s']:,.0f} "
        f"({wall:.0f} s, load {load:.1f})",
        flush=True,
    )
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _fmt(spread: dict[str, float], spec: str) -> str:
    return (
        f"{format(spread['mean'], spec)} [{format(spread['min'], spec)}, "
        f"{format(spread['max'], spec)}]"
    )


def _summaries(rows: list[dict[str, Any]], precisions: list[str]) -> dict[str, Any]:
    """Per data set: each precision's spread over seeds, and each other precision's paired
    differences (AUC, log loss) and ratio (samples/s) against the first."""
    out: dict[str, Any] = {}
    base = precisions[0]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        runs = {(r["precision"], r["seed"]): r for r in rows if r["dataset"] == dataset}
        seeds = sorted({seed for _, seed in runs})
        per_precision = {
            p: {k: _spread([runs[p, s][k] for s in seeds]) for k in FIGURES} for p in precisions
        }
        paired = {}
        for p in precisions[1:]:
            pairs = [(runs[p, s], runs[base, s]) for s in seeds]
            paired[p] = {
                "auc_diff": _spread([r["eval_auc"] - b["eval_auc"] for r, b in pairs]),
                "log_loss_diff": _spread(
                    [r["eval_log_loss"] - b["eval_log_loss"] for r, b in pairs]
                ),
                "samples_per_s_ratio": _spread(
                    [r["samples_per_s"] / b["samples_per_s"] for r, b in pairs]
                ),
            }
        out[dataset] = {"seeds": seeds, "per_precision": per_precision, f"vs_{base}": paired}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default=DEFAULT_DATASETS, help="name=config,...")
    parser.add_argument("--precisions", default="fp32,fp16", help="the first is the baseline")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--retries", type=int, default=1, help="re-runs of a failed run (same seed, fresh dir)"
    )
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "precision_auc.json"))
    args = parser.parse_args()
    datasets = dict(item.split("=", 1) for item in args.datasets.split(","))
    precisions = args.precisions.split(",")
    if len(set(precisions)) != len(precisions) or len(precisions) < 2:
        parser.error(f"--precisions must name at least two distinct precisions: {precisions}")
    if args.seeds < 1:
        parser.error(f"--seeds must be positive, got {args.seeds}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset progress lines

    for name, config in datasets.items():
        job = load_config(config, overrides=args.overrides)
        job.data.train_path = _absolute(job.data.train_path)
        job.data.eval_path = _absolute(job.data.eval_path)
        prepare_data(job)  # the synthetic data, once, before any run is timed
        if "://" not in job.data.train_path and not Path(job.data.train_path).exists():
            parser.error(
                f"{name}: {job.data.train_path} does not exist "
                "(for Adult: python benchmarks/adult.py)"
            )
    # As the launcher starts a local instance (one Parquet footer reader, room for the 0.5-CPU
    # workers plus Ray Data's actor and read tasks), but quiet: the runs' own lines only.
    os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
    # Ray Train's PlacementGroupCleaner asks the State API whether the run's controller is
    # alive. Without an address it asks the newest Ray instance on the machine
    # (/tmp/ray/ray_current_cluster), on a shared machine often another job's, which does not
    # know the controller: the cleaner takes it for dead and removes the live run's placement
    # group. Point the State API (inherited by every Ray process) at this instance's dashboard.
    dashboard_port = _free_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, 4),
        include_dashboard=True,
        dashboard_port=dashboard_port,
        log_to_driver=False,
    )
    rows = []
    start = time.perf_counter()
    for name, config in datasets.items():
        print(f"{name} ({config})", flush=True)
        for seed in range(args.seeds):
            for precision in precisions:
                for attempt in range(1, args.retries + 2):
                    # A fresh directory per attempt: a retry must not resume the failed run.
                    with tempfile.TemporaryDirectory(prefix=f"precision-auc-{name}-") as work:
                        job = _job(
                            config,
                            Path(work),
                            dataset=name,
                            precision=precision,
                            seed=seed,
                            overrides=args.overrides,
                        )
                        try:
                            row = _run(job, dataset=name, precision=precision, seed=seed)
                            break
                        except Exception as e:
                            if attempt > args.retries:
                                raise
                            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
                            print(
                                f"  [{name} {precision} seed {seed}] attempt {attempt} failed: "
                                f"{type(e).__name__}: {first_line}; retrying",
                                flush=True,
                            )
                rows.append({**row, "attempts": attempt})
    total_s = time.perf_counter() - start
    ray.shutdown()
    summary = _summaries(rows, precisions)

    base = precisions[0]
    print(
        f"\n{args.seeds} seed(s), overrides {args.overrides or 'none'}; "
        f"{total_s / 60:.1f} min in all, load average at the end "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        "| data set | run | eval AUC | eval log loss | train AUC | samples/s | steps | wall s "
        "| load before |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dataset']} | {r['precision']} seed {r['seed']} | {r['eval_auc']:.4f} "
            f"| {r['eval_log_loss']:.4f} | {r['train_auc']:.4f} | {r['samples_per_s']:,.0f} "
            f"| {r['steps']:.0f} | {r['wall_s']:.0f} | {r['load_average_1min_before']:.1f} |"
        )
    print(
        f"\nmean [min, max] over seeds; differences and ratios are paired by seed, against {base}"
    )
    print(
        f"| data set | weights | {' | '.join(FIGURES.values())} | AUC - {base} "
        f"| log loss - {base} | samples/s / {base} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        for p in precisions:
            figures = s["per_precision"][p]
            cells = [
                _fmt(figures["eval_auc"], ".4f"),
                _fmt(figures["eval_log_loss"], ".4f"),
                _fmt(figures["samples_per_s"], ",.0f"),
            ]
            if p == base:
                cells += ["-", "-", "-"]
            else:
                paired = s[f"vs_{base}"][p]
                cells += [
                    _fmt(paired["auc_diff"], "+.4f"),
                    _fmt(paired["log_loss_diff"], "+.4f"),
                    _fmt(paired["samples_per_s_ratio"], ".2f"),
                ]
            print(f"| {name} | {p} | {' | '.join(cells)} |")

    out = {
        "args": vars(args),
        "datasets": datasets,
        "rows": rows,
        "summary": summary,
        "total_s": total_s,
        "load_average_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    Path(args.out).write_text(json.dumps(out, indent=2, default=float))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
