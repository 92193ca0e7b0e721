"""End to end: ``raydlrm train`` with the analytic planner's plan against the learned one's.

A 60-table synthetic data set (``configs/quickstart.toml`` widened: 60 categorical columns, 30
of them id lists of up to 30 ids, tables of 10^3 to 10^6 rows log-spaced, ids power-law), DLRM
with 64-wide embeddings, ``sharding.default_type = "auto"``, 2 Ray Train workers, 256 samples a
worker (a global batch of 512, what the learned model was measured at). The same job trained
with ``sharding.cost_model = "analytic"`` (calibrated constants when ``--constants`` is given)
and ``"neural"`` (the model at ``--model``), repeats interleaved; reported per variant
(medians): the plans' shapes, ``train/samples_per_second`` (the training steps' wall time, data
waits included) and the job's wall time, and the ratio neural / analytic. Usage::

    python benchmarks/neural_train.py --model ~/.cache/raydlrm/learned_cost.json \
        [--constants ~/.cache/raydlrm/cost_constants.json] [--repeats 2] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"
TABLES = 60


def _overrides(args) -> list[str]:
    sizes = [round(10 ** (3 + 3 * i / (TABLES - 1))) for i in range(TABLES)]
    table_sizes = "{" + ", ".join(f"C{i + 1} = {n}" for i, n in enumerate(sizes)) + "}"
    columns = "[" + ", ".join(f'"C{i + 1}"' for i in range(TABLES)) + "]"
    return [
        f"data.sparse_columns={columns}",
        f"data.synthetic.num_sparse={TABLES}",
        "data.synthetic.num_list_features=30",
        "data.synthetic.max_list_length=30",
        "data.synthetic.max_cardinality=1000000",
        "data.synthetic.num_user_features=0",
        f"data.synthetic.num_train_rows={args.rows}",
        "data.synthetic.num_eval_rows=5000",
        "data.synthetic.rows_per_file=20000",
        "data.batch_size=256",  # x 2 workers: the learned model's global batch of 512
        f"data.table_sizes={table_sizes}",
        "model.embedding_dim=64",
        "model.bottom_mlp=[64, 64]",
        "sharding.default_type=auto",
        f'sharding.learned_cost_path="{args.model}"',
        *([f'sharding.cost_constants_path="{args.constants}"'] if args.constants else []),
        "training.log_every_steps=50",
    ]


def _run(job) -> dict:
    import raydlrm

    start = time.perf_counter()
    result = raydlrm.train(job)
    return {
        "samples_per_s": result.metrics["train/samples_per_second"],
        "job_s": time.perf_counter() - start,
        "auc": result.metrics["eval/auc"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--constants", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--data", type=Path, default=None, help="data directory (kept)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from raydlrm.ingestion import generate_synthetic
    from raydlrm.platform.config import load_config, replaced
    from raydlrm.platform.job_data import data_shape, validate_job_data
    from raydlrm.platform.preflight import make_plan

    root = args.data or Path(tempfile.mkdtemp(prefix="neural-train-"))
    job = load_config(CONFIG, overrides=_overrides(args))
    info = generate_synthetic(job.data.synthetic, out_dir=root / "data")
    job = replaced(
        job,
        data=replaced(job.data, train_path=str(info.train_path), eval_path=str(info.eval_path)),
        tracking=replaced(
            job.tracking, tracking_uri=f"sqlite:///{root / 'mlflow.db'}", registered_model_name=None
        ),
    )
    variants = {
        name: replaced(job, sharding=replaced(job.sharding, cost_model=name))
        for name in ("analytic", "neural")
    }
    for name, variant in variants.items():
        plan = make_plan(variant, shape=data_shape(variant, validate_job_data(variant)))
        kinds: dict[str, int] = {}
        for t in plan.tables:
            kinds[t.sharding_type] = kinds.get(t.sharding_type, 0) + 1
        print(
            f"{name} plan: {kinds}; tables a rank {[len(plan.tables_on_rank(r)) for r in range(2)]}"
            f"; per rank ({plan.cost_model} s) {[f'{c:.4g}' for c in plan.per_rank_cost()]}"
        )
    results: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(args.repeats):
        for name in names[repeat % 2 :] + names[: repeat % 2]:
            run = replaced(
                variants[name],
                run=replaced(job.run, storage_path=str(root / "runs"), name=f"{name}-{repeat}"),
            )
            out = _run(run)
            print(f"repeat {repeat} {name}: {json.dumps(out)}", flush=True)
            results[name].append(out)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    for name, runs in results.items():
        print(
            f"| {name} | {statistics.median(r['samples_per_s'] for r in runs):,.0f} samples/s "
            f"| job {statistics.median(r['job_s'] for r in runs):.1f} s "
            f"| eval AUC {statistics.median(r['auc'] for r in runs):.4f} |"
        )
    ratio = [
        n["samples_per_s"] / a["samples_per_s"]
        for n, a in zip(results["neural"], results["analytic"], strict=True)
    ]
    print(f"neural / analytic training throughput: median {statistics.median(ratio):.3f}x")


if __name__ == "__main__":
    main()
