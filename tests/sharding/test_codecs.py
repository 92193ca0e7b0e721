"""Compressed communication: codec round-trip bounds, wire sizes, and multi-process parity.

The bounds checked are those stated in :mod:`raydlrm.sharding.codecs`. The distributed test
trains the same sharded model on 2 gloo ranks once per codec (one launch) and compares with the
fp32-comms run: fp32 is exact against the unsharded reference path, the others stay within their
codec's bound and are not exact (so the codec really ran).
"""

from __future__ import annotations

import math

import pytest
import torch

from raydlrm.sharding import ShardedEmbeddingBagCollection, ShardingConfig, plan_sharding
from raydlrm.sharding.codecs import CODECS, ColumnBlockCodec, Mx4Codec
from raydlrm.sharding.sizes import wire_bytes_per_vector
from tests._multiprocess import run_distributed
from tests.sharding._fixtures import (
    GLOBAL_BATCH,
    SPLITS,
    TinyModel,
    feature_rows,
    gather_full_tables,
    global_batch,
    make_tables,
    targets,
)

PRECISIONS = ["fp32", "fp16", "bf16", "fp8", "int8", "mx4"]
# Relative error bound of a value (int8: of the row's absolute maximum, range <= 2 max|x|;
# mx4: of its block's absolute maximum, at most the row's).
REL = {"fp32": 0.0, "fp16": 2**-11, "bf16": 2**-8, "fp8": 1 / 16, "int8": 2 / 510, "mx4": 1 / 5}
# Payload bytes of one row of ``cols`` values.
ROW_BYTES = {
    "fp32": lambda c: 4 * c,
    "fp16": lambda c: 2 * c,
    "bf16": lambda c: 2 * c,
    "fp8": lambda c: c + 4,
    "int8": lambda c: c + 8,
    "mx4": lambda c: math.ceil(c / 2) + math.ceil(c / 32),
}


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of each value's block of 32 along its row (mx4's ``m``)."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.abs(), (0, -cols % 32)).view(rows, -1, 32)
    return padded.amax(dim=2).repeat_interleave(32, dim=1)[:, :cols]


def _bound(precision: str, x: torch.Tensor) -> torch.Tensor:
    """The stated per-value round-trip error bound of a ``(rows, cols)`` block ``x``."""
    if precision == "mx4":
        return torch.maximum(x.abs() / 5, _block_absmax(x) / 14).clamp(min=2**-129)
    absmax = x.abs().amax(dim=1, keepdim=True)
    spread = x.amax(dim=1, keepdim=True) - x.amin(dim=1, keepdim=True)
    return {
        "fp32": torch.zeros_like(x),
        "fp16": x.abs() * 2**-11 + 2**-25,
        "bf16": x.abs() * 2**-8,
        "fp8": x.abs() / 16 + absmax * 2**-17,
        # fp32 arithmetic of the dequantization adds a few ulps of the row's range.
        "int8": (spread / 510 * (1 + 1e-5)).expand_as(x),
    }[precision]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_round_trip_within_bound(precision: str) -> None:
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes (as gradients are), some below fp16's normal range.
    x = torch.randn(64, 24, generator=gen) * torch.logspace(-3, 2, 64).unsqueeze(1)
    codec = CODECS[precision]
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8
    assert payload.numel() == codec.payload_bytes(64, 24) == 64 * ROW_BYTES[precision](24)
    y = codec.decode(payload, rows=64, cols=24, dtype=torch.float32)
    err = (y - x).abs()
    assert bool((err <= _bound(precision, x)).all()), (err - _bound(precision, x)).max()
    if precision == "fp32":
        assert torch.equal(y, x)
    else:
        # The bound is reasonably tight: the worst error uses at least a tenth of it.
        assert float((err / _bound(precision, x).clamp(min=1e-30)).max()) > 0.1


def test_column_block_codec_mixes_precisions_and_merges_runs() -> None:
    codec = ColumnBlockCodec.from_columns(
        [("fp16", 4), ("fp16", 8), ("int8", 4), ("fp32", 0), ("fp8", 12)]
    )
    assert [(c.name, w) for c, w in codec.runs] == [("fp16", 12), ("int8", 4), ("fp8", 12)]
    assert codec.bytes_by_codec(3) == {"fp16": 3 * 24, "int8": 3 * 12, "fp8": 3 * 16}
    x = torch.randn(3, 28)
    y = codec.decode(codec.encode(x), rows=3, dtype=torch.float32)
    torch.testing.assert_close(y[:, :12], x[:, :12], atol=0, rtol=2**-11)
    assert bool(((y[:, 12:16] - x[:, 12:16]).abs() <= _bound("int8", x[:, 12:16])).all())
    assert bool(((y[:, 16:] - x[:, 16:]).abs() <= _bound("fp8", x[:, 16:])).all())
    empty = ColumnBlockCodec.from_columns([])
    assert empty.payload_bytes(5) == 0
    assert empty.decode(empty.encode(torch.empty(5, 0)), rows=5, dtype=torch.float32).shape == (
        5,
        0,
    )


def test_unknown_table_in_per_table_precision_is_rejected() -> None:
    tables = make_tables()
    config = ShardingConfig(comm_precision_per_table={"t1": "fp16", "nope": "int8"})
    with pytest.raises(ValueError, match=r"comm_precision_per_table.*\['nope'\]"):
        ShardedEmbeddingBagCollection(
            TinyModel(tables).embedding_bags,
            plan=plan_sharding(tables, world_size=1, config=config),
            config=config,
            device="cpu",
        )


# Every sharded type but data-parallel (whose gradient all-gather is uncompressed).
TYPES = {"t0": "column_wise", "t1": "row_wise", "t2": "table_wise", "t3": "table_row_wise"}
SCENARIOS = [{"comm_precision": p} for p in PRECISIONS]
SCENARIOS.append(
    {"comm_precision": "fp16", "comm_precision_per_table": {"t0": "int8", "t2": "fp8"}}
)
SCENARIOS.append({"comm_precision": "mx4", "comm_precision_per_table": {"t1": "bf16"}})
LR = 0.1
NUM_STEPS = 2


def _config(sc: dict) -> ShardingConfig:
    return ShardingConfig(pinned_types=TYPES, optimizer="sgd", learning_rate=LR, **sc)


def _run(rank: int, world_size: int, sc: dict) -> dict:
    tables, config = make_tables(), _config(sc)
    start = sum(SPLITS[world_size][:rank])
    rows = torch.arange(start, start + SPLITS[world_size][rank])
    model = TinyModel(tables)
    ebc = ShardedEmbeddingBagCollection(
        model.embedding_bags,
        plan=plan_sharding(tables, world_size=world_size, config=config),
        config=config,
        device="cpu",
    )
    pooled = []
    for step in range(NUM_STEPS):
        kjt = global_batch(step, weighted=False, rows=feature_rows(tables)).index_rows(rows)
        values = ebc(kjt).values
        pred = model.dense(values).squeeze(1)
        loss = ((pred - targets(step)[rows]) ** 2).sum() * world_size / GLOBAL_BATCH
        loss.backward()
        pooled.append(values.detach())
    return {
        "pooled": pooled,
        "tables": gather_full_tables(ebc, dst=0),
        "bytes": ebc.comm_bytes(),
        "codec_cols": [codecs[0].cols for codecs in ebc._output.codecs],  # one batch class
    }


def _worker(rank: int, world_size: int) -> list[dict]:
    return [_run(rank, world_size, sc) for sc in SCENARIOS]


def _expected_bytes(precision: str, cols: list[int], rank: int) -> tuple[int, int]:
    """Forward and backward bytes rank ``rank`` of 2 sends with a uniform precision."""
    other = 1 - rank
    batch = SPLITS[2]
    row = ROW_BYTES[precision]
    return batch[other] * row(cols[rank]), batch[rank] * row(cols[other])


@pytest.mark.distributed
def test_codecs_parity_two_ranks() -> None:
    results = run_distributed(_worker, world_size=2, timeout_s=120)
    initial = {k: w.detach() for k, w in TinyModel(make_tables()).embedding_bags.weights.items()}
    fp32 = {r: results[r][0] for r in range(2)}
    for i, sc in enumerate(SCENARIOS):
        precision = sc["comm_precision"]
        mixed = "comm_precision_per_table" in sc
        for rank in range(2):
            got, ref = results[rank][i], fp32[rank]
            # Forward of step 0: the fp32 output through the codec. Row-split tables send partial
            # sums that may exceed (and cancel in) the result, so the bound is taken per row,
            # with a factor of 4: ``err <= 4 * rel * max|row|`` (int8: ``4 * range / 510``).
            ref0 = ref["pooled"][0]
            err = (got["pooled"][0] - ref0).abs()
            worst = max([precision, *sc.get("comm_precision_per_table", {}).values()], key=REL.get)
            bound = 4 * REL[worst] * ref0.abs().amax(dim=1, keepdim=True) + 1e-7
            assert bool((err <= bound).all()), (precision, rank, float((err / bound).max()))
            if precision == "fp32" and not mixed:
                for g, r in zip(got["pooled"], ref["pooled"], strict=True):
                    assert torch.equal(g, r)
            else:
                assert float(err.max()) > 0, sc
            # Wire bytes: exactly the codec's payload sizes.
            fwd, bwd = got["bytes"]["forward"], got["bytes"]["backward"]
            if mixed:
                assert set(fwd) | set(bwd) <= {precision, *sc["comm_precision_per_table"].values()}
                assert sum(fwd.values()) <= sum(ref["bytes"]["forward"].values()) / 2
            else:
                exp_fwd, exp_bwd = _expected_bytes(precision, got["codec_cols"], rank)
                assert fwd == {precision: NUM_STEPS * exp_fwd}, (precision, fwd)
                assert bwd == {precision: NUM_STEPS * exp_bwd}, (precision, bwd)
            assert got["bytes"]["input"] == ref["bytes"]["input"]
        # Updated rows (SGD): the update ``-lr * grad`` is off by at most the codec's relative
        # error of the gradient (plus what the forward error does to the dense-side gradient).
        tol = {"fp32": 0.0, "fp16": 2e-3, "bf16": 2e-2, "fp8": 0.15, "int8": 0.1, "mx4": 0.3}
        rel = max(tol[p] for p in [precision, *sc.get("comm_precision_per_table", {}).values()])
        for name, weight in fp32[0]["tables"].items():
            step_ref = weight - initial[name]
            step_got = results[0][i]["tables"][name] - initial[name]
            err = float((step_got - step_ref).abs().max())
            assert err <= rel * float(step_ref.abs().max()), (sc, name, err)
    # Ratios of the total wire bytes to fp32's.
    total = [
        sum(sum(results[0][i]["bytes"][d].values()) for d in ("forward", "backward"))
        for i in range(len(SCENARIOS))
    ]
    ratios = dict(zip(PRECISIONS, (t / total[0] for t in total), strict=False))
    assert ratios["fp16"] == ratios["bf16"] == 0.5
    assert 0.25 < ratios["fp8"] < ratios["int8"] < 0.5
    assert ratios["mx4"] < 0.2  # dims 4-12: 4 bits plus an exponent byte per row and table


# mx4 (OCP MX FP4): sizes, bounds at the edges, exact codes, agreement with fbgemm's reference.


def test_mx4_payload_bytes_follow_from_the_shape() -> None:
    codec = CODECS["mx4"]
    for rows in (0, 1, 5):
        for cols in (0, 1, 2, 16, 31, 32, 33, 64, 100, 128):
            expected = rows * (math.ceil(cols / 2) + math.ceil(cols / 32))
            assert codec.payload_bytes(rows, cols) == expected
            payload = codec.encode(torch.randn(rows, cols))
            assert payload.dtype == torch.uint8 and payload.numel() == expected
            y = codec.decode(payload, rows=rows, cols=cols, dtype=torch.float32)
            assert y.shape == (rows, cols)
    # 4.25 bits per value at a multiple of 32: 68 of fp32's 512 bytes per 128-row.
    assert codec.payload_bytes(1, 128) / (4 * 128) == 68 / 512


def test_wire_bytes_of_the_cost_model_are_the_codecs_payloads() -> None:
    for precision, codec in CODECS.items():
        for dim in (1, 4, 7, 16, 31, 32, 33, 64, 100, 128):
            assert wire_bytes_per_vector(dim, precision=precision) == codec.payload_bytes(1, dim)


def test_mx4_round_trip_within_bound_at_every_magnitude() -> None:
    gen = torch.Generator().manual_seed(1)
    codec = CODECS["mx4"]
    for cols in (1, 7, 24, 32, 33, 100, 128):
        # Rows from fp32 subnormals (1e-44) to 1e37, a zero row, and a row whose blocks mix
        # one huge value with tiny ones.
        x = torch.randn(40, cols, generator=gen) * torch.logspace(-44, 37, 40).unsqueeze(1)
        x[3] = 0
        x[5] = torch.randn(cols, generator=gen) * 1e-30
        x[5, ::32] = 1e30
        y = codec.decode(codec.encode(x), rows=40, cols=cols, dtype=torch.float32)
        err, bound = (y - x).abs(), _bound("mx4", x)
        assert bool((err <= bound).all()), (cols, float((err / bound).max()))
        assert torch.equal(y[3], x[3])
        if cols >= 24:  # the bound is tight: some value uses most of it
            assert float((err / bound).max()) > 0.5
    # Decoding to a narrower dtype is the fp32 result cast.
    x = torch.randn(3, 40, generator=gen)
    payload = codec.encode(x)
    torch.testing.assert_close(
        codec.decode(payload, rows=3, cols=40, dtype=torch.bfloat16),
        codec.decode(payload, rows=3, cols=40, dtype=torch.float32).bfloat16(),
        atol=0,
        rtol=0,
    )


def test_mx4_exact_codes_of_a_hand_made_block() -> None:
    # Block maximum 7 = 7 * 2**0: exponent 0 (byte 127); x / 1 rounds to the nearest E2M1
    # value, ties to even (5 -> 4, 3.5 -> 4, 2.5 -> 2, 1.75 -> 2, 1.25 -> 1, 0.75 -> 1,
    # 0.25 -> 0), -6.5 and 7 saturate to 6, -0.1 is -0 (code 8).
    row = [6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25]
    row += [-6.5, 7.0, -0.1, 0.0, 2.9, -1.5, 0.5, 4.1]
    codes = [7, 6, 6, 4, 4, 2, 2, 0, 15, 7, 8, 0, 5, 11, 1, 6]
    decoded = [6.0, 4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 0.0, -6.0, 6.0, -0.0, 0.0, 3.0, -1.5, 0.5, 4.0]
    x = torch.tensor([row, [v * 2**-10 for v in row], [0.0] * 16, [7.01] + [0.0] * 15])
    payload = Mx4Codec().encode(x)
    assert payload.numel() == 4 * (8 + 1)
    packed = [lo | (hi << 4) for lo, hi in zip(codes[::2], codes[1::2], strict=True)]
    assert payload[:8].tolist() == packed  # the even column in the low nibble
    assert payload[8:16].tolist() == packed
    assert payload[16:24].tolist() == [0] * 8
    # 7.01 > 7 * 2**0: exponent 1, 7.01 / 2 rounds to 4 (code 6).
    assert payload[24:32].tolist() == [6] + [0] * 7
    assert payload[32:].tolist() == [127, 117, 0, 128]  # e + 127; a zero block: -127
    y = Mx4Codec().decode(payload, rows=4, cols=16, dtype=torch.float32)
    assert y[0].tolist() == decoded
    assert y[1].tolist() == [v * 2**-10 for v in decoded]
    assert y[3].tolist() == [8.0] + [0.0] * 15
    assert y[0, 10].item() == 0.0 and math.copysign(1.0, y[0, 10].item()) == -1.0


def test_mx4_non_finite_blocks_decode_to_nan_and_huge_values_saturate() -> None:
    x = torch.ones(3, 40)
    x[0, 3] = float("nan")
    x[1, 35] = float("inf")
    x[1, 33] = -1.0
    x[2, :32] = 3e38  # above 1.75 * 2**127: exponent 125, saturates at 1.5 * 2**127
    payload = CODECS["mx4"].encode(x)
    assert payload[-6:].tolist() == [255, 125, 125, 255, 252, 125]
    # A non-finite block's codes: 0 but for the sign bits (the same bytes on every device).
    codes = payload[:60].view(3, 20)
    assert codes[0, :16].tolist() == [0] * 16
    assert codes[1, 16:].tolist() == [0x80] + [0] * 3
    y = CODECS["mx4"].decode(payload, rows=3, cols=40, dtype=torch.float32)
    assert bool(y[0, :32].isnan().all()) and bool((y[0, 32:] == 1).all())
    assert bool(y[1, 32:].isnan().all()) and bool((y[1, :32] == 1).all())
    assert bool((y[2, :32] == 1.5 * 2.0**127).all()) and bool((y[2, 32:] == 1).all())


def test_mx4_bytes_equal_fbgemm_reference() -> None:
    """Our codes and exponents are those of fbgemm's ``fp32_to_mx4`` (its CPU reference, default
    rounding), laid out per block there (16 code bytes, then the exponent byte)."""
    quantize_utils = pytest.importorskip("fbgemm_gpu.quantize_utils")
    gen = torch.Generator().manual_seed(2)
    rows, cols = 96, 64
    # Random values (no exact ties, which fbgemm rounds away from zero) from 1e-42 to 1e37,
    # and a zero row.
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-42, 37, rows).unsqueeze(1)
    x[7] = 0
    ours = CODECS["mx4"].encode(x)
    codes, exps = ours[: rows * cols // 2].view(rows, 2, 16), ours[rows * cols // 2 :]
    fbgemm = quantize_utils.fp32_to_mx4(x, 32).view(rows, 2, 17)
    assert torch.equal(fbgemm[..., :16], codes)
    assert torch.equal(fbgemm[..., 16].reshape(-1), exps)
    torch.testing.assert_close(
        CODECS["mx4"].decode(ours, rows=rows, cols=cols, dtype=torch.float32),
        quantize_utils.mx4_to_fp32(fbgemm.view(rows, -1), 32).view(rows, cols),
        atol=0,
        rtol=0,
    )


@pytest.mark.gpu
def test_mx4_on_cuda_matches_cpu() -> None:
    """The same PyTorch operators on a GPU: the CPU's bytes and values (ties and subnormals
    included)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 100, generator=gen) * torch.logspace(-44, 37, 64).unsqueeze(1)
    x[0, :16] = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] * 2)  # ties
    x[1] = 0
    x[2, 40] = float("nan")
    codec = CODECS["mx4"]
    cpu, cuda = codec.encode(x), codec.encode(x.cuda())
    differ = (cuda.cpu() != cpu).nonzero().flatten().tolist()
    assert not differ, f"bytes {differ[:8]} of {cpu.numel()} differ (64 rows of 50 + 4 bytes)"
    y_cpu = codec.decode(cpu, rows=64, cols=100, dtype=torch.float32)
    y_cuda = codec.decode(cuda, rows=64, cols=100, dtype=torch.float32)
    torch.testing.assert_close(y_cuda.cpu(), y_cpu, atol=0, rtol=0, equal_nan=True)
