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

Only tensors go through DCP and only JSON sits beside them. DCP's own ``.metadata`` file is a
pickle (``FileSystemReader`` unpickles it with no restriction); :class:`CheckpointReader` reads it
with an unpickler that can build only DCP's metadata classes, ``torch.Size``, dtypes, layouts,
memory formats and paths, so a planted ``.metadata`` cannot run code.

Every rank writes ``manifest.rank<r>.json`` last: the size and CRC-32 of each file it wrote.
:func:`verify_checkpoint` checks a checkpoint against its manifests (every rank's present, every
file there with its size, and with ``checksums`` its CRC-32): a truncated shard or state file
is found before a load fails on it, and a resume falls back to the newest intact checkpoint
(``raydlrm.trainers._ray``).
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata

from raydlrm.sharding import ShardingPlan
from raydlrm.sharding.state import (
    column_blocks,
    embedding_state_dict,
    load_embedding_state,
    weight_key,
)
from raydlrm.storage import redact

if TYPE_CHECKING:
    from raydlrm.trainers.loop import Trainer

__all__ = [
    "STATE_FILE",
    "CheckpointDamagedError",
    "CheckpointReader",
    "check_state_matches",
    "dense_module",
    "load_model_tensor",
    "load_training_state",
    "model_tensors",
    "read_state_file",
    "save_training_state",
    "verify_checkpoint",
    "write_manifest",
]

STATE_FILE = "trainer_state.json"
MANIFEST_PREFIX = "manifest.rank"
_DENSE = "dense."
_DENSE_OPTIMIZER = "dense_optimizer."
_RNG = "rng"
FORMAT_VERSION = 2
"""2: every rank writes a manifest (version 1 checkpoints have none and are checked for their
state file only)."""


_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name): getattr(_dcp_metadata, name)
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    # torch pickles a layout as _get_layout("torch.strided"): a lookup in a table of layouts.
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,  # written on Windows, read here
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: any other global is refused (the "restricting
    globals" recipe of the ``pickle`` docs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP metadata may not refer to {module}.{name}: refused (not a checkpoint's metadata)"
        )


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` with :class:`_MetadataUnpickler` instead
    of an unrestricted ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, _dcp_metadata.Metadata):
            raise pickle.UnpicklingError(
                f"{path} holds a {type(metadata).__name__}, not DCP metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every call that ShardedTensor is deprecated in favour of DTensor. DTensor
    places even splits only; table-wise and planner-chosen row ranges need ShardedTensor's
    arbitrary shard offsets (as TorchRec's checkpoints do). A load in one process
    (``no_dist=True``: exporting a model, one tensor per call) also warns each time that it
    assumes a single process, which is what it asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*deprecating ShardedTensor", category=FutureWarning
        )
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def dense_module(trainer: Trainer) -> torch.nn.Module:
    """The trainer's dense part, without its DDP wrapper."""
    dense = trainer.model.dense
    return getattr(dense, "module", dense)


def _tensor_state(trainer: Trainer) -> dict[str, Any]:
    spec = trainer.spec
    state = embedding_state_dict(
        trainer.model.embedding_bags,
        plan=trainer.plan,
        rank=trainer.rank,
        optimizer=spec.sharding.optimizer,
    )
    mine = f"rank{trainer.rank}."
    state.update({mine + _DENSE + k: v for k, v in dense_module(trainer).state_dict().items()})
    for index, values in trainer.optimizer.state_dict()["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"{mine}{_DENSE_OPTIMIZER}{index}.{name}"] = value
    state[mine + _RNG] = torch.get_rng_state()
    return state


def save_training_state(trainer: Trainer, directory: str | Path, *, position: dict) -> Path:
    """Writes this rank's part of the training state into ``directory``, then this rank's
    manifest of every file in it (files written there before, such as the model's config,
    included); every rank must call.

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
            **trainer.state_dict(),  # step, epoch, samples_seen, train_seconds
            "world_size": trainer.plan.world_size,
            "optimizer": trainer.spec.sharding.optimizer,
            "column_blocks": {t.name: column_blocks(t) for t in trainer.plan.tables},
            "position": position,
            "plan": json.loads(trainer.plan.to_json()),
            # Credentials are not stored with the state.
            "spec": redact(trainer.spec.to_dict()),
        }
        (path / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    write_manifest(path, rank=trainer.rank, world_size=trainer.plan.world_size)  # last
    return path


class CheckpointDamagedError(ValueError):
    """A checkpoint whose files do not match its manifests, or cannot be read."""


def read_state_file(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``.

    Raises:
        FileNotFoundError: naming the checkpoint when it has none.
        CheckpointDamagedError: naming the file when it is not readable JSON.
    """
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {STATE_FILE}")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointDamagedError(
            f"checkpoint {directory}: {STATE_FILE} is damaged: {exc}"
        ) from exc


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: str | Path, *, rank: int, world_size: int) -> Path:
    """Writes ``manifest.rank<rank>.json`` into ``directory``: the size and CRC-32 of every
    file this rank wrote there (call it last, once the rank's files are complete)."""
    path = Path(directory)
    files = {
        p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(path.iterdir())
        if p.is_file() and not p.name.startswith(MANIFEST_PREFIX)
    }
    manifest = path / f"{MANIFEST_PREFIX}{rank:05d}.json"
    manifest.write_text(json.dumps({"rank": rank, "world_size": world_size, "files": files}))
    return manifest


def verify_checkpoint(directory: str | Path, *, checksums: bool = True) -> list[str]:
    """What is wrong with a checkpoint, one line per problem (empty when it is intact): a
    missing or unreadable ``trainer_state.json``, a missing rank manifest, a file missing,
    of another size or (with ``checksums``) another CRC-32 than its manifest says. A
    checkpoint written before manifests existed (format version 1) is checked for its state
    file only."""
    path = Path(directory)
    try:
        state = read_state_file(path)
    except (FileNotFoundError, CheckpointDamagedError) as exc:
        return [str(exc)]
    manifests = sorted(path.glob(f"{MANIFEST_PREFIX}*.json"))
    if state.get("format_version", 1) < 2:
        return []  # written before manifests: nothing more to check against
    problems = []
    seen = set()
    for manifest in manifests:
        try:
            record = json.loads(manifest.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(f"{manifest.name} is damaged: {exc}")
            continue
        seen.add(int(record["rank"]))
        for name, expected in record["files"].items():
            file = path / name
            if not file.is_file():
                problems.append(f"{name} is missing")
            elif file.stat().st_size != expected["bytes"]:
                problems.append(
                    f"{name} has {file.stat().st_size} bytes, its manifest says {expected['bytes']}"
                )
            elif checksums and _crc32(file) != expected["crc32"]:
                problems.append(f"{name} does not match its checksum")
    missing = sorted(set(range(int(state["world_size"]))) - seen)
    if missing:
        problems.append(f"no manifest of ranks {missing} (their part was not completed)")
    return problems


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
    problems = verify_checkpoint(directory, checksums=False)
    if problems:
        raise CheckpointDamagedError(f"checkpoint {directory} is damaged: {'; '.join(problems)}")
    optimizer = trainer.spec.sharding.optimizer
    check_state_matches(state, trainer.plan, optimizer, source=str(directory))
    try:
        metadata = CheckpointReader(str(directory)).read_metadata().state_dict_metadata
    except Exception as exc:  # EOFError, unpickling errors of a damaged .metadata
        raise CheckpointDamagedError(
            f"checkpoint {directory}: its DCP metadata is not readable: {exc!r}"
        ) from exc

    def load(state_dict: dict[str, Any]) -> None:
        try:
            with _quiet():
                dcp.load(state_dict, storage_reader=CheckpointReader(str(directory)))
        except Exception as exc:  # a shard that cannot be read: name the checkpoint
            raise CheckpointDamagedError(
                f"checkpoint {directory}: reading its shards failed: {exc!r}"
            ) from exc

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
    dense = {source + _DENSE + k: v for k, v in dense_module(trainer).state_dict().items()}
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
    trainer.load_state_dict(state)
    if dist.is_initialized():
        dist.barrier()
    return state


def model_tensors(directory: str | Path) -> dict[str, tuple[str, Any]]:
    """Every tensor of a training checkpoint's unsharded model, from its metadata alone: the
    key of the unsharded ``RecModel`` (``embedding_bags.weights.<table>``, ``dense.*`` of rank
    0) -> (its DCP key, its DCP metadata: ``size``, ``properties.dtype``)."""
    state = read_state_file(directory)
    metadata = CheckpointReader(str(directory)).read_metadata().state_dict_metadata
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


def load_model_tensor(directory: str | Path, key: str, meta: Any) -> torch.Tensor:
    """One tensor of a training checkpoint (its DCP ``key`` and ``meta`` from
    :func:`model_tensors`), in one process: a table is assembled from the chunks every rank
    wrote; nothing else is read."""
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    # Without a process group DCP reads in this process.
    with _quiet():
        dcp.load({key: tensor}, storage_reader=CheckpointReader(str(directory)), no_dist=True)
    return tensor
