"""Sharded embedding-bag collection on table-batched embedding (TBE) kernels.

Every table is sharded by the :class:`~raydlrm.sharding.plan.ShardingPlan` (table-wise,
column-wise, row-wise, table-row-wise or data-parallel; types mix freely in one collection).
The unit of work is one feature looked up in one shard (:mod:`raydlrm.sharding._layout`); each
rank looks up its units for the whole global batch with one TBE per (batch class, replicated,
pooling mode, precision, placement): fbgemm's, or its PyTorch equivalent (``sharding.kernel``,
see :mod:`raydlrm.sharding.kernel`). The collection implements
:class:`~raydlrm.sharding.types.ShardedTables`; a forward pass is its ``input_dist`` (step 1,
which a pipeline may run ahead) and its ``compute_and_output_dist`` (steps 2-4):

1. sends every id to the units that own its row, with the row offset subtracted, and receives
   this rank's units' bags for every rank's samples (:mod:`raydlrm.sharding._input_dist`);
2. looks up and pools with TBE;
3. sharded units: sends each rank the pooled rows of its samples; data-parallel units: keeps
   this rank's rows; and copies every received block's columns into its features' output
   columns: column shards land side by side, row shards' partial sums add up (a reduce-scatter
   done as all-to-all plus sum) (:mod:`raydlrm.sharding._output_dist`);
4. row-split mean tables, pooled as sums, are divided by the bag's true length.

Deduplicated features (RecD): features declared as a dedup group (e.g. the user features,
identical over a session's samples) reach the collection as a
:class:`~raydlrm.batch.DedupGroup`, the group's ``U`` unique rows in the batch and an inverse
index. Each group is a *batch class* of its own: its features are routed, looked up and sent
back on their unique rows, in the same input and output all-to-alls as the plain features (one
of each per batch, a variable batch size per feature), and expanded to the batch with the
inverse index after the output exchange (a row gather whose backward sums the gradients of
duplicate samples, so the fused optimizer's update equals that of the plain path up to float
summation order). A table belongs to one class: a table looked up both by a deduplicated
feature and by a feature outside its group is an error.

Design choices:

- *Data-parallel update.* The fused optimizers update rows inside the TBE backward, so the
  weight gradient can never be all-reduced before the update. Instead every replica looks up
  the *global* batch (its ids reach every rank through the same input all-to-all) and the
  backward of the output distribution all-gathers their pooled-output gradient rows
  (divided by the world size, as for every other type). Every replica then runs the same TBE
  backward on the same ids and gradients: the update equals the single-process one on the
  global batch, replicas stay bit-identical, and the communication is ``B x D`` per table
  rather than a dense ``rows x D`` all-reduce.
- *Column-wise row-wise Adagrad.* Row-wise Adagrad keeps one momentum per row, the mean of the
  row's squared gradients. A column shard only sees its columns, so each shard keeps the
  momentum of its own row segment (as TorchRec does): the column-wise update is exactly
  row-wise Adagrad with each shard's row segment as the "row". It equals the unsharded update
  only when the table has a single column shard. Adagrad and SGD are per element and exact.
  The width-weighted mean of the segments' momenta is the unsharded definition (mean over the
  whole row) of the accumulated squared gradients: what a resharded checkpoint loads
  (:mod:`raydlrm.sharding.state`).

The TBE's fused optimizer updates the rows in the backward pass: embeddings need no separate
optimizer step. Ids are checked against their table's size on the rank that sends them, so the
error names the table and shows up where the bad batch is.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn
from torch.distributed import ProcessGroup

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor, lengths_to_offsets
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig, init_rows_
from raydlrm.models.quantized import code_bytes_per_row
from raydlrm.sharding._comm import CommBytes, rank_and_world_size
from raydlrm.sharding._input_dist import InputDistributor, LocalBags
from raydlrm.sharding._layout import LookupUnit, TbeGroup, batch_classes, rank_units, tbe_groups
from raydlrm.sharding._output_dist import ClassLayout, ColumnRun, OutputDist, column_runs
from raydlrm.sharding.codecs import ColumnBlockCodec
from raydlrm.sharding.config import QUANTIZED, ShardingConfig
from raydlrm.sharding.cost import cache_rows, quantized_cache_rows, wire_bytes_per_vector
from raydlrm.sharding.delta import ModifiedRows
from raydlrm.sharding.kernel import WEIGHT_DTYPES, TableSpec, build_tbe, resolve_kernel
from raydlrm.sharding.plan import Shard, ShardingPlan
from raydlrm.sharding.quantized import QuantizedRows, table_key
from raydlrm.sharding.row_cache import RowCache
from raydlrm.sharding.tiers import TierError, mapped_buffer, ssd_directory
from raydlrm.sharding.types import ShardedTables

__all__ = ["ShardedEmbeddingBagCollection"]

_ROW_SPLIT = ("row_wise", "table_row_wise")
_INIT_CHUNK_ROWS = 65536
"""Rows of a quantized shard initialized at once (fp32 rows in memory while it is filled)."""


@dataclass
class _Routed:
    """A batch routed to this collection's shards (a :class:`~raydlrm.sharding.types.Routed`).

    Attributes:
        features: the batch's features it was made for.
        kjts: per batch class, its features of the batch (a row per sample, or per unique row
            of a dedup group); None for a class without features.
        inverses: per batch class, the inverse index of its dedup group (None: a row per
            sample).
        bags: this rank's units' bags for every rank's samples.
    """

    features: KeyedJaggedTensor
    kjts: list[KeyedJaggedTensor | None]
    inverses: list[torch.Tensor | None]
    bags: LocalBags

    def tensors(self) -> Iterator[torch.Tensor | None]:
        for kjt in self.kjts:
            if kjt is not None:
                yield from (kjt.values, kjt.lengths, kjt.weights)
        yield from self.inverses
        yield from (self.bags.lengths, self.bags.values, self.bags.weights)


def _output_codecs(
    units: list[list[LookupUnit]], config: ShardingConfig, *, kernel: str, num_classes: int
) -> list[list[ColumnBlockCodec]]:
    """The codec of the columns of every rank's sharded units of each batch class (per-table
    precision), with ``kernel``'s operators.

    Raises:
        ValueError: if ``config.comm_precision_per_table`` names a table with no units.
    """
    per_table = config.comm_precision_per_table
    names = {u.table.name for us in units for u in us}
    unknown = sorted(set(per_table) - names)
    if unknown:
        raise ValueError(f"sharding.comm_precision_per_table names unknown tables {unknown}")
    replicated = sorted({u.table.name for us in units for u in us if u.replicated} & set(per_table))
    if replicated:
        warnings.warn(
            f"sharding.comm_precision_per_table: data_parallel tables {replicated} have no "
            "output all-to-all; their gradient all-gather stays fp32",
            stacklevel=3,
        )
    return [
        [
            ColumnBlockCodec.from_columns(
                [
                    (per_table.get(u.table.name, config.comm_precision), u.dim)
                    for u in us
                    if not u.replicated and u.batch_class == c
                ],
                kernel=kernel,
            )
            for c in range(num_classes)
        ]
        for us in units
    ]


def _numel(group: TbeGroup) -> int:
    """Values of the group's shards."""
    return sum((s.row_end - s.row_start) * (s.col_end - s.col_start) for _, s in group.shards)


def _column_starts(features: list[str], dims: dict[str, int]) -> dict[str, int]:
    """The first column of each of ``features`` when their columns are side by side."""
    return dict(zip(features, accumulate((dims[f] for f in features), initial=0), strict=False))


class ShardedEmbeddingBagCollection(ShardedTables):
    """An :class:`EmbeddingBagCollection` sharded across the ranks of ``pg`` by a plan.

    Input and output are those of the unsharded collection: a KJT of shape ``(F, B, L[f][b])``
    holding this rank's ``B`` samples (``B`` may differ across ranks), and a
    :class:`KeyedTensor` of shape ``B x sum(D_f)`` in ``ebc.feature_names`` order.

    Args:
        ebc: the unsharded collection; its tables' weights initialize the shards (every rank
            must build it with the same seed). Tables on the meta device are created shard by
            shard from ``ebc.seed`` instead, with the values the unsharded table would have.
        plan: where each table lives; its world size must be the size of ``pg``.
        config: the kernel, the fused optimizer, its hyper-parameters, and the codecs of the
            pooled output all-to-all (``comm_precision``, ``comm_precision_per_table``).
        device: ``cpu`` (host TBE, gloo) or a CUDA device (device TBE, NCCL).
        pg: process group (default: torch.distributed's default group; none initialized or a
            world size of 1 means no communication).
        dedup_groups: the feature names of each dedup group (RecD, see the module docstring).

    Attributes:
        kernel: the kernel this rank runs (``fbgemm`` or ``torch``; ``sharding.kernel``
            resolved).
        dedup_groups: the feature names of each dedup group.

    Raises:
        ValueError: if the plan does not match the tables or the process group's size,
            ``comm_precision_per_table`` names an unknown table, a dedup group names a feature
            no table looks up, or a table is looked up across a group boundary.
        ImportError: ``sharding.kernel = "fbgemm"`` without a usable fbgemm-gpu.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        *,
        plan: ShardingPlan,
        config: ShardingConfig,
        device: torch.device | str,
        pg: ProcessGroup | None = None,
        dedup_groups: Sequence[Sequence[str]] = (),
    ):
        super().__init__()
        plan.validate(ebc.tables)
        class_of = batch_classes(ebc.tables, dedup_groups)
        self.dedup_groups = [list(g) for g in dedup_groups]
        self._pg = pg
        self._rank, self._world_size = rank_and_world_size(pg)
        if plan.world_size != self._world_size:
            raise ValueError(
                f"sharding plan is for world_size {plan.world_size}, but the process group has "
                f"{self._world_size} ranks"
            )
        self._device = torch.device(device)
        self._comm_bytes = CommBytes()
        self._optimizer = config.optimizer
        self.kernel = resolve_kernel(config.kernel)
        self.tables = list(ebc.tables)
        self.feature_names = ebc.feature_names
        self.feature_dims = ebc.feature_dims
        self.plan = plan
        self._precisions = {t.name: config.weights_precision_of(t.name) for t in self.tables}
        self._class_features = [
            [f for f in self.feature_names if class_of[f] == c]
            for c in range(len(self.dedup_groups) + 1)
        ]
        units = rank_units(self.tables, plan, config.weights_precision_of, class_of)
        self._input = InputDistributor(
            units,
            feature_classes=[class_of[f] for f in self.feature_names],
            rank=self._rank,
            device=self._device,
            pg=pg,
            comm_bytes=self._comm_bytes,
            fbgemm=self.kernel == "fbgemm",
        )
        self._output = self._output_dist(units, config)
        self._register_feature_buffers()
        self._dedup = _DedupCounters(self.tables, class_of, units[self._rank], config, self._rank)
        self._groups = tbe_groups(units[self._rank])
        self._pieces: list[tuple[EmbeddingBagConfig, Shard]] = [
            p for g in self._groups for p in g.shards
        ]
        self.local_table_configs = [t for t, _ in self._pieces]
        self._ssd_directory = ssd_directory(config.ssd_path)
        self._build_tbes(config, seed=ebc.seed)
        self._init_weights(ebc)
        self._modified: ModifiedRows | None = None

    def _output_dist(self, units: list[list[LookupUnit]], config: ShardingConfig) -> OutputDist:
        """The output distribution: per batch class, the output column (or the column among
        the class's own) of every column of the blocks received (sharded units of every rank,
        in rank order), then of this rank's replicated units."""
        dims = dict(zip(self.feature_names, self.feature_dims, strict=True))
        output = _column_starts(self.feature_names, dims)
        layouts = []
        for c, features in enumerate(self._class_features):
            compact = _column_starts(features, dims)

            def runs(start: dict[str, int], c: int = c) -> list[ColumnRun]:
                def targets(us: list[LookupUnit]) -> list[int]:
                    return [
                        start[u.feature] + col
                        for u in us
                        if u.batch_class == c
                        for col in range(u.shard.col_start, u.shard.col_end)
                    ]

                return column_runs(
                    [targets([u for u in us if not u.replicated]) for us in units]
                    + [targets([u for u in units[self._rank] if u.replicated])]
                )

            placement = [output[f] + i for f in features for i in range(dims[f])]
            layouts.append(
                ClassLayout(
                    width=len(placement),
                    runs=runs(output),
                    compact_runs=runs(compact),
                    placement=column_runs([placement]),
                )
            )
        return OutputDist(
            classes=layouts,
            num_columns=sum(self.feature_dims),
            codecs=_output_codecs(units, config, kernel=self.kernel, num_classes=len(layouts)),
            pg=self._pg,
            comm_bytes=self._comm_bytes,
        )

    def _register_feature_buffers(self) -> None:
        """Per feature: its table's size (the id check, per batch class) and dim, and whether
        it is a mean bag of a row-split table (pooled as sums by the shards, divided after the
        exchange); each class's features' positions."""
        table_of = {f: t for t in self.tables for f in t.feature_names}
        row_split = {t.name for t in self.plan.tables if t.sharding_type in _ROW_SPLIT}
        position = {f: i for i, f in enumerate(self.feature_names)}
        for c, features in enumerate(self._class_features):
            self._register(
                f"_limits{c}",
                torch.tensor([table_of[f].num_embeddings for f in features], dtype=torch.int64),
            )
            self._register(
                f"_positions{c}", torch.tensor([position[f] for f in features], dtype=torch.int64)
            )
        mean = [
            table_of[f].pooling == "mean" and table_of[f].name in row_split
            for f in self.feature_names
        ]
        self._has_row_split_mean = any(mean)
        self._register("_row_split_mean", torch.tensor(mean, dtype=torch.bool))
        self._register("_feature_dims", torch.tensor(self.feature_dims, dtype=torch.int64))

    def _build_tbes(self, config: ShardingConfig, *, seed: int) -> None:
        """One TBE per group of this rank's units; an ``ssd`` group's over its mapped files, or
        over the slots of a DRAM row cache in front of them; a quantized group's over the fp32
        slots of the cache in front of its quantized rows."""
        tbes, self._caches = [], []
        for group in self._groups:
            if group.precision in QUANTIZED:
                tbe, cache = self._quantized_group(group, config, seed=seed)
            else:
                tbe, cache = self._float_group(group, config)
            tbes.append(tbe)
            self._caches.append(cache)
        self.tbes = nn.ModuleList(tbes)

    def _float_group(
        self, group: TbeGroup, config: ShardingConfig
    ) -> tuple[nn.Module, RowCache | None]:
        """An fp32 / fp16 group's TBE: over its shards' rows (an uncached ``ssd`` group's in
        mapped files), or over the slots of the DRAM row cache in front of its files."""
        buffers = self._tier_buffers(group, config)
        cached = buffers is not None and config.ssd_cache_load_factor > 0
        rows = [
            cache_rows(
                s.row_end - s.row_start,
                load_factor=config.ssd_cache_load_factor,
                min_rows=config.ssd_cache_min_rows,
                step_rows=self._step_rows(t.name),
            )
            if cached
            else s.row_end - s.row_start
            for t, s in group.shards
        ]
        tbe = self._build_tbe(
            group, config, rows=rows, precision=group.precision, buffers=None if cached else buffers
        )
        return tbe, self._row_cache(group, tbe, buffers) if cached else None

    def _register(self, name: str, value: torch.Tensor) -> None:
        self.register_buffer(name, value.to(self._device), persistent=False)

    def _build_tbe(
        self,
        group: TbeGroup,
        config: ShardingConfig,
        *,
        rows: list[int],
        precision: str,
        buffers: dict[str, torch.Tensor] | None,
    ) -> nn.Module:
        """The group's TBE of ``rows`` rows per table: the shards' rows (in ``buffers`` if
        given: an uncached ``ssd`` group's mapped files), or the slots of its cache."""
        return build_tbe(
            self.kernel,
            tables=[
                TableSpec(rows=n, dim=s.col_end - s.col_start)
                for n, (_, s) in zip(rows, group.shards, strict=True)
            ],
            feature_table_map=group.feature_table_map,
            optimizer=config.optimizer,
            learning_rate=config.learning_rate,
            eps=config.eps,
            pooling=group.pooling,
            precision=precision,
            device=self._device,
            buffers=buffers,
        )

    def _check_tier_device(self, group: TbeGroup) -> None:
        if group.placement != "dram" and self._device.type != "cpu":
            raise TierError(
                f"tables {[t.name for t, _ in group.shards]}: placement {group.placement!r} is "
                f"for CPU workers; this worker's device is {self._device}"
            )

    def _group_buffer(self, group: TbeGroup, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat zeroed buffer of the group: mapped from a file for ``ssd``, else on the
        worker's device."""
        if group.placement == "dram":
            return torch.zeros(numel, dtype=dtype, device=self._device)
        names = [t.name for t, _ in group.shards]
        return mapped_buffer(self._ssd_directory, numel, dtype, tables=names)

    def _tier_buffers(
        self, group: TbeGroup, config: ShardingConfig
    ) -> dict[str, torch.Tensor] | None:
        """The host buffers of an ``ssd`` group, mapped from files (see
        :mod:`raydlrm.sharding.tiers`): its weights, and Adagrad's per-weight state (row-wise
        Adagrad's per-row state stays in memory); None for a ``dram`` group."""
        if group.placement == "dram":
            return None
        self._check_tier_device(group)
        numel = _numel(group)
        buffers = {"weights": self._group_buffer(group, numel, WEIGHT_DTYPES[group.precision])}
        if config.optimizer == "adagrad":
            buffers["momentum1"] = self._group_buffer(group, numel, torch.float32)
        return buffers

    def _row_cache(
        self,
        group: TbeGroup,
        tbe: nn.Module,
        backing: dict[str, torch.Tensor],
    ) -> RowCache:
        """The DRAM cache of a cached ``ssd`` group (see :mod:`.row_cache`): the TBE's
        weights are its slots, ``backing`` the mapped files of the whole shards."""
        return self._cache(group, tbe, self._split_rows(backing["weights"], group), backing)

    def _cache(
        self,
        group: TbeGroup,
        tbe: nn.Module,
        rows: list[torch.Tensor | QuantizedRows],
        backing: dict[str, torch.Tensor],
        *,
        too_small: str = "sharding.ssd_cache_min_rows (or ssd_cache_load_factor)",
    ) -> RowCache:
        """A :class:`RowCache` whose slots are ``tbe``'s weights and whose rows are ``rows``;
        Adagrad's per-weight state of the rows in ``backing["momentum1"]``, row-wise Adagrad's
        in memory."""
        slot_states = row_states = None
        if self._optimizer != "sgd":
            slot_states = [states[0] for states in tbe.split_optimizer_states()]
            if self._optimizer == "rowwise_adagrad":  # one float per row: in memory
                row_states = [
                    torch.zeros(sh.row_end - sh.row_start, device=self._device)
                    for _, sh in group.shards
                ]
            else:
                row_states = self._split_rows(backing["momentum1"], group)
        return RowCache(
            [t.name for t, _ in group.shards],
            slots=list(tbe.split_embedding_weights()),
            slot_states=slot_states,
            rows=rows,
            row_states=row_states,
            unit_tables=group.feature_table_map,
            too_small=too_small,
        )

    def _step_rows(self, table: str) -> int:
        """The most rows of ``table`` a step can look up, as planned (0: unknown); see
        :attr:`~raydlrm.sharding.plan.TablePlan.step_rows`."""
        return self.plan.table(table).step_rows

    def _quantized_group(
        self, group: TbeGroup, config: ShardingConfig, *, seed: int
    ) -> tuple[nn.Module, RowCache]:
        """A quantized group's fp32 TBE over the slots of the cache (see :mod:`.quantized`) in
        front of its quantized rows: in memory (``dram``) or in mapped files (``ssd``)."""
        self._check_tier_device(group)
        slots = [
            quantized_cache_rows(
                s.row_end - s.row_start,
                load_factor=config.cache_load_factor_of(t.name),
                step_rows=self._step_rows(t.name),
            )
            for t, s in group.shards
        ]
        tbe = self._build_tbe(group, config, rows=slots, precision="fp32", buffers=None)
        rows: list[torch.Tensor | QuantizedRows] = []
        for t, s in group.shards:
            n, cols = s.row_end - s.row_start, s.col_end - s.col_start
            width = code_bytes_per_row(cols, group.precision)
            rows.append(
                QuantizedRows(
                    self._group_buffer(group, n * width, torch.uint8).view(n, width),
                    self._group_buffer(group, n * 2, torch.float16).view(n, 2),
                    precision=group.precision,
                    dim=cols,
                    key=table_key(seed, t.name),
                    row_start=s.row_start,
                    col_start=s.col_start,
                )
            )
        backing = {}
        if config.optimizer == "adagrad":
            backing["momentum1"] = self._group_buffer(group, _numel(group), torch.float32)
        return tbe, self._cache(
            group,
            tbe,
            rows,
            backing,
            too_small="sharding.cache_load_factor (or cache_load_factor_per_table)",
        )

    @staticmethod
    def _split_rows(flat: torch.Tensor, group: TbeGroup) -> list[torch.Tensor]:
        """Per-table ``(rows, cols)`` views of a group's flat buffer, in TBE order."""
        views, start = [], 0
        for _, sh in group.shards:
            rows, cols = sh.row_end - sh.row_start, sh.col_end - sh.col_start
            views.append(flat[start : start + rows * cols].view(rows, cols))
            start += rows * cols
        return views

    @torch.no_grad()
    def _init_weights(self, ebc: EmbeddingBagCollection) -> None:
        """Fills this rank's shards: copied from ``ebc``'s tables, or, for tables on the meta
        device, created from ``ebc.seed`` block by block (:func:`init_rows_`), so no rank ever
        holds more than its shards and every rank's rows equal the unsharded ones. Quantized
        shards are filled :data:`_INIT_CHUNK_ROWS` rows at a time, rounded to nearest."""
        shards = self.local_shards()
        configs = {t.name: t for t in self.tables}

        def fill(target: torch.Tensor, name: str, row_start: int, col_start: int) -> None:
            source = ebc.weights[name]
            if source.device.type == "meta":
                init_rows_(
                    target,
                    table=configs[name],
                    seed=ebc.seed,
                    row_start=row_start,
                    col_start=col_start,
                )
            else:
                rows, cols = target.shape
                target.copy_(
                    source.detach()[row_start : row_start + rows, col_start : col_start + cols]
                )

        for name, weight in self.local_tables().items():
            s = shards[name]
            if not isinstance(weight, QuantizedRows):
                fill(weight, name, s.row_start, s.col_start)
                continue
            for lo in range(0, weight.shape[0], _INIT_CHUNK_ROWS):
                chunk = torch.empty(min(_INIT_CHUNK_ROWS, weight.shape[0] - lo), weight.dim)
                fill(chunk, name, s.row_start + lo, s.col_start)
                weight.assign(chunk, start=lo)

    def comm_bytes(self) -> dict[str, dict[str, int]]:
        """Cumulative bytes this rank sent to other ranks (counted from shapes, no sync).

        Returns:
            ``{"input": {"lengths"|"ids"|"weights": n}, "forward": {codec: n},
            "backward": {codec: n}}``; ``forward``/``backward`` are the pooled output and its
            gradient by codec name (the data-parallel gradient all-gather is ``fp32``
            backward bytes). Empty with a world size of 1.
        """
        return self._comm_bytes.as_dict()

    def local_tables(self) -> dict[str, torch.Tensor]:
        """Views of this rank's shard of each of its tables (one shard per table per rank).

        Returns:
            Table name -> ``(row_end - row_start, col_end - col_start)`` weights of the shard
            (see :meth:`local_shards`); a data-parallel table's full replica.
        """
        tables = {}
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            if cache is not None:  # the whole shard is in the file once the cache is flushed
                cache.flush()
                tables.update(cache.rows())
            else:
                tables.update(
                    (t.name, w)
                    for (t, _), w in zip(group.shards, tbe.split_embedding_weights(), strict=True)
                )
        return tables

    def ssd_tables(self) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        """This rank's ``ssd`` shards, as they are (no flush): table name -> (the rows in the
        file, (distinct ids found in the DRAM cache, distinct ids looked up) so far, or None
        for a table without a cache)."""
        out = {}
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            if cache is not None and group.placement == "ssd":
                hits = cache.hit_rates()
                out.update(
                    (name, (rows.codes if isinstance(rows, QuantizedRows) else rows, hits[name]))
                    for name, rows in cache.rows().items()
                )
            elif group.placement == "ssd":
                views = tbe.split_embedding_weights()
                out.update(
                    (t.name, (w, None)) for (t, _), w in zip(group.shards, views, strict=True)
                )
        return out

    def local_shards(self) -> dict[str, Shard]:
        """Table name -> the :class:`Shard` this rank holds, for each of its tables."""
        return {t.name: s for t, s in self._pieces}

    def weight_precisions(self) -> dict[str, str]:
        """Table name -> its ``sharding.weights_precision``, every table."""
        return dict(self._precisions)

    def memory_bytes(self) -> int:
        """Bytes of memory (DRAM or the device's) this rank's tables hold: the kernels'
        weights and optimizer state (the slots of a cache), quantized rows with their scales,
        caches' bookkeeping and the rows' state in memory; not what lives in mapped files."""
        total = 0
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            in_files = group.placement == "ssd" and cache is None
            if not in_files:
                tensors = list(tbe.split_embedding_weights())
                tensors += [x for states in tbe.split_optimizer_states() for x in states]
                total += sum(x.numel() * x.element_size() for x in tensors)
            if cache is not None:
                total += cache.memory_bytes(rows_in_memory=group.placement == "dram")
        return total

    def cache_hit_rates(self) -> dict[str, tuple[int, int]]:
        """Per quantized table of this rank: (distinct ids found in its fp32 cache, distinct
        ids looked up) so far."""
        out = {}
        for group, cache in zip(self._groups, self._caches, strict=True):
            if cache is not None and group.precision in QUANTIZED:
                out.update(cache.hit_rates())
        return out

    def optimizer_states(self) -> dict[str, list[torch.Tensor]]:
        """Fused optimizer state of this rank's shards (views).

        Returns:
            Table name -> state tensors of the local shard: row-wise Adagrad one ``(rows,)``
            tensor (the momentum of the shard's row segments), Adagrad one ``(rows, cols)``
            tensor, SGD none.
        """
        states: dict[str, list[torch.Tensor]] = {}
        for group, tbe, cache in zip(self._groups, self.tbes, self._caches, strict=True):
            if cache is not None:
                cache.flush()
                states.update(cache.row_states())
                continue
            split = tbe.split_optimizer_states() or [[] for _ in group.shards]
            states.update({t.name: list(s) for (t, _), s in zip(group.shards, split, strict=True)})
        return states

    def track_modified_rows(self) -> None:
        """Starts flagging the rows training steps look up (one byte per row of the rank's
        shards; differential checkpoints, :mod:`raydlrm.sharding.delta`)."""
        if self._modified is None:
            self._modified = ModifiedRows(self._groups, self._device)

    def modified_rows(self) -> dict[str, torch.Tensor]:
        """Table name -> the shard-local rows training steps looked up since
        :meth:`clear_modified_rows` (a data-parallel table's: on any rank); every rank must
        call."""
        if self._modified is None:
            raise RuntimeError("modified rows are not tracked: call track_modified_rows() first")
        replicated = {t.name for t in self.plan.tables if t.sharding_type == "data_parallel"}
        return self._modified.rows(replicated=replicated, pg=self._pg)

    def clear_modified_rows(self) -> None:
        if self._modified is not None:
            self._modified.clear()

    def _check_ids(self, kjt: KeyedJaggedTensor, batch_class: int) -> None:
        """Raises ValueError naming the table of the first id outside ``[0, num_embeddings)``."""
        limit = getattr(self, f"_limits{batch_class}")
        # Each feature's smallest and largest id (cheaper than comparing every id with its
        # feature's limit); one synchronization.
        extremes = torch.stack(
            [
                torch.stack(torch.aminmax(v)) if v.numel() else v.new_zeros(2)
                for v in kjt.values.split(kjt.length_per_key().tolist())
            ]
        )
        if not bool(((extremes[:, 0] < 0) | (extremes[:, 1] >= limit)).any()):
            return
        limits = torch.repeat_interleave(
            limit, kjt.length_per_key(), output_size=kjt.values.numel()
        )
        pos = int(torch.nonzero((kjt.values < 0) | (kjt.values >= limits))[0, 0])
        feature = int(torch.searchsorted(kjt.offset_per_key(), pos, right=True)) - 1
        name = next(t.name for t in self.tables if kjt.keys[feature] in t.feature_names)
        raise ValueError(
            f"table {name!r} (feature {kjt.keys[feature]!r}): id {int(kjt.values[pos])} "
            f"not in [0, {int(limit[feature])})"
        )

    def _lookup(self, bags: LocalBags) -> list[torch.Tensor]:
        """Pooled vectors of this rank's units of each batch class, ``(global rows of the
        class, D_units)``."""
        totals = [sum(sizes) for sizes in bags.batch_sizes]
        offsets = lengths_to_offsets(bags.lengths)
        # Every group's first and last bag, and id, read in one transfer (one synchronization on
        # a GPU).
        bounds = [0]
        for group in self._groups:
            bounds.append(bounds[-1] + group.num_units * totals[group.batch_class])
        id_bounds = offsets[torch.tensor(bounds, device=offsets.device)].tolist()
        pooled: list[list[torch.Tensor]] = [[] for _ in totals]
        for index, (group, tbe, cache) in enumerate(
            zip(self._groups, self.tbes, self._caches, strict=True)
        ):
            lo, hi, rows = bounds[index], bounds[index + 1], totals[group.batch_class]
            id_lo, id_hi = id_bounds[index], id_bounds[index + 1]
            weights = bags.weights
            indices = bags.values[id_lo:id_hi].to(torch.int64)
            # A training step's lookups (the module's mode, not autograd's: an evaluation or a
            # warm-up's measurement runs in eval mode) mark what the optimizer will update.
            track = self._modified is not None and self.training
            if cache is not None or track:
                ids_per_unit = offsets[lo : hi + 1 : rows].diff()
                if track:
                    self._modified.mark(index, indices, ids_per_unit)
                if cache is not None:  # ids become the slots of their rows in the DRAM cache
                    indices = cache.prefetch(indices, ids_per_unit, training=self.training)
            pooled[group.batch_class].append(
                tbe(
                    indices,
                    offsets[lo : hi + 1] - id_lo,
                    per_sample_weights=None if weights is None else weights[id_lo:id_hi],
                )
            )
        out = []
        for parts, rows in zip(pooled, totals, strict=True):
            if not parts:
                # Requires grad so that backward still reaches the output all-to-all on this rank.
                parts = [torch.zeros(rows, 0, device=self._device, requires_grad=True)]
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return out

    def _class_inputs(
        self, features: KeyedJaggedTensor, dedup_groups: Sequence[DedupGroup]
    ) -> tuple[list[KeyedJaggedTensor | None], list[torch.Tensor | None]]:
        """Each batch class's features of a batch and its inverse index. A declared group
        missing from the batch is read from ``features`` (a row per sample); a group the
        collection was not built for is expanded into the plain features."""
        declared = {tuple(sorted(g)): c + 1 for c, g in enumerate(self.dedup_groups)}
        given: dict[int, DedupGroup] = {}
        expanded = []
        for group in dedup_groups:
            c = declared.get(tuple(sorted(group.keys)))
            if c is None:
                expanded.append(group.expand())
            else:
                given[c] = group
        if expanded:
            features = KeyedJaggedTensor.concat([features, *expanded])
        kjts: list[KeyedJaggedTensor | None] = []
        inverses: list[torch.Tensor | None] = []
        for c, names in enumerate(self._class_features):
            group = given.get(c)
            source = features if group is None else group.unique
            kjt = source.select(names) if names else None
            if kjt is not None:
                self._check_ids(kjt, c)
            kjts.append(kjt)
            inverses.append(None if group is None else group.inverse)
        return kjts, inverses

    def input_dist(
        self,
        features: KeyedJaggedTensor,
        dedup_groups: Sequence[DedupGroup] = (),
        *,
        pg: ProcessGroup | None = None,
    ) -> _Routed:
        """Routes ``features`` and ``dedup_groups`` (their unique rows) to this collection's
        shards: see :meth:`ShardedTables.input_dist
        <raydlrm.sharding.types.ShardedTables.input_dist>`."""
        kjts, inverses = self._class_inputs(features, dedup_groups)
        local_batch = [features.batch_size if kjt is None else kjt.batch_size for kjt in kjts]
        bags = self._input(kjts, local_batch, pg=pg)
        return _Routed(features=features, kjts=kjts, inverses=inverses, bags=bags)

    def compute_and_output_dist(self, routed: _Routed) -> KeyedTensor:
        """Pooled embeddings of this rank's samples from their routed ids (the lookups, the
        output all-to-all, the dedup groups' expansion), ``B x sum(D_f)`` in ``feature_names``
        order."""
        bags = routed.bags
        values = self._output(self._lookup(bags), bags.batch_sizes, routed.inverses)
        if self._has_row_split_mean:
            values = self._divide_row_split_means(values, routed)
        for c, (kjt, inverse) in enumerate(zip(routed.kjts, routed.inverses, strict=True)):
            if kjt is not None and inverse is not None:
                self._dedup.count(c, kjt, inverse, bags.batch_sizes)
        return KeyedTensor(
            keys=list(self.feature_names), dims=list(self.feature_dims), values=values
        )

    def _divide_row_split_means(self, values: torch.Tensor, routed: _Routed) -> torch.Tensor:
        """Divides the row-split mean bags, pooled as sums, by their lengths."""
        lengths = values.new_empty(len(self.feature_names), values.shape[0])
        for c, (kjt, inverse) in enumerate(zip(routed.kjts, routed.inverses, strict=True)):
            if kjt is None:
                continue
            rows = kjt.lengths.view(len(kjt.keys), kjt.batch_size).to(values.dtype)
            lengths[getattr(self, f"_positions{c}")] = rows if inverse is None else rows[:, inverse]
        scale = torch.where(
            self._row_split_mean.unsqueeze(1),
            1.0 / lengths.clamp(min=1),
            torch.ones((), dtype=values.dtype, device=values.device),
        )
        return values * scale.t().repeat_interleave(
            self._feature_dims, dim=1, output_size=values.shape[1]
        )

    def dedup_stats(self) -> dict[str, dict[str, float]]:
        """Per deduplicated table, cumulative since construction (this rank's batches and
        units): ``ratio`` (samples / unique rows), ``lookups_saved`` (ids of this rank's samples
        not looked up) and ``a2a_bytes_saved`` (bytes this rank's units would have sent
        beyond what they sent in the pooled output all-to-all and its gradient with a row per
        sample)."""
        return self._dedup.stats()


class _DedupCounters:
    """What deduplication saved on one rank (see
    :meth:`ShardedEmbeddingBagCollection.dedup_stats`).

    Args:
        tables: every table of the collection.
        class_of: each feature's batch class.
        units: this rank's units.
        config: the codecs of the output all-to-all.
        rank: this rank.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        class_of: dict[str, int],
        units: list[LookupUnit],
        config: ShardingConfig,
        rank: int,
    ) -> None:
        self._rank = rank
        self._table_of = {f: t.name for t in tables for f in t.feature_names}
        self._class_of_table = {
            t.name: class_of[t.feature_names[0]] for t in tables if class_of[t.feature_names[0]]
        }
        self._row_bytes: dict[str, int] = defaultdict(int)  # table -> its units' bytes per row
        for u in units:
            if u.batch_class and not u.replicated:
                precision = config.comm_precision_per_table.get(u.table.name, config.comm_precision)
                self._row_bytes[u.table.name] += wire_bytes_per_vector(u.dim, precision=precision)
        self._rows: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # class -> [B, U]
        self._rows_not_sent: dict[int, int] = defaultdict(int)  # class -> rows
        self._ids_saved: dict[str, int] = defaultdict(int)

    def count(
        self,
        batch_class: int,
        kjt: KeyedJaggedTensor,
        inverse: torch.Tensor,
        batch_sizes: list[list[int]],
    ) -> None:
        """Counts one batch's dedup group: its unique rows ``kjt`` and ``inverse``, and the
        rows of every rank (``batch_sizes[0]`` samples, ``batch_sizes[batch_class]`` unique
        rows)."""
        rows = self._rows[batch_class]
        rows[0] += inverse.numel()
        rows[1] += kjt.batch_size
        lengths = kjt.lengths.view(len(kjt.keys), kjt.batch_size)
        repeats = torch.bincount(inverse, minlength=kjt.batch_size) - 1
        for key, n in zip(kjt.keys, (lengths * repeats).sum(dim=1).tolist(), strict=True):
            self._ids_saved[self._table_of[key]] += int(n)
        self._rows_not_sent[batch_class] += sum(
            b - u
            for r, (b, u) in enumerate(zip(batch_sizes[0], batch_sizes[batch_class], strict=True))
            if r != self._rank
        )

    def stats(self) -> dict[str, dict[str, float]]:
        stats = {}
        for table, c in self._class_of_table.items():
            samples, unique = self._rows.get(c, (0, 0))
            if not samples:  # no batch has carried the group yet
                continue
            stats[table] = {
                "ratio": samples / max(unique, 1),
                "lookups_saved": float(self._ids_saved[table]),
                # the pooled rows and, the same size, their gradient
                "a2a_bytes_saved": 2.0 * self._rows_not_sent[c] * self._row_bytes[table],
            }
        return stats
