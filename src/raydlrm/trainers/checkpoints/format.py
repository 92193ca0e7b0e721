"""The checkpoint format: what a training checkpoint's files are, and reading them safely.

A training checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own embedding shards and fused optimizer state in parallel (see
``raydlrm.sharding.embedding_checkpoint``: keyed by table, so they load into another plan or
world size), the
dense model and its optimizer state and the RNG state of every rank; plus ``trainer_state.json``
(:data:`STATE_FILE`) from rank 0 with the loop's own state, the plan, the resolved worker config
and the data position; and every rank's manifest (``manifest.rank<r>.json``,
:mod:`~raydlrm.trainers.checkpoints.manifest`).

Only tensors go through DCP and only JSON sits beside them. DCP's own ``.metadata`` file is a
pickle (``FileSystemReader`` unpickles it with no restriction); :class:`CheckpointReader` reads it
with an unpickler that can build only DCP's metadata classes, ``torch.Size``, dtypes, layouts,
memory formats and paths, so a planted ``.metadata`` cannot run code. The readers here
(:func:`read_state_file`, :func:`dcp_metadata`, :func:`dcp_loader`) name the checkpoint in a
:class:`CheckpointDamagedError` when its files cannot be read.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata

__all__ = [
    "DENSE",
    "DENSE_OPTIMIZER",
    "FORMAT_VERSION",
    "MANIFEST_PREFIX",
    "RNG",
    "STATE_FILE",
    "CheckpointDamagedError",
    "CheckpointReader",
    "dcp_loader",
    "dcp_metadata",
    "delta_reader",
    "quiet_dcp",
    "read_json",
    "read_state_file",
]

STATE_FILE = "trainer_state.json"
MANIFEST_PREFIX = "manifest.rank"
DENSE = "dense."
DENSE_OPTIMIZER = "dense_optimizer."
RNG = "rng"
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
def quiet_dcp() -> Iterator[None]:
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


class CheckpointDamagedError(ValueError):
    """A checkpoint whose files do not match its manifests, or cannot be read."""


def read_state_file(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``.

    Raises:
        FileNotFoundError: naming the checkpoint when it has none.
        CheckpointDamagedError: naming the file when it is not readable JSON.
    """
    path = Path(directory) / STATE_FILE
    return read_json(pafs.LocalFileSystem(), str(directory), STATE_FILE, present=path.is_file())


def read_json(filesystem: pafs.FileSystem, root: str, name: str, *, present: bool) -> Any:
    """The JSON file ``name`` of the checkpoint ``root`` on ``filesystem`` (``present``: whether
    the caller found it there), naming both when it is missing or damaged."""
    if not present:
        raise FileNotFoundError(f"checkpoint {root} has no {name}")
    try:
        with filesystem.open_input_stream(f"{root}/{name}") as f:
            return json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointDamagedError(f"checkpoint {root}: {name} is damaged: {exc}") from exc


def dcp_metadata(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's DCP metadata of every tensor (key -> ``size``, ``properties.dtype``),
    read with :class:`CheckpointReader`."""
    try:
        return CheckpointReader(str(directory)).read_metadata().state_dict_metadata
    except Exception as exc:  # EOFError, unpickling errors of a damaged .metadata
        raise CheckpointDamagedError(
            f"checkpoint {directory}: its DCP metadata is not readable: {exc!r}"
        ) from exc


def dcp_loader(directory: str | Path, *, no_dist: bool = False) -> Callable[[dict[str, Any]], None]:
    """``load(state_dict)``: fills the tensors of ``state_dict`` from the checkpoint
    (collectively; with ``no_dist`` in this process alone)."""

    def load(state_dict: dict[str, Any]) -> None:
        try:
            with quiet_dcp():
                dcp.load(
                    state_dict, storage_reader=CheckpointReader(str(directory)), no_dist=no_dist
                )
        except Exception as exc:  # a shard that cannot be read: name the checkpoint
            raise CheckpointDamagedError(
                f"checkpoint {directory}: reading its shards failed: {exc!r}"
            ) from exc

    return load


def delta_reader(directory: str | Path, metadata: dict[str, Any]) -> Any:
    """``read(keys)``: a delta's tensors ``keys``, read whole in this process."""
    load = dcp_loader(directory, no_dist=True)

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        out = {
            k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype)
            for k in keys
        }
        load(out)
        return out

    return read
