"""The learned model: :class:`SetCostNet` (a per-table MLP summed over a shard's tables, then a
head) and :class:`LearnedCostModel`, a trained net with its normalisation and what it was
trained on, saved as safetensors weights plus JSON (nothing is unpickled).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from raydlrm.sharding.planner.comm_samples import CommCostModel, CommCostNet
from raydlrm.sharding.planner.learned_cost.features import NUM_FEATURES, CostModelError, TableStats
from raydlrm.sharding.planner.measure import machine_description

__all__ = ["LearnedCostModel", "SetCostNet", "padded_features"]

logger = logging.getLogger(__name__)

_HIDDEN, _LATENT, _HEAD = 128, 32, 64


class SetCostNet(nn.Module):
    """A shard's log time from its tables' normalised features: a per-table MLP summed over the
    tables, then a head. ``forward(features, mask)``: ``(S, T, F)`` features of ``S`` shards
    padded to ``T`` tables, ``(S, T)`` mask of the real ones -> ``(S,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Sequential(
            nn.Linear(NUM_FEATURES, _HIDDEN), nn.ReLU(), nn.Linear(_HIDDEN, _LATENT), nn.ReLU()
        )
        self.head = nn.Sequential(nn.Linear(_LATENT, _HEAD), nn.ReLU(), nn.Linear(_HEAD, 1))

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        latent = (self.table(features) * mask.unsqueeze(-1)).sum(dim=1)
        return self.head(latent).squeeze(-1)


@dataclass
class LearnedCostModel:
    """A trained :class:`SetCostNet` with what it needs to predict and to be trusted."""

    net: SetCostNet
    mean: list[float]
    std: list[float]
    kernel: str
    batch_size: int
    machine: str
    feature_min: list[float]
    feature_max: list[float]
    report: dict[str, float] = field(default_factory=dict)
    """Held-out errors (``neural_mape``, ``analytic_mape``), sample counts and the most tables
    of a training set (``max_set_tables``)."""
    comm: CommCostModel | None = None
    """The all-to-all transfer model, when all-to-all samples were collected."""
    device: str = "cpu"
    """Where its samples' tables were looked up: ``cpu`` or ``cuda`` (GPU workers)."""

    def latents(self, tables: Sequence[Sequence[float]]) -> np.ndarray:
        """The per-table MLP's outputs ``(T, 32)`` of tables given as their features: a shard's
        predicted time is :meth:`head_seconds` of the sum of its tables' latents."""
        features = (torch.tensor(np.asarray(tables, dtype=np.float32)) - self._mean()) / self._std()
        with torch.no_grad():
            return self.net.table(features).numpy().astype(np.float64)

    def head_seconds(self, sums: np.ndarray) -> np.ndarray:
        """Predicted seconds of shards from their latent sums ``(..., 32)`` (the head in numpy:
        the search calls it once a placement step)."""
        if self._head is None:
            first, last = self.net.head[0], self.net.head[2]
            self._head = tuple(
                t.detach().numpy().astype(np.float64)
                for t in (first.weight.T, first.bias, last.weight[0], last.bias)
            )
        w1, b1, w2, b2 = self._head
        return np.exp(np.maximum(sums @ w1 + b1, 0.0) @ w2 + b2)

    def warn_outside(
        self, tables: dict[str, Sequence[float]], *, world_size: int, set_sizes: Sequence[int]
    ) -> None:
        """Warns, a line each, of what this model predicts outside what it was trained on:
        tables whose rows, dim or pooling factor lie outside its training tables' (``tables``:
        name -> features), ranks holding more tables than its largest training set, and a
        world size its all-to-all model was not measured at (or no all-to-all model)."""
        labels = ("log10 rows", "dim", "pooling")
        outside = []
        for name, f in tables.items():
            for i, label in enumerate(labels):
                lo, hi = self.feature_min[i], self.feature_max[i]
                if not lo <= f[i] <= hi:
                    outside.append(f"{name} ({label} {f[i]:.3g} not in [{lo:.3g}, {hi:.3g}])")
                    break
        if outside:
            logger.warning(
                "the learned cost model was not trained on tables like %d of these: %s%s; its "
                "costs of them are extrapolations",
                len(outside),
                ", ".join(outside[:3]),
                ", ..." if len(outside) > 3 else "",
            )
        largest = int(self.report.get("max_set_tables", 0))
        if largest and max(set_sizes, default=0) > largest:
            logger.warning(
                "a rank holds %d tables, the learned cost model's training sets at most %d: "
                "its costs of such ranks are extrapolations (collect samples with more tables)",
                max(set_sizes),
                largest,
            )
        if world_size > 1 and self.comm is None:
            logger.warning(
                "the learned cost model has no all-to-all samples: transfer is costed "
                "analytically (raydlrm plan --collect N with scaling.num_workers > 1)"
            )
        elif world_size > 1 and world_size not in self.comm.world_sizes:
            logger.warning(
                "the learned all-to-all model was measured on %s ranks, the job has %d: its "
                "transfer costs are extrapolations",
                self.comm.world_sizes,
                world_size,
            )

    def _mean(self) -> torch.Tensor:
        return torch.tensor(self.mean, dtype=torch.float32)

    def _std(self) -> torch.Tensor:
        return torch.tensor(self.std, dtype=torch.float32)

    def __post_init__(self) -> None:
        self._head: tuple[np.ndarray, ...] | None = None

    def predict(self, shards: Sequence[Sequence[TableStats]]) -> list[float]:
        """Predicted fused forward + backward seconds of each shard (a set of tables; an empty
        set costs nothing)."""
        return self.predict_features([[t.features() for t in shard] for shard in shards])

    def predict_features(self, shards: Sequence[Sequence[Sequence[float]]]) -> list[float]:
        """:meth:`predict` of shards given as their tables' features."""
        out = [0.0] * len(shards)
        nonempty = [i for i, s in enumerate(shards) if len(s)]
        if not nonempty:
            return out
        features, mask = padded_features(
            [[list(t) for t in shards[i]] for i in nonempty], self._mean(), self._std()
        )
        with torch.no_grad():
            predicted = torch.exp(self.net(features, mask)).tolist()
        for i, value in zip(nonempty, predicted, strict=True):
            out[i] = value
        return out

    def save(self, path: str | Path) -> Path:
        """Writes ``<path>`` (JSON: everything but the weights) and ``<path>.safetensors``."""
        from safetensors.torch import save_file

        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = dict(self.net.state_dict())
        meta = {f.name: getattr(self, f.name) for f in fields(self)}
        del meta["net"], meta["comm"]
        if self.comm is not None:
            tensors.update({f"comm.{k}": v for k, v in self.comm.net.state_dict().items()})
            meta["comm"] = self.comm.meta()
        save_file({k: v.contiguous() for k, v in tensors.items()}, _weights(path))
        path.write_text(json.dumps({"format": "raydlrm-learned-cost-1", **meta}, indent=2))
        return path

    @classmethod
    def load(
        cls, path: str | Path, *, kernel: str | None = None, device: str | None = None
    ) -> LearnedCostModel:
        """A model saved by :meth:`save`.

        Raises:
            CostModelError: missing or malformed files, or (``kernel`` / ``device`` given) a
                model trained for another kernel or device, naming the file.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path).expanduser()
        if not path.is_file() or not _weights(path).is_file():
            raise CostModelError(
                f"no learned cost model at {path}: run raydlrm plan --train-cost-model"
            )
        try:
            meta = json.loads(path.read_text())
            if meta.pop("format", None) != "raydlrm-learned-cost-1":
                raise ValueError("not a raydlrm learned cost model")
            tensors = load_file(str(_weights(path)))
            net = SetCostNet()
            net.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("comm.")})
            comm_meta = meta.pop("comm", None)
            comm = None
            if comm_meta is not None:
                comm_net = CommCostNet()
                comm_net.load_state_dict(
                    {k[5:]: v for k, v in tensors.items() if k.startswith("comm.")}
                )
                comm = CommCostModel(net=comm_net.eval(), **comm_meta)
            model = cls(net=net.eval(), comm=comm, **meta)
        except SafetensorError as exc:
            raise CostModelError(
                f"learned cost model {path}: its weights {_weights(path)} are damaged ({exc})"
            ) from None
        except (ValueError, TypeError, RuntimeError, KeyError, OSError) as exc:
            raise CostModelError(f"learned cost model {path} is malformed: {exc}") from None
        _check_fits(model, path, kernel=kernel, device=device)
        return model


def _check_fits(
    model: LearnedCostModel, path: Path, *, kernel: str | None, device: str | None
) -> None:
    """Refuses a model of another kernel or device than the job's (given), naming ``path``;
    warns of one measured on another machine."""
    if kernel is not None and model.kernel != kernel:
        raise CostModelError(
            f"learned cost model {path} was trained for the {model.kernel} kernel, the job "
            f"uses {kernel}: collect samples and train again"
        )
    if device is not None and model.device != device:
        raise CostModelError(
            f"learned cost model {path} was measured on {model.device}, the job's tables "
            f"are on {device} (scaling.use_gpu): collect samples there and train again"
        )
    if model.device == "cuda" and not torch.cuda.is_available():
        return  # a GPU job planned where there is no GPU: nothing here to compare
    here = machine_description(model.device)
    if model.machine != here:
        logger.warning(
            "learned cost model %s was measured on another machine (%s; this one: %s): "
            "its costs may not hold here",
            path,
            model.machine,
            here,
        )


def _weights(path: Path) -> Path:
    return path.with_name(path.name + ".safetensors")


def padded_features(
    shards: list[list[list[float]]], mean: torch.Tensor, std: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in shards)
    features = torch.zeros(len(shards), width, NUM_FEATURES)
    mask = torch.zeros(len(shards), width)
    for i, shard in enumerate(shards):
        if shard:
            features[i, : len(shard)] = (torch.tensor(shard) - mean) / std
            mask[i, : len(shard)] = 1.0
    return features, mask
