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

``--shipped`` trains the config as it is (no sweep; ``--set`` overrides, e.g. to compare a
setting) with ``--seeds`` seeds on the whole training data, for each architecture:

    .venv/bin/python benchmarks/quality.py --configs configs/adult.toml --archs dlrm \\
        --shipped --set data.dense_buckets=0 --out /tmp/bench/shipped.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

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
):
    data = raydlrm.load_config(config).data
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
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench/quality.json"))
    args = parser.parse_args()
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
