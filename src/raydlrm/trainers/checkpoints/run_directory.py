"""A run directory's checkpoints: the newest intact one a resume takes, why a run cannot
resume, and pruning to what retention keeps.

Ray Train names a run's checkpoints ``checkpoint_<time>`` (:func:`checkpoint_names`). A resume
takes the newest intact one (:func:`newest_intact_stored`, :func:`newest_intact`), passing over
damaged ones (:mod:`~raydlrm.trainers.checkpoints.manifest`); :func:`resume_blocker` says why
none is; :func:`prune_checkpoints` keeps the newest and what the kept deltas' chains need.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pyarrow.fs as pafs

from raydlrm.trainers.checkpoints.format import STATE_FILE, CheckpointDamagedError, read_json
from raydlrm.trainers.checkpoints.manifest import verify_checkpoint

__all__ = [
    "checkpoint_names",
    "newest_intact",
    "newest_intact_path",
    "newest_intact_stored",
    "prune_checkpoints",
    "resume_blocker",
]

logger = logging.getLogger(__name__)


def checkpoint_names(filesystem: pafs.FileSystem, parent: str) -> list[str]:
    """The ``checkpoint_*`` directories of a run directory, oldest first (by Ray's
    time-stamped names); none where the directory does not exist yet (a new run)."""
    return sorted(
        i.base_name
        for i in filesystem.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
        if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
    )


def newest_intact_path(filesystem: pafs.FileSystem, run_directory: str) -> str | None:
    """The newest intact ``checkpoint_*`` directory of a run directory (checked where it is
    stored, without checksums; a delta with its chain), or None: where a submission of the
    run resumes from, as :func:`newest_intact_stored` chooses it."""
    parent = run_directory.rstrip("/")
    for name in reversed(checkpoint_names(filesystem, parent)):
        path = f"{parent}/{name}"
        if not verify_checkpoint(path, checksums=False, filesystem=filesystem):
            return path
    return None


def _newest_first(latest: Any) -> list[Any]:
    """Every ``checkpoint_*`` directory beside ``latest``, newest first (by Ray's time-stamped
    names), as checkpoints of ``latest``'s type."""
    filesystem = latest.filesystem
    parent = latest.path.rstrip("/").rsplit("/", 1)[0]
    paths = [f"{parent}/{n}" for n in reversed(checkpoint_names(filesystem, parent))]
    if latest.path.rstrip("/") not in paths:
        paths.insert(0, latest.path)
    return [type(latest)(path=p, filesystem=filesystem) for p in paths]


def prune_checkpoints(latest: Any, *, keep: int, also: Sequence[str] = ()) -> list[str]:
    """Deletes the ``checkpoint_*`` directories beside ``latest`` (a stored checkpoint:
    ``path``, ``filesystem``) but the newest ``keep``, those named in ``also`` (the best
    validation checkpoint) and every checkpoint their chains need; returns the names deleted.
    A checkpoint whose state cannot be read is kept if among the newest, and needs nothing."""
    filesystem = latest.filesystem
    parent = latest.path.rstrip("/").rsplit("/", 1)[0]
    names = checkpoint_names(filesystem, parent)
    protected = [*names[-keep:], *(n for n in also if n in names)]
    kept = set(protected)
    for name in protected:
        try:
            state = read_json(filesystem, f"{parent}/{name}", STATE_FILE, present=True)
        except (OSError, CheckpointDamagedError):
            continue
        kept.update((state.get("differential") or {}).get("chain", []))
    deleted = [n for n in names if n not in kept]
    for name in deleted:
        filesystem.delete_dir(f"{parent}/{name}")
    return deleted


def newest_intact_stored(latest: Any) -> Any | None:
    """A run's newest intact checkpoint as stored (nothing downloaded), or None when the run
    has none (a fresh start).

    ``latest`` (a Ray Train ``Checkpoint``: ``path``, ``filesystem``) and every other
    ``checkpoint_*`` directory beside it are checked where they are stored (without checksums;
    a delta with its chain), newest first (Ray names them by time): one complete but never
    registered (a crash between writing and registering) is taken rather than redoing its
    steps, and a damaged one is passed over with a warning naming it. Every rank checks the
    same directories the same way, so all ranks pick the same one.

    Raises:
        RuntimeError: the run has checkpoints but none is intact (each named with its damage).
    """
    if latest is None:
        return None
    damaged = []
    for checkpoint in _newest_first(latest):
        problems = verify_checkpoint(
            checkpoint.path, checksums=False, filesystem=checkpoint.filesystem
        )
        if not problems:
            if damaged or checkpoint.path != latest.path:
                logger.warning(
                    "taking %s rather than the latest registered checkpoint %s",
                    checkpoint.path,
                    latest.path,
                )
            return checkpoint
        damaged.append(f"{checkpoint.path}: {'; '.join(problems[:3])}")
        logger.warning("checkpoint %s is damaged, passed over: %s", checkpoint.path, damaged[-1])
    raise RuntimeError("no intact checkpoint to resume from: " + " | ".join(damaged))


def resume_blocker(run_directory: str, filesystem: pafs.FileSystem) -> str | None:
    """Why a run with checkpoints in ``run_directory`` cannot resume, or None (it has an intact
    checkpoint, or none at all): the checkpoints damaged or missing themselves, each named
    once with how many checkpoints' chains need it (a damaged baseline of a differential run
    breaks every delta after it). The driver says it before Ray starts; the workers would
    find the same (:func:`newest_intact_stored`), checkpoint by checkpoint."""
    root = run_directory.rstrip("/")
    names = checkpoint_names(filesystem, root)
    own: dict[str, list[str]] = {}  # a checkpoint -> its own damage, read when first needed

    def damage(name: str) -> list[str]:
        if name not in own:
            own[name] = verify_checkpoint(
                f"{root}/{name}", checksums=False, filesystem=filesystem, chain=False
            )
        return own[name]

    needed: dict[str, int] = {}  # a damaged or missing checkpoint -> the chains that need it
    for name in reversed(names):  # the newest is intact in a run that can resume: one check
        if damage(name):
            continue
        if not verify_checkpoint(f"{root}/{name}", checksums=False, filesystem=filesystem):
            return None  # intact, its chain too
        state = read_json(filesystem, f"{root}/{name}", STATE_FILE, present=True)
        link = state.get("differential")
        for member in (link or {}).get("chain", []):
            if member not in names or damage(member):
                needed[member] = needed.get(member, 0) + 1
    if not names:
        return None
    causes = []
    for name in sorted({*needed, *(n for n in names if own[n])}):
        what = f"{name} is missing" if name not in names else f"{name} is damaged ({own[name][0]})"
        count = needed.get(name, 0)
        if count:
            what += f", which the chain of {count} later checkpoint{'s' * (count != 1)} needs"
        causes.append(what)
    return f"none of its {len(names)} checkpoints is intact: {'; '.join(causes)}"


@contextmanager
def newest_intact(latest: Any) -> Iterator[tuple[str, Any] | tuple[None, None]]:
    """:func:`newest_intact_stored` as a local directory (downloaded if remote) and as stored,
    or (None, None)."""
    checkpoint = newest_intact_stored(latest)
    if checkpoint is None:
        yield None, None
        return
    with checkpoint.as_directory() as directory:
        yield directory, checkpoint
