"""The jagged sequence operations equal their padded dense references, values and gradients
(float64: the same arithmetic up to summation order), and bucketed attention pads each sample
to less than twice its length."""

from __future__ import annotations

import pytest
import torch

from raydlrm.batch import JaggedTensor
from raydlrm.models.sequence_ops import (
    _length_buckets,
    causal_attention,
    segment_softmax,
    segment_sum,
    single_rows,
)

LENGTHS = torch.tensor([3, 0, 1, 7, 4, 2, 9, 16, 5])  # an empty history; buckets of 1 to 16
TOL = {"atol": 1e-12, "rtol": 1e-12}


def _rows(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = int(LENGTHS.sum())
    return torch.randn(n, *shape, generator=gen, dtype=torch.float64).requires_grad_()


def _padded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return JaggedTensor(values=values, lengths=LENGTHS).to_padded()


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), inputs)


def test_segment_sum_equals_padded_sum() -> None:
    x = _rows(3)
    got = segment_sum(JaggedTensor(values=x, lengths=LENGTHS))
    padded, _ = _padded(x)
    want = padded.sum(dim=1)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got[1], torch.zeros(3, dtype=torch.float64))
    for a, b in zip(_grads(got, (x,)), _grads(want, (x,)), strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("heads", [(), (2,)])
def test_segment_softmax_equals_masked_padded_softmax(heads: tuple[int, ...]) -> None:
    x = _rows(*heads)
    got = segment_softmax(JaggedTensor(values=x * 30, lengths=LENGTHS))  # large: needs the shift
    padded, mask = _padded(x * 30)
    mask = mask.view(*mask.shape, *[1] * len(heads))
    weights = padded.masked_fill(~mask, float("-inf")).softmax(dim=1)
    want = weights[mask.expand_as(weights)].view(-1, *heads)
    torch.testing.assert_close(got.values, want, **TOL)
    assert torch.isfinite(got.values).all()
    for a, b in zip(_grads(got.values, (x,)), _grads(want, (x,)), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the whole batch padded to its longest history, padding masked."""
    (qp, mask), (kp, _), (vp, _) = _padded(q), _padded(k), _padded(v)  # (B, L, H, D)
    scores = torch.einsum("blhd,bmhd->bhlm", qp, kp) / q.shape[-1] ** 0.5
    width = mask.shape[1]
    allowed = torch.ones(width, width, dtype=torch.bool).tril() & mask[:, None, None, :]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1).nan_to_num()
    out = torch.einsum("bhlm,bmhd->blhd", weights, vp)
    return out[mask]


def test_causal_attention_equals_padded_reference() -> None:
    q, k, v = _rows(2, 4, seed=1), _rows(2, 4, seed=2), _rows(2, 3, seed=3)
    got = causal_attention(q, key=k, value=v, lengths=LENGTHS)
    want = _reference_attention(q, k, v)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_causal_attention_of_empty_histories() -> None:
    empty = torch.zeros(0, 2, 4)
    out = causal_attention(empty, key=empty, value=empty, lengths=torch.zeros(3, dtype=torch.int64))
    assert out.shape == (0, 2, 4)


def test_buckets_pad_each_history_to_less_than_twice_its_length() -> None:
    buckets = _length_buckets(LENGTHS, device=torch.device("cpu"))
    padded = sum(b.count * b.width for b in buckets)
    assert padded < 2 * int(LENGTHS.sum())
    # Every position in exactly one bucket; the whole batch padded would be 9 x 16 = 144.
    assert sorted(torch.cat([b.sources for b in buckets]).tolist()) == list(range(47))
    assert len(buckets) == 5 and padded == 57


def test_single_rows_needs_one_position_per_sample() -> None:
    rows = torch.randn(3, 4)
    assert single_rows("item", jagged=JaggedTensor(rows, torch.ones(3, dtype=torch.int64))) is rows
    with pytest.raises(ValueError, match="feature 'item' must have exactly one id per sample"):
        single_rows("item", jagged=JaggedTensor(rows, torch.tensor([2, 0, 1])))
    with pytest.raises(ValueError, match="feature 'item' must have exactly one id per sample"):
        single_rows("item", jagged=JaggedTensor(rows[:2], torch.tensor([1, 0, 1])))


def test_segment_ops_take_an_empty_batch() -> None:
    """A rank whose data ran out still runs the model on an empty batch."""
    from raydlrm.batch import JaggedTensor

    empty = JaggedTensor(values=torch.zeros(0, 3), lengths=torch.zeros(0, dtype=torch.int64))
    assert segment_sum(empty).shape == (0, 3)
    assert segment_softmax(empty).values.shape == (0, 3)
