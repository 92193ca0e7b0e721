"""Per-position (unpooled) lookups of sequence features, sharded, against the unsharded
collection: every sharding type, 1-4 gloo ranks, pooled and per-position tables in one
collection, a candidate feature sharing the history's table, empty histories.

Each rank takes an unequal slice of a seeded global batch; the loss is a fixed random linear
function of every output row, summed over the rank's samples (so the sharded update, averaged
over ranks, equals the reference's on the global loss divided by the world size). Compared: the
pooled and per-position outputs of both steps, and the tables after them (SGD and row-wise
Adagrad, fused in the kernel).
"""

from __future__ import annotations

import pytest
import torch

from raydlrm.batch import DedupGroup, KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding import ShardedEmbeddingBagCollection, ShardingConfig, plan_sharding
from tests._multiprocess import run_distributed
from tests._tolerance import EPS16
from tests.sharding._fixtures import (
    EPS,
    LR,
    MAGNITUDE,
    NUM_STEPS,
    SPLITS,
    TOL,
    gather_full_tables,
    reference_optimizer,
)

TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
# Row-wise Adagrad keeps a momentum per column shard's row segment (a column-wise table's
# update differs from the whole row's by design, tests/sharding/test_sharding_types.py):
# column-wise tables train with per-element Adagrad here.
SCENARIOS = [
    (kind, opt, False)
    for kind in TYPES
    for opt in ("sgd", "adagrad" if kind == "column_wise" else "rowwise_adagrad")
]
# RecD: the user and their history deduplicated over a session's samples (5 unique rows for
# 13 samples), each sample with a candidate of its own in the same table as the history.
SCENARIOS += [(kind, "sgd", True) for kind in ("table_wise", "row_wise", "data_parallel")]
# The communication codecs apply to the per-position rows: fp16 on the wire (both ways) for
# a row-wise table (a class per row shard: each id's row comes from its one shard).
SCENARIOS += [("row_wise", "sgd", "fp16")]


def _scenarios(world_size: int) -> list[tuple]:
    """Every scenario on 1 and 2 ranks; on 3 and 4 (the uneven splits, more shards), each
    sharding type once with its fused optimizer, RecD once and the codec."""
    if world_size <= 2:
        return SCENARIOS
    return [
        sc
        for sc in SCENARIOS
        if (sc[2] is False and sc[1] != "sgd")
        or sc[2] == "fp16"
        or (sc[:2] == ("row_wise", "sgd") and sc[2] is True)
    ]


# fp16 on the wire: each output row and gradient rounded once per exchange (half a spacing of
# values below MAGNITUDE), on top of the summation-order tolerance.
FP16_TOL = {"atol": TOL["atol"] + NUM_STEPS * 2 * EPS16 * MAGNITUDE, "rtol": TOL["rtol"]}
DEDUP = ["user", "hist", "hist_cat"]
UNIQUE = 5
KEYS = ["user", "hist", "cand", "hist_cat"]
BATCH = 13


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t_user", num_embeddings=30, embedding_dim=8, feature_names=("user",)
        ),
        EmbeddingBagConfig(
            name="t_item",
            num_embeddings=40,
            embedding_dim=8,
            feature_names=("hist", "cand"),
            pooling="none",
        ),
        EmbeddingBagConfig(
            name="t_cat",
            num_embeddings=12,
            embedding_dim=4,
            feature_names=("hist_cat",),
            pooling="none",
        ),
    ]


def _batch(step: int) -> KeyedJaggedTensor:
    """``BATCH`` samples: 1-3 user ids, a history of 0-6 items with a category each, one
    candidate item."""
    gen = torch.Generator().manual_seed(300 + step)
    hist = torch.randint(0, 7, (BATCH,), generator=gen)
    hist[3] = 0  # an empty history
    lengths = torch.cat(
        [
            torch.randint(1, 4, (BATCH,), generator=gen),
            hist,
            torch.ones(BATCH, dtype=torch.int64),
            hist,
        ]
    )
    sizes = {"user": 30, "hist": 40, "cand": 40, "hist_cat": 12}
    per_key = lengths.view(len(KEYS), BATCH).sum(1).tolist()
    values = torch.cat(
        [
            torch.randint(0, sizes[k], (n,), generator=gen)
            for k, n in zip(KEYS, per_key, strict=True)
        ]
    )
    return KeyedJaggedTensor.from_lengths(KEYS, values, lengths)


def _dedup_parts(step: int) -> tuple[KeyedJaggedTensor, torch.Tensor, KeyedJaggedTensor]:
    """The unique rows of the dedup group (the first ``UNIQUE`` samples of :func:`_batch`),
    each sample's unique row, and the candidates."""
    batch = _batch(step)
    inverse = torch.randint(0, UNIQUE, (BATCH,), generator=torch.Generator().manual_seed(step))
    inverse[:UNIQUE] = torch.arange(UNIQUE)
    unique = batch.select(DEDUP).index_rows(torch.arange(UNIQUE))
    return unique, inverse, batch.select(["cand"])


def _full_batch(step: int, dedup: bool) -> KeyedJaggedTensor:
    if not dedup:
        return _batch(step)
    unique, inverse, cand = _dedup_parts(step)
    return KeyedJaggedTensor.concat([cand, unique.index_rows(inverse)])


def _rank_input(step: int, dedup: bool, rows: slice) -> tuple[KeyedJaggedTensor, list]:
    """This rank's samples ``rows``: plain, or the candidates plus the group's unique rows
    among them and the inverse index (the unique rows renumbered)."""
    index = torch.arange(rows.start, rows.stop)
    if not dedup:
        return _batch(step).index_rows(index), []
    unique, inverse, cand = _dedup_parts(step)
    used, local = torch.unique(inverse[index], return_inverse=True)
    return cand.index_rows(index), [DedupGroup(unique=unique.index_rows(used), inverse=local)]


def _loss(out: KeyedTensor, step: int, rows: slice, full: KeyedJaggedTensor) -> torch.Tensor:
    """A fixed random linear function of every output row of the samples ``rows``."""
    gen = torch.Generator().manual_seed(900 + step)
    pooled_w = torch.randn(BATCH, out.values.shape[1], generator=gen)[rows]
    loss = (out.values * pooled_w).sum()
    for name in ("hist", "cand", "hist_cat"):
        lengths = full.select([name]).lengths
        dim = out.jagged[name].values.shape[1]
        weights = torch.randn(int(lengths.sum()), dim, generator=gen)
        start = int(lengths[: rows.start].sum())
        mine = weights[start : start + int(lengths[rows].sum())]
        loss = loss + (out.jagged[name].values * mine).sum()
    return loss


def _config(kind: str, optimizer: str, world_size: int = 1, comm: str = "fp32") -> ShardingConfig:
    group = 2 if kind == "table_row_wise" and world_size % 2 == 0 else None
    return ShardingConfig(
        default_type=kind,
        optimizer=optimizer,
        learning_rate=LR,
        eps=EPS,
        group_size=group,
        comm_precision=comm,
    )


def _record(out: KeyedTensor) -> dict:
    return {
        "pooled": out.values.detach().clone(),
        **{f: (j.values.detach().clone(), j.lengths.clone()) for f, j in out.jagged.items()},
    }


def _run(rank: int, world_size: int) -> list[dict]:
    start = sum(SPLITS[world_size][:rank])
    rows = slice(start, start + SPLITS[world_size][rank])
    results = []
    for kind, optimizer, variant in _scenarios(world_size):
        dedup = variant is True
        config = _config(kind, optimizer, world_size, variant if variant == "fp16" else "fp32")
        plan = plan_sharding(_tables(), world_size=world_size, config=config)
        ebc = ShardedEmbeddingBagCollection(
            EmbeddingBagCollection(_tables(), device="meta"),
            plan=plan,
            config=config,
            device="cpu",
            dedup_groups=[DEDUP] if dedup else [],
        )
        steps = []
        for step in range(NUM_STEPS):
            out = ebc(*_rank_input(step, dedup, rows))
            steps.append(_record(out))
            _loss(out, step, rows, _full_batch(step, dedup)).backward()
        results.append({"steps": steps, "tables": gather_full_tables(ebc, dst=0)})
    return results


def _reference(optimizer: str, world_size: int, dedup: bool) -> dict:
    ebc = EmbeddingBagCollection(_tables())
    step_fn, _ = reference_optimizer(ebc, optimizer, lr=LR, eps=EPS)
    steps = []
    for step in range(NUM_STEPS):
        full = _full_batch(step, dedup)
        out = ebc(full)
        steps.append(_record(out))
        (_loss(out, step, slice(0, BATCH), full) / world_size).backward()
        step_fn()
    return {"steps": steps, "tables": {k: w.detach() for k, w in ebc.weights.items()}}


def _check(results: list[list[dict]], world_size: int) -> None:
    for i, (kind, optimizer, variant) in enumerate(_scenarios(world_size)):
        dedup = variant is True
        name = f"{kind}/{optimizer}/{variant}/{world_size}"
        ref = _reference(optimizer, world_size, dedup)
        tol = FP16_TOL if variant == "fp16" and world_size > 1 else TOL
        rounded = False  # an fp16 run's rows did cross the wire, rounded
        for rank, per_rank in enumerate(results):
            start = sum(SPLITS[world_size][:rank])
            rows = slice(start, start + SPLITS[world_size][rank])
            for step, (got, want) in enumerate(
                zip(per_rank[i]["steps"], ref["steps"], strict=True)
            ):
                torch.testing.assert_close(got["pooled"], want["pooled"][rows], **tol, msg=name)
                for feature in ("hist", "cand", "hist_cat"):
                    values, lengths = got[feature]
                    ref_values, ref_lengths = want[feature]
                    assert torch.equal(lengths, ref_lengths[rows]), (name, feature)
                    lo = int(ref_lengths[: rows.start].sum())
                    expected = ref_values[lo : lo + values.shape[0]]
                    torch.testing.assert_close(
                        values, expected, **tol, msg=f"{name} {feature} step {step}"
                    )
                    rounded |= not torch.equal(values, expected)
        if variant == "fp16" and world_size > 1:
            assert rounded, f"{name}: no per-position row went through the fp16 codec"
        tables = results[0][i]["tables"]
        for table, weight in ref["tables"].items():
            torch.testing.assert_close(tables[table], weight, **tol, msg=f"{name} {table}")


def test_sequence_lookup_single_process() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    _check([_run(0, 1)], 1)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sequence_lookup_sharded(world_size: int) -> None:
    _check(run_distributed(_run, world_size=world_size, timeout_s=300), world_size)


def test_unsharded_dedup_expands_the_histories() -> None:
    """The unsharded collection given the dedup group equals it given the expanded batch."""
    ebc = EmbeddingBagCollection(_tables())
    unique, inverse, cand = _dedup_parts(0)
    got = ebc(cand, [DedupGroup(unique=unique, inverse=inverse)])
    want = ebc(_full_batch(0, True))
    assert torch.equal(got.values, want.values)
    for name in ("hist", "cand", "hist_cat"):
        assert torch.equal(got.jagged[name].values, want.jagged[name].values), name
        assert torch.equal(got.jagged[name].lengths, want.jagged[name].lengths), name


# Each rank's history ids: repeats, and ids in both halves of the table's rows.
WIRE_IDS = {0: [3, 3, 3, 25, 25, 7, 39], 1: [3, 30, 30, 30, 7, 7, 12, 3]}
WIRE_TYPES = ("table_wise", "row_wise", "column_wise")


def _wire_run(rank: int, world_size: int) -> dict:
    """Per sharding type: the plan's shards of a per-position table and the bytes this rank
    sent after one step on ``WIRE_IDS``."""
    table = EmbeddingBagConfig(
        name="t_item", num_embeddings=40, embedding_dim=8, feature_names=("hist",), pooling="none"
    )
    ids = torch.tensor(WIRE_IDS[rank])
    kjt = KeyedJaggedTensor.from_lengths(["hist"], ids, torch.tensor([3, ids.numel() - 3]))
    results = {}
    for kind in WIRE_TYPES:
        config = ShardingConfig(default_type=kind)
        plan = plan_sharding([table], world_size=world_size, config=config)
        ebc = ShardedEmbeddingBagCollection(
            EmbeddingBagCollection([table], device="meta"), plan=plan, config=config, device="cpu"
        )
        out = ebc(kjt).jagged["hist"]
        assert torch.equal(out.lengths, kjt.lengths)
        out.values.sum().backward()
        results[kind] = (plan.table("t_item").shards, ebc.comm_bytes())
    return results


@pytest.mark.distributed
def test_per_position_all_to_alls_carry_a_row_per_distinct_id() -> None:
    """A shard sends each rank one row per distinct id of that rank it owns (and receives one
    gradient row back): repeated ids travel once, and a row shard sends nothing for the ids
    of the other shards."""
    results = run_distributed(_wire_run, world_size=2, timeout_s=120)
    for kind in WIRE_TYPES:
        shards = results[0][kind][0]
        if kind == "row_wise":
            assert len(shards) == 2, shards
        # Bytes of the rows (and gradient rows) each shard exchanges with the other rank.
        expected = sum(
            len({i for i in WIRE_IDS[1 - s.rank] if s.row_start <= i < s.row_end})
            * (s.col_end - s.col_start)
            * 4
            for s in shards
        )
        for direction in ("forward", "backward"):
            sent = sum(r[kind][1].get(direction, {}).get("fp32", 0) for r in results)
            assert sent == expected, (kind, direction, sent, expected)
