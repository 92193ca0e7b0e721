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
- ``mx4``: OCP Microscaling MX FP4 (:class:`Mx4Codec`): a 4-bit E2M1 code per value (``0, 0.5,
  1, 1.5, 2, 3, 4, 6`` and their negatives) times a power of two (E8M0) shared by each block of
  32 values of a row; with ``m`` the block's absolute maximum, ``|err| <= max(|x| / 5, m / 14,
  2**-129)`` (the last term: E8M0's smallest exponent, -127; for ``|x|`` above ``1.75 *
  2**127``, saturation at ``1.5 * 2**127``: ``|err| < |x| / 4``); ``ceil(cols / 2) + ceil(cols
  / 32)`` bytes per row (4.25 bits per value when ``cols`` is a multiple of 32).

Per-table precision: a rank's output block holds the columns of several tables. Rather than
one exchange per precision, :class:`ColumnBlockCodec` encodes each run of adjacent columns that
share a precision with that precision's codec and concatenates the payloads (one all-to-all per
direction whatever the mix). Row-wise scales are then per (row, run) rather than per table,
which only tightens the bounds above. ``mx4``'s blocks of 32 are counted from the start of each
run, so a block may straddle two tables of one run (its ``m`` is then the larger of theirs).

Kernels: with ``sharding.kernel = "fbgemm"`` the ``fp8`` decode and the ``int8`` codec run
fbgemm's operators; with ``torch`` their PyTorch equivalents, which give the same bytes and
values (tested against fbgemm). ``fp8`` encodes with torch's ``float8_e4m3fn`` cast on both:
below 240 its bit layout is HFP8's (one code path; a one-off timing here, not a recorded benchmark,
found it faster than fbgemm's quantizer). ``mx4`` runs the same PyTorch operators with either
kernel, on CPU and CUDA: fbgemm 1.8's ``fp32_to_mx4`` / ``mx4_to_fp32`` run a Triton kernel on
CUDA only, and on the CPU a reference in PyTorch operators, which lays the bytes out per block
(16 code bytes, then the exponent) and rounds ties away from zero. Our codes and exponents are
that reference's (for its default ``RoundingMode.even``) but at exact ties and in blocks
with ``m`` above ``1.75 * 2**127`` (tested).
"""

from __future__ import annotations

import math
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
    "Mx4Codec",
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


_MX4_BLOCK = 32
"""Values per shared exponent of :class:`Mx4Codec` (OCP MX's block size)."""
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""FP4 E2M1 magnitudes of the codes 0-7 (bit 3 of a code is the sign)."""
_ROUND_MAGIC = float(2**22)
_MX4_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _mx4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs, scales)`` of :class:`Mx4Codec` on ``device``, built once per device: the two
    values of each code byte (``(256, 2)``: low nibble, high nibble), and ``2 ** (b - 127)`` of
    each E8M0 byte ``b`` (``2 ** -127`` is an fp32 subnormal, exact), NaN for 255."""
    tables = _MX4_TABLES.get(device)
    if tables is None:
        values = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES))
        byte = torch.arange(256)
        pairs = torch.stack([values[byte & 15], values[byte >> 4]], dim=1)
        scales = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan])
        tables = _MX4_TABLES[device] = (pairs.to(device), scales.to(device))
    return tables


def _e2m1_codes_(y: torch.Tensor) -> torch.Tensor:
    """The E2M1 code (``uint8``, 0-7) of each fp32 magnitude ``y`` in ``[0, 6]``: the nearest
    E2M1 value, ties to even. Overwrites ``y``.

    The steps of E2M1 are 0.5 below 2, 1 in ``[2, 4)``, 2 in ``[4, 6]``: with ``k`` the binade
    (0, 1, 2 from ``y``'s fp32 exponent) and ``w = y / 2**k`` (in ``[0, 2)``), the code is
    ``round(2 w) + 2 k``. The power of two comes off the exponent
    bits (exact), and the rounding is fp32's own: ``w + 2**22`` (whose ulp is 0.5) holds
    ``round(2 w)``, to nearest, ties to even, in its low mantissa bits. In place but for ``k``:
    on a CPU, fresh pages for temporaries cost more than the arithmetic.
    """
    bits = y.view(torch.int32)
    k = (bits >> 23).sub_(127).clamp_(0, 2)
    bits.sub_(k.bitwise_left_shift_(23))  # w = y / 2**k
    y.add_(_ROUND_MAGIC)  # bits: 0x4A800000 + round(2 w)
    bits.add_(k.bitwise_right_shift_(22))  # + 2 k
    return bits.to(torch.uint8)  # the low byte


@dataclass(frozen=True)
class Mx4Codec:
    """OCP MX FP4 (MX4): FP4 E2M1 codes with an E8M0 exponent per block of 32 values of a row.

    Each row is cut into blocks of 32 consecutive values, the last one padded with zeros (which
    leave its absolute maximum unchanged). A block of absolute maximum ``m`` gets the smallest
    exponent ``e`` with ``m <= 7 * 2**e`` (exact, from ``frexp(m)``): OCP's ``floor(log2(m)) -
    2``, plus one when ``m``'s significand is above 1.75 (``m`` would round up to the next power
    of two at E2M1's one mantissa bit; fbgemm's default ``RoundingMode.even``), clamped to
    ``[-127, 125]`` (an all-zero block: -127; at most 125, as fbgemm, so that every finite
    value decodes finite: ``6 * 2**125``). Each value ``x`` then sends ``x / 2**e`` rounded
    to the nearest E2M1 value, ties to even, magnitudes in ``(6, 7]`` saturating to 6, and the
    sign bit of ``x`` (``-0.0`` and negatives that round to 0 send code 8, ``-0``). A block
    holding inf or NaN sends exponent byte 255 (E8M0's NaN) and decodes to NaN throughout (its
    codes are 0 but for the sign bits, the same bytes on every device).

    Layout: the ``rows * ceil(cols / 2)`` code bytes (two codes a byte, the even column's in the
    low nibble; an odd ``cols`` leaves each row's last high nibble 0), then the ``rows * ceil(cols
    / 32)`` exponent bytes (``e + 127``, row by row): ``ceil(cols / 2) + ceil(cols / 32)`` bytes
    per row. The codes and exponents are fbgemm's ``fp32_to_mx4`` in another layout, but at ties
    (see the module docstring).
    """

    name: str = "mx4"

    def payload_bytes(self, rows: int, cols: int) -> int:
        return rows * ((cols + 1) // 2 + -(-cols // _MX4_BLOCK))

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        rows, cols = block.shape
        if rows * cols == 0:
            return block.new_empty(self.payload_bytes(rows, cols), dtype=torch.uint8)
        nblocks = -(-cols // _MX4_BLOCK)
        x = block.float()
        if cols % _MX4_BLOCK:
            x = torch.nn.functional.pad(x, (0, nblocks * _MX4_BLOCK - cols))
        x = x.view(rows, nblocks, _MX4_BLOCK)
        mag = x.abs()
        amax = mag.amax(dim=2)
        # m = f 2**k, f in [0.5, 1): m <= 7 2**e = 0.875 2**(e + 3) first holds at e = k - 3
        # when f <= 0.875, else at e = k - 2.
        frac, exp = torch.frexp(amax)
        e = torch.where(amax > 0, exp - 3 + (frac > 0.875).int(), -127).clamp(-127, 125)
        finite = amax.isfinite()
        # 1 / 2**e as fp32 bits, exact; 0 in a non-finite block.
        inv = torch.where(finite, ((127 - e) << 23).view(torch.float32), 0.0)
        # |x| / 2**e <= 7 (8 where e = 125 cut m's exponent), saturated to 6. A non-finite
        # block's NaN and inf times 0 are NaN, whose bits differ by device (a GPU makes its
        # canonical NaN, a CPU keeps the operand's): 0 instead, so that its codes are 0.
        codes = _e2m1_codes_(mag.mul_(inv.unsqueeze(2)).nan_to_num_(nan=0.0).clamp_(max=6.0))
        codes |= x.signbit().view(torch.uint8) << 3
        codes = codes.view(rows, -1, 2)
        packed = codes[..., 0] | (codes[..., 1] << 4)
        exps = torch.where(finite, e + 127, 255).to(torch.uint8)
        return torch.cat([packed[:, : (cols + 1) // 2].reshape(-1), exps.view(-1)])

    def decode(
        self, payload: torch.Tensor, *, rows: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        if rows * cols == 0:
            return payload.new_zeros(rows, cols, dtype=dtype)
        pairs, scales = _mx4_tables(payload.device)
        nblocks, width = -(-cols // _MX4_BLOCK), (cols + 1) // 2
        packed = payload[: rows * width].view(rows, width)
        if width != nblocks * _MX4_BLOCK // 2:
            packed = torch.nn.functional.pad(packed, (0, nblocks * _MX4_BLOCK // 2 - width))
        # index_select: several times faster than indexing with a tensor on a CPU.
        out = pairs.index_select(0, packed.reshape(-1).int()).view(rows, nblocks, _MX4_BLOCK)
        out.mul_(scales.index_select(0, payload[rows * width :].int()).view(rows, nblocks, 1))
        return out.view(rows, nblocks * _MX4_BLOCK)[:, :cols].to(dtype).contiguous()


CODECS: dict[str, PooledCodec] = {
    "fp32": CastCodec("fp32", torch.float32),
    "fp16": CastCodec("fp16", torch.float16),
    "bf16": CastCodec("bf16", torch.bfloat16),
    "fp8": Fp8Codec(),
    "int8": Int8RowwiseCodec(),
    "mx4": Mx4Codec(),
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
