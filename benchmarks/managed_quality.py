"""Managed ids against hashed tables of the same rows: held-out quality (issue 48, "Quality at
equal memory").

Two parts (``--parts``, both by default):

``churn``: the daily feed of ``configs/churn.toml`` (``raydlrm data generate --config
configs/churn.toml`` writes ``data/churn/train/date=2026-01-01..06``; a fifth of the active ids
are new each day, Zipf popularity drifting), retrained slot by slot with :func:`raydlrm.retrain`
for the slots 2026-01-02 .. 2026-01-06 (each trains on the day before and holds out its own day;
the first slot trains from scratch, every later one warm-starts from the previous slot's model).
Variants, all with the config's table rows (user 20,645, item 7,267: 1/1.3 of the 26,838 users and
9,447 items of the six days):

- ``hashed``: ``data.managed_ids = {}`` (ids hashed modulo the rows: colliding ids share a row);
- ``managed``: the config as it is (user_id and item_id managed, LRU, ``reset_on_evict = true``);
- ``managed-noreset``: the same with ``reset_on_evict = false`` for both tables (a new id inherits
  the evicted id's row and optimizer state, as a colliding hashed id does);
- ``hashed-mem`` (only when named in ``--variants``): hashed with the rows scaled by
  (68 + 32) / 68, the bytes the managed tables hold with their id maps (16 fp32 + 1 rowwise-adagrad
  float = 68 B a row, the map 32 B a row): equal memory, not equal rows.

Each (variant, seed) is a chain of its own (own run storage, own sqlite MLflow, own registered
model), ``training.seed`` = the seed (the data are the same for all). ``retrain.min_improvement =
-1`` and ``retrain.max_regression = 1``, so every slot's model becomes the champion and the next
slot warm-starts from it (a chain that day-by-day training would give; the config's rule would
keep an older champion when a new model scores lower, and then the chains of two variants would
differ by more than the variant). Per slot: the new model's held-out metrics as the training job
evaluates it on the slot's day (``eval/auc``, ``eval/normalized_entropy``: raydlrm's NE, the log
loss over the entropy of the held-out day's positive rate, ``raydlrm.trainers.metrics``), the
retrain's own scoring of it (``new/auc``: the exported model, through its id map) and the
champion's, and each managed table's map counters from the slot's MLflow run
(``managed/t_<table>/{ids,occupancy,admissions,evictions}``, counters of this run, the map
carried over from the champion) with the first logged step at which ``evictions`` was above 0
(``training.log_every_steps = 5`` in every variant, the config's 20 otherwise).

``--seen-split`` scores each chain's last model once more (``raydlrm.score``) on the last slot's
day and splits the rows by when their user and item ids occur before it (in the day before, the
last training day; only in older days, what LRU evicts first; in no earlier day): how the
variants do on returning ids and on ids no training day held (a managed table gives those its
bucket's fallback row; a hashed table whatever row they collide into).

``movielens``: MovieLens 100K split by time (``benchmarks/movielens.py`` writes
``data/movielens/{train,eval}``), ``configs/movielens.toml`` trained with :func:`raydlrm.train`:

- ``exact``: the config as it is (user and movie ids are row numbers, ``hash = false``, 944 and
  1,683 rows: one row per id, the reference);
- ``hashed``: 726 user rows and 1,294 movie rows (the 943 and 1,682 ids / 1.3), hashed;
- ``managed``: the same rows, user_id and movie_id managed (LRU, reset on evict).

Everything runs in this process with one local Ray instance (raydlrm starts it on the first call
and every later call reuses it), the chains' slots interleaved (the variants' order rotating) so
that load changes on a shared machine hit all variants. Prints Markdown tables; every figure goes
to ``--out`` (JSON, rewritten after every run). ``--report a.json b.json`` prints the tables of
earlier runs (merged) without running anything.

    .venv/bin/python benchmarks/managed_quality.py --out /tmp/bench/managed_quality.json
    .venv/bin/python benchmarks/managed_quality.py --parts churn --variants hashed-mem \\
        --out /tmp/bench/managed_quality_mem.json
    .venv/bin/python benchmarks/managed_quality.py --report /tmp/bench/managed_quality*.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as pads
import ray
import tomllib
import torch
from mlflow import MlflowClient

import raydlrm
from raydlrm.platform.config import load_config
from raydlrm.storage import PartitionSelector
from raydlrm.trainers.metrics import binary_metrics

CHURN_VARIANTS = ("hashed", "managed", "managed-noreset")
EXTRA_CHURN_VARIANTS = ("hashed-mem",)
MOVIELENS_VARIANTS = ("exact", "hashed", "managed")
# MovieLens 100K: 943 users, 1,682 movies; rows for 1/1.3 of them.
MOVIELENS_ROWS = {"user_id": 726, "movie_id": 1294}
EMBEDDING_ROW_BYTES = 16 * 4 + 4  # churn: dim-16 fp32 weights + one rowwise-adagrad float
MAP_ROW_BYTES = 32  # the id map's (rows, 4) int64 row
MANAGED_COUNTERS = ("ids", "occupancy", "admissions", "evictions", "rejections", "max_probe")


def _sections(base: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(base)


def churn_config(
    base: dict[str, Any], variant: str, seed: int, work: Path, data: Path
) -> dict[str, Any]:
    """``configs/churn.toml`` (``base``) for one chain: the variant, the seed, the chain's own
    run storage and MLflow under ``work``."""
    config = _sections(base)
    config["data"]["train_path"] = str(data)
    config["data"]["eval_path"] = str(data)
    managed = config["data"].get("managed_ids", {})
    if variant in ("hashed", "hashed-mem"):
        config["data"]["managed_ids"] = {}
    elif variant == "managed-noreset":
        for policy in managed.values():
            policy["reset_on_evict"] = False
    elif variant != "managed":
        raise ValueError(f"unknown churn variant {variant!r}")
    if variant == "hashed-mem":
        scale = (EMBEDDING_ROW_BYTES + MAP_ROW_BYTES) / EMBEDDING_ROW_BYTES
        config["data"]["table_sizes"] = {
            k: round(v * scale) for k, v in config["data"]["table_sizes"].items()
        }
    config["training"]["seed"] = seed
    # The map counters are logged every 5 steps (of ~25 a slot) instead of 20: when eviction
    # starts inside a slot. Logging does not change what is trained.
    config["training"]["log_every_steps"] = 5
    config["run"] = {**config.get("run", {}), "storage_path": str(work / "runs"), "progress": "off"}
    config["tracking"] = {
        **config.get("tracking", {}),
        "tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
        "registered_model_name": f"churn-{variant}-s{seed}",
    }
    config["retrain"] = {**config["retrain"], "min_improvement": -1.0, "max_regression": 1.0}
    return config


def movielens_config(
    base: dict[str, Any], variant: str, seed: int, work: Path, root: Path
) -> dict[str, Any]:
    """``configs/movielens.toml`` (``base``) for one run of ``variant``."""
    config = _sections(base)
    data = config["data"]
    data["train_path"] = str(root / data["train_path"])
    data["eval_path"] = str(root / data["eval_path"])
    if variant in ("hashed", "managed"):
        data.pop("sparse_specs", None)  # user_id and movie_id: hash = true (the default)
        data["table_sizes"] = {**data["table_sizes"], **MOVIELENS_ROWS}
        if variant == "managed":
            data["managed_ids"] = {c: {"eviction": "lru"} for c in MOVIELENS_ROWS}
    elif variant != "exact":
        raise ValueError(f"unknown movielens variant {variant!r}")
    config["training"]["seed"] = seed
    config["run"] = {**config.get("run", {}), "storage_path": str(work / "runs"), "progress": "off"}
    config["tracking"] = {
        "tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
        "experiment_name": "managed-quality-movielens",
    }
    return config


def _managed_metrics(client: Any, run_id: str) -> dict[str, Any]:
    """The map counters of a run's managed tables and the first step with evictions."""
    logged = client.get_run(run_id).data.metrics
    out: dict[str, Any] = {}
    tables = sorted({k.split("/")[1] for k in logged if k.startswith("managed/")})
    for table in tables:
        stats = {c: logged.get(f"managed/{table}/{c}") for c in MANAGED_COUNTERS}
        history = client.get_metric_history(run_id, f"managed/{table}/evictions")
        evicting = sorted(m.step for m in history if m.value > 0)
        stats["first_eviction_step"] = evicting[0] if evicting else None
        stats["logged_steps"] = sorted({m.step for m in history})
        stats["evictions_history"] = sorted((m.step, m.value) for m in history)
        out[table.removeprefix("t_")] = stats
    return out


def run_slot(config: dict[str, Any], variant: str, seed: int, slot: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = raydlrm.retrain(config, slot=slot)
    wall = time.perf_counter() - start
    trained = result.train.metrics if result.train is not None else {}
    client = MlflowClient(config["tracking"]["tracking_uri"])
    row = {
        "variant": variant,
        "seed": seed,
        "slot": slot,
        "version": result.version,
        "skipped": result.skipped,
        "warm_started": not result.from_scratch,
        "train_partitions": result.train_partitions,
        "eval_auc": trained.get("eval/auc"),
        "eval_ne": trained.get("eval/normalized_entropy"),
        "eval_log_loss": trained.get("eval/log_loss"),
        "eval_positive_rate": trained.get("eval/positive_rate"),
        "train_auc": trained.get("train/auc"),
        "scored_auc": result.metrics.get("new/auc"),
        "model_uri": result.train.model_uri if result.train is not None else None,
        "champion_auc": result.metrics.get("champion/auc"),
        "managed": _managed_metrics(client, result.run_id) if result.run_id else {},
        "wall_s": wall,
        "load_average_1min_before": load,
    }
    print(
        f"  {variant:16s} seed {seed} {slot}: eval AUC {_fmt(row['eval_auc'], '.4f')} "
        f"NE {_fmt(row['eval_ne'], '.4f')} (scored AUC {_fmt(row['scored_auc'], '.4f')}) "
        f"{_evictions(row)}, {wall:.1f} s",
        flush=True,
    )
    return row


def seen_split(
    config: dict[str, Any], slot: str, model_uri: str, output: Path
) -> dict[str, dict[str, float]]:
    """The model's held-out metrics on ``slot``'s rows split by when their ids occur in the
    feed before ``slot`` (the chain trained on every earlier day, one a slot): ``all``,
    ``both_prev`` (user and item both in the day before, the slot's training day), and per id
    column ``<column>_prev`` (in the day before), ``<column>_older`` (in an earlier day but not
    the day before: what LRU evicts first), ``<column>_new`` (in no earlier day: never trained).
    NE of a group is over the group's own positive rate."""
    job = load_config(config)
    label = job.data.label_column
    columns = list(job.data.sparse_columns)
    key = job.retrain.partition_key
    raydlrm.score(
        model_uri,
        job.data.train_path,
        str(output),
        keep=[label, *columns],
        partitions={key: PartitionSelector(values=[slot])},
    )
    scored = pads.dataset(str(output), format="parquet").to_table()
    history = pads.dataset(job.data.train_path, partitioning="hive", format="parquet")
    earlier = history.to_table(columns=[*columns, key], filter=pads.field(key) < slot)
    previous = max(earlier[key].to_pylist())
    last = np.array(earlier[key].to_pylist()) == previous
    groups = {"all": np.ones(scored.num_rows, dtype=bool)}
    prev = {}
    for c in columns:
        ids = scored[c].to_numpy()
        every = earlier[c].to_numpy()
        prev[c] = np.isin(ids, every[last])
        seen = np.isin(ids, every)
        groups[f"{c}_prev"] = prev[c]
        groups[f"{c}_older"] = seen & ~prev[c]
        groups[f"{c}_new"] = ~seen
    groups["both_prev"] = np.logical_and.reduce(list(prev.values()))
    labels = torch.from_numpy(scored[label].to_numpy().astype(np.float64))
    probs = torch.from_numpy(scored["prediction"].to_numpy().astype(np.float64))
    logits = torch.logit(probs, 1e-7)
    out = {}
    for name, mask in groups.items():
        m = binary_metrics(logits[torch.from_numpy(mask)], labels[torch.from_numpy(mask)])
        out[name] = {
            "share": float(mask.mean()),
            "auc": m.auc,
            "ne": m.normalized_entropy,
            "log_loss": m.log_loss,
            "positive_rate": m.positive_rate,
        }
    return out


def run_movielens(config: dict[str, Any], variant: str, seed: int) -> dict[str, Any]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = raydlrm.train(config)
    wall = time.perf_counter() - start
    m = result.metrics
    client = MlflowClient(config["tracking"]["tracking_uri"])
    row = {
        "variant": variant,
        "seed": seed,
        "eval_auc": m.get("eval/auc"),
        "eval_ne": m.get("eval/normalized_entropy"),
        "eval_log_loss": m.get("eval/log_loss"),
        "eval_positive_rate": m.get("eval/positive_rate"),
        "train_auc": m.get("train/auc"),
        "managed": _managed_metrics(client, result.run_id),
        "wall_s": wall,
        "load_average_1min_before": load,
    }
    print(
        f"  movielens {variant:8s} seed {seed}: eval AUC {_fmt(row['eval_auc'], '.4f')} "
        f"NE {_fmt(row['eval_ne'], '.4f')} {_evictions(row)}, {wall:.1f} s",
        flush=True,
    )
    return row


def _evictions(row: dict[str, Any]) -> str:
    parts = [
        f"{t} occ {_fmt(s['occupancy'], '.3f')} evict {_fmt(s['evictions'], ',.0f')}"
        for t, s in row["managed"].items()
    ]
    return ("[" + "; ".join(parts) + "]") if parts else ""


def _fmt(value: float | None, spec: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def _mean_sd(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else float("nan"))


def _ms(values: list[float], spec: str = ".4f") -> str:
    if not values:
        return "-"
    mean, sd = _mean_sd(values)
    return f"{mean:{spec}} ({_fmt(sd, spec)})"


def report(out: dict[str, Any]) -> None:
    churn = out.get("churn", [])
    if churn:
        _report_churn(churn)
    movielens = out.get("movielens", [])
    if movielens:
        _report_movielens(movielens)


def _report_churn(rows: list[dict[str, Any]]) -> None:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    slots = sorted({r["slot"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    by = {(r["variant"], r["seed"], r["slot"]): r for r in rows}
    print(f"\nchurn: seeds {seeds}; mean over seeds (sd)")
    for key, name in (("eval_auc", "eval AUC"), ("eval_ne", "eval NE")):
        print(f"\n{name} of the new model on the slot's day")
        print("| slot | " + " | ".join(variants) + " |")
        print("|---|" + "---|" * len(variants))
        for slot in slots:
            cells = [
                _ms([by[(v, s, slot)][key] for s in seeds if (v, s, slot) in by]) for v in variants
            ]
            print(f"| {slot} | " + " | ".join(cells) + " |")
    if "hashed" in variants:
        others = [v for v in variants if v != "hashed"]
        print("\nagainst hashed, paired by seed: mean (sd) of the difference")
        print(
            "| slot | " + " | ".join(f"{v} AUC - hashed | {v} NE - hashed" for v in others) + " |"
        )
        print("|---|" + "---|---|" * len(others))
        for slot in slots:
            cells = []
            for v in others:
                for key in ("eval_auc", "eval_ne"):
                    diffs = [
                        by[(v, s, slot)][key] - by[("hashed", s, slot)][key]
                        for s in seeds
                        if (v, s, slot) in by and ("hashed", s, slot) in by
                    ]
                    cells.append(_ms(diffs, "+.4f"))
            print(f"| {slot} | " + " | ".join(cells) + " |")
        _goals(by, slots, seeds, others)
    managed = [
        v
        for v in variants
        if any(by[(v, s, sl)]["managed"] for s in seeds for sl in slots if (v, s, sl) in by)
    ]
    for v in managed:
        print(
            f"\n{v}: id maps at the end of each slot's training (seed {seeds[0]}; mean over seeds "
            "of the evictions)"
        )
        print(
            "| slot | table | ids | occupancy | admissions | evictions (mean) | first step "
            "evicting | logged steps |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for slot in slots:
            row = by.get((v, seeds[0], slot))
            if row is None:
                continue
            for table, st in row["managed"].items():
                ev = [
                    by[(v, s, slot)]["managed"][table]["evictions"]
                    for s in seeds
                    if (v, s, slot) in by
                ]
                print(
                    f"| {slot} | {table} | {_fmt(st['ids'], ',.0f')} "
                    f"| {_fmt(st['occupancy'], '.3f')} | {_fmt(st['admissions'], ',.0f')} "
                    f"| {statistics.fmean(ev):,.0f} | {_fmt(st['first_eviction_step'], 'd')} "
                    f"| {st['logged_steps'][0] if st['logged_steps'] else '-'}.."
                    f"{st['logged_steps'][-1] if st['logged_steps'] else '-'} |"
                )
    split = [r for r in rows if r.get("seen_split")]
    if split:
        slot = split[0]["slot"]
        split_variants = [v for v in variants if any(r["variant"] == v for r in split)]
        print(
            f"\nthe last models on {slot}, rows split by when their ids occur before it (prev: "
            "in the day before, the last training day; older: in an earlier day only; new: in "
            "no earlier day): AUC / NE (NE over the group's own positive rate), mean over seeds"
        )
        print("| rows | share | positive rate | " + " | ".join(split_variants) + " |")
        print("|---|---|---|" + "---|" * len(split_variants))
        for g, first in split[0]["seen_split"].items():
            cells = []
            for v in split_variants:
                vs = [r["seen_split"][g] for r in split if r["variant"] == v]
                auc = statistics.fmean(x["auc"] for x in vs)
                ne = statistics.fmean(x["ne"] for x in vs)
                cells.append(f"{auc:.4f} / {ne:.4f}")
            print(
                f"| {g} | {first['share']:.3f} | {first['positive_rate']:.3f} | "
                + " | ".join(cells)
                + " |"
            )
    walls = [r["wall_s"] for r in rows]
    print(
        f"\n{len(rows)} slots, wall per slot median {statistics.median(walls):.1f} s "
        f"(min {min(walls):.1f}, max {max(walls):.1f}), total {sum(walls) / 60:.1f} min; "
        f"scored AUC - eval AUC max |diff| "
        f"{max(abs(r['scored_auc'] - r['eval_auc']) for r in rows if r['scored_auc']):.2e}"
    )


def _goals(by: dict, slots: list[str], seeds: list[int], others: list[str]) -> None:
    print("\ngoals (issue 48), mean over the seeds:")
    for v in others:
        after_first = slots[1:]
        ne_wins = []
        for slot in after_first:
            m = statistics.fmean(by[(v, s, slot)]["eval_ne"] for s in seeds)
            h = statistics.fmean(by[("hashed", s, slot)]["eval_ne"] for s in seeds)
            ne_wins.append((slot, m < h, m - h))
        last = slots[-1]
        auc = statistics.fmean(
            by[(v, s, last)]["eval_auc"] - by[("hashed", s, last)]["eval_auc"] for s in seeds
        )
        ne_ok = all(w for _, w, _ in ne_wins)
        shown = ", ".join(f"{slot} {d:+.4f}" for slot, _, d in ne_wins)
        print(
            f"- {v}: lower eval NE than hashed on every day after the first: "
            f"{'met' if ne_ok else 'missed'} (NE {v} - hashed: {shown}); "
            f"eval AUC on {last} >= hashed + 0.002: {'met' if auc >= 0.002 else 'missed'} "
            f"({auc:+.4f})"
        )


def _report_movielens(rows: list[dict[str, Any]]) -> None:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    print("\nmovielens (time split): mean over seeds (sd)")
    print("| variant | seeds | eval AUC | eval NE | eval log loss | train AUC | wall s |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        rs = [r for r in rows if r["variant"] == v]
        print(
            f"| {v} | {len(rs)} | {_ms([r['eval_auc'] for r in rs])} "
            f"| {_ms([r['eval_ne'] for r in rs])} | {_ms([r['eval_log_loss'] for r in rs])} "
            f"| {_ms([r['train_auc'] for r in rs])} "
            f"| {statistics.median(r['wall_s'] for r in rs):.1f} |"
        )
    for r in rows:
        if r["managed"]:
            print(
                f"  {r['variant']} seed {r['seed']}: {_evictions(r)} "
                + "; ".join(
                    f"{t} first evicting step {s['first_eviction_step']}"
                    for t, s in r["managed"].items()
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", choices=("churn", "movielens"), default=["churn", "movielens"]
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=CHURN_VARIANTS + EXTRA_CHURN_VARIANTS,
        default=list(CHURN_VARIANTS),
        help="churn variants",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--churn-config", default="configs/churn.toml")
    parser.add_argument("--churn-data", default="data/churn/train")
    parser.add_argument(
        "--slots",
        nargs="+",
        default=["2026-01-02", "2026-01-03", "2026-01-04", "2026-01-05", "2026-01-06"],
    )
    parser.add_argument("--movielens-config", default="configs/movielens.toml")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "managed_quality.json"))
    parser.add_argument("--work", default=None, help="runs and MLflow (default: a temporary dir)")
    parser.add_argument(
        "--seen-split",
        action="store_true",
        help="churn: score each chain's last model on its day split by new/seen ids",
    )
    parser.add_argument("--report", nargs="+", default=None, help="print earlier --out files")
    args = parser.parse_args()

    if args.report:
        merged: dict[str, Any] = {"churn": [], "movielens": []}
        for path in args.report:
            loaded = json.loads(Path(path).read_text())
            for part in merged:
                merged[part].extend(loaded.get(part, []))
        report(merged)
        return

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("raydlrm.platform.retrain").setLevel(logging.ERROR)  # "from scratch"
    root = Path.cwd()
    churn_data = Path(args.churn_data).resolve()
    if "churn" in args.parts and not churn_data.is_dir():
        raise SystemExit(
            f"error: no {churn_data}: raydlrm data generate --config {args.churn_config}"
        )
    if "movielens" in args.parts and not (root / "data/movielens/train").is_dir():
        raise SystemExit("error: no data/movielens/train: python benchmarks/movielens.py")
    out: dict[str, Any] = {"args": vars(args), "churn": [], "movielens": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="managed-quality-", dir=args.work) as tmp:
        work = Path(tmp)

        def save() -> None:
            out["total_s"] = time.perf_counter() - started
            out["load_average_end"] = os.getloadavg()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))

        if "churn" in args.parts:
            base = tomllib.loads(Path(args.churn_config).read_text())
            configs = {}
            for variant in args.variants:
                for seed in args.seeds:
                    chain = work / "churn" / f"{variant}-s{seed}"
                    chain.mkdir(parents=True)
                    configs[(variant, seed)] = churn_config(base, variant, seed, chain, churn_data)
            for seed in args.seeds:
                for i, slot in enumerate(args.slots):
                    shift = (i + seed) % len(args.variants)
                    order = args.variants[shift:] + args.variants[:shift]
                    for variant in order:
                        row = run_slot(configs[(variant, seed)], variant, seed, slot)
                        if args.seen_split and slot == args.slots[-1] and row["model_uri"]:
                            row["seen_split"] = seen_split(
                                configs[(variant, seed)],
                                slot,
                                row["model_uri"],
                                work / "churn" / f"{variant}-s{seed}" / "seen_split",
                            )
                        out["churn"].append(row)
                        save()
        if "movielens" in args.parts:
            base = tomllib.loads(Path(args.movielens_config).read_text())
            for seed in args.seeds:
                shift = seed % len(MOVIELENS_VARIANTS)
                order = MOVIELENS_VARIANTS[shift:] + MOVIELENS_VARIANTS[:shift]
                for variant in order:
                    run_dir = work / "movielens" / f"{variant}-s{seed}"
                    run_dir.mkdir(parents=True)
                    config = movielens_config(base, variant, seed, run_dir, root)
                    out["movielens"].append(run_movielens(config, variant, seed))
                    save()
        save()
    ray.shutdown()
    report(out)
    print(f"\ntotal {out['total_s'] / 60:.1f} min; wrote {args.out}")


if __name__ == "__main__":
    main()
