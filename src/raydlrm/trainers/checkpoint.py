"""Training checkpoints: everything a run needs to continue exactly where it stopped.

A training checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own embedding shards and fused optimizer state in parallel (see
``raydlrm.sharding.state``: keyed by table, so they load into another plan or world size), the
dense model and its optimizer state and the RNG state of every rank (the data-parallel replicas
may differ in the last bit, since gloo's all-reduce need not round alike on every rank: an exact
resume restores each rank's own; another world size starts every rank from rank 0's); plus
``trainer_state.json`` from rank 0 with the loop's own state (step, epoch, samples seen,
training time), the plan, the resolved worker config and the data position (which rows of the
current epoch every worker has trained on; see ``raydlrm.ingestion.reader.EpochProgress``).

Only tensors go through DCP and only JSON sits beside them. DCP's own ``.metadata`` file is a
pickle (``FileSystemReader`` unpickles it with no restriction); :class:`CheckpointReader` reads it
with an unpickler that can build only DCP's metadata classes, ``torch.Size``, dtypes, layouts,
memory formats and paths, so a planted ``.metadata`` cannot run code.

Every rank writes ``manifest.rank<r>.json`` last: the size and CRC-32 of each file it wrote.
:func:`verify_checkpoint` checks a checkpoint against its manifests (every rank's present, every
file there with its size, and with ``checksums`` its CRC-32): a truncated shard or state file
is found before a load fails on it, and a resume falls back to the newest intact checkpoint
(:func:`newest_intact`).
"""

from __future__ import annotations

import io
import json
import logging
import pathlib
import pickle
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata

from raydlrm.sharding import ShardingPlan
from raydlrm.sharding.state import (
    codes_key,
    column_blocks,
    embedding_state_dict,
    load_embedding_state,
    qparams_key,
    saved_precisions,
    weight_key,
)
from raydlrm.sharding.types import ShardedTables
from raydlrm.storage import redact
from raydlrm.trainers.spec import WorkerSpec

__all__ = [
    "STATE_FILE",
    "CheckpointDamagedError",
    "CheckpointReader",
    "TrainingParts",
    "check_intact",
    "check_state_matches",
    "load_model_tensor",
    "load_training_state",
    "model_tensors",
    "newest_intact",
    "read_state_file",
    "save_training_state",
    "verify_checkpoint",
    "write_manifest",
]

logger = logging.getLogger(__name__)

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


def _tensor_state(parts: TrainingParts) -> dict[str, Any]:
    state = embedding_state_dict(
        parts.collection,
        plan=parts.plan,
        rank=parts.rank,
        optimizer=parts.spec.sharding.optimizer,
    )
    mine = f"rank{parts.rank}."
    state.update({mine + _DENSE + k: v for k, v in parts.dense.state_dict().items()})
    for index, values in parts.optimizer.state_dict()["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"{mine}{_DENSE_OPTIMIZER}{index}.{name}"] = value
    state[mine + _RNG] = torch.get_rng_state()
    return state


def save_training_state(
    directory: str | Path,
    *,
    parts: TrainingParts,
    loop_state: dict[str, Any],
    position: dict,
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
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # One file per tensor: DCP clones a tensor that is a view into a larger buffer (every
    # table of an fbgemm TBE is one) and keeps each clone until its file is closed, so one file
    # per rank would hold a copy of all the rank's shards while saving; this way, one table.
    with _quiet():
        dcp.save(
            _tensor_state(parts),
            storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False),
        )
    if parts.rank == 0:
        state = {
            "format_version": FORMAT_VERSION,
            **loop_state,
            "world_size": parts.plan.world_size,
            "optimizer": parts.spec.sharding.optimizer,
            "column_blocks": {t.name: column_blocks(t) for t in parts.plan.tables},
            "position": position,
            "plan": json.loads(parts.plan.to_json()),
            # Credentials are not stored with the state.
            "spec": redact(parts.spec.to_dict()),
        }
        (path / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    write_manifest(path, rank=parts.rank, world_size=parts.plan.world_size)  # last
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
    return _read_json(pafs.LocalFileSystem(), str(directory), STATE_FILE, present=path.is_file())


def _read_json(filesystem: pafs.FileSystem, root: str, name: str, *, present: bool) -> Any:
    if not present:
        raise FileNotFoundError(f"checkpoint {root} has no {name}")
    try:
        with filesystem.open_input_stream(f"{root}/{name}") as f:
            return json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointDamagedError(f"checkpoint {root}: {name} is damaged: {exc}") from exc


def _crc32(filesystem: pafs.FileSystem, path: str) -> int:
    crc = 0
    with filesystem.open_input_stream(path) as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: str | Path, *, rank: int, world_size: int) -> Path:
    """Writes ``manifest.rank<rank>.json`` into ``directory``: the size and CRC-32 of every
    file this rank wrote there (call it last, once the rank's files are complete)."""
    path = Path(directory)
    files = {
        p.name: {"bytes": p.stat().st_size, "crc32": _crc32(pafs.LocalFileSystem(), str(p))}
        for p in sorted(path.iterdir())
        if p.is_file() and not p.name.startswith(MANIFEST_PREFIX)
    }
    manifest = path / f"{MANIFEST_PREFIX}{rank:05d}.json"
    manifest.write_text(json.dumps({"rank": rank, "world_size": world_size, "files": files}))
    return manifest


def verify_checkpoint(
    directory: str | Path, *, checksums: bool = True, filesystem: pafs.FileSystem | None = None
) -> list[str]:
    """What is wrong with a checkpoint, one line per problem (empty when it is intact): a
    missing or unreadable ``trainer_state.json``, a missing rank manifest, a file missing,
    of another size or (with ``checksums``) another CRC-32 than its manifest says. A
    checkpoint written before manifests existed (format version 1) is checked for its state
    file only.

    Args:
        directory: the checkpoint (a local directory, or a path on ``filesystem``).
        checksums: also read every file for its CRC-32 (else sizes only).
        filesystem: where ``directory`` is (default: the local disk), e.g. an object store.
    """
    filesystem = filesystem or pafs.LocalFileSystem()
    root = str(directory).rstrip("/")
    infos = {
        i.base_name: i
        for i in filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        if i.type == pafs.FileType.File
    }
    try:
        state = _read_json(filesystem, root, STATE_FILE, present=STATE_FILE in infos)
    except (FileNotFoundError, CheckpointDamagedError) as exc:
        return [str(exc)]
    if state.get("format_version", 1) < 2:
        return []  # written before manifests: nothing more to check against
    problems, seen = [], set()
    for name in sorted(n for n in infos if n.startswith(MANIFEST_PREFIX)):
        try:
            record = _read_json(filesystem, root, name, present=True)
        except CheckpointDamagedError as exc:
            problems.append(f"{name} is damaged: {exc.__cause__}")
            continue
        seen.add(int(record["rank"]))
        for file, expected in record["files"].items():
            info = infos.get(file)
            if info is None:
                problems.append(f"{file} is missing")
            elif info.size != expected["bytes"]:
                problems.append(
                    f"{file} has {info.size} bytes, its manifest says {expected['bytes']}"
                )
            elif checksums and _crc32(filesystem, f"{root}/{file}") != expected["crc32"]:
                problems.append(f"{file} does not match its checksum")
    missing = sorted(set(range(int(state["world_size"]))) - seen)
    if missing:
        problems.append(f"no manifest of ranks {missing} (their part was not completed)")
    return problems


def check_intact(
    directory: str | Path, *, filesystem: pafs.FileSystem | None = None, checksums: bool = False
) -> None:
    """Raises :class:`CheckpointDamagedError` naming the checkpoint and its first problems
    (:func:`verify_checkpoint`) unless it is intact: before anything reads its shards."""
    problems = verify_checkpoint(directory, checksums=checksums, filesystem=filesystem)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointDamagedError(
            f"checkpoint {directory} is damaged: {'; '.join(problems[:3])}{more} "
            "(raydlrm checkpoint verify names every problem)"
        )


@contextmanager
def newest_intact(
    latest: Any, *, problems_of: Callable[[str], list[str]] | None = None
) -> Iterator[tuple[str, Any] | tuple[None, None]]:
    """A run's newest intact checkpoint as a local directory (downloaded if remote) and as
    stored, or (None, None) when the run has none (a fresh start).

    ``latest`` (a Ray Train ``Checkpoint``: ``path``, ``filesystem``, ``as_directory()``) and
    every other ``checkpoint_*`` directory beside it are tried newest first (Ray names them by
    time): one complete but never registered (a crash between writing and registering) is
    taken rather than redoing its steps, and a damaged one is passed over with a warning
    naming it. Every rank checks the same directories the same way, so all ranks pick the
    same one.

    Args:
        latest: the run's latest registered checkpoint, or None.
        problems_of: what is wrong with a checkpoint directory (default:
            :func:`verify_checkpoint` without checksums).

    Raises:
        RuntimeError: the run has checkpoints but none is intact (each named with its damage).
    """
    if latest is None:
        yield None, None
        return
    problems_of = problems_of or (lambda d: verify_checkpoint(d, checksums=False))
    damaged = []
    for checkpoint in _newest_first(latest):
        with checkpoint.as_directory() as directory:
            problems = problems_of(directory)
            if not problems:
                if damaged or checkpoint.path != latest.path:
                    logger.warning(
                        "taking %s rather than the latest registered checkpoint %s",
                        checkpoint.path,
                        latest.path,
                    )
                yield directory, checkpoint
                return
        damaged.append(f"{checkpoint.path}: {'; '.join(problems[:3])}")
        logger.warning("checkpoint %s is damaged, passed over: %s", checkpoint.path, damaged[-1])
    raise RuntimeError("no intact checkpoint to resume from: " + " | ".join(damaged))


def _newest_first(latest: Any) -> list[Any]:
    """Every ``checkpoint_*`` directory beside ``latest``, newest first (by Ray's time-stamped
    names), as checkpoints of ``latest``'s type."""
    filesystem = latest.filesystem
    parent = latest.path.rstrip("/").rsplit("/", 1)[0]
    infos = filesystem.get_file_info(pafs.FileSelector(parent))
    paths = sorted(
        (
            i.path
            for i in infos
            if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
        ),
        reverse=True,
    )
    if latest.path.rstrip("/") not in paths:
        paths.insert(0, latest.path)
    return [type(latest)(path=p, filesystem=filesystem) for p in paths]


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


def load_training_state(directory: str | Path, *, parts: TrainingParts) -> dict[str, Any]:
    """Restores ``parts`` from a training checkpoint (any saving world size or plan); every
    rank must call. The training loop's own state is the caller's to restore.

    Returns:
        The saved ``trainer_state.json``: the loop's state (``step``, ``epoch``, ...), the data
        position to resume from (``position``), the saving ``world_size``.

    Raises:
        CheckpointDamagedError: a checkpoint whose files do not match its manifests, or whose
            metadata or shards cannot be read, named.
        ValueError: the checkpoint's tables or optimizer do not match ``parts``'.
    """
    state = read_state_file(directory)
    check_intact(directory)
    optimizer = parts.spec.sharding.optimizer
    check_state_matches(state, parts.plan, optimizer, source=str(directory))
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
        parts.collection,
        plan=parts.plan,
        rank=parts.rank,
        optimizer=optimizer,
        load=load,
        saved_blocks={k: [tuple(b) for b in v] for k, v in state["column_blocks"].items()},
        saved_precisions=saved_precisions(parts.plan, metadata),
    )
    _load_dense(parts, metadata, load=load, same_world=state["world_size"] == parts.plan.world_size)
    if dist.is_initialized():
        dist.barrier()
    return state


def _load_dense(
    parts: TrainingParts, metadata: dict[str, Any], *, load: Any, same_world: bool
) -> None:
    """The dense part, its optimizer state and the RNG state: each rank's own when the world
    size is the same (an exact resume), rank 0's otherwise."""
    source = f"rank{parts.rank if same_world else 0}."
    dense = {source + _DENSE + k: v for k, v in parts.dense.state_dict().items()}
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
        current = parts.optimizer.state_dict()
        parts.optimizer.load_state_dict(
            {"state": per_param, "param_groups": current["param_groups"]}
        )
    if rng:
        torch.set_rng_state(rng[rng_key])


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


def model_tensors(directory: str | Path) -> dict[str, tuple[str, Any]]:
    """Every tensor of a training checkpoint's unsharded model, from its metadata alone: the
    key of the unsharded ``RecModel`` (``embedding_bags.weights.<table>``, ``dense.*`` of rank
    0) -> (its DCP key, its DCP metadata: ``size``, ``properties.dtype``).

    A quantized table (``int8`` / ``int4``) has no weight but
    ``embedding_bags.quantized.<table>.codes`` and ``.qparams`` (its DCP tensors, as saved) and
    ``.blocks``, the saving plan's column blocks as a ``(K, 2)`` int64 tensor (from
    ``trainer_state.json``; key ``column_blocks.<table>``): a
    :class:`~raydlrm.models.embedding.QuantizedTable`."""
    state = read_state_file(directory)
    metadata = CheckpointReader(str(directory)).read_metadata().state_dict_metadata
    plan = ShardingPlan.from_json(json.dumps(state["plan"]))
    keys: dict[str, tuple[str, Any]] = {}
    for table in plan.tables:
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
    dense_prefix = "rank0." + _DENSE
    for key, meta in metadata.items():
        if key.startswith(dense_prefix):
            keys["dense." + key[len(dense_prefix) :]] = (key, meta)
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
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    # Without a process group DCP reads in this process.
    try:
        with _quiet():
            dcp.load({key: tensor}, storage_reader=CheckpointReader(str(directory)), no_dist=True)
    except Exception as exc:  # a shard of the right size but damaged content
        raise CheckpointDamagedError(
            f"checkpoint {directory}: reading {key} failed ({type(exc).__name__}; raydlrm "
            "checkpoint verify checks every file's checksum)"
        ) from exc
    return tensor
