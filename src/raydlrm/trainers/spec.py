"""What a worker needs to know: the data, model, sharding and training configs, composed.

The driver (``raydlrm.platform``) resolves the job config and sends this part of it, with the
sharding plan, to every worker as plain JSON-compatible data.
"""

from __future__ import annotations

from dataclasses import asdict, field

from raydlrm._config import config_dataclass
from raydlrm.ingestion.config import DataConfig
from raydlrm.models import EmbeddingBagConfig, ModelConfig
from raydlrm.sharding.config import ShardingConfig
from raydlrm.trainers.config import CheckpointConfig, FaultConfig, TrainingConfig

__all__ = ["WorkerSpec", "tables_for"]


def tables_for(data: DataConfig, model: ModelConfig) -> list[EmbeddingBagConfig]:
    """The embedding tables of the data config's sparse columns (``t_<column>`` unless a
    ``sparse_specs`` entry names a shared table), each looked up by its columns, sized from the
    data config, in order of their first column."""
    return [
        EmbeddingBagConfig(
            name=table,
            num_embeddings=data.table_size_of(columns[0]),
            embedding_dim=model.embedding_dim,
            feature_names=tuple(columns),
        )
        for table, columns in data.table_columns().items()
    ]


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
        return tables_for(self.data, self.model)

    def to_dict(self) -> dict:
        return asdict(self)
