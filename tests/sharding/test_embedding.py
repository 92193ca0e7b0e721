"""Parity of the sharded embedding collection with the unsharded one plus a reference optimizer.

Each rank feeds its own (unequal) slice of a seeded global batch through a sharded model; the
reference runs the whole batch through the plain-torch :class:`EmbeddingBagCollection` and
applies the fused optimizer's update rule written out in torch below.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raydlrm.models.embedding import INIT_BLOCK_ROWS, EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding import (
    ShardedEmbeddingBagCollection,
    ShardingConfig,
    plan_sharding,
    shard_model,
)
from tests._multiprocess import run_distributed
from tests.sharding._fixtures import (
    EPS,
    GLOBAL_BATCH,
    LR,
    NUM_STEPS,
    SPLITS,
    TOL,
    TinyModel,
    assert_steps_match,
    feature_rows,
    gather_full_tables,
    global_batch,
    load_full_tables,
    make_tables,
    reference_optimizer,
    targets,
)

SCENARIOS = [
    {"optimizer": "rowwise_adagrad", "weighted": False},
    {"optimizer": "rowwise_adagrad", "weighted": True},
    {"optimizer": "adagrad", "weighted": False},
    {"optimizer": "sgd", "weighted": True},
]
# With 3 ranks: rank 0 holds a sum and a mean table (two TBEs), rank 2 holds no table.
PINNED_3 = {"t0": [0], "t1": [0], "t2": [1], "t3": [1]}


def _config(optimizer: str, world_size: int) -> ShardingConfig:
    pinned = PINNED_3 if world_size == 3 else {}
    return ShardingConfig(optimizer=optimizer, learning_rate=LR, eps=EPS, pinned_ranks=pinned)


def _train(model, *, weighted: bool, rows: slice, tables) -> dict:
    """Runs NUM_STEPS forward/backward steps on samples ``rows`` of each global batch."""
    record = {"pooled": [], "pooled_grad": [], "dense_grad": []}
    dense = getattr(model.dense, "module", model.dense)
    for step in range(NUM_STEPS):
        batch = global_batch(step, weighted=weighted, rows=feature_rows(tables))
        kjt = batch.index_rows(torch.arange(rows.start, rows.stop))
        kt = model.embedding_bags(kjt)
        pooled = kt.values
        pooled.retain_grad()
        pred = model.dense(pooled).squeeze(1)
        # Each rank's loss is scaled by the world size over the global batch: DDP averages the
        # dense gradients over ranks and the output all-to-all averages the embedding gradients,
        # so both then equal the single-process reference's on the global batch.
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        loss = ((pred - targets(step)[rows]) ** 2).sum() * world_size / GLOBAL_BATCH
        loss.backward()
        # The sharded model's fused optimizer has already updated its rows in backward.
        optimizer_step = getattr(model, "reference_optimizer_step", None)
        if optimizer_step is not None:
            optimizer_step()
        record["keys"] = kt.keys
        record["pooled"].append(pooled.detach().clone())
        record["pooled_grad"].append(pooled.grad.clone())
        record["dense_grad"].append([p.grad.clone() for p in dense.parameters()])
        dense.zero_grad()
    return record


def _sharded_worker(rank: int, world_size: int, scenarios: list[dict]) -> list[dict]:
    results = []
    start = sum(SPLITS[world_size][:rank])
    rows = slice(start, start + SPLITS[world_size][rank])
    for sc in scenarios:
        tables = make_tables(mean_pooling=not sc["weighted"])
        config = _config(sc["optimizer"], world_size)
        plan = plan_sharding(tables, world_size=world_size, config=config)
        model = shard_model(TinyModel(tables), plan=plan, config=config, device="cpu")
        record = _train(model, weighted=sc["weighted"], rows=rows, tables=tables)
        record["tables"] = gather_full_tables(model.embedding_bags, dst=0)
        record["states"] = {
            k: [s.clone() for s in v] for k, v in model.embedding_bags.optimizer_states().items()
        }
        record["ddp"] = type(model.dense).__name__
        results.append(record)
    return results


def _reference(optimizer: str, weighted: bool) -> dict:
    """Single-process unsharded run with the fused optimizer's update written in torch."""
    tables = make_tables(mean_pooling=not weighted)
    model = TinyModel(tables)
    ebc = model.embedding_bags
    step, states = reference_optimizer(ebc, optimizer, lr=LR, eps=EPS)
    model.reference_optimizer_step = step
    record = _train(model, weighted=weighted, rows=slice(0, GLOBAL_BATCH), tables=tables)
    record["tables"] = {k: w.detach() for k, w in ebc.weights.items()}
    record["states"] = states
    record["keys"] = ebc.feature_names
    return record


@pytest.fixture(scope="module")
def references() -> list[dict]:
    return [_reference(sc["optimizer"], sc["weighted"]) for sc in SCENARIOS]


def _check_parity(results: list[list[dict]], references: list[dict], world_size: int) -> None:
    for i, ref in enumerate(references):
        start = 0
        merged_states: dict[str, list[torch.Tensor]] = {}
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            rows = slice(start, start + SPLITS[world_size][rank])
            start = rows.stop
            assert got["keys"] == ref["keys"]
            assert got["ddp"] == ("DistributedDataParallel" if world_size > 1 else "Linear")
            assert_steps_match(
                got, ref, rows=rows, world_size=world_size, num_steps=NUM_STEPS, tol=TOL
            )
            merged_states.update(got["states"])
            if rank:
                assert got["tables"] is None
        assert results[0][i]["tables"].keys() == ref["tables"].keys()
        for name, weight in ref["tables"].items():
            torch.testing.assert_close(results[0][i]["tables"][name], weight, **TOL)
            torch.testing.assert_close(merged_states[name], ref["states"][name], **TOL)


def test_reference_updates_rows(references: list[dict]) -> None:
    # Guards the parity test against a reference that never changes the tables.
    initial = TinyModel(make_tables()).embedding_bags.weights
    for ref in references:
        assert not torch.equal(ref["tables"]["t0"], initial["t0"])


def test_parity_without_process_group(references: list[dict]) -> None:
    results = [_sharded_worker(0, 1, SCENARIOS)]
    _check_parity(results, references, world_size=1)


def _round_trip(world_size: int) -> dict:
    """Gathers the tables on rank 1, loads changed full tables, gathers again."""
    tables = make_tables()
    config = ShardingConfig()
    plan = plan_sharding(tables, world_size=world_size, config=config)
    ebc = TinyModel(tables).embedding_bags
    sharded = ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device="cpu")
    before = gather_full_tables(sharded, dst=1)
    load_full_tables(sharded, {k: w.detach() * 2 + 1 for k, w in ebc.weights.items()})
    after = gather_full_tables(sharded, dst=1)
    return {"before": before, "after": after, "local": sorted(sharded.local_tables())}


# Tables crossing init blocks (INIT_BLOCK_ROWS rows) at shard boundaries, of every kind.
META_TABLES = [
    EmbeddingBagConfig("rows", INIT_BLOCK_ROWS + 1000, 8, ("f0",)),
    EmbeddingBagConfig("cols", 3000, 12, ("f1",)),
    EmbeddingBagConfig("whole", 50, 8, ("f2",)),
    EmbeddingBagConfig("replica", 40, 4, ("f3",)),
]
META_TYPES = {"rows": "row_wise", "cols": "column_wise", "replica": "data_parallel"}


def _meta_init(world_size: int) -> dict:
    """Shards created from a meta-device collection: their weights, the bytes of fbgemm's
    host weight buffers, and whether the unsharded tables stayed on meta."""
    config = ShardingConfig(pinned_types=META_TYPES)
    plan = plan_sharding(META_TABLES, world_size=world_size, config=config)
    ebc = EmbeddingBagCollection(META_TABLES, device="meta", seed=11)
    sharded = ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device="cpu")
    return {
        "local": {k: v.clone() for k, v in sharded.local_tables().items()},
        "shards": sharded.local_shards(),
        "allocated": sum(int(t.weights_host.numel()) for t in sharded.tbes),
        "meta": all(w.device.type == "meta" for w in ebc.weights.values()),
    }


def _distributed_worker(rank: int, world_size: int) -> dict:
    # One process group per world size for all checks: spawning processes dominates the time.
    return {
        "parity": _sharded_worker(rank, world_size, SCENARIOS),
        "round_trip": _round_trip(world_size),
        "meta_init": _meta_init(world_size),
    }


@pytest.fixture(scope="module")
def distributed_runs():
    """World size -> per-rank results of ``_distributed_worker`` (each size run once)."""
    cache: dict[int, list[dict]] = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_distributed(_distributed_worker, world_size=world_size)
        return cache[world_size]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_multi_process(world_size: int, references: list[dict], distributed_runs) -> None:
    results = [r["parity"] for r in distributed_runs(world_size)]
    _check_parity(results, references, world_size=world_size)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_and_load_full_tables(world_size: int, distributed_runs) -> None:
    results = [r["round_trip"] for r in distributed_runs(world_size)]
    ebc = TinyModel(make_tables()).embedding_bags
    for rank, result in enumerate(results):
        if rank != 1:
            assert result["before"] is None and result["after"] is None
    assert sorted(name for r in results for name in r["local"]) == ["t0", "t1", "t2", "t3"]
    for name, weight in ebc.weights.items():
        torch.testing.assert_close(results[1]["before"][name], weight.detach(), atol=0, rtol=0)
        torch.testing.assert_close(results[1]["after"][name], weight.detach() * 2 + 1)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_collection_allocates_only_its_shards(world_size: int, distributed_runs) -> None:
    """Scale: built on the meta device, each rank allocates exactly its shards' rows (fbgemm's
    host weight buffer) and initializes them to the unsharded table's values on the same seed
    (block-wise init: independent of the world size and plan)."""
    reference = EmbeddingBagCollection(META_TABLES, seed=11).weights
    covered = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim) for t in META_TABLES}
    for result in (r["meta_init"] for r in distributed_runs(world_size)):
        assert result["meta"]
        sizes = [w.numel() for w in result["local"].values()]
        assert result["allocated"] == sum(sizes)
        for name, weight in result["local"].items():
            s = result["shards"][name]
            expected = reference[name].detach()[s.row_start : s.row_end, s.col_start : s.col_end]
            assert torch.equal(weight, expected), name
            covered[name][s.row_start : s.row_end, s.col_start : s.col_end] += 1
    # Every element of a sharded table lives on exactly one rank; a replica on every rank.
    for name, count in covered.items():
        assert torch.all(count == (world_size if name == "replica" else 1)), name
    assert max(r["allocated"] for r in (x["meta_init"] for x in distributed_runs(world_size))) < (
        sum(t.num_embeddings * t.embedding_dim for t in META_TABLES)
    )


def test_out_of_range_id_names_table() -> None:
    tables = make_tables()
    sharded = ShardedEmbeddingBagCollection(
        TinyModel(tables).embedding_bags,
        plan=plan_sharding(tables, world_size=1, config=ShardingConfig()),
        config=ShardingConfig(),
        device="cpu",
    )
    batch = global_batch(0, weighted=False, rows=feature_rows(tables))
    bad = batch.values.clone()
    f4_start = int(batch.offset_per_key()[batch.keys.index("f4")])
    bad[f4_start] = 20  # t3 has 20 rows
    with pytest.raises(ValueError, match=r"table 't3'.*id 20"):
        sharded(type(batch).from_lengths(batch.keys, bad, batch.lengths))
    bad[f4_start] = -1
    with pytest.raises(ValueError, match="table 't3'"):
        sharded(type(batch).from_lengths(batch.keys, bad, batch.lengths))


def test_plan_world_size_must_match_process_group() -> None:
    tables = make_tables()
    plan = plan_sharding(tables, world_size=2, config=ShardingConfig())
    with pytest.raises(ValueError, match="world_size 2"):
        ShardedEmbeddingBagCollection(
            TinyModel(tables).embedding_bags, plan=plan, config=ShardingConfig(), device="cpu"
        )
