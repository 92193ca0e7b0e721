"""Ingestion throughput: Parquet to training batches, raydlrm against the limit and the naive path.

The same files (synthetic, Criteo-shaped: 13 dense + 26 sparse columns, 4 of them id lists), read
one after the other in one run on the same machine:

- ``limit``: one process, no Ray: pyarrow reads each row group, raydlrm's ``Preprocessor`` hashes
  and transforms it and ``arrow_to_batch`` makes the same tensors the trainer gets. The most a
  single core does on this machine.
- ``ray-default``: Ray Data's default path, ``read_parquet(...).iter_torch_batches(...)`` on the
  raw columns, with the id lists turned into (lengths, values) tensors by a per-row
  ``collate_fn`` (what glue code does: ``iter_torch_batches`` cannot stack ragged lists). No
  hashing or transforms, so it does less work than the others.
- ``raydlrm``: raydlrm's ingestion into a Ray Train worker: a ``TorchTrainer`` with one worker
  (0.5 CPU) iterating :class:`raydlrm.ingestion.reader.WorkerSource` over all row groups into
  :class:`raydlrm.batch.Batch` es, as the training loop does (actor pool sized as for a job).

Reported: rows/s at steady state (after the first batch), time to the first batch, and rows/s
over the whole pass (first batch included). Usage::

    python benchmarks/ingest_throughput.py [--rows 2000000] [--batch-size 4096]
        [--variants limit,ray-default,raydlrm] [--data DIR] [--num-cpus 4]

``--windows 0 262144 --repeats 3`` runs the ``raydlrm`` path once per shuffle window
(``data.shuffle_window_rows``; 0: off) in each of 3 rounds, alternating, and reports the median
of each and their ratio (issue 46: the window's cost).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

TABLE_SIZE = 100_000


def _data(root: Path, rows: int) -> Path:
    from raydlrm.ingestion import SyntheticConfig, generate_synthetic

    if not (root / "metadata.json").exists():
        generate_synthetic(
            SyntheticConfig(num_train_rows=rows, num_eval_rows=0, rows_per_file=100_000, seed=21),
            out_dir=root,
        )
    return root / "train"


def _config(path: Path, batch_size: int, window: int | None = None):
    from raydlrm.ingestion import DataConfig

    window_key = {} if window is None else {"shuffle_window_rows": window}
    return DataConfig(
        train_path=str(path),
        eval_path=None,
        table_size=TABLE_SIZE,
        batch_size=batch_size,
        **window_key,
    )


def _timed(batches) -> dict[str, float]:
    """Rows/s after the first batch, and the time to the first batch."""
    start = time.perf_counter()
    first, rows, first_rows = None, 0, 0
    for n in batches:
        rows += n
        if first is None:
            first, first_rows = time.perf_counter(), rows
    end = time.perf_counter()
    steady = (rows - first_rows) / max(end - first, 1e-9) if first is not None else 0.0
    return {
        "rows": rows,
        "rows_per_s": steady,
        "first_batch_s": (first or end) - start,
        "overall_rows_per_s": rows / max(end - start, 1e-9),
    }


def _limit(path: Path, batch_size: int) -> dict[str, float]:
    import pyarrow.parquet as pq

    from raydlrm.ingestion import Preprocessor, validate_data
    from raydlrm.ingestion.loader import arrow_to_batch
    from raydlrm.ingestion.row_group_reader import read_columns

    config = _config(path, batch_size)
    summary = validate_data(str(path), config)
    columns = read_columns(config, summary.schema)
    preprocess = Preprocessor(config)

    def batches():
        for file in sorted(path.glob("*.parquet")):
            parquet = pq.ParquetFile(file)
            for i in range(parquet.num_row_groups):
                table = preprocess(parquet.read_row_group(i, columns=columns))
                for start in range(0, table.num_rows, batch_size):
                    yield arrow_to_batch(table.slice(start, batch_size), config=config).batch_size

    return _timed(batches())


def _collate(batch: dict[str, np.ndarray]):
    import torch

    out = {}
    for name, column in batch.items():
        if column.dtype == object:  # id lists: per-row Python, as glue code does
            lengths = torch.tensor([len(x) for x in column])
            values = torch.cat([torch.as_tensor(x) for x in column])
            out[name] = (lengths, values)
        else:
            out[name] = torch.as_tensor(column)
    return out


def _ray_default(path: Path, batch_size: int) -> dict[str, float]:
    import ray.data

    ds = ray.data.read_parquet(str(path))
    batches = ds.iter_torch_batches(batch_size=batch_size, collate_fn=_collate)
    return _timed(len(b["label"]) for b in batches)


def _raydlrm_worker(config: dict) -> None:
    import ray.train

    from raydlrm.ingestion.loader import iter_train_batches
    from raydlrm.ingestion.reader import WorkerSource
    from raydlrm.ingestion.schema import RowGroup

    data = config["data"]
    source = WorkerSource(
        [RowGroup(**g) for g in config["row_groups"]],
        data,
        source_path=str(config["path"]),
        rank=0,
        world_size=1,
        seed=0,
        shuffle=True,
        num_actors=config["num_actors"],
        schema=config["schema"],
    )
    result = _timed(b.batch_size for b in iter_train_batches(source, config=data))
    # Result.metrics keeps only metrics reported with a checkpoint.
    with tempfile.TemporaryDirectory() as checkpoint:
        ray.train.report(result, checkpoint=ray.train.Checkpoint.from_directory(checkpoint))


def _raydlrm(path: Path, batch_size: int, window: int | None = None) -> dict[str, float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raydlrm.ingestion import default_num_actors, validate_data

    config = _config(path, batch_size, window)
    summary = validate_data(str(path), config)
    trainer = TorchTrainer(
        _raydlrm_worker,
        train_loop_config={
            "data": config,
            "path": str(path),
            "row_groups": [g.to_dict() for g in summary.row_groups],
            "schema": summary.schema,
            "num_actors": default_num_actors(),
        },
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name="ingest-throughput", storage_path=tempfile.mkdtemp()),
    )
    metrics = trainer.fit().metrics
    return {k: metrics[k] for k in ("rows", "rows_per_s", "first_batch_s", "overall_rows_per_s")}


def _windows(path: Path, args: argparse.Namespace) -> None:
    """The ``raydlrm`` path once per window in each round, alternating; medians and ratios."""
    import statistics

    runs: dict[int, list[dict[str, float]]] = {w: [] for w in args.windows}
    for round_ in range(args.repeats):
        for window in args.windows:
            result = _raydlrm(path, args.batch_size, window)
            runs[window].append(result)
            print(f"[round {round_} window {window}] {result}", flush=True)
    keys = ("rows_per_s", "first_batch_s", "overall_rows_per_s")
    medians = {w: {k: statistics.median(r[k] for r in rs) for k in keys} for w, rs in runs.items()}
    print(f"\n{args.rows:,} rows, batch {args.batch_size}, medians of {args.repeats} rounds")
    print("| shuffle_window_rows | rows/s (steady) | first batch | rows/s (whole pass) |")
    print("|---|---|---|---|")
    for window, m in medians.items():
        print(
            f"| {window} | {m['rows_per_s']:,.0f} | {m['first_batch_s']:.1f} s "
            f"| {m['overall_rows_per_s']:,.0f} |"
        )
    base = medians[args.windows[0]]
    for window in args.windows[1:]:
        ratio = {k: medians[window][k] / base[k] for k in ("rows_per_s", "overall_rows_per_s")}
        print(
            f"window {window} / {args.windows[0]}: steady {ratio['rows_per_s']:.3f}, "
            f"whole pass {ratio['overall_rows_per_s']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--variants", default="limit,ray-default,raydlrm")
    parser.add_argument("--data", default=None, help="data directory (generated if missing)")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the Ray cluster")
    parser.add_argument("--windows", type=int, nargs="+", default=None, help="shuffle windows")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of --windows")
    args = parser.parse_args()

    import os

    import ray

    root = Path(args.data or Path(tempfile.gettempdir()) / f"raydlrm-ingest-{args.rows}")
    path = _data(root, args.rows)
    from raydlrm.platform.ray_init import LOCAL_RAY_ENV

    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
    if args.windows:
        _windows(path, args)
        return
    runners = {"limit": _limit, "ray-default": _ray_default, "raydlrm": _raydlrm}
    results = {}
    for variant in args.variants.split(","):
        results[variant] = runners[variant](path, args.batch_size)
        print(f"[{variant}] {results[variant]}", flush=True)
    print(f"\n{args.rows:,} rows (13 dense + 26 sparse columns), batch {args.batch_size}")
    print("| path | rows | rows/s (steady) | time to first batch |")
    print("|---|---|---|---|")
    for variant, r in results.items():
        print(
            f"| {variant} | {int(r['rows']):,} | {r['rows_per_s']:,.0f} "
            f"| {r['first_batch_s']:.1f} s |"
        )
    if "raydlrm" in results:
        ours = results["raydlrm"]["rows_per_s"]
        for other in ("limit", "ray-default"):
            if other in results:
                print(f"raydlrm / {other}: {ours / results[other]['rows_per_s']:.2f}")


if __name__ == "__main__":
    main()
