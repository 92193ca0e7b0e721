"""Training a :class:`~raydlrm.sharding.planner.learned_cost.model.LearnedCostModel` on measured
samples, and judging it on held-out sets beside the analytic model's form fitted to the same
training sets (:func:`fit_analytic`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import torch

from raydlrm.sharding.planner.comm_samples import train_comm_model
from raydlrm.sharding.planner.learned_cost.features import CostModelError
from raydlrm.sharding.planner.learned_cost.model import (
    LearnedCostModel,
    SetCostNet,
    padded_features,
)
from raydlrm.sharding.planner.learned_cost.samples import sample_sets, with_device
from raydlrm.sharding.planner.measure import mape

__all__ = ["fit_analytic", "train_cost_model"]


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
    given ``comm_samples`` (:mod:`~raydlrm.sharding.planner.comm_samples`'s
    ``collect_comm_samples``), its all-to-all model (:func:`train_comm_model`).

    Raises:
        CostModelError: fewer than 10 samples, or samples of more than one kernel, batch size,
            device or machine.
    """
    samples = with_device(samples)
    _check_trainable(samples)
    torch.manual_seed(seed)
    sets = sample_sets(samples)
    seconds = np.asarray(samples.column("seconds").to_pylist(), dtype=np.float64)
    order = np.random.default_rng(seed).permutation(len(sets))
    cut = max(1, round(len(sets) * held_out)) if held_out > 0 else 0
    test, train = order[:cut], order[cut:]
    rows = np.array([t for i in train for t in sets[i]], dtype=np.float64)
    mean, std = rows.mean(axis=0), np.maximum(rows.std(axis=0), 1e-6)
    features, mask = padded_features(
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
