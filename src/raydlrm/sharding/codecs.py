"""Codecs of the pooled-embedding output all-to-all: compressed communication.

The pooled output of every sharded table, and in backward its gradient, crosses the network
through the output all-to-all (:mod:`raydlrm.sharding._output_dist`). Each ``(rows, cols)``
block it sends is encoded by a codec into a 1-D ``uint8`` payload: one all-to-all moves one
dtype, so every codec speaks bytes and codecs of different precisions can share one exchange.
A payload's size follows from the block's shape alone, so receivers know their splits without
an extra exchange.

Codecs (``CommPrecision`` names them) and the bound on their round-trip error per value ``x`` of
a row with absolute maximum ``m`` (min ``lo``, max ``hi``):

- ``fp32``: the block's bytes unchanged (exact); 4 bytes per value.
- ``fp16``: cast to half; ``|err| <= 2**-11 |x| + 2**-25`` (the second term: half's
  subnormals below ``6.1e-5``); values above 65504 overflow (no scaling); 2 bytes.
- ``bf16``: cast to bfloat16 (fp32's range); ``|err| <= 2**-8 |x|``; 2 bytes.
- ``fp8``: fbgemm's HFP8 (1 sign, 4 exponent, 3 mantissa bits, exponent bias 7, largest value
  240) after scaling each row so that ``m`` maps to 240, plus the fp32 scale of each row;
  ``|err| <= |x| / 16 + m * 2**-17`` (the second term: values that fall into HFP8's subnormal
  range); ``cols + 4`` bytes per row.
- ``int8``: fbgemm's fused 8-bit row-wise quantization (``q = round((x - lo) / s)`` with
  ``s = (hi - lo) / 255``, the fp32 scale and bias appended to each row);
  ``|err| <= (hi - lo) / 510``; ``cols + 8`` bytes per row.

Per-table precision: a rank's output block holds the columns of several tables. Rather than
one exchange per precision, :class:`ColumnBlockCodec` encodes each run of adjacent columns that
share a precision with that precision's codec and concatenates the payloads (one all-to-all per
direction whatever the mix). Row-wise scales are then per (row, run) rather than per table,
which only tightens the bounds above.

Kernels: with ``sharding.kernel = "fbgemm"`` the ``fp8`` decode and the ``int8`` codec run
fbgemm's operators; with ``torch`` their PyTorch equivalents, which give the same bytes and
values (tested against fbgemm). ``fp8`` encodes with torch's ``float8_e4m3fn`` cast on both:
below 240 its bit layout is HFP8's (one code path; a one-off timing here, not a recorded benchmark,
found it faster than fbgemm's quantizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from raydlrm._versions import import_fbgemm
from raydlrm.sharding.config import CommPrecision

__all__ = [
    "CODECS",
    "CastCodec",
    "ColumnBlockCodec",
    "Fp8Codec",
    "Int8RowwiseCodec",
    "PooledCodec",
    "codecs_for",
]


class PooledCodec(Protocol):
    """Encodes a ``(rows, cols)`` block of pooled embeddings (or gradients) into bytes."""

    name: str
    """The codec's :data:`CommPrecision`."""

    def payload_bytes(self, rows: int, cols: int) -> int:
        """Bytes of the payload of a ``(rows, cols)`` block."""
        ...

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        """``(rows, cols)`` float block -> 1-D ``uint8`` payload of ``payload_bytes`` bytes."""
        ...

    def decode(
        self, payload: torch.Tensor, *, rows: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """1-D ``uint8`` payload -> ``(rows, cols)`` block of ``dtype``."""
        ...


def _view(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterprets 1-D bytes as ``dtype``, copying only if the bytes are misaligned for it."""
    if payload.storage_offset() % dtype.itemsize:
        payload = payload.clone()
    return payload.view(dtype)


@dataclass(frozen=True)
class CastCodec:
    """Sends each value cast to ``wire`` (fp32: the bytes unchanged)."""

    name: str
    wire: torch.dtype

    def payload_bytes(self, rows: int, cols: int) -> int:
        return rows * cols * self.wire.itemsize

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        return block.to(self.wire).contiguous().view(-1).view(torch.uint8)

    def decode(
        self, payload: torch.Tensor, *, rows: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return _view(payload, self.wire).view(rows, cols).to(dtype)


@dataclass(frozen=True)
class Fp8Codec:
    """fbgemm HFP8 (e4m3, bias 7) with an fp32 scale per row: ``cols + 4`` bytes per row.

    Layout: the ``rows * cols`` HFP8 bytes, then the ``rows`` fp32 scales.
    """

    name: str = "fp8"
    fbgemm: bool = False
    """Decode with fbgemm's operator (else torch's)."""
    ebits: int = 4
    exponent_bias: int = 7
    max_pos: float = 240.0
    """Largest HFP8 value: ``2 ** (2 ** ebits - 2 - exponent_bias) * (2 - 2 ** -3)``."""

    def payload_bytes(self, rows: int, cols: int) -> int:
        return rows * (cols + 4)

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        block = block.float()
        scale = block.abs().amax(dim=1, keepdim=True) / self.max_pos
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        # Scaled to [-240, 240], where e4m3fn's bits are HFP8's (round to nearest even).
        scaled = (block / scale).clamp(-self.max_pos, self.max_pos)
        quantized = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([quantized.view(-1), scale.view(-1).view(torch.uint8)])

    def decode(
        self, payload: torch.Tensor, *, rows: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        quantized = payload[: rows * cols].view(rows, cols)
        scale = _view(payload[rows * cols :], torch.float32).view(rows, 1)
        if self.fbgemm:
            values = torch.ops.fbgemm.HFP8QuantizedToFloat(
                quantized, self.ebits, self.exponent_bias
            )
        else:
            values = quantized.view(torch.float8_e4m3fn).float()
        return (values * scale).to(dtype)


@dataclass(frozen=True)
class Int8RowwiseCodec:
    """fbgemm fused 8-bit row-wise quantization: ``cols`` bytes plus fp32 scale and bias per
    row (``cols + 8`` bytes per row)."""

    name: str = "int8"
    fbgemm: bool = False
    """Run fbgemm's operators (else their torch equivalents, same bytes and values)."""

    def payload_bytes(self, rows: int, cols: int) -> int:
        return rows * (cols + 8)

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        if block.numel() == 0:
            return block.new_empty(self.payload_bytes(*block.shape), dtype=torch.uint8)
        block = block.float().contiguous()
        if self.fbgemm:
            return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(block).view(-1)
        # fbgemm's arithmetic: scale = range / 255, q = round((x - min) * 255 / (range + 1e-8)).
        lo = block.amin(dim=1, keepdim=True)
        span = block.amax(dim=1, keepdim=True) - lo
        q = torch.round((block - lo) * (255.0 / (span + 1e-8))).to(torch.uint8)
        scale_bias = torch.cat([span / 255.0, lo], dim=1).view(torch.uint8)
        return torch.cat([q, scale_bias], dim=1).view(-1)

    def decode(
        self, payload: torch.Tensor, *, rows: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        if rows * cols == 0:
            return payload.new_zeros(rows, cols, dtype=dtype)
        fused = payload.view(rows, cols + 8)
        if self.fbgemm:
            return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(fused).to(dtype)
        scale_bias = _view(fused[:, cols:].reshape(-1), torch.float32).view(rows, 2)
        # One rounding (a fused multiply-add), as fbgemm's dequantizer.
        values = torch.addcmul(scale_bias[:, 1:], fused[:, :cols].float(), scale_bias[:, :1])
        return values.to(dtype)


CODECS: dict[str, PooledCodec] = {
    "fp32": CastCodec("fp32", torch.float32),
    "fp16": CastCodec("fp16", torch.float16),
    "bf16": CastCodec("bf16", torch.bfloat16),
    "fp8": Fp8Codec(),
    "int8": Int8RowwiseCodec(),
}
"""The codec of each :data:`CommPrecision`, in PyTorch operators (any kernel)."""

_FBGEMM_CODECS: dict[str, PooledCodec] = {
    **CODECS,
    "fp8": Fp8Codec(fbgemm=True),
    "int8": Int8RowwiseCodec(fbgemm=True),
}


def codecs_for(kernel: str) -> dict[str, PooledCodec]:
    """The codec of each :data:`CommPrecision` with ``kernel``'s operators (``fbgemm`` or
    ``torch``)."""
    if kernel == "fbgemm":
        import_fbgemm()
        return _FBGEMM_CODECS
    return CODECS


@dataclass(frozen=True)
class ColumnBlockCodec:
    """Encodes the runs of a block's columns each with its own codec (per-table precision).

    Attributes:
        runs: ``(codec, width)`` of each run of columns, left to right; the widths sum to the
            block's columns. No runs: a block of no columns (0 bytes).
    """

    runs: tuple[tuple[PooledCodec, int], ...]

    @classmethod
    def from_columns(
        cls, columns: list[tuple[CommPrecision, int]], *, kernel: str = "torch"
    ) -> ColumnBlockCodec:
        """Merges adjacent ``(precision, width)`` column groups of equal precision into runs,
        each encoded by the codec of ``kernel`` (:func:`codecs_for`)."""
        codecs = codecs_for(kernel)
        runs: list[tuple[PooledCodec, int]] = []
        for precision, width in columns:
            if runs and runs[-1][0].name == precision:
                runs[-1] = (runs[-1][0], runs[-1][1] + width)
            elif width:
                runs.append((codecs[precision], width))
        return cls(tuple(runs))

    @property
    def cols(self) -> int:
        return sum(w for _, w in self.runs)

    def bytes_by_codec(self, rows: int) -> dict[str, int]:
        """Payload bytes of a ``rows``-row block, per codec name."""
        out: dict[str, int] = {}
        for codec, width in self.runs:
            out[codec.name] = out.get(codec.name, 0) + codec.payload_bytes(rows, width)
        return out

    def payload_bytes(self, rows: int) -> int:
        """Payload bytes of a ``(rows, cols)`` block."""
        return sum(codec.payload_bytes(rows, width) for codec, width in self.runs)

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        """``(rows, cols)`` block -> 1-D ``uint8`` payload of ``payload_bytes(rows)`` bytes."""
        assert block.shape[1] == self.cols, (block.shape, self.cols)
        if not self.runs:
            return block.new_empty(0, dtype=torch.uint8)
        parts = block.split([w for _, w in self.runs], dim=1)
        return torch.cat([c.encode(p) for (c, _), p in zip(self.runs, parts, strict=True)])

    def decode(self, payload: torch.Tensor, *, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """1-D ``uint8`` payload -> ``(rows, cols)`` block of ``dtype``."""
        if not self.runs:
            return payload.new_empty(rows, 0, dtype=dtype)
        chunks = payload.split([c.payload_bytes(rows, w) for c, w in self.runs])
        return torch.cat(
            [
                c.decode(chunk, rows=rows, cols=w, dtype=dtype)
                for (c, w), chunk in zip(self.runs, chunks, strict=True)
            ],
            dim=1,
        )
