"""Differential chains (``checkpoint.differential``, Check-N-Run): a checkpoint's place in one,
and the local directories of the chain a checkpoint needs.

A checkpoint is a full *baseline* or a *delta* holding only the embedding rows modified since
the checkpoint before it (:mod:`raydlrm.sharding.delta`; dense part, optimizer, RNG and
position whole). A delta's ``trainer_state.json`` names its chain (:class:`ChainLink`: the
checkpoints before it, baseline first, its siblings in the run storage, and the baseline's id);
:func:`open_chain` gives a checkpoint's chain as local directories, baseline first.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raydlrm.trainers.checkpoints.format import read_state_file

__all__ = ["ChainLink", "open_chain", "sibling_path"]


@dataclass
class ChainLink:
    """Where a checkpoint sits in a chain of differential checkpoints (Check-N-Run): a full
    ``baseline``, or a ``delta`` holding the embedding rows modified since the checkpoint
    before it (:mod:`raydlrm.sharding.delta`; the dense part, optimizer and data position are
    always whole).

    Attributes:
        kind: ``baseline`` or ``delta``.
        chain: the names of the checkpoints before it in its chain, baseline first (empty for
            a baseline); they are its siblings in the run storage.
        chain_id: the baseline's identity, shared by the chain (a delta of another run or
            chain is refused).
        rows: a delta's modified rows, table name -> shard-local rows of this rank.
        delta_bytes: the estimated embedding bytes of the chain's deltas so far, this one
            included (all ranks).
        baseline_bytes: the estimated embedding bytes of the chain's baseline (all ranks).
    """

    kind: str
    chain: list[str] = field(default_factory=list)
    chain_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    rows: dict[str, torch.Tensor] | None = None
    delta_bytes: float = 0.0
    baseline_bytes: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "chain": self.chain,
            "chain_id": self.chain_id,
            "delta_bytes": self.delta_bytes,
            "baseline_bytes": self.baseline_bytes,
        }


def sibling_path(root: str, name: str) -> str:
    """The checkpoint ``name`` beside the checkpoint ``root`` (a path in its run directory)."""
    return f"{root.rstrip('/').rsplit('/', 1)[0]}/{name}"


@contextmanager
def open_chain(directory: str | Path, stored: Any = None) -> Iterator[list[str]]:
    """The local directories of the chain a checkpoint is the newest point of: its baseline,
    every delta in order, then ``directory`` itself (only ``directory`` for a full checkpoint).

    Args:
        directory: the checkpoint, a local directory.
        stored: the checkpoint as stored (a Ray Train ``Checkpoint``: ``path``,
            ``filesystem``, ``as_directory()``) when ``directory`` is a local copy of a remote
            one: its chain's siblings are copied too; None: they are ``directory``'s siblings.
    """
    state = read_state_file(directory)
    names = (state.get("differential") or {}).get("chain", [])
    with ExitStack() as stack:
        members = []
        for name in names:
            if stored is None:
                sibling = Path(directory).parent / name
                if not sibling.is_dir():
                    raise FileNotFoundError(
                        f"checkpoint {directory} is a delta (differential checkpoints): the "
                        f"{name} of its chain is not beside it; give it with the checkpoints of "
                        "its run directory beside it"
                    )
                members.append(str(sibling))
            else:
                sibling = type(stored)(
                    path=sibling_path(stored.path, name), filesystem=stored.filesystem
                )
                members.append(stack.enter_context(sibling.as_directory()))
        yield [*members, str(directory)]
