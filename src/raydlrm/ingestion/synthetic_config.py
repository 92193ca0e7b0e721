"""Configuration of a synthetic data set (``[data.synthetic]``): sizes, shapes, planted model.

The data set itself, its columns and the planted model are described in
``raydlrm.ingestion.synthetic``; :class:`SyntheticConfig` is a field of
:class:`~raydlrm.ingestion.config.DataConfig` (``data.synthetic``).
"""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from raydlrm._config import config_dataclass

__all__ = ["SyntheticConfig"]


@config_dataclass
class SyntheticConfig:
    """A Criteo-shaped synthetic data set with a planted model.

    See ``raydlrm.ingestion.synthetic`` for the columns and the planted model. ``raydlrm data
    generate`` writes it; training writes it only when ``generate = "if_missing"`` says so.
    """

    generate: Literal["never", "if_missing"] = "never"
    """Whether training writes this data set where ``data.train_path`` points when nothing is
    there: ``never`` (the default: a missing data path is an error naming the key and the
    path, so that a wrong path never trains on fake data; ``raydlrm data generate`` writes it),
    or ``if_missing``."""
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
    user_history_length: float = 0.0
    """Mean length of each user feature's id list (a user history, as RecD's data has): 0
    keeps the user features single ids; otherwise each session draws, per user feature, a list
    of ``1 + Poisson(user_history_length - 1)`` power-law ids that every sample of the session
    repeats; the user features then take the largest cardinalities (a history lists items of
    a large vocabulary). Must be 0 or at least 1."""
    layout: Literal["samples", "clustered"] = "samples"
    """How the files store the rows: ``samples``, one row per sample with every column;
    ``clustered``, session-clustered (RecD): the user features once per session, beside the
    samples (see ``raydlrm.ingestion.clustered``)."""
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
    interaction_orders: list[int] = field(default_factory=lambda: [2])
    """The planted logit's interaction terms: one product of per-id factors of that many
    categorical features per entry. ``[2]``: one pairwise product (the first user feature with
    the first item feature), which one layer of pairwise interactions captures; orders of 3 or
    more are what only deeper or higher-order interaction layers express exactly (e.g.
    ``[2, 3, 4]``). A term's features beyond the first pair are drawn from the seed, each
    feature in at most one term. ``[]``: no interaction term."""
    interaction_share: float = 0.20
    """Share of the planted logit's variance in the interaction terms (split equally between
    them); the rest goes to the dense linear term (5/16 of it) and the per-id effects."""
    seed: int = 0
    """Seed; the same seed gives the same files."""
    partitions: list[str] = field(default_factory=list)
    """Hive partition values of the training split, oldest first (e.g. days): the training
    files are spread over ``train/<partition_key>=<value>/`` in order, as a daily data feed
    would write them. Empty: no partitions."""
    partition_key: str = "date"
    """The hive partition key of ``partitions``."""

    def __post_init__(self) -> None:
        self._check_partitions()
        self._check_sizes()
        self._check_distributions()
        self._check_interactions()

    def _check_partitions(self) -> None:
        if not self.partitions:
            return
        files = -(-self.num_train_rows // max(1, self.rows_per_file))
        if len(self.partitions) > files:
            raise ValueError(
                f"data.synthetic.partitions: {len(self.partitions)} partitions need at least as "
                f"many training files, got {files} (lower data.synthetic.rows_per_file)"
            )
        if len(set(self.partitions)) != len(self.partitions):
            raise ValueError("data.synthetic.partitions: values must be distinct")
        bad = [v for v in self.partitions if not v or "/" in v or "=" in v]
        if bad:
            raise ValueError(f"data.synthetic.partitions: invalid partition values {bad}")

    def _check_sizes(self) -> None:
        for name in (
            "num_train_rows",
            "rows_per_file",
            "num_dense",
            "num_sparse",
            "max_list_length",
            "max_cardinality",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"data.synthetic.{name} must be positive, got {getattr(self, name)}"
                )
        if self.num_eval_rows < 0:
            raise ValueError(f"data.synthetic.num_eval_rows must be >= 0, got {self.num_eval_rows}")
        if not 0 <= self.num_list_features <= self.num_sparse:
            raise ValueError(
                f"data.synthetic.num_list_features must be in [0, num_sparse={self.num_sparse}], "
                f"got {self.num_list_features}"
            )
        if not 0 <= self.num_user_features <= self.num_sparse - self.num_list_features:
            raise ValueError(
                "data.synthetic.num_user_features must be in [0, num_sparse - num_list_features], "
                f"got {self.num_user_features}"
            )

    def _check_distributions(self) -> None:
        if self.mean_session_length < 1:
            raise ValueError(
                f"data.synthetic.mean_session_length must be >= 1, got {self.mean_session_length}"
            )
        if self.user_history_length != 0 and self.user_history_length < 1:
            raise ValueError(
                "data.synthetic.user_history_length must be 0 (single ids) or >= 1, got "
                f"{self.user_history_length}"
            )
        if self.layout == "clustered" and self.num_user_features == 0:
            raise ValueError(
                "data.synthetic.layout = 'clustered' stores the user features once per session: "
                "data.synthetic.num_user_features must be positive"
            )
        if not 0 <= self.dense_null_fraction < 1:
            raise ValueError(
                "data.synthetic.dense_null_fraction must be in [0, 1), got "
                f"{self.dense_null_fraction}"
            )
        if not 0.55 <= self.target_auc <= 0.95:
            raise ValueError(
                f"data.synthetic.target_auc must be in [0.55, 0.95], got {self.target_auc}"
            )
        if not 0.01 <= self.positive_rate <= 0.99:
            raise ValueError(
                f"data.synthetic.positive_rate must be in [0.01, 0.99], got {self.positive_rate}"
            )

    def _check_interactions(self) -> None:
        bad_orders = [k for k in self.interaction_orders if not 2 <= k <= max(2, self.num_sparse)]
        if bad_orders:
            raise ValueError(
                f"data.synthetic.interaction_orders: orders must be in [2, num_sparse="
                f"{self.num_sparse}], got {bad_orders}"
            )
        if sum(self.interaction_orders) > max(2, self.num_sparse):
            raise ValueError(
                f"data.synthetic.interaction_orders: the terms need {sum(self.interaction_orders)} "
                f"distinct features, there are num_sparse={self.num_sparse}"
            )
        if not 0 <= self.interaction_share <= 0.9:
            raise ValueError(
                "data.synthetic.interaction_share must be in [0, 0.9], got "
                f"{self.interaction_share}"
            )
