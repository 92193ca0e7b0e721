"""RecD end to end: ``raydlrm train`` with and without deduplication, ingestion included.

The RecD-shaped synthetic data of ``configs/recd.toml`` (user-history id lists repeated by every
sample of a session), generated sample-level and converted to the session-clustered layout
(``raydlrm data cluster``), trained by the real job (``raydlrm.train``: Ray Data preprocessing,
2 Ray Train workers, MLflow) three ways, same model, seed and samples, repeats interleaved (the
order rotates):

- ``plain``: the sample-level set, no dedup groups;
- ``dedup``: the sample-level set, the user features deduplicated (keyed per row on the
  preprocessing actors, one ``np.unique`` per batch in the loader, looked up and exchanged on
  unique rows);
- ``recd``: the clustered set, ``data.dedup = "infer"`` (its per-session columns): the user
  features read, checked and hashed once per session and carried as dictionaries.
- ``clustered`` (not run by default): the clustered set without dedup groups (the user
  features expanded per sample after reading): ``recd``'s batches, trained as ``plain`` does.

All three evaluate on the same sample-level held-out set. Reported per variant (medians):
``train/samples_per_second`` (samples over the training steps' wall time, each step with its
wait for data: ingestion included, start-up and evaluation not), the job's wall time, eval AUC
and log loss, the final ``train/loss``, the embedding all-to-all bytes per sample, the dedup
ratio; and the ratios to ``plain`` (the median of the per-repeat ratios). Usage::

    python benchmarks/recd_train.py [--repeats 3] [--data DIR] [--set key=value ...]
        [--variants plain,dedup,recd]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "recd.toml"


def _data(root: Path, job) -> dict[str, Path]:
    """The sample-level training and held-out sets and the clustered training set (made when
    missing)."""
    from raydlrm.ingestion import generate_synthetic
    from raydlrm.ingestion.clustering import cluster_data
    from raydlrm.platform.config import replaced

    info = generate_synthetic(job.data.synthetic, out_dir=root / "samples")
    clustered = root / "clustered"
    if not (clustered / "_clustered.json").exists():
        users = [job.data.sparse_columns[i] for i in range(job.data.synthetic.num_user_features)]
        config = replaced(job.data, train_path=str(info.train_path), dedup_groups=[users])
        cluster_data(str(info.train_path), config, out=str(clustered))
    return {"samples": info.train_path, "eval": info.eval_path, "clustered": clustered}


def _variant(job, name: str, paths: dict[str, Path], root: Path, repeat: int):
    from raydlrm.platform.config import replaced

    users = [job.data.sparse_columns[i] for i in range(job.data.synthetic.num_user_features)]
    data = {
        "plain": {"train_path": str(paths["samples"]), "dedup": "groups", "dedup_groups": []},
        "dedup": {"train_path": str(paths["samples"]), "dedup": "groups", "dedup_groups": [users]},
        "recd": {"train_path": str(paths["clustered"]), "dedup": "infer", "dedup_groups": []},
        "clustered": {"train_path": str(paths["clustered"]), "dedup": "groups", "dedup_groups": []},
    }[name]
    return replaced(
        job,
        data=replaced(job.data, eval_path=str(paths["eval"]), **data),
        run=replaced(job.run, storage_path=str(root / "runs"), name=f"{name}-{repeat}"),
        tracking=replaced(
            job.tracking,
            tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
            registered_model_name=None,
        ),
    )


def _run(job) -> dict[str, float]:
    import raydlrm

    start = time.perf_counter()
    result = raydlrm.train(job)
    seconds = time.perf_counter() - start
    m = result.metrics
    a2a = sum(v for k, v in m.items() if k.startswith("comm/") and k.endswith("_bytes"))
    ratios = [v for k, v in m.items() if k.startswith("dedup/") and k.endswith("/ratio")]
    return {
        "samples_per_s": m["train/samples_per_second"],
        "job_s": seconds,
        "auc": m["eval/auc"],
        "log_loss": m["eval/log_loss"],
        "train_loss": m["train/loss"],
        "first_batch_s": m.get("data/first_batch_seconds", float("nan")),
        "a2a_bytes": a2a,
        "dedup_ratio": statistics.mean(ratios) if ratios else 1.0,
    }


def _report(results: dict[str, list[dict[str, float]]], job, samples: int) -> None:
    names = list(results)
    print(
        f"\n{job.scaling.num_workers} workers, {job.model.arch} dim {job.model.embedding_dim}, "
        f"batch {job.data.batch_size} per worker, {job.training.num_epochs} epoch(s) of "
        f"{samples:,} samples, {len(results[names[0]])} interleaved repeats"
    )
    print(
        "\n| variant | samples/s (training) | job s | eval AUC | eval log loss | train loss "
        "| first batch s | a2a bytes/sample | dedup ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    seen = samples * job.training.num_epochs
    for name, runs in results.items():

        def med(key: str, runs=runs) -> float:
            return statistics.median(r[key] for r in runs)

        print(
            f"| {name} | {med('samples_per_s'):,.0f} | {med('job_s'):.1f} | {med('auc'):.5f} "
            f"| {med('log_loss'):.5f} | {med('train_loss'):.5f} | {med('first_batch_s'):.1f} "
            f"| {med('a2a_bytes') / seen:,.0f} | {med('dedup_ratio'):.2f} |"
        )
    base = results.get("plain")
    if base is None:
        return
    for name in names:
        if name == "plain":
            continue
        runs = results[name]
        speed = [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(runs, base, strict=True)]
        job_s = [b["job_s"] / r["job_s"] for r, b in zip(runs, base, strict=True)]
        auc = max(abs(r["auc"] - b["auc"]) for r, b in zip(runs, base, strict=True))
        loss = max(abs(r["train_loss"] - b["train_loss"]) for r, b in zip(runs, base, strict=True))
        print(
            f"{name} / plain: training throughput {statistics.median(speed):.2f}x, job wall "
            f"time {statistics.median(job_s):.2f}x; |eval AUC difference| max {auc:.2e}; "
            f"|final train loss difference| max {loss:.2e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", type=Path, default=None, help="data directory (kept)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    parser.add_argument("--variants", default="plain,dedup,recd")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    from raydlrm.platform.config import load_config

    # 2 epochs of ~12 steps: the loss is logged every 6 steps (the preset logs every 50).
    overrides = ["training.num_epochs=2", "training.log_every_steps=6", *args.set]
    job = load_config(CONFIG, overrides=overrides)
    root = args.data or Path(tempfile.mkdtemp(prefix="recd-train-"))
    paths = _data(root, job)
    names = args.variants.split(",")
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            out = _run(_variant(job, name, paths, root, repeat))
            print(f"repeat {repeat} {name}: {json.dumps(out)}", flush=True)
            results[name].append(out)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    _report(results, job, job.data.synthetic.num_train_rows)


if __name__ == "__main__":
    main()
