"""Model directories: the unsharded model's weights, streamed, plus the config and plan.

A model directory holds ``spec.json`` (the worker-side config), ``plan.json`` (the sharding
plan), ``metrics.json`` and the weights, in one of two forms:

* ``model.safetensors``: every tensor of the unsharded ``RecModel`` under its state-dict key
  (``embedding_bags.weights.<table>``, ``dense.*``), in the safetensors format (a JSON header,
  then raw little-endian bytes: no pickle, memory-mappable). Exported and logged models have it.
  An ``int8`` / ``int4`` table is kept as trained, without a weight, as three tensors under
  ``embedding_bags.quantized.<table>.``: ``codes`` (uint8, ``(rows, dim * bits / 8)``),
  ``qparams`` (fp16, ``(rows, 2 K)``: each column block's scale and bias) and ``blocks``
  (int64, ``(K, 2)``: the column blocks); the codes' width tells the precision (``dim``: int8,
  ``dim / 2``: int4). See :class:`~raydlrm.models.embedding.QuantizedTable`.
* a training checkpoint (``raydlrm.trainers.checkpoints``): the final checkpoint of a run holds
  its tables once, as the ranks' DCP shards (a differential checkpoint: with its chain), and no
  second copy of them. Exporting it assembles the tables one at a time.
* a reference (``weights_ref.json``: ``{"checkpoint": <URI>}``): the weights are those of the
  training checkpoint at that URI (a local path or ``s3://``, read with the standard AWS
  variables), left where the run stored them. A run's model registered by reference holds only
  this file beside its config, plan and metrics (``raydlrm.platform.export``).
  :func:`model_source` follows it.

:func:`write_model_weights` turns either into ``model.safetensors`` holding one table in
memory at a time (the header is computed from shapes before any data is read, then each tensor
is read and written in turn). :func:`load_model_checkpoint` rebuilds the model with its tables
*memory-mapped* from ``model.safetensors``: scoring a model larger than RAM works, the page cache
serving the hot rows (a quantized table's codes: a lookup dequantizes the rows it reads).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raydlrm.models import RecModel, build_model
from raydlrm.sharding import ShardingPlan
from raydlrm.storage import StorageConfig, StorageError, redact, scratch_directory
from raydlrm.trainers.checkpoints import (
    STATE_FILE,
    check_intact,
    load_model_tensor,
    local_checkpoint,
    model_tensors,
)
from raydlrm.trainers.spec import WorkerSpec

__all__ = [
    "LoadedModel",
    "ModelWeights",
    "find_model_dir",
    "load_model_checkpoint",
    "model_metrics",
    "model_source",
    "save_model_metadata",
    "write_model_dir",
    "write_model_weights",
    "write_weights",
]

WEIGHTS_FILE = "model.safetensors"
REFERENCE_FILE = "weights_ref.json"
SPEC_FILE = "spec.json"
PLAN_FILE = "plan.json"
METRICS_FILE = "metrics.json"
FINAL_METRICS_FILE = "final_metrics.json"
"""The run's final metrics, the final evaluation's included, written into the final checkpoint
after the evaluation (its ``metrics.json`` is written before: the checkpoint precedes it)."""
METADATA_FILES = (SPEC_FILE, PLAN_FILE, METRICS_FILE)
"""The small files of a model directory, beside its weights."""

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def model_metrics(directory: str | Path) -> dict[str, Any]:
    """A model directory's metrics: ``metrics.json`` with ``final_metrics.json`` (the final
    evaluation's, when the run wrote them) over it; empty if it has neither."""
    metrics: dict[str, Any] = {}
    for name in (METRICS_FILE, FINAL_METRICS_FILE):
        file = Path(directory, name)
        if file.is_file():
            metrics.update(json.loads(file.read_text()))
    return metrics


def write_model_dir(checkpoint_dir: str | Path, target: str | Path) -> Path:
    """Writes the model of a model directory or training checkpoint into ``target`` (created):
    ``model.safetensors`` (streamed, one table at a time), its config and plan, and its metrics
    (:func:`model_metrics`); not the training state's optimizer state."""
    target = Path(target)
    target.mkdir(parents=True)
    for name in (SPEC_FILE, PLAN_FILE):
        if Path(checkpoint_dir, name).is_file():
            shutil.copy2(Path(checkpoint_dir, name), target / name)
    metrics = model_metrics(checkpoint_dir)
    (target / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
    with model_source(checkpoint_dir) as source:
        write_model_weights(source, target / WEIGHTS_FILE)
    return target


def weights_reference(directory: str | Path) -> str | None:
    """The checkpoint URI a model directory's weights are referenced at, or None when it holds
    them (or is a checkpoint) itself."""
    file = Path(directory, REFERENCE_FILE)
    if not file.is_file() or Path(directory, WEIGHTS_FILE).is_file():
        return None
    return str(json.loads(file.read_text())["checkpoint"])


@contextlib.contextmanager
def model_source(directory: str | Path) -> Iterator[Path]:
    """The directory holding a model directory's weights: itself, or for a model registered by
    reference the training checkpoint it names (a temporary local copy of the checkpoint and
    its chain when remote).

    Raises:
        FileNotFoundError: the referenced checkpoint is gone, naming it.
        CheckpointDamagedError: the referenced checkpoint (or its chain) is damaged.
    """
    uri = weights_reference(directory)
    if uri is None:
        yield Path(directory)
        return
    with contextlib.ExitStack() as stack:
        try:  # only the reference's own failures are named as such, not the caller's
            local = stack.enter_context(local_checkpoint(uri, StorageConfig()))
        except (FileNotFoundError, StorageError) as exc:
            raise FileNotFoundError(
                f"model {directory}: its weights are referenced at the training checkpoint "
                f"{uri}, which cannot be read ({exc}). A model registered by reference needs "
                "its run's checkpoints where the run stored them (raydlrm export --register "
                "makes a standalone copy)"
            ) from None
        yield local  # checked (with its chain) by ModelWeights before anything is read


def save_model_metadata(
    directory: str | Path, *, spec: WorkerSpec, plan: ShardingPlan, metrics: dict[str, float]
) -> Path:
    """Writes a model directory's config, plan and metrics into ``directory`` (created if
    missing; the weights are the training state's, or :func:`write_model_weights`'s); returns
    it."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # Credentials are not stored with the model.
    (path / SPEC_FILE).write_text(json.dumps(redact(spec.to_dict()), indent=2))
    (path / PLAN_FILE).write_text(plan.to_json())
    (path / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
    return path


@dataclass(frozen=True)
class TensorInfo:
    """Name, dtype and shape of one tensor of a model's weights."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


class ModelWeights:
    """The weights of a model directory, read one tensor at a time.

    Args:
        directory: a model directory (see the module docstring).

    Raises:
        FileNotFoundError: naming the directory when it holds no weights in any known form.
        CheckpointDamagedError: a training checkpoint whose files do not match its manifests.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._safetensors = self.directory / WEIGHTS_FILE
        if self._safetensors.is_file():
            from safetensors import safe_open

            self._open = safe_open(str(self._safetensors), framework="pt")
            codes = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
            self.tensors = []
            names = self._open.keys()  # a safetensors handle is not iterable
            for key in names:
                piece = self._open.get_slice(key)
                self.tensors.append(
                    TensorInfo(key, codes[piece.get_dtype()], tuple(piece.get_shape()))
                )
            self.form = "safetensors"
        elif (self.directory / STATE_FILE).is_file():
            check_intact(self.directory)  # a damaged shard is named before anything reads it
            # Read once: every tensor's DCP key and metadata.
            self._dcp = model_tensors(self.directory)
            self.tensors = [
                TensorInfo(name, meta.properties.dtype, tuple(meta.size))
                for name, (_, meta) in self._dcp.items()
            ]
            self.form = "training_state"
        else:
            raise FileNotFoundError(
                f"{self.directory} holds no model weights ({WEIGHTS_FILE} or a training checkpoint)"
            )

    def load(self, name: str) -> torch.Tensor:
        """The tensor ``name``: memory-mapped (safetensors) or read from the shards (training
        checkpoint; only this tensor's chunks are read)."""
        if self.form == "safetensors":
            return self._open.get_tensor(name)
        return load_model_tensor(self.directory, *self._dcp[name])

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one at a time (drop each before taking the next to bound memory)."""
        for info in self.tensors:
            yield info.name, self.load(info.name)


def write_model_weights(directory: str | Path, output: str | Path) -> Path:
    """Writes the weights of the model directory ``directory`` to ``output`` as safetensors,
    one tensor in memory at a time.

    The header (every tensor's dtype, shape and byte range) is known from the shapes alone, so it
    is written first; tensors follow in order of decreasing element size (then name), which
    keeps every tensor aligned to its element size, as the safetensors library writes them.

    Returns:
        ``output``.
    """
    weights = ModelWeights(directory)
    if weights.form == "safetensors" and Path(output).resolve() == weights._safetensors.resolve():
        return Path(output)
    return write_weights(weights, output, source=directory)


def write_weights(weights: Any, output: str | Path, *, source: str | Path) -> Path:
    """:func:`write_model_weights` of ``weights`` (a :class:`ModelWeights`, or anything with
    its ``tensors`` and ``load``) read from ``source`` (named in errors)."""
    directory = source
    order = sorted(weights.tensors, key=lambda t: (-t.dtype.itemsize, t.name))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for info in order:
        if info.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {info.name}: dtype {info.dtype} has no safetensors code")
        header[info.name] = {
            "dtype": _SAFETENSORS_DTYPES[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    with open(partial, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for info in order:
            tensor = weights.load(info.name).detach().to("cpu").contiguous()
            if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
                raise ValueError(
                    f"tensor {info.name} of {directory} is {tensor.dtype} {tuple(tensor.shape)}, "
                    f"its metadata says {info.dtype} {info.shape}"
                )
            if tensor.numel():
                f.write(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()))
            del tensor
    os.replace(partial, output)  # a reader never sees a half-written file under the name
    return output


@dataclass
class LoadedModel:
    """An unsharded model restored from a checkpoint, with what made it."""

    model: RecModel
    spec: WorkerSpec
    plan: ShardingPlan
    metrics: dict[str, float]


def find_model_dir(root: str | Path) -> Path | None:
    """The model directory at or under ``root`` (an exported or downloaded MLflow model holds
    it under ``artifacts/``), or None."""
    root = Path(root)
    if (root / SPEC_FILE).is_file():
        return root
    found = sorted(root.rglob(SPEC_FILE))
    return found[0].parent if found else None


def load_model_checkpoint(directory: str | Path) -> LoadedModel:
    """Rebuilds the unsharded model of a model directory (on CPU, in eval mode) with its tables
    memory-mapped (no table is read into memory until its rows are looked up).

    A directory without ``model.safetensors`` (a training checkpoint, or a reference to one) is
    first written to a temporary safetensors file, one table at a time, which is mapped and
    unlinked (the mapping keeps it readable).

    Raises:
        FileNotFoundError: naming the missing file.
    """
    path = Path(directory)
    for name in (SPEC_FILE, PLAN_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {path} has no {name}")
    spec = WorkerSpec.stored(json.loads((path / SPEC_FILE).read_text()))
    plan = ShardingPlan.from_json((path / PLAN_FILE).read_text())
    metrics = model_metrics(path)
    model = build_model(
        spec.model,
        tables=spec.tables(),
        num_dense=spec.data.num_dense_inputs(),
        embedding_device="meta",
        **spec.sequence_inputs(),
    )
    with model_source(path) as source:
        weights_file = source / WEIGHTS_FILE
        if weights_file.is_file():
            state = _mapped(weights_file)
        else:
            with scratch_directory("weights") as tmp:
                state = _mapped(write_model_weights(source, Path(tmp, WEIGHTS_FILE)))
    # assign=True: the meta tables become the mapped tensors themselves (no copy); a table
    # whose codes the file holds is held quantized (EmbeddingBagCollection's load).
    model.load_state_dict(state, assign=True)
    for table in model.embedding_bags.quantized.values():
        table.column_blocks()  # checked here rather than at the first lookup
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(model=model, spec=spec, plan=plan, metrics=metrics)


def _mapped(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, memory-mapped (copy-on-write, never written back)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = f.keys()  # a safetensors handle is not iterable
        return {k: f.get_tensor(k) for k in names}
