"""Row-wise quantized table rows: the format of ``int8`` / ``int4`` embedding tables.

A row of ``dim`` values is stored as ``dim`` unsigned codes of ``bits`` bits (``int8``: one
byte each; ``int4``: two per byte, the even column in the low nibble, as fbgemm's fused 4-bit
rows) and an fp16 ``scale`` and ``bias``, and reads as ``bias + code * scale`` in fp32:

- ``bias`` is ``min(x)`` rounded down to fp16 and ``scale`` is ``(max(x) - bias) / L`` rounded
  up to fp16 (``L = 2**bits - 1``), so every value lies in ``[bias, bias + L * scale]``: no code
  clips;
- ``code = floor((x - bias) / scale + u)``: ``u`` uniform in ``[0, 1)`` is stochastic rounding
  (unbiased, an error below one ``scale``), ``u = 1/2`` rounds to nearest (at most half a
  ``scale``).

A table quantized column block by column block (the column shards of the plan that trained
it) keeps one scale and bias per row and block (:func:`dequantize_blocks`). The sharded tables
train such rows through an fp32 cache (:mod:`raydlrm.sharding.quantized`); exported models
read them (:class:`raydlrm.models.embedding.QuantizedTable`).
"""

from __future__ import annotations

import torch

__all__ = [
    "QUANTIZED_BITS",
    "block_code_columns",
    "code_bytes_per_row",
    "dequantize_blocks",
    "dequantize_rows",
    "quantize_rows",
    "quantized_precision",
]

QUANTIZED_BITS: dict[str, int] = {"int8": 8, "int4": 4}
"""Bits per stored value of each quantized weights precision."""


def code_bytes_per_row(dim: int, precision: str) -> int:
    """Bytes of a ``dim`` row's codes at ``precision`` (``int4``: ``dim`` must be even).

    Raises:
        ValueError: ``int4`` with an odd ``dim`` (two codes share a byte).
    """
    bits = QUANTIZED_BITS[precision]
    if bits == 4 and dim % 2:
        raise ValueError(f"int4 rows pack two codes per byte; dim {dim} is odd")
    return dim * bits // 8


def quantized_precision(embedding_dim: int, code_bytes: int) -> str:
    """The precision of a quantized table of ``embedding_dim`` columns whose rows have
    ``code_bytes`` bytes of codes: ``int8`` (one byte a value) or ``int4`` (two a byte).

    Raises:
        ValueError: ``code_bytes`` is neither.
    """
    if code_bytes == embedding_dim:
        return "int8"
    if 2 * code_bytes == embedding_dim:
        return "int4"
    raise ValueError(
        f"{code_bytes} bytes of codes per row hold neither int8 nor int4 rows of "
        f"dim {embedding_dim}"
    )


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
        noise: ``u`` of each value (stochastic rounding, see
            :func:`raydlrm.sharding.quantized.rounding_noise`); None
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
    """fp32 rows of a checkpoint's quantized table (see
    :mod:`raydlrm.sharding.embedding_checkpoint`): the
    column blocks ``blocks`` (the saving plan's column shards) each quantized with their own
    scale and bias, ``params[:, 2k : 2k + 2]`` for block ``k``, their codes side by side; on
    the codes' device (an exported model moved to a GPU looks up its rows there)."""
    out = torch.empty(codes.shape[0], blocks[-1][1] if blocks else 0, device=codes.device)
    for k, (start, end) in enumerate(blocks):
        lo, hi = block_code_columns(start, end, precision)
        out[:, start:end] = dequantize_rows(
            codes[:, lo:hi], params[:, 2 * k : 2 * k + 2], precision=precision
        )
    return out
