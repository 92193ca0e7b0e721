"""The data set a scoring job reads: its files, raw schema and row count, read on Ray Data.

A session-clustered data set (``raydlrm.ingestion.clustered``) is scored from its samples
files, each read with its sessions file; every row read carries its file (``PATH_COLUMN``), so
that a bad row can be named by its file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion.clustered import file_row_groups
from raydlrm.ingestion.layout import ClusteredLayout, read_layout, sessions_file_of
from raydlrm.storage import StorageConfig, filesystem_for, list_files

__all__ = ["PATH_COLUMN", "ScoreSource"]

PATH_COLUMN = "path"  # Ray Data's include_paths column


@dataclass(frozen=True)
class ScoreSource:
    """The data set to score: its files (of a session-clustered set, the samples files, each
    read with its sessions file), their filesystem, the raw schema and the row count."""

    data: str
    filesystem: pafs.FileSystem
    paths: list[str]
    schema: pa.Schema
    num_rows: int
    layout: ClusteredLayout | None
    root: str

    @classmethod
    def of(cls, data: str, storage: StorageConfig, partitions: dict) -> ScoreSource:
        filesystem, paths = list_files(data, storage, partitions, role="scoring")
        footers = []
        for path in paths:
            with filesystem.open_input_file(path) as f:
                footers.append(pq.read_metadata(f))
        schema = footers[0].schema.to_arrow_schema()
        layout, root = read_layout(data, storage), filesystem_for(data, storage)[1]
        if layout is not None:  # the per-session columns are in the sessions files
            with filesystem.open_input_file(sessions_file_of(paths[0], root=root)) as f:
                sessions = pq.read_schema(f)
            for name in layout.session_columns:
                if name in sessions.names and name not in schema.names:
                    schema = schema.append(sessions.field(name))
        rows = sum(footer.num_rows for footer in footers)
        return cls(data, filesystem, paths, schema, rows, layout, root)

    def row_groups(self, file: str, columns: list[str]) -> Iterator[pa.Table]:
        """``file``'s rows of ``columns``, a row group at a time."""
        return file_row_groups(
            file, filesystem=self.filesystem, root=self.root, layout=self.layout, columns=columns
        )

    def dataset(self, columns: list[str]) -> Any:
        """A Ray Data dataset of the rows' ``columns`` and their file (to name a bad row's)."""
        import ray.data

        if self.layout is None:
            return ray.data.read_parquet(
                self.paths, filesystem=self.filesystem, columns=columns, include_paths=True
            )
        files = ray.data.from_items([{"file": p} for p in self.paths])
        return files.map_batches(
            _read_clustered,
            fn_kwargs={"source": self, "columns": columns},
            batch_size=1,
            batch_format="pyarrow",
        )


def _read_clustered(files: pa.Table, source: ScoreSource, columns: list[str]) -> Iterator[pa.Table]:
    """A Ray Data task: the rows of session-clustered files, joined with their sessions."""
    for file in files.column("file").to_pylist():
        for table in source.row_groups(file, columns):
            yield table.append_column(PATH_COLUMN, pa.array([file] * table.num_rows))
