"""Scheduled retraining: warm start from the champion vs training from scratch, slot by slot.

Generates a day-partitioned synthetic feed (``--days`` partitions of ``--rows-per-day`` rows,
through the config's ``[data.synthetic] partitions``) in a temporary directory, then runs the
newest ``--slots`` days as retraining slots with :func:`raydlrm.retrain` (1 day trained, the
slot's day held out) for two registered models side by side:

- ``warm``: ``retrain.warm_start = true``. The first slot has no champion and trains from
  scratch; every later slot warm-starts from the previous slot's model (weights and optimizer
  states) and trains one more day on top of it.
- ``scratch``: ``retrain.warm_start = false``: every slot trains from scratch on its one day.

Both use ``retrain.min_improvement = -1`` (every new model becomes the champion, so the next
warm slot starts from it) and ``retrain.max_regression = 1`` (no guard failure), and the rest of
``--config`` (model, sharding, training; 2 workers of 0.5 CPU). The slots of the two chains are
interleaved, alternating which runs first, so that load changes on a shared machine hit both.
Per slot it records the new model's held-out AUC (``new/auc``, scored by the same Ray Data job
for both), whether it was warm-started, the wall time of the ``retrain`` call and the training
samples/s; then it times ``retrain`` again on each chain's last slot (already retrained: the
idempotent no-op). The first slot is from scratch in both chains, so its AUC difference is the
run-to-run noise of the job (asynchronous data loading changes batch composition).

One local Ray instance (``num_cpus=4``) for everything, a local sqlite MLflow and run storage
in the temporary directory, fresh per repeat (the data are generated once). Prints Markdown
tables and writes every figure to ``--out`` (JSON).

    .venv/bin/python benchmarks/retrain_warm_start.py
    .venv/bin/python benchmarks/retrain_warm_start.py --rows-per-day 20000 --days 4 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import tomllib

import raydlrm
from raydlrm.platform.config import load_config
from raydlrm.platform.job_data import prepare_data

CHAINS = {"warm": True, "scratch": False}  # registered model name: retrain.warm_start
FIRST_DAY = datetime.date(2026, 11, 16)
NOOP_REPEATS = 3


def _days(count: int) -> list[str]:
    return [(FIRST_DAY + datetime.timedelta(days=i)).isoformat() for i in range(count)]


def _config(base: dict[str, Any], root: Path, work: Path, args: argparse.Namespace) -> dict:
    """``base`` (the TOML's sections) with the data, run storage and tracking under the
    temporary directory; ``root`` holds the data, ``work`` one repeat's MLflow and runs."""
    config = {section: dict(values) for section, values in base.items()}
    config["data"].update(
        train_path=str(root / "data" / "train"),
        eval_path=None,
        synthetic={
            **config["data"].get("synthetic", {}),
            "generate": "if_missing",
            "num_train_rows": args.rows_per_day * args.days,
            "num_eval_rows": 0,
            "rows_per_file": args.rows_per_file,
            "partitions": _days(args.days),
            "partition_key": "date",
        },
    )
    config["scaling"] = {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}}
    config["run"] = {"storage_path": str(work / "runs"), "progress": "off"}
    config["tracking"] = {
        "tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
        "experiment_name": "retrain-warm-start",
    }
    config["retrain"] = {
        **config.get("retrain", {}),
        "partition_key": "date",
        "train_partitions": 1,
        "holdout_partitions": 1,
        "metric": "auc",
        "min_improvement": -1.0,
        "max_regression": 1.0,
    }
    return config


def _chain_config(config: dict[str, Any], name: str) -> dict[str, Any]:
    chain = {section: dict(values) for section, values in config.items()}
    chain["tracking"]["registered_model_name"] = name
    chain["retrain"]["warm_start"] = CHAINS[name]
    return chain


def _slot(config: dict[str, Any], name: str, slot: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = raydlrm.retrain(_chain_config(config, name), slot=slot)
    wall = time.perf_counter() - start
    trained = result.train.metrics if result.train is not None else {}
    row = {
        "chain": name,
        "slot": slot,
        "version": result.version,
        "warm_started": not result.from_scratch,
        "decision": result.decision,
        "train_partitions": result.train_partitions,
        "new_auc": result.metrics["new/auc"],
        "champion_auc": result.metrics.get("champion/auc"),
        "wall_s": wall,
        "train_samples_per_s": trained.get("train/samples_per_second"),
        "train_auc": trained.get("train/auc"),
        "warm_start_from_step": trained.get("warm_start/from_step"),
        "load_average_1min_before": load,
    }
    print(
        f"  {name:7s} {slot}: auc {row['new_auc']:.4f} "
        f"({'warm' if row['warm_started'] else 'from scratch'}), {wall:.1f} s",
        flush=True,
    )
    return row


def _noop(config: dict[str, Any], name: str, slot: str) -> list[float]:
    walls = []
    for _ in range(NOOP_REPEATS):
        start = time.perf_counter()
        result = raydlrm.retrain(_chain_config(config, name), slot=slot)
        walls.append(time.perf_counter() - start)
        assert result.skipped, f"{name} {slot} was trained again"
    return walls


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/retrain.toml")
    parser.add_argument("--rows-per-day", type=int, default=40_000)
    parser.add_argument("--rows-per-file", type=int, default=10_000)
    parser.add_argument("--days", type=int, default=5, help="partitions of the feed")
    parser.add_argument("--slots", type=int, default=3, help="the newest days retrained")
    parser.add_argument("--repeats", type=int, default=1, help="both chains, fresh registry")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "retrain_ws.json"))
    args = parser.parse_args()
    if not 1 <= args.slots <= args.days - 1:
        parser.error("--slots must be between 1 and --days - 1 (each slot trains the day before)")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset progress lines

    # As the launcher does for the local instances it starts: one Parquet footer reader.
    os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
    base = tomllib.loads(Path(args.config).read_text())
    slots = _days(args.days)[-args.slots :]
    ray.init(
        address="local",
        num_cpus=4,
        object_store_memory=512 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
    )
    rows: list[dict[str, Any]] = []
    noop: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="retrain-ws-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        prepare_data(load_config(_config(base, root, root, args)))
        generate_s = time.perf_counter() - start
        print(f"{args.days} days x {args.rows_per_day:,} rows generated in {generate_s:.1f} s")
        for repeat in range(args.repeats):
            work = root / f"repeat{repeat}"
            config = _config(base, root, work, args)
            print(f"repeat {repeat}", flush=True)
            for i, slot in enumerate(slots):
                order = list(CHAINS) if (i + repeat) % 2 == 0 else list(CHAINS)[::-1]
                for name in order:
                    rows.append({"repeat": repeat, **_slot(config, name, slot)})
            for name in CHAINS:
                noop.setdefault(name, []).extend(_noop(config, name, slots[-1]))
    ray.shutdown()

    by = {(r["repeat"], r["chain"], r["slot"]): r for r in rows}
    pairs = []
    for repeat in range(args.repeats):
        for slot in slots:
            warm, scratch = by[(repeat, "warm", slot)], by[(repeat, "scratch", slot)]
            pairs.append(
                {
                    "repeat": repeat,
                    "slot": slot,
                    "warm_started": warm["warm_started"],
                    "days_seen_warm": len(slots[: slots.index(slot) + 1]),
                    "auc_diff": warm["new_auc"] - scratch["new_auc"],
                    "wall_ratio": warm["wall_s"] / scratch["wall_s"],
                }
            )
    warm_pairs = [p for p in pairs if p["warm_started"]]
    control = [p for p in pairs if not p["warm_started"]]
    summary = {
        "median_auc_diff_warm_started": _median([p["auc_diff"] for p in warm_pairs]),
        "median_wall_ratio_warm_started": _median([p["wall_ratio"] for p in warm_pairs]),
        "median_auc_diff_both_from_scratch": _median([p["auc_diff"] for p in control]),
        "median_wall_ratio_both_from_scratch": _median([p["wall_ratio"] for p in control]),
        "median_noop_s": {name: statistics.median(w) for name, w in noop.items()},
    }

    print(f"\nconfig {args.config}; {args.days} days x {args.rows_per_day:,} rows, slots {slots}")
    print(
        "| repeat | slot | chain | warm-started | days trained | held-out AUC | wall s "
        "| train samples/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        seen = slots.index(r["slot"]) + 1 if r["chain"] == "warm" else 1
        warm = "yes" if r["warm_started"] else "no"
        print(
            f"| {r['repeat']} | {r['slot']} | {r['chain']} | {warm} | {seen} "
            f"| {r['new_auc']:.4f} | {r['wall_s']:.1f} "
            f"| {_fmt(r['train_samples_per_s'], ',.0f')} |"
        )
    print("\n| repeat | slot | warm-started | AUC warm - scratch | wall warm / scratch |")
    print("|---|---|---|---|---|")
    for p in pairs:
        print(
            f"| {p['repeat']} | {p['slot']} | {'yes' if p['warm_started'] else 'no (control)'} "
            f"| {p['auc_diff']:+.4f} | {p['wall_ratio']:.2f} |"
        )
    print(
        f"\nwarm-started slots: median AUC difference "
        f"{_fmt(summary['median_auc_diff_warm_started'], '+.4f')}, median wall ratio "
        f"{_fmt(summary['median_wall_ratio_warm_started'], '.2f')}; both from scratch (noise): "
        f"{_fmt(summary['median_auc_diff_both_from_scratch'], '+.4f')}, "
        f"{_fmt(summary['median_wall_ratio_both_from_scratch'], '.2f')}"
    )
    for name, walls in noop.items():
        print(f"no-op re-run of {name} {slots[-1]}: {', '.join(f'{w:.2f}' for w in walls)} s")

    out = {
        "args": vars(args),
        "slots": slots,
        "generate_s": generate_s,
        "rows": rows,
        "pairs": pairs,
        "noop_s": noop,
        "summary": summary,
        "load_average_end": os.getloadavg(),
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
