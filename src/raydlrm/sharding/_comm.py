"""Collectives of the sharded embedding collection.

Plain all-to-alls move the sparse input (lengths, ids, per-id weights), which needs no gradient.
The pooled output travels through :class:`PooledAllToAll`, an autograd function whose backward
is the reverse all-to-all of the gradients. Every block it sends passes through a
:class:`PooledCodec`, so compressing the payload (fp16, bf16, int8 with scales) is a matter of
passing another codec; the default :class:`IdentityCodec` sends fp32 unchanged.

All functions take an optional process group; ``None`` means torch.distributed's default group.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "IdentityCodec",
    "LocalRows",
    "PooledAllToAll",
    "PooledCodec",
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


class PooledCodec(Protocol):
    """Encodes a block of pooled embeddings (or their gradients) into a 1-D payload.

    The payload's size must follow from the block's shape alone, so receivers know their
    all-to-all splits without an extra exchange; all blocks share the payload dtype.
    """

    def payload_numel(self, rows: int, cols: int) -> int:
        """Elements of the payload of a ``(rows, cols)`` block."""
        ...

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        """``(rows, cols)`` float block -> 1-D payload of ``payload_numel(rows, cols)``."""
        ...

    def decode(
        self, payload: torch.Tensor, *, rows: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """1-D payload -> ``(rows, cols)`` block of ``dtype``."""
        ...


class IdentityCodec:
    """Sends blocks unchanged (no compression)."""

    def payload_numel(self, rows: int, cols: int) -> int:
        return rows * cols

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        return block.reshape(-1)

    def decode(
        self, payload: torch.Tensor, *, rows: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return payload.view(rows, cols).to(dtype)


def _exchange_blocks(
    blocks: list[torch.Tensor],
    *,
    recv_shapes: list[tuple[int, int]],
    codec: PooledCodec,
    pg: ProcessGroup | None,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Sends ``blocks[r]`` to rank ``r``; returns the block of shape ``recv_shapes[s]`` from
    each rank ``s``."""
    payloads = [codec.encode(b) for b in blocks]
    received = all_to_all(
        torch.cat(payloads),
        input_splits=[p.numel() for p in payloads],
        output_splits=[codec.payload_numel(r, c) for r, c in recv_shapes],
        pg=pg,
    )
    chunks = received.split([codec.payload_numel(r, c) for r, c in recv_shapes])
    return [
        codec.decode(chunk, rows=r, cols=c, dtype=dtype)
        for chunk, (r, c) in zip(chunks, recv_shapes, strict=True)
    ]


class PooledAllToAll(torch.autograd.Function):
    """Output all-to-all of pooled embeddings, with the reverse all-to-all in backward.

    Rank ``r`` computed pooled vectors for its own features over the global batch (the
    concatenation of every rank's samples, in rank order) and sends each rank the rows of that
    rank's samples; it receives, from every rank, that rank's features for its own samples.

    Forward args:
        pooled: ``(sum(batch_sizes), D_local)``, this rank's features over the global batch.
        batch_sizes: samples of each rank (rows sent to each rank).
        dims: ``D_s`` of every rank ``s`` (columns received from each rank).
        pg: process group.
        codec: encodes each block sent, forward and backward.

    Forward returns:
        ``(batch_sizes[rank], sum(dims))``: every rank's features for this rank's samples, the
        columns grouped by source rank.

    Backward divides the gradient by the world size (gradients are averaged over ranks).
    """

    @staticmethod
    def forward(
        ctx: Any,
        pooled: torch.Tensor,
        batch_sizes: list[int],
        dims: list[int],
        pg: ProcessGroup | None,
        codec: PooledCodec,
    ) -> torch.Tensor:
        rank, _ = rank_and_world_size(pg)
        ctx.batch_sizes, ctx.dims, ctx.pg, ctx.codec = batch_sizes, dims, pg, codec
        ctx.dtype = pooled.dtype
        batch = batch_sizes[rank]
        blocks = _exchange_blocks(
            list(pooled.split(batch_sizes, dim=0)),
            recv_shapes=[(batch, d) for d in dims],
            codec=codec,
            pg=pg,
            dtype=pooled.dtype,
        )
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rank, world_size = rank_and_world_size(ctx.pg)
        local_dim = ctx.dims[rank]
        # Gradient division (as DDP does for dense parameters): each rank's loss is the mean over
        # its own samples, so the gradients of all ranks are averaged, not summed. The embedding
        # update then equals that of one process training on the global batch.
        grad = grad / world_size
        blocks = _exchange_blocks(
            list(grad.split(ctx.dims, dim=1)),
            recv_shapes=[(b, local_dim) for b in ctx.batch_sizes],
            codec=ctx.codec,
            pg=ctx.pg,
            dtype=ctx.dtype,
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

    Forward returns:
        ``(batch_sizes[rank], D)``.

    Backward divides the gradient by the world size (as :class:`PooledAllToAll`).
    """

    @staticmethod
    def forward(
        ctx: Any, pooled: torch.Tensor, batch_sizes: list[int], pg: ProcessGroup | None
    ) -> torch.Tensor:
        rank, _ = rank_and_world_size(pg)
        ctx.batch_sizes, ctx.pg = batch_sizes, pg
        start = sum(batch_sizes[:rank])
        return pooled[start : start + batch_sizes[rank]]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _, world_size = rank_and_world_size(ctx.pg)
        dim = grad.shape[1]
        payload = (grad / world_size).reshape(-1)
        gathered = all_to_all(
            payload.repeat(world_size),
            input_splits=[payload.numel()] * world_size,
            output_splits=[b * dim for b in ctx.batch_sizes],
            pg=ctx.pg,
        )
        return gathered.view(-1, dim), None, None
