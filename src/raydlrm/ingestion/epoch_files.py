"""The data files an epoch is dealt from, recorded with its data position.

A checkpoint's data position counts the rows trained per row group *by its index in the list*
the epoch was dealt from (``raydlrm.ingestion.reader.EpochProgress``). That list is the data
set's files, sorted, each with its row groups; so the position means nothing without it. Every
checkpoint therefore records the epoch's list (:func:`file_list`: each file's path inside the
data set and its row groups' rows) and a resume reads the rest of that epoch from the same list
(:func:`epoch_groups`: the recorded files looked up in today's listing), whatever was added to
the data set meanwhile: files added since the epoch began (a late file in a daily partition, a
new day) are read from the next epoch on. A recorded file that is gone or whose row groups
changed cannot be read as the epoch began: :func:`file_changes` names it, and the driver
refuses the resume before Ray starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raydlrm.ingestion.layout import relative_path
from raydlrm.ingestion.schema import RowGroup

__all__ = ["FileChanges", "epoch_groups", "file_changes", "file_list"]

FileList = list[list[Any]]
"""``[[path inside the data set, [rows of row group 0, 1, ...]], ...]`` in the list's order (JSON
as a checkpoint stores it)."""


def file_list(groups: list[RowGroup], *, root: str) -> FileList:
    """The files of ``groups`` (a data set's row groups, in its order, each file's together),
    each with its path inside the data set at ``root`` (the filesystem's path) and its row
    groups' rows: what the position of an epoch dealt from ``groups`` refers to."""
    files: FileList = []
    for group in groups:
        path = relative_path(group.file, root)
        if not files or files[-1][0] != path:
            files.append([path, []])
        files[-1][1].append(group.num_rows)
    return files


def epoch_groups(files: FileList, groups: list[RowGroup], *, root: str) -> list[RowGroup]:
    """The row groups of a recorded list ``files`` (:func:`file_list`), found in a data set's
    current ``groups``: the list a resumed epoch is dealt from, in the recorded order, so its
    position's indices mean what they meant.

    Raises:
        ValueError: a recorded file is not in ``groups`` or has other row groups, named (the
            driver refuses such a resume before Ray starts: :func:`file_changes`).
    """
    by_path: dict[str, list[RowGroup]] = {}
    for group in groups:
        by_path.setdefault(relative_path(group.file, root), []).append(group)
    out: list[RowGroup] = []
    for path, rows in files:
        found = by_path.get(path, [])
        if [g.num_rows for g in found] != rows:
            raise ValueError(f"data file {path} of the resumed epoch is gone or changed")
        out.extend(found)
    return out


@dataclass(frozen=True)
class FileChanges:
    """How a data set's files differ from a recorded epoch's list (paths inside the data set).

    Attributes:
        removed: recorded files that are gone.
        changed: recorded files with other row groups, each with both row counts (a phrase).
        added: files not in the recorded list (read from the next epoch on).
    """

    removed: list[str]
    changed: list[str]
    added: list[str]

    def problems(self) -> list[str]:
        """What keeps the recorded epoch from being read as it began, one phrase each."""
        out = [f"file {path} is gone" for path in self.removed]
        return out + [f"file {phrase}" for phrase in self.changed]


def file_changes(recorded: FileList, current: FileList) -> FileChanges:
    """The files of a recorded epoch's list (:func:`file_list`) that are gone or changed in the
    ``current`` one, and the files added to it."""
    now = {path: rows for path, rows in current}
    then = {path: rows for path, rows in recorded}
    changed = [
        f"{path} has {_groups(now[path])} now, {_groups(rows)} in the checkpoint's epoch"
        for path, rows in recorded
        if path in now and now[path] != rows
    ]
    return FileChanges(
        removed=[path for path, _ in recorded if path not in now],
        changed=changed,
        added=[path for path, _ in current if path not in then],
    )


def _groups(rows: list[int]) -> str:
    """``3 row groups (64, 64, 8 rows)``."""
    shown = ", ".join(str(n) for n in rows[:6]) + (", ..." if len(rows) > 6 else "")
    return f"{len(rows)} row group{'s' * (len(rows) != 1)} ({shown} rows)"
