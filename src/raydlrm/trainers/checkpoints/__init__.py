"""Training checkpoints: everything a run needs to continue exactly where it stopped.

By concern:

* :mod:`~raydlrm.trainers.checkpoints.format`: the files of a checkpoint (DCP shards and
  ``trainer_state.json``), read with a restricted unpickler;
* :mod:`~raydlrm.trainers.checkpoints.save_load`: saving and restoring the training state (any
  plan or world size);
* :mod:`~raydlrm.trainers.checkpoints.manifest`: every rank's manifest (sizes, CRC-32s) and
  verifying a checkpoint, with a delta's chain, against them;
* :mod:`~raydlrm.trainers.checkpoints.chains`: differential checkpoints' chains (Check-N-Run);
* :mod:`~raydlrm.trainers.checkpoints.run_directory`: a run's checkpoints: the newest intact
  one to resume from, why none is, retention;
* :mod:`~raydlrm.trainers.checkpoints.download`: a local copy of a stored checkpoint;
* :mod:`~raydlrm.trainers.checkpoints.export_reader`: the unsharded model's tensors, read one
  at a time for export.

When the training loop checkpoints is :mod:`raydlrm.trainers.checkpoint_cadence`'s. The names
load lazily (``raydlrm._lazy``).
"""

from __future__ import annotations

from raydlrm._lazy import lazy_exports

# The public names by the submodule that defines them (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "chains": ("ChainLink", "open_chain"),
    "download": ("local_checkpoint",),
    "export_reader": ("load_model_tensor", "model_tensors"),
    "format": (
        "STATE_FILE",
        "CheckpointDamagedError",
        "CheckpointReader",
        "read_state_file",
    ),
    "manifest": (
        "check_intact",
        "verify_checkpoint",
        "write_manifest",
    ),
    "run_directory": (
        "checkpoint_names",
        "newest_intact",
        "newest_intact_path",
        "newest_intact_stored",
        "prune_checkpoints",
        "resume_blocker",
    ),
    "save_load": (
        "TrainingParts",
        "check_state_matches",
        "checkpoint_precisions",
        "load_training_state",
        "save_training_state",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
