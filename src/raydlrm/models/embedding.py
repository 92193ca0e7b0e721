"""Unsharded embedding-bag collection: the sparse part of a model, written without parallelism.

``raydlrm.sharding`` turns an :class:`EmbeddingBagCollection` into its sharded form (looked up by
fbgemm's kernel or its PyTorch equivalent, ``sharding.kernel``); the unsharded module is the
reference in parity tests and what exported models run.
Tables are plain parameters (one ``(num_embeddings, embedding_dim)`` tensor per table), so the
module can be built on the meta device when the tables are too large for one host.

A table trained ``int8`` or ``int4`` (``sharding.weights_precision``) stays quantized in the
unsharded model (exported models, scoring): a :class:`QuantizedTable` of buffers (its codes, its
fp16 scale and bias per row and column block, and the column blocks) in place of its weight. A
state dict holding such a table's buffers makes the collection hold it quantized when loaded
(:meth:`EmbeddingBagCollection.load_state_dict`, ``assign=True`` included), and a lookup
dequantizes only the rows it gathers, pooled in fp32.

Initialization is deterministic per block of rows: rows ``[k * INIT_BLOCK_ROWS, (k + 1) *
INIT_BLOCK_ROWS)`` of table ``t`` are drawn from a generator seeded by ``(seed, t, k)``. Any
rectangle of a table (a row, column or table shard) is therefore initialized on its own, with
the values the whole table would have, whatever the world size or plan: a rank creates only its
shards, and a sharded run still starts from the unsharded reference's weights.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from raydlrm.batch import DedupGroup, JaggedTensor, KeyedJaggedTensor, KeyedTensor
from raydlrm.ids import ManagedIds
from raydlrm.models.managed_ids import IdMaps
from raydlrm.models.quantized import code_bytes_per_row, dequantize_blocks, quantized_precision

__all__ = [
    "INIT_BLOCK_ROWS",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "QuantizedTable",
    "check_id_range",
    "init_rows_",
]

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
        pooling: ``sum`` or ``mean`` of a bag's rows, or ``none``: every id's row is returned
            on its own (per position, a :class:`~raydlrm.batch.JaggedTensor` per feature: a
            sequence feature's history, or a candidate item sharing the history's table).
        managed: a managed table's policy (its features hold raw ids, given rows by
            :mod:`raydlrm.models.managed_ids`); None: the ids are rows (hashed upstream).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: Literal["sum", "mean", "none"] = "sum"
    managed: ManagedIds | None = None

    @property
    def pooled(self) -> bool:
        """Whether a bag's rows are pooled into one vector (else returned per position)."""
        return self.pooling != "none"

    @property
    def id_limit(self) -> int:
        """The bound ids of its features must stay below: its rows, or for a managed table
        any non-negative int64."""
        return self.num_embeddings if self.managed is None else (1 << 63) - 1

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
        if self.pooling not in ("sum", "mean", "none"):
            raise ValueError(f"table {self.name}: pooling must be 'sum', 'mean' or 'none'")


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


def check_id_range(
    kjt: KeyedJaggedTensor,
    limits: torch.Tensor,
    *,
    table_of: dict[str, EmbeddingBagConfig] | dict[str, str],
) -> None:
    """Checks every id of ``kjt`` is a row of its feature's table: in ``[0, limits[f])`` for
    feature ``f`` (``limits``: one per key, on the ids' device). Each feature's smallest and
    largest id first (one synchronization when all are in range); the first bad id is then
    found and named. The one id range check of the unsharded and the sharded collections.

    Raises:
        ValueError: naming the table (``table_of``: feature -> its table or table name), the
            feature, the id and the range.
    """
    if not kjt.values.numel():
        return
    extremes = torch.stack(
        [
            torch.stack(torch.aminmax(v)) if v.numel() else v.new_zeros(2)
            for v in kjt.values.split(kjt.length_per_key().tolist())
        ]
    )
    if not bool(((extremes[:, 0] < 0) | (extremes[:, 1] >= limits)).any()):
        return
    per_id = torch.repeat_interleave(limits, kjt.length_per_key(), output_size=kjt.values.numel())
    pos = int(torch.nonzero((kjt.values < 0) | (kjt.values >= per_id))[0, 0])
    feature = int(torch.searchsorted(kjt.offset_per_key(), pos, right=True)) - 1
    key = kjt.keys[feature]
    table = table_of[key]
    name = table if isinstance(table, str) else table.name
    raise ValueError(
        f"table {name!r} (feature {key!r}): id {int(kjt.values[pos])} not in "
        f"[0, {int(limits[feature])})"
    )


class QuantizedTable(nn.Module):
    """An ``int8`` / ``int4`` table held as it was trained and saved (see
    :mod:`raydlrm.models.quantized`; saved as :mod:`raydlrm.sharding.embedding_checkpoint`
    says), in three buffers:

    * ``codes``: ``(num_embeddings, embedding_dim * bits / 8)`` uint8; block ``k``'s codes at
      byte columns ``[start_k * bits / 8, end_k * bits / 8)`` (``int4``: two a byte, the even
      column in the low nibble);
    * ``qparams``: ``(num_embeddings, 2 K)`` fp16, block ``k``'s scale and bias at columns
      ``2k, 2k + 1``;
    * ``blocks``: ``(K, 2)`` int64, the column blocks ``[start_k, end_k)`` the rows were
      quantized by (the saving plan's column shards; ``[[0, embedding_dim]]`` unless
      column-sharded).

    The precision follows from the shapes (:func:`quantized_precision`). Value ``j`` of block
    ``k`` reads ``bias_k + code_j * scale_k`` in fp32.

    Args:
        num_embeddings: rows.
        embedding_dim: columns.
        precision: ``int8`` or ``int4``.
        num_blocks: ``K``.
        device: where to allocate the buffers (``meta``: shapes only, for
            ``load_state_dict(..., assign=True)``); allocated zero (``blocks``: an even split).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        precision: str,
        num_blocks: int = 1,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.embedding_dim = embedding_dim
        width = code_bytes_per_row(embedding_dim, precision)
        bounds = [embedding_dim * k // num_blocks for k in range(num_blocks + 1)]
        blocks = torch.tensor(list(itertools.pairwise(bounds)), dtype=torch.int64)
        self.register_buffer(
            "codes", torch.zeros(num_embeddings, width, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "qparams",
            torch.zeros(num_embeddings, 2 * num_blocks, dtype=torch.float16, device=device),
        )
        self.register_buffer("blocks", blocks.view(num_blocks, 2).to(device))

    @property
    def precision(self) -> str:
        return quantized_precision(self.embedding_dim, self.codes.shape[1])

    def column_blocks(self) -> list[tuple[int, int]]:
        """The column blocks, checked: adjacent, from 0 to ``embedding_dim``, as many as
        ``qparams`` has pairs.

        Raises:
            ValueError: blocks that do not tile the row, or another number of them.
        """
        blocks = [(int(a), int(b)) for a, b in self.blocks.tolist()]
        edges = [0] + [b for _, b in blocks]
        if (
            not blocks
            or [a for a, _ in blocks] != edges[:-1]
            or edges[-1] != self.embedding_dim
            or any(a >= b for a, b in blocks)
            or self.qparams.shape[1] != 2 * len(blocks)
        ):
            raise ValueError(
                f"column blocks {blocks} do not tile a row of {self.embedding_dim} columns "
                f"with {self.qparams.shape[1] // 2} (scale, bias) pairs"
            )
        return blocks

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids``, dequantized: ``(len(ids), embedding_dim)`` fp32 (only those rows'
        codes and parameters are read)."""
        return dequantize_blocks(
            self.codes.index_select(0, ids),
            self.qparams.index_select(0, ids),
            blocks=[(a, b) for a, b in self.blocks.tolist()],  # checked when loaded
            precision=self.precision,
        )


_QUANTIZED = "quantized."
_WEIGHTS = "weights."


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding lookups for a set of tables.

    Input: a KJT of shape ``(F, B, L[f][b])`` holding (at least) every feature of every table.
    Output: a :class:`KeyedTensor` of shape ``B x sum(D_f)`` with the pooled features in
    :attr:`pooled_feature_names` order (tables in order, each table's features in order), and
    in its ``jagged`` the per-position rows of every feature of a ``pooling = "none"`` table.

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
        # Tables held quantized (see QuantizedTable): none until a state dict holds some.
        self.quantized = nn.ModuleDict()
        # Managed tables' id maps, (rows, 4) each (raydlrm.models.managed_ids): what a model
        # restored from a checkpoint looks its ids up in; empty maps on a fresh model.
        self.id_maps = IdMaps([t for t in tables if t.managed is not None], device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for t in self.tables:
            weight = self.weights.get(t.name)
            if weight is not None and weight.device.type != "meta":
                init_rows_(weight, table=t, seed=self.seed)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Before the tables load (torch loads a module before its children): a table whose
        ``quantized.<table>.codes`` the state dict holds is held as a :class:`QuantizedTable`
        of the saved shapes (on the device of the table it replaces), one whose
        ``weights.<table>`` it holds as a weight; then the keys load as usual."""
        for t in self.tables:
            codes = state_dict.get(f"{prefix}{_QUANTIZED}{t.name}.codes")
            if codes is not None:
                qparams = state_dict.get(f"{prefix}{_QUANTIZED}{t.name}.qparams")
                pairs = 1 if qparams is None else qparams.shape[1] // 2
                try:
                    self._hold_quantized(t, code_bytes=codes.shape[1], num_blocks=pairs)
                except ValueError as exc:
                    error_msgs.append(f"table {t.name}: {exc}")
            elif f"{prefix}{_WEIGHTS}{t.name}" in state_dict and t.name in self.quantized:
                device = self.quantized[t.name].codes.device
                del self.quantized[t.name]
                self.weights[t.name] = nn.Parameter(
                    torch.empty(t.num_embeddings, t.embedding_dim, device=device)
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _hold_quantized(self, table: EmbeddingBagConfig, *, code_bytes: int, num_blocks: int):
        """Holds ``table`` as a :class:`QuantizedTable` (in place of its weight) of rows of
        ``code_bytes`` code bytes in ``num_blocks`` column blocks."""
        precision = quantized_precision(table.embedding_dim, code_bytes)
        if table.name in self.weights:
            device = self.weights[table.name].device
        else:
            device = self.quantized[table.name].codes.device
        self.quantized[table.name] = QuantizedTable(
            table.num_embeddings,
            table.embedding_dim,
            precision=precision,
            num_blocks=num_blocks,
            device=device,
        )
        if table.name in self.weights:
            del self.weights[table.name]

    def precisions(self) -> dict[str, str]:
        """Table name -> the precision it is held in (``fp32``, ``fp16``, ``int8``, ...)."""
        names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
        out = {}
        for t in self.tables:
            if t.name in self.quantized:
                out[t.name] = self.quantized[t.name].precision
            else:
                dtype = self.weights[t.name].dtype
                out[t.name] = names.get(dtype, str(dtype).removeprefix("torch."))
        return out

    @property
    def feature_names(self) -> list[str]:
        """Every feature looked up, pooled or per position."""
        return [f for t in self.tables for f in t.feature_names]

    @property
    def pooled_feature_names(self) -> list[str]:
        """The pooled features: the columns of the output's ``values``."""
        return [f for t in self.tables if t.pooled for f in t.feature_names]

    @property
    def pooled_feature_dims(self) -> list[int]:
        return [t.embedding_dim for t in self.tables if t.pooled for _ in t.feature_names]

    @property
    def sequence_feature_names(self) -> list[str]:
        """The features looked up per position (the output's ``jagged``)."""
        return [f for t in self.tables if not t.pooled for f in t.feature_names]

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
            ``B x sum(D_f)``, the pooled features in :attr:`pooled_feature_names` order; the
            per-position rows of :attr:`sequence_feature_names` in ``jagged``.

        A deduplicated feature looked up per position (a history repeated over a session's
        samples) is looked up on the unique rows and expanded to the batch
        (:meth:`JaggedTensor.index_rows`).
        """
        table_of = {f: t for t in self.tables for f in t.feature_names}
        pooled: dict[str, torch.Tensor] = {}
        jagged: dict[str, JaggedTensor] = {}
        sources = [(features, None)] + [(g.unique, g.inverse) for g in dedup_groups]
        for kjt, inverse in sources:
            names = [f for f in kjt.keys if f in table_of and f not in pooled and f not in jagged]
            if not names:
                continue
            selected = kjt.select(names)
            for name, vectors in self._pool(selected, table_of).items():
                if not table_of[name].pooled:
                    rows = JaggedTensor(values=vectors, lengths=selected.select([name]).lengths)
                    jagged[name] = rows if inverse is None else rows.index_rows(inverse)
                else:
                    pooled[name] = vectors if inverse is None else vectors.index_select(0, inverse)
        missing = [f for f in self.feature_names if f not in pooled and f not in jagged]
        if missing:
            raise KeyError(f"features {missing} are missing from the batch")
        keys = self.pooled_feature_names
        values = (
            torch.cat([pooled[f] for f in keys], dim=1)
            if keys
            else torch.zeros(features.batch_size, 0, device=features.values.device)
        )
        return KeyedTensor(
            keys=keys,
            dims=self.pooled_feature_dims,
            values=values,
            jagged={f: jagged[f] for f in self.sequence_feature_names},
        )

    def _rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows of ``ids`` (int64 rows of ``table``), differentiable for a float
        table."""
        if table in self.quantized:
            distinct, inverse = torch.unique(ids, return_inverse=True)
            return self.quantized[table].rows(distinct).index_select(0, inverse)
        weight = self.weights[table]
        if weight.dtype == torch.float32:
            return nn.functional.embedding(ids, weight)
        return weight.index_select(0, ids).float()

    def _pool(
        self, kjt: KeyedJaggedTensor, table_of: dict[str, EmbeddingBagConfig]
    ) -> dict[str, torch.Tensor]:
        """Feature -> ``(batch, D)`` pooled vectors of every feature of ``kjt`` (a per-position
        feature: ``(ids, D)``, a row per id)."""
        limits = [table_of[f].id_limit for f in kjt.keys]
        check_id_range(kjt, torch.tensor(limits, device=kjt.values.device), table_of=table_of)
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
            if table.managed is not None:  # raw ids: their rows, unknown ids the fallback's
                ids = self.id_maps.rows(table.name, ids)
            per_sample = None if kjt.weights is None else kjt.weights[start:end]
            if not table.pooled:  # a row per id, fp32 (as the kernels return them)
                pooled[feature] = self._rows(table.name, ids)
                continue
            if table.name in self.quantized:
                # Only the distinct rows looked up are read and dequantized (fp32), then
                # pooled as an fp32 table's rows are.
                distinct, inverse = torch.unique(ids, return_inverse=True)
                pooled[feature] = nn.functional.embedding_bag(
                    inverse,
                    self.quantized[table.name].rows(distinct),
                    bag_offsets[:-1],
                    mode=table.pooling,
                    per_sample_weights=None if per_sample is None else per_sample.float(),
                    include_last_offset=False,
                )
                continue
            weight = self.weights[table.name]
            if weight.dtype == torch.float32:
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
