"""The kernels of a sharded collection's rank: one table-batched embedding (TBE) per group of
its lookup units (:func:`~raydlrm.sharding._layout.tbe_groups`), fbgemm's or its PyTorch
equivalent (:mod:`raydlrm.sharding.kernel`), over the group's shards in the memory tier it is
placed in (:mod:`raydlrm.sharding.tiers`):

- an fp32 / fp16 ``dram`` group: over its shards' rows on the worker's device;
- an ``ssd`` group: over its mapped files, or over the slots of a DRAM row cache in front of
  them (:mod:`raydlrm.sharding.row_cache`; ``sharding.cache_load_factor``);
- a quantized (``int8`` / ``int4``) group: an fp32 TBE over the slots of the cache in front of
  its quantized rows (:mod:`raydlrm.sharding.quantized`), in memory or in mapped files;
- a ``host`` group: over the slots of a row cache in the worker's device memory
  (``sharding.cache_load_factor`` of the rows) in front of its rows and their optimizer state
  in the host's (pinned) memory.

The ``ssd`` tier is for CPU workers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from raydlrm.models.quantized import code_bytes_per_row
from raydlrm.sharding._layout import TbeGroup
from raydlrm.sharding.config import QUANTIZED, CacheSizing, ShardingConfig
from raydlrm.sharding.kernel import WEIGHT_DTYPES, TableSpec, build_tbe
from raydlrm.sharding.plan import ShardingPlan
from raydlrm.sharding.quantized import QuantizedRows, table_key
from raydlrm.sharding.row_cache import RowCache
from raydlrm.sharding.sizes import cache_rows
from raydlrm.sharding.tiers import TierError, host_buffer, mapped_buffer

__all__ = ["GroupKernels"]


def _numel(group: TbeGroup) -> int:
    """Values of the group's shards."""
    return sum((s.row_end - s.row_start) * (s.col_end - s.col_start) for _, s in group.shards)


class GroupKernels:
    """Builds the kernels (TBEs) of a rank's groups, and the caches in front of them.

    Args:
        kernel: the kernel the rank runs (``fbgemm`` or ``torch``).
        plan: the plan (each table's most rows a step looks up sizes its caches).
        optimizer: the fused optimizer.
        device: the worker's device.
        ssd_directory: where the ``ssd`` groups' files are mapped from.
    """

    def __init__(
        self,
        *,
        kernel: str,
        plan: ShardingPlan,
        optimizer: str,
        device: torch.device,
        ssd_directory: Path,
    ) -> None:
        self.kernel, self.plan, self.optimizer = kernel, plan, optimizer
        self.device, self.ssd_directory = device, ssd_directory

    def build(
        self, groups: list[TbeGroup], config: ShardingConfig, *, seed: int
    ) -> tuple[list[nn.Module], list[RowCache | None]]:
        """One TBE per group of this rank's units, and the cache in front of it (None: none);
        an ``ssd`` group's over its mapped files, or over the slots of a DRAM row cache in front
        of them; a quantized group's over the fp32 slots of the cache in front of its quantized
        rows."""
        tbes: list[nn.Module] = []
        caches: list[RowCache | None] = []
        for group in groups:
            if group.precision in QUANTIZED:
                tbe, cache = self._quantized_group(group, config, seed=seed)
            else:
                tbe, cache = self._float_group(group, config)
            tbes.append(tbe)
            caches.append(cache)
        return tbes, caches

    def _float_group(
        self, group: TbeGroup, config: ShardingConfig
    ) -> tuple[nn.Module, RowCache | None]:
        """An fp32 / fp16 group's TBE: over its shards' rows (an uncached ``ssd`` group's in
        mapped files), or over the slots of the DRAM row cache in front of its files."""
        if group.placement == "host":
            return self._host_group(group, config)
        buffers = self._tier_buffers(group, config)
        cached = buffers is not None and group.row_cache
        rows = (
            self._cache_slots(group, config)
            if cached
            else [s.row_end - s.row_start for _, s in group.shards]
        )
        tbe = self._build_tbe(
            group, config, rows=rows, precision=group.precision, buffers=None if cached else buffers
        )
        return tbe, self._row_cache(group, tbe, buffers, config) if cached else None

    def _host_group(self, group: TbeGroup, config: ShardingConfig) -> tuple[nn.Module, RowCache]:
        """A ``host`` group's TBE over the slots of its row cache in device memory, in front of
        its rows (and a per-weight optimizer state) in the host's memory, pinned on a GPU."""
        slots = self._cache_slots(group, config)
        tbe = self._build_tbe(group, config, rows=slots, precision=group.precision, buffers=None)
        numel = _numel(group)
        backing = {"weights": self._host_buffer(numel, WEIGHT_DTYPES[group.precision])}
        if config.optimizer == "adagrad":
            backing["momentum1"] = self._host_buffer(numel, torch.float32)
        return tbe, self._cache(group, tbe, _split_rows(backing["weights"], group), backing, config)

    def _host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat zeroed buffer in the host's memory (page-locked for a GPU worker's copies)."""
        return host_buffer(numel, dtype, pinned=self.device.type == "cuda")

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
            device=self.device,
            buffers=buffers,
        )

    def _check_tier_device(self, group: TbeGroup) -> None:
        if group.placement == "ssd" and self.device.type != "cpu":
            raise TierError(
                f"tables {[t.name for t, _ in group.shards]}: placement {group.placement!r} is "
                f"for CPU workers; this worker's device is {self.device}"
            )

    def _group_buffer(self, group: TbeGroup, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat zeroed buffer of the group: mapped from a file for ``ssd``, else on the
        worker's device."""
        if group.placement == "dram":
            return torch.zeros(numel, dtype=dtype, device=self.device)
        names = [t.name for t, _ in group.shards]
        return mapped_buffer(self.ssd_directory, numel, dtype, tables=names)

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
        config: ShardingConfig,
    ) -> RowCache:
        """The DRAM cache of a cached ``ssd`` group (see :mod:`.row_cache`): the TBE's
        weights are its slots, ``backing`` the mapped files of the whole shards."""
        return self._cache(group, tbe, _split_rows(backing["weights"], group), backing, config)

    def _cache(
        self,
        group: TbeGroup,
        tbe: nn.Module,
        rows: list[torch.Tensor | QuantizedRows],
        backing: dict[str, torch.Tensor],
        config: ShardingConfig,
    ) -> RowCache:
        """A :class:`RowCache` whose slots are ``tbe``'s weights and whose rows are ``rows``;
        Adagrad's per-weight state of the rows in ``backing["momentum1"]``, row-wise Adagrad's
        in memory. Its errors name the keys that sized each table's cache."""
        slot_states = row_states = None
        if self.optimizer != "sgd":
            slot_states = [states[0] for states in tbe.split_optimizer_states()]
            if self.optimizer == "rowwise_adagrad":  # one float per row: in memory
                rows_per_shard = [sh.row_end - sh.row_start for _, sh in group.shards]
                if group.placement == "host":  # in the host's memory with the rows
                    flat = self._host_buffer(sum(rows_per_shard), torch.float32)
                    row_states = list(flat.split(rows_per_shard))
                else:
                    row_states = [torch.zeros(n, device=self.device) for n in rows_per_shard]
            else:
                row_states = _split_rows(backing["momentum1"], group)
        return RowCache(
            [t.name for t, _ in group.shards],
            slots=list(tbe.split_embedding_weights()),
            slot_states=slot_states,
            rows=rows,
            row_states=row_states,
            unit_tables=group.feature_table_map,
            too_small=[_sizing(config, t.name, group).keys for t, _ in group.shards],
        )

    def _cache_slots(self, group: TbeGroup, config: ShardingConfig) -> list[int]:
        """Slots of the row cache of each of a cached group's shards (the
        ``sharding.cache_load_factor`` family, at least a step's rows)."""
        sizings = [_sizing(config, t.name, group) for t, _ in group.shards]
        return [
            cache_rows(
                s.row_end - s.row_start,
                load_factor=sizing.load_factor,
                min_rows=sizing.min_rows,
                step_rows=self._step_rows(t.name),
            )
            for (t, s), sizing in zip(group.shards, sizings, strict=True)
        ]

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
        slots = self._cache_slots(group, config)
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
        return tbe, self._cache(group, tbe, rows, backing, config)


def _sizing(config: ShardingConfig, table: str, group: TbeGroup) -> CacheSizing:
    """How the row cache of ``table`` of a cached group is sized (its kind by the group's
    precision and placement, :meth:`~raydlrm.sharding.config.ShardingConfig.cache_kind`)."""
    kind = config.cache_kind(table, group.placement)
    assert kind is not None, f"table {table}: a cached group's table has no cache kind"
    return config.cache_sizing(table, kind)


def _split_rows(flat: torch.Tensor, group: TbeGroup) -> list[torch.Tensor]:
    """Per-table ``(rows, cols)`` views of a group's flat buffer, in TBE order."""
    views, start = [], 0
    for _, sh in group.shards:
        rows, cols = sh.row_end - sh.row_start, sh.col_end - sh.col_start
        views.append(flat[start : start + rows * cols].view(rows, cols))
        start += rows * cols
    return views
