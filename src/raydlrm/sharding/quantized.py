"""Row-wise quantized embedding rows (``sharding.weights_precision`` ``int8`` / ``int4``).

A quantized table stores each row as ``dim`` unsigned codes of ``bits`` bits (``int8``: one
byte each; ``int4``: two per byte, the even column in the low nibble, as fbgemm's fused 4-bit
rows) and an fp16 ``scale`` and ``bias`` (fbgemm's 4-bit row-wise layout; fbgemm's 8-bit rows
keep fp32 ones, 4 bytes more per row), and reads as ``bias + code * scale`` in fp32. Codes and
parameters are two tensors, ``(rows, dim * bits / 8)`` ``uint8`` and ``(rows, 2)`` fp16, so
either may live in DRAM, on a GPU or in a mapped file (:mod:`raydlrm.sharding.tiers`).

The tables are never trained in low precision: the kernels train an fp32 cache of the rows a
step looks up (:mod:`raydlrm.sharding.row_cache`); a row is quantized when the cache evicts it
after updating it, and when a checkpoint flushes the cache. Both kernels therefore train
quantized tables, on CPU and CUDA: fbgemm's TBE only ever sees fp32 slots (its own int8
training and its UVM cache are CUDA-only and are not used).

Quantizing a row ``x`` (``L = 2**bits - 1`` levels):

- ``bias`` is ``min(x)`` rounded down to fp16 and ``scale`` is ``(max(x) - bias) / L`` rounded
  up to fp16, so every value of the row lies in ``[bias, bias + L * scale]``: no code clips;
- ``code = floor((x - bias) / scale + u)`` with ``u`` uniform in ``[0, 1)``: stochastic rounding,
  unbiased (``E[bias + code * scale] = x``) with an error below one ``scale``; or, for the
  initial rows and conversions, ``u = 1/2`` (round to nearest, error at most ``scale / 2``).

The rounding's ``u`` is not drawn from a generator but hashed (an xorshift-multiply hash) from
the run's seed, the table's name, the value's global row and column, and the value's fp32 bits:
it depends on nothing a run's history or layout changes, so a resumed run, a rerun and any
sharding of the table (row ranges, replicas) round alike, and two different values of the
same element (successive evictions of a trained row) draw independent ``u``.
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch

from raydlrm.sharding.config import QUANTIZED_BITS

__all__ = [
    "QuantizedRows",
    "code_bytes_per_row",
    "dequantize_rows",
    "quantize_rows",
]


_MASK32 = 0xFFFFFFFF


def code_bytes_per_row(dim: int, precision: str) -> int:
    """Bytes of a ``dim`` row's codes at ``precision`` (``int4``: ``dim`` must be even).

    Raises:
        ValueError: ``int4`` with an odd ``dim`` (two codes share a byte).
    """
    bits = QUANTIZED_BITS[precision]
    if bits == 4 and dim % 2:
        raise ValueError(f"int4 rows pack two codes per byte; dim {dim} is odd")
    return dim * bits // 8


# Odd multipliers below 2**31: a product with a 32-bit value stays below 2**63 (no int64
# overflow), so the hash is the same on every device.
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """An xorshift-multiply 32-bit integer hash (the shape of murmur3's finalizer) on int64
    tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * _M1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def table_key(seed: int, table: str) -> int:
    """A 32-bit key of (run seed, table name) for :func:`rounding_noise`."""
    return zlib.crc32(f"{seed}:{table}".encode()) & _MASK32


def rounding_noise(
    values: torch.Tensor, *, key: int, rows: torch.Tensor, col_start: int
) -> torch.Tensor:
    """``u`` in ``[0, 1)`` for each value of ``values`` ``(k, cols)``: a hash of ``key``, the
    value's global row (``rows``, int64) and column (``col_start`` + its column) and its fp32
    bits (see the module docstring)."""
    k, cols = values.shape
    device = values.device
    row = rows.to(torch.int64).view(k, 1)
    col = torch.arange(col_start, col_start + cols, device=device, dtype=torch.int64).view(1, cols)
    bits = values.float().contiguous().view(torch.int32).to(torch.int64) & _MASK32
    # Rows and columns are hashed once each; one hash per value mixes them with its bits.
    row_key = _mix32(_mix32((row & _MASK32) ^ key) ^ (row >> 32))
    col_key = _mix32((col + 0x9E3779B9) & _MASK32)
    h = _mix32(row_key ^ col_key ^ bits)
    return (h >> 8).to(torch.float32) * 2.0**-24


def _params(values: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's fp16 bias (its min rounded down) and scale (its range over ``levels``
    rounded up); a constant row gets the smallest positive fp16 scale."""
    lo, hi = torch.aminmax(values, dim=1)
    lo = lo.clamp(min=-65504.0, max=65504.0)
    bias = lo.to(torch.float16)
    down = bias.float() > lo
    bias = torch.where(down, torch.nextafter(bias, bias.new_full((), -torch.inf)), bias)
    scale_exact = (hi - bias.float()) / levels
    scale = scale_exact.to(torch.float16)
    up = scale.float() < scale_exact
    scale = torch.where(up, torch.nextafter(scale, scale.new_full((), torch.inf)), scale)
    tiny = torch.tensor(2.0**-24, dtype=torch.float16, device=values.device)
    return torch.maximum(scale, tiny), bias


def quantize_rows(
    values: torch.Tensor,
    *,
    precision: str,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``values`` ``(k, dim)`` row by row: returns ``(codes, params)``, ``codes``
    ``(k, code_bytes_per_row)`` uint8 and ``params`` ``(k, 2)`` fp16 (scale, bias).

    Args:
        values: the rows, any float dtype (computed in fp32).
        precision: ``int8`` or ``int4``.
        noise: ``u`` of each value (stochastic rounding, see :func:`rounding_noise`); None
            rounds to nearest.
    """
    levels = 2 ** QUANTIZED_BITS[precision] - 1
    x = values.float()
    k, dim = x.shape
    code_bytes_per_row(dim, precision)  # checks int4's dim
    scale, bias = _params(x, levels) if k else (x.new_empty(0, dtype=torch.float16),) * 2
    t = (x - bias.float().unsqueeze(1)) / scale.float().unsqueeze(1)
    t = t.add_(0.5) if noise is None else t.add_(noise)
    codes = t.floor_().clamp_(0, levels).to(torch.uint8)
    if levels == 15:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes, torch.stack([scale, bias], dim=1)


def dequantize_rows(codes: torch.Tensor, params: torch.Tensor, *, precision: str) -> torch.Tensor:
    """fp32 rows ``bias + code * scale`` of ``codes`` and ``params`` (see :func:`quantize_rows`)."""
    if QUANTIZED_BITS[precision] == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=2).flatten(1)
    p = params.float()
    return torch.addcmul(p[:, 1:2], codes.float(), p[:, 0:1])


class QuantizedRows:
    """A table shard's rows, quantized (see the module docstring): what a row cache reads
    rows from and writes evicted rows to, indexed like a ``(rows, dim)`` tensor.

    ``rows[ids]`` dequantizes rows ``ids`` (fp32); ``rows[ids] = values`` quantizes ``values``
    into them with stochastic rounding; ``rows.assign(values)`` writes every row, rounding to
    nearest.

    Args:
        codes: ``(rows, code_bytes_per_row(dim, precision))`` uint8 storage.
        params: ``(rows, 2)`` fp16 storage (scale, bias).
        precision: ``int8`` or ``int4``.
        dim: the row's values.
        key: :func:`table_key` of the run's seed and the table.
        row_start: the shard's first row in the table (rows are hashed by global row).
        col_start: the shard's first column in the table.
    """

    def __init__(
        self,
        codes: torch.Tensor,
        params: torch.Tensor,
        *,
        precision: Literal["int8", "int4"],
        dim: int,
        key: int,
        row_start: int = 0,
        col_start: int = 0,
    ):
        if codes.shape != (params.shape[0], code_bytes_per_row(dim, precision)):
            raise ValueError(
                f"{precision} codes of shape {tuple(codes.shape)} do not hold "
                f"{params.shape[0]} rows of dim {dim}"
            )
        self.codes, self.params = codes, params
        self.precision, self.dim = precision, dim
        self.key, self.row_start, self.col_start = key, row_start, col_start

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.params.shape[0], self.dim))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        """Bytes of the codes and parameters."""
        return self.codes.numel() + 2 * self.params.numel()

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.codes[ids], self.params[ids], precision=self.precision)

    def __setitem__(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        noise = rounding_noise(
            values, key=self.key, rows=ids + self.row_start, col_start=self.col_start
        )
        self.codes[ids], self.params[ids] = quantize_rows(
            values, precision=self.precision, noise=noise
        )

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """fp32 rows ``[start, end)``."""
        end = self.shape[0] if end is None else end
        return dequantize_rows(
            self.codes[start:end], self.params[start:end], precision=self.precision
        )

    @torch.no_grad()
    def assign(self, values: torch.Tensor, *, start: int = 0, chunk_rows: int = 65536) -> None:
        """Writes fp32 (or fp16) ``values`` into rows ``[start, start + len(values))``, rounding
        to nearest, ``chunk_rows`` rows at a time (no fp32 copy of the table)."""
        for lo in range(0, values.shape[0], chunk_rows):
            part = values[lo : lo + chunk_rows].to(self.device)
            codes, params = quantize_rows(part, precision=self.precision)
            self.codes[start + lo : start + lo + part.shape[0]] = codes
            self.params[start + lo : start + lo + part.shape[0]] = params


def block_code_columns(start: int, end: int, precision: str) -> tuple[int, int]:
    """The code columns (bytes) of value columns ``[start, end)`` of a row (``int4``: both
    even)."""
    bits = QUANTIZED_BITS[precision]
    if bits == 4 and (start % 2 or end % 2):
        raise ValueError(f"int4 columns [{start}, {end}) do not start and end on a byte")
    return start * bits // 8, end * bits // 8


def dequantize_blocks(
    codes: torch.Tensor,
    params: torch.Tensor,
    *,
    blocks: list[tuple[int, int]],
    precision: str,
) -> torch.Tensor:
    """fp32 rows of a checkpoint's quantized table (see :mod:`raydlrm.sharding.state`): the
    column blocks ``blocks`` (the saving plan's column shards) each quantized with their own
    scale and bias, ``params[:, 2k : 2k + 2]`` for block ``k``, their codes side by side."""
    out = torch.empty(codes.shape[0], blocks[-1][1] if blocks else 0)
    for k, (start, end) in enumerate(blocks):
        lo, hi = block_code_columns(start, end, precision)
        out[:, start:end] = dequantize_rows(
            codes[:, lo:hi], params[:, 2 * k : 2 * k + 2], precision=precision
        )
    return out
