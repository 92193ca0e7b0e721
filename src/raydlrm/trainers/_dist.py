"""The collectives the training loop needs beyond the model's: scalars, objects, counters.

Each works without a process group (or with a world size of 1) and then returns the local
value, so the loop reads the same in one process and on many ranks.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["all_gather_object", "all_reduce_scalar", "distributed", "sum_over_ranks", "world_size"]


def distributed() -> bool:
    """True when a process group of more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def all_reduce_scalar(
    value: float, device: torch.device, *, op: Literal["sum", "max"] = "sum"
) -> float:
    """``value`` summed (or maximized) over all ranks, in float64."""
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(t.item())


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def sum_over_ranks(local: dict[str, float], device: torch.device) -> dict[str, float]:
    """Counters summed over all ranks, by name; a name only some ranks have counts 0 on the
    others (every rank must reduce the same names in the same order: they are agreed first)."""
    if not distributed():
        return dict(local)
    names = sorted({n for names in all_gather_object(sorted(local)) for n in names})
    if not names:
        return {}
    t = torch.tensor([float(local.get(n, 0.0)) for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(names, t.tolist(), strict=True))
