"""Export's reader of a training checkpoint: the unsharded model's tensors, one at a time.

:func:`model_tensors` lists every tensor of the unsharded model from the checkpoint's metadata
alone; :func:`load_model_tensor` reads one (a table assembled from the chunks every rank wrote),
in one process. A delta's tables are its chain's: the baseline's, patched by every delta in
order when read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as _dcp_metadata

from raydlrm.sharding import ShardingPlan
from raydlrm.sharding.delta import patch_model_tensor
from raydlrm.sharding.embedding_checkpoint import (
    codes_key,
    qparams_key,
    saved_precisions,
    weight_key,
)
from raydlrm.sharding.id_map_checkpoint import id_map_key
from raydlrm.trainers.checkpoints.chains import open_chain
from raydlrm.trainers.checkpoints.format import (
    DENSE,
    CheckpointDamagedError,
    CheckpointReader,
    dcp_metadata,
    delta_reader,
    quiet_dcp,
    read_state_file,
)

__all__ = ["load_model_tensor", "model_tensors"]


@dataclass(frozen=True)
class _StateTensor:
    """A small tensor of ``trainer_state.json`` (a quantized table's column blocks), described
    as DCP describes its tensors (``size``, ``properties.dtype``)."""

    value: torch.Tensor

    @property
    def size(self) -> torch.Size:
        return self.value.shape

    @property
    def properties(self) -> Any:
        return _dcp_metadata.TensorProperties(dtype=self.value.dtype)


@dataclass(frozen=True)
class _ChainTensor:
    """A table's tensor of a delta's chain: read from the baseline, then patched by every
    delta in order (described as DCP describes its tensors)."""

    meta: Any
    baseline: str
    deltas: tuple[str, ...]
    table: Any  # TablePlan
    part: str  # weight, codes or qparams
    precision: str

    @property
    def size(self) -> torch.Size:
        return self.meta.size

    @property
    def properties(self) -> Any:
        return self.meta.properties


def model_tensors(directory: str | Path) -> dict[str, tuple[str, Any]]:
    """Every tensor of a training checkpoint's unsharded model, from its metadata alone: the
    key of the unsharded ``RecModel`` (``embedding_bags.weights.<table>``, ``dense.*`` of rank
    0) -> (its DCP key, its DCP metadata: ``size``, ``properties.dtype``).

    A quantized table (``int8`` / ``int4``) has no weight but
    ``embedding_bags.quantized.<table>.codes`` and ``.qparams`` (its DCP tensors, as saved) and
    ``.blocks``, the saving plan's column blocks as a ``(K, 2)`` int64 tensor (from
    ``trainer_state.json``; key ``column_blocks.<table>``): a
    :class:`~raydlrm.models.embedding.QuantizedTable`.

    A delta's tables are its chain's (its siblings): the baseline's, patched by the deltas
    when read."""
    metadata = dcp_metadata(directory)
    with open_chain(directory) as chain:
        base = metadata if len(chain) == 1 else dcp_metadata(chain[0])
        keys = _embedding_tensors(chain[0], base, deltas=chain[1:])
    dense_prefix = "rank0." + DENSE
    for key, meta in metadata.items():
        if key.startswith(dense_prefix):
            keys["dense." + key[len(dense_prefix) :]] = (key, meta)
    return keys


def _embedding_tensors(
    directory: str, metadata: dict[str, Any], *, deltas: list[str]
) -> dict[str, tuple[str, Any]]:
    """The tables of :func:`model_tensors`, from the baseline ``directory`` and its DCP
    ``metadata`` (patched by ``deltas`` when read)."""
    state = read_state_file(directory)
    plan = ShardingPlan.from_json(json.dumps(state["plan"]))
    keys: dict[str, tuple[str, Any]] = {}
    for table in plan.tables:
        if table.buckets:  # a managed table's id map (see raydlrm.sharding.id_map_checkpoint)
            keys[f"embedding_bags.id_maps.{table.name}"] = (
                id_map_key(table.name),
                metadata[id_map_key(table.name)],
            )
        codes = metadata.get(codes_key(table.name))
        if codes is not None:
            blocks = state["column_blocks"][table.name]
            qparams = metadata.get(qparams_key(table.name))
            if qparams is None or qparams.size[1] != 2 * len(blocks):
                raise CheckpointDamagedError(
                    f"checkpoint {directory}: table {table.name!r} has codes but no (scale, bias) "
                    f"pair for each of its {len(blocks)} column blocks"
                )
            prefix = f"embedding_bags.quantized.{table.name}."
            keys[prefix + "codes"] = (codes_key(table.name), codes)
            keys[prefix + "qparams"] = (qparams_key(table.name), qparams)
            keys[prefix + "blocks"] = (
                f"column_blocks.{table.name}",
                _StateTensor(torch.tensor(blocks, dtype=torch.int64).view(-1, 2)),
            )
            continue
        key = weight_key(table.name)
        if key not in metadata:
            raise ValueError(f"checkpoint {directory} has no weights of table {table.name!r}")
        keys[f"embedding_bags.weights.{table.name}"] = (key, metadata[key])
    if deltas:
        precisions = saved_precisions(plan, metadata)
        for name, (key, meta) in keys.items():
            if isinstance(meta, _StateTensor):
                continue
            if name.startswith("embedding_bags.quantized."):  # .<table>.codes / .qparams
                table_name, part = name.removeprefix("embedding_bags.quantized.").rsplit(".", 1)
            elif name.startswith("embedding_bags.id_maps."):
                table_name, part = name.removeprefix("embedding_bags.id_maps."), "id_map"
            else:  # embedding_bags.weights.<table>
                table_name, part = name.removeprefix("embedding_bags.weights."), "weight"
            table = plan.table(table_name)
            keys[name] = (
                key,
                _ChainTensor(meta, directory, tuple(deltas), table, part, precisions[table.name]),
            )
    return keys


def load_model_tensor(directory: str | Path, key: str, meta: Any) -> torch.Tensor:
    """One tensor of a training checkpoint (its DCP ``key`` and ``meta`` from
    :func:`model_tensors`), in one process: a table is assembled from the chunks every rank
    wrote; nothing else is read.

    Raises:
        CheckpointDamagedError: naming the checkpoint and the tensor when its chunks cannot be
            read.
    """
    if isinstance(meta, _StateTensor):  # not in the shards
        return meta.value.clone()
    if isinstance(meta, _ChainTensor):
        tensor = load_model_tensor(meta.baseline, key, meta.meta)
        for delta in meta.deltas:
            delta_meta = dcp_metadata(delta)
            patch_model_tensor(
                tensor,
                table=meta.table,
                part=meta.part,
                precision=meta.precision,
                metadata=delta_meta,
                read=delta_reader(delta, delta_meta),
            )
        return tensor
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    # Without a process group DCP reads in this process.
    try:
        with quiet_dcp():
            dcp.load({key: tensor}, storage_reader=CheckpointReader(str(directory)), no_dist=True)
    except Exception as exc:  # a shard of the right size but damaged content
        raise CheckpointDamagedError(
            f"checkpoint {directory}: reading {key} failed ({type(exc).__name__}; raydlrm "
            "checkpoint verify checks every file's checksum)"
        ) from exc
    return tensor
