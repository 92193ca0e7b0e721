"""Collectives of the sharded embedding collection.

Plain all-to-alls move the sparse input (lengths, ids, per-id weights), which needs no gradient.
The pooled output travels through :class:`PooledAllToAll`, an autograd function whose backward
is the reverse all-to-all of the gradients. Every block it sends, forward and backward, is
encoded to bytes by the :class:`~raydlrm.sharding.codecs.ColumnBlockCodec` of the rank whose
columns it holds (compressed communication, :mod:`raydlrm.sharding.codecs`). :class:`CommBytes`
counts the bytes sent to other ranks from the shapes alone (no extra synchronization).

All functions take an optional process group; ``None`` means torch.distributed's default group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from raydlrm.sharding.codecs import ColumnBlockCodec

__all__ = [
    "CommBytes",
    "LocalRows",
    "PooledAllToAll",
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
) -> torch.Tensor:
    """All-to-all of a 1-D tensor: ``input_splits[r]`` elements go to rank ``r``.

    Args:
        tensor: shape ``(sum(input_splits),)``.
        input_splits: elements sent to each rank.
        output_splits: elements received from each rank.
        pg: process group.

    Returns:
        Shape ``(sum(output_splits),)``: the blocks received, in source-rank order.
    """
    output = tensor.new_empty(sum(output_splits))
    dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits, group=pg)
    return output


def all_gather_ints(value: int, *, device: torch.device, pg: ProcessGroup | None) -> list[int]:
    """Every rank's ``value``, in rank order."""
    _, world_size = rank_and_world_size(pg)
    local = torch.tensor([value], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=pg)
    return torch.cat(gathered).tolist()


class CommBytes:
    """Cumulative bytes this rank sent to other ranks, by direction and kind.

    Directions: ``"input"`` (kinds ``lengths``, ``ids``, ``weights`` of the sparse input),
    ``"forward"`` and ``"backward"`` (kinds: the codec names of the pooled output and its
    gradient; the data-parallel gradient all-gather counts as ``fp32`` backward bytes).
    """

    def __init__(self) -> None:
        self._bytes: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, direction: str, kind: str, num_bytes: int) -> None:
        self._bytes[direction][kind] += num_bytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        """A copy: direction -> kind -> bytes."""
        return {d: dict(kinds) for d, kinds in self._bytes.items()}


def _exchange_blocks(
    blocks: list[torch.Tensor],
    *,
    send_codecs: list[ColumnBlockCodec],
    recv_codecs: list[ColumnBlockCodec],
    recv_rows: list[int],
    pg: ProcessGroup | None,
    dtype: torch.dtype,
    counter: tuple[CommBytes, str],
) -> list[torch.Tensor]:
    """Sends ``blocks[r]``, encoded by ``send_codecs[r]``, to rank ``r``; returns the
    ``recv_rows[s]``-row block from each rank ``s``, decoded by ``recv_codecs[s]``."""
    rank, _ = rank_and_world_size(pg)
    payloads = [c.encode(b) for c, b in zip(send_codecs, blocks, strict=True)]
    comm_bytes, direction = counter
    for r, (codec, block) in enumerate(zip(send_codecs, blocks, strict=True)):
        if r != rank:
            for name, num_bytes in codec.bytes_by_codec(block.shape[0]).items():
                comm_bytes.add(direction, name, num_bytes)
    recv_bytes = [c.payload_bytes(n) for c, n in zip(recv_codecs, recv_rows, strict=True)]
    received = all_to_all(
        torch.cat(payloads),
        input_splits=[p.numel() for p in payloads],
        output_splits=recv_bytes,
        pg=pg,
    )
    return [
        codec.decode(chunk, rows=n, dtype=dtype)
        for codec, chunk, n in zip(recv_codecs, received.split(recv_bytes), recv_rows, strict=True)
    ]


class PooledAllToAll(torch.autograd.Function):
    """Output all-to-all of pooled embeddings, with the reverse all-to-all in backward.

    Rank ``r`` computed pooled vectors for its own features over the global batch (the
    concatenation of every rank's samples, in rank order) and sends each rank the rows of that
    rank's samples; it receives, from every rank, that rank's features for its own samples.

    Forward args:
        pooled: ``(sum(batch_sizes), D_local)``, this rank's features over the global batch.
        batch_sizes: samples of each rank (rows sent to each rank).
        codecs: the codec of the columns of every rank ``s`` (``D_s = codecs[s].cols``
            columns); it encodes ``s``'s blocks, forward and backward.
        pg: process group.
        comm_bytes: counts the bytes sent.

    Forward returns:
        ``(batch_sizes[rank], sum(D_s))``: every rank's features for this rank's samples, the
        columns grouped by source rank.

    Backward divides the gradient by the world size (gradients are averaged over ranks).
    """

    @staticmethod
    def forward(
        ctx: Any,
        pooled: torch.Tensor,
        batch_sizes: list[int],
        codecs: list[ColumnBlockCodec],
        pg: ProcessGroup | None,
        comm_bytes: CommBytes,
    ) -> torch.Tensor:
        rank, world_size = rank_and_world_size(pg)
        ctx.batch_sizes, ctx.codecs, ctx.pg, ctx.comm_bytes = batch_sizes, codecs, pg, comm_bytes
        ctx.dtype = pooled.dtype
        blocks = _exchange_blocks(
            list(pooled.split(batch_sizes, dim=0)),
            send_codecs=[codecs[rank]] * world_size,
            recv_codecs=codecs,
            recv_rows=[batch_sizes[rank]] * world_size,
            pg=pg,
            dtype=pooled.dtype,
            counter=(comm_bytes, "forward"),
        )
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rank, world_size = rank_and_world_size(ctx.pg)
        # Gradient division (as DDP does for dense parameters): each rank's loss is the mean over
        # its own samples, so the gradients of all ranks are averaged, not summed. The embedding
        # update then equals that of one process training on the global batch.
        grad = grad / world_size
        blocks = _exchange_blocks(
            list(grad.split([c.cols for c in ctx.codecs], dim=1)),
            send_codecs=ctx.codecs,
            recv_codecs=[ctx.codecs[rank]] * world_size,
            recv_rows=ctx.batch_sizes,
            pg=ctx.pg,
            dtype=ctx.dtype,
            counter=(ctx.comm_bytes, "backward"),
        )
        return torch.cat(blocks, dim=0), None, None, None, None


class LocalRows(torch.autograd.Function):
    """This rank's rows of an output every rank computed for the global batch (data-parallel
    tables), with an all-gather of the gradient rows in backward.

    Every rank looks up its replicated tables for the whole global batch; the backward gives
    every rank the gradient of the whole global batch, so every replica's fused optimizer makes
    the same update and the replicas stay identical.

    Forward args:
        pooled: ``(sum(batch_sizes), D)``, identical on every rank.
        batch_sizes: samples of each rank.
        pg: process group.
        comm_bytes: counts the (fp32, backward) bytes sent.

    Forward returns:
        ``(batch_sizes[rank], D)``.

    Backward divides the gradient by the world size (as :class:`PooledAllToAll`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        pooled: torch.Tensor,
        batch_sizes: list[int],
        pg: ProcessGroup | None,
        comm_bytes: CommBytes,
    ) -> torch.Tensor:
        rank, _ = rank_and_world_size(pg)
        ctx.batch_sizes, ctx.pg, ctx.comm_bytes = batch_sizes, pg, comm_bytes
        start = sum(batch_sizes[:rank])
        return pooled[start : start + batch_sizes[rank]]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _, world_size = rank_and_world_size(ctx.pg)
        dim = grad.shape[1]
        payload = (grad / world_size).reshape(-1)
        ctx.comm_bytes.add("backward", "fp32", payload.nbytes * (world_size - 1))
        gathered = all_to_all(
            payload.repeat(world_size),
            input_splits=[payload.numel()] * world_size,
            output_splits=[b * dim for b in ctx.batch_sizes],
            pg=ctx.pg,
        )
        return gathered.view(-1, dim), None, None, None
