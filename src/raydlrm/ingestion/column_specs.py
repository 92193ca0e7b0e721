"""Per-column configuration: how one dense column becomes a model input (:class:`DenseSpec`),
how one sparse column becomes a feature (:class:`SparseSpec`)."""

from __future__ import annotations

from typing import Literal

from raydlrm._config import config_dataclass

__all__ = ["DenseFill", "DenseSpec", "DenseTransform", "SparseSpec"]

DenseTransform = Literal["log1p", "standardize", "none"]
DenseFill = Literal["zero", "mean", "median"]


@config_dataclass
class DenseSpec:
    """How one dense column becomes a model input (``[data.dense_specs.<column>]``).

    Missing (null) values are filled (``fill``), then clipped, then transformed.
    """

    transform: DenseTransform | None = None
    """``log1p`` (``log1p(max(x, 0))``), ``standardize`` (``(x - mean) / std`` with the
    statistics of the training data, :attr:`DataConfig.dense_stats`) or ``none``; default:
    ``data.dense_transform``."""
    clip: tuple[float, float] | None = None
    """``[lo, hi]``: values are clipped into this range before the transform."""
    buckets: int | None = None
    """Also a sparse feature of the column, ``<column>_bucket``: the bucket of its (filled,
    clipped) value among at most ``buckets`` (see :attr:`DataConfig.bucket_boundaries`), looked
    up in a table of its own. 0: none; default: ``data.dense_buckets``."""
    fill: DenseFill | None = None
    """What a missing value of the column becomes (see :attr:`DataConfig.dense_fill`); default:
    ``data.dense_fill``."""
    missing_indicator: bool | None = None
    """Whether the column also gets a 0/1 "was missing" dense input (see
    :attr:`DataConfig.dense_missing_indicator`); default: ``data.dense_missing_indicator``."""

    def __post_init__(self) -> None:
        if self.clip is not None and not self.clip[0] <= self.clip[1]:
            raise ValueError(f"clip must be [lo, hi] with lo <= hi, got {list(self.clip)}")
        if self.buckets is not None and self.buckets != 0 and self.buckets < 2:
            raise ValueError(f"buckets must be 0 (none) or at least 2, got {self.buckets}")


@config_dataclass
class SparseSpec:
    """How one sparse column becomes a feature (``[data.sparse_specs.<column>]``).

    A sparse column holds an integer id, a string id, or a list of either; strings are hashed
    (stable across runs and machines) and so are integers, into the rows of the column's table.
    """

    table: str | None = None
    """Embedding table of the column; columns naming the same table share it. Default:
    ``t_<column>``, a table of its own."""
    weight_column: str | None = None
    """Column of per-id weights (float, or a list of floats as long as the id list) for
    weighted sum pooling; default: every id weighs 1."""
    max_length: int | None = None
    """Longest id list accepted; a longer list is bad input (``data.bad_input``)."""
    min_length: int = 1
    """Shortest id list accepted (default: an empty list is bad input); 0 accepts empty lists,
    which pool to zeros. A sequence's id columns (``data.sequences``) take their lengths from
    the sequence instead, and may set none of ``min_length``, ``max_length`` and
    ``weight_column`` here."""
    hash: bool = True
    """Hash the ids into the table (default). ``false``: the ids are already row numbers
    (integers); a negative id or one not below the table size is bad input."""

    def __post_init__(self) -> None:
        if self.table is not None and not self.table:
            raise ValueError("table must be a non-empty name")
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        if self.min_length < 0:
            raise ValueError(f"min_length must be >= 0, got {self.min_length}")
        if self.max_length is not None and self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} is above max_length {self.max_length}")
