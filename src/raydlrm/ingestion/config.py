"""Configuration of the data: where it is, which columns mean what, and how batches are made."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from raydlrm._config import config_dataclass

DEFAULT_DENSE_COLUMNS = [f"I{i}" for i in range(1, 14)]
DEFAULT_SPARSE_COLUMNS = [f"C{i}" for i in range(1, 27)]


@config_dataclass
class SyntheticConfig:
    """A Criteo-shaped synthetic data set with a planted model.

    See ``raydlrm.ingestion.synthetic`` for the columns and the planted model.
    """

    num_train_rows: int = 200_000
    """Rows in the training split."""
    num_eval_rows: int = 50_000
    """Rows in the held-out evaluation split."""
    rows_per_file: int = 50_000
    """Rows per Parquet file; generation holds one file in memory at a time."""
    num_dense: int = 13
    """Number of dense float columns (named I1..In)."""
    num_sparse: int = 26
    """Number of categorical columns (named C1..Cn)."""
    num_list_features: int = 4
    """How many of the categorical columns (the last ones) are variable-length id lists."""
    max_list_length: int = 8
    """Longest id list of a list feature."""
    num_user_features: int = 8
    """How many categorical columns (the first ones) are user features that repeat across the
    samples of a session."""
    mean_session_length: float = 4.0
    """Mean number of samples per session (geometric distribution)."""
    max_cardinality: int = 100_000
    """Largest number of distinct raw ids of a feature; cardinalities are log-spaced up to it."""
    zipf_exponent: float = 1.05
    """Power-law exponent of id popularity."""
    dense_null_fraction: float = 0.02
    """Fraction of dense values written as null (missing)."""
    target_auc: float = 0.80
    """AUC of the planted model (the best a trainer can reach); the planted logits are scaled to
    reach it."""
    positive_rate: float = 0.25
    """Expected fraction of positive labels."""
    seed: int = 0
    """Seed; the same seed gives the same files."""

    def __post_init__(self) -> None:
        for name in (
            "num_train_rows",
            "rows_per_file",
            "num_dense",
            "num_sparse",
            "max_list_length",
            "max_cardinality",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"synthetic.{name} must be positive, got {getattr(self, name)}")
        if self.num_eval_rows < 0:
            raise ValueError(f"synthetic.num_eval_rows must be >= 0, got {self.num_eval_rows}")
        if not 0 <= self.num_list_features <= self.num_sparse:
            raise ValueError(
                f"synthetic.num_list_features must be in [0, num_sparse={self.num_sparse}], "
                f"got {self.num_list_features}"
            )
        if not 0 <= self.num_user_features <= self.num_sparse - self.num_list_features:
            raise ValueError(
                "synthetic.num_user_features must be in [0, num_sparse - num_list_features], "
                f"got {self.num_user_features}"
            )
        if self.mean_session_length < 1:
            raise ValueError(
                f"synthetic.mean_session_length must be >= 1, got {self.mean_session_length}"
            )
        if not 0 <= self.dense_null_fraction < 1:
            raise ValueError(
                f"synthetic.dense_null_fraction must be in [0, 1), got {self.dense_null_fraction}"
            )
        if not 0.55 <= self.target_auc <= 0.95:
            raise ValueError(f"synthetic.target_auc must be in [0.55, 0.95], got {self.target_auc}")
        if not 0.01 <= self.positive_rate <= 0.99:
            raise ValueError(
                f"synthetic.positive_rate must be in [0.01, 0.99], got {self.positive_rate}"
            )


@config_dataclass
class DataConfig:
    """Where the data is and how it becomes batches."""

    train_path: str = "data/synthetic/train"
    """Directory (or file) of training Parquet."""
    eval_path: str | None = "data/synthetic/eval"
    """Directory (or file) of held-out Parquet; None skips evaluation."""
    synthetic: SyntheticConfig | None = None
    """If set and ``train_path`` does not exist, a synthetic data set is generated into the parent
    directory of ``train_path`` (``train/`` and ``eval/`` beside each other)."""
    label_column: str = "label"
    """The click label column (0/1)."""
    dense_columns: list[str] = field(default_factory=lambda: list(DEFAULT_DENSE_COLUMNS))
    """Dense float columns, in model input order."""
    sparse_columns: list[str] = field(default_factory=lambda: list(DEFAULT_SPARSE_COLUMNS))
    """Categorical columns (int64 ids or lists of int64 ids); each gets its own embedding table."""
    table_size: int = 100_000
    """Rows of each embedding table unless ``table_sizes`` names it; raw ids are hashed into it."""
    table_sizes: dict[str, int] = field(default_factory=dict)
    """Per-column table sizes, overriding ``table_size``."""
    dense_transform: Literal["log1p", "none"] = "log1p"
    """Transform of dense values after missing values are filled with 0: log1p(max(x, 0))."""
    batch_size: int = 1024
    """Samples per batch on each worker."""
    num_preprocess_actors: int = 0
    """Size of the preprocessing actor pool; 0 sizes it from the cluster's CPUs."""
    preprocess_batch_size: int = 8192
    """Rows per preprocessing call on the actor pool (independent of ``batch_size``)."""
    prefetch_batches: int = 2
    """Batches prefetched on each worker."""

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"data.batch_size must be positive, got {self.batch_size}")
        if self.preprocess_batch_size <= 0:
            raise ValueError(
                f"data.preprocess_batch_size must be positive, got {self.preprocess_batch_size}"
            )
        if self.table_size <= 0:
            raise ValueError(f"data.table_size must be positive, got {self.table_size}")
        for col, size in self.table_sizes.items():
            if col not in self.sparse_columns:
                raise ValueError(f"data.table_sizes.{col}: not one of data.sparse_columns")
            if size <= 0:
                raise ValueError(f"data.table_sizes.{col} must be positive, got {size}")
        if not self.sparse_columns:
            raise ValueError("data.sparse_columns must name at least one column")
        columns = [self.label_column, *self.dense_columns, *self.sparse_columns]
        dupes = sorted({c for c in columns if columns.count(c) > 1})
        if dupes:
            raise ValueError(f"data: columns {dupes} are named more than once")
        if self.num_preprocess_actors < 0:
            raise ValueError(
                f"data.num_preprocess_actors must be >= 0, got {self.num_preprocess_actors}"
            )

    def table_size_of(self, column: str) -> int:
        """Rows of the embedding table of sparse ``column``."""
        return self.table_sizes.get(column, self.table_size)
