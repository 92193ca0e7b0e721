"""Saving and loading a training checkpoint: everything a run needs to continue exactly where
it stopped.

:func:`save_training_state` writes, on every rank, its embedding shards and fused optimizer
state (a delta: only the rows modified since the checkpoint before it), the dense model and
its optimizer state and the RNG state (the data-parallel replicas may differ in the last bit,
since gloo's all-reduce need not round alike on every rank: an exact resume restores each
rank's own; another world size starts every rank from rank 0's); plus ``trainer_state.json``
from rank 0 with the loop's own state (step, epoch, samples seen, training time), the plan,
the resolved worker config and the data position (which rows of the current epoch every worker
has trained on, and the list of files the epoch is dealt from; see
``raydlrm.ingestion.reader.EpochProgress``); then the rank's manifest.
:func:`load_training_state` restores it into any plan or world size, a delta with its chain
read as one checkpoint. ``checkpoint.embedding_precision`` saves fp32 tables at fp16 or int8
(:func:`~raydlrm.sharding.embedding_checkpoint.checkpoint_precision`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from raydlrm.sharding import ShardingPlan
from raydlrm.sharding.delta import DeltaError, apply_delta, delta_state_dict
from raydlrm.sharding.embedding_checkpoint import (
    checkpoint_precision,
    column_blocks,
    embedding_state_dict,
    load_embedding_state,
    saved_precisions,
)
from raydlrm.sharding.id_map_checkpoint import id_map_state_dict, load_id_maps
from raydlrm.sharding.plan import managed_mismatches
from raydlrm.sharding.types import ShardedTables
from raydlrm.storage import redact
from raydlrm.trainers.checkpoints.chains import ChainLink, open_chain
from raydlrm.trainers.checkpoints.format import (
    DENSE,
    DENSE_OPTIMIZER,
    FORMAT_VERSION,
    RNG,
    STATE_FILE,
    CheckpointDamagedError,
    dcp_loader,
    dcp_metadata,
    delta_reader,
    quiet_dcp,
    read_state_file,
)
from raydlrm.trainers.checkpoints.manifest import check_intact, write_manifest
from raydlrm.trainers.spec import WorkerSpec

__all__ = [
    "TrainingParts",
    "check_state_matches",
    "checkpoint_precisions",
    "load_training_state",
    "save_training_state",
]


@dataclass(frozen=True)
class TrainingParts:
    """What a training checkpoint saves and restores, by reference.

    Attributes:
        spec: the worker config (stored with the state).
        plan: the sharding plan of ``collection``.
        rank: this worker's rank.
        collection: the sharded embedding tables, with their fused optimizer state.
        dense: the dense part, without its DDP wrapper.
        optimizer: the dense part's optimizer.
    """

    spec: WorkerSpec
    plan: ShardingPlan
    rank: int
    collection: ShardedTables
    dense: nn.Module
    optimizer: torch.optim.Optimizer


def checkpoint_precisions(parts: TrainingParts) -> dict[str, str]:
    """Table name -> the precision this checkpoint holds it in
    (``checkpoint.embedding_precision``)."""
    wanted = parts.spec.checkpoint.embedding_precision
    return {
        name: checkpoint_precision(held, wanted)
        for name, held in parts.collection.weight_precisions().items()
    }


def _tensor_state(parts: TrainingParts, link: ChainLink | None) -> dict[str, Any]:
    optimizer = parts.spec.sharding.optimizer
    if link is not None and link.kind == "delta":
        state = delta_state_dict(
            parts.collection,
            plan=parts.plan,
            rank=parts.rank,
            optimizer=optimizer,
            rows=link.rows or {},
            precisions=checkpoint_precisions(parts),
        )
    else:
        state = embedding_state_dict(
            parts.collection,
            plan=parts.plan,
            rank=parts.rank,
            optimizer=optimizer,
            precisions=checkpoint_precisions(parts),
        )
        state.update(id_map_state_dict(parts.collection, plan=parts.plan, rank=parts.rank))
    mine = f"rank{parts.rank}."
    state.update({mine + DENSE + k: v for k, v in parts.dense.state_dict().items()})
    for index, values in parts.optimizer.state_dict()["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"{mine}{DENSE_OPTIMIZER}{index}.{name}"] = value
    state[mine + RNG] = torch.get_rng_state()
    return state


def save_training_state(
    directory: str | Path,
    *,
    parts: TrainingParts,
    loop_state: dict[str, Any],
    position: dict,
    link: ChainLink | None = None,
) -> Path:
    """Writes this rank's part of the training state into ``directory``, then this rank's
    manifest of every file in it (files written there before, such as the model's config,
    included); every rank must call.

    Args:
        directory: a directory of this rank (ranks may write to different local directories
            that are later merged, as Ray Train does with per-worker checkpoint directories).
        parts: what to save.
        loop_state: the training loop's own state (``Trainer.state_dict()``: step, epoch,
            samples seen, training time), stored as JSON.
        position: the data position of every rank, merged (the same on every rank).
        link: its place in a chain of differential checkpoints (None: a full checkpoint
            outside any chain).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # One file per tensor: DCP clones a tensor that is a view into a larger buffer (every
    # table of an fbgemm TBE is one) and keeps each clone until its file is closed, so one file
    # per rank would hold a copy of all the rank's shards while saving; this way, one table.
    with quiet_dcp():
        dcp.save(
            _tensor_state(parts, link),
            storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False),
        )
    if parts.rank == 0:
        state = {
            "format_version": FORMAT_VERSION,
            **loop_state,
            "world_size": parts.plan.world_size,
            "optimizer": parts.spec.sharding.optimizer,
            "column_blocks": {t.name: column_blocks(t) for t in parts.plan.tables},
            "saved_precisions": checkpoint_precisions(parts),
            "position": position,
            "plan": json.loads(parts.plan.to_json()),
            # Credentials are not stored with the state.
            "spec": redact(parts.spec.to_dict()),
        }
        if link is not None:
            state["differential"] = link.to_json()
        (path / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    write_manifest(path, rank=parts.rank, world_size=parts.plan.world_size)  # last
    return path


def check_state_matches(
    state: dict[str, Any], plan: ShardingPlan, optimizer: str, *, source: str
) -> None:
    """Checks that a checkpoint's ``trainer_state.json`` holds ``plan``'s tables (names and
    shapes; any sharding) and was trained with the fused ``optimizer``.

    Raises:
        ValueError: naming the checkpoint ``source`` and what differs.
    """
    saved_plan = ShardingPlan.from_json(json.dumps(state["plan"]))
    ours = {t.name: (t.num_embeddings, t.embedding_dim) for t in plan.tables}
    theirs = {t.name: (t.num_embeddings, t.embedding_dim) for t in saved_plan.tables}
    if ours != theirs:
        raise ValueError(
            f"checkpoint {source} holds tables {sorted(theirs.items())}, the model has "
            f"{sorted(ours.items())}"
        )
    problems = managed_mismatches(saved_plan, plan)
    if problems:
        raise ValueError(f"checkpoint {source}: {'; '.join(problems)}")
    if state["optimizer"] != optimizer:
        raise ValueError(
            f"checkpoint {source} was trained with the fused optimizer {state['optimizer']!r}, "
            f"the config asks for {optimizer!r}"
        )


def _apply_deltas(parts: TrainingParts, members: list[str]) -> None:
    """Writes the deltas ``members`` (oldest first) over the loaded baseline."""
    for member in members:
        state = read_state_file(member)
        metadata = dcp_metadata(member)
        try:
            apply_delta(
                parts.collection,
                plan=parts.plan,
                rank=parts.rank,
                optimizer=parts.spec.sharding.optimizer,
                saved_plan=ShardingPlan.from_json(json.dumps(state["plan"])),
                saved_precisions=state["saved_precisions"],
                metadata=metadata,
                read=delta_reader(member, metadata),
            )
        except DeltaError as exc:
            raise CheckpointDamagedError(f"checkpoint {member}: {exc}") from exc


def load_training_state(
    directory: str | Path, *, parts: TrainingParts, chain: list[str] | None = None
) -> dict[str, Any]:
    """Restores ``parts`` from a training checkpoint (any saving world size or plan); every
    rank must call. The training loop's own state is the caller's to restore.

    A delta (differential checkpoints) loads its chain: the baseline's tables, then every
    delta's rows in order, then ``directory``'s dense part, optimizer and RNG states.

    Args:
        directory: the checkpoint.
        parts: what to restore.
        chain: the local directories of its chain
            (:func:`~raydlrm.trainers.checkpoints.chains.open_chain`; default: its siblings).

    Returns:
        The saved ``trainer_state.json``: the loop's state (``step``, ``epoch``, ...), the data
        position to resume from (``position``), the saving ``world_size``.

    Raises:
        CheckpointDamagedError: a checkpoint whose files do not match its manifests, or whose
            metadata or shards cannot be read, named.
        ValueError: the checkpoint's tables or optimizer do not match ``parts``'.
    """
    state = read_state_file(directory)
    if chain is None:
        check_intact(directory)  # and its chain's checkpoints beside it
        with open_chain(directory) as members:
            return load_training_state(directory, parts=parts, chain=members)
    for member in chain:
        check_intact(member, chain=False)
    optimizer = parts.spec.sharding.optimizer
    check_state_matches(state, parts.plan, optimizer, source=str(directory))
    baseline = chain[0]
    base_state = read_state_file(baseline)
    base_metadata = dcp_metadata(baseline)
    load_embedding_state(
        parts.collection,
        plan=parts.plan,
        rank=parts.rank,
        optimizer=optimizer,
        load=dcp_loader(baseline),
        saved_blocks={k: [tuple(b) for b in v] for k, v in base_state["column_blocks"].items()},
        saved_precisions=saved_precisions(parts.plan, base_metadata),
    )
    load_id_maps(parts.collection, plan=parts.plan, rank=parts.rank, load=dcp_loader(baseline))
    _apply_deltas(parts, chain[1:])
    _load_dense(
        parts,
        dcp_metadata(directory),
        load=dcp_loader(directory),
        same_world=state["world_size"] == parts.plan.world_size,
    )
    if dist.is_initialized():
        dist.barrier()
    return state


def _load_dense(
    parts: TrainingParts, metadata: dict[str, Any], *, load: Any, same_world: bool
) -> None:
    """The dense part, its optimizer state and the RNG state: each rank's own when the world
    size is the same (an exact resume), rank 0's otherwise."""
    source = f"rank{parts.rank if same_world else 0}."
    dense = {source + DENSE + k: v for k, v in parts.dense.state_dict().items()}
    optim = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(source + DENSE_OPTIMIZER)
    }
    rng_key = source + RNG
    rng = {rng_key: torch.get_rng_state()} if same_world else {}
    load({**dense, **optim, **rng})
    if optim:
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in optim.items():
            index, name = key[len(source + DENSE_OPTIMIZER) :].split(".", 1)
            per_param.setdefault(int(index), {})[name] = value
        current = parts.optimizer.state_dict()
        parts.optimizer.load_state_dict(
            {"state": per_param, "param_groups": current["param_groups"]}
        )
    if rng:
        torch.set_rng_state(rng[rng_key])
