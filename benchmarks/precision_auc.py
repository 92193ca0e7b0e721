"""Effect of fp16, int8 and int4 embedding tables on final AUC, memory and throughput, against fp32.

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

A precision ``dense:bf16`` or ``dense:fp16`` sets ``training.precision`` (the dense side's
compute, issue 49) instead, the tables staying fp32. A precision may name the fp32 cache of a
quantized table: ``int8@0.05`` sets
``sharding.weights_precision = "int8"`` and ``sharding.cache_load_factor = 0.05`` (issue 28).
If such a run stops because a step looks up more distinct rows of a shard than its cache holds
(the error names ``sharding.cache_load_factor``), it is not retried at that factor: the run goes
on with the next larger factor of ``--fallback-factors`` (none: the error is raised), and the
row records the factor used and the error that moved it on.

Data sets are ``name=config``; the name ``synthetic-ho`` (alone, or ``synthetic-ho=config``,
default ``configs/quickstart.toml``) is that config with :data:`model_zoo.SYNTHETIC_HO`'s data
(1,000,000 rows with planted 2-, 3- and 4-way interactions, generated on first use).

Per run: held-out AUC and log loss, train AUC and the steady-state train samples/s from the
run's final metrics (:func:`raydlrm.train`), ``memory/embedding_bytes`` (all ranks' tables:
weights, optimizer state, quantized rows and scales, caches), the mean ``cache_hit_rate`` over
the quantized tables, the wall time and the load average before it. Per data set and precision:
mean and [min, max] over seeds; per data set: the paired differences of AUC and log loss
against the first precision, and the ratios of samples/s (precision / first) and of
embedding memory (first / precision), mean and [min, max] over seeds.

One local Ray instance for all runs, with the State API pinned to its own dashboard
(``RAY_API_SERVER_ADDRESS``: otherwise Ray Train's placement-group cleaner may ask another job's
Ray instance on a shared machine whether the run is alive, and kill it); each run gets its own
temporary directory (its ``mlflow.db`` and ``runs/``, removed after the run) and registers no
model. A failed run is retried ``--retries`` times (same seed, fresh directory); the JSON records
the attempts. The configs' data paths are resolved against the current directory (run from the
repository root); the synthetic data are generated there first if missing. Prints Markdown
tables and writes every figure to ``--out`` (JSON).

Usage::

    python benchmarks/precision_auc.py [--seeds 3] [--precisions fp32,fp16,int8@0.05,int4@0.01]
        [--datasets synthetic=configs/quickstart.toml,synthetic-ho,adult=configs/adult.toml]
        [--fallback-factors 0.02,0.05,0.1] [--set section.key=value ...] [--retries 1]
        [--out /tmp/precision_auc.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import tomllib

import raydlrm
from raydlrm.ingestion import DataValidationError
from raydlrm.platform.config import JobConfig, load_config
from raydlrm.platform.job_data import prepare_data

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import SYNTHETIC_HO

DEFAULT_DATASETS = "synthetic=configs/quickstart.toml,adult=configs/adult.toml"
# Figures summarized per (data set, precision): run key -> table heading.
FIGURES = {"eval_auc": "eval AUC", "eval_log_loss": "eval log loss", "samples_per_s": "samples/s"}
HO = "synthetic-ho"
HO_CONFIG = "configs/quickstart.toml"
# The cache-too-small error (raydlrm.sharding.row_cache) names this knob.
CACHE_ERROR = "sharding.cache_load_factor"


def _precision(spec: str) -> tuple[str, float | None]:
    """``int8@0.05`` -> (``int8``, 0.05); ``fp32`` -> (``fp32``, None)."""
    precision, _, factor = spec.partition("@")
    return precision, float(factor) if factor else None


def _load(name: str, config: str, overrides: list[str]) -> JobConfig:
    """``config`` (``synthetic-ho``: with model_zoo's SYNTHETIC_HO data) and ``overrides``,
    its data paths made absolute."""
    tree = tomllib.loads(Path(config).read_text())
    if name == HO:  # as model_zoo._config does
        tree["data"].update(
            SYNTHETIC_HO, synthetic={**tree["data"]["synthetic"], **SYNTHETIC_HO["synthetic"]}
        )
    if "synthetic" in tree["data"]:  # written once, before any run is timed
        tree["data"]["synthetic"] = {**tree["data"]["synthetic"], "generate": "if_missing"}
    job = load_config(tree, overrides=overrides)
    job.data.train_path = _absolute(job.data.train_path)
    job.data.eval_path = _absolute(job.data.eval_path)
    return job


def _absolute(path: str | None) -> str | None:
    """A local path made absolute (the runs' working directories are elsewhere); URIs as is."""
    return path if path is None or "://" in path else str(Path(path).resolve())


def _job(
    config: str,
    work: Path,
    *,
    dataset: str,
    precision: str,
    factor: float | None,
    seed: int,
    overrides: list[str],
) -> JobConfig:
    """``config`` with the run's precision (and cache factor) and seed, MLflow and run storage
    under ``work``."""
    cache = [f"sharding.cache_load_factor={factor}"] if factor is not None else []
    tag = precision if factor is None else f"{precision}-cache{factor}"
    tag = tag.replace(":", "-")
    dense = precision.removeprefix("dense:")
    if dense != precision:  # the dense side's compute (training.precision), fp32 tables
        setting = f"training.precision={dense}"
    else:
        setting = f"sharding.weights_precision={precision}"
    job = _load(
        dataset,
        config,
        [
            setting,
            *cache,
            f"training.seed={seed}",
            f"run.name=precision-auc-{dataset}-{tag}-seed{seed}",
            "run.progress=off",
            "tracking.experiment_name=raydlrm-precision-auc",
            *overrides,
        ],
    )
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
    hit_rates = [
        v for k, v in m.items() if k.startswith("cache/") and k.endswith("/cache_hit_rate")
    ]
    row = {
        "dataset": dataset,
        "precision": precision,
        "seed": seed,
        "eval_auc": m["eval/auc"],
        "eval_log_loss": m["eval/log_loss"],
        "train_auc": m["train/auc"],
        "samples_per_s": m["train/samples_per_second"],
        "embedding_bytes": m.get("memory/embedding_bytes"),
        "cache_hit_rate": statistics.fmean(hit_rates) if hit_rates else None,
        "cache_hit_rates": {
            k: v for k, v in m.items() if k.startswith("cache/") and k.endswith("_rate")
        },
        "steps": m["step"],
        "wall_s": wall,
        "load_average_1min_before": load,
        "run_id": result.run_id,
    }
    memory = row["embedding_bytes"]
    hit = row["cache_hit_rate"]
    print(
        f"  [{dataset} {precision} seed {seed}] eval/auc={row['eval_auc']:.4f} "
        f"log_loss={row['eval_log_loss']:.4f} samples/s={row['samples_per_s']:,.0f} "
        f"embedding MiB={'-' if memory is None else f'{memory / 2**20:.2f}'} "
        f"cache hit={'-' if hit is None else f'{hit:.3f}'} "
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


def _fmt_opt(spread: dict[str, float] | None, spec: str) -> str:
    return "-" if spread is None else _fmt(spread, spec)


def _maybe_spread(values: list[float | None]) -> dict[str, float] | None:
    return None if any(v is None for v in values) else _spread(values)


def _summaries(rows: list[dict[str, Any]], precisions: list[str]) -> dict[str, Any]:
    """Per data set: each precision's spread over seeds, and each other precision's paired
    differences (AUC, log loss) and ratio (samples/s) against the first."""
    out: dict[str, Any] = {}
    base = precisions[0]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        runs = {(r["precision"], r["seed"]): r for r in rows if r["dataset"] == dataset}
        seeds = sorted({seed for _, seed in runs})
        per_precision = {
            p: {
                **{k: _spread([runs[p, s][k] for s in seeds]) for k in FIGURES},
                "embedding_bytes": _maybe_spread([runs[p, s]["embedding_bytes"] for s in seeds]),
                "cache_hit_rate": _maybe_spread([runs[p, s]["cache_hit_rate"] for s in seeds]),
                "cache_load_factors": sorted(
                    {runs[p, s]["cache_load_factor"] for s in seeds}, key=lambda f: f or 0
                ),
            }
            for p in precisions
        }
        paired = {}
        for p in precisions[1:]:
            pairs = [(runs[p, s], runs[base, s]) for s in seeds]
            paired[p] = {
                "memory_ratio": _maybe_spread(
                    [
                        b["embedding_bytes"] / r["embedding_bytes"]
                        if r["embedding_bytes"] and b["embedding_bytes"]
                        else None
                        for r, b in pairs
                    ]
                ),
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
    parser.add_argument(
        "--precisions",
        default="fp32,fp16",
        help="the first is the baseline; int8@0.05: int8 with sharding.cache_load_factor 0.05; "
        "dense:bf16 / dense:fp16: training.precision (the dense side's compute) instead",
    )
    parser.add_argument(
        "--fallback-factors",
        default="",
        help="cache factors to move on to (the next larger) when a step needs more rows than "
        "a quantized table's cache holds, e.g. 0.02,0.05,0.1; empty: raise",
    )
    parser.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--retries", type=int, default=1, help="re-runs of a failed run (same seed, fresh dir)"
    )
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "precision_auc.json"))
    args = parser.parse_args()
    datasets = dict(
        item.split("=", 1) if "=" in item else (item, HO_CONFIG if item == HO else item)
        for item in args.datasets.split(",")
    )
    precisions = args.precisions.split(",")
    fallback = sorted(float(f) for f in args.fallback_factors.split(",") if f)
    if len(set(precisions)) != len(precisions) or len(precisions) < 2:
        parser.error(f"--precisions must name at least two distinct precisions: {precisions}")
    if args.seeds < 1:
        parser.error(f"--seeds must be positive, got {args.seeds}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset progress lines

    for name, config in datasets.items():
        job = _load(name, config, args.overrides)
        try:
            prepare_data(job)  # the synthetic data, once, before any run is timed
        except DataValidationError as e:
            parser.error(f"{name}: {e} (for Adult: python benchmarks/adult.py)")
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
            for label in precisions:
                precision, factor = _precision(label)
                cache_errors: list[str] = []
                attempt = 0
                while True:
                    attempt += 1
                    # A fresh directory per attempt: a retry must not resume the failed run.
                    with tempfile.TemporaryDirectory(prefix=f"precision-auc-{name}-") as work:
                        job = _job(
                            config,
                            Path(work),
                            dataset=name,
                            precision=precision,
                            factor=factor,
                            seed=seed,
                            overrides=args.overrides,
                        )
                        try:
                            row = _run(job, dataset=name, precision=label, seed=seed)
                            break
                        except Exception as e:
                            text = str(e)
                            lines = [x for x in text.splitlines() if CACHE_ERROR in x]
                            first_line = text.strip().splitlines()[0] if text.strip() else ""
                            if lines and factor is not None:
                                # Deterministic: the same factor fails again; take a larger one.
                                larger = [f for f in fallback if f > factor]
                                cache_errors.append(f"cache_load_factor={factor}: {lines[0]}")
                                print(
                                    f"  [{name} {label} seed {seed}] cache too small at "
                                    f"{factor}: {lines[0].strip()}",
                                    flush=True,
                                )
                                if not larger:
                                    raise
                                factor = larger[0]
                                attempt = 0
                                continue
                            if attempt > args.retries:
                                raise
                            print(
                                f"  [{name} {label} seed {seed}] attempt {attempt} failed: "
                                f"{type(e).__name__}: {first_line}; retrying",
                                flush=True,
                            )
                rows.append(
                    {
                        **row,
                        "attempts": attempt,
                        "cache_load_factor": factor,
                        "cache_errors": cache_errors,
                    }
                )
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
        "| data set | run | cache factor | eval AUC | eval log loss | train AUC | samples/s "
        "| embedding MiB | cache hit rate | steps | wall s | load before |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        memory = "-" if r["embedding_bytes"] is None else f"{r['embedding_bytes'] / 2**20:.2f}"
        hit = "-" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.3f}"
        print(
            f"| {r['dataset']} | {r['precision']} seed {r['seed']} "
            f"| {r['cache_load_factor'] or '-'} | {r['eval_auc']:.4f} "
            f"| {r['eval_log_loss']:.4f} | {r['train_auc']:.4f} | {r['samples_per_s']:,.0f} "
            f"| {memory} | {hit} | {r['steps']:.0f} | {r['wall_s']:.0f} "
            f"| {r['load_average_1min_before']:.1f} |"
        )
        for error in r["cache_errors"]:
            print(f"|  | ({error}) |")
    print(
        f"\nmean [min, max] over seeds; differences and ratios are paired by seed, against {base}"
    )
    print(
        f"| data set | weights | cache factor | {' | '.join(FIGURES.values())} "
        f"| embedding MiB | cache hit rate | AUC - {base} | log loss - {base} "
        f"| samples/s / {base} | memory {base} / weights |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        for p in precisions:
            figures = s["per_precision"][p]
            memory = figures["embedding_bytes"]
            cells = [
                ", ".join(str(f) for f in figures["cache_load_factors"] if f is not None) or "-",
                _fmt(figures["eval_auc"], ".4f"),
                _fmt(figures["eval_log_loss"], ".4f"),
                _fmt(figures["samples_per_s"], ",.0f"),
                "-" if memory is None else f"{memory['mean'] / 2**20:.2f}",
                _fmt_opt(figures["cache_hit_rate"], ".3f"),
            ]
            if p == base:
                cells += ["-", "-", "-", "-"]
            else:
                paired = s[f"vs_{base}"][p]
                cells += [
                    _fmt(paired["auc_diff"], "+.4f"),
                    _fmt(paired["log_loss_diff"], "+.4f"),
                    _fmt(paired["samples_per_s_ratio"], ".2f"),
                    _fmt_opt(paired["memory_ratio"], ".2f"),
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
