"""Collectives of the sharded embedding collection.

Plain all-to-alls move the sparse input (lengths, ids, per-id weights) and, in
:mod:`raydlrm.sharding._output_dist`, the pooled output and its gradient. :class:`CommBytes`
counts the bytes sent to other ranks from the shapes alone (no extra synchronization).

All functions take an optional process group; ``None`` means torch.distributed's default group.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "CommBytes",
    "all_gather_ints",
    "all_to_all",
    "rank_and_world_size",
]


def rank_and_world_size(pg: ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``pg`` and the group's size; ``(0, 1)`` without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def all_to_all(
    tensor: torch.Tensor,
    *,
    input_splits: list[int],
    output_splits: list[int],
    pg: ProcessGroup | None,
    async_op: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dist.Work]:
    """All-to-all of a 1-D tensor: ``input_splits[r]`` elements go to rank ``r``.

    Args:
        tensor: shape ``(sum(input_splits),)``.
        input_splits: elements sent to each rank.
        output_splits: elements received from each rank.
        pg: process group.
        async_op: return at once, with the work to wait for (several exchanges then proceed
            together).

    Returns:
        Shape ``(sum(output_splits),)``: the blocks received, in source-rank order (and the
        work, with ``async_op``).
    """
    output = tensor.new_empty(sum(output_splits))
    work = dist.all_to_all_single(
        output, tensor.contiguous(), output_splits, input_splits, group=pg, async_op=async_op
    )
    return (output, work) if async_op else output


def all_gather_ints(
    values: list[int], *, device: torch.device, pg: ProcessGroup | None
) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), transposed: ``out[i][r]`` is
    rank ``r``'s ``values[i]``."""
    _, world_size = rank_and_world_size(pg)
    local = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=pg)
    return torch.stack(gathered, dim=1).tolist()


class CommBytes:
    """Cumulative bytes this rank sent to other ranks, by direction and kind.

    Directions: ``"input"`` (kinds ``lengths``, ``ids``, ``weights`` of the sparse input),
    ``"forward"`` and ``"backward"`` (kinds: the codec names of the pooled output and its
    gradient; the data-parallel gradient all-gather counts as ``fp32`` backward bytes).
    """

    def __init__(self) -> None:
        self._bytes: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))
        # A pipeline's thread counts input bytes while the step (or an evaluation) counts too.
        self._lock = threading.Lock()

    def add(self, direction: str, kind: str, num_bytes: int) -> None:
        with self._lock:
            self._bytes[direction][kind] += num_bytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        """A copy: direction -> kind -> bytes."""
        with self._lock:
            return {d: dict(kinds) for d, kinds in self._bytes.items()}
