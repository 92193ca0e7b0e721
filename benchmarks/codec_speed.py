"""Bytes per value and encode/decode time of each all-to-all codec, side by side in one run.

Every codec of :mod:`raydlrm.sharding.codecs` (``sharding.comm_precision``) encodes and decodes
the same fp32 blocks of normally distributed values: one block per shape, timed in interleaved
repeats (the codec order rotates each repeat, so that the noise of a shared machine falls on all
of them alike), medians reported. Encode is the block to its ``uint8`` payload, decode the
payload back to an fp32 block, as the pooled-embedding all-to-all runs them (forward: encode
before, decode after; backward the same on the gradients).

Default shapes: ``4096x128``; ``26624x16``: a batch of 1024 times 26 tables (Criteo's sparse
features) of dim 16 (``configs/quickstart.toml``), one pooled vector a row; ``1024x416``: the same
values as the all-to-all lays them out (a sample a row, the tables' columns side by side).

Codecs: ``fp32 fp16 bf16 fp8 int8 mx4`` run the PyTorch operators (``sharding.kernel =
"torch"``; ``mx4`` runs them with either kernel); ``fp8-fbgemm`` and ``int8-fbgemm`` fbgemm's
(``kernel = "fbgemm"``); ``mx4-fbgemm-ref`` fbgemm 1.8's ``fp32_to_mx4`` / ``mx4_to_fp32`` on
the CPU (its reference in PyTorch operators; its CUDA kernels are Triton), for comparison only.
Columns: payload bytes per value and its ratio to fp32's 4, median encode and decode
milliseconds, their sum per value in nanoseconds, and the largest round-trip error relative to
its row's absolute maximum (a sanity check of the codec, not a benchmark).

``--exponent-rules`` adds the round-trip error of three rules for MX4's shared exponent on
blocks of 32 values from a few distributions (a reference quantizer: nearest E2M1 value, ties to
even, magnitudes above 6 saturating): ``ocp``, OCP's ``floor(log2(m)) - 2`` (the block maximum
``m`` maps into ``[4, 8)``, values above 6 clamp); ``no-clamp``, the smallest ``e`` with ``m <= 6
2**e``; ``mx4``, the codec's, the smallest ``e`` with ``m <= 7 2**e`` (checked equal to the
codec's output). Columns: RMS and largest error relative to the block maximum, RMS error
relative to the RMS value, and the mean signed error of each block's largest value relative to
the block maximum (negative: shrunk toward 0).

Usage::

    python benchmarks/codec_speed.py [--shapes 4096x128,26624x16,1024x416] [--repeats 21]
        [--threads 1] [--codecs fp32,fp16,bf16,fp8,int8,mx4,fp8-fbgemm,int8-fbgemm,mx4-fbgemm-ref]
        [--exponent-rules]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from raydlrm.sharding.codecs import CODECS, codecs_for

DEFAULT_CODECS = "fp32,fp16,bf16,fp8,int8,mx4,fp8-fbgemm,int8-fbgemm,mx4-fbgemm-ref"

Encode = Callable[[torch.Tensor], torch.Tensor]
Decode = Callable[[torch.Tensor, int, int], torch.Tensor]


def _codec(name: str) -> tuple[Encode, Decode]:
    """``(encode, decode)`` of codec variant ``name``."""
    if name == "mx4-fbgemm-ref":
        from fbgemm_gpu.quantize_utils import fp32_to_mx4, mx4_to_fp32

        def decode_ref(payload: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
            padded = -(-cols // 32) * 32
            return mx4_to_fp32(payload, 32).view(rows, padded)[:, :cols]

        return (lambda block: fp32_to_mx4(block, 32).view(-1)), decode_ref
    precision, _, kernel = name.partition("-")
    codec = codecs_for(kernel or "torch")[precision]

    def decode(payload: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return codec.decode(payload, rows=rows, cols=cols, dtype=torch.float32)

    return codec.encode, decode


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _mx4_reference(blocks: torch.Tensor, rule: str) -> torch.Tensor:
    """``(n, 32)`` fp32 blocks through MX4 with shared-exponent ``rule``, in float64."""
    m = blocks.abs().amax(dim=1, keepdim=True).double()
    frac, k = torch.frexp(m)  # m = frac 2**k, frac in [0.5, 1)
    bump = {"ocp": 2.0, "no-clamp": 0.75, "mx4": 0.875}[rule]  # e = k - 3, + 1 above it
    e = (k - 3 + (frac > bump).int()).double()
    y = (blocks.abs().double() / 2**e).clamp(max=6.0)
    # Nearest E2M1 value, ties to the even code (the lower of two neighbours when its index is
    # even): argmin over |y - v| picks the first minimum, so break ties by a tiny odd penalty.
    dist = (y.unsqueeze(-1) - _E2M1).abs() + torch.arange(8) % 2 * 1e-12
    return (_E2M1[dist.argmin(dim=-1)] * 2**e * blocks.sign().double()).float()


def _exponent_rules() -> None:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # torch.distributions draw from the global generator
    n = 20_000
    dists = {
        "normal": torch.randn(n, 32, generator=gen),
        "uniform": torch.rand(n, 32, generator=gen) * 2 - 1,
        "laplace": torch.distributions.Laplace(0.0, 1.0).sample((n, 32)),
        "student-t 3": torch.distributions.StudentT(3.0).sample((n, 32)),
    }
    mx4 = CODECS["mx4"]
    print("\nMX4 shared-exponent rules, 20,000 blocks of 32 per distribution")
    print(
        "| values | rule | RMS err / m | max err / m | RMS err / RMS x | block max: mean err / m |"
    )
    print("|---|---|---|---|---|---|")
    for name, blocks in dists.items():
        m = blocks.abs().amax(dim=1, keepdim=True)
        for rule in ("ocp", "no-clamp", "mx4"):
            y = _mx4_reference(blocks, rule)
            if rule == "mx4":  # the reference is the codec
                assert torch.equal(
                    mx4.decode(mx4.encode(blocks), rows=n, cols=32, dtype=y.dtype), y
                )
            err = y - blocks
            top = blocks.abs() == m
            print(
                f"| {name} | {rule} | {float((err / m).pow(2).mean().sqrt()):.4f} "
                f"| {float((err.abs() / m).max()):.3f} "
                f"| {float(err.pow(2).mean().sqrt() / blocks.pow(2).mean().sqrt()):.4f} "
                f"| {float(((y.abs() - blocks.abs()) / m)[top].mean()):+.4f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x128,26624x16,1024x416")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS)
    parser.add_argument("--exponent-rules", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.codecs.split(",")
    codecs = {n: _codec(n) for n in names}
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} thread(s), {args.repeats} repeats, medians"
    )
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        block = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
        absmax = block.abs().amax(dim=1, keepdim=True)
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        sizes, errors = {}, {}
        for name, (encode, decode) in codecs.items():  # warm-up, sizes and errors
            payload = encode(block)
            sizes[name] = payload.numel()
            errors[name] = float(((decode(payload, rows, cols) - block).abs() / absmax).max())
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                encode, decode = codecs[name]
                start = time.perf_counter()
                payload = encode(block)
                encoded = time.perf_counter()
                decode(payload, rows, cols)
                times[name].append((encoded - start, time.perf_counter() - encoded))
        base = sizes.get("fp32", rows * cols * 4)
        print(f"\nblock {rows} x {cols} ({rows * cols:,} values)")
        print(
            "| codec | bytes/value | of fp32 | encode ms | decode ms | enc+dec ms "
            "| enc+dec ns/value | max err / row max |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in names:
            enc = statistics.median(t for t, _ in times[name])
            dec = statistics.median(t for _, t in times[name])
            both = statistics.median(a + b for a, b in times[name])
            print(
                f"| {name} | {sizes[name] / (rows * cols):.4f} | {sizes[name] / base:.4f} "
                f"| {enc * 1e3:.3f} | {dec * 1e3:.3f} | {both * 1e3:.3f} "
                f"| {both * 1e9 / (rows * cols):.2f} | {errors[name]:.2e} |",
                flush=True,
            )
    if args.exponent_rules:
        _exponent_rules()


if __name__ == "__main__":
    main()
