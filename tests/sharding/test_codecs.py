"""Compressed communication: codec round-trip bounds, wire sizes, and multi-process parity.

The bounds checked are those stated in :mod:`raydlrm.sharding.codecs`. The distributed test
trains the same sharded model on 2 gloo ranks once per codec (one launch) and compares with the
fp32-comms run: fp32 is exact against the unsharded reference path, the others stay within their
codec's bound and are not exact (so the codec really ran).
"""

from __future__ import annotations

import pytest
import torch

from raydlrm.sharding import ShardedEmbeddingBagCollection, ShardingConfig, plan_sharding
from raydlrm.sharding.codecs import CODECS, ColumnBlockCodec
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

PRECISIONS = ["fp32", "fp16", "bf16", "fp8", "int8"]
# Relative error bound of a value (int8: of the row's absolute maximum, range <= 2 max|x|).
REL = {"fp32": 0.0, "fp16": 2**-11, "bf16": 2**-8, "fp8": 1 / 16, "int8": 2 / 510}
# Payload bytes of one row of ``cols`` values.
ROW_BYTES = {
    "fp32": lambda c: 4 * c,
    "fp16": lambda c: 2 * c,
    "bf16": lambda c: 2 * c,
    "fp8": lambda c: c + 4,
    "int8": lambda c: c + 8,
}


def _bound(precision: str, x: torch.Tensor) -> torch.Tensor:
    """The stated per-value round-trip error bound of a ``(rows, cols)`` block ``x``."""
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
                assert set(fwd) | set(bwd) <= {"fp16", "int8", "fp8"}
                assert sum(fwd.values()) <= sum(ref["bytes"]["forward"].values()) / 2
            else:
                exp_fwd, exp_bwd = _expected_bytes(precision, got["codec_cols"], rank)
                assert fwd == {precision: NUM_STEPS * exp_fwd}, (precision, fwd)
                assert bwd == {precision: NUM_STEPS * exp_bwd}, (precision, bwd)
            assert got["bytes"]["input"] == ref["bytes"]["input"]
        # Updated rows (SGD): the update ``-lr * grad`` is off by at most the codec's relative
        # error of the gradient (plus what the forward error does to the dense-side gradient).
        tol = {"fp32": 0.0, "fp16": 2e-3, "bf16": 2e-2, "fp8": 0.15, "int8": 0.1}
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
