"""Configuration of a synthetic data set (``[data.synthetic]``): sizes, shapes, planted model.

The data set itself, its columns and the planted model are described in
``raydlrm.ingestion.synthetic`` (``kind = "criteo"``), ``raydlrm.ingestion.synthetic_churn``
(``kind = "churn"``, daily partitions with id churn, configured by :class:`ChurnConfig`,
``[data.synthetic.churn]``) and ``raydlrm.ingestion.synthetic_sequences`` (``kind =
"sequences"``, user histories, configured by :class:`SequencesConfig`,
``[data.synthetic.sequences]``); :class:`SyntheticConfig` is a field of
:class:`~raydlrm.ingestion.config.DataConfig` (``data.synthetic``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import field
from typing import Literal

from raydlrm._config import config_dataclass

__all__ = ["ChurnConfig", "SequencesConfig", "SyntheticConfig"]

logger = logging.getLogger(__name__)

# The fields that only the Criteo-shaped data set reads (``kind = "criteo"``).
_CRITEO_ONLY = (
    "num_train_rows",
    "num_eval_rows",
    "num_sparse",
    "num_list_features",
    "max_list_length",
    "num_user_features",
    "mean_session_length",
    "user_history_length",
    "layout",
    "max_cardinality",
    "interaction_orders",
)
# The fields the user-history data set reads besides its own table (``kind = "sequences"``).
_SEQUENCES_READ = (
    "seed",
    "num_train_rows",
    "num_eval_rows",
    "rows_per_file",
    "num_dense",
    "dense_null_fraction",
    "zipf_exponent",
    "target_auc",
    "positive_rate",
)


@config_dataclass
class ChurnConfig:
    """Daily partitions with id churn (``[data.synthetic.churn]``, read when
    ``data.synthetic.kind = "churn"``): each day a share of every id column's active ids is new
    and popularity drifts. See ``raydlrm.ingestion.synthetic_churn``."""

    num_days: int = 5
    """Days written, one hive partition each, from ``start_date`` on."""
    start_date: str = "2026-01-01"
    """The first day, ``YYYY-MM-DD``."""
    rows_per_day: int = 100_000
    """Rows of each day."""
    num_active_ids: dict[str, int] = field(
        default_factory=lambda: {"user_id": 100_000, "item_id": 20_000}
    )
    """Per id column, in order: how many ids are active each day (the ids a day's rows draw
    from). The first column is the user, the second the item: their latent vectors' dot
    product is the label's interaction term; every column's ids have a bias of their own. Ids
    ever active: ``n + (num_days - 1) * round(new_id_share * n)``."""
    new_id_share: float = 0.2
    """Share of each day's active ids that are new (never active before), from the second day
    on; as many old ids retire. New ids take the retired ids' popularity ranks."""
    rank_drift: float = 0.1
    """Share of popularity ranks whose ids are reshuffled among themselves each day."""
    latent_dim: int = 8
    """Width of the user and item latent vectors of the label model."""

    def __post_init__(self) -> None:
        for name in ("num_days", "rows_per_day", "latent_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"data.synthetic.churn.{name} must be positive, got {getattr(self, name)}"
                )
        for name in ("new_id_share", "rank_drift"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(
                    f"data.synthetic.churn.{name} must be in [0, 1], got {getattr(self, name)}"
                )
        try:
            valid = datetime.date.fromisoformat(self.start_date).isoformat() == self.start_date
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(
                "data.synthetic.churn.start_date must be a date YYYY-MM-DD, got "
                f"{self.start_date!r}"
            )
        if not self.num_active_ids:
            raise ValueError("data.synthetic.churn.num_active_ids must name at least one column")
        for column, count in self.num_active_ids.items():
            if not column or "/" in column or "=" in column:
                raise ValueError(f"data.synthetic.churn.num_active_ids: invalid column {column!r}")
            if count <= 0:
                raise ValueError(
                    f"data.synthetic.churn.num_active_ids.{column} must be positive, got {count}"
                )

    def days(self) -> list[str]:
        """The days' partition values, oldest first."""
        first = datetime.date.fromisoformat(self.start_date)
        return [(first + datetime.timedelta(days=d)).isoformat() for d in range(self.num_days)]


@config_dataclass
class SequencesConfig:
    """User histories (``[data.synthetic.sequences]``, read when ``data.synthetic.kind =
    "sequences"``): one row per user, a target item and the user's history of Zipf-distributed
    items. See ``raydlrm.ingestion.synthetic_sequences``."""

    num_items: int = 100_000
    """Items of the catalogue; item ids are the rows ``0..num_items-1`` (of the item table)."""
    min_length: int = 50
    """The shortest history."""
    max_length: int = 1000
    """The longest history; lengths are uniform between ``min_length`` and this."""
    num_categories: int = 100
    """Item categories (of the label model): each user favours one."""
    taste_share: float = 0.5
    """Share of a user's events (history and target) drawn from the user's favourite category
    (Zipf over its items); the rest are drawn from the whole catalogue (Zipf)."""

    def __post_init__(self) -> None:
        key = "data.synthetic.sequences"
        for name in ("num_items", "min_length", "num_categories"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{key}.{name} must be positive, got {getattr(self, name)}")
        if self.max_length < self.min_length:
            raise ValueError(
                f"{key}.max_length ({self.max_length}) is below min_length ({self.min_length})"
            )
        if self.num_items >= 2**31:
            raise ValueError(f"{key}.num_items must be below 2^31, got {self.num_items}")
        if self.num_categories > self.num_items:
            raise ValueError(
                f"{key}.num_categories ({self.num_categories}) exceeds num_items ({self.num_items})"
            )
        if not 0 <= self.taste_share <= 1:
            raise ValueError(f"{key}.taste_share must be in [0, 1], got {self.taste_share}")


@config_dataclass
class SyntheticConfig:
    """A synthetic data set with a planted model: Criteo-shaped, or daily partitions with id
    churn (``kind``).

    See ``raydlrm.ingestion.synthetic`` for the columns and the planted model, and
    ``raydlrm.ingestion.synthetic_churn`` for the churn data. ``raydlrm data generate`` writes
    it; training writes it only when ``generate = "if_missing"`` says so.
    """

    kind: Literal["criteo", "churn", "sequences"] = "criteo"
    """``criteo``: a Criteo-shaped data set, train and eval splits. ``churn``: daily hive
    partitions ``train/<partition_key>=<YYYY-MM-DD>/`` where each day a share of the ids is new
    and popularity drifts (``[data.synthetic.churn]``); of this table it reads ``seed``,
    ``rows_per_file``, ``num_dense``, ``dense_null_fraction``, ``zipf_exponent``,
    ``target_auc``, ``positive_rate``, ``interaction_share`` and ``partition_key``.
    ``sequences``: user histories of Zipf items, train and eval splits of one row per user
    (``[data.synthetic.sequences]``); of this table it reads ``seed``, ``num_train_rows``,
    ``num_eval_rows``, ``rows_per_file``, ``num_dense``, ``dense_null_fraction``,
    ``zipf_exponent``, ``target_auc`` and ``positive_rate``."""
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
    """The hive partition key of ``partitions`` (and of the churn data's days)."""
    churn: ChurnConfig = field(default_factory=ChurnConfig)
    """The churn data's days, rows and id populations (``kind = "churn"``)."""
    sequences: SequencesConfig = field(default_factory=SequencesConfig)
    """The user histories' items and lengths (``kind = "sequences"``)."""

    def __post_init__(self) -> None:
        self._check_kind()
        self._check_partitions()
        self._check_sizes()
        self._check_distributions()
        self._check_interactions()

    def _check_kind(self) -> None:
        """Churn data: no ``partitions`` (its days are its partitions), no column named like
        another; a warning per setting the kind ignores (the other kinds' tables included)."""
        defaults = {f.name: _default(f) for f in dataclasses.fields(self)}
        for table in ("churn", "sequences"):
            if self.kind != table and getattr(self, table) != defaults[table]:
                logger.warning(
                    "data.synthetic.%s is ignored: data.synthetic.kind = %r", table, self.kind
                )
        if self.kind == "sequences":
            reads = (*_SEQUENCES_READ, "kind", "generate", "sequences", "churn")
            for name, value in defaults.items():
                if name not in reads and getattr(self, name) != value:
                    logger.warning(
                        "data.synthetic.%s is ignored: data.synthetic.kind = 'sequences'", name
                    )
        if self.kind != "churn":
            return
        if not self.partition_key or "/" in self.partition_key or "=" in self.partition_key:
            raise ValueError(f"data.synthetic.partition_key: invalid key {self.partition_key!r}")
        if self.partitions:
            raise ValueError(
                "data.synthetic.partitions: kind = 'churn' writes one partition per day "
                "(data.synthetic.churn.num_days, start_date); leave partitions empty"
            )
        taken = {"sample_id", "label", *(f"I{j + 1}" for j in range(self.num_dense))}
        clashes = sorted(taken & set(self.churn.num_active_ids))
        if clashes:
            raise ValueError(
                f"data.synthetic.churn.num_active_ids: columns {clashes} clash with the "
                "sample_id, label and dense (I1..In) columns"
            )
        for name in _CRITEO_ONLY:
            if getattr(self, name) != defaults[name]:
                logger.warning("data.synthetic.%s is ignored: data.synthetic.kind = 'churn'", name)

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


def _default(f: dataclasses.Field) -> object:
    """A dataclass field's default value."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default
