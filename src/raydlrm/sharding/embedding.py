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
- *Column-wise row-wise Adagrad.* Each column shard keeps the momentum of its own row
  segment (as TorchRec does); see :mod:`raydlrm.sharding._embedding_state`.

The TBE's fused optimizer updates the rows in the backward pass: embeddings need no separate
optimizer step. Ids are checked against their table's size on the rank that sends them, so the
error names the table and shows up where the bad batch is.

This module holds the collection's construction, routing, lookups and output; by concern, the
rest is in :mod:`~raydlrm.sharding._embedding_kernels` (each group's TBE, in its memory tier,
with its cache), :mod:`~raydlrm.sharding._embedding_output` (the output distribution's layout
and codecs), :mod:`~raydlrm.sharding._embedding_state` (the local shards, optimizer state,
memory, modified rows, the first values) and :mod:`~raydlrm.sharding._dedup_stats` (what
deduplication saved).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from raydlrm.batch import (
    DedupGroup,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    lengths_to_offsets,
)
from raydlrm.models.embedding import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    check_id_range,
)
from raydlrm.sharding._comm import CommBytes, rank_and_world_size
from raydlrm.sharding._dedup_stats import DedupCounters
from raydlrm.sharding._embedding_kernels import GroupKernels
from raydlrm.sharding._embedding_output import output_dist
from raydlrm.sharding._embedding_state import LocalState
from raydlrm.sharding._input_dist import InputDistributor, LocalBags
from raydlrm.sharding._layout import (
    LookupUnit,
    PositionClasses,
    position_classes,
    rank_units,
    tbe_groups,
)
from raydlrm.sharding._managed import ManagedShards
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.delta import ModifiedRows
from raydlrm.sharding.kernel import resolve_kernel
from raydlrm.sharding.plan import Shard, ShardingPlan
from raydlrm.sharding.tiers import ssd_directory
from raydlrm.sharding.types import ShardedTables

__all__ = ["ShardedEmbeddingBagCollection"]

_ROW_SPLIT = ("row_wise", "table_row_wise")


@dataclass
class _Positions:
    """A per-position table's ids of a batch (:func:`_position_inputs`).

    Attributes:
        sources: its features of the batch, one after another in the table's order, each with
            its lengths and the inverse index of its dedup group (None: a row per sample).
        expand: ``(ids,)``, each id's row among the table's distinct ids of the batch (the
            rows its class looks up, in ascending id order).
    """

    sources: list[tuple[str, torch.Tensor, torch.Tensor | None]]
    expand: torch.Tensor


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
        sequences: per per-position table (keyed by its first class), its ids of the batch
            (:class:`_Positions`).
    """

    features: KeyedJaggedTensor
    kjts: list[KeyedJaggedTensor | None]
    inverses: list[torch.Tensor | None]
    bags: LocalBags
    sequences: dict[int, _Positions]

    def tensors(self) -> Iterator[torch.Tensor | None]:
        for kjt in self.kjts:
            if kjt is not None:
                yield from (kjt.values, kjt.lengths, kjt.weights)
        yield from self.inverses
        for positions in self.sequences.values():
            for _, lengths, inverse in positions.sources:
                yield from (lengths, inverse)
            yield positions.expand
        yield from (self.bags.lengths, self.bags.values, self.bags.weights)


class ShardedEmbeddingBagCollection(LocalState, ShardedTables):
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
        managed_clock: count the managed tables' clock (default: when ``ebc`` has managed
            tables; a tower host's collection counts it when any host's has, so every rank
            holds the run's clock).

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
        managed_clock: bool | None = None,
    ):
        super().__init__()
        plan.validate(ebc.tables)
        layout = position_classes(ebc.tables, dedup_groups, plan)
        class_of = layout.class_of
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
        self.kernel = resolve_kernel(config.kernel)
        self._describe(ebc, layout, plan, config)
        lookup_features = [f for t in self._lookup_tables for f in t.feature_names]
        units = rank_units(self._lookup_tables, plan, config, class_of, layout.shard_of_feature)
        self._input = InputDistributor(
            units,
            feature_classes=[class_of[f] for f in lookup_features],
            rank=self._rank,
            device=self._device,
            pg=pg,
            comm_bytes=self._comm_bytes,
            fbgemm=self.kernel == "fbgemm",
        )
        self._output = output_dist(
            units,
            config,
            feature_names=self.feature_names,
            feature_dims=[t.embedding_dim for t in self._lookup_tables for _ in t.feature_names],
            lookup_features=lookup_features,
            class_features=self._class_features,
            rank=self._rank,
            kernel=self.kernel,
            pg=pg,
            comm_bytes=self._comm_bytes,
        )
        self._register_feature_buffers()
        self._dedup = DedupCounters(
            self._lookup_tables, class_of, units[self._rank], config, self._rank
        )
        self._modified: ModifiedRows | None = None
        self._build_shards(units[self._rank], config, ebc, managed_clock=managed_clock)

    def _describe(
        self,
        ebc: EmbeddingBagCollection,
        layout: PositionClasses,
        plan: ShardingPlan,
        config: ShardingConfig,
    ) -> None:
        """The tables, features and batch classes the collection is made of."""
        self.tables = list(ebc.tables)
        self._lookup_tables = layout.tables
        self._position_tables = layout.tables_of_class
        self._position_classes = layout.classes_of_table
        self._row_starts = layout.row_starts
        self.feature_names = ebc.pooled_feature_names
        self.feature_dims = ebc.pooled_feature_dims
        self.sequence_feature_names = ebc.sequence_feature_names
        self.plan = plan
        self._precisions = {t.name: config.weights_precision_of(t.name) for t in self.tables}
        lookup_features = [f for t in self._lookup_tables for f in t.feature_names]
        self._class_features = [
            [f for f in lookup_features if layout.class_of[f] == c]
            for c in range(layout.num_classes)
        ]

    def _build_shards(
        self,
        units: list[LookupUnit],
        config: ShardingConfig,
        ebc: EmbeddingBagCollection,
        *,
        managed_clock: bool | None,
    ) -> None:
        """The TBE groups of this rank's ``units``, their kernels and caches
        (:mod:`raydlrm.sharding._embedding_kernels`), filled with the tables' first values."""
        self._groups = tbe_groups(units)
        self._pieces: list[tuple[EmbeddingBagConfig, Shard]] = [
            p for g in self._groups for p in g.shards
        ]
        self.local_table_configs = [t for t, _ in self._pieces]
        kernels = GroupKernels(
            kernel=self.kernel,
            plan=self.plan,
            optimizer=config.optimizer,
            device=self._device,
            ssd_directory=ssd_directory(config.ssd_path),
        )
        tbes, self._caches = kernels.build(self._groups, config, seed=ebc.seed)
        self.tbes = nn.ModuleList(tbes)
        self._managed = ManagedShards(
            self._groups,
            seed=ebc.seed,
            device=self._device,
            keeps_clock=any(t.managed is not None for t in self.tables)
            if managed_clock is None
            else managed_clock,
        )
        self._init_weights(ebc)

    def _register_feature_buffers(self) -> None:
        """Per feature: its table's size (the id check, per batch class) and dim, and whether
        it is a mean bag of a row-split table (pooled as sums by the shards, divided after the
        exchange); each class's features' positions."""
        table_of = {f: t for t in self._lookup_tables for f in t.feature_names}
        self._table_names = {f: t.name for f, t in table_of.items()}
        row_split = {t.name for t in self.plan.tables if t.sharding_type in _ROW_SPLIT}
        position = {f: i for i, f in enumerate(self.feature_names)}
        for c, features in enumerate(self._class_features):
            self._register(
                f"_limits{c}",
                torch.tensor([table_of[f].id_limit for f in features], dtype=torch.int64),
            )
            if c not in self._position_tables:
                self._register(
                    f"_positions{c}",
                    torch.tensor([position[f] for f in features], dtype=torch.int64),
                )
        mean = [
            table_of[f].pooling == "mean" and table_of[f].name in row_split
            for f in self.feature_names
        ]
        self._has_row_split_mean = any(mean)
        self._register("_row_split_mean", torch.tensor(mean, dtype=torch.bool))
        self._register("_feature_dims", torch.tensor(self.feature_dims, dtype=torch.int64))

    def _register(self, name: str, value: torch.Tensor) -> None:
        self.register_buffer(name, value.to(self._device), persistent=False)

    def comm_bytes(self) -> dict[str, dict[str, int]]:
        """Cumulative bytes this rank sent to other ranks (counted from shapes, no sync).

        Returns:
            ``{"input": {"lengths"|"ids"|"weights": n}, "forward": {codec: n},
            "backward": {codec: n}}``; ``forward``/``backward`` are the pooled output and its
            gradient by codec name (the data-parallel gradient all-gather is ``fp32``
            backward bytes). Empty with a world size of 1.
        """
        return self._comm_bytes.as_dict()

    def _check_ids(self, kjt: KeyedJaggedTensor, batch_class: int) -> None:
        """Raises ValueError naming the table of the first id outside ``[0, num_embeddings)``
        (:func:`~raydlrm.models.embedding.check_id_range`)."""
        limits = getattr(self, f"_limits{batch_class}")
        check_id_range(kjt, limits, table_of=self._table_names)

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
        self._managed.begin(self.training)
        if not self.training and self._managed:
            self._managed.refresh_fallbacks(list(self.tbes), self._caches, self._modified)
        for index, (group, tbe, cache) in enumerate(
            zip(self._groups, self.tbes, self._caches, strict=True)
        ):
            lo, hi, rows = bounds[index], bounds[index + 1], totals[group.batch_class]
            id_lo, id_hi = id_bounds[index], id_bounds[index + 1]
            weights = bags.weights
            indices = bags.values[id_lo:id_hi].to(torch.int64)
            track = self._modified is not None and self.training
            if self._managed.has(index):  # raw ids become rows (one host synchronization)
                indices = self._managed.rows(
                    index,
                    tbe,
                    indices,
                    offsets[lo : hi + 1 : rows] - id_lo,
                    training=self.training,
                    modified=self._modified if track else None,
                    cache=cache,
                )
            # A training step's lookups (the module's mode, not autograd's: an evaluation or a
            # warm-up's measurement runs in eval mode) mark what the optimizer will update.
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
    ) -> tuple[
        list[KeyedJaggedTensor | None], list[torch.Tensor | None], dict[int, KeyedJaggedTensor]
    ]:
        """Each batch class's features of a batch and its inverse index, and each per-position
        class's table's features. A declared group missing from the batch is read from
        ``features`` (a row per sample); a group the collection was not built for is expanded
        into the plain features."""
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
        sequences: dict[int, _Positions] = {}
        position_kjts: dict[int, KeyedJaggedTensor] = {}
        for name, classes in self._position_classes.items():
            sequences[classes[0]], parts = _position_inputs(
                self._position_tables[classes[0]].feature_names,
                [self._class_features[c][0] for c in classes],
                features,
                list(given.values()),
                row_starts=self._row_starts.get(name),
            )
            position_kjts.update(zip(classes, parts, strict=True))
        for c, names in enumerate(self._class_features):
            group = given.get(c)
            if c in position_kjts:
                kjt = position_kjts[c]
            else:
                source = features if group is None else group.unique
                kjt = source.select(names) if names else None
            if kjt is not None:
                self._check_ids(kjt, c)
            kjts.append(kjt)
            inverses.append(None if group is None else group.inverse)
        return kjts, inverses, sequences

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
        kjts, inverses, sequences = self._class_inputs(features, dedup_groups)
        local_batch = [features.batch_size if kjt is None else kjt.batch_size for kjt in kjts]
        bags = self._input(kjts, local_batch, pg=pg)
        return _Routed(
            features=features, kjts=kjts, inverses=inverses, bags=bags, sequences=sequences
        )

    def compute_and_output_dist(self, routed: _Routed) -> KeyedTensor:
        """Pooled embeddings of this rank's samples from their routed ids (the lookups, the
        output all-to-all, the dedup groups' expansion), ``B x sum(D_f)`` in ``feature_names``
        order, and the per-position rows of the sequence features (``jagged``)."""
        bags = routed.bags
        values, positions = self._output(self._lookup(bags), bags.batch_sizes, routed.inverses)
        if self._has_row_split_mean:
            values = self._divide_row_split_means(values, routed)
        for c, (kjt, inverse) in enumerate(zip(routed.kjts, routed.inverses, strict=True)):
            if kjt is not None and inverse is not None:
                self._dedup.count(c, kjt, inverse, bags.batch_sizes)
        if self.embedding_cut is not None and self.training and values.requires_grad:
            values = self.embedding_cut(values)
        jagged = {}
        for classes in self._position_classes.values():
            table_input = routed.sequences[classes[0]]
            sources, expand = table_input.sources, table_input.expand
            # A row-split table's shards' rows, in row order, are its distinct ids' rows.
            parts = [positions[c] for c in classes]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            totals = torch.stack([lengths.sum() for _, lengths, _ in sources]).tolist()
            # The distinct ids' rows to every id of each feature, a gather per feature (the
            # backward adds each feature's gradient rows into the distinct rows, with no copy
            # of the features' gradients into one buffer as a split's backward makes).
            for (name, lengths, inverse), part in zip(sources, expand.split(totals), strict=True):
                one = JaggedTensor(values=rows.index_select(0, part), lengths=lengths)
                jagged[name] = one if inverse is None else one.index_rows(inverse)
        return KeyedTensor(
            keys=list(self.feature_names),
            dims=list(self.feature_dims),
            values=values,
            jagged=jagged,
        )

    def _divide_row_split_means(self, values: torch.Tensor, routed: _Routed) -> torch.Tensor:
        """Divides the row-split mean bags, pooled as sums, by their lengths."""
        lengths = values.new_empty(len(self.feature_names), values.shape[0])
        for c, (kjt, inverse) in enumerate(zip(routed.kjts, routed.inverses, strict=True)):
            if kjt is None or c in self._position_tables:
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


def _position_inputs(
    names: Sequence[str],
    position_features: list[str],
    features: KeyedJaggedTensor,
    groups: list[DedupGroup],
    *,
    row_starts: list[int] | None,
) -> tuple[_Positions, list[KeyedJaggedTensor]]:
    """A per-position table's input (see :func:`~raydlrm.sharding._layout.position_classes`):
    each of its features ``names`` with its lengths and inverse index, read from its dedup
    group's unique rows in ``groups`` or else from ``features``; and the distinct ids of them
    all, in ascending order, as bags of one id of each of its classes' ``position_features``:
    one class, or a class per row shard (the shards' first rows ``row_starts``), each with
    the ids its shard owns.

    A history repeats popular items (Zipf): each distinct id is routed, looked up and sent
    back once, and its row copied to every position holding it after the exchange
    (:attr:`_Positions.expand`), so the all-to-alls carry a row per distinct id, not per id.
    """
    sources, values = [], []
    for name in names:
        group = next((g for g in groups if name in g.keys), None)
        kjt = (features if group is None else group.unique).select([name])
        sources.append((name, kjt.lengths, None if group is None else group.inverse))
        values.append(kjt.values)
    ids = torch.cat(values) if len(values) > 1 else values[0]
    distinct, expand = torch.unique(ids, sorted=True, return_inverse=True)
    parts = [distinct]
    # Sorted: each row shard's ids are contiguous (ids out of range land in the first or the
    # last shard's class, whose id check names the table).
    if row_starts:
        starts = torch.tensor(row_starts[1:], dtype=distinct.dtype, device=distinct.device)
        parts = list(distinct.tensor_split(torch.searchsorted(distinct, starts).cpu()))
    bags = [
        KeyedJaggedTensor(
            keys=[feature],
            values=part,
            lengths=torch.ones(part.numel(), dtype=torch.int64, device=ids.device),
            batch_size=part.numel(),
        )
        for feature, part in zip(position_features, parts, strict=True)
    ]
    return _Positions(sources=sources, expand=expand), bags
