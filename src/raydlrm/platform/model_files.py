"""A model ready to score: a local directory with ``model.safetensors``, made once on the driver.

The model is a registered or logged MLflow model (``models:/name@champion``, ``models:/name/3``,
``runs:/<id>/model``) or a model checkpoint directory (``runs/<run>/checkpoint_...``, local or
``s3://``): downloaded, or written table by table from a training checkpoint (one given, or the
one a model registered by reference names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from raydlrm.storage import StorageConfig, StorageError, is_remote, scratch_directory
from raydlrm.trainers.checkpoints import local_checkpoint
from raydlrm.trainers.model_dir import (
    PLAN_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    find_model_dir,
    write_model_dir,
)

__all__ = ["ModelFiles", "model_files"]


@dataclass
class ModelFiles:
    """A model ready to score: a local directory with ``model.safetensors``, its config, plan
    and metrics (a temporary copy when the model was downloaded or converted, removed by
    :meth:`close`). A context manager."""

    directory: Path
    """The model directory."""
    spec: dict[str, Any]
    """Its worker config (``spec.json``)."""
    _copies: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    def close(self) -> None:
        self._copies.close()

    def __enter__(self) -> ModelFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def model_files(model: str) -> ModelFiles:
    """The model of a checkpoint or exported model directory (local or ``s3://``, the store
    from the standard AWS variables), or of an MLflow model URI, as a local directory with
    ``model.safetensors`` (see :class:`ModelFiles`).

    Raises:
        FileNotFoundError: naming the model (a local one by its absolute path) when it does
            not exist or holds no raydlrm model.
    """
    copies = contextlib.ExitStack()

    def scratch() -> str:
        return copies.enter_context(scratch_directory("model"))

    try:
        if is_remote(model):
            try:
                root = copies.enter_context(local_checkpoint(model, StorageConfig()))
            except (StorageError, FileNotFoundError) as exc:
                raise FileNotFoundError(f"model {exc}") from exc
        elif not urlsplit(model).scheme:
            root = _local_model(model)
        else:
            root = _downloaded(model, scratch())
        directory = find_model_dir(root) or root
        for name in (SPEC_FILE, PLAN_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"model {model} has no {name}")
        if not (directory / WEIGHTS_FILE).is_file():
            # A training checkpoint (or a model referencing one): its tables, one at a time,
            # into a safetensors file that the actors can map.
            directory = write_model_dir(directory, Path(scratch(), "model"))
        spec = json.loads((directory / SPEC_FILE).read_text())
    except BaseException:
        copies.close()
        raise
    return ModelFiles(directory=directory, spec=spec, _copies=copies)


def _local_model(model: str) -> Path:
    """A local model directory, by its absolute path.

    Raises:
        FileNotFoundError: naming the absolute path when it is not a directory (MLflow would
            read it as a relative artifact URI, and name only its last part).
    """
    path = Path(model).expanduser().resolve()
    if path.is_dir():
        return path
    what = "is not a directory" if path.exists() else "does not exist"
    raise FileNotFoundError(
        f"model {path} {what}: give a model checkpoint or exported model directory, or an "
        "MLflow model URI (models:/<name>@<alias>, models:/<name>/<version>, runs:/<id>/model)"
    )


def _downloaded(model: str, directory: str) -> Path:
    """The MLflow model ``model`` downloaded into ``directory``.

    Raises:
        FileNotFoundError: naming ``model`` and MLflow's reason, on one line.
    """
    import mlflow

    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=model, dst_path=directory))
    except Exception as exc:  # MlflowException, OSError: a model that is not there
        reason = "; ".join(line.strip("# ") for line in str(exc).splitlines() if line.strip())
        raise FileNotFoundError(f"model {model} cannot be loaded: {reason}") from exc
