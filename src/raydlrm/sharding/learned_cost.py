"""A learned compute cost model of a rank's embedding tables (NeuroShard, Zha et al., MLSys 2023).

The analytic cost model (:mod:`raydlrm.sharding.cost`) charges a rank the sum of its tables'
times. A fused kernel's time is not that sum: tables share one launch, one sort of the ids and
one backward pass, and how many distinct rows a batch touches (the access distribution) decides
how much of them the caches serve. NeuroShard learns the cost of a *set* of tables instead:

* each table is a vector of :data:`NUM_FEATURES` features (:class:`TableStats`): log10 of its
  rows, its dim, its mean pooling factor (ids per bag) and a :data:`HISTOGRAM_BINS`-bin
  histogram of how often each distinct index of a batch is looked up (bin ``b``: the fraction of
  distinct indices looked up ``2^b`` to ``2^(b+1) - 1`` times; the last bin holds the rest);
* :class:`SetCostNet`: a per-table MLP (features -> 128 -> 32) **summed over the tables of a
  shard** (so the prediction does not depend on their order), then a head (32 -> 64 -> 1)
  predicting the log of the fused forward + backward time of the shard's tables;
* trained (:func:`train_cost_model`) on measured samples (:func:`collect_samples`: random sets
  of 1-15 synthetic tables whose rows, dims, pooling factors and access skew span the ranges
  below, each timed with the job's kernel on this machine), Adam on the squared error of the log
  time, features z-normalised with the training set's mean and deviation.

Samples are Parquet (one row per measured set: the tables' features, flattened, the seconds,
kernel, batch size, device -- ``cpu``, or ``cuda`` for GPU workers -- and machine); a trained
model is a safetensors file of its weights plus a JSON file of everything else (normalisation,
kernel, device, machine, the features' ranges, held-out errors): nothing is unpickled.
:func:`train_cost_model` reports the held-out mean absolute percentage error of the learned
model beside that of the analytic model's form (a sum of the tables' bytes looked up over a
throughput, plus a constant, fitted to the same training samples), so the two are compared on
the same sets.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from raydlrm.sharding.comm_samples import CommCostModel, CommCostNet, train_comm_model
from raydlrm.sharding.measure import check_device, machine_description, mape, synchronize

__all__ = [
    "HISTOGRAM_BINS",
    "NUM_FEATURES",
    "CostModelError",
    "LearnedCostModel",
    "SetCostNet",
    "SyntheticTable",
    "TableStats",
    "access_histogram",
    "collect_samples",
    "draw_ids",
    "fit_analytic",
    "histogram_of_counts",
    "load_samples",
    "sample_sets",
    "save_samples",
    "stored_samples",
    "time_tables",
    "train_cost_model",
]

logger = logging.getLogger(__name__)

HISTOGRAM_BINS = 17
NUM_FEATURES = 3 + HISTOGRAM_BINS
_HIDDEN, _LATENT, _HEAD = 128, 32, 64
_SAMPLE_COLUMNS = (
    "num_tables",
    "features",
    "seconds",
    "kernel",
    "batch_size",
    "device",
    "machine",
)
_DIMS = tuple(range(4, 132, 4))
"""Dims of the synthetic tables: multiples of 4 from 4 to 128 (what the kernels vectorise)."""


class CostModelError(ValueError):
    """Cost samples or a learned model that cannot be used (missing, another kernel or machine,
    malformed), naming the file and what is wrong."""


@dataclass(frozen=True)
class TableStats:
    """What the learned model knows of a table: its shape and how a batch looks it up."""

    rows: int
    dim: int
    pooling: float
    """Mean ids per bag."""
    histogram: tuple[float, ...]
    """:func:`access_histogram` of a batch's ids."""

    def features(self) -> list[float]:
        """The table's :data:`NUM_FEATURES` features (before normalisation)."""
        return [math.log10(max(self.rows, 1)), float(self.dim), self.pooling, *self.histogram]

    @classmethod
    def of_batch(cls, *, rows: int, dim: int, ids: np.ndarray, bags: int) -> TableStats:
        """The statistics of one batch of ``bags`` bags whose ids are ``ids``."""
        return cls(rows, dim, len(ids) / max(bags, 1), access_histogram(ids))

    @classmethod
    def uniform(cls, *, rows: int, dim: int, pooling: float, bags: int) -> TableStats:
        """The statistics of ``bags`` bags of ``pooling`` ids each drawn uniformly from
        ``rows`` rows (what the planner assumes of a table the data says nothing of)."""
        ids = np.random.default_rng(0).integers(0, rows, size=max(1, round(bags * pooling)))
        return cls(rows, dim, pooling, access_histogram(ids))


def access_histogram(ids: np.ndarray) -> tuple[float, ...]:
    """Fractions of a batch's distinct ids by how often each is looked up: bin ``b`` holds
    those looked up ``2^b`` to ``2^(b+1) - 1`` times (the last bin: ``2^16`` or more). All
    zeros for an empty batch."""
    if len(ids) == 0:
        return (0.0,) * HISTOGRAM_BINS
    return histogram_of_counts(np.unique(ids, return_counts=True)[1])


def histogram_of_counts(counts: np.ndarray) -> tuple[float, ...]:
    """:func:`access_histogram` of the look-up counts of a batch's distinct ids."""
    counts = np.asarray(counts)
    if len(counts) == 0:
        return (0.0,) * HISTOGRAM_BINS
    bins = np.minimum(np.log2(counts).astype(np.int64), HISTOGRAM_BINS - 1)
    hist = np.bincount(bins, minlength=HISTOGRAM_BINS) / len(counts)
    return tuple(float(v) for v in hist)


# --- collection -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticTable:
    """A table of the synthetic family the samples (and the sharding benchmark) draw."""

    rows: int
    dim: int
    pooling: float
    skew: float
    """Zipf exponent of the ids (0: uniform)."""


def _random_table(rng: np.random.Generator, *, max_rows: int) -> SyntheticTable:
    """Rows log-uniform in [10^3, max_rows], a dim in :data:`_DIMS`, a pooling factor
    log-uniform in [1, 100], and access skew uniform in [0, 1.2] (uniform to heavy power law)."""
    rows = int(10 ** rng.uniform(3, math.log10(max(max_rows, 1001))))
    dim = int(rng.choice(_DIMS))
    pooling = float(10 ** rng.uniform(0, 2))
    return SyntheticTable(rows, dim, pooling, float(rng.uniform(0.0, 1.2)))


def _random_set(
    rng: np.random.Generator, *, max_tables: int, max_rows: int, max_bytes: int
) -> list[SyntheticTable]:
    """1 to ``max_tables`` random tables, fewer if the next would take the set's weights and
    row-wise state past ``max_bytes``."""
    count = int(rng.integers(1, max_tables + 1))
    tables: list[SyntheticTable] = []
    used = 0
    while len(tables) < count:
        table = _random_table(rng, max_rows=max_rows)
        size = table.rows * (table.dim + 1) * 4
        if used + size <= max_bytes:
            tables.append(table)
            used += size
        elif tables:
            break
    return tables


def draw_ids(
    rng: np.random.Generator, table: SyntheticTable, bags: int
) -> tuple[np.ndarray, np.ndarray]:
    """One batch of ``bags`` bags of a table: (ids, lengths); lengths 1 + Poisson(pooling - 1),
    ids Zipf-ranked rows scattered over the table (a hash of the rank)."""
    from raydlrm._sampling import zipf_ranks

    lengths = 1 + rng.poisson(max(table.pooling - 1.0, 0.0), size=bags)
    total = int(lengths.sum())
    if table.skew < 1e-3:
        ranks = rng.integers(0, table.rows, size=total)
    else:
        ranks = zipf_ranks(rng, size=total, cardinality=table.rows, s=table.skew)
    ids = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(table.rows)
    return ids.astype(np.int64), lengths


def time_tables(
    tables: Sequence[Any],
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    kernel: str,
    repeats: int,
    device: str = "cpu",
) -> float:
    """Median seconds of a fused TBE forward + backward (row-wise Adagrad, fp32) of ``tables``
    (anything with ``rows`` and ``dim``) on ``device`` looking up ``batches`` (ids and bag
    lengths, one per table), after one warm-up (on a GPU: until its kernels finish)."""
    from raydlrm.sharding.calibration import timed_tbe
    from raydlrm.sharding.kernel import TableSpec

    tbe = timed_tbe(kernel, [TableSpec(t.rows, t.dim) for t in tables], device=device)
    indices = torch.from_numpy(np.concatenate([ids for ids, _ in batches])).to(device)
    lengths = np.concatenate([lengths for _, lengths in batches])
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    offsets = offsets.to(device)
    times = []
    synchronize(device)
    for i in range(repeats + 1):
        start = time.perf_counter()
        tbe(indices, offsets).sum().backward()
        synchronize(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def collect_samples(
    n: int,
    *,
    kernel: str = "auto",
    batch_size: int = 1024,
    seed: int = 0,
    max_tables: int = 15,
    max_rows: int = 2_000_000,
    max_bytes: int = 1 << 30,
    repeats: int = 5,
    progress: Callable[[int, int], None] | None = None,
    device: str = "cpu",
) -> pa.Table:
    """Measures ``n`` random sets of synthetic tables (1 to ``max_tables`` each, at most
    ``max_bytes`` of weights and state a set) with the kernel ``kernel`` resolves to, on this
    machine's ``device`` (``cpu``, or ``cuda``: the tables in GPU memory, as GPU workers hold
    them): each set's fused forward + backward seconds over one batch of ``batch_size`` bags
    per table.

    Returns:
        One row per set: ``num_tables``, ``features`` (the tables' :class:`TableStats`
        features, flattened), ``seconds``, ``kernel``, ``batch_size``, ``device``,
        ``machine``.
    """
    from raydlrm.sharding.kernel import resolve_kernel

    smallest = 1000 * (min(_DIMS) + 1) * 4  # the smallest table a set can draw
    if max_bytes < smallest:
        raise ValueError(f"max_bytes {max_bytes} is below the smallest table's {smallest}")
    check_device(device)
    resolved = resolve_kernel(kernel)
    rng = np.random.default_rng(seed)
    machine = machine_description(device)
    rows: dict[str, list[Any]] = {"num_tables": [], "features": [], "seconds": []}
    for i in range(n):
        tables = _random_set(rng, max_tables=max_tables, max_rows=max_rows, max_bytes=max_bytes)
        batches = [draw_ids(rng, t, batch_size) for t in tables]
        stats = [
            TableStats.of_batch(rows=t.rows, dim=t.dim, ids=ids, bags=batch_size)
            for t, (ids, _) in zip(tables, batches, strict=True)
        ]
        seconds = time_tables(tables, batches, kernel=resolved, repeats=repeats, device=device)
        rows["num_tables"].append(len(tables))
        rows["features"].append([v for s in stats for v in s.features()])
        rows["seconds"].append(seconds)
        if progress is not None:
            progress(i + 1, n)
    size = len(rows["seconds"])
    return pa.table(
        {
            **rows,
            "kernel": [resolved] * size,
            "batch_size": [batch_size] * size,
            "device": [device] * size,
            "machine": [machine] * size,
        }
    )


def _store_prefix(kernel: str, batch_size: int, device: str) -> str:
    """The name of a sample file of the store, up to its time: ``<kernel>-b<batch>`` for CPU
    samples, ``<kernel>-<device>-b<batch>`` for others."""
    return f"{kernel}-b{batch_size}" if device == "cpu" else f"{kernel}-{device}-b{batch_size}"


def save_samples(samples: pa.Table, directory: str | Path) -> Path:
    """Adds measured samples to the store ``directory`` (``sharding.cost_samples_path``): a
    Parquet file named by their kernel, device, batch size and the time; returns it."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    first = {c: samples.column(c)[0].as_py() for c in ("kernel", "batch_size", "device")}
    prefix = _store_prefix(first["kernel"], first["batch_size"], first["device"])
    path = directory / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.parquet"
    pq.write_table(samples, path)
    return path


def stored_samples(
    directory: str | Path, *, kernel: str, batch_size: int, device: str = "cpu"
) -> pa.Table:
    """Every sample of the store ``directory`` measured with ``kernel`` at ``batch_size`` on
    ``device``.

    Raises:
        CostModelError: there are none, naming the store; or a file is malformed.
    """
    directory = Path(directory).expanduser()
    files = sorted(directory.glob(f"{_store_prefix(kernel, batch_size, device)}-*.parquet"))
    if not files:
        raise CostModelError(
            f"no cost samples of the {kernel} kernel on {device} at batch size {batch_size} "
            f"in {directory}: run raydlrm plan --collect N first"
        )
    return load_samples(files)


def _with_device(samples: pa.Table) -> pa.Table:
    """``samples`` with a ``device`` column: those measured before GPU measurements were
    possible have none, and are CPU samples."""
    if "device" in samples.column_names:
        return samples
    return samples.append_column("device", pa.array(["cpu"] * samples.num_rows))


def load_samples(paths: Sequence[str | Path]) -> pa.Table:
    """The cost samples of one or more Parquet files (as :func:`collect_samples` wrote them).

    Raises:
        CostModelError: a file is missing or lacks a column, naming it.
    """
    if not paths:
        raise CostModelError("no cost samples: run raydlrm plan --collect N first")
    tables = []
    for path in paths:
        if not Path(path).is_file():
            raise CostModelError(f"cost samples {path} do not exist: run raydlrm plan --collect N")
        table = _with_device(pq.read_table(path))
        missing = set(_SAMPLE_COLUMNS) - set(table.column_names)
        if missing:
            raise CostModelError(f"cost samples {path} lack the columns {sorted(missing)}")
        tables.append(table.select(list(_SAMPLE_COLUMNS)))
    return pa.concat_tables(tables)


# --- the model ---------------------------------------------------------------------------------


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
        features, mask = _padded(
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


def _padded(
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


def sample_sets(samples: pa.Table) -> list[list[list[float]]]:
    """Each sample's tables' features (:meth:`TableStats.features`)."""
    out = []
    for count, flat in zip(
        samples.column("num_tables").to_pylist(),
        samples.column("features").to_pylist(),
        strict=True,
    ):
        out.append([flat[i * NUM_FEATURES : (i + 1) * NUM_FEATURES] for i in range(count)])
    return out


def fit_analytic(
    sets: list[list[list[float]]], seconds: np.ndarray
) -> Callable[[list[list[list[float]]]], np.ndarray]:
    """The analytic model's form fitted to the samples: ``seconds = c + bytes / rate``, bytes
    the fp32 rows a step reads (the tables' pooling x dim x 4, per bag; the batch is the same
    for all samples), by least squares on the relative error (weights ``1 / seconds``: the
    fit the percentage error is judged by)."""

    def volume(batch: list[list[list[float]]]) -> np.ndarray:
        return np.array([sum(t[2] * t[1] * 4 for t in tables) for tables in batch])

    slope, intercept = np.polyfit(volume(sets), seconds, 1, w=1.0 / seconds)
    slope, intercept = max(float(slope), 1e-15), max(float(intercept), 0.0)
    return lambda batch: intercept + slope * volume(batch)


def _fit(
    features: torch.Tensor,
    mask: torch.Tensor,
    target: torch.Tensor,
    *,
    epochs: int,
    learning_rate: float,
) -> SetCostNet:
    """A :class:`SetCostNet` fitted to the log times ``target`` (Adam, full batch: a few
    thousand sets at most)."""
    net = SetCostNet()
    optimizer = torch.optim.Adam(net.parameters(), lr=learning_rate)
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = torch.mean((net(features, mask) - target) ** 2)
        loss.backward()
        optimizer.step()
    return net


def _check_trainable(samples: pa.Table) -> None:
    if samples.num_rows < 10:
        raise CostModelError(
            f"{samples.num_rows} cost samples are too few to train on: collect at least 10 "
            "(hundreds for a useful model)"
        )
    # A model records one of each, and is refused where it does not match (a machine's
    # samples mixed with another's would be predicted as this one's).
    for column in ("kernel", "batch_size", "device", "machine"):
        values = set(samples.column(column).to_pylist())
        if len(values) > 1:
            raise CostModelError(
                f"cost samples of several {column}s {sorted(values)}: train one each"
            )


def train_cost_model(
    samples: pa.Table,
    *,
    comm_samples: pa.Table | None = None,
    epochs: int = 1000,
    held_out: float = 0.2,
    seed: int = 0,
    learning_rate: float = 3e-3,
) -> LearnedCostModel:
    """Trains a :class:`LearnedCostModel` on measured samples, keeping ``held_out`` of them
    (at random; 0: none) to report its error and the analytic form's on the same sets; and,
    given ``comm_samples`` (:func:`~raydlrm.sharding.comm_samples.collect_comm_samples`), its
    all-to-all model (:func:`~raydlrm.sharding.comm_samples.train_comm_model`).

    Raises:
        CostModelError: fewer than 10 samples, or samples of more than one kernel, batch size,
            device or machine.
    """
    samples = _with_device(samples)
    _check_trainable(samples)
    torch.manual_seed(seed)
    sets = sample_sets(samples)
    seconds = np.asarray(samples.column("seconds").to_pylist(), dtype=np.float64)
    order = np.random.default_rng(seed).permutation(len(sets))
    cut = max(1, round(len(sets) * held_out)) if held_out > 0 else 0
    test, train = order[:cut], order[cut:]
    rows = np.array([t for i in train for t in sets[i]], dtype=np.float64)
    mean, std = rows.mean(axis=0), np.maximum(rows.std(axis=0), 1e-6)
    features, mask = _padded(
        [sets[i] for i in train],
        torch.tensor(mean, dtype=torch.float32),
        torch.tensor(std, dtype=torch.float32),
    )
    target = torch.tensor(np.log(seconds[train]), dtype=torch.float32)
    net = _fit(features, mask, target, epochs=epochs, learning_rate=learning_rate)
    first = {c: samples.column(c)[0].as_py() for c in ("kernel", "batch_size", "device", "machine")}
    model = LearnedCostModel(
        net=net.eval(),
        mean=mean.tolist(),
        std=std.tolist(),
        **first,
        feature_min=rows.min(axis=0).tolist(),  # the range the model was trained on
        feature_max=rows.max(axis=0).tolist(),
    )
    model.report = {
        "train_samples": float(len(train)),
        "held_out_samples": float(len(test)),
        "max_set_tables": float(max(len(sets[i]) for i in train)),
    }
    if comm_samples is not None and comm_samples.num_rows:
        model.comm = train_comm_model(
            comm_samples, batch_size=model.batch_size, epochs=epochs, held_out=held_out, seed=seed
        )
        model.report.update(model.comm.report)
    if len(test):
        held = [sets[i] for i in test]
        analytic = fit_analytic([sets[i] for i in train], seconds[train])
        model.report["neural_mape"] = mape(np.array(model.predict_features(held)), seconds[test])
        model.report["analytic_mape"] = mape(analytic(held), seconds[test])
    return model
