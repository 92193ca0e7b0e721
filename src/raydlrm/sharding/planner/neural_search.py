"""NeuroShard's search of a sharding plan with the learned cost model (Zha et al., MLSys 2023).

The learned compute model (:class:`~raydlrm.sharding.planner.learned_cost.LearnedCostModel`) costs a
rank's set of tables as ``head(sum of the tables' latents)``; the search keeps each rank's latent
sum and evaluates the head on all ranks (and all thresholds) at once in numpy, so a placement
step is one small matrix product. A plan's predicted cost is ``max over ranks of compute +
max over ranks of the all-to-all transfer``: each rank waits in the all-to-all for the slowest
rank's lookups, then the transfer its dim sum sets (the communication model,
:class:`~raydlrm.sharding.planner.comm_samples.CommCostModel`).

* :meth:`NeuralSearch.table_wise` (**greedy grid**): pieces in order of their predicted cost
  alone, largest first, each on the rank whose predicted compute after placing it is lowest,
  among the ranks with room in memory and whose dim sum stays under a threshold (1.0x to 1.5x
  the mean dim sum a rank, 11 thresholds; when no rank is under it, any rank with room); the
  threshold whose plan has the lowest predicted cost wins.
* :meth:`NeuralSearch.column_wise` (**beam search**, width 3, at most 10 steps): from all
  tables whole, each step halves the column pieces of one table of a plan's bottleneck rank
  (the rank with the highest predicted compute plus transfer; a table is halved while its
  pieces stay multiples of 4 wide and no more than the ranks) and re-runs the greedy grid; the
  three cheapest new plans make the next beam; it stops when a step finds nothing cheaper.

A table's column pieces that land on one rank are one shard there (their widths summed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["NeuralSearch", "Piece", "SearchResult"]

THRESHOLDS = np.linspace(1.0, 1.5, 11)
BEAM_WIDTH = 3
BEAM_STEPS = 10


@dataclass(frozen=True)
class Piece:
    """A table, or one of its column pieces, to place on one rank."""

    table: int
    """Index of its table in the search's tables."""
    dim: int
    memory: int
    """Bytes of weights and optimizer state."""


@dataclass(frozen=True)
class SearchResult:
    """The chosen pieces, their ranks and the plan's predicted costs."""

    pieces: list[Piece]
    ranks: list[int]
    compute: np.ndarray
    """Predicted seconds of each rank's fused lookups (forward + backward)."""
    transfer: np.ndarray
    """Predicted seconds of each rank's forward + backward all-to-all transfer."""

    @property
    def cost(self) -> float:
        """The plan's predicted step cost: slowest lookups plus slowest transfer."""
        return float(self.compute.max() + self.transfer.max())


class NeuralSearch:
    """The searches of one planning problem.

    Args:
        latent: ``(dim -> (T, L))``: callable giving the tables' latents at a column width.
        head: the compute model's head, latent sums ``(..., L)`` -> predicted seconds ``(...)``.
        transfer: the communication model, dim sums ``(K, W)`` -> seconds ``(K, W)``.
        dims, memory: the tables' widths and bytes.
        base_latent, base_dims, room: what the ranks already hold (tables the search does not
            place): ``(W, L)`` latent sums, ``(W,)`` dim sums, and ``(W,)`` bytes still free.
    """

    def __init__(
        self,
        *,
        latent,
        head,
        transfer,
        dims: Sequence[int],
        memory: Sequence[int],
        base_latent: np.ndarray,
        base_dims: np.ndarray,
        room: np.ndarray,
    ) -> None:
        self._latent_of = latent
        self._latents: dict[int, np.ndarray] = {}
        self.head, self.transfer = head, transfer
        self.dims, self.memory = list(dims), list(memory)
        self.base_latent, self.base_dims = base_latent, base_dims.astype(np.float64)
        self.room = room.astype(np.float64)
        self.world_size = len(room)

    def _latent(self, table: int, dim: int) -> np.ndarray:
        if dim not in self._latents:
            self._latents[dim] = self._latent_of(dim)
        return self._latents[dim][table]

    def _pieces(self, splits: Sequence[int]) -> list[Piece]:
        out = []
        for t, parts in enumerate(splits):
            out += [Piece(t, self.dims[t] // parts, -(-self.memory[t] // parts))] * parts
        return out

    def table_wise(self, splits: Sequence[int] | None = None) -> SearchResult | None:
        """The greedy grid's best plan of the tables cut into ``splits[t]`` column pieces each
        (default: whole), or None if some piece fits no rank's memory at any threshold."""
        pieces = self._pieces(splits or [1] * len(self.dims))
        k, w = len(THRESHOLDS), self.world_size
        latents = np.stack([self._latent(p.table, p.dim) for p in pieces])
        alone = self.head(latents)
        order = sorted(range(len(pieces)), key=lambda i: (-alone[i], i))
        total_dims = self.base_dims.sum() + sum(p.dim for p in pieces)
        caps = THRESHOLDS[:, None] * (total_dims / w)
        sums = np.broadcast_to(self.base_latent, (k, *self.base_latent.shape)).copy()
        dims = np.broadcast_to(self.base_dims, (k, w)).copy()
        room = np.broadcast_to(self.room, (k, w)).copy()
        ranks = np.zeros((k, len(pieces)), dtype=np.int64)
        feasible = np.ones(k, dtype=bool)
        rows = np.arange(k)
        for i in order:
            piece = pieces[i]
            predicted = self.head(sums + latents[i])  # (K, W)
            fits = room >= piece.memory
            under = fits & (dims + piece.dim <= caps)
            allowed = np.where(under.any(axis=1, keepdims=True), under, fits)
            feasible &= allowed.any(axis=1)
            choice = np.argmin(np.where(allowed, predicted, np.inf), axis=1)
            ranks[:, i] = choice
            sums[rows, choice] += latents[i]
            dims[rows, choice] += piece.dim
            room[rows, choice] -= piece.memory
        if not feasible.any():
            return None
        compute = self.head(sums)
        transfer = self.transfer(dims)
        cost = np.where(feasible, compute.max(axis=1) + transfer.max(axis=1), np.inf)
        best = int(np.argmin(cost))
        return SearchResult(pieces, ranks[best].tolist(), compute[best], transfer[best])

    def column_wise(self) -> SearchResult | None:
        """The beam search's best plan over column halvings (see the module)."""
        start = [1] * len(self.dims)
        first = self.table_wise(start)
        if first is None:
            return None
        best: tuple[float, tuple[int, ...], SearchResult] = (first.cost, tuple(start), first)
        beam = [best]
        seen = {tuple(start)}
        for _ in range(BEAM_STEPS):
            found = []
            for _, splits, result in beam:
                for t in self._bottleneck_tables(result):
                    parts = splits[t] * 2
                    width = self.dims[t] // parts
                    if parts > self.world_size or width % 4 or width * parts != self.dims[t]:
                        continue
                    trial = (*splits[:t], parts, *splits[t + 1 :])
                    if trial in seen:
                        continue
                    seen.add(trial)
                    outcome = self.table_wise(trial)
                    if outcome is not None:
                        found.append((outcome.cost, trial, outcome))
            if not found:
                break
            found.sort(key=lambda f: (f[0], f[1]))
            beam = found[:BEAM_WIDTH]
            if beam[0][0] >= best[0]:
                break
            best = beam[0]
        return best[2]

    def _bottleneck_tables(self, result: SearchResult) -> list[int]:
        """The tables with a piece on the rank of the highest predicted compute plus
        transfer."""
        top = int(np.argmax(result.compute + result.transfer))
        placed = zip(result.pieces, result.ranks, strict=True)
        return sorted({p.table for p, r in placed if r == top})
