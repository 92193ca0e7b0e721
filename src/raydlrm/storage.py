"""Where data, checkpoints and models live: local paths or ``s3://`` (any S3-compatible
store); the one home of raydlrm's storage and URI helpers, used by every layer.

:func:`is_remote`, :func:`scheme_of`, :func:`join` and :func:`with_scheme` answer what a path
or URI is and build others from it; :func:`local_directory` makes a remote directory (a
checkpoint on S3) a local one for as long as it is needed.

:func:`filesystem_for` gives the pyarrow filesystem of a path: the local one, or S3 through
``s3fs`` with the endpoint, region and credentials of :class:`StorageConfig` (pyarrow itself
ignores ``AWS_ENDPOINT_URL``, so the endpoint is always passed explicitly). Credentials come from
the config or the standard AWS environment variables; they never appear in logs, reprs, errors
or the MLflow params (:func:`redact`).

:func:`list_files` lists a data set's Parquet files: one file, or every file under a directory
(except names starting with ``.`` or ``_``, as pyarrow does), in sorted order. In a
hive-partitioned layout (``date=2026-11-20/part-0.parquet``) ``data.partitions`` selects
partitions by value list or inclusive range, e.g. the last seven days for a scheduled
retraining job::

    [data.partitions]
    date = { min = "2026-11-14", max = "2026-11-20" }
    region = { values = ["eu", "us"] }

Values compare as integers when both sides are integers, else as strings (ISO dates sort
correctly as strings).

A session-clustered data set (``raydlrm.ingestion.clustered``) is a directory holding
:data:`CLUSTERED_MARKER`, its sample files under :data:`SAMPLES_DIR` and their companion files of
per-session columns under :data:`SESSIONS_DIR` (same relative paths, partitions included):
:func:`list_files` lists its sample files, partitions selected as in any data set.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import socket
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raydlrm._config import config_dataclass

__all__ = [
    "CLUSTERED_MARKER",
    "SAMPLES_DIR",
    "SECRET_KEYS",
    "SESSIONS_DIR",
    "PartitionSelector",
    "StorageConfig",
    "StorageError",
    "filesystem_for",
    "is_remote",
    "join",
    "list_files",
    "local_directory",
    "partition_values",
    "redact",
    "remove_orphaned_scratch",
    "scheme_of",
    "scratch_directory",
    "scratch_origin",
    "scratch_owner",
    "with_scheme",
]

SECRET_KEYS = ("access_key_id", "secret_access_key", "session_token")
"""Config keys whose values are never logged."""

CLUSTERED_MARKER = "_clustered.json"
"""The file at the root of a session-clustered data set that names its per-session columns;
its presence makes the directory one (written last: a conversion that stopped leaves none)."""
SAMPLES_DIR = "samples"
"""A session-clustered data set's sample files (every column but the per-session ones)."""
SESSIONS_DIR = "sessions"
"""A session-clustered data set's per-session files, one per sample file, at the same path."""


class StorageError(ValueError):
    """A path, bucket or partition selection that does not lead to data."""


@config_dataclass
class StorageConfig:
    """Object-store access (``[data.storage]``); unset fields fall back to the standard AWS
    environment variables and s3fs's default credential chain."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph, a local test server). Default:
    ``$AWS_ENDPOINT_URL_S3`` or ``$AWS_ENDPOINT_URL``."""
    region: str | None = None
    """Region. Default: ``$AWS_REGION`` or ``$AWS_DEFAULT_REGION``."""
    access_key_id: str | None = field(default=None, repr=False)
    """Access key. Default: ``$AWS_ACCESS_KEY_ID`` (or the credential chain)."""
    secret_access_key: str | None = field(default=None, repr=False)
    """Secret key. Default: ``$AWS_SECRET_ACCESS_KEY`` (or the credential chain)."""
    session_token: str | None = field(default=None, repr=False)
    """Session token. Default: ``$AWS_SESSION_TOKEN``."""
    anonymous: bool = False
    """Unsigned requests (public buckets)."""

    def s3fs_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``s3fs.S3FileSystem``."""
        endpoint = (
            self.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        region = self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        kwargs: dict[str, Any] = {"anon": self.anonymous}
        if self.access_key_id:
            kwargs["key"] = self.access_key_id
        if self.secret_access_key:
            kwargs["secret"] = self.secret_access_key
        if self.session_token:
            kwargs["token"] = self.session_token
        client: dict[str, Any] = {}
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        if region:
            client["region_name"] = region
        if client:
            kwargs["client_kwargs"] = client
        return kwargs


@config_dataclass
class PartitionSelector:
    """Which values of one hive partition key to read: a list, a range, or both."""

    values: list[str | int] | None = None
    """Exact values to keep."""
    min: str | int | None = None
    """Smallest value to keep (inclusive)."""
    max: str | int | None = None
    """Largest value to keep (inclusive)."""

    def __post_init__(self) -> None:
        if self.values is None and self.min is None and self.max is None:
            raise ValueError("a partition selector needs values, min or max")

    def keeps(self, value: str) -> bool:
        """Whether the partition value ``value`` (a directory name's text) is selected."""
        if self.values is not None and not any(_equal(value, v) for v in self.values):
            return False
        if self.min is not None and _less(value, self.min):
            return False
        return not (self.max is not None and _less(self.max, value))


def _as_int(x: str | int) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _equal(a: str, b: str | int) -> bool:
    ia, ib = _as_int(a), _as_int(b)
    return ia == ib if ia is not None and ib is not None else str(a) == str(b)


def _less(a: str | int, b: str | int) -> bool:
    ia, ib = _as_int(a), _as_int(b)
    return ia < ib if ia is not None and ib is not None else str(a) < str(b)


def scheme_of(uri: str) -> str | None:
    """The scheme of a remote URI (``s3`` for ``s3://bucket/x``); None for a local path
    (``file://`` included)."""
    scheme, sep, _ = uri.partition("://")
    return scheme if sep and scheme != "file" else None


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an object store rather than the local filesystem."""
    return scheme_of(uri) is not None


def join(root: str, *parts: str) -> str:
    """``root/parts...``: a URI stays a URI; a local path becomes absolute."""
    if is_remote(root):
        return "/".join([root.rstrip("/"), *parts])
    return str(Path(root.removeprefix("file://"), *parts).resolve())


def with_scheme(path: str, scheme: str | None) -> str:
    """A path on a filesystem as a URI: pyarrow and Ray name object-store paths without their
    scheme (``bucket/run/checkpoint_...``); records and users need ``s3://bucket/...``."""
    return f"{scheme}://{path}" if scheme and "://" not in path else path


@contextlib.contextmanager
def local_directory(uri: str, storage: StorageConfig) -> Iterator[Path]:
    """A local directory holding the directory ``uri``: itself when local, else a temporary
    copy (removed on exit).

    Raises:
        FileNotFoundError: ``uri`` does not exist (local) or is not a directory (remote),
            naming it.
        StorageError: the store cannot be read (naming ``uri`` and the store's error).
    """
    if not is_remote(uri):
        local = Path(uri.removeprefix("file://"))
        if not local.exists():
            raise FileNotFoundError(f"{uri} does not exist")
        yield local
        return
    try:
        filesystem, path = filesystem_for(uri, storage)
        kind = filesystem.get_file_info(path).type
    except OSError as exc:
        raise StorageError(f"{uri} cannot be read: {exc}") from exc
    if kind != pafs.FileType.Directory:
        raise FileNotFoundError(f"{uri} does not exist")
    with scratch_directory("download") as tmp:
        pafs.copy_files(
            path, tmp, source_filesystem=filesystem, destination_filesystem=pafs.LocalFileSystem()
        )
        yield Path(tmp)


# ``raydlrm-<kind>-<pid>-<origin>-<tempfile's 8 characters>``
_SCRATCH = re.compile(r"raydlrm-[a-z]+-(\d{1,9})-([0-9a-f]{8})-[a-z0-9_]{8}")


@contextlib.contextmanager
def scratch_directory(kind: str) -> Iterator[str]:
    """A temporary directory for the block (``raydlrm-<kind>-<pid>-<origin>-*`` in the
    temporary directory), removed after it. A process killed inside such a block (a worker lost
    while it checkpoints, a driver stopped by its scheduler while it logs a model) cannot
    remove its own: the next one made on the machine, in the same PID namespace, removes those
    whose process is gone (:func:`remove_orphaned_scratch`)."""
    if not kind.isalpha() or not kind.islower():
        raise ValueError(f"scratch kind {kind!r}: lower-case letters only")
    remove_orphaned_scratch()
    prefix = f"raydlrm-{kind}-{os.getpid()}-{scratch_origin()}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def scratch_origin() -> str:
    """Where this process's ids mean something: its host and PID namespace, hashed (8 hex
    digits). Containers that share a temporary directory (a mounted ``/tmp``, a network file
    system) see other processes under the same ids, or none: a scratch directory is judged
    only by a process of its own origin."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        namespace = ""  # no procfs (macOS): the host alone
    return f"{zlib.crc32(f'{socket.gethostname()}/{namespace}'.encode()):08x}"


def scratch_owner(name: str) -> int | None:
    """The process id in a scratch directory's name (:func:`scratch_directory`) when that
    directory was made here (this host and PID namespace, :func:`scratch_origin`); None for
    another name, or one made elsewhere (its id is not this namespace's)."""
    match = _SCRATCH.fullmatch(name)
    if match is None or match.group(2) != scratch_origin():
        return None
    return int(match.group(1))


def remove_orphaned_scratch(directory: str | Path | None = None) -> list[Path]:
    """Removes the scratch directories (:func:`scratch_directory`) in ``directory`` (default:
    the temporary directory) made here whose process is no longer running; returns them.
    Those made in another PID namespace or on another host are left to their own."""
    removed = []
    for path in Path(directory or tempfile.gettempdir()).glob("raydlrm-*"):
        pid = scratch_owner(path.name)
        if pid is None or _running(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this PID namespace runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's, or not a process id: left alone
    return True


def filesystem_for(path: str, storage: StorageConfig) -> tuple[pafs.FileSystem, str]:
    """The filesystem of ``path`` and the path as that filesystem names it.

    Raises:
        StorageError: for a URI scheme other than ``s3://`` and local paths.
    """
    scheme = scheme_of(path)
    if scheme in ("s3", "s3a"):
        import s3fs

        fs = s3fs.S3FileSystem(**storage.s3fs_kwargs())
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path.split("://", 1)[1].rstrip("/")
    if scheme is not None:
        raise StorageError(f"unsupported storage scheme in {path!r} (use a local path or s3://)")
    return pafs.LocalFileSystem(), os.path.abspath(path.removeprefix("file://"))


def _partitions(relative: str) -> dict[str, str]:
    """``key=value`` directory names of a file's path relative to the data set root."""
    parts = relative.split("/")[:-1]
    return dict(p.split("=", 1) for p in parts if "=" in p)


def list_files(
    path: str,
    storage: StorageConfig,
    partitions: dict[str, PartitionSelector],
    *,
    role: str = "train",
) -> tuple[pafs.FileSystem, list[str]]:
    """The filesystem and the selected Parquet files of a data set, sorted (of a
    session-clustered data set, its sample files).

    Raises:
        StorageError: naming the path when it does not exist or holds no Parquet files, the
            partition key when the layout has no such key, and the partitions that exist when
            a selection matches none.
    """
    filesystem, resolved = filesystem_for(path, storage)
    try:
        info = filesystem.get_file_info(resolved)
    except OSError as exc:
        raise StorageError(f"{role} data path {path!r} cannot be read: {exc}") from exc
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"{role} data path {path!r} does not exist")
    if info.type == pafs.FileType.File:
        if partitions:
            raise StorageError(f"data.partitions: {role} data path {path!r} is a single file")
        return filesystem, [resolved]
    if filesystem.get_file_info(f"{resolved}/{CLUSTERED_MARKER}").type == pafs.FileType.File:
        resolved = f"{resolved}/{SAMPLES_DIR}"
    entries = filesystem.get_file_info(
        pafs.FileSelector(resolved, recursive=True, allow_not_found=True)
    )
    files = sorted(
        e.path
        for e in entries
        # pyarrow's convention: files whose names start with "." or "_" are not data.
        if e.type == pafs.FileType.File
        and not any(part.startswith((".", "_")) for part in e.path[len(resolved) :].split("/"))
    )
    if not files:
        raise StorageError(f"{role} data path {path!r} contains no Parquet files")
    return filesystem, _selected(files, root=resolved, partitions=partitions, what=(role, path))


def _selected(
    files: list[str], *, root: str, partitions: dict[str, PartitionSelector], what: tuple
) -> list[str]:
    """The ``files`` under ``root`` that ``partitions`` select (all without a selection);
    ``what`` is the data's role and path, for messages."""
    if not partitions:
        return files
    role, path = what
    found = {f: _partitions(f[len(root) :].lstrip("/")) for f in files}
    keys = {k for parts in found.values() for k in parts}
    unknown = sorted(set(partitions) - keys)
    if unknown:
        raise StorageError(
            f"data.partitions: {role} data at {path!r} has no partition key {unknown} "
            f"(its keys: {sorted(keys) or 'none, not a hive layout'})"
        )
    selected = [
        f
        for f, parts in found.items()
        if all(k in parts and sel.keeps(parts[k]) for k, sel in partitions.items())
    ]
    if not selected:
        existing = {k: sorted({p[k] for p in found.values() if k in p}) for k in partitions}
        raise StorageError(
            f"data.partitions selects no files of {role} data at {path!r}; partitions: {existing}"
        )
    return selected


def partition_values(path: str, storage: StorageConfig, key: str) -> list[str]:
    """The values of hive partition ``key`` under the data set ``path``, oldest first
    (integers compare as integers, other values as strings, so ISO dates sort by time).

    Raises:
        StorageError: the path is missing or holds no files, or its layout has no ``key``.
    """
    _, files = list_files(path, storage, {})
    _, root = filesystem_for(path, storage)
    values = {_partitions(f[len(root) :].lstrip("/")).get(key) for f in files}
    values.discard(None)
    if not values:
        raise StorageError(f"data at {path!r} has no hive partitions {key}=<value>")
    return sorted(values, key=functools.cmp_to_key(_compare))


def _compare(a: str, b: str) -> int:
    return -1 if _less(a, b) else (1 if _less(b, a) else 0)


def redact(tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of a (nested or flattened) config dict with every secret value replaced by
    ``***``: what may be logged, stored with a checkpoint or printed."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = redact(value)
        elif str(key).rsplit(".", 1)[-1] in SECRET_KEYS and value is not None:
            out[key] = "***"
        else:
            out[key] = value
    return out
