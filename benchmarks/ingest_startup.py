"""Time to first batch of every pass over a data set, before and after the start-up fixes.

Mirrors a Ray Train job: a local Ray cluster, ``build_dataset`` for a train and an eval set,
``streaming_split(2, equal=True)`` consumed by 2 actors of 0.5 CPU (the train workers), several
epochs over the train split and a few passes over the eval split. Each variant runs in its own
process with its own Ray cluster (the settings must be in place before ``ray.init``) and is
repeated; the table shows medians.

Variants:

- ``before``: the pipeline as it was: a fixed pool of ``default_num_actors()`` preprocessing
  actors, Ray Data's default 32 Parquet footer-reader actors per pass, and a ``Preprocessor``
  whose import pulls torch and ``ray.data`` into every actor (the eager ``raydlrm.ingestion``).
- ``after``: :func:`raydlrm.ingestion.build_dataset` and the environment of
  :func:`raydlrm.platform.launch._init_ray` as they are now.

Usage::

    python benchmarks/ingest_startup.py [--repeats 3] [--epochs 3] [--eval-passes 2]
        [--num-cpus 4] [--variants before,after] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH_SIZE = 500
TABLE_SIZE = 2000
LEGACY_ENV = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "32"}  # Ray Data's default


def _make_data(root: Path, train_rows: int, eval_rows: int) -> None:
    from raydlrm.ingestion import SyntheticConfig, generate_synthetic

    generate_synthetic(
        SyntheticConfig(
            num_train_rows=train_rows,
            num_eval_rows=eval_rows,
            rows_per_file=10_000,
            max_cardinality=3000,
            seed=11,
        ),
        out_dir=root,
    )


def _child(variant: str, data: str, num_cpus: int, epochs: int, eval_passes: int) -> dict:
    if variant == "before":
        os.environ.update(LEGACY_ENV)
    else:
        from raydlrm.platform.launch import _LOCAL_RAY_ENV

        for name, value in _LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
    import ray
    import ray.data

    from raydlrm.ingestion.config import DataConfig

    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=400_000_000,
        include_dashboard=False,
        log_to_driver=False,
    )
    config = DataConfig(batch_size=BATCH_SIZE, table_size=TABLE_SIZE)

    if variant == "before":
        from raydlrm.ingestion.dataset import default_num_actors
        from raydlrm.ingestion.preprocess import Preprocessor
        from raydlrm.ingestion.schema import validate_data

        class EagerPreprocessor(Preprocessor):
            """The old import structure: unpickling Preprocessor imported torch and ray.data."""

            def __init__(self, config: DataConfig) -> None:
                import ray.data  # noqa: F401
                import torch  # noqa: F401

                super().__init__(config)

        def build(path: str) -> ray.data.Dataset:
            summary = validate_data(path, config)
            columns = [config.label_column, *config.dense_columns, *config.sparse_columns]
            if "sample_id" in summary.schema.names:
                columns.append("sample_id")
            return ray.data.read_parquet(path, columns=columns).map_batches(
                EagerPreprocessor,
                fn_constructor_kwargs={"config": config},
                batch_format="pyarrow",
                batch_size=config.preprocess_batch_size,
                compute=ray.data.ActorPoolStrategy(size=default_num_actors()),
                num_cpus=0.5,
            )
    else:
        from raydlrm.ingestion import build_dataset

        def build(path: str) -> ray.data.Dataset:
            return build_dataset(path, config)

    @ray.remote(num_cpus=0.5)
    class Consumer:
        def ready(self) -> bool:
            return True

        def consume(self, iterator) -> dict:
            start = time.perf_counter()
            first = None
            rows = 0
            for table in iterator.iter_batches(
                batch_size=BATCH_SIZE,
                batch_format="pyarrow",
                prefetch_batches=config.prefetch_batches,
            ):
                if first is None:
                    first = time.perf_counter()
                rows += table.num_rows
            end = time.perf_counter()
            first = end if first is None else first
            return {"ttfb": first - start, "rest": end - first, "rows": rows}

    consumers = [Consumer.remote() for _ in range(2)]
    ray.get([c.ready.remote() for c in consumers])
    passes = []
    for name, path, count in (
        ("train", f"{data}/train", epochs),
        ("eval", f"{data}/eval", eval_passes),
    ):
        splits = build(path).streaming_split(2, equal=True)
        for i in range(count):
            results = ray.get([c.consume.remote(s) for c, s in zip(consumers, splits, strict=True)])
            rest = max(r["rest"] for r in results)
            rows = sum(r["rows"] for r in results)
            passes.append(
                {
                    "pass": f"{name}{i}",
                    "ttfb": max(r["ttfb"] for r in results),
                    "rows_per_s": rows / rest if rest > 0 else float("nan"),
                }
            )
    ray.shutdown()
    return {"variant": variant, "passes": passes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="before,after")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-passes", type=int, default=2)
    parser.add_argument("--num-cpus", type=int, default=4)
    parser.add_argument("--train-rows", type=int, default=40_000)
    parser.add_argument("--eval-rows", type=int, default=8000)
    parser.add_argument("--data", help="synthetic data root (made in a temp dir if not given)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = _child(args.child, args.data, args.num_cpus, args.epochs, args.eval_passes)
        print("RESULT " + json.dumps(result), flush=True)
        return

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data or Path(tmp) / "data")
        if not (data / "train").exists():
            _make_data(data, args.train_rows, args.eval_rows)
        runs: dict[str, list[dict]] = {}
        env = {**os.environ, "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
        env.pop("RAY_ADDRESS", None)
        for repeat in range(args.repeats):
            for variant in args.variants.split(","):
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        variant,
                        "--data",
                        str(data),
                        "--num-cpus",
                        str(args.num_cpus),
                        "--epochs",
                        str(args.epochs),
                        "--eval-passes",
                        str(args.eval_passes),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(f"{variant} run {repeat} failed:\n{proc.stderr[-3000:]}")
                    continue
                result = json.loads(line[len("RESULT ") :])
                runs.setdefault(variant, []).append(result)
                shown = " ".join(f"{p['pass']}={p['ttfb']:.1f}s" for p in result["passes"])
                print(f"[{variant} run {repeat}] time to first batch: {shown}", flush=True)

    print(f"\nmedian over {args.repeats} runs; time to first batch (s) | steady rows/s")
    header = f"{'pass':<8}" + "".join(f"{v:>24}" for v in runs)
    print(header)
    names = [p["pass"] for p in next(iter(runs.values()))[0]["passes"]] if runs else []
    for i, name in enumerate(names):
        cells = []
        for results in runs.values():
            ttfb = statistics.median(r["passes"][i]["ttfb"] for r in results)
            rate = statistics.median(r["passes"][i]["rows_per_s"] for r in results)
            cells.append(f"{ttfb:>10.1f} | {rate:>11,.0f}")
        print(f"{name:<8}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
