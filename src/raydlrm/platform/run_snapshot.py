"""Ray Train's record of a run's checkpoints, kept true to what is stored.

Ray Train keeps a run snapshot (``checkpoint_manager_snapshot.json`` in the run directory) that
lists the checkpoints reported so far. A run submitted again under the same name (a finished
run given more epochs, a run whose driver was killed, a failed job resubmitted) restores it,
and Ray refuses to start when one of the listed checkpoints is gone, advising to delete the run
directory, checkpoints and all.

With differential checkpoints raydlrm deletes checkpoints itself: Ray's own retention keeps
the newest ``num_to_keep`` and would delete a baseline that the kept deltas need, so rank 0
keeps every checkpoint the newest chains need and deletes the rest (``prune_checkpoints``),
behind Ray's back. Before a run starts, the driver drops the checkpoints that are no longer
stored from the snapshot (:func:`drop_deleted_checkpoints`); the workers then resume from the
newest intact one as always. Ray's ``Result.best_checkpoints`` of a differential run may still
name deleted checkpoints: the run's own record is the run directory.

Written against Ray 2.60's snapshot (its ``checkpoint_results`` and the lists beside them); a
snapshot of another shape is left as it is, and Ray's own check then applies.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pyarrow.fs as pafs

from raydlrm.trainers.checkpoints import checkpoint_names

__all__ = ["SNAPSHOT_FILE", "drop_deleted_checkpoints"]

logger = logging.getLogger(__name__)

SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
"""Ray Train's run snapshot, in the run directory."""

# The snapshot's lists of checkpoint directory names (Ray 2.60).
_NAME_LISTS = (
    "validated_checkpoint_dir_names",
    "timed_out_validation_checkpoint_dir_names",
    "failed_validation_checkpoint_dir_names",
)


def _name(result: Any) -> str | None:
    return result.get("checkpoint_dir_name") if isinstance(result, dict) else None


def _known(state: Any) -> bool:
    """Whether ``state`` has the shape this module edits."""
    if not isinstance(state, dict):
        return False
    results, indices = state.get("checkpoint_results"), state.get("checkpoint_report_indices")
    pending = state.get("pending_training_results", [])
    specs = state.get("pending_validation_specs", [])
    return (
        isinstance(results, list)
        and isinstance(indices, list)
        and len(results) == len(indices)
        and all(_name(r) for r in results)
        and isinstance(pending, list)
        and isinstance(specs, list)
        and len(pending) == len(specs)
    )


def _dropped(state: dict[str, Any], stored: set[str]) -> list[str]:
    """Removes from ``state`` (in place) the checkpoints not in ``stored``; returns their
    names."""
    results = list(
        zip(state["checkpoint_results"], state["checkpoint_report_indices"], strict=True)
    )
    kept = [(r, i) for r, i in results if _name(r) in stored]
    gone = [_name(r) for r, _ in results if _name(r) not in stored]
    state["checkpoint_results"] = [r for r, _ in kept]
    state["checkpoint_report_indices"] = [i for _, i in kept]
    latest = state.get("latest_checkpoint_result")
    if latest is not None and _name(latest) not in stored:
        gone.append(_name(latest))
        state["latest_checkpoint_result"] = max(kept, key=lambda ri: ri[1])[0] if kept else None
    pending = list(
        zip(
            state.get("pending_training_results", []),
            state.get("pending_validation_specs", []),
            strict=True,
        )
    )
    if pending:
        state["pending_training_results"] = [r for r, _ in pending if _name(r) in stored]
        state["pending_validation_specs"] = [s for r, s in pending if _name(r) in stored]
        gone += [_name(r) for r, _ in pending if _name(r) not in stored]
    for key in _NAME_LISTS:
        if isinstance(state.get(key), list):
            state[key] = [n for n in state[key] if n in stored]
    return sorted({n for n in gone if n})


def drop_deleted_checkpoints(run_directory: str, filesystem: pafs.FileSystem) -> list[str]:
    """Drops the checkpoints that are no longer stored from the run snapshot of
    ``run_directory`` (on ``filesystem``: local or an object store), so that Ray Train restores
    the run; returns the names dropped (nothing when there is no snapshot, when it lists only
    stored checkpoints, or when it is not of the shape this module knows)."""
    path = f"{run_directory.rstrip('/')}/{SNAPSHOT_FILE}"
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return []
    with filesystem.open_input_stream(path) as f:
        try:
            state = json.loads(f.read())
        except ValueError:
            return []  # Ray's own loading names a damaged snapshot
    if not _known(state):
        logger.warning("Ray Train's run snapshot %s has an unknown shape: left as it is", path)
        return []
    gone = _dropped(state, set(checkpoint_names(filesystem, run_directory.rstrip("/"))))
    if not gone:
        return []
    text = json.dumps(state).encode()
    if isinstance(filesystem, pafs.LocalFileSystem):
        partial = f"{path}.raydlrm-partial"
        with filesystem.open_output_stream(partial) as f:
            f.write(text)
        filesystem.move(partial, path)  # a crash leaves the old snapshot or the new one
    else:
        with filesystem.open_output_stream(path) as f:  # one PUT: whole or not at all
            f.write(text)
    logger.info(
        "Ray Train's run snapshot listed %d checkpoints that retention deleted (%s): dropped "
        "from it, so the run resumes from its newest intact checkpoint",
        len(gone),
        ", ".join(gone),
    )
    return gone
