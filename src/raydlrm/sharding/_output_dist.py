"""Output distribution: pooled embeddings to the ranks that own the samples, in feature order.

Rank ``r`` looked up its units for the global batch (the concatenation of every rank's samples,
in rank order). Its *sharded* units' pooled vectors go through one all-to-all: rank ``r`` sends
each rank ``t`` the rows of ``t``'s samples and receives, from every rank ``s``, ``s``'s
columns for its own samples. Its *data-parallel* (replicated) units' vectors stay local: ``r``
keeps the rows of its own samples. The output is then assembled in the collection's feature
order by copying column *runs* (:class:`ColumnRun`): contiguous columns of one received block
that land on contiguous output columns. Row-split shards' partial sums land on the same output
columns; the first run to reach a column copies, the later ones add (a reduce-scatter done as an
all-to-all plus a sum).

The backward pass runs the same in reverse: the output gradient's runs are written, divided by
the world size, straight into the send buffer of the reverse all-to-all; the received buffer is
the gradient of the pooled lookups (without a copy when the codecs are fp32). The data-parallel
columns' gradient rows are all-gathered instead, so that every replica's fused optimizer sees
the whole global batch.

Gradient division: each rank's loss is the mean over its own samples, so the gradients of all
ranks are averaged, not summed (as DDP does for dense parameters). The embedding update then
equals that of one process training on the global batch.

With fp32 codecs (no compression) the pooled output is sent without a copy and each direction
touches the data once after (forward) or before (backward) the exchange. Compressed codecs
encode each rank's block into bytes (:class:`~raydlrm.sharding.codecs.ColumnBlockCodec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from raydlrm.sharding._comm import CommBytes, all_to_all, rank_and_world_size
from raydlrm.sharding.codecs import ColumnBlockCodec

__all__ = ["ColumnRun", "OutputDist", "column_runs"]


@dataclass(frozen=True)
class ColumnRun:
    """Contiguous columns of one block that land on contiguous output columns.

    Attributes:
        block: the block holding the run: a rank ``s < world_size`` (the columns of ``s``'s
            sharded units) or ``world_size`` (this rank's replicated units).
        src: first column in the block.
        dst: first output column.
        width: number of columns.
        accumulate: add into the output (an earlier run already wrote these columns).
    """

    block: int
    src: int
    dst: int
    width: int
    accumulate: bool


def column_runs(targets: list[list[int]]) -> list[ColumnRun]:
    """The runs that place every block's columns on their output columns.

    Args:
        targets: for each block, the output column of each of its columns.

    Returns:
        Maximal runs, in block and column order.
    """
    runs: list[ColumnRun] = []
    written: set[int] = set()
    for block, columns in enumerate(targets):
        for src, dst in enumerate(columns):
            accumulate = dst in written
            written.add(dst)
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.block == block
                and last.accumulate == accumulate
                and last.src + last.width == src
                and last.dst + last.width == dst
            ):
                runs[-1] = ColumnRun(block, last.src, last.dst, last.width + 1, accumulate)
            else:
                runs.append(ColumnRun(block, src, dst, 1, accumulate))
    return runs


@dataclass
class OutputDist:
    """The static part of the output distribution of one rank (see the module docstring).

    Attributes:
        runs: column runs of the received blocks (and the replicated block) into the output.
        num_columns: output columns (sum of the features' dims).
        codecs: the codec of the sharded columns of every rank; it encodes that rank's blocks,
            forward and backward.
        pg: process group.
        comm_bytes: counts the bytes sent.
    """

    runs: list[ColumnRun]
    num_columns: int
    codecs: list[ColumnBlockCodec]
    pg: ProcessGroup | None
    comm_bytes: CommBytes

    def __call__(self, pooled: torch.Tensor, batch_sizes: list[int]) -> torch.Tensor:
        """This rank's samples' pooled embeddings in feature order.

        Args:
            pooled: ``(sum(batch_sizes), D_r + D_rep)``, this rank's units over the global
                batch: the sharded ones' ``D_r = codecs[rank].cols`` columns, then the
                replicated ones'.
            batch_sizes: samples of each rank.

        Returns:
            ``(batch_sizes[rank], num_columns)``.
        """
        return _OutputDistFn.apply(pooled, batch_sizes, self)

    @property
    def exchanges(self) -> bool:
        """Whether any rank has sharded columns (else there is no all-to-all)."""
        return any(c.cols for c in self.codecs)

    def _exchange(
        self,
        flat: torch.Tensor,
        blocks: list[torch.Tensor],
        *,
        send_codecs: list[ColumnBlockCodec],
        recv_codecs: list[ColumnBlockCodec],
        recv_rows: list[int],
        direction: str,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Sends ``blocks[r]`` encoded by ``send_codecs[r]`` to rank ``r``.

        Args:
            flat: the blocks concatenated, 1-D and contiguous (sent as it is when every send
                codec is fp32).
            blocks: ``(rows, send_codecs[r].cols)`` views of ``flat``.

        Returns:
            The ``recv_rows[s]``-row block from each rank ``s``, and, when every received
            block is fp32, the 1-D buffer holding them all (the blocks are views of it).
        """
        dtype, (rank, _) = flat.dtype, rank_and_world_size(self.pg)
        for r, (codec, block) in enumerate(zip(send_codecs, blocks, strict=True)):
            if r != rank:
                for name, num_bytes in codec.bytes_by_codec(block.shape[0]).items():
                    self.comm_bytes.add(direction, name, num_bytes)
        if all(_lossless(c, dtype) for c in send_codecs):
            payload = flat.view(torch.uint8)
            input_splits = [b.numel() * b.element_size() for b in blocks]
        else:
            parts = [c.encode(b) for c, b in zip(send_codecs, blocks, strict=True)]
            payload = torch.cat(parts)
            input_splits = [p.numel() for p in parts]
        recv_bytes = [c.payload_bytes(n) for c, n in zip(recv_codecs, recv_rows, strict=True)]
        received = all_to_all(
            payload, input_splits=input_splits, output_splits=recv_bytes, pg=self.pg
        )
        if all(_lossless(c, dtype) for c in recv_codecs):
            values = received.view(torch.float32)
            chunks = values.split([b // values.element_size() for b in recv_bytes])
            return [
                chunk.view(n, c.cols)
                for chunk, n, c in zip(chunks, recv_rows, recv_codecs, strict=True)
            ], values
        chunks = received.split(recv_bytes)
        return [
            codec.decode(chunk, rows=n, dtype=dtype)
            for codec, chunk, n in zip(recv_codecs, chunks, recv_rows, strict=True)
        ], None

    def forward_blocks(self, sharded: torch.Tensor, batch_sizes: list[int]) -> list[torch.Tensor]:
        """Every rank's sharded columns for this rank's samples, one block per rank."""
        rank, world_size = rank_and_world_size(self.pg)
        if world_size == 1:
            return [sharded]
        rows = batch_sizes[rank]
        if not self.exchanges:
            return [sharded.new_empty(rows, 0) for _ in range(world_size)]
        sharded = sharded.contiguous()
        blocks, _ = self._exchange(
            sharded.view(-1),
            list(sharded.split(batch_sizes, dim=0)),
            send_codecs=[self.codecs[rank]] * world_size,
            recv_codecs=self.codecs,
            recv_rows=[rows] * world_size,
            direction="forward",
        )
        return blocks

    def backward_pooled(
        self, flat: torch.Tensor, blocks: list[torch.Tensor], batch_sizes: list[int]
    ) -> torch.Tensor:
        """The gradient of this rank's sharded lookups, ``(sum(batch_sizes), D_r)``.

        Args:
            flat: 1-D buffer of the gradient blocks.
            blocks: ``blocks[s]``, a view of ``flat``: the gradient of ``s``'s columns for this
                rank's samples.
        """
        rank, world_size = rank_and_world_size(self.pg)
        if world_size == 1:
            return blocks[0]
        cols = self.codecs[rank].cols
        if not self.exchanges:
            return flat.new_zeros(sum(batch_sizes), cols)
        received, values = self._exchange(
            flat,
            blocks,
            send_codecs=self.codecs,
            recv_codecs=[self.codecs[rank]] * world_size,
            recv_rows=batch_sizes,
            direction="backward",
        )
        if values is not None:
            return values.view(sum(batch_sizes), cols)
        return torch.cat(received, dim=0)

    def gather_replicated(self, grad: torch.Tensor, batch_sizes: list[int]) -> torch.Tensor:
        """All-gathers the replicated columns' gradient rows of every rank (rank order)."""
        _, world_size = rank_and_world_size(self.pg)
        if world_size == 1:
            return grad
        dim = grad.shape[1]
        payload = grad.reshape(-1)
        self.comm_bytes.add("backward", "fp32", payload.nbytes * (world_size - 1))
        gathered = all_to_all(
            payload.repeat(world_size),
            input_splits=[payload.numel()] * world_size,
            output_splits=[b * dim for b in batch_sizes],
            pg=self.pg,
        )
        return gathered.view(-1, dim)


def _lossless(codec: ColumnBlockCodec, dtype: torch.dtype) -> bool:
    """Whether ``codec`` sends ``dtype`` blocks as they are (fp32 blocks, fp32 codec)."""
    return dtype == torch.float32 and all(c.name == "fp32" for c, _ in codec.runs)


class _OutputDistFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, pooled: torch.Tensor, batch_sizes: list[int], dist: OutputDist
    ) -> torch.Tensor:
        rank, _ = rank_and_world_size(dist.pg)
        sharded_cols = dist.codecs[rank].cols
        ctx.batch_sizes, ctx.dist = batch_sizes, dist
        ctx.replicated_cols = pooled.shape[1] - sharded_cols
        start = sum(batch_sizes[:rank])
        blocks = dist.forward_blocks(pooled[:, :sharded_cols], batch_sizes)
        blocks.append(pooled[start : start + batch_sizes[rank], sharded_cols:])
        out = pooled.new_empty(batch_sizes[rank], dist.num_columns)
        for run in dist.runs:
            src = blocks[run.block][:, run.src : run.src + run.width]
            dst = out[:, run.dst : run.dst + run.width]
            if run.accumulate:
                dst.add_(src)
            else:
                dst.copy_(src)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dist: OutputDist = ctx.dist
        rank, world_size = rank_and_world_size(dist.pg)
        rows = ctx.batch_sizes[rank]
        widths = [c.cols for c in dist.codecs] + [ctx.replicated_cols]
        # One buffer for every block's gradient, in block order: the sharded blocks are sent
        # from it as they are.
        buffer = grad.new_empty(rows * sum(widths))
        pieces = buffer.split([rows * w for w in widths])
        blocks = [b.view(rows, w) for b, w in zip(pieces, widths, strict=True)]
        for run in dist.runs:
            src = grad[:, run.dst : run.dst + run.width]
            dst = blocks[run.block][:, run.src : run.src + run.width]
            if world_size > 1:
                torch.div(src, world_size, out=dst)
            else:
                dst.copy_(src)
        sharded_numel = rows * sum(widths[:-1])
        grad_sharded = dist.backward_pooled(buffer[:sharded_numel], blocks[:-1], ctx.batch_sizes)
        if not ctx.replicated_cols:
            return grad_sharded, None, None
        grad_replicated = dist.gather_replicated(blocks[-1], ctx.batch_sizes)
        return torch.cat([grad_sharded, grad_replicated], dim=1), None, None
