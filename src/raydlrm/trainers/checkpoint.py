"""Model checkpoints: the unsharded model state plus the config and plan that made it.

A checkpoint directory holds ``model.pt`` (a state dict of tensors only, loaded with
``weights_only=True``: nothing is unpickled from storage), ``spec.json`` (the worker-side
config), ``plan.json`` (the sharding plan) and ``metrics.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from raydlrm.ingestion.storage import redact
from raydlrm.models import RecModel, build_model
from raydlrm.sharding import ShardingPlan
from raydlrm.trainers.spec import WorkerSpec

__all__ = [
    "MODEL_CHECKPOINT_FILES",
    "LoadedModel",
    "load_model_checkpoint",
    "save_model_checkpoint",
]

MODEL_FILE = "model.pt"
SPEC_FILE = "spec.json"
PLAN_FILE = "plan.json"
METRICS_FILE = "metrics.json"
MODEL_CHECKPOINT_FILES = (MODEL_FILE, SPEC_FILE, PLAN_FILE, METRICS_FILE)
"""The files of a model checkpoint (a training checkpoint holds them too, besides its state)."""


def save_model_checkpoint(
    directory: str | Path,
    *,
    state_dict: dict[str, torch.Tensor],
    spec: WorkerSpec,
    plan: ShardingPlan,
    metrics: dict[str, float],
) -> Path:
    """Writes a model checkpoint into ``directory`` (created if missing); returns it."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state_dict, path / MODEL_FILE)
    # Credentials are not stored with the model.
    (path / SPEC_FILE).write_text(json.dumps(redact(spec.to_dict()), indent=2))
    (path / PLAN_FILE).write_text(plan.to_json())
    (path / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
    return path


@dataclass
class LoadedModel:
    """An unsharded model restored from a checkpoint, with what made it."""

    model: RecModel
    spec: WorkerSpec
    plan: ShardingPlan
    metrics: dict[str, float]


def load_model_checkpoint(directory: str | Path) -> LoadedModel:
    """Rebuilds the unsharded model of a checkpoint (on CPU, in eval mode).

    Raises:
        FileNotFoundError: naming the missing file.
    """
    path = Path(directory)
    for name in (MODEL_FILE, SPEC_FILE, PLAN_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {path} has no {name}")
    spec = WorkerSpec(**json.loads((path / SPEC_FILE).read_text()))
    plan = ShardingPlan.from_json((path / PLAN_FILE).read_text())
    metrics_path = path / METRICS_FILE
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    model = build_model(spec.model, tables=spec.tables(), num_dense=len(spec.data.dense_columns))
    state = torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    return LoadedModel(model=model, spec=spec, plan=plan, metrics=metrics)
