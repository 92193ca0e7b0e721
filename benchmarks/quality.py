"""Model quality on real tables: each raydlrm architecture tuned with ``raydlrm.tune`` against
a tuned GBDT and a factorization machine (``benchmarks/baselines.py``), issue 32.

For each ``--configs`` data set and each ``--archs`` architecture, the same protocol as the
baselines: a sweep of ``--trials`` trials (ASHA on the eval AUC every ``--eval-every`` steps)
trained on ``fit/`` and evaluated on ``valid/`` (a fifth of the training data,
:func:`baselines.validation_split`), then the best trial's values trained on the whole training
data with ``--seeds`` seeds and measured on the eval data. The search space is the same for every
architecture (the dense and embedding learning rates, the epochs) plus one architecture key
(``ARCH_SPACE``); the embedding dim is the config's (DLRM's dot interaction ties it to the
bottom MLP's last width, which a search of one key cannot follow).

    .venv/bin/python benchmarks/quality.py --configs configs/adult.toml configs/movielens.toml \\
        --trials 12 --out /tmp/bench/quality.json

``--search key=distribution`` adds a key to the space or replaces the key's range (e.g. a wider
``sharding.learning_rate``, or ``model.embedding_dim`` for an architecture not tied to the bottom
MLP); ``--set`` overrides go to every run (e.g. ``tune.grace_period=3``).

``--valid-split time`` tunes on a split by time instead (for data whose eval split is by time):
per user (``--user-column``), the last ``--valid-fraction`` (default 0.1, at least 1) of the user's
training rows by ``--time-column`` are ``valid/``, the rest ``fit/``
(:func:`time_validation_split`; written beside the training data as ``fit_by_time/`` and
``valid_by_time/``, kept while the training data is unchanged), so the sweep picks the
settings that predict the future. MovieLens as ``benchmarks/movielens.py`` writes it by default
(``data/movielens``, split by time) or ``benchmarks/ordered_data.py``'s copy (``--set`` the
paths; the split is made from the data the overrides name):

    .venv/bin/python benchmarks/quality.py --configs configs/movielens.toml --archs dcnv2 \\
        --valid-split time --time-column timestamp --user-column user_id \\
        --set 'tune.scheduler="fifo"' \\
        [--set data.train_path='"data/ordered/movielens/train_sorted"' \\
         --set data.eval_path='"data/ordered/movielens/eval"']

``--shipped`` trains the config as it is (no sweep; ``--set`` overrides, e.g. to compare a
setting) with ``--seeds`` seeds on the whole training data, for each architecture:

    .venv/bin/python benchmarks/quality.py --configs configs/adult.toml --archs dlrm \\
        --shipped --set data.dense_buckets=0 --out /tmp/bench/shipped.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from baselines import validation_split

import raydlrm

COMMON_SPACE = [
    "training.learning_rate=loguniform(3e-4, 1e-2)",
    "sharding.learning_rate=loguniform(0.01, 0.3)",
    "training.num_epochs=choice(1, 2, 3, 5)",
]
ARCH_SPACE = {
    "dlrm": ["model.top_mlp=choice([64, 32], [128, 64], [256, 128, 64])"],
    "dcnv2": ["model.dcn_num_layers=choice(2, 3, 4)"],
    "wukong": ["model.wukong_num_layers=choice(1, 2, 3)"],
    "dhen": ["model.dhen_attention_heads=choice(1, 2, 4)"],
}


def _overrides(values: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def space(arch: str, extra: list[str]) -> list[str]:
    """The search space of ``arch``: the common keys and its own, ``extra`` expressions added or
    replacing the expression of the same key."""
    by_key = {e.partition("=")[0]: e for e in [*COMMON_SPACE, *ARCH_SPACE[arch], *extra]}
    return list(by_key.values())


TIME_SPLIT_DIRS = ("fit_by_time", "valid_by_time")
_TIME_SPLIT_STAMP = "by_time.json"


def _source_stamp(path: Path) -> list:
    """The training files' names, sizes and modification times (a changed file: a new split)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.parquet"))
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def time_validation_split(
    data, *, time_column: str, user_column: str, fraction: float = 0.1
) -> tuple[str, str]:
    """``fit_by_time/`` and ``valid_by_time/`` beside the training data: of each user's rows
    (``user_column``) sorted by ``time_column`` (the file order breaks ties), the last
    ``fraction`` (at least 1, as the eval split of ``benchmarks/ordered_data.py`` and
    ``benchmarks/movielens.py``) are held out. Both keep the training data's row order and
    row groups of 2,048 rows. Written once and kept while the training files and ``fraction``
    are those they were made from (``by_time.json`` beside them), returned as paths."""
    source = Path(data.train_path)
    root = source.parent
    fit, valid = (root / d for d in TIME_SPLIT_DIRS)
    stamp = {
        "source": _source_stamp(source),
        "time_column": time_column,
        "user_column": user_column,
        "fraction": fraction,
    }
    done = root / _TIME_SPLIT_STAMP
    if done.exists() and json.loads(done.read_text()) == stamp:
        return str(fit), str(valid)
    done.unlink(missing_ok=True)  # incomplete until written again
    table = pq.read_table(data.train_path)
    missing = [c for c in (time_column, user_column) if c not in table.column_names]
    if missing:
        raise SystemExit(
            f"error: {data.train_path} has no column(s) {missing} (--valid-split time)"
        )
    users = table[user_column].to_numpy()
    order = np.lexsort((np.arange(table.num_rows), table[time_column].to_numpy(), users))
    ranked = users[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    counts = np.diff(np.r_[starts, len(ranked)])
    held = np.maximum(1, np.round(counts * fraction)).astype(np.int64)
    position = np.arange(len(ranked)) - np.repeat(starts, counts)
    is_valid = np.zeros(table.num_rows, dtype=bool)
    is_valid[order] = position >= np.repeat(counts - held, counts)
    for path, rows in ((valid, is_valid), (fit, ~is_valid)):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        pq.write_table(
            table.filter(pa.array(rows)), path / "part-00000.parquet", row_group_size=2048
        )
    done.write_text(json.dumps(stamp, indent=1) + "\n")  # last: the split is complete
    print(
        f"time split of {data.train_path}: {int((~is_valid).sum()):,} fit / "
        f"{int(is_valid.sum()):,} valid rows ({len(starts):,} users) -> {root}",
        flush=True,
    )
    return str(fit), str(valid)


def quality(
    config: str,
    arch: str,
    *,
    trials: int,
    seeds: int,
    eval_every: int,
    tag: str,
    search: list[str],
    overrides: list[str],
    valid_split: str = "random",
    time_column: str = "timestamp",
    user_column: str = "user_id",
    valid_fraction: float | None = None,
):
    data = raydlrm.load_config(config, overrides=overrides).data
    if valid_split == "time":
        fit, valid = time_validation_split(
            data,
            time_column=time_column,
            user_column=user_column,
            fraction=0.1 if valid_fraction is None else valid_fraction,
        )
    else:
        fit, valid = validation_split(data)
    name = f"quality-{tag}-{Path(config).stem}-{arch}"
    base = [*_base(arch, name), *overrides]
    start = time.perf_counter()
    sweep = raydlrm.tune(
        config,
        overrides=[
            *base,
            f"data.train_path={json.dumps(fit)}",
            f"data.eval_path={json.dumps(valid)}",
            f"training.eval_every_steps={eval_every}",
            f"run.name={json.dumps(name)}",
        ],
        search=space(arch, search),
        num_trials=trials,
    )
    sweep_s = time.perf_counter() - start
    print(sweep.summary, flush=True)
    runs = _seeds(config, [*base, *_overrides(sweep.best_config)], seeds=seeds, name=name)
    return {
        "config": config,
        "arch": arch,
        "best_config": sweep.best_config,
        "valid_split": valid_split,
        "valid_auc": sweep.best_metrics.get("eval/auc"),
        **runs,
        "sweep_seconds": sweep_s,
        "trials": [{k: v for k, v in t.items() if k != "evaluations"} for t in sweep.trials],
    }


def _base(arch: str, name: str) -> list[str]:
    """The overrides every run of ``arch`` named ``name`` takes: the architecture, and a
    registered model of its own (runs do not add versions to the config's model)."""
    return [f"model.arch={json.dumps(arch)}", f"tracking.registered_model_name={json.dumps(name)}"]


def _seeds(config: str, overrides: list[str], *, seeds: int, name: str) -> dict:
    """The config with ``overrides`` trained with ``seeds`` seeds on the whole training data:
    each eval AUC, their mean and deviation."""
    aucs = []
    for seed in range(seeds):
        result = raydlrm.train(
            config,
            overrides=[
                *overrides,
                f"training.seed={seed}",
                f"run.name={json.dumps(f'{name}-final-{seed}')}",
            ],
        )
        aucs.append(result.metrics["eval/auc"])
        print(f"{name} seed {seed}: eval AUC {aucs[-1]:.4f}", flush=True)
    return {
        "eval_aucs": aucs,
        "mean": statistics.mean(aucs),
        "stdev": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
    }


def shipped(config: str, arch: str, *, seeds: int, overrides: list[str], tag: str) -> dict:
    """The config as it is (with ``overrides``), ``seeds`` seeds, on the train/eval split."""
    name = f"shipped-{tag}-{Path(config).stem}-{arch}"
    runs = _seeds(config, [*_base(arch, name), *overrides], seeds=seeds, name=name)
    return {"config": config, "arch": arch, "overrides": overrides, "best_config": {}, **runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--archs", default="dlrm,dcnv2,wukong,dhen")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--tag", default=time.strftime("%m%d%H%M"))
    parser.add_argument("--shipped", action="store_true", help="no sweep: the config as it is")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--search", action="append", default=[], help="key=distribution")
    parser.add_argument(
        "--valid-split",
        choices=["random", "time"],
        default="random",
        help="the tuning split of the training data: a random fifth, or per user the last rows",
    )
    parser.add_argument("--time-column", default="timestamp", help="--valid-split time")
    parser.add_argument("--user-column", default="user_id", help="--valid-split time")
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=None,
        help="--valid-split time: each user's share held out (default 0.1)",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/quality.json"))
    args = parser.parse_args()
    if args.valid_fraction is not None:
        if args.valid_split != "time":
            parser.error("--valid-fraction: only with --valid-split time (the random split is 0.2)")
        if not 0 < args.valid_fraction < 1:
            parser.error(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    results = []
    for config in args.configs:
        for arch in args.archs.split(","):
            if args.shipped:
                run = shipped(
                    config, arch, seeds=args.seeds, overrides=args.overrides, tag=args.tag
                )
            else:
                run = quality(
                    config,
                    arch,
                    trials=args.trials,
                    seeds=args.seeds,
                    eval_every=args.eval_every,
                    tag=args.tag,
                    search=args.search,
                    overrides=args.overrides,
                    valid_split=args.valid_split,
                    time_column=args.time_column,
                    user_column=args.user_column,
                    valid_fraction=args.valid_fraction,
                )
            results.append(run)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    print("\n| data | arch | eval AUC (mean of seeds) | sd | best values |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {Path(r['config']).stem} | {r['arch']} | {r['mean']:.4f} | {r['stdev']:.4f} | "
            f"{json.dumps(r['best_config'])} |"
        )


if __name__ == "__main__":
    main()
