"""Managed tables sharded: parity with one whole-table map on one process, on 1-4 gloo ranks and
every sharding type a managed table can take.

The reference maps each step's global batch with one :class:`IdMap` over the whole table,
resets the rows it gives to new ids (fresh values, zero Adagrad state), and trains the unsharded
collection on the rows. The sharded run must give every id its own row until the table is full
(no collision), the same rows, the same evictions and resets, the same pooled outputs, tables
and maps. Table ``m0`` holds its ids; ``m1`` is too small and evicts (LRU) from the second step
on; ``h`` is hashed, beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.ids import ManagedIds
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.models.managed_ids import ID, IdMap, fresh_rows
from raydlrm.sharding import ShardingConfig, plan_sharding, shard_model
from raydlrm.sharding.planner.tower_plan import plan_towers
from raydlrm.sharding.row_cache import RowCache
from raydlrm.sharding.telemetry import local_counters, metrics_of
from raydlrm.sharding.topology import Topology, topology_groups
from raydlrm.sharding.tower_spec import Tower
from raydlrm.sharding.towers import ShardedTowerCollection
from tests._multiprocess import run_distributed
from tests.sharding._fixtures import (
    EPS,
    LR,
    SPLITS,
    TinyModel,
    gather_full_tables,
    gather_id_maps,
    parity_tol,
)

GLOBAL_BATCH = 13
STEPS = 4
KEYS = ["f0", "f1", "f2", "f3"]
POOLS = {"f0": 3000, "f1": 3000, "f2": 300, "f3": 40}  # raw ids drawn below these
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
# Managed tables behind a row cache: fp32 rows on ssd (a small DRAM cache in front: training
# equals the uncached table's bit for bit) and int8 rows (trained in an fp32 cache, stored
# rounded: the tables within a few quantization steps, the maps exact).
CACHED = ["row_wise+ssd", "column_wise+int8"]
# On fbgemm's TBE too (the others run the torch kernel), plain and behind the int8 cache.
FBGEMM = ["row_wise@fbgemm", "table_row_wise+int8@fbgemm"]
# Managed tables in towers (2 hosts): m0's features in one, m1's and h's in the other; the
# identity towers' output is the flat collection's.
TOWERS = [Tower("a", ("f0", "f1"), host=0), Tower("b", ("f2", "f3"), host=1)]
INT8_TOL = {"atol": 4e-3, "rtol": 0.0}


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="m0",
            num_embeddings=1024,
            embedding_dim=8,
            feature_names=("f0", "f1"),
            managed=ManagedIds(buckets=8, eviction="none"),
        ),
        EmbeddingBagConfig(
            name="m1",
            num_embeddings=64,
            embedding_dim=8,
            feature_names=("f2",),
            pooling="mean",
            managed=ManagedIds(buckets=4),
        ),
        EmbeddingBagConfig(name="h", num_embeddings=40, embedding_dim=4, feature_names=("f3",)),
    ]


def _model(kind: str, world_size: int) -> TinyModel:
    tables = _tables()
    config = _config(kind, world_size)
    if kind != "towers":
        plan = plan_sharding(tables, world_size=world_size, config=config)
        return shard_model(TinyModel(tables), plan=plan, config=config, device="cpu")
    model = TinyModel(tables)
    groups = topology_groups(Topology(2, world_size // 2))
    model.embedding_bags = ShardedTowerCollection(
        model.embedding_bags,
        towers=TOWERS,
        modules={},
        output_widths={},
        plan=plan_towers(tables, TOWERS, groups.topology, config=config),
        config=config,
        device="cpu",
        groups=groups,
    )
    return model


def _config(kind: str, world_size: int) -> ShardingConfig:
    kind, _, kernel = kind.partition("@")
    kind, _, tier = kind.replace("towers", "row_wise").partition("+")
    managed = ("m0", "m1")
    return ShardingConfig(
        default_type=kind,
        group_size=2 if kind == "table_row_wise" and world_size % 2 == 0 else None,
        optimizer="adagrad",
        learning_rate=LR,
        eps=EPS,
        kernel=kernel or "torch",
        placement=dict.fromkeys(managed, "ssd") if tier == "ssd" else {},
        weights_precision_per_table=dict.fromkeys(managed, "int8") if tier == "int8" else {},
        # ssd: m0's shards cache a few of their rows (at least 90), the cache evicts; int8: m0
        # caches 102 of 1024 rows, a step's at most 78 (the cache evicts).
        cache_load_factor=0.1,
        cache_min_rows=90 if tier == "ssd" else None,
        cache_load_factor_per_table={"m1": 1.0} if tier == "int8" else {},
    )


def _batch(step: int) -> KeyedJaggedTensor:
    """A seeded global batch of raw ids (large, sparse integers: ``id * 7919 + 10**12``)."""
    gen = torch.Generator().manual_seed(500 + step)
    lengths = torch.randint(0, 4, (len(KEYS) * GLOBAL_BATCH,), generator=gen)
    per_key = lengths.view(len(KEYS), GLOBAL_BATCH).sum(1).tolist()
    values = []
    for key, n in zip(KEYS, per_key, strict=True):
        drawn = torch.randint(0, POOLS[key], (n,), generator=gen)
        values.append(drawn if key == "f3" else drawn * 7919 + 10**12)
    return KeyedJaggedTensor.from_lengths(KEYS, torch.cat(values), lengths)


def _targets(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, generator=torch.Generator().manual_seed(900 + step))


def _step(model, kjt: KeyedJaggedTensor, targets: torch.Tensor, world_size: int) -> torch.Tensor:
    pooled = model.embedding_bags(kjt).values
    loss = ((model.dense(pooled).squeeze(1) - targets) ** 2).sum() * world_size / GLOBAL_BATCH
    loss.backward()
    return pooled.detach().clone()


@contextlib.contextmanager
def _recorded_cache_reads() -> Iterator[list[tuple[int, int]]]:
    """Records (rows read, slots of the table's cache) of every :meth:`RowCache.read`."""
    reads: list[tuple[int, int]] = []
    read = RowCache.read

    def recording(cache: RowCache, table: int, rows: torch.Tensor) -> torch.Tensor:
        reads.append((rows.numel(), cache.slot_count(table)))
        return read(cache, table, rows)

    RowCache.read = recording
    try:
        yield reads
    finally:
        RowCache.read = read


def _worker(rank: int, world_size: int, kinds: list[str]) -> dict:
    start = sum(SPLITS[world_size][:rank])
    rows = torch.arange(start, start + SPLITS[world_size][rank])
    out = {}
    for kind in kinds:
        model = _model(kind, world_size)
        pooled = []
        for step in range(STEPS):
            pooled.append(
                _step(model, _batch(step).index_rows(rows), _targets(step)[rows], world_size)
            )
            model.dense.zero_grad()
        collection = model.embedding_bags
        with _recorded_cache_reads() as reads:  # the fallback refresh reads through the cache
            tables = gather_full_tables(collection, dst=0)
        out[kind] = {
            "pooled": pooled,
            "tables": tables,
            "cache_reads": reads,
            "maps": gather_id_maps(collection),
            "stats": {n: m.stats() for n, m in collection.id_maps().items()},
            "counters": local_counters(collection, families=["managed"]),
        }
    return out


def _reference() -> dict:
    tables = _tables()
    # The reference maps the ids itself and looks the rows up in plain tables.
    model = TinyModel([dataclasses.replace(t, managed=None) for t in tables])
    ebc = model.embedding_bags
    states = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim) for t in tables}
    maps = {
        t.name: IdMap(
            t.managed,
            table=t.name,
            num_embeddings=t.num_embeddings,
            row_start=0,
            row_end=t.num_embeddings,
        )
        for t in tables
        if t.managed is not None
    }
    pooled = []
    for step in range(STEPS):
        kjt = _batch(step)
        values = kjt.values.clone()
        offsets = kjt.offset_per_key().tolist()
        with torch.no_grad():
            for t in tables:
                if t.managed is None:
                    continue
                spans = [
                    (offsets[KEYS.index(f)], offsets[KEYS.index(f) + 1]) for f in t.feature_names
                ]
                ids = torch.cat([values[a:b] for a, b in spans])
                got = maps[t.name].assign(ids, now=step + 1, training=True)
                mapped = got.rows.split([b - a for a, b in spans])
                for (a, b), part in zip(spans, mapped, strict=True):
                    values[a:b] = part
                if got.reset.numel():
                    ebc.weights[t.name][got.reset] = fresh_rows(
                        got.reset,
                        table=t.name,
                        num_embeddings=t.num_embeddings,
                        seed=ebc.seed,
                        salt=step + 1,
                        col_start=0,
                        cols=t.embedding_dim,
                    )
                    states[t.name][got.reset] = 0
        rows_kjt = KeyedJaggedTensor.from_lengths(KEYS, values, kjt.lengths)
        pooled.append(_step(model, rows_kjt, _targets(step), 1))
        with torch.no_grad():
            for name, weight in ebc.weights.items():
                states[name] += weight.grad * weight.grad
                weight -= LR * weight.grad / (states[name].sqrt() + EPS)
                weight.grad = None
        model.dense.zero_grad()
    with torch.no_grad():  # admitting at once: the fallback rows hold their buckets' means
        for name, id_map in maps.items():
            rows, means = id_map.bucket_means(
                lambda r, n=name: ebc.weights[n][r], chunk_rows=id_map.rows
            )
            assert rows.numel() > 0
            ebc.weights[name][rows] = means.float()
    return {
        "pooled": pooled,
        "tables": {k: w.detach() for k, w in ebc.weights.items()},
        "maps": {n: m.state for n, m in maps.items()},
        "stats": {n: m.stats() for n, m in maps.items()},
    }


def _check(results: list[dict], ref: dict, world_size: int, kinds: list[str]) -> None:
    assert ref["stats"]["m1"]["evictions"] > 0 and ref["stats"]["m0"]["evictions"] == 0
    for kind in kinds:
        tol = INT8_TOL if "+int8" in kind else parity_tol(STEPS)
        for rank, got in enumerate(results):
            start = sum(SPLITS[world_size][:rank])
            rows = slice(start, start + SPLITS[world_size][rank])
            for step in range(STEPS):
                torch.testing.assert_close(
                    got[kind]["pooled"][step], ref["pooled"][step][rows], **tol
                )
        first = results[0][kind]
        for name, full in ref["tables"].items():
            torch.testing.assert_close(
                first["tables"][name], full, **tol, msg=lambda m, k=kind, n=name: f"{k} {n}: {m}"
            )
        for name, state in ref["maps"].items():
            assert torch.equal(first["maps"][name], state), (kind, name)
        # Behind a cache the refresh streams through it: never more rows at once than its
        # slots (m0's shards hold more ids than their caches do).
        reads = [r for got in results for r in got[kind]["cache_reads"]]
        assert bool(reads) == ("+" in kind), kind
        assert all(rows <= slots for rows, slots in reads), (kind, reads)
        # The telemetry the run reports: the ranks' counters summed, then made metrics.
        sums: dict[str, float] = {}
        for r in results:
            for key, value in r[kind]["counters"].items():
                sums[key] = sums.get(key, 0.0) + value
        metrics = metrics_of(sums, world_size=world_size)
        for name, stats in ref["stats"].items():
            for key in ("admissions", "evictions", "lookups", "rejections"):
                assert metrics[f"managed/{name}/{key}"] == stats[key], (kind, name, key)
            occupancy = stats["occupied"] / stats["capacity"]
            assert metrics[f"managed/{name}/occupancy"] == pytest.approx(occupancy)
            assert metrics[f"managed/{name}/collisions"] == 0
            assert 1 <= metrics[f"managed/{name}/max_probe"] <= stats["max_probe"]
        # No collision: every id of the table holds its own row.
        held = ref["maps"]["m0"][ID]
        assert (held >= 0).sum() == held[held >= 0].unique().numel()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_managed_tables_sharded_match_one_whole_table_map(world_size: int) -> None:
    kinds = TYPES + (CACHED if world_size in (2, 3) else []) + (["towers"] * (world_size % 2 == 0))
    kinds += FBGEMM if world_size == 2 else []
    results = run_distributed(_worker, world_size=world_size, args=(kinds,), timeout_s=300)
    _check(results, _reference(), world_size, kinds)
