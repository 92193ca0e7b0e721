"""The session-clustered layout (RecD) as a description: its marker file and its schema's mark.

A session-clustered data set stores the columns that are constant within a session (the user
features) once per session instead of once per sample::

    <root>/_clustered.json          the marker: format version, session column, per-session columns
    <root>/samples/<path>.parquet   every column but the per-session ones, one row per sample,
                                    each session's samples contiguous
    <root>/sessions/<path>.parquet  one row per session: the session column and the per-session
                                    columns

``<path>`` keeps the sample-level data set's relative paths (hive partitions included). Row group
``i`` of a sessions file holds exactly the sessions of row group ``i`` of its samples file, in
the order of their first sample (a session cut by a row-group boundary has a row in both).
The marker is written last, so a directory without it is not (yet) a data set.

A clustered data set's training schema is the samples' schema plus the per-session columns;
:func:`with_layout` marks it in the schema's metadata, so whoever holds the schema (each
worker's row-group reader) knows which columns come from the sessions files.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from raydlrm.storage import (
    CLUSTERED_MARKER,
    SAMPLES_DIR,
    SESSIONS_DIR,
    StorageConfig,
    filesystem_for,
)

__all__ = [
    "FORMAT_VERSION",
    "ClusteredLayout",
    "layout_of",
    "read_layout",
    "relative_path",
    "sessions_file_of",
    "with_layout",
    "write_layout",
]

FORMAT_VERSION = 1
"""Version of the clustered layout written by this release."""
_SCHEMA_KEY = b"raydlrm.clustered"


@dataclass(frozen=True)
class ClusteredLayout:
    """What a session-clustered data set's marker says.

    Attributes:
        session_column: the column naming each sample's session (in both files).
        session_columns: the columns stored once per session, in the sessions files.
    """

    session_column: str
    session_columns: list[str]

    def to_json(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str, *, source: str) -> ClusteredLayout:
        """Parses a marker.

        Raises:
            ValueError: naming ``source`` when the marker is not one this release reads.
        """
        try:
            meta = json.loads(text)
            version = meta["format_version"]
            layout = cls(meta["session_column"], list(meta["session_columns"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source} is not a clustered data set's marker: {exc}") from exc
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{source}: clustered layout version {version}, this release reads {FORMAT_VERSION}"
            )
        return layout


def read_layout(path: str, storage: StorageConfig) -> ClusteredLayout | None:
    """The layout of the session-clustered data set at ``path``; None for any other path
    (a sample-level directory, a file, a path that does not exist).

    Raises:
        ValueError: the marker cannot be parsed (naming it).
    """
    filesystem, root = filesystem_for(path, storage)
    marker = f"{root}/{CLUSTERED_MARKER}"
    try:
        if filesystem.get_file_info(marker).type != pafs.FileType.File:
            return None
        with filesystem.open_input_stream(marker) as f:
            text = f.read().decode()
    except OSError:
        return None
    return ClusteredLayout.from_json(text, source=marker)


def write_layout(layout: ClusteredLayout, *, filesystem: pafs.FileSystem, root: str) -> None:
    """Writes the marker of the data set at ``root`` (last: it marks the data set complete)."""
    with filesystem.open_output_stream(f"{root}/{CLUSTERED_MARKER}") as f:
        f.write(layout.to_json().encode())


def relative_path(file: str, root: str) -> str:
    """``file``'s path inside the data set at ``root`` (its name when ``root`` is the file)."""
    inside = file[len(root) :].lstrip("/") if file.startswith(root.rstrip("/") + "/") else ""
    return inside or posixpath.basename(file)


def sessions_file_of(samples_file: str, *, root: str) -> str:
    """The sessions file of a samples file of the data set at ``root`` (filesystem paths)."""
    prefix = f"{root.rstrip('/')}/{SAMPLES_DIR}/"
    if not samples_file.startswith(prefix):
        raise ValueError(f"{samples_file} is not under {prefix}")
    return f"{root.rstrip('/')}/{SESSIONS_DIR}/{samples_file[len(prefix) :]}"


def with_layout(schema: pa.Schema, layout: ClusteredLayout) -> pa.Schema:
    """``schema`` marked as the training schema of a clustered data set of ``layout``."""
    return schema.with_metadata({**(schema.metadata or {}), _SCHEMA_KEY: layout.to_json()})


def layout_of(schema: pa.Schema) -> ClusteredLayout | None:
    """The layout a training schema was marked with (:func:`with_layout`); None for a
    sample-level data set's schema."""
    text = (schema.metadata or {}).get(_SCHEMA_KEY)
    return None if text is None else ClusteredLayout.from_json(text.decode(), source="schema")
