"""The trained model as a self-contained MLflow model that scores raw feature rows.

The logged model is an MLflow ``pyfunc``: its artifacts are a model checkpoint (unsharded
weights as a tensor-only state dict, loaded with ``weights_only=True``, plus the config and plan)
and its ``predict`` takes a pandas DataFrame of raw rows, shaped like the training Parquet (dense
and sparse columns; the label is not needed), applies the same preprocessing as training (the
same stable id hashing and dense transform) and returns click probabilities. It needs neither
Ray nor a process group.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import torch

import raydlrm
from raydlrm.ingestion import DataConfig, Preprocessor, arrow_to_batch
from raydlrm.trainers import load_model_checkpoint

__all__ = ["RecModelPythonModel", "log_model", "score_table"]

logger = logging.getLogger(__name__)

MODEL_ARTIFACT = "model"
_REQUIREMENTS = ("numpy", "pandas", "pyarrow", "pydantic", "scikit-learn", "mlflow", "ray")


class RecModelPythonModel(mlflow.pyfunc.PythonModel):
    """Scores raw feature rows with an unsharded model restored from a checkpoint."""

    def load_context(self, context: Any) -> None:
        loaded = load_model_checkpoint(context.artifacts["checkpoint"])
        self._model = loaded.model
        self._data = loaded.spec.data
        self._preprocess = Preprocessor(loaded.spec.data)

    def predict(self, context: Any, model_input: pd.DataFrame, params: Any = None) -> np.ndarray:
        """Click probabilities, shape ``(N,)``, for ``N`` raw rows (a pandas DataFrame)."""
        table = pa.Table.from_pandas(pd.DataFrame(model_input), preserve_index=False)
        return score_table(self._model, self._preprocess, self._data, table)


def score_table(
    model: torch.nn.Module, preprocess: Preprocessor, data: DataConfig, table: pa.Table
) -> np.ndarray:
    """Click probabilities, shape ``(N,)``, of ``N`` raw rows (an Arrow table with the model's
    input columns; a label column, if any, is ignored)."""
    # The preprocessor expects a label; scoring has none (or must not use it).
    labels = pa.array(np.zeros(table.num_rows, dtype=np.float32))
    if data.label_column in table.column_names:
        table = table.drop_columns([data.label_column])
    table = table.append_column(data.label_column, labels)
    batch = arrow_to_batch(preprocess(table), config=data)
    with torch.no_grad():
        return torch.sigmoid(model(batch)).numpy()


class _Context:
    """The part of MLflow's ``PythonModelContext`` that ``load_context`` reads."""

    def __init__(self, artifacts: dict[str, str]):
        self.artifacts = artifacts


def log_model(
    *,
    run_id: str,
    checkpoint_dir: str | Path,
    example: pd.DataFrame,
    registered_model_name: str | None,
) -> mlflow.models.model.ModelInfo:
    """Logs the checkpoint as a pyfunc model on run ``run_id`` and registers it if a name is
    given.

    Args:
        run_id: the job's MLflow run.
        checkpoint_dir: a model checkpoint directory (``raydlrm.trainers.checkpoint``).
        example: a few raw input rows, used for the model signature and input example.
        registered_model_name: registry name, or None to log without registering.
    """
    # The raydlrm source travels with the model (code_paths); these are what it imports.
    requirements = [
        "torch==2.13.0",
        "fbgemm-gpu-cpu==1.8.0",
        *(f"{name}=={metadata.version(name)}" for name in _REQUIREMENTS),
    ]
    scorer = RecModelPythonModel()
    scorer.load_context(_Context({"checkpoint": str(checkpoint_dir)}))
    predictions = scorer.predict(None, example)
    signature = mlflow.models.infer_signature(example, predictions)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name=MODEL_ARTIFACT,
            python_model=RecModelPythonModel(),
            artifacts={"checkpoint": str(checkpoint_dir)},
            signature=signature,
            input_example=example,
            pip_requirements=requirements,
            code_paths=[str(Path(raydlrm.__file__).parent)],
            registered_model_name=registered_model_name,
        )
    logger.info(
        "logged model %s%s",
        info.model_uri,
        f" as {registered_model_name} v{info.registered_model_version}"
        if registered_model_name
        else "",
    )
    return info
