"""Delta exports: what changed in a model since an earlier one of the same tables (``raydlrm
export --since``), so a serving system takes a day's update without the whole model.

A delta directory holds ``delta.safetensors`` and the new model's ``spec.json``, ``plan.json``
and ``metrics.json``, plus ``delta.json`` (the base model's weights file size and SHA-256, and
the rows per table). In ``delta.safetensors``, per embedding table ``<table>``: ``rows.<table>``
(int64, the rows whose weights or, for a managed table, id-map entries changed),
``weights.<table>`` (those rows' weights) and, for a managed table, ``id_maps.<table>`` (those
rows' map entries, ``(n, 4)``); every other tensor (the dense part, quantized tables and
their id maps) whole, under ``whole.<key>``. :func:`apply_model_delta` rebuilds the new model
from the base and the delta (what a serving system does), one table at a time.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from raydlrm.trainers.model_dir import (
    METADATA_FILES,
    WEIGHTS_FILE,
    ModelWeights,
    write_weights,
)

__all__ = ["DELTA_FILE", "apply_model_delta", "write_model_delta"]

DELTA_FILE = "delta.safetensors"
DELTA_INFO = "delta.json"
_WEIGHTS, _MAPS = "embedding_bags.weights.", "embedding_bags.id_maps."


def _fingerprint(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _changed_rows(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return (new != old).reshape(new.shape[0], -1).any(dim=1)


def write_model_delta(new_dir: str | Path, base_dir: str | Path, target: str | Path) -> dict:
    """Writes the delta of model directory ``new_dir`` over ``base_dir`` (both with
    ``model.safetensors``) into ``target`` (created); returns ``delta.json``'s content.

    Raises:
        ValueError: naming a tensor the two models do not share with one shape (a delta needs
            the same tables; export the whole model).
    """
    new, base = ModelWeights(new_dir), ModelWeights(base_dir)
    shapes = {t.name: (t.shape, t.dtype) for t in base.tensors}
    for t in new.tensors:
        if shapes.get(t.name) != (t.shape, t.dtype):
            raise ValueError(
                f"tensor {t.name} is {t.dtype} {t.shape} in the new model, "
                f"{shapes.get(t.name, 'absent')} in the base {base_dir}: a delta needs the "
                "same tables; export the whole model"
            )
    out: dict[str, torch.Tensor] = {}
    rows_of: dict[str, int] = {}
    names = {t.name for t in new.tensors}
    for info in new.tensors:
        name = info.name
        if name.startswith(_MAPS) and _WEIGHTS + name.removeprefix(_MAPS) in names:
            continue  # with its table's weights (a quantized table's map goes whole with it)
        if not name.startswith(_WEIGHTS):
            out["whole." + name] = new.load(name).contiguous()
            continue
        table = name.removeprefix(_WEIGHTS)
        weight = new.load(name)
        changed = _changed_rows(weight, base.load(name))
        id_map = _MAPS + table
        if id_map in names:
            now = new.load(id_map)
            changed |= _changed_rows(now, base.load(id_map))
        rows = changed.nonzero().squeeze(1)
        out[f"rows.{table}"], out[f"weights.{table}"] = rows, weight[rows].contiguous()
        if id_map in names:
            out[f"id_maps.{table}"] = now[rows].contiguous()
        rows_of[table] = rows.numel()
    target = Path(target)
    target.mkdir(parents=True)
    safetensors.torch.save_file(out, str(target / DELTA_FILE))
    for name in METADATA_FILES:
        if Path(new_dir, name).is_file():
            shutil.copy2(Path(new_dir, name), target / name)
    info = {"base": _fingerprint(Path(base_dir, WEIGHTS_FILE)), "rows": rows_of}
    (target / DELTA_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
    return info


class _Patched:
    """The base model's weights with a delta written over them (``ModelWeights``' interface)."""

    def __init__(self, base: ModelWeights, delta: dict[str, torch.Tensor]):
        self._base, self._delta = base, delta
        self.tensors = base.tensors

    def load(self, name: str) -> torch.Tensor:
        if "whole." + name in self._delta:
            return self._delta["whole." + name]
        tensor = self._base.load(name).clone()
        for prefix, part in ((_WEIGHTS, "weights"), (_MAPS, "id_maps")):
            if name.startswith(prefix):
                table = name.removeprefix(prefix)
                tensor[self._delta[f"rows.{table}"]] = self._delta[f"{part}.{table}"]
        return tensor


def apply_model_delta(base_dir: str | Path, delta_dir: str | Path, target: str | Path) -> Path:
    """Writes the model of ``delta_dir`` over ``base_dir`` into the model directory ``target``
    (created).

    Raises:
        ValueError: the base is not the model the delta was made over (its weights' size or
            SHA-256 differ).
    """
    info = json.loads(Path(delta_dir, DELTA_INFO).read_text())
    found = _fingerprint(Path(base_dir, WEIGHTS_FILE))
    if found != info["base"]:
        raise ValueError(
            f"delta {delta_dir} was made over another model than {base_dir} (weights "
            f"{info['base']['sha256'][:12]}, {base_dir} has {found['sha256'][:12]})"
        )
    target = Path(target)
    target.mkdir(parents=True)
    delta = safetensors.torch.load_file(str(Path(delta_dir, DELTA_FILE)))
    write_weights(_Patched(ModelWeights(base_dir), delta), target / WEIGHTS_FILE, source=base_dir)
    for name in METADATA_FILES:
        if Path(delta_dir, name).is_file():
            shutil.copy2(Path(delta_dir, name), target / name)
    return target
