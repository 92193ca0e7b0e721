"""Unsharded embedding-bag collection: the sparse part of a model, written without parallelism.

``raydlrm.sharding`` turns an :class:`EmbeddingBagCollection` into its sharded, fbgemm-backed
form; the unsharded module is the reference in parity tests and what exported models run.
Tables are plain parameters (one ``(num_embeddings, embedding_dim)`` tensor per table), so the
module can be built on the meta device when the tables are too large for one host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor

__all__ = ["EmbeddingBagCollection", "EmbeddingBagConfig"]


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One embedding table and the features that look it up.

    Attributes:
        name: table name (unique in a collection).
        num_embeddings: rows of the table.
        embedding_dim: columns of the table (a multiple of 4 for fbgemm).
        feature_names: features pooled from this table; several features may share one table.
        pooling: ``sum`` or ``mean`` of a bag's rows.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: Literal["sum", "mean"] = "sum"

    def __post_init__(self) -> None:
        if self.num_embeddings <= 0:
            raise ValueError(f"table {self.name}: num_embeddings must be positive")
        if self.embedding_dim <= 0 or self.embedding_dim % 4:
            raise ValueError(
                f"table {self.name}: embedding_dim must be a positive multiple of 4, "
                f"got {self.embedding_dim}"
            )
        if not self.feature_names:
            raise ValueError(f"table {self.name}: needs at least one feature")
        if self.pooling not in ("sum", "mean"):
            raise ValueError(f"table {self.name}: pooling must be 'sum' or 'mean'")


def init_table_(weight: torch.Tensor, *, num_embeddings: int) -> torch.Tensor:
    """Initializes a table in place: uniform in ``±sqrt(1 / num_embeddings)`` (as TorchRec)."""
    bound = math.sqrt(1.0 / num_embeddings)
    with torch.no_grad():
        return weight.uniform_(-bound, bound)


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups for a set of tables.

    Input: a KJT of shape ``(F, B, L[f][b])`` holding (at least) every feature of every table.
    Output: a :class:`KeyedTensor` of shape ``B x sum(D_f)`` with features in
    :attr:`feature_names` order (tables in order, each table's features in order).

    Args:
        tables: the tables.
        device: where to allocate the weights (``meta`` for deferred allocation).
    """

    def __init__(self, tables: list[EmbeddingBagConfig], *, device: torch.device | str = "cpu"):
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        features = [f for t in tables for f in t.feature_names]
        dupes = sorted({f for f in features if features.count(f) > 1})
        if dupes:
            raise ValueError(f"features {dupes} are assigned to more than one table")
        self.tables = list(tables)
        self.weights = nn.ParameterDict(
            {
                t.name: nn.Parameter(torch.empty(t.num_embeddings, t.embedding_dim, device=device))
                for t in tables
            }
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for t in self.tables:
            weight = self.weights[t.name]
            if weight.device.type != "meta":
                init_table_(weight, num_embeddings=t.num_embeddings)

    @property
    def feature_names(self) -> list[str]:
        return [f for t in self.tables for f in t.feature_names]

    @property
    def feature_dims(self) -> list[int]:
        return [t.embedding_dim for t in self.tables for _ in t.feature_names]

    def forward(
        self, features: KeyedJaggedTensor, dedup_groups: Sequence[DedupGroup] = ()
    ) -> KeyedTensor:
        """Pooled embeddings of every feature.

        Args:
            features: KJT of batch size ``B`` holding every feature not in ``dedup_groups``.
            dedup_groups: deduplicated features (RecD): each group's unique rows are looked up
                once and the pooled rows expanded to the batch with the inverse index.

        Returns:
            ``B x sum(D_f)``, features in :attr:`feature_names` order.
        """
        table_of = {f: t for t in self.tables for f in t.feature_names}
        pooled: dict[str, torch.Tensor] = {}
        sources = [(features, None)] + [(g.unique, g.inverse) for g in dedup_groups]
        for kjt, inverse in sources:
            names = [f for f in kjt.keys if f in table_of and f not in pooled]
            if not names:
                continue
            for name, vectors in self._pool(kjt.select(names), table_of).items():
                pooled[name] = vectors if inverse is None else vectors.index_select(0, inverse)
        missing = [f for f in self.feature_names if f not in pooled]
        if missing:
            raise KeyError(f"features {missing} are missing from the batch")
        return KeyedTensor(
            keys=self.feature_names,
            dims=self.feature_dims,
            values=torch.cat([pooled[f] for f in self.feature_names], dim=1),
        )

    def _pool(
        self, kjt: KeyedJaggedTensor, table_of: dict[str, EmbeddingBagConfig]
    ) -> dict[str, torch.Tensor]:
        """Feature -> ``(batch, D)`` pooled vectors of every feature of ``kjt``."""
        b = kjt.batch_size
        offsets = kjt.offset_per_key()
        pooled = {}
        for i, feature in enumerate(kjt.keys):
            table = table_of[feature]
            start, end = int(offsets[i]), int(offsets[i + 1])
            lengths = kjt.lengths[i * b : (i + 1) * b]
            bag_offsets = torch.zeros(b + 1, dtype=torch.int64, device=lengths.device)
            torch.cumsum(lengths, 0, out=bag_offsets[1:])
            ids = kjt.values[start:end]
            weight = self.weights[table.name]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
                raise ValueError(
                    f"table {table.name}: ids must be in [0, {table.num_embeddings}), got range "
                    f"[{int(ids.min())}, {int(ids.max())}]"
                )
            pooled[feature] = nn.functional.embedding_bag(
                ids,
                weight,
                bag_offsets[:-1],
                mode=table.pooling,
                per_sample_weights=None if kjt.weights is None else kjt.weights[start:end],
                include_last_offset=False,
            )
        return pooled
