"""Output distribution: pooled embeddings to the ranks that own the samples, in feature order.

Rank ``r`` looked up its units for the global batch (the concatenation of every rank's samples,
in rank order): one pooled block per batch class (:mod:`raydlrm.sharding._layout`), with a row
per sample, or per unique row for a dedup group's class. Its *sharded* units' pooled vectors go
through one all-to-all, whatever the number of classes: rank ``r`` sends each rank ``t`` its
rows of ``t``'s samples (class after class) and receives, from every rank ``s``, ``s``'s columns
for its own samples. Its *data-parallel* (replicated) units' vectors stay local: ``r`` keeps the
rows of its own samples. The output of each class is then assembled in the class's feature
order by copying column *runs* (:class:`ColumnRun`): contiguous columns of one received block
that land on contiguous output columns. Row-split shards' partial sums land on the same output
columns; the first run to reach a column copies, the later ones add (a reduce-scatter done as an
all-to-all plus a sum).

A dedup group's class arrives as its ``U_g`` unique rows: they are assembled into the class's
own columns, expanded to the batch with the group's inverse index (a row gather) and placed on
their output columns; the backward sums the gradient rows of a unique row's samples
(``index_add``) before the exchange. Expanding after the exchange rather than on the owning rank
before it moves ``U_g`` rows instead of ``B``, and no inverse index has to travel: it always
moves fewer bytes, so it is the only way taken.

The backward pass runs the same in reverse: the output gradient's runs are written, divided by
the world size, straight into the send buffer of the reverse all-to-all; the received buffer is
the gradient of the pooled lookups (without a copy when the codecs are fp32). The data-parallel
columns' gradient rows are all-gathered instead, so that every replica's fused optimizer sees
the whole global batch.

Gradient division: each rank's loss is the mean over its own samples, so the gradients of all
ranks are averaged, not summed (as DDP does for dense parameters). The embedding update then
equals that of one process training on the global batch.

With fp32 codecs (no compression) and one class the pooled output is sent without a copy and
each direction touches the data once after (forward) or before (backward) the exchange (several
classes add one copy into the send buffer). Compressed codecs encode each rank's block into
bytes (:class:`~raydlrm.sharding.codecs.ColumnBlockCodec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from raydlrm.sharding._comm import CommBytes, all_to_all, rank_and_world_size
from raydlrm.sharding.codecs import ColumnBlockCodec

__all__ = ["ClassLayout", "ColumnRun", "OutputDist", "column_runs"]


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


Blocks = list[list[torch.Tensor]]
"""``blocks[r][c]``: a block of batch class ``c`` to or from rank ``r``."""


@dataclass(frozen=True)
class ClassLayout:
    """Where one batch class's received columns go.

    Attributes:
        width: the class's columns (the sum of its features' dims).
        runs: the received blocks' (and the replicated block's) columns on the output
            columns, for a batch whose class has a row per sample.
        compact_runs: the same columns on the class's own ``width`` columns, for a batch whose
            class has a row per unique row (a dedup group).
        placement: the class's own columns on the output columns (``block`` unused).
        per_position: a per-position table's class (a row per id): its own columns are its
            output, not placed in the pooled output (``runs`` and ``placement`` empty).
    """

    width: int
    runs: list[ColumnRun]
    compact_runs: list[ColumnRun]
    placement: list[ColumnRun]
    per_position: bool = False


@dataclass
class OutputDist:
    """The static part of the output distribution of one rank (see the module docstring).

    Attributes:
        classes: where each batch class's columns go.
        num_columns: output columns (the sum of the features' dims).
        codecs: ``codecs[r][c]``, the codec of rank ``r``'s sharded columns of class ``c``; it
            encodes that rank's blocks, forward and backward.
        pg: process group.
        comm_bytes: counts the bytes sent.
    """

    classes: list[ClassLayout]
    num_columns: int
    codecs: list[list[ColumnBlockCodec]]
    pg: ProcessGroup | None
    comm_bytes: CommBytes

    def __call__(
        self,
        pooled: list[torch.Tensor],
        batch_sizes: list[list[int]],
        inverses: list[torch.Tensor | None],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This rank's samples' pooled embeddings, in feature order, and the rows of its ids of
        each per-position class.

        Args:
            pooled: per class ``c``, ``(sum(batch_sizes[c]), D_rc + D_rep)``: this rank's
                units of the class over the global batch, the sharded ones' ``D_rc =
                codecs[rank][c].cols`` columns, then the replicated ones'.
            batch_sizes: ``batch_sizes[c][r]``, the rows of class ``c`` on rank ``r``; class 0
                has a row per sample.
            inverses: per class, the inverse index of its unique rows (shape ``(B,)``), or None
                when the class has a row per sample.

        Returns:
            ``(batch_sizes[0][rank], num_columns)``, and per per-position class ``c``
            ``(batch_sizes[c][rank], width_c)``.
        """
        out, *rows = _OutputDistFn.apply(batch_sizes, inverses, self, *pooled)
        per_position = [c for c, layout in enumerate(self.classes) if layout.per_position]
        return out, dict(zip(per_position, rows, strict=True))

    @property
    def exchanges(self) -> bool:
        """Whether any rank has sharded columns (else there is no all-to-all)."""
        return any(c.cols for codecs in self.codecs for c in codecs)

    def _exchange(
        self,
        blocks: Blocks,
        *,
        flat: torch.Tensor,
        send_codecs: list[list[ColumnBlockCodec]],
        recv_codecs: list[list[ColumnBlockCodec]],
        recv_rows: list[list[int]],
        direction: str,
    ) -> tuple[Blocks, torch.Tensor | None]:
        """Sends ``blocks[r][c]`` encoded by ``send_codecs[r][c]`` to rank ``r``.

        Args:
            blocks: ``(rows, send_codecs[r][c].cols)`` blocks, views of ``flat``.
            flat: the blocks concatenated in ``(r, c)`` order, 1-D and contiguous (sent as it
                is when every send codec is fp32).
            recv_rows: ``recv_rows[s][c]``, the rows of class ``c`` received from rank ``s``.

        Returns:
            The blocks received, ``[s][c]``, and, when every received block is fp32, the 1-D
            buffer holding them all (the blocks are views of it).
        """
        payload, input_splits = self._payload(blocks, flat=flat, codecs=send_codecs)
        rank, _ = rank_and_world_size(self.pg)
        for r, (codecs, row_blocks) in enumerate(zip(send_codecs, blocks, strict=True)):
            for codec, block in zip(codecs, row_blocks, strict=True):
                if r != rank:
                    for name, num_bytes in codec.bytes_by_codec(block.shape[0]).items():
                        self.comm_bytes.add(direction, name, num_bytes)
        recv_bytes = [
            [c.payload_bytes(n) for c, n in zip(cs, ns, strict=True)]
            for cs, ns in zip(recv_codecs, recv_rows, strict=True)
        ]
        received = all_to_all(
            payload,
            input_splits=input_splits,
            output_splits=[sum(bs) for bs in recv_bytes],
            pg=self.pg,
        )
        if all(_lossless(c, flat.dtype) for cs in recv_codecs for c in cs):
            values = received.view(torch.float32)
            shapes = [
                [(n, c.cols) for c, n in zip(cs, ns, strict=True)]
                for cs, ns in zip(recv_codecs, recv_rows, strict=True)
            ]
            chunks = iter(values.split([n * cols for ss in shapes for n, cols in ss]))
            return [[next(chunks).view(n, cols) for n, cols in ss] for ss in shapes], values
        chunks = iter(received.split([b for bs in recv_bytes for b in bs]))
        return [
            [c.decode(next(chunks), rows=n, dtype=flat.dtype) for c, n in zip(cs, ns, strict=True)]
            for cs, ns in zip(recv_codecs, recv_rows, strict=True)
        ], None

    @staticmethod
    def _payload(
        blocks: Blocks, *, flat: torch.Tensor, codecs: list[list[ColumnBlockCodec]]
    ) -> tuple[torch.Tensor, list[int]]:
        """The bytes to send (``flat`` itself when every codec is fp32) and their splits."""
        if all(_lossless(c, flat.dtype) for cs in codecs for c in cs):
            splits = [sum(b.numel() * b.element_size() for b in bs) for bs in blocks]
            return flat.view(torch.uint8), splits
        parts = [
            [c.encode(b) for c, b in zip(cs, bs, strict=True)]
            for cs, bs in zip(codecs, blocks, strict=True)
        ]
        return torch.cat([p for ps in parts for p in ps]), [
            sum(p.numel() for p in ps) for ps in parts
        ]

    def forward_blocks(self, sharded: list[torch.Tensor], batch_sizes: list[list[int]]) -> Blocks:
        """Every rank's sharded columns of each class for this rank's rows, ``[rank][class]``."""
        rank, world_size = rank_and_world_size(self.pg)
        if world_size == 1:
            return [sharded]
        rows = [sizes[rank] for sizes in batch_sizes]
        if not self.exchanges:
            return [[x.new_empty(n, 0) for x, n in zip(sharded, rows, strict=True)]] * world_size
        if len(sharded) == 1:  # one class: the rows of each rank are contiguous, no copy
            flat = sharded[0].contiguous()
            blocks = [[b] for b in flat.split(batch_sizes[0], dim=0)]
            flat = flat.view(-1)
        else:
            splits = [x.split(sizes, dim=0) for x, sizes in zip(sharded, batch_sizes, strict=True)]
            blocks = [[split[t] for split in splits] for t in range(world_size)]
            flat = torch.cat([b.reshape(-1) for bs in blocks for b in bs])
        received, _ = self._exchange(
            blocks,
            flat=flat,
            send_codecs=[self.codecs[rank]] * world_size,
            recv_codecs=self.codecs,
            recv_rows=[rows] * world_size,
            direction="forward",
        )
        return received

    def backward_pooled(
        self, flat: torch.Tensor, blocks: Blocks, batch_sizes: list[list[int]]
    ) -> list[torch.Tensor]:
        """The gradient of this rank's sharded lookups of each class, ``(sum(batch_sizes[c]),
        D_rc)``.

        Args:
            flat: 1-D buffer of the gradient blocks, in ``(rank, class)`` order.
            blocks: ``blocks[s][c]``, a view of ``flat``: the gradient of ``s``'s columns of
                class ``c`` for this rank's rows.
        """
        rank, world_size = rank_and_world_size(self.pg)
        if world_size == 1:
            return blocks[0]
        cols = [c.cols for c in self.codecs[rank]]
        if not self.exchanges:
            return [
                flat.new_zeros(sum(sizes), n) for sizes, n in zip(batch_sizes, cols, strict=True)
            ]
        received, values = self._exchange(
            blocks,
            flat=flat,
            send_codecs=self.codecs,
            recv_codecs=[self.codecs[rank]] * world_size,
            recv_rows=[[sizes[t] for sizes in batch_sizes] for t in range(world_size)],
            direction="backward",
        )
        if values is not None and len(cols) == 1:
            return [values.view(sum(batch_sizes[0]), cols[0])]
        return [torch.cat([r[c] for r in received], dim=0) for c in range(len(cols))]

    def gather_replicated(
        self, grads: list[torch.Tensor], batch_sizes: list[list[int]]
    ) -> list[torch.Tensor]:
        """All-gathers the replicated columns' gradient rows of every rank (rank order), per
        class, in one exchange."""
        _, world_size = rank_and_world_size(self.pg)
        if world_size == 1:
            return grads
        dims = [g.shape[1] for g in grads]
        payload = (
            torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
        )
        self.comm_bytes.add("backward", "fp32", payload.nbytes * (world_size - 1))
        gathered = all_to_all(
            payload.repeat(world_size),
            input_splits=[payload.numel()] * world_size,
            output_splits=[
                sum(sizes[s] * d for sizes, d in zip(batch_sizes, dims, strict=True))
                for s in range(world_size)
            ],
            pg=self.pg,
        )
        if len(grads) == 1:
            return [gathered.view(-1, dims[0])]
        chunks = iter(
            gathered.split(
                [
                    sizes[s] * d
                    for s in range(world_size)
                    for sizes, d in zip(batch_sizes, dims, strict=True)
                ]
            )
        )
        per_rank = [
            [next(chunks).view(sizes[s], d) for sizes, d in zip(batch_sizes, dims, strict=True)]
            for s in range(world_size)
        ]
        return [torch.cat([r[c] for r in per_rank], dim=0) for c in range(len(dims))]


def _lossless(codec: ColumnBlockCodec, dtype: torch.dtype) -> bool:
    """Whether ``codec`` sends ``dtype`` blocks as they are (fp32 blocks, fp32 codec)."""
    return dtype == torch.float32 and all(c.name == "fp32" for c, _ in codec.runs)


def _copy_runs(runs: list[ColumnRun], blocks: list[torch.Tensor], out: torch.Tensor) -> None:
    """Copies (or adds) each run's columns of its block into ``out``."""
    for run in runs:
        src = blocks[run.block][:, run.src : run.src + run.width]
        dst = out[:, run.dst : run.dst + run.width]
        if run.accumulate:
            dst.add_(src)
        else:
            dst.copy_(src)


class _OutputDistFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        batch_sizes: list[list[int]],
        inverses: list[torch.Tensor | None],
        dist: OutputDist,
        *pooled: torch.Tensor,
    ) -> torch.Tensor:
        rank, _ = rank_and_world_size(dist.pg)
        sharded_cols = [c.cols for c in dist.codecs[rank]]
        ctx.batch_sizes, ctx.inverses, ctx.dist = batch_sizes, inverses, dist
        ctx.replicated_cols = [p.shape[1] - n for p, n in zip(pooled, sharded_cols, strict=True)]
        received = dist.forward_blocks(
            [p[:, :n] for p, n in zip(pooled, sharded_cols, strict=True)], batch_sizes
        )
        out = pooled[0].new_empty(batch_sizes[0][rank], dist.num_columns)
        positions = []
        for c, (p, layout, inverse) in enumerate(zip(pooled, dist.classes, inverses, strict=True)):
            start, rows = sum(batch_sizes[c][:rank]), batch_sizes[c][rank]
            blocks = [r[c] for r in received] + [p[start : start + rows, sharded_cols[c] :]]
            if inverse is None and not layout.per_position:
                _copy_runs(layout.runs, blocks, out)
                continue
            unique = p.new_empty(rows, layout.width)
            _copy_runs(layout.compact_runs, blocks, unique)
            if layout.per_position:
                positions.append(unique)
            else:
                _copy_runs(layout.placement, [unique.index_select(0, inverse)], out)
        return out, *positions

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor, *position_grads: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        dist: OutputDist = ctx.dist
        position_grad = iter(position_grads)
        rank, world_size = rank_and_world_size(dist.pg)
        rows = [sizes[rank] for sizes in ctx.batch_sizes]
        # One buffer for every block's gradient, the sharded blocks in (rank, class) order (sent
        # from it as they are), then the replicated ones of each class.
        shapes = [(n, c.cols) for codecs in dist.codecs for c, n in zip(codecs, rows, strict=True)]
        shapes += list(zip(rows, ctx.replicated_cols, strict=True))
        buffer = grad.new_empty(sum(n * w for n, w in shapes))
        views = [
            b.view(n, w)
            for b, (n, w) in zip(buffer.split([n * w for n, w in shapes]), shapes, strict=True)
        ]
        classes = len(rows)
        blocks = [views[s * classes : (s + 1) * classes] for s in range(world_size)]
        replicated = views[world_size * classes :]
        for c, (layout, inverse) in enumerate(zip(dist.classes, ctx.inverses, strict=True)):
            source, runs = grad, layout.runs
            if layout.per_position:  # the class's own columns, a row per id
                source, runs = next(position_grad), layout.compact_runs
            elif inverse is not None:  # the samples' gradient rows summed per unique row
                expanded = grad.new_empty(grad.shape[0], layout.width)
                for p in layout.placement:
                    expanded[:, p.src : p.src + p.width].copy_(grad[:, p.dst : p.dst + p.width])
                source = grad.new_zeros(rows[c], layout.width).index_add_(0, inverse, expanded)
                runs = layout.compact_runs
            for run in runs:
                src = source[:, run.dst : run.dst + run.width]
                block = replicated[c] if run.block == world_size else blocks[run.block][c]
                dst = block[:, run.src : run.src + run.width]
                if world_size > 1:
                    torch.div(src, world_size, out=dst)
                else:
                    dst.copy_(src)
        sharded_numel = sum(n * w for n, w in shapes[: world_size * classes])
        grad_sharded = dist.backward_pooled(buffer[:sharded_numel], blocks, ctx.batch_sizes)
        if not any(ctx.replicated_cols):
            return None, None, None, *grad_sharded
        grad_replicated = dist.gather_replicated(replicated, ctx.batch_sizes)
        return (
            None,
            None,
            None,
            *(torch.cat([s, r], dim=1) for s, r in zip(grad_sharded, grad_replicated, strict=True)),
        )
