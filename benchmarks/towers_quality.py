"""Disaggregated Multi-Tower's accuracy (issue 31): the flat model against towers from the
partitioner (``model.towers = "auto"``) and random towers, side by side, 3 seeds each.

On each data set (``--datasets``): ``synthetic`` (the quickstart's Criteo-shaped data, one
planted pair interaction), ``higher-order`` (the same with planted interactions of 3 and 4
features, half the logit's variance) and ``adult`` (``configs/adult.toml``; write the data
first with ``benchmarks/adult.py``), every variant trains with ``--seeds`` seeds on 2 workers
as 2 hosts of one rank (``scaling.ranks_per_host = 1``), with ``--towers`` towers of
``--tower-vectors`` x ``embedding_dim`` compressed width, and is evaluated on the held-out data:

- ``flat``: no towers;
- ``auto``: the partitioner's towers (a warm-up of the flat model in the driver, the
  features' interaction strength, tables grouped into towers balanced by lookups);
- ``random``: the tables dealt at random into as many towers (a seeded shuffle, round robin).

It prints and writes (``--out``) each run's eval AUC, the towers, each variant's mean and
deviation, and the per-host load imbalance (the most lookups per sample on a host over the
mean).

    .venv/bin/python benchmarks/towers_quality.py --out /tmp/bench/towers_quality.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import raydlrm
from raydlrm.platform.config import load_config
from raydlrm.trainers.checkpoints import read_state_file

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = [
    "data.synthetic.num_train_rows=60000",
    "data.synthetic.num_eval_rows=20000",
    "data.synthetic.rows_per_file=10000",
    "data.table_size=20000",
    "data.batch_size=512",
]
DATASETS = {
    "synthetic": ("configs/quickstart.toml", SYNTHETIC),
    "higher-order": (
        "configs/quickstart.toml",
        [
            *SYNTHETIC,
            "data.synthetic.interaction_orders=[3, 4]",
            "data.synthetic.interaction_share=0.5",
        ],
    ),
    "adult": ("configs/adult.toml", []),
}


def _lookups(config: str, overrides: list[str]) -> dict[str, float]:
    """Each table's ids per sample (its features' mean bag lengths; a single id or a bucket
    table: 1), from the training data's first file."""
    job = load_config(config, overrides=overrides)
    files = sorted(Path(job.data.train_path).rglob("*.parquet"))
    table = pq.read_table(files[0]) if files else None

    def ids(column: str) -> float:
        if table is None or column not in table.column_names:
            return 1.0
        values = table.column(column)
        if not pa.types.is_list(values.type):
            return 1.0
        return pc.mean(pc.fill_null(pc.list_value_length(values), 0)).as_py()

    return {
        name: sum(ids(c) for c in columns) for name, columns in job.data.table_columns().items()
    }


def _random_towers(config: str, overrides: list[str], num: int, seed: int) -> list[list[str]]:
    tables = list(load_config(config, overrides=overrides).data.table_columns().values())
    random.Random(seed).shuffle(tables)
    return [[f for cols in tables[i::num] for f in cols] for i in range(num)]


def _imbalance(
    towers: list[list[str]], table_lookups: dict[str, float], config, overrides
) -> float:
    columns = load_config(config, overrides=overrides).data.table_columns()
    by_feature = {c: table_lookups[t] / len(cols) for t, cols in columns.items() for c in cols}
    hosts = [0.0, 0.0]
    for i, tower in enumerate(towers):
        hosts[i % 2] += sum(by_feature[f] for f in tower)
    return max(hosts) / statistics.mean(hosts)


def run(dataset: str, args, work: Path) -> dict:
    config, extra = DATASETS[dataset]
    config = str(ROOT / config)
    dim = load_config(config).model.embedding_dim
    base = [
        *extra,
        "scaling.num_workers=2",
        "scaling.ranks_per_host=1",
        f"run.storage_path={json.dumps(str(work / 'runs'))}",
        f"tracking.tracking_uri={json.dumps('sqlite:///' + str(work / 'mlflow.db'))}",
        "tracking.registered_model_name=null",
        *([f"model.arch={json.dumps(args.arch)}"] if args.arch else []),
    ]
    if dataset != "adult":
        base += [
            f"data.train_path={json.dumps(str(work / dataset / 'train'))}",
            f"data.eval_path={json.dumps(str(work / dataset / 'eval'))}",
        ]
    towers = [f"model.num_towers={args.towers}", f"model.tower_dim={args.tower_vectors * dim}"]
    out = {"config": config, "overrides": base, "runs": []}
    lookups = None
    for seed in range(args.seeds):
        variants = {"flat": [], "auto": ['model.towers="auto"', *towers]}
        for variant in args.variants:
            overrides = [*base, f"training.seed={seed}"]
            if variant == "random":  # after flat: the data exists
                chosen = _random_towers(config, base, args.towers, seed)
                overrides += [f"model.towers={json.dumps(chosen)}", *towers]
            else:
                overrides += variants[variant]
            name = f"{dataset}-{variant}-{seed}"
            started = time.perf_counter()
            result = raydlrm.train(config, overrides=[*overrides, f"run.name={json.dumps(name)}"])
            made = read_state_file(result.checkpoint_path)["spec"]["model"]["towers"]
            lookups = lookups or _lookups(config, base)
            row = {
                "dataset": dataset,
                "variant": variant,
                "seed": seed,
                "eval_auc": result.metrics["eval/auc"],
                "towers": made,
                "host_imbalance": None if made is None else _imbalance(made, lookups, config, base),
                "seconds": time.perf_counter() - started,
            }
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for variant in args.variants:
        aucs = [r["eval_auc"] for r in out["runs"] if r["variant"] == variant]
        imb = [r["host_imbalance"] for r in out["runs"] if r["variant"] == variant]
        summary[variant] = {
            "mean": statistics.mean(aucs),
            "stdev": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
            "host_imbalance": None if imb[0] is None else statistics.mean(imb),
        }
    for variant in [v for v in args.variants if v != "flat"]:
        diffs = [
            a["eval_auc"] - f["eval_auc"]
            for a in out["runs"]
            if a["variant"] == variant
            for f in out["runs"]
            if f["variant"] == "flat" and f["seed"] == a["seed"]
        ]
        summary[variant]["minus_flat"] = statistics.mean(diffs)
    out["summary"] = summary
    print(dataset, json.dumps(summary), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--tower-vectors", type=int, default=2)
    parser.add_argument("--arch", default=None, help="model.arch (default: the config's)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["flat", "auto", "random"],
        choices=["flat", "auto", "random"],
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="towers-quality-"))
    results = {"args": vars(args) | {"out": str(args.out)}, "datasets": []}
    for dataset in args.datasets:
        results["datasets"].append(run(dataset, args, work))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
