"""The tower partitioner of Disaggregated Multi-Tower: features grouped into towers by how much
a trained model makes them interact, balanced by load.

DMT's towers lose nothing when the features a model combines sit in the same tower (their
interaction happens inside the tower module, before the compression); features that only add
up can be apart. Two steps:

1. :func:`interaction_strength` measures, on a short warm-up run's model and a batch, how
   much each pair of features interacts in the model's output: for samples ``b`` and a
   permutation ``p`` of the batch, the 2 x 2 contrast ``f(b) - f(b; i from p(b)) - f(b; j from
   p(b)) + f(b; i and j from p(b))`` of the logit ``f`` with feature ``i``'s and ``j``'s pooled
   embeddings taken from another sample. It is 0 for every sample when ``f`` is additive in
   the two features and grows with their interaction (the numerator of Friedman's
   H-statistic, in its permutation form); the strength is its root mean square over the
   batch. It needs only the model's dense part, so it works for every architecture.
2. :func:`partition_towers` groups the tables (a table's features stay together) into towers
   maximizing the interaction strength inside towers, with each tower's load (its lookups, or
   any per-table cost) within ``1 + slack`` of the mean: agglomerative merging by average
   linkage under the load cap, then moves out of towers over the cap (losing the least
   strength), then single moves between towers while they raise the strength kept inside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = ["inside_strength", "interaction_strength", "partition_towers"]


@torch.no_grad()
def interaction_strength(
    dense: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dense_inputs: torch.Tensor,
    pooled: torch.Tensor,
    dims: Sequence[int],
    *,
    seed: int = 0,
) -> np.ndarray:
    """Pairwise interaction strength of the features in a model's output (module docstring).

    Args:
        dense: the model's dense part, ``(dense B x num_dense, pooled B x sum D_f) -> (B,)``
            logits (run in eval mode; its mode is restored after).
        dense_inputs: a batch's dense inputs.
        pooled: the batch's pooled embeddings, ``B x sum(dims)``, features side by side.
        dims: each feature's embedding width.
        seed: seeds the permutation of the batch.

    Returns:
        A symmetric ``F x F`` array, zero on the diagonal.
    """
    num = len(dims)
    bounds = np.cumsum([0, *dims]).tolist()
    # Dropout or batch statistics would make the four logits differ by chance: eval mode.
    training = [m.training for m in _modules(dense)]
    for m in _modules(dense):
        m.eval()
    perm = torch.randperm(pooled.shape[0], generator=torch.Generator().manual_seed(seed))
    moved = pooled[perm]

    def logits(features: Sequence[int]) -> torch.Tensor:
        x = pooled.clone()
        for f in features:
            x[:, bounds[f] : bounds[f + 1]] = moved[:, bounds[f] : bounds[f + 1]]
        return dense(dense_inputs, x).float()

    base = logits(())
    single = [logits((i,)) for i in range(num)]
    strength = np.zeros((num, num))
    for i in range(num):
        for j in range(i + 1, num):
            contrast = base - single[i] - single[j] + logits((i, j))
            strength[i, j] = strength[j, i] = float(contrast.square().mean().sqrt())
    for m, mode in zip(_modules(dense), training, strict=True):
        m.train(mode)
    return strength


def _modules(dense: Callable) -> list[torch.nn.Module]:
    return list(dense.modules()) if isinstance(dense, torch.nn.Module) else []


def inside_strength(strength: np.ndarray, towers: Sequence[Sequence[int]]) -> float:
    """The share of the total pairwise strength between features of the same tower."""
    total = strength[np.triu_indices_from(strength, k=1)].sum()
    kept = sum(strength[np.ix_(t, t)].sum() / 2 for t in towers)
    return float(kept / total) if total > 0 else 1.0


def partition_towers(
    strength: np.ndarray,
    *,
    units: Sequence[Sequence[int]],
    loads: Sequence[float],
    num_towers: int,
    slack: float = 0.1,
) -> list[list[int]]:
    """Groups ``units`` (each a table's feature indices) into ``num_towers`` towers.

    Args:
        strength: ``F x F`` pairwise interaction strength (:func:`interaction_strength`).
        units: the feature indices of each table (kept in one tower).
        loads: each unit's load (lookups per step, bytes, ...).
        num_towers: towers to make (at most the number of units).
        slack: a tower's load may exceed the mean by this fraction (more when one unit alone
            does).

    Returns:
        Each tower's feature indices (sorted), towers in order of their smallest feature.

    Raises:
        ValueError: fewer units than towers, or a unit's and load's counts differ.
    """
    if len(units) != len(loads):
        raise ValueError(f"{len(units)} units but {len(loads)} loads")
    if not 1 <= num_towers <= len(units):
        raise ValueError(f"cannot make {num_towers} towers of {len(units)} tables")
    unit_strength = np.array([[strength[np.ix_(a, b)].sum() for b in units] for a in units])
    cap = max(max(loads), (1 + slack) * sum(loads) / num_towers)
    groups = _merge(unit_strength, list(loads), num_towers, cap)
    groups = _balance(unit_strength, list(loads), groups, cap)
    groups = _improve(unit_strength, list(loads), groups, cap)
    towers = [sorted(f for u in g for f in units[u]) for g in groups]
    return sorted(towers, key=lambda t: t[0])


def _merge(
    strength: np.ndarray, loads: list[float], num_towers: int, cap: float
) -> list[list[int]]:
    """Average-linkage agglomeration under the load cap; when no merge fits, the two lightest
    groups merge (the cap is a target, the count of towers a must)."""
    groups = [[u] for u in range(len(loads))]
    load = list(loads)
    while len(groups) > num_towers:
        best, pair = -1.0, None
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                if load[a] + load[b] > cap:
                    continue
                link = strength[np.ix_(groups[a], groups[b])].sum()
                link /= len(groups[a]) * len(groups[b])
                if link > best:
                    best, pair = link, (a, b)
        if pair is None:
            order = sorted(range(len(groups)), key=lambda g: load[g])
            pair = tuple(sorted(order[:2]))
        a, b = pair
        groups[a] += groups.pop(b)
        load[a] += load.pop(b)
    return groups


def _link(strength: np.ndarray, unit: int, group: list[int]) -> float:
    """The strength between ``unit`` and the other units of ``group``."""
    return float(strength[unit, group].sum() - (unit in group) * strength[unit, unit])


def _balance(
    strength: np.ndarray, loads: list[float], groups: list[list[int]], cap: float
) -> list[list[int]]:
    """Moves units out of the heaviest tower over the cap, each time the move (to a tower it
    fits in) that loses the least strength, until none is over or no move fits."""
    load = [sum(loads[u] for u in g) for g in groups]
    while True:
        over = [g for g in range(len(groups)) if load[g] > cap + 1e-9 and len(groups[g]) > 1]
        if not over:
            return groups
        src = max(over, key=lambda g: load[g])
        moves = [
            (_link(strength, u, groups[dst]) - _link(strength, u, groups[src]), u, dst)
            for u in groups[src]
            for dst in range(len(groups))
            if dst != src and load[dst] + loads[u] <= cap + 1e-9
        ]
        if not moves:
            # Units too coarse for the cap (e.g. loads of 1 against a cap of 3.85): a move
            # that still lowers the heaviest tower (its unit lands below the source's load).
            moves = [
                (_link(strength, u, groups[dst]) - _link(strength, u, groups[src]), u, dst)
                for u in groups[src]
                for dst in range(len(groups))
                if dst != src and load[dst] + loads[u] < load[src] - 1e-9
            ]
        if not moves:
            return groups
        _, u, dst = max(moves)
        groups[src].remove(u)
        groups[dst].append(u)
        load[src] -= loads[u]
        load[dst] += loads[u]


def _improve(
    strength: np.ndarray, loads: list[float], groups: list[list[int]], cap: float
) -> list[list[int]]:
    """Moves single units, each to the tower it interacts with most among those it fits in,
    while that raises the strength kept inside towers (no tower is left empty)."""
    where = {u: g for g, members in enumerate(groups) for u in members}
    load = [sum(loads[u] for u in g) for g in groups]
    improved = True
    while improved:
        improved = False
        for u in range(len(loads)):
            src = where[u]
            if len(groups[src]) == 1:
                continue
            links = [_link(strength, u, g) for g in groups]
            fits = [
                g
                for g in range(len(groups))
                if g != src and links[g] > links[src] + 1e-12 and load[g] + loads[u] <= cap + 1e-9
            ]
            if not fits:
                continue
            dst = max(fits, key=lambda g: links[g])
            groups[src].remove(u)
            groups[dst].append(u)
            load[src] -= loads[u]
            load[dst] += loads[u]
            where[u] = dst
            improved = True
    return groups
