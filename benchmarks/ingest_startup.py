"""Time to first batch of every pass over a data set, before and after the start-up fixes.

Mirrors a Ray Train job: a local Ray cluster, 2 actors of 0.5 CPU (the train workers) that each
read their share of a train and an eval set, several epochs over the train set and a few passes
over the eval set. Each variant runs in its own process with its own Ray cluster (the settings
must be in place before ``ray.init``) and is repeated; the table shows medians.

Variants:

- ``before``: the pipeline as it was: ``ray.data.read_parquet`` split between the workers by
  ``streaming_split(2, equal=True)``, a fixed pool of ``default_num_actors()`` preprocessing
  actors, Ray Data's default 32 Parquet footer-reader actors per pass, and a ``Preprocessor``
  whose import pulls torch and ``ray.data`` into every actor (the eager ``raydlrm.ingestion``).
- ``after``: the reader path training uses now, with the environment of
  :func:`raydlrm.platform.ray_init.init_ray` (``LOCAL_RAY_ENV``): the driver validates the
  footers and each worker holds a :class:`raydlrm.ingestion.reader.WorkerSource` built as
  :func:`raydlrm.trainers.loop.train_loop_per_worker` builds it (its preprocessing actors are the
  cluster's share per worker, as ``raydlrm.platform.launch`` sizes them); every pass deals the
  row groups anew and starts one actor pool per worker, which grows from one actor. A worker
  without row groups in a pass (at the default sizes the eval set is one row group) finishes
  it at once; the table shows the slowest worker.

Until the reshape of ``raydlrm.ingestion``, ``after`` measured ``build_dataset`` (Ray Data's
``read_parquet`` through a growing actor pool, split by ``streaming_split``), which was removed
as no job used it; its figures in ``benchmarks/RESULTS.md`` are of that path.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raydlrm.ingestion.config import DataConfig

BATCH_SIZE = 500
TABLE_SIZE = 2000
LEGACY_ENV = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "32"}  # Ray Data's default
NUM_WORKERS = 2
SEED = 0  # the job's seed (``training.seed``): it seeds the shuffle of the train passes


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
        from raydlrm.platform.ray_init import LOCAL_RAY_ENV

        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
    import ray

    from raydlrm.ingestion.config import DataConfig

    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=400_000_000,
        include_dashboard=False,
        log_to_driver=False,
    )
    config = DataConfig(batch_size=BATCH_SIZE, table_size=TABLE_SIZE)
    sources = _before_sources if variant == "before" else _after_sources
    consumers = [_consumer_class().remote(config) for _ in range(NUM_WORKERS)]
    passes = []
    for role, path, count in (
        ("train", f"{data}/train", epochs),
        ("eval", f"{data}/eval", eval_passes),
    ):
        # Each worker holds its source over the passes, as a training worker holds its own.
        held = sources(path, config=config, role=role)
        ray.get([c.hold.remote(s) for c, s in zip(consumers, held, strict=True)])
        for i in range(count):
            results = ray.get([c.consume.remote() for c in consumers])
            rest = max(r["rest"] for r in results)
            rows = sum(r["rows"] for r in results)
            passes.append(
                {
                    "pass": f"{role}{i}",
                    "ttfb": max(r["ttfb"] for r in results),
                    "rows_per_s": rows / rest if rest > 0 else float("nan"),
                }
            )
    ray.shutdown()
    return {"variant": variant, "passes": passes}


def _before_sources(path: str, *, config: DataConfig, role: str) -> list:
    """The old pipeline's per-worker iterators: ``read_parquet`` through a fixed actor pool of
    an eagerly importing ``Preprocessor``, split by ``streaming_split``."""
    import ray.data

    from raydlrm.ingestion.preprocess import Preprocessor
    from raydlrm.ingestion.reader import default_num_actors
    from raydlrm.ingestion.schema import validate_data

    class EagerPreprocessor(Preprocessor):
        """The old import structure: unpickling Preprocessor imported torch and ray.data."""

        def __init__(self, config: DataConfig) -> None:
            import ray.data  # noqa: F401
            import torch  # noqa: F401

            super().__init__(config)

    summary = validate_data(path, config, role=role)
    columns = [config.label_column, *config.dense_columns, *config.sparse_columns]
    if "sample_id" in summary.schema.names:
        columns.append("sample_id")
    dataset = ray.data.read_parquet(path, columns=columns).map_batches(
        EagerPreprocessor,
        fn_constructor_kwargs={"config": config},
        batch_format="pyarrow",
        batch_size=config.preprocess_batch_size,
        compute=ray.data.ActorPoolStrategy(size=default_num_actors()),
        num_cpus=0.5,
    )
    return dataset.streaming_split(NUM_WORKERS, equal=True)


def _after_sources(path: str, *, config: DataConfig, role: str) -> list:
    """Every worker's ``WorkerSource``, as the driver describes the data set
    (``raydlrm.platform.launch._worker_job``) and each worker builds its own
    (``raydlrm.trainers.loop.train_loop_per_worker``)."""
    from raydlrm.ingestion.reader import WorkerSource, default_num_actors
    from raydlrm.ingestion.schema import validate_data

    summary = validate_data(path, config, role=role)
    actors = config.num_preprocess_actors or default_num_actors()
    return [
        WorkerSource(
            summary.row_groups,
            config,
            source_path=summary.path,
            rank=rank,
            world_size=NUM_WORKERS,
            seed=SEED,
            shuffle=role == "train",
            num_actors=max(1, actors // NUM_WORKERS),
            schema=summary.schema,
        )
        for rank in range(NUM_WORKERS)
    ]


def _consumer_class():
    """A train worker's stand-in: it holds its data source and times each pass over it."""
    import ray

    @ray.remote(num_cpus=0.5)
    class Consumer:
        def __init__(self, config: DataConfig) -> None:
            self.config = config
            self.source = None

        def hold(self, source) -> None:
            self.source = source

        def consume(self) -> dict:
            start = time.perf_counter()
            first = None
            rows = 0
            for table in self.source.iter_batches(
                batch_size=BATCH_SIZE,
                batch_format="pyarrow",
                prefetch_batches=self.config.prefetch_batches,
            ):
                if first is None:
                    first = time.perf_counter()
                rows += table.num_rows
            end = time.perf_counter()
            first = end if first is None else first
            return {"ttfb": first - start, "rest": end - first, "rows": rows}

    return Consumer


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
