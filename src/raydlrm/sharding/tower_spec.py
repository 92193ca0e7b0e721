"""Towers as configured, without torch: :class:`Tower`, :func:`check_towers` and
:func:`model_towers` (``model.towers`` placed on hosts), which the job config checks before Ray
starts. The sharded form is :mod:`raydlrm.sharding.towers`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from raydlrm.models.config import tower_name

__all__ = ["Tower", "check_towers", "model_towers", "tower_name"]


class _Table(Protocol):
    name: str
    feature_names: tuple[str, ...]


@dataclass(frozen=True)
class Tower:
    """Features looked up together on one host.

    Attributes:
        name: the tower's name (its output's key when it has a module).
        features: the features it looks up (every feature of a table is in the same tower).
        host: the host whose ranks hold its tables and run its module.
    """

    name: str
    features: tuple[str, ...]
    host: int


def model_towers(towers: Sequence[Sequence[str]], num_hosts: int) -> list[Tower]:
    """``model.towers`` (each tower's features) as :class:`Tower` s: tower ``i`` is named
    :func:`tower_name` ``(i)`` and placed on host ``i % num_hosts``."""
    return [
        Tower(tower_name(i), tuple(features), host=i % num_hosts)
        for i, features in enumerate(towers)
    ]


def check_towers(towers: Sequence[Tower], tables: Sequence[_Table], num_hosts: int) -> None:
    """Every feature of ``tables`` in exactly one tower, every table's features in one tower,
    each tower on one of the hosts, every host with a tower.

    Raises:
        ValueError: naming the tower and the feature, table or host.
    """
    seen: dict[str, str] = {}
    for tower in towers:
        if not 0 <= tower.host < num_hosts:
            raise ValueError(f"tower {tower.name}: host {tower.host} is not in 0..{num_hosts - 1}")
        if not tower.features:
            raise ValueError(f"tower {tower.name}: no features")
        for f in tower.features:
            if seen.get(f) == tower.name:
                raise ValueError(f"tower {tower.name}: feature {f} is listed twice")
            if f in seen:
                raise ValueError(f"feature {f} is in towers {seen[f]} and {tower.name}")
            seen[f] = tower.name
    features = [f for t in tables for f in t.feature_names]
    missing = [f for f in features if f not in seen]
    if missing:
        raise ValueError(f"features {missing} are in no tower")
    unknown = [f for f in seen if f not in features]
    if unknown:
        raise ValueError(f"towers {sorted({seen[f] for f in unknown})}: unknown features {unknown}")
    for table in tables:
        owners = sorted({seen[f] for f in table.feature_names})
        if len(owners) > 1:
            raise ValueError(
                f"table {table.name} is looked up by features of towers {owners}: a table's "
                "features must be in one tower"
            )
    empty = [h for h in range(num_hosts) if not any(t.host == h for t in towers)]
    if empty:
        raise ValueError(f"hosts {empty} have no tower: every host needs one")
