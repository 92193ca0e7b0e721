"""A local copy of a stored checkpoint (or model directory): itself when local, else a
temporary download with, for a delta, the checkpoints of its chain beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

from raydlrm.storage import (
    StorageConfig,
    StorageError,
    filesystem_for,
    is_remote,
    local_directory,
    scratch_directory,
)
from raydlrm.trainers.checkpoints.chains import sibling_path
from raydlrm.trainers.checkpoints.format import STATE_FILE, read_json

__all__ = ["local_checkpoint"]


@contextmanager
def local_checkpoint(
    uri: str, storage: StorageConfig | None = None, *, filesystem: pafs.FileSystem | None = None
) -> Iterator[Path]:
    """A local directory holding the checkpoint (or model directory) ``uri``: itself when
    local, else a temporary copy with, for a delta, the checkpoints of its chain beside it, as
    in the run storage (removed on exit).

    Args:
        uri: a local path or an object-store URI (read with ``storage``); with ``filesystem``,
            the path as that filesystem names it (a Ray Train checkpoint's ``path``).
        storage: the object-store access of a URI (default: the standard AWS variables).
        filesystem: the store's filesystem (a Ray Train checkpoint's ``filesystem``).

    Raises:
        FileNotFoundError: ``uri`` does not exist, naming it.
        StorageError: the store cannot be read.
    """
    if (filesystem is None and not is_remote(uri)) or isinstance(filesystem, pafs.LocalFileSystem):
        with local_directory(uri, storage or StorageConfig()) as local:
            yield local
        return
    try:
        if filesystem is None:
            filesystem, path = filesystem_for(uri, storage or StorageConfig())
        else:
            path = uri
        kind = filesystem.get_file_info(path).type
        state_file = filesystem.get_file_info(f"{path}/{STATE_FILE}").type
    except OSError as exc:
        raise StorageError(f"{uri} cannot be read: {exc}") from exc
    if kind != pafs.FileType.Directory:
        raise FileNotFoundError(f"{uri} does not exist")
    names = [path.rstrip("/").rsplit("/", 1)[-1]]
    if state_file == pafs.FileType.File:
        state = read_json(filesystem, path, STATE_FILE, present=True)
        names = [*(state.get("differential") or {}).get("chain", []), *names]
    with scratch_directory("download") as tmp:
        for name in names:
            Path(tmp, name).mkdir()  # copy_files writes into an existing directory only
            pafs.copy_files(
                sibling_path(path, name),
                f"{tmp}/{name}",
                source_filesystem=filesystem,
                destination_filesystem=pafs.LocalFileSystem(),
            )
        yield Path(tmp, names[-1])
