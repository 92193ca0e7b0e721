"""Where the ranks are: hosts of consecutive ranks, and each rank's process groups on them.

Datacenter networks are two-level (fast links inside a host, slower ones between hosts). One
:class:`Topology` describes it for every part that cares: the planner's table-row-wise groups
(a table's rows sharded inside one host) and the towers of
:mod:`raydlrm.sharding.towers` (each looked up inside one host). Ranks are numbered host by
host, as Ray Train numbers a node's workers together: rank ``r`` is local rank
``r % ranks_per_host`` of host ``r // ranks_per_host``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Types only: the job config derives its topology here without loading torch.
    from torch.distributed import ProcessGroup

__all__ = ["Topology", "TopologyGroups", "topology_groups"]


@dataclass(frozen=True)
class Topology:
    """``num_hosts`` hosts of ``ranks_per_host`` ranks each; rank ``r`` is on host
    ``r // ranks_per_host`` (ranks are numbered host by host, as Ray Train numbers a node's
    workers together)."""

    num_hosts: int
    ranks_per_host: int

    def __post_init__(self) -> None:
        if self.num_hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(f"a topology needs at least one host and rank, got {self}")

    @classmethod
    def of(cls, world_size: int, ranks_per_host: int | None) -> Topology:
        """The topology of ``world_size`` ranks, ``ranks_per_host`` to a host (None: one host
        of them all). The one place the host count is derived.

        Raises:
            ValueError: ``ranks_per_host`` is not positive or does not divide ``world_size``.
        """
        per_host = world_size if ranks_per_host is None else ranks_per_host
        if per_host <= 0 or world_size % per_host:
            raise ValueError(
                f"{per_host} ranks per host must be positive and divide the {world_size} ranks"
            )
        return cls(world_size // per_host, per_host)

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.ranks_per_host

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def host_ranks(self, host: int) -> list[int]:
        """The ranks of ``host`` (the intra-host group, in local-index order)."""
        return [host * self.ranks_per_host + i for i in range(self.ranks_per_host)]

    def peer_ranks(self, local: int) -> list[int]:
        """The ranks of local index ``local`` on every host (a cross-host group, in host
        order)."""
        return [h * self.ranks_per_host + local for h in range(self.num_hosts)]


@dataclass(frozen=True)
class TopologyGroups:
    """This rank's place in a :class:`Topology` and its two process groups."""

    topology: Topology
    host: int
    intra: ProcessGroup | None
    """The ranks of this rank's host (their rank in it is the local index)."""
    cross: ProcessGroup | None
    """The ranks of this rank's local index on every host (their rank in it is the host)."""


def topology_groups(topology: Topology) -> TopologyGroups:
    """Creates the intra-host and cross-host process groups of ``topology`` (every rank must
    call it: each group is created on every rank, in the same order).

    Raises:
        ValueError: if the topology's world size is not torch.distributed's.
    """
    import torch.distributed as dist

    from raydlrm.sharding._comm import rank_and_world_size

    rank, world_size = rank_and_world_size(None)
    if topology.world_size != world_size:
        raise ValueError(
            f"topology of {topology.num_hosts} hosts x {topology.ranks_per_host} ranks does not "
            f"match the {world_size} ranks of the process group"
        )
    if world_size == 1:
        return TopologyGroups(topology, host=0, intra=None, cross=None)
    intra = cross = None
    for h in range(topology.num_hosts):
        group = dist.new_group(topology.host_ranks(h))
        intra = group if topology.host(rank) == h else intra
    for i in range(topology.ranks_per_host):
        group = dist.new_group(topology.peer_ranks(i))
        cross = group if rank % topology.ranks_per_host == i else cross
    return TopologyGroups(topology, host=topology.host(rank), intra=intra, cross=cross)
