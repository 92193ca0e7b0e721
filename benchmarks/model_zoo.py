"""DLRM, DCNv2, Wukong and DHEN side by side: eval AUC and log loss, throughput, parameters.

Every (data set, architecture, seed) trains with ``raydlrm.train`` on ``--workers`` CPU workers
in one local Ray instance (started once), the runs interleaved seed by seed so that a change
in the machine's load falls on every architecture alike:

- ``synthetic``: ``configs/quickstart.toml``'s data (generated on first use), ``--epochs`` epochs;
- ``synthetic-ho``: the same generator with higher-order planted interactions
  (:data:`SYNTHETIC_HO`: a pairwise, a three-way and a four-way product of per-id factors, half
  of the logit's variance) and 1,000,000 training rows, where the order of the interactions a
  model expresses shows (generated on first use into ``data/synthetic-ho``);
- ``adult``: ``configs/adult.toml`` (the Adult census-income table; write it first with
  ``python benchmarks/adult.py``), its own epochs.

Each architecture's knobs are :data:`ARCH_KNOBS` (sized to comparable dense parameter counts
at the data set's embedding dim; the models' tables are identical). Reported per data set and
architecture: eval AUC and log loss (mean and the spread, max - min, over the seeds), training
samples per second (the run's ``train/samples_per_second``, median over the seeds), dense and
embedding parameters. ``--sweep`` adds a Wukong scaling sweep (quality against layers and
width) on ``--sweep-dataset`` (default ``synthetic-ho``).

Usage::

    python benchmarks/model_zoo.py [--datasets synthetic,adult] [--archs dlrm,dcnv2,wukong,dhen]
        [--seeds 0,1,2] [--workers 2] [--epochs 1] [--sweep] [--sweep-dataset synthetic-ho]
        [--out /tmp/model_zoo.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "synthetic": ROOT / "configs" / "quickstart.toml",
    "synthetic-ho": ROOT / "configs" / "quickstart.toml",
    "adult": ROOT / "configs" / "adult.toml",
}
# The higher-order variant: the quickstart's tables and batch, five times the training rows, and
# half the planted logit's variance in a pairwise, a three-way and a four-way product of per-id
# factors (its own directory).
SYNTHETIC_HO = {
    "train_path": "data/synthetic-ho/train",
    "eval_path": "data/synthetic-ho/eval",
    "synthetic": {
        "generate": "if_missing",
        "num_train_rows": 1_000_000,
        "rows_per_file": 100_000,
        "interaction_orders": [2, 3, 4],
        "interaction_share": 0.5,
    },
}

# Each architecture's own knobs; every one has a bottom MLP [64, D] and a top MLP [64, 32].
ARCH_KNOBS = {
    "dlrm": {},
    "dcnv2": {"dcn_num_layers": 2, "dcn_low_rank": 16},
    "wukong": {
        "wukong_num_layers": 2,
        "wukong_num_fm": 8,
        "wukong_num_lc": 8,
        "wukong_rank": 8,
        "wukong_fm_mlp": [64],
    },
    # cross, attention and conv modules: a dense side near DCNv2's and Wukong's size (the dot
    # and linear modules each map all n x d values at once, ~13x the parameters).
    "dhen": {
        "dhen_layers": [["cross", "attention", "conv"]] * 2,
        "dcn_low_rank": 16,
        "dhen_attention_heads": 2,
    },
}


def _model(arch: str, dim: int) -> dict:
    """The ``[model]`` knobs of ``arch`` at embedding dim ``dim``."""
    return {"arch": arch, "bottom_mlp": [64, dim], "top_mlp": [64, 32], **ARCH_KNOBS[arch]}


SWEEP = [
    {"wukong_num_layers": layers, "wukong_num_fm": width, "wukong_num_lc": width}
    for layers in (1, 2, 3)
    for width in (4, 8, 16)
]


def _config(dataset: str, model: dict, *, seed: int, workdir: Path, epochs: int | None) -> dict:
    config = tomllib.loads(CONFIGS[dataset].read_text())
    if dataset == "synthetic-ho":
        config["data"].update(
            SYNTHETIC_HO, synthetic={**config["data"]["synthetic"], **SYNTHETIC_HO["synthetic"]}
        )
    for section in ("train_path", "eval_path"):  # paths relative to the repository
        config["data"][section] = str(ROOT / config["data"][section])
    config["model"] = {"embedding_dim": config["model"]["embedding_dim"], **model}
    config["training"]["seed"] = seed
    config["training"]["log_every_steps"] = 100
    if epochs is not None:
        config["training"]["num_epochs"] = epochs
    config["run"] = {"storage_path": str(workdir / "runs"), "progress": "off"}
    config["tracking"] = {
        "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}",
        "experiment_name": f"model-zoo-{dataset}",
        "registered_model_name": None,
    }
    config["ray"] = {"include_dashboard": False, "log_to_driver": False}
    return config


def _parameters(config: dict) -> tuple[int, int]:
    """(dense, embedding) parameters of the config's model, counted on the meta device."""
    from raydlrm import load_config
    from raydlrm.models import build_model

    spec = load_config(config).worker_spec()
    model = build_model(
        spec.model,
        tables=spec.tables(),
        num_dense=spec.data.num_dense_inputs(),
        device="meta",
    )
    dense = sum(p.numel() for p in model.dense.parameters())
    embedding = sum(t.num_embeddings * t.embedding_dim for t in spec.tables())
    return dense, embedding


def _train(config: dict, workers: int) -> dict:
    import raydlrm

    config = copy.deepcopy(config)
    config["scaling"] = {"num_workers": workers, "resources_per_worker": {"CPU": 0.5}}
    start = time.perf_counter()
    result = raydlrm.train(config)
    metrics = result.metrics
    return {
        "auc": metrics["eval/auc"],
        "log_loss": metrics["eval/log_loss"],
        "samples_per_s": metrics["train/samples_per_second"],
        "wall_s": time.perf_counter() - start,
    }


def _summary(runs: list[dict]) -> dict:
    auc = [r["auc"] for r in runs]
    loss = [r["log_loss"] for r in runs]
    return {
        "auc_mean": statistics.fmean(auc),
        "auc_spread": max(auc) - min(auc),
        "log_loss_mean": statistics.fmean(loss),
        "log_loss_spread": max(loss) - min(loss),
        "samples_per_s_median": statistics.median(r["samples_per_s"] for r in runs),
        "seeds": len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="synthetic,synthetic-ho,adult")
    parser.add_argument("--archs", default=",".join(ARCH_KNOBS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1, help="epochs on the synthetic data")
    parser.add_argument("--sweep", action="store_true", help="add the Wukong scaling sweep")
    parser.add_argument("--sweep-dataset", default="synthetic-ho", choices=sorted(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/raydlrm-model-zoo.json"))
    args = parser.parse_args()

    import ray

    from raydlrm.platform.ray_init import LOCAL_RAY_ENV

    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    seeds = [int(s) for s in args.seeds.split(",")]
    archs = args.archs.split(",")
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "zoo": {}, "sweep": []}
    with tempfile.TemporaryDirectory(prefix="raydlrm-zoo-") as tmp:
        workdir = Path(tmp)
        for dataset in args.datasets.split(","):
            dim = tomllib.loads(CONFIGS[dataset].read_text())["model"]["embedding_dim"]
            epochs = args.epochs if dataset.startswith("synthetic") else None
            runs: dict[str, list[dict]] = {a: [] for a in archs}
            for seed in seeds:  # interleaved: every architecture once per seed
                for arch in archs:
                    config = _config(
                        dataset, _model(arch, dim), seed=seed, workdir=workdir, epochs=epochs
                    )
                    run = _train(config, args.workers)
                    runs[arch].append(run)
                    print(
                        f"[{dataset}] {arch} seed {seed}: AUC {run['auc']:.4f}, log loss "
                        f"{run['log_loss']:.4f}, {run['samples_per_s']:,.0f} samples/s",
                        flush=True,
                    )
            for arch in archs:
                config = _config(dataset, _model(arch, dim), seed=0, workdir=workdir, epochs=epochs)
                dense, embedding = _parameters(config)
                results["zoo"].setdefault(dataset, {})[arch] = {
                    **_summary(runs[arch]),
                    "dense_parameters": dense,
                    "embedding_parameters": embedding,
                    "runs": runs[arch],
                }
            args.out.write_text(json.dumps(results, indent=1))
        if args.sweep:
            dataset = args.sweep_dataset
            dim = tomllib.loads(CONFIGS[dataset].read_text())["model"]["embedding_dim"]
            epochs = args.epochs if dataset.startswith("synthetic") else None
            for knobs in SWEEP:
                model = {**_model("wukong", dim), **knobs}
                config = _config(dataset, model, seed=0, workdir=workdir, epochs=epochs)
                run = {**_train(config, args.workers), **knobs}
                run["dense_parameters"] = _parameters(config)[0]
                results["sweep"].append(run)
                print(f"[sweep {dataset}] {knobs}: AUC {run['auc']:.4f}", flush=True)
                args.out.write_text(json.dumps(results, indent=1))
    ray.shutdown()

    print(
        f"\n{args.workers} CPU workers; AUC and log loss: mean (spread = max - min) over seeds "
        f"{args.seeds}; samples/s: median"
    )
    print(
        "| data | model | eval AUC | eval log loss | train samples/s | dense params | "
        "embedding params |"
    )
    print("|---|---|---|---|---|---|---|")
    for dataset, per_arch in results["zoo"].items():
        for arch, r in per_arch.items():
            print(
                f"| {dataset} | {arch} | {r['auc_mean']:.4f} ({r['auc_spread']:.4f}) | "
                f"{r['log_loss_mean']:.4f} ({r['log_loss_spread']:.4f}) | "
                f"{r['samples_per_s_median']:,.0f} | {r['dense_parameters']:,} | "
                f"{r['embedding_parameters']:,} |"
            )
    if results["sweep"]:
        print(f"\nWukong sweep on {args.sweep_dataset}:")
        print("| Wukong layers | n_F = n_L | dense params | eval AUC | eval log loss |")
        print("|---|---|---|---|---|")
        for r in results["sweep"]:
            print(
                f"| {r['wukong_num_layers']} | {r['wukong_num_fm']} | {r['dense_parameters']:,} "
                f"| {r['auc']:.4f} | {r['log_loss']:.4f} |"
            )
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
