"""Training-state checkpoints: everything a run needs to continue exactly where it stopped.

A training-state checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own embedding shards and fused optimizer state in parallel (see
``raydlrm.sharding.state``: keyed by table, so they load into another plan or world size), the
dense model and its optimizer state and the RNG state of every rank (the data-parallel replicas
may differ in the last bit, since gloo's all-reduce need not round alike on every rank: an exact
resume restores each rank's own; another world size starts every rank from rank 0's); plus
``trainer_state.json`` from rank 0 with the step, epoch, samples seen, the plan, the resolved
worker config and the data position (which rows of the current epoch every worker has trained
on; see ``raydlrm.ingestion.reader.EpochProgress``).

Only tensors go through DCP and only JSON sits beside them: nothing is unpickled on load.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raydlrm.ingestion.storage import redact
from raydlrm.sharding import ShardingPlan
from raydlrm.sharding.state import (
    column_blocks,
    embedding_state_dict,
    load_embedding_state,
    weight_key,
)

if TYPE_CHECKING:
    from raydlrm.trainers.loop import Trainer

__all__ = [
    "STATE_FILE",
    "check_state_matches",
    "load_model_tensor",
    "load_training_state",
    "model_tensors",
    "read_state_file",
    "save_training_state",
]

STATE_FILE = "trainer_state.json"
_DENSE = "dense."
_DENSE_OPTIMIZER = "dense_optimizer."
_RNG = "rng"
FORMAT_VERSION = 1


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every call that ShardedTensor is deprecated in favour of DTensor. DTensor
    places even splits only; table-wise and planner-chosen row ranges need ShardedTensor's
    arbitrary shard offsets (as TorchRec's checkpoints do)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*deprecating ShardedTensor", category=FutureWarning
        )
        yield


def _dense_module(trainer: Trainer) -> torch.nn.Module:
    dense = trainer.model.dense
    return getattr(dense, "module", dense)  # unwrap DDP


def _tensor_state(trainer: Trainer) -> dict[str, Any]:
    spec = trainer.spec
    state = embedding_state_dict(
        trainer.model.embedding_bags,
        plan=trainer.plan,
        rank=trainer.rank,
        optimizer=spec.sharding.optimizer,
    )
    mine = f"rank{trainer.rank}."
    state.update({mine + _DENSE + k: v for k, v in _dense_module(trainer).state_dict().items()})
    for index, values in trainer.optimizer.state_dict()["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"{mine}{_DENSE_OPTIMIZER}{index}.{name}"] = value
    state[mine + _RNG] = torch.get_rng_state()
    return state


def save_training_state(trainer: Trainer, directory: str | Path, *, position: dict) -> Path:
    """Writes this rank's part of the training state into ``directory``; every rank must call.

    Args:
        trainer: the worker's trainer.
        directory: a directory of this rank (ranks may write to different local directories
            that are later merged, as Ray Train does with per-worker checkpoint directories).
        position: the data position of every rank, merged (the same on every rank).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # One file per tensor: DCP clones a tensor that is a view into a larger buffer (every
    # table of an fbgemm TBE is one) and keeps each clone until its file is closed, so one file
    # per rank would hold a copy of all the rank's shards while saving; this way, one table.
    with _quiet():
        dcp.save(
            _tensor_state(trainer),
            storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False),
        )
    if trainer.rank == 0:
        state = {
            "format_version": FORMAT_VERSION,
            "step": trainer.step,
            "epoch": trainer.epoch,
            "samples_seen": trainer.samples_seen,
            "train_seconds": trainer.train_seconds,
            "world_size": trainer.plan.world_size,
            "optimizer": trainer.spec.sharding.optimizer,
            "column_blocks": {t.name: column_blocks(t) for t in trainer.plan.tables},
            "position": position,
            "plan": json.loads(trainer.plan.to_json()),
            # Credentials are not stored with the state.
            "spec": redact(trainer.spec.to_dict()),
        }
        (path / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    return path


def read_state_file(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {STATE_FILE}")
    return json.loads(path.read_text())


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
    if state["optimizer"] != optimizer:
        raise ValueError(
            f"checkpoint {source} was trained with the fused optimizer {state['optimizer']!r}, "
            f"the config asks for {optimizer!r}"
        )


def load_training_state(trainer: Trainer, directory: str | Path) -> dict[str, Any]:
    """Restores ``trainer`` from a training-state checkpoint (any saving world size or plan);
    every rank must call. Returns the saved ``trainer_state.json`` (its ``position`` is the
    data position to resume from).

    Raises:
        ValueError: the checkpoint's tables or optimizer do not match the trainer's.
    """
    state = read_state_file(directory)
    optimizer = trainer.spec.sharding.optimizer
    check_state_matches(state, trainer.plan, optimizer, source=str(directory))
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata

    def load(state_dict: dict[str, Any]) -> None:
        with _quiet():
            dcp.load(state_dict, storage_reader=dcp.FileSystemReader(str(directory)))

    load_embedding_state(
        trainer.model.embedding_bags,
        plan=trainer.plan,
        rank=trainer.rank,
        optimizer=optimizer,
        load=load,
        saved_blocks={k: [tuple(b) for b in v] for k, v in state["column_blocks"].items()},
    )
    same_world = state["world_size"] == trainer.plan.world_size
    source = f"rank{trainer.rank if same_world else 0}."
    dense = {source + _DENSE + k: v for k, v in _dense_module(trainer).state_dict().items()}
    optim = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(source + _DENSE_OPTIMIZER)
    }
    rng_key = source + _RNG
    rng = {rng_key: torch.get_rng_state()} if same_world else {}
    load({**dense, **optim, **rng})
    if optim:
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in optim.items():
            index, name = key[len(source + _DENSE_OPTIMIZER) :].split(".", 1)
            per_param.setdefault(int(index), {})[name] = value
        current = trainer.optimizer.state_dict()
        trainer.optimizer.load_state_dict(
            {"state": per_param, "param_groups": current["param_groups"]}
        )
    if rng:
        torch.set_rng_state(rng[rng_key])
    trainer.step = state["step"]
    trainer.epoch = state["epoch"]
    trainer.samples_seen = state["samples_seen"]
    trainer.train_seconds = state["train_seconds"]
    if dist.is_initialized():
        dist.barrier()
    return state


def _model_keys(directory: str | Path) -> dict[str, tuple[str, Any]]:
    """Model state-dict key -> (DCP key, DCP metadata) of a training checkpoint's model: every
    table (``embedding_bags.weights.<table>``) and rank 0's dense model (``dense.*``)."""
    state = read_state_file(directory)
    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    plan = ShardingPlan.from_json(json.dumps(state["plan"]))
    keys = {}
    for table in plan.tables:
        key = weight_key(table.name)
        if key not in metadata:
            raise ValueError(f"checkpoint {directory} has no weights of table {table.name!r}")
        keys[f"embedding_bags.weights.{table.name}"] = (key, metadata[key])
    dense_prefix = "rank0." + _DENSE
    for key, meta in metadata.items():
        if key.startswith(dense_prefix):
            keys["dense." + key[len(dense_prefix) :]] = (key, meta)
    return keys


def model_tensors(directory: str | Path) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Name, dtype and shape of every tensor of a training checkpoint's unsharded model (keys of
    the unsharded ``RecModel``: ``embedding_bags.weights.<table>``, ``dense.*``), from its
    metadata alone."""
    return [
        (name, meta.properties.dtype, tuple(meta.size))
        for name, (_, meta) in _model_keys(directory).items()
    ]


def load_model_tensor(directory: str | Path, name: str) -> torch.Tensor:
    """One tensor of a training checkpoint's unsharded model (see :func:`model_tensors`), in
    one process: a table is assembled from the chunks every rank wrote; nothing else is read.

    Raises:
        KeyError: ``name`` is not a tensor of the model.
    """
    key, meta = _model_keys(directory)[name]
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    # Without a process group DCP reads in this process.
    with _quiet():
        dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return tensor
