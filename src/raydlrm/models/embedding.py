"""Unsharded embedding-bag collection: the sparse part of a model, written without parallelism.

``raydlrm.sharding`` turns an :class:`EmbeddingBagCollection` into its sharded form (looked up by
fbgemm's kernel or its PyTorch equivalent, ``sharding.kernel``); the unsharded module is the
reference in parity tests and what exported models run.
Tables are plain parameters (one ``(num_embeddings, embedding_dim)`` tensor per table), so the
module can be built on the meta device when the tables are too large for one host.

Initialization is deterministic per block of rows: rows ``[k * INIT_BLOCK_ROWS, (k + 1) *
INIT_BLOCK_ROWS)`` of table ``t`` are drawn from a generator seeded by ``(seed, t, k)``. Any
rectangle of a table (a row, column or table shard) is therefore initialized on its own, with
the values the whole table would have, whatever the world size or plan: a rank creates only its
shards, and a sharded run still starts from the unsharded reference's weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor

__all__ = ["INIT_BLOCK_ROWS", "EmbeddingBagCollection", "EmbeddingBagConfig", "init_rows_"]

INIT_BLOCK_ROWS = 8192
"""Rows drawn from one seeded generator; initializing a shard holds one block at most."""


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


def _block_seed(seed: int, table: str, block: int) -> int:
    """A 63-bit generator seed for block ``block`` of table ``table`` (stable across runs and
    platforms: not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{seed}/{table}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_rows_(
    weight: torch.Tensor,
    *,
    table: EmbeddingBagConfig,
    seed: int,
    row_start: int = 0,
    col_start: int = 0,
) -> torch.Tensor:
    """Initializes, in place, the rectangle of ``table`` that ``weight`` holds: rows
    ``[row_start, row_start + weight.shape[0])``, columns ``[col_start, col_start +
    weight.shape[1])``, uniform in ``±sqrt(1 / num_embeddings)`` (as TorchRec).

    Each block of :data:`INIT_BLOCK_ROWS` rows is drawn whole (all ``embedding_dim`` columns,
    fp32, on the CPU) from its own seeded generator and the overlap copied (cast to
    ``weight``'s dtype and device), so a shard gets exactly the values of the same rows and
    columns of the whole table.

    Args:
        weight: ``(rows, cols)`` tensor, any dtype and device.
        table: the table the rectangle belongs to.
        seed: the run's seed.
        row_start: first table row of ``weight``.
        col_start: first table column of ``weight``.

    Returns:
        ``weight``.
    """
    rows, cols = weight.shape
    if row_start < 0 or row_start + rows > table.num_embeddings:
        raise ValueError(f"table {table.name}: rows [{row_start}, {row_start + rows}) out of range")
    if col_start < 0 or col_start + cols > table.embedding_dim:
        raise ValueError(f"table {table.name}: cols [{col_start}, {col_start + cols}) out of range")
    bound = math.sqrt(1.0 / table.num_embeddings)
    generator = torch.Generator()
    row_end = row_start + rows
    for block in range(row_start // INIT_BLOCK_ROWS, -(-row_end // INIT_BLOCK_ROWS)):
        first = block * INIT_BLOCK_ROWS
        last = min(first + INIT_BLOCK_ROWS, table.num_embeddings)
        generator.manual_seed(_block_seed(seed, table.name, block))
        values = torch.empty(last - first, table.embedding_dim).uniform_(
            -bound, bound, generator=generator
        )
        lo, hi = max(first, row_start), min(last, row_end)
        weight[lo - row_start : hi - row_start].copy_(
            values[lo - first : hi - first, col_start : col_start + cols]
        )
    return weight


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups for a set of tables.

    Input: a KJT of shape ``(F, B, L[f][b])`` holding (at least) every feature of every table.
    Output: a :class:`KeyedTensor` of shape ``B x sum(D_f)`` with features in
    :attr:`feature_names` order (tables in order, each table's features in order).

    Args:
        tables: the tables.
        device: where to allocate the weights (``meta`` for deferred allocation: the sharded
            collection then creates each rank's shards from ``seed``).
        seed: the seed of the block-wise initialization (see :func:`init_rows_`).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ):
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        features = [f for t in tables for f in t.feature_names]
        dupes = sorted({f for f in features if features.count(f) > 1})
        if dupes:
            raise ValueError(f"features {dupes} are assigned to more than one table")
        self.tables = list(tables)
        self.seed = seed
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
                init_rows_(weight, table=t, seed=self.seed)

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
            if weight.dtype == torch.float32:
                per_sample = None if kjt.weights is None else kjt.weights[start:end]
                pooled[feature] = nn.functional.embedding_bag(
                    ids,
                    weight,
                    bag_offsets[:-1],
                    mode=table.pooling,
                    per_sample_weights=per_sample,
                    include_last_offset=False,
                )
                continue
            # fp16 tables (sharding.weights_precision): the looked-up rows pooled in fp32, as
            # fbgemm's kernels do (fp16 sums would drift from the trained model's outputs).
            rows = weight.index_select(0, ids).float()
            if kjt.weights is not None:
                rows = rows * kjt.weights[start:end].float().unsqueeze(1)
            bags = torch.repeat_interleave(
                torch.arange(b, device=lengths.device), lengths, output_size=ids.numel()
            )
            sums = torch.zeros(b, weight.shape[1], device=rows.device).index_add_(0, bags, rows)
            if table.pooling == "mean":
                sums = sums / lengths.clamp(min=1).unsqueeze(1).to(sums.dtype)
            pooled[feature] = sums
        return pooled
