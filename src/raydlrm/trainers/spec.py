"""What a worker needs to know: the data, model, sharding and training configs, composed
(:class:`WorkerSpec`), and everything the driver sends each worker (:class:`WorkerJob`).

The driver (``raydlrm.platform``) resolves the job config and sends a :class:`WorkerJob` (this
part of the config, the sharding plan, the data sets to read, logging and drills) to every
worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from raydlrm._config import config_dataclass
from raydlrm.ingestion.config import DataConfig
from raydlrm.models.config import ModelConfig
from raydlrm.sharding import config as sharding_config
from raydlrm.sharding.config import ShardingConfig
from raydlrm.trainers.config import CheckpointConfig, FaultConfig, TrainingConfig

if TYPE_CHECKING:
    # Types only: the job config (the command line's config commands) imports this module,
    # which then loads neither torch, pyarrow's readers nor Ray.
    import pyarrow as pa
    import ray.train

    from raydlrm.ingestion.schema import RowGroup
    from raydlrm.models.embedding import EmbeddingBagConfig
    from raydlrm.sharding.plan import ShardingPlan
    from raydlrm.sharding.topology import Topology
    from raydlrm.storage import StorageConfig

__all__ = ["SourceDescription", "WorkerJob", "WorkerSpec"]


@config_dataclass
class WorkerSpec:
    """The worker-side part of a job's config."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def tables(self) -> list[EmbeddingBagConfig]:
        """The embedding tables of the data config's sparse features (``t_<column>`` unless a
        ``sparse_specs`` entry names a shared table; ``t_<column>_bucket`` of a bucketized dense
        column), each looked up by its features, sized from the data config, in order of their
        first feature.

        Pooling: a table of the model's history or candidate columns is looked up per position
        (``none``) by a sequence model (``model.sequence``); the item table of ``sasrec`` also
        by :meth:`negatives_feature`. Another sequence's columns pool as means (a pooled arch
        reads a history as its mean), the other columns as sums."""
        from raydlrm.models.embedding import EmbeddingBagConfig

        per_position = set(self.history_columns()) | set(self.model.candidate)
        in_sequences = {c for s in self.data.sequences.values() for c in s.columns}
        negatives = self.negatives_feature()
        tables = []
        for table, columns in self.data.table_columns().items():
            features = tuple(columns)
            if negatives is not None and self.model.candidate[0] in columns:
                features += (negatives,)
            pooling = (
                "none"
                if per_position & set(columns)
                else "mean"
                if in_sequences & set(columns)
                else "sum"
            )
            tables.append(
                EmbeddingBagConfig(
                    name=table,
                    num_embeddings=self.data.table_size_of(columns[0]),
                    embedding_dim=self.model.embedding_dim,
                    feature_names=features,
                    pooling=pooling,
                    managed=self.data.managed_of(table),
                )
            )
        return tables

    def check_sequence_model(self) -> None:
        """Checks that a sequence model's history and candidate fit the data config.

        Raises:
            ValueError: naming the ``model`` or ``data`` key that does not fit.
        """
        if self.data.label_column is None and not self.model.retrieval:
            raise ValueError(
                f"data.label_column is unset: arch {self.model.arch!r} learns from a click "
                "label (only a retrieval model, arch 'sasrec', trains without one)"
            )
        if not self.model.reads_sequences:
            return
        name = self.model.sequence
        if name not in self.data.sequences:
            raise ValueError(
                f"model.sequence = {name!r} is not a data.sequences entry (have "
                f"{sorted(self.data.sequences)})"
            )
        columns = self.data.sequences[name].columns
        table_of = {c: t for t, cs in self.data.table_columns().items() for c in cs}
        candidate = self.model.candidate
        pairs = list(zip(candidate, columns, strict=False))
        if self.model.arch == "din" and len(candidate) != len(columns):
            raise ValueError(
                f"model.candidate {candidate} must name one column per column of "
                f"data.sequences.{name} {columns} (the candidate's item, category, ...)"
            )
        for cand, column in pairs:
            if cand not in table_of or cand in columns:
                raise ValueError(
                    f"model.candidate {cand!r} must be a sparse column outside the history "
                    f"data.sequences.{name}"
                )
            if table_of[cand] != table_of[column]:
                raise ValueError(
                    f"model.candidate {cand!r} is looked up in table {table_of[cand]!r} but the "
                    f"history column {column!r} in {table_of[column]!r}: give both the same "
                    f"table (data.sparse_specs.{cand}.table = {table_of[column]!r})"
                )
        if self.model.retrieval and self.data.managed_of(table_of[columns[0]]) is not None:
            raise ValueError(
                f"arch 'sasrec' ranks every row of the item table {table_of[columns[0]]!r}: it "
                "cannot be a managed table (data.managed_ids)"
            )

    def sequence_inputs(self) -> dict[str, Any]:
        """What :func:`~raydlrm.models.dlrm.build_model` needs of the data for a sequence
        model (its history columns, their longest history, the negatives feature)."""
        return {
            "history": self.history_columns(),
            "max_length": self.history_max_length(),
            "negatives": self.negatives_feature(),
        }

    def history_columns(self) -> list[str]:
        """The id columns of the history a sequence model reads (none for a pooled arch)."""
        if not self.model.reads_sequences or self.model.sequence is None:
            return []
        return list(self.data.sequences[self.model.sequence].columns)

    def history_max_length(self) -> int:
        """The most events a history of the model's sequence holds (0: none)."""
        if not self.history_columns():
            return 0
        return self.data.sequences[self.model.sequence].max_length

    def negatives_feature(self) -> str | None:
        """The feature through which ``sasrec`` looks up its sampled negatives in the item
        table (a name no data column has), or None."""
        if not self.model.retrieval:
            return None
        return f"{self.model.candidate[0]}/negatives"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def stored(cls, data: dict) -> WorkerSpec:
        """The spec a model or checkpoint stored (its ``spec.json``, :meth:`to_dict`), written
        by this release or an earlier one: the keys a release has retired
        (:data:`~raydlrm.sharding.config.RETIRED_KEYS`) are dropped, not refused (they sized
        training's row caches; a stored model needs them for nothing it is used for)."""
        sharding = {
            k: v
            for k, v in data.get("sharding", {}).items()
            if k not in sharding_config.RETIRED_KEYS
        }
        return cls(**{**data, "sharding": sharding})


@dataclass(frozen=True)
class SourceDescription:
    """A validated data set as every worker reads its share of it (see
    ``raydlrm.ingestion.reader.WorkerSource``).

    Attributes:
        path: the data set's path.
        row_groups: every row group, dealt to the workers per epoch.
        schema: the Arrow schema of its files.
        shuffle: shuffle the row groups each epoch (training data).
        num_actors: preprocessing actors per worker.
        quarantine_tag: names the run's quarantined rows (``data.bad_input``).
    """

    path: str
    row_groups: list[RowGroup]
    schema: pa.Schema
    shuffle: bool
    num_actors: int
    quarantine_tag: str | None = None


@dataclass(frozen=True)
class WorkerJob:
    """What the driver sends each training worker (Ray Train's ``train_loop_config`` holds it
    as ``{"job": ...}``).

    Attributes:
        spec: the worker's part of the job config.
        plan: the sharding plan (the same on every rank).
        train_source: the training data.
        eval_source: the held-out data, or None.
        valid_source: the validation set, or None.
        log_level: raydlrm's log level in the workers (see ``raydlrm._logs``).
        library_log_level: the libraries' log level in the workers.
        fault_marker: where an injected fault records that it fired (None: no fault).
        run_storage: the run storage's object store (``[run.storage]``, else
            ``[data.storage]``): of ``fault_marker`` and the progress file.
        warm_start: another run's checkpoint to start from, or None.
        run_directory: the run's directory in ``run.storage_path`` (the progress file;
            messages).
        topology: the hosts of the workers (``scaling.ranks_per_host``), or None: one host.
    """

    spec: WorkerSpec
    plan: ShardingPlan
    train_source: SourceDescription
    eval_source: SourceDescription | None
    log_level: int
    library_log_level: int
    fault_marker: str | None = None
    run_storage: StorageConfig | None = None
    warm_start: ray.train.Checkpoint | None = None
    run_directory: str | None = None
    topology: Topology | None = None
    valid_source: SourceDescription | None = None
