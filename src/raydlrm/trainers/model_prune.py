"""Pruned model directories: managed tables cut to a row cap for export (``raydlrm export
--max-rows``, ``data.managed_ids.<table>.export_rows``).

A managed table of ``R`` rows is rewritten as a table of ``cap`` rows with a fresh bucket layout
(:func:`~raydlrm.ids.auto_buckets`), holding the ids that matter most: the most recently looked
up (``keep = "recent"``, the map's last step) or the most often (``"frequent"``, its lookups).
The ids are inserted into the new map least important first, a chunk per clock tick, with LRU
eviction, so a probe window that overflows keeps its most important ids; every kept id's row
carries its weights (an int8/int4 table: its codes and scales, byte for byte) and its map entry
(last step, lookups) over. The new fallback rows hold the mean of the old ones (what an unknown
id read before; quantized block by block for an int8/int4 table); rows no id holds are zero.
Nothing else changes: the other tables and the dense part are copied as they are, one tensor at
a time, and ``spec.json`` and ``plan.json`` say the new sizes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from raydlrm.ids import ManagedIds, auto_buckets
from raydlrm.models.managed_ids import COUNT, FALLBACK, ID, LAST, IdMap
from raydlrm.models.quantized import (
    block_code_columns,
    dequantize_blocks,
    quantize_rows,
    quantized_precision,
)
from raydlrm.sharding.plan import Shard, ShardingPlan
from raydlrm.trainers.model_dir import (
    METRICS_FILE,
    PLAN_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    ModelWeights,
    TensorInfo,
    write_weights,
)
from raydlrm.trainers.spec import WorkerSpec

__all__ = ["PruneRule", "prune_model_dir", "prune_rules"]

Keep = Literal["recent", "frequent"]
_CHUNKS = 16
_QUANTIZED = "embedding_bags.quantized."


@dataclass(frozen=True)
class PruneRule:
    """Cut a managed table to ``rows`` rows, keeping its ``keep`` ids; ``policy``: the table's
    policy in the pruned model (its buckets for ``rows`` rows; its probe window, which the
    pruned map is built and read with)."""

    rows: int
    keep: Keep
    policy: ManagedIds


def prune_rules(
    spec: WorkerSpec, max_rows: dict[str, int] | None = None, keep: Keep | None = None
) -> dict[str, PruneRule]:
    """The rules of an export: each managed table's ``export_rows`` / ``export_keep``
    (``data.managed_ids``), overridden by ``max_rows`` (table or column -> rows) and ``keep``.

    Raises:
        ValueError: naming a key that is not a managed table, or a cap not below its rows with
            at least 2 rows a bucket.
    """
    data = spec.data
    rules: dict[str, PruneRule] = {}
    for table in data.table_columns():
        policy = data.managed_of(table)
        if policy is not None and policy.export_rows:
            rules[table] = _rule(policy, policy.export_rows, keep or policy.export_keep)
    for key, rows in (max_rows or {}).items():
        table = key if key in data.table_columns() else data.table_of(key)
        policy = data.managed_of(table)
        if policy is None:
            raise ValueError(f"--max-rows {key}: not a managed table (data.managed_ids)")
        rules[table] = _rule(policy, rows, keep or policy.export_keep)
    for table, rule in rules.items():
        size = data.table_size_of(data.table_columns()[table][0])
        if not 2 * auto_buckets(rule.rows) <= rule.rows < size:
            raise ValueError(
                f"table {table}: an export cap of {rule.rows} rows must be below its {size} rows "
                "and leave ids beside the fallback rows"
            )
    return rules


def _rule(policy: ManagedIds, rows: int, keep: Keep) -> PruneRule:
    pruned = dataclasses.replace(
        policy, buckets=auto_buckets(rows), export_rows=0, export_keep="recent"
    )
    return PruneRule(rows, keep, pruned)


def _table_part(name: str) -> tuple[str, str] | None:
    """(table, part) of a model tensor that holds a table's rows: ``weights`` and ``id_maps``
    (``embedding_bags.<part>.<table>``), an int8/int4 table's ``codes``, ``qparams`` and
    ``blocks`` (``embedding_bags.quantized.<table>.<part>``); None for another tensor."""
    if name.startswith(_QUANTIZED):
        table, _, part = name.removeprefix(_QUANTIZED).rpartition(".")
        return table, part
    for part in ("weights", "id_maps"):
        if name.startswith(f"embedding_bags.{part}."):
            return name.removeprefix(f"embedding_bags.{part}."), part
    return None


class _PrunedWeights:
    """A model's weights with its pruned tables rewritten (the interface of
    :class:`~raydlrm.trainers.model_dir.ModelWeights`)."""

    def __init__(self, weights: ModelWeights, rules: dict[str, PruneRule]):
        self._weights, self._rules = weights, rules
        self._done: dict[str, dict[str, torch.Tensor]] = {}
        self.tensors = []
        for info in weights.tensors:
            found = _table_part(info.name)
            if found is not None and found[0] in rules and found[1] != "blocks":
                info = TensorInfo(info.name, info.dtype, (rules[found[0]].rows, *info.shape[1:]))
            self.tensors.append(info)

    def load(self, name: str) -> torch.Tensor:
        found = _table_part(name)
        if found is None or found[0] not in self._rules or found[1] == "blocks":
            return self._weights.load(name)
        table, part = found
        if table not in self._done:  # the rows and the map of one table, then freed
            self._done = {table: self._prune(table)}
        return self._done[table][part]

    def _prune(self, name: str) -> dict[str, torch.Tensor]:
        rule = self._rules[name]
        old_map = self._weights.load(f"embedding_bags.id_maps.{name}").t()
        held = (old_map[ID] >= 0).nonzero().squeeze(1)
        score = old_map[LAST if rule.keep == "recent" else COUNT][held]
        held = held[torch.sort(score, stable=True).indices]  # least important first
        # Inserted with the table's probe window (what the pruned model reads with), evicting.
        policy = dataclasses.replace(rule.policy, eviction="lru", ttl_steps=0, ttl_days=0)
        new = IdMap(
            dataclasses.replace(policy, admit_after=1),
            table=name,
            num_embeddings=rule.rows,
            row_start=0,
            row_end=rule.rows,
        )
        chunks = max(_CHUNKS, -(-4 * held.numel() // rule.rows))  # a chunk: a quarter of the rows
        for step, chunk in enumerate(held.tensor_split(chunks), start=1):
            new.assign(old_map[ID][chunk], now=step, training=True)
        kept = (new.state[ID] >= 0).nonzero().squeeze(1)
        old_rows = _rows_of(old_map[ID], held, new.state[ID][kept])
        out_map = new.state.clone()
        out_map[2:, :] = 0
        out_map[LAST, kept], out_map[COUNT, kept] = (
            old_map[LAST, old_rows],
            old_map[COUNT, old_rows],
        )
        rows = _Rows(
            kept,
            old_rows,
            (old_map[ID] == FALLBACK).nonzero().squeeze(1),
            new.state[ID] == FALLBACK,
        )
        quantized = f"{_QUANTIZED}{name}.codes" in {t.name for t in self._weights.tensors}
        out = self._quantized_rows(name, rule, rows) if quantized else self._rows(name, rule, rows)
        return {**out, "id_maps": out_map.t().contiguous()}

    def _rows(self, name: str, rule: PruneRule, rows: _Rows) -> dict[str, torch.Tensor]:
        """An fp32/fp16 table's pruned weights."""
        weight = self._weights.load(f"embedding_bags.weights.{name}")
        out = torch.zeros(rule.rows, weight.shape[1], dtype=weight.dtype)
        out[rows.kept] = weight[rows.old]
        out[rows.new_fallback] = weight[rows.old_fallback].float().mean(0).to(weight.dtype)
        return {"weights": out}

    def _quantized_rows(self, name: str, rule: PruneRule, rows: _Rows) -> dict[str, torch.Tensor]:
        """An int8/int4 table's pruned codes and scales: kept rows byte for byte; the new
        fallback rows the old ones' mean, quantized block by block."""
        prefix = f"{_QUANTIZED}{name}."
        codes, params = self._weights.load(prefix + "codes"), self._weights.load(prefix + "qparams")
        blocks = [tuple(b) for b in self._weights.load(prefix + "blocks").tolist()]
        precision = quantized_precision(blocks[-1][1], codes.shape[1])
        out_codes = torch.zeros(rule.rows, codes.shape[1], dtype=codes.dtype)
        out_params = torch.zeros(rule.rows, params.shape[1], dtype=params.dtype)
        out_codes[rows.kept], out_params[rows.kept] = codes[rows.old], params[rows.old]
        old = rows.old_fallback
        mean = dequantize_blocks(codes[old], params[old], blocks=blocks, precision=precision)
        mean = mean.mean(0, keepdim=True)
        for k, (start, end) in enumerate(blocks):
            lo, hi = block_code_columns(start, end, precision)
            block_codes, block_params = quantize_rows(mean[:, start:end], precision=precision)
            out_codes[rows.new_fallback, lo:hi] = block_codes
            out_params[rows.new_fallback, 2 * k : 2 * k + 2] = block_params
        return {"codes": out_codes, "qparams": out_params}


@dataclass(frozen=True)
class _Rows:
    """A pruned table's rows: the new rows of the kept ids and their old rows, the old
    fallback rows, and (a mask) the new ones."""

    kept: torch.Tensor
    old: torch.Tensor
    old_fallback: torch.Tensor
    new_fallback: torch.Tensor


def _rows_of(ids: torch.Tensor, rows: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """The rows (of ``rows``) whose ``ids`` are ``wanted``, in ``wanted``'s order."""
    order = torch.argsort(ids[rows])
    position = torch.searchsorted(ids[rows][order], wanted)
    return rows[order][position]


def prune_model_dir(source: str | Path, target: str | Path, rules: dict[str, PruneRule]) -> Path:
    """Writes the model directory ``source`` (with ``model.safetensors``) into ``target``
    (created) with its managed tables pruned by ``rules`` (see the module docstring)."""
    source, target = Path(source), Path(target)
    spec = WorkerSpec.stored(json.loads((source / SPEC_FILE).read_text()))
    target.mkdir(parents=True)
    pruned = _PrunedWeights(ModelWeights(source), rules)
    write_weights(pruned, target / WEIGHTS_FILE, source=source)
    data = spec.data
    sizes, managed = dict(data.table_sizes), dict(data.managed_ids)
    for table, rule in rules.items():
        for key in (table, *data.table_columns()[table]):
            sizes.pop(key, None)
            if key in managed:
                managed[key] = rule.policy
        sizes[table] = rule.rows
    data = dataclasses.replace(data, table_sizes=sizes, managed_ids=managed)
    spec = dataclasses.replace(spec, data=data)
    (target / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2))
    plan = ShardingPlan.from_json((source / PLAN_FILE).read_text())
    for t in plan.tables:
        if t.name in rules:
            rows = rules[t.name].rows
            t.num_embeddings, t.buckets, t.sharding_type = rows, auto_buckets(rows), "table_wise"
            t.shards = [Shard(t.shards[0].rank, 0, rows, 0, t.embedding_dim)]
    (target / PLAN_FILE).write_text(plan.to_json())
    if (source / METRICS_FILE).is_file():
        shutil.copy2(source / METRICS_FILE, target / METRICS_FILE)
    return target
