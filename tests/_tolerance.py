"""Tolerances of the parity tests, derived from the arithmetic rather than tuned on one CPU.

Two float32 computations of the same value that add the same terms in another order (another
kernel, another SIMD width: torch and fbgemm pick AVX2 or AVX-512 kernels by CPU, a reduction
over another number of ranks, duplicates summed first) differ by rounding alone. Recursive
summation of ``n`` terms errs by at most ``gamma(n - 1) * sum|x_i|`` whatever the order, with
``gamma(k) = k u / (1 - k u)`` and ``u = 2**-24`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., eq. 4.4); pairwise and blocked (SIMD) orders err less. Two orders
therefore differ by at most twice that, ``(n - 1) * EPS32 * sum|x_i|`` to first order
(``EPS32 = 2u``), and a value that goes through ``k`` such sums in a chain (layers, training
steps) by about ``k`` times that. So a parity test compares with

    atol = k * n_terms * EPS32 * magnitude,  rtol = 0

where ``n_terms`` is the most terms any one compared value sums, ``magnitude`` bounds
``sum|x_i|`` (the compared values' largest magnitude when the terms do not cancel much; a test
states its bound, and checks it where it is not obvious), and ``k`` counts the chained sums.
A wrong row or a wrong gradient moves a value by far more (a step's update, a row's size), so
the tests still fail on them.

Training several steps adds the optimizer's gain: an update's difference per unit of gradient
difference. SGD's is ``lr``; Adagrad's and Adam's ``lr * g / (sqrt(G) + eps)`` is up to
``lr / eps``, which with ``eps = 1e-8`` turns a rounding difference in a gradient that cancels to
near zero into a visible one (``test_managed_tables_in_a_dedup_group_train_as_without`` failed
on one such element, 1.66e-6, on an AVX-512 CPU). Tests that compare trained weights across
summation orders set ``eps`` so that ``lr / eps`` is about 1, or train with SGD.

Where the claim is "the same arithmetic in the same order" (a checkpoint loaded, a cache that
trains a table as the table itself, a replicated computation), the tests compare exactly
(``torch.equal``), not within a tolerance.
"""

from __future__ import annotations

import torch

__all__ = ["EPS16", "EPS32", "assert_sums_close", "sum_order_tol"]

EPS32 = torch.finfo(torch.float32).eps
"""2**-23: float32's spacing at 1 (a rounding errs by at most half of it, relatively)."""
EPS16 = torch.finfo(torch.float16).eps
"""2**-10: float16's spacing at 1."""


def sum_order_tol(n_terms: int, magnitude: float, *, k: float = 1.0) -> dict[str, float]:
    """``torch.testing.assert_close`` tolerances for two float32 results that sum the same
    terms in different orders (see the module docstring).

    Args:
        n_terms: the most terms summed into any one compared value.
        magnitude: a bound of the terms' absolute sum (``sum|x_i|``) of every compared value.
        k: the chained sums (and gains) a value goes through; 1 for a single sum.

    Returns:
        ``{"atol": k * n_terms * EPS32 * magnitude, "rtol": 0.0}``.
    """
    return {"atol": k * n_terms * EPS32 * magnitude, "rtol": 0.0}


def assert_sums_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    n_terms: int,
    k: float = 1.0,
    msg: str | None = None,
) -> None:
    """``actual`` equals ``expected`` within :func:`sum_order_tol`, the magnitude being
    ``expected``'s largest: it stands for the terms' absolute sum of every element, exact where
    the terms share a sign, and covering an element whose terms cancel (its sum is small, its
    terms no larger than elsewhere); ``k`` takes any further cancellation."""
    magnitude = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, **sum_order_tol(n_terms, magnitude, k=k), msg=msg)
