"""Helpers of the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import torch

from raydlrm.sharding.parallelize import unwrap_dense
from raydlrm.trainers.loop import Trainer
from tests._tolerance import EPS32, sum_order_tol
from tests.sharding._fixtures import gather_full_tables, gather_id_maps

MAX_TERMS = 8 * 64
"""The longest sum of the trainer tests' model (``test_loop._spec``: DLRM, 26 tables of dim 8,
MLPs [16, 8] and [16], 64 samples a step at most): a row's gradient, up to 8 ids of a list
feature in each sample (the top MLP's first layer sums 359 inputs)."""
DEPTH = 5
"""The chained sums of a forward: the bottom MLP's two layers, the interaction, the top MLP's
two (the backward's mirror them)."""


def trained_tol(expected: torch.Tensor, *, steps: int = 0) -> dict[str, float]:
    """The tolerance of two runs of the trainer tests' model that differ in summation order
    alone (another world size, plan or kernel), compared after ``steps`` training steps taken
    apart (:func:`~tests._tolerance.sum_order_tol`): a forward's :data:`DEPTH` chained sums, and
    each step a row's gradient and the update that carries it into the next forward. The
    magnitude is ``expected``'s largest value."""
    magnitude = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return sum_order_tol(MAX_TERMS, magnitude, k=DEPTH + 2 * steps)


def unsharded_state_dict(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """The full, unsharded model state on rank 0 (None elsewhere); all ranks must call. Keys
    are those of the unsharded ``RecModel``: ``embedding_bags.weights.<table>``,
    ``embedding_bags.id_maps.<table>`` (managed tables, ``(rows, 4)``), ``dense.*``.
    Every table is gathered whole onto rank 0: for small models and tests only."""
    tables = gather_full_tables(trainer.model.embedding_bags, dst=0)
    maps = gather_id_maps(trainer.model.embedding_bags)
    if trainer.rank != 0:
        return None
    state = {f"embedding_bags.weights.{name}": t.cpu() for name, t in tables.items()}
    state.update((f"embedding_bags.id_maps.{name}", m.t().contiguous()) for name, m in maps.items())
    dense = unwrap_dense(trainer.model).state_dict()
    state.update({f"dense.{k}": v.detach().cpu() for k, v in dense.items()})
    return state


def assert_losses_close(got: list[float], want: list[float], *, n_terms: int = MAX_TERMS) -> None:
    """Each step's loss of a run that differs from ``want``'s in summation order alone. To
    first order a step's update errs by its gradient's relative error, at most
    ``n_terms * EPS32`` (:data:`MAX_TERMS`: a row's gradient; where its terms share the
    gradient's scale), so step ``s``'s loss moves by that share of the loss's changes so far,
    plus its own mean's rounding: ``atol_s = n_terms * EPS32 * (|L_s| + sum_{t <= s}
    |L_t - L_{t-1}|)``. Embedding gradients summed over 2 ranks instead of averaged (SGD) move
    a loss about 7 times that."""
    assert len(got) == len(want), (got, want)
    moved = 0.0
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        moved += abs(w - want[s - 1]) if s else 0.0
        atol = n_terms * EPS32 * (abs(w) + moved)
        assert abs(g - w) <= atol, f"step {s}: loss {g} against {w}, beyond {atol:.3g}"


def auc_tol(data_dir: str | Path, *, swaps: int = 2) -> float:
    """The AUC difference of two runs whose eval logits differ by rounding: a pair of logits
    that close may swap its order, and each swap moves the AUC by ``1 / (P * N)`` (``P``
    positive and ``N`` negative eval rows); ``swaps`` of them are allowed."""
    labels = pq.read_table(Path(data_dir) / "eval", columns=["label"]).column("label")
    positives = sum(labels.to_pylist())
    return swaps / (positives * (len(labels) - positives))
