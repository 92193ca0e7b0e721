"""Configuration of the data: where it is, which columns mean what, and how batches are made.

:class:`DataConfig` is ``[data]``; its per-column tables (``[data.dense_specs.<column>]``,
``[data.sparse_specs.<column>]``) are in ``raydlrm.ingestion.column_specs``, its sequence
features (``[data.sequences.<name>]``) in ``raydlrm.ingestion.sequence_specs``, its
``[data.synthetic]`` table in ``raydlrm.ingestion.synthetic_config`` and its
``[data.sequence_build]`` table in ``raydlrm.ingestion.sequences_config``.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import field
from itertools import pairwise
from typing import Literal

from raydlrm._config import config_dataclass
from raydlrm.ids import ManagedIds
from raydlrm.ingestion.column_specs import DenseFill, DenseSpec, DenseTransform, SparseSpec
from raydlrm.ingestion.sequence_specs import SEQUENCE_NAME, SequenceSpec
from raydlrm.ingestion.sequences_config import SequenceBuildConfig
from raydlrm.ingestion.synthetic_config import SyntheticConfig
from raydlrm.storage import PartitionSelector, StorageConfig

DEFAULT_DENSE_COLUMNS = [f"I{i}" for i in range(1, 14)]
DEFAULT_SPARSE_COLUMNS = [f"C{i}" for i in range(1, 27)]
LABEL_OUTPUT = "_label"
"""The preprocessed labels' column when the data has no label column (all zeros)."""
BUCKET_SUFFIX = "_bucket"
"""A bucketized dense column ``c`` is also the sparse feature ``c_bucket`` (table
``t_c_bucket``)."""


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
    sequence_build: SequenceBuildConfig | None = None
    """How ``raydlrm data sequences`` builds examples with user histories from an interaction
    log (``[data.sequence_build]``); training does not read it."""
    label_column: str | None = "label"
    """The click label column (0/1). None: the data has no label, as an interaction log's
    histories have none (a retrieval model, ``model.arch = "sasrec"``, learns from the items
    themselves; a click model needs a label)."""
    dense_columns: list[str] = field(default_factory=lambda: list(DEFAULT_DENSE_COLUMNS))
    """Dense float columns, in model input order."""
    sparse_columns: list[str] = field(default_factory=lambda: list(DEFAULT_SPARSE_COLUMNS))
    """Categorical columns: integer or string ids, or lists of either (see :class:`SparseSpec`);
    each is one feature, looked up in its table (by default a table of its own)."""
    sparse_specs: dict[str, SparseSpec] = field(default_factory=dict)
    """Per sparse column: its table (several columns may share one), per-id weight column and
    longest list."""
    sequences: dict[str, SequenceSpec] = field(default_factory=dict)
    """Sequence features by name (see :class:`SequenceSpec`): parallel id list columns (sparse
    columns) and value list columns of the same length per row, of which reading keeps each
    row's last ``max_length`` events."""
    table_size: int = 100_000
    """Rows of each embedding table unless ``table_sizes`` names it; raw ids are hashed into it."""
    table_sizes: dict[str, int] = field(default_factory=dict)
    """Table sizes by table name or by sparse column (the column's table), overriding
    ``table_size``."""
    managed_ids: dict[str, ManagedIds] = field(default_factory=dict)
    """Managed tables by table name or sparse column (the column's table): their ids are not
    hashed into rows but each given a row of its own, with admission and eviction (see
    :class:`~raydlrm.ids.ManagedIds`); the table's size is its capacity. Other tables are
    hashed."""
    dense_transform: DenseTransform = "log1p"
    """Transform of dense values after missing values are filled (``dense_fill``) and values
    clipped (see :class:`DenseSpec`), unless ``dense_specs`` names the column."""
    dense_fill: DenseFill = "zero"
    """What a missing (null) dense value becomes, unless ``dense_specs`` names the column's
    ``fill``: ``zero`` (0, as in earlier releases), ``mean`` or ``median`` (of the column's
    present training values, :attr:`dense_fill_values`). The fill is a raw value: it is
    clipped and transformed like a present one, and a bucketized column buckets it too. A
    policy on a column with no missing value changes nothing."""
    dense_missing_indicator: bool = False
    """Give each dense column (unless ``dense_specs`` says otherwise per column) a second dense
    input: 1.0 where its value was missing, 0.0 elsewhere. The model's dense input is the
    dense columns' values, then these indicators in dense column order
    (:meth:`num_dense_inputs` wide)."""
    dense_specs: dict[str, DenseSpec] = field(default_factory=dict)
    """Per dense column: transform, clipping, buckets, missing-value fill and indicator."""
    dense_stats: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``(mean, std)`` of each standardized dense column over its present (non-null, finite)
    training values, clipped. Missing values do not count, whatever the fill (``zero``
    included): a column with many missing values would otherwise have its present values
    squeezed into a sliver of the standardized range; a fill then standardizes to
    ``(fill - mean) / std`` (0 for ``mean``). Computed once over the training data before
    training when missing, then stored with the model, so a model trained with statistics
    over zero-filled values (earlier releases) keeps them: resumed, warm-started, scored."""
    dense_fill_values: dict[str, float] = field(default_factory=dict)
    """The fill of each dense column filled with its ``mean`` or ``median``: that statistic of
    the column's present (non-null, finite) training values, clipped, in raw units (before
    the transform). A median is exact for a column of at most 2^20 distinct values, beyond
    that the weighted median of a value-hash sample of them. Computed once over the training
    data before training when missing, then stored with the model like ``dense_stats``."""
    dense_buckets: int = 0
    """Bucketize every dense column into at most this many buckets (see :class:`DenseSpec`
    ``buckets``, which overrides it per column); 0: none. The value stays a dense input too."""
    bucket_boundaries: dict[str, list[float]] = field(default_factory=dict)
    """The ascending boundaries of each bucketized dense column: a value's bucket is the number
    of boundaries at or below it. A column of at most ``buckets`` distinct training values gets
    one bucket per value (boundaries halfway between them); otherwise the boundaries are
    quantiles of its distinct values, so that rare values (a long tail) get buckets of their
    own; a column with missing values counts its fill as one of its values. Computed once over
    the training data before training when missing (from at most 2^20 of the distinct values:
    beyond, an evenly thinned subset), then stored with the model."""
    id_kinds: dict[str, Literal["integer", "string"]] = field(default_factory=dict)
    """The kind of each sparse column's ids (``integer`` or ``string``): read off the training
    data when missing, then stored with the model. Integers and strings hash to different rows,
    so data whose column holds the other kind is refused (training a warm start, scoring,
    evaluating, the MLflow model), naming the column and both kinds."""
    dedup_groups: list[list[str]] = field(default_factory=list)
    """Groups of sparse columns deduplicated together (RecD), e.g. the user features that repeat
    over a session: inside a batch, identical rows of a group are looked up once."""
    dedup: Literal["groups", "infer"] = "groups"
    """Where the dedup groups come from: ``groups``, exactly ``dedup_groups`` (none when
    empty); ``infer``, ``dedup_groups`` when set, else one group inferred from the training
    data before training starts: a session-clustered data set's user columns, or the sparse
    columns found constant within the sessions (``session_column``) of a sample of a
    sample-level data set. The inferred group is stored in ``dedup_groups`` (and so in every
    checkpoint)."""
    session_column: str | None = "session_id"
    """Column whose equal, adjacent values form a session (e.g. a user's visit); shuffling moves
    whole sessions, so a session's samples stay in one batch (deduplication pays inside a
    batch). Ignored when the data has no such column."""
    shuffle_window_rows: int = 262_144
    """Rows each worker mixes at once when training (0: off). Every epoch the row groups are
    dealt to the workers in the epoch's order (``order``); each worker then takes its row
    groups in that order in windows of consecutive row groups holding at most this many rows
    (at least one row group each) and reads every window in a uniformly random order of its
    rows, drawn from ``training.seed`` and the epoch: rows of several row groups share a batch,
    so data written sorted by user trains like shuffled data (under ``order = "time"``, only
    rows of a bounded span of time are mixed). A session (``session_column``) moves as one
    unit, so its samples stay together. Every row is still read exactly once per epoch, and a
    resumed run continues with exactly the batches it would have had. Off: under
    ``shuffled``, only the row groups and the sessions inside each row group are shuffled, and
    the rows of a data set without a session column keep their file order inside a row group;
    under ``time``, every row group is read in its file order. A window must fit a worker's
    memory (checked before Ray starts)."""
    order: Literal["shuffled", "time"] = "shuffled"
    """The order a training epoch reads the row groups in. ``shuffled``: a random order drawn
    from ``training.seed`` and the epoch, different every epoch, the rows mixed inside the
    shuffle window (data sorted by user: mix the users). ``time``: the time order of the row
    groups (``time_column``, else the file order), the same every epoch, dealt to the workers
    so that they advance through time together; the shuffle window then mixes rows only
    inside a worker's consecutive row groups, a bounded span (``shuffle_window_rows`` rows),
    as production trains on logs for recency under drift. Evaluation always reads the file
    order. Which is better depends on the data: ``raydlrm data inspect`` says what to try."""
    time_column: str | None = None
    """The column whose per-row-group minimum, from the Parquet footer statistics of the
    training data (nothing is read), gives the row groups' time order (``order = "time"``, a
    time-split validation set); a timestamp, date, integer or float column. None: the file
    order (sorted paths, then row group index), which is the time order of daily or hourly
    partitioned logs. Row groups without statistics for it are refused, named."""
    bad_input: Literal["fail", "quarantine"] = "fail"
    """What a bad row (null or negative id, NaN dense value, ...) or an unreadable file does:
    ``fail`` stops the job naming file, row group, row and column; ``quarantine`` sets it aside
    under ``quarantine_path`` with the reason, counts it and continues."""
    quarantine_path: str | None = None
    """Where quarantined rows go (local or a URI), and the counts of rows whose histories
    were cut to their sequence's ``max_length`` (``truncated/``). Default for a job with
    ``bad_input = "quarantine"`` or with sequences: ``quarantine/`` in the job's run directory
    (``run.storage_path``/run name)."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Object-store access for ``s3://`` paths (endpoint, region, credentials)."""
    partitions: dict[str, PartitionSelector] = field(default_factory=dict)
    """Hive partitions to read (``key = { values = [...] }`` or ``{ min = ..., max = ... }``);
    applies to ``train_path`` and, unless ``eval_partitions`` is set, ``eval_path``."""
    eval_partitions: dict[str, PartitionSelector] | None = None
    """Hive partitions of ``eval_path``, when they differ from the training ones (e.g. train on
    the days before the newest, evaluate on the newest). Default: ``partitions``."""
    valid_path: str | None = None
    """Directory (or file) of validation Parquet: what ``training.early_stopping`` and
    ``tune`` decide on, apart from ``eval_path`` (which then scores the model they picked).
    Read with ``partitions``. Exclusive with ``valid_split``."""
    valid_split: Literal["none", "time", "random"] = "none"
    """Carve the validation set out of ``train_path`` instead, by whole row groups, so that no
    validation row trains: ``time`` takes the latest row groups (by ``data.time_column``'s
    per-row-group minimum, else the file order: the last files), ``random`` row groups drawn
    with a fixed seed (the same split for every ``training.seed``); ``none``: no carved set."""
    valid_fraction: float = 0.1
    """The share of the training rows ``valid_split`` holds out (whole row groups: at least
    this share, at least one row group, never all of them)."""
    data_date: str | None = None
    """The data's date (``YYYY-MM-DD``): the clock of managed tables' ``ttl_days``. ``raydlrm
    retrain`` sets it to the newest training partition when the partition values are dates."""
    batch_size: int = 1024
    """Samples per batch on each worker."""
    num_preprocess_actors: int = 0
    """Size of the preprocessing actor pool; 0 sizes it from the cluster's CPUs."""
    preprocess_batch_size: int = 8192
    """Rows per preprocessing call on the actor pool (independent of ``batch_size``)."""
    prefetch_batches: int = 2
    """Batches prefetched on each worker."""

    def has_validation(self) -> bool:
        """Whether the job has a validation set (``valid_path`` or ``valid_split``)."""
        return self.valid_path is not None or self.valid_split != "none"

    def partitions_for(self, role: str) -> dict[str, PartitionSelector]:
        """The partition selection of the ``train``, ``valid`` or ``eval`` data set."""
        if role == "eval" and self.eval_partitions is not None:
            return self.eval_partitions
        return self.partitions

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"data.batch_size must be positive, got {self.batch_size}")
        if self.preprocess_batch_size <= 0:
            raise ValueError(
                f"data.preprocess_batch_size must be positive, got {self.preprocess_batch_size}"
            )
        if self.table_size <= 0:
            raise ValueError(f"data.table_size must be positive, got {self.table_size}")
        if not self.sparse_columns:
            raise ValueError("data.sparse_columns must name at least one column")
        self._check_specs()
        self._check_tables()
        self._check_managed()
        if self.data_date is not None:
            try:
                self.data_day()
            except ValueError:
                raise ValueError(
                    f"data.data_date must be a date YYYY-MM-DD, got {self.data_date!r}"
                ) from None
        self._check_dedup_groups()
        self._check_sequences()
        columns = [*self.label_columns(), *self.dense_columns, *self.sparse_columns]
        dupes = sorted({c for c in columns if columns.count(c) > 1})
        if dupes:
            raise ValueError(f"data: columns {dupes} are named more than once")
        if self.num_preprocess_actors < 0:
            raise ValueError(
                f"data.num_preprocess_actors must be >= 0, got {self.num_preprocess_actors}"
            )
        if self.valid_path is not None and self.valid_split != "none":
            raise ValueError(
                "data.valid_path and data.valid_split both give a validation set: set one of them"
            )
        if not 0 < self.valid_fraction < 1:
            raise ValueError(f"data.valid_fraction must be in (0, 1), got {self.valid_fraction}")
        if self.shuffle_window_rows < 0:
            raise ValueError(
                f"data.shuffle_window_rows must be >= 0 (0: off), got {self.shuffle_window_rows}"
            )
        if self.time_column is not None and not self.time_column:
            raise ValueError("data.time_column must name a column (or be unset: the file order)")

    def _check_specs(self) -> None:
        for col in self.dense_specs:
            if col not in self.dense_columns:
                raise ValueError(f"data.dense_specs.{col}: not one of data.dense_columns")
        self._check_buckets()
        for col, spec in self.sparse_specs.items():
            if col not in self.sparse_columns:
                raise ValueError(f"data.sparse_specs.{col}: not one of data.sparse_columns")
            weight = spec.weight_column
            if weight is not None and weight in (
                *self.label_columns(),
                *self.dense_columns,
                *self.sparse_columns,
            ):
                raise ValueError(
                    f"data.sparse_specs.{col}.weight_column: {weight!r} is already a label, "
                    "dense or sparse column"
                )
        for col in self.id_kinds:
            if col not in self.sparse_columns:
                raise ValueError(f"data.id_kinds.{col}: not one of data.sparse_columns")
        standardized = set(self.standardized_columns())
        for col, stats in self.dense_stats.items():
            if col not in standardized:
                raise ValueError(f"data.dense_stats.{col}: not a standardized dense column")
            if not stats[1] > 0:
                raise ValueError(f"data.dense_stats.{col}: std must be positive, got {stats[1]}")
        filled = set(self.computed_fill_columns())
        for col, value in self.dense_fill_values.items():
            if col not in filled:
                raise ValueError(
                    f"data.dense_fill_values.{col}: not a dense column filled with its mean or "
                    "median"
                )
            if not math.isfinite(value):
                raise ValueError(f"data.dense_fill_values.{col}: must be finite, got {value}")

    def _check_buckets(self) -> None:
        if self.dense_buckets != 0 and self.dense_buckets < 2:
            raise ValueError(
                f"data.dense_buckets must be 0 (none) or at least 2, got {self.dense_buckets}"
            )
        bucketized = self.bucketized_columns()
        taken = {*self.label_columns(), *self.dense_columns, *self.sparse_columns}
        taken |= {self.table_of(c) for c in self.sparse_columns}
        for col in bucketized:
            feature = self.bucket_feature(col)
            if feature in taken or f"t_{feature}" in taken:
                raise ValueError(
                    f"data.dense_buckets: dense column {col!r} would become the sparse feature "
                    f"{feature!r} (table 't_{feature}'), which is already a column or table name"
                )
        for col, bounds in self.bucket_boundaries.items():
            if col not in bucketized:
                raise ValueError(f"data.bucket_boundaries.{col}: not a bucketized dense column")
            if len(bounds) >= self.buckets_of(col):
                raise ValueError(
                    f"data.bucket_boundaries.{col}: {len(bounds)} boundaries make more than its "
                    f"{self.buckets_of(col)} buckets"
                )
            if not all(math.isfinite(b) for b in bounds):
                raise ValueError(f"data.bucket_boundaries.{col}: a boundary is NaN or infinite")
            if any(not a < b for a, b in pairwise(bounds)):
                raise ValueError(f"data.bucket_boundaries.{col}: not strictly ascending")

    def _check_tables(self) -> None:
        tables = self.table_columns()
        for key, size in self.table_sizes.items():
            if key in self.bucket_tables():
                raise ValueError(
                    f"data.table_sizes.{key}: a bucket table has its column's buckets as rows "
                    "(set the column's buckets instead)"
                )
            if key not in tables and key not in self.sparse_columns:
                raise ValueError(
                    f"data.table_sizes.{key}: not a table ({sorted(tables)}) or sparse column"
                )
            if size <= 0:
                raise ValueError(f"data.table_sizes.{key} must be positive, got {size}")
        for table, columns in tables.items():
            sizes = {self.table_sizes[k] for k in (table, *columns) if k in self.table_sizes}
            if len(sizes) > 1:
                raise ValueError(
                    f"data.table_sizes: table {table!r} (columns {columns}) is given sizes "
                    f"{sorted(sizes)}"
                )

    def _check_managed(self) -> None:
        tables = self.table_columns()
        managed: dict[str, str] = {}
        for key, policy in self.managed_ids.items():
            if key in self.bucket_tables():
                raise ValueError(f"data.managed_ids.{key}: a bucket table cannot be managed")
            if key not in tables and key not in self.sparse_columns:
                raise ValueError(
                    f"data.managed_ids.{key}: not a table ({sorted(tables)}) or sparse column"
                )
            table = key if key in tables else self.table_of(key)
            if table in managed and self.managed_ids[managed[table]] != policy:
                raise ValueError(
                    f"data.managed_ids: table {table!r} is given two policies (keys "
                    f"{managed[table]!r} and {key!r})"
                )
            managed[table] = key
            columns = tables[table]
            try:
                policy.buckets_for(self.table_size_of(columns[0]))
            except ValueError as e:
                raise ValueError(f"data.managed_ids.{key}: {e}") from None
            for column in columns:
                spec = self.sparse_specs.get(column)
                if spec is not None and not spec.hash:
                    raise ValueError(
                        f"data.managed_ids.{key}: column {column!r} has hash = false (its ids are "
                        "row numbers); a managed table takes raw ids"
                    )

    def data_day(self) -> int:
        """``data_date`` as days since 1970-01-01 (0 without one)."""
        if self.data_date is None:
            return 0
        return (datetime.date.fromisoformat(self.data_date) - datetime.date(1970, 1, 1)).days

    def managed_of(self, table: str) -> ManagedIds | None:
        """The managed-ids policy of ``table`` (None: hashed)."""
        for key in (table, *self.table_columns().get(table, [])):
            if key in self.managed_ids:
                return self.managed_ids[key]
        return None

    def _check_dedup_groups(self) -> None:
        seen: dict[str, int] = {}
        for i, group in enumerate(self.dedup_groups):
            if not group:
                raise ValueError(f"data.dedup_groups[{i}] is empty")
            for col in group:
                if col not in self.sparse_columns:
                    raise ValueError(f"data.dedup_groups[{i}]: {col!r} is not a sparse column")
                if col in seen:
                    raise ValueError(f"data.dedup_groups: {col!r} is in groups {seen[col]} and {i}")
                seen[col] = i
        for table, columns in self.table_columns().items():
            groups = {seen.get(c) for c in columns}
            if len(groups) > 1:
                raise ValueError(
                    f"data.dedup_groups: table {table!r} is shared by columns {columns} that are "
                    "not all in the same dedup group"
                )

    def _check_sequences(self) -> None:
        seen: dict[str, str] = {}
        taken = {*self.label_columns(), *self.dense_columns, *self.sparse_columns}
        taken |= {w for c in self.sparse_columns if (w := self.weight_column_of(c))}
        for name, spec in self.sequences.items():
            key = f"data.sequences.{name}"
            if not SEQUENCE_NAME.fullmatch(name):
                raise ValueError(f"{key}: a sequence's name is letters, digits, '_' and '-'")
            for column in spec.all_columns:
                if column in seen:
                    raise ValueError(
                        f"{key}: column {column!r} is also a column of sequence {seen[column]!r}"
                    )
                seen[column] = name
            for column in spec.columns:
                self._check_sequence_ids(column, key=key)
            for column in spec.value_columns:
                if column in taken:
                    raise ValueError(
                        f"{key}.value_columns: {column!r} is already the label, a dense, sparse "
                        "or weight column (a value column is read as the sequence's own)"
                    )

    def _check_sequence_ids(self, column: str, *, key: str) -> None:
        """An id column of the sequence ``key`` must be a sparse column outside dedup groups,
        whose spec leaves lengths and per-event values to the sequence."""
        if column not in self.sparse_columns:
            raise ValueError(f"{key}.columns: {column!r} is not one of data.sparse_columns")
        group = self.dedup_group_of(column)
        if group is not None:
            raise ValueError(
                f"{key}.columns: {column!r} is in data.dedup_groups[{group}]; a sequence's "
                "columns cannot be deduplicated in this version"
            )
        spec = self.sparse_specs.get(column)
        if spec is None:
            return
        conflicts = {
            "max_length": (spec.max_length is not None, f"use {key}.max_length"),
            "min_length": (spec.min_length != 1, f"use {key}.min_length"),
            "weight_column": (spec.weight_column is not None, f"use {key}.value_columns"),
        }
        for field_name, (given, instead) in conflicts.items():
            if given:
                raise ValueError(
                    f"data.sparse_specs.{column}.{field_name}: {column!r} is a column of "
                    f"sequence {key.rsplit('.', 1)[1]!r}, which keeps its last max_length "
                    f"events; {instead}"
                )

    def sequence_of(self, column: str) -> str | None:
        """The name of the sequence ``column`` (an id or value column) belongs to, or None."""
        return next((n for n, s in self.sequences.items() if column in s.all_columns), None)

    def min_length_of(self, column: str) -> int:
        """The shortest id list sparse ``column`` accepts: its sequence's ``min_length``, else
        its ``sparse_specs`` entry's (default 1)."""
        name = self.sequence_of(column)
        if name is not None:
            return self.sequences[name].min_length
        spec = self.sparse_specs.get(column)
        return spec.min_length if spec is not None else 1

    def max_length_of(self, column: str) -> int | None:
        """The most ids one row of sparse ``column`` holds after reading: its sequence's
        ``max_length`` (longer rows are cut), else its ``sparse_specs`` entry's (longer rows
        are bad input); None: no bound."""
        name = self.sequence_of(column)
        if name is not None:
            return self.sequences[name].max_length
        spec = self.sparse_specs.get(column)
        return spec.max_length if spec is not None else None

    def table_of(self, column: str) -> str:
        """Name of the embedding table of sparse ``column`` (or bucket feature)."""
        spec = self.sparse_specs.get(column)
        return spec.table if spec is not None and spec.table else f"t_{column}"

    def buckets_of(self, column: str) -> int:
        """The most buckets of dense ``column`` (0: not bucketized)."""
        spec = self.dense_specs.get(column)
        if spec is not None and spec.buckets is not None:
            return spec.buckets
        return self.dense_buckets

    def bucketized_columns(self) -> list[str]:
        """Dense columns that are also a bucket feature, in dense column order."""
        return [c for c in self.dense_columns if self.buckets_of(c)]

    @staticmethod
    def bucket_feature(column: str) -> str:
        """The sparse feature of bucketized dense ``column``."""
        return column + BUCKET_SUFFIX

    def bucket_tables(self) -> dict[str, str]:
        """Table name -> its bucketized dense column."""
        return {f"t_{self.bucket_feature(c)}": c for c in self.bucketized_columns()}

    def feature_columns(self) -> list[str]:
        """The model's sparse features: the sparse columns, then the bucket features."""
        return [*self.sparse_columns, *map(self.bucket_feature, self.bucketized_columns())]

    def table_columns(self) -> dict[str, list[str]]:
        """Table name -> its sparse features, tables in order of their first feature."""
        tables: dict[str, list[str]] = {}
        for column in self.feature_columns():
            tables.setdefault(self.table_of(column), []).append(column)
        return tables

    def table_size_of(self, column: str) -> int:
        """Rows of the embedding table of sparse ``column`` (a bucket feature: its buckets)."""
        table = self.table_of(column)
        bucketized = self.bucket_tables().get(table)
        if bucketized is not None:
            return self.buckets_of(bucketized)
        for key in (table, *self.table_columns()[table]):
            if key in self.table_sizes:
                return self.table_sizes[key]
        return self.table_size

    def dense_transform_of(self, column: str) -> DenseTransform:
        """The transform of dense ``column``."""
        spec = self.dense_specs.get(column)
        return spec.transform if spec is not None and spec.transform else self.dense_transform

    def standardized_columns(self) -> list[str]:
        """Dense columns whose transform is ``standardize``."""
        return [c for c in self.dense_columns if self.dense_transform_of(c) == "standardize"]

    def dense_fill_of(self, column: str) -> DenseFill:
        """The missing-value fill policy of dense ``column``."""
        spec = self.dense_specs.get(column)
        return spec.fill if spec is not None and spec.fill else self.dense_fill

    def fill_key_of(self, column: str) -> str:
        """The config key that sets the fill policy of dense ``column`` (for messages)."""
        spec = self.dense_specs.get(column)
        return f"data.dense_specs.{column}.fill" if spec and spec.fill else "data.dense_fill"

    def computed_fill_columns(self) -> list[str]:
        """Dense columns filled with a statistic of the data (``mean``, ``median``)."""
        return [c for c in self.dense_columns if self.dense_fill_of(c) != "zero"]

    def fill_value_of(self, column: str) -> float:
        """The raw value a missing value of dense ``column`` becomes (0 for ``zero``).

        Raises:
            KeyError: a ``mean`` or ``median`` column without ``dense_fill_values``.
        """
        if self.dense_fill_of(column) == "zero":
            return 0.0
        return self.dense_fill_values[column]

    def missing_indicator_columns(self) -> list[str]:
        """Dense columns with a "was missing" input, in dense column order."""
        out = []
        for column in self.dense_columns:
            spec = self.dense_specs.get(column)
            own = spec.missing_indicator if spec is not None else None
            if own if own is not None else self.dense_missing_indicator:
                out.append(column)
        return out

    def num_dense_inputs(self) -> int:
        """Width of the model's dense input: one per dense column, one per missing indicator."""
        return len(self.dense_columns) + len(self.missing_indicator_columns())

    def weight_column_of(self, column: str) -> str | None:
        """The per-id weight column of sparse ``column``, if any."""
        spec = self.sparse_specs.get(column)
        return spec.weight_column if spec is not None else None

    def input_columns(self) -> list[str]:
        """The raw columns training reads: label, dense, sparse, weight and sequence value
        columns."""
        weights = [self.weight_column_of(c) for c in self.sparse_columns]
        return [
            *self.label_columns(),
            *self.dense_columns,
            *self.sparse_columns,
            *(w for w in weights if w is not None),
            *self.value_columns(),
        ]

    def label_columns(self) -> list[str]:
        """The label column, or none (``label_column = None``: a retrieval model's data)."""
        return [] if self.label_column is None else [self.label_column]

    @property
    def label_output(self) -> str:
        """The column of the preprocessed table that holds the labels (zeros when the data
        has none)."""
        return self.label_column or LABEL_OUTPUT

    def value_columns(self) -> list[str]:
        """The sequences' value columns, in the order of the sequences and their columns."""
        return [c for spec in self.sequences.values() for c in spec.value_columns]

    def dedup_group_of(self, column: str) -> int | None:
        """Index of the dedup group of sparse ``column``, or None."""
        return next((i for i, g in enumerate(self.dedup_groups) if column in g), None)
