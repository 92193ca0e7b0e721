"""A shard's ``int8`` / ``int4`` rows (``sharding.weights_precision``), in the row-wise format of
:mod:`raydlrm.models.quantized` (codes plus an fp16 scale and bias per row; fbgemm's 4-bit
row-wise layout, and for 8 bits fp16 parameters where fbgemm keeps fp32, 4 bytes less a row):
codes and parameters are two tensors, ``(rows, dim * bits / 8)`` ``uint8`` and ``(rows, 2)``
fp16, so either may live in DRAM, on a GPU or in a mapped file (:mod:`raydlrm.sharding.tiers`).

The tables are never trained in low precision: the kernels train an fp32 cache of the rows a
step looks up (:mod:`raydlrm.sharding.row_cache`); a row is quantized when the cache evicts it
after updating it, and when a checkpoint flushes the cache. Both kernels therefore train
quantized tables, on CPU and CUDA: fbgemm's TBE only ever sees fp32 slots (its own int8
training and its UVM cache are CUDA-only and are not used).

A row written back is quantized with stochastic rounding (unbiased, an error below one step);
the initial rows and conversions round to nearest.

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

from raydlrm.models.quantized import code_bytes_per_row, dequantize_rows, quantize_rows

__all__ = ["QuantizedRows", "rounding_noise", "table_key"]


_MASK32 = 0xFFFFFFFF


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
