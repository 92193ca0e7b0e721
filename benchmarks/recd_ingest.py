"""RecD on the data side: preprocessing throughput and storage, sample-level against clustered.

The RecD-shaped synthetic data of ``configs/recd.toml`` (user-history id lists per session,
repeated by each of its samples, beside per-sample item features), generated sample-level and
converted to the session-clustered layout (``raydlrm data cluster``), read one after the other,
repeats interleaved (the order rotates):

- ``plain``: the sample-level set, no dedup groups: every sample's user histories are checked
  and hashed on the preprocessing actors;
- ``samples``: the sample-level set with ``data.dedup_groups = [the user features]``: as
  ``plain``, and keyed, and deduplicated per batch by the loader (``np.unique`` over the row
  keys, rows compared);
- ``clustered``: the clustered set: the user histories are checked and hashed once per session
  and reach the batch as dictionaries, which are the dedup group (no keys, no ``np.unique``).

Each is measured two ways: ``ray``, a worker's :class:`~raydlrm.ingestion.reader.WorkerSource`
(a Ray Data actor pool preprocessing the row groups) through ``iter_train_batches`` into
:class:`~raydlrm.batch.Batch` es with their dedup groups, as the training loop reads; and
``process``, the same reader called in this process with no Ray (its CPU cost alone, steadier on
a shared machine). Reported: rows/s (medians), their ratios to ``plain`` (issue 27's goal:
>= 1.79x), and the bytes on disk (snappy for both; goal >= 3.71x) of the sample-level set as
generated (pyarrow's default writer), of the same rows rewritten with the clustered layout's
writer options (``raydlrm.ingestion.clustered.WRITE_OPTIONS``: a like-for-like comparison) and
of the clustered set, with the bytes before compression (the footers' uncompressed sizes)
beside them, the per-batch dedup factor over all sparse features and the user features' share
of the lookups. Usage::

    python benchmarks/recd_ingest.py [--rows 200000] [--repeats 3] [--data DIR] [--num-cpus 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "recd.toml"


def _job(rows: int):
    from raydlrm.platform.config import load_config

    return load_config(
        CONFIG,
        overrides=[f"data.synthetic.num_train_rows={rows}", "data.synthetic.num_eval_rows=0"],
    )


def _data(root: Path, rows: int) -> tuple[Path, Path, float]:
    """The sample-level training set and its clustered copy (made if missing), and the
    conversion's seconds (0 when it existed)."""
    from raydlrm.ingestion import generate_synthetic
    from raydlrm.ingestion.clustering import cluster_data

    job = _job(rows)
    info = generate_synthetic(job.data.synthetic, out_dir=root / "samples")
    clustered = root / "clustered"
    seconds = 0.0
    if not (clustered / "_clustered.json").exists():
        start = time.perf_counter()
        cluster_data(str(info.train_path), _config(info.train_path, job), out=str(clustered))
        seconds = time.perf_counter() - start
    return info.train_path, clustered, seconds


def _config(path: Path, job, *, dedup: bool = True):
    import dataclasses

    users = [f"C{i + 1}" for i in range(job.data.synthetic.num_user_features)]
    return dataclasses.replace(
        job.data,
        train_path=str(path),
        eval_path=None,
        dedup="groups",
        dedup_groups=[users] if dedup else [],
    )


def _rewritten(samples: Path, root: Path) -> Path:
    """The sample-level files rewritten with the clustered layout's writer options."""
    import pyarrow.parquet as pq

    from raydlrm.ingestion.clustered import WRITE_OPTIONS

    out = root / "samples-rewritten"
    if not out.exists():
        out.mkdir()
        for file in sorted(samples.rglob("*.parquet")):
            parquet = pq.ParquetFile(file)
            with pq.ParquetWriter(out / file.name, parquet.schema_arrow, **WRITE_OPTIONS) as w:
                for i in range(parquet.num_row_groups):
                    w.write_table(parquet.read_row_group(i))
    return out


def _uncompressed(path: Path) -> int:
    """Bytes of a data set's column chunks before compression (Parquet footers)."""
    import pyarrow.parquet as pq

    total = 0
    for file in path.rglob("*.parquet"):
        meta = pq.ParquetFile(file).metadata
        for i in range(meta.num_row_groups):
            group = meta.row_group(i)
            total += sum(group.column(c).total_uncompressed_size for c in range(group.num_columns))
    return total


def _ray(path: Path, job, dedup: bool) -> dict[str, float]:
    """A worker's source through ``iter_train_batches``: rows/s over the whole pass (the actor
    pool's start included) and after the first batch, and the time to the first batch."""
    from raydlrm.ingestion import default_num_actors, iter_train_batches, validate_data
    from raydlrm.ingestion.reader import WorkerSource

    config = _config(path, job, dedup=dedup)
    summary = validate_data(str(path), config)
    source = WorkerSource(
        summary.row_groups,
        config,
        source_path=str(path),
        rank=0,
        world_size=1,
        seed=0,
        shuffle=True,
        num_actors=default_num_actors(),
        schema=summary.schema,
    )
    start = time.perf_counter()
    first, rows, first_rows = None, 0, 0
    for batch in iter_train_batches(source, config=config):
        assert not dedup or batch.dedup_groups[0].inverse.numel() == batch.batch_size
        rows += batch.batch_size
        if first is None:
            first, first_rows = time.perf_counter(), rows
    end = time.perf_counter()
    return {
        "rows": rows,
        "rows_per_s": rows / (end - start),
        "steady_rows_per_s": (rows - first_rows) / (end - first),
        "first_batch_s": first - start,
    }


def _process(path: Path, job, dedup: bool) -> dict[str, float]:
    """The row-group reader called here, no Ray: read, preprocess, batches (with dedup
    groups)."""
    import pyarrow as pa

    from raydlrm.ingestion import arrow_to_batch, validate_data
    from raydlrm.ingestion.row_group_reader import read_columns, reader_class

    config = _config(path, job, dedup=dedup)
    summary = validate_data(str(path), config)
    kind = reader_class(summary.schema)
    reader = kind(
        config,
        source_path=str(path),
        columns=read_columns(config, summary.schema),
        schema=summary.schema,
        seed=0,
        epoch=0,
        shuffle=True,
    )
    start, rows = time.perf_counter(), 0
    for i, group in enumerate(summary.row_groups):
        out = reader(pa.Table.from_pylist([{"group": group.to_dict(), "id": i, "skip": 0}]))
        # The sample-level reader hands one table per row group on; Ray Data's iter_batches
        # cuts it into training batches. The clustered reader yields the training batches.
        tables = (
            [out.slice(s, config.batch_size) for s in range(0, out.num_rows, config.batch_size)]
            if isinstance(out, pa.Table)
            else out
        )
        for table in tables:
            rows += arrow_to_batch(table, config=config).batch_size
    return {"rows": rows, "rows_per_s": rows / (time.perf_counter() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default=None, help="data directory (generated if missing)")
    parser.add_argument("--num-cpus", type=int, default=2, help="logical CPUs of the Ray cluster")
    args = parser.parse_args()

    import os

    import ray

    from raydlrm.ingestion.clustered import data_bytes
    from raydlrm.ingestion.inspect import inspect_data
    from raydlrm.platform.ray_init import LOCAL_RAY_ENV

    root = Path(args.data or Path(tempfile.gettempdir()) / f"raydlrm-recd-{args.rows}")
    samples, clustered, convert_s = _data(root, args.rows)
    job = _job(args.rows)
    report = inspect_data(str(samples), _config(samples, job), max_rows=args.rows)["recd"]
    rewritten = _rewritten(samples, root)
    sizes = {
        name: (data_bytes(str(path), job.data), _uncompressed(path))
        for name, path in (("samples", samples), ("rewritten", rewritten), ("clustered", clustered))
    }
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
    variants = {
        "plain": (samples, False),
        "samples": (samples, True),
        "clustered": (clustered, True),
    }
    for path, dedup in variants.values():  # warm-up, untimed: imports, page cache, Ray workers
        _ray(path, job, dedup)
        _process(path, job, dedup)
    results: dict[tuple[str, str], list[dict]] = {}
    names = list(variants)
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for how, run in (("ray", _ray), ("process", _process)):
            for name in order:
                result = run(variants[name][0], job, variants[name][1])
                results.setdefault((how, name), []).append(result)
                print(f"[{how} {name} #{repeat}] {result}", flush=True)
    _report(results, report=report, sizes=sizes, job=job, convert_s=convert_s)


def _report(results, *, report, sizes, job, convert_s: float) -> None:
    rows = int(results["process", "plain"][0]["rows"])
    print(
        f"\n{rows:,} rows, batch {job.data.batch_size}: dedup factor {report['dedup_factor']:.2f} "
        f"(id lookups per distinct (feature, id) pair in a batch, all sparse features), user "
        f"features {'+'.join(report['user_columns'])} {report['user_lookup_share']:.1%} of the "
        f"lookups; conversion {convert_s:.1f} s"
    )
    print(
        "| path | plain rows/s | samples rows/s | clustered rows/s | samples / plain "
        "| clustered / plain |"
    )
    print("|---|---|---|---|---|---|")
    measures = {
        "ray, whole pass": ("ray", "rows_per_s"),
        "ray, after the first batch": ("ray", "steady_rows_per_s"),
        "ray, time to the first batch (s)": ("ray", "first_batch_s"),
        "process (no Ray)": ("process", "rows_per_s"),
    }
    for label, (how, key) in measures.items():
        a, b, c = (
            statistics.median(r[key] for r in results[how, name])
            for name in ("plain", "samples", "clustered")
        )
        print(f"| {label} | {a:,.2f} | {b:,.2f} | {c:,.2f} | {b / a:.2f}x | {c / a:.2f}x |")
    (disk, raw), (disk_w, raw_w), (disk_c, raw_c) = (
        sizes[n] for n in ("samples", "rewritten", "clustered")
    )
    print(
        f"storage, bytes on disk (snappy): sample-level as generated {disk:,}, rewritten with "
        f"the clustered writer options {disk_w:,}, clustered {disk_c:,}: "
        f"{disk / disk_c:.2f}x as generated, {disk_w / disk_c:.2f}x like for like; before "
        f"compression {raw:,} / {raw_w:,} -> {raw_c:,} = {raw / raw_c:.2f}x"
    )


if __name__ == "__main__":
    main()
