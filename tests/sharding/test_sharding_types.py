"""Parity of every sharding type (and a mixed plan) with the unsharded single-process reference.

For world sizes 1-4, each scenario trains a few steps on unequal per-rank slices of a seeded
global batch and compares pooled outputs, gradients reaching the dense side, updated tables and
optimizer state with :func:`_reference`. One process group per world size runs all scenarios.
"""

from __future__ import annotations

import random

import pytest
import torch

from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.models.quantized import dequantize_rows, quantize_rows
from raydlrm.sharding import (
    ShardedEmbeddingBagCollection,
    ShardingConfig,
    ShardingPlan,
    plan_sharding,
    shard_model,
)
from raydlrm.sharding.quantized import QuantizedRows
from tests._multiprocess import run_distributed
from tests._tolerance import EPS16
from tests.sharding._fixtures import (
    MAGNITUDE,
    SPLITS,
    TinyModel,
    assert_steps_match,
    gather_full_optimizer_states,
    gather_full_tables,
    load_full_tables,
    make_tables,
)
from tests.sharding.test_embedding import EPS, LR, NUM_STEPS, TOL, _train

TYPES = ["data_parallel", "row_wise", "column_wise", "table_row_wise"]
# Each type with mean pooling (unweighted) and with per-id weights, over the three optimizers.
SCENARIOS = [
    {"name": f"{kind}/{opt}", "default_type": kind, "optimizer": opt, "weighted": weighted}
    for kind in TYPES
    for opt, weighted in (("rowwise_adagrad", False), ("adagrad", True))
]
SCENARIOS += [
    {"name": f"mixed/{opt}", "mixed": True, "optimizer": opt, "weighted": weighted}
    for opt, weighted in (("rowwise_adagrad", False), ("sgd", True), ("adagrad", False))
]
# fp16 tables (t4 stays fp32: two weight precisions on a rank mean two TBEs) against the fp32
# reference started from the same fp16-rounded weights: equal within fp16 rounding of the
# updates (fbgemm rounds each updated row to fp16; the optimizer state stays fp32).
FP16 = {"name": "mixed/fp16", "mixed": True, "optimizer": "rowwise_adagrad", "weighted": False}
# fp16 tables against the fp32 reference: each step rounds every updated row to fp16 (at most
# half a spacing, EPS16 / 2, of the values' MAGNITUDE) and a pooled vector sums up to 3 rows.
FP16_TOL = {"atol": NUM_STEPS * 3 * EPS16 / 2 * MAGNITUDE, "rtol": 0.0}
SCENARIOS.append({**FP16, "fp16": True})
# Tables on the SSD tier (weights in mapped files; Adagrad's per-weight state beside them,
# row-wise Adagrad's per-row state in memory) train exactly like tables in DRAM: behind a DRAM
# row cache smaller than the shards (rows evicted and read back between steps), and without one
# (the kernels update the mapped files in place).
SCENARIOS += [
    {
        "name": "mixed/ssd/rowwise_adagrad",
        "mixed": True,
        "optimizer": "rowwise_adagrad",
        "weighted": False,
        "ssd": ["t0", "t1", "t2"],
        "cache": 0.5,
    },
    {
        "name": "mixed/ssd/adagrad",
        "mixed": True,
        "optimizer": "adagrad",
        "weighted": True,
        "ssd": ["t3", "t4"],
        "cache": 0.0,
    },
]
# Tables in host memory behind a row cache in device memory (``host``; on CPU the two memories
# are one, but the cache, its evictions and the rows' state in the host buffers are the same):
# exactly like tables in DRAM, with a cache of 3/5 to 9/10 of each shard's rows (rows evicted and
# read back between steps). World sizes 1 and 2: at 3 and 4 the row-wise shards of t1 are too
# small for a cache that evicts.
SCENARIOS += [
    {
        "name": "mixed/host/rowwise_adagrad",
        "mixed": True,
        "optimizer": "rowwise_adagrad",
        "weighted": False,
        "host": {"t0": 0.6, "t1": 0.8, "t2": 0.6},
    },
    {
        "name": "mixed/host/adagrad",
        "mixed": True,
        "optimizer": "adagrad",
        "weighted": True,
        "host": {"t3": 0.9, "t4": 0.9},
    },
]
# int8 / int4 tables (t4 stays fp32) behind an fp32 cache holding every row of a shard: they
# train exactly as fp32 tables started from the quantized initial rows (each shard's column
# block quantized on its own, rounded to nearest); the final tables, written back with
# stochastic rounding when gathered, are within one quantization step of the reference's.
SCENARIOS += [
    {**FP16, "name": f"mixed/{bits}", "precision": bits, "optimizer": opt, "weighted": weighted}
    for bits, opt, weighted in (("int8", "rowwise_adagrad", False), ("int4", "adagrad", True))
]
# The PyTorch kernel (sharding.kernel = "torch") against the same reference: every scenario
# (every sharding type, optimizer, fp16 and the SSD tier), at world sizes 1 and 2.
TORCH_KERNEL = [{**sc, "name": f"{sc['name']}/torch", "kernel": "torch"} for sc in SCENARIOS]
GROUPED = {
    "name": "table_row_wise/group2",
    "default_type": "table_row_wise",
    "group_size": 2,
    "optimizer": "rowwise_adagrad",
    "weighted": False,
}
MIXED_TYPES = {
    "t0": "data_parallel",
    "t1": "row_wise",
    "t2": "column_wise",
    "t3": "table_row_wise",
    "t4": "table_wise",
}


def _tables(sc: dict) -> list[EmbeddingBagConfig]:
    tables = make_tables(mean_pooling=not sc["weighted"])
    if sc.get("mixed"):
        tables.append(
            EmbeddingBagConfig(name="t4", num_embeddings=25, embedding_dim=8, feature_names=("fx",))
        )
    return tables


def _precision(sc: dict) -> str:
    return "fp16" if sc.get("fp16") else sc.get("precision", "fp32")


def _config(sc: dict) -> ShardingConfig:
    return ShardingConfig(
        default_type=sc.get("default_type", "table_wise"),
        pinned_types=MIXED_TYPES if sc.get("mixed") else {},
        group_size=sc.get("group_size"),
        optimizer=sc["optimizer"],
        learning_rate=LR,
        eps=EPS,
        weights_precision=_precision(sc),
        weights_precision_per_table={"t4": "fp32"} if _precision(sc) != "fp32" else {},
        cache_load_factor=1.0,  # quantized tables: every row of a shard cached
        cache_load_factor_per_table=sc.get("host", {})
        | dict.fromkeys(sc.get("ssd", []), sc.get("cache")),
        cache_min_rows=36 if sc.get("ssd") else None,
        placement=dict.fromkeys(sc.get("ssd", []), "ssd")
        | dict.fromkeys(sc.get("host", []), "host"),
        kernel=sc.get("kernel", "fbgemm"),
    )


def _plan(sc: dict, world_size: int) -> ShardingPlan:
    return plan_sharding(_tables(sc), world_size=world_size, config=_config(sc))


def _run_scenario(rank: int, world_size: int, sc: dict) -> dict:
    start = sum(SPLITS[world_size][:rank])
    rows = slice(start, start + SPLITS[world_size][rank])
    tables, config = _tables(sc), _config(sc)
    plan = plan_sharding(tables, world_size=world_size, config=config)
    model = shard_model(TinyModel(tables), plan=plan, config=config, device="cpu")
    ebc = model.embedding_bags
    record = _train(model, weighted=sc["weighted"], rows=rows, tables=tables)
    record["tables"] = gather_full_tables(ebc, dst=0)
    record["states"] = gather_full_optimizer_states(ebc, dst=0)
    replicated = [t.name for t in plan.tables if t.sharding_type == "data_parallel"]
    record["replicas"] = {n: _replica(ebc.local_tables()[n]) for n in replicated}
    # The SSD tier's buffers are mapped files (unlinked at once: "(deleted)" in the maps).
    maps = open("/proc/self/maps").read()  # noqa: SIM115
    record["mapped"] = sum("raydlrm-ssd-" in line for line in maps.splitlines())
    record["kernel"] = ebc.kernel
    return record


def _replica(weight: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """A copy of a replica's rows (a quantized one's codes and scales, as bytes)."""
    if isinstance(weight, QuantizedRows):
        return torch.cat([weight.codes, weight.params.view(torch.uint8)], dim=1)
    return weight.clone()


def _worker(rank: int, world_size: int, scenarios: list[dict]) -> list[dict]:
    return [_run_scenario(rank, world_size, sc) for sc in scenarios]


def _reference(sc: dict, plan: ShardingPlan) -> dict:
    """Single-process unsharded run with the fused optimizer's update written in torch.

    Row-wise Adagrad on a column-wise table keeps one momentum per row *segment* of each column
    shard (see raydlrm.sharding._embedding_state); its reported state is the width-weighted mean.
    """
    tables = _tables(sc)
    model = TinyModel(tables)
    ebc = model.embedding_bags
    blocks = {
        t.name: sorted({(s.col_start, s.col_end) for s in plan.table(t.name).shards})
        for t in tables
    }
    with torch.no_grad():
        for name, weight in ebc.weights.items():
            if sc.get("fp16") and name != "t4":
                weight.copy_(weight.half().float())
            elif sc.get("precision") and name != "t4":
                for lo, hi in blocks[name]:
                    codes, params = quantize_rows(weight[:, lo:hi], precision=sc["precision"])
                    weight[:, lo:hi] = dequantize_rows(codes, params, precision=sc["precision"])
    states = {
        t.name: torch.zeros(t.num_embeddings, len(blocks[t.name]))
        if sc["optimizer"] == "rowwise_adagrad"
        else torch.zeros(t.num_embeddings, t.embedding_dim)
        for t in tables
    }

    @torch.no_grad()
    def step() -> None:
        for name, weight in ebc.weights.items():
            grad, state = weight.grad, states[name]
            if sc["optimizer"] == "rowwise_adagrad":
                for k, (lo, hi) in enumerate(blocks[name]):
                    state[:, k] += (grad[:, lo:hi] ** 2).mean(dim=1)
                    weight[:, lo:hi] -= LR * grad[:, lo:hi] / (state[:, k].sqrt() + EPS)[:, None]
            elif sc["optimizer"] == "adagrad":
                state += grad * grad
                weight -= LR * grad / (state.sqrt() + EPS)
            else:
                weight -= LR * grad
            weight.grad = None

    model.reference_optimizer_step = step
    record = _train(model, weighted=sc["weighted"], rows=slice(0, 13), tables=tables)
    record["tables"] = {k: w.detach() for k, w in ebc.weights.items()}
    if sc["optimizer"] == "rowwise_adagrad":
        widths = {
            n: torch.tensor([hi - lo for lo, hi in b], dtype=torch.float32)
            for n, b in blocks.items()
        }
        record["states"] = {
            t.name: [states[t.name] @ widths[t.name] / t.embedding_dim] for t in tables
        }
    elif sc["optimizer"] == "adagrad":
        record["states"] = {n: [s] for n, s in states.items()}
    else:
        record["states"] = {t.name: [] for t in tables}
    record["keys"] = ebc.feature_names
    return record


def _check(results: list[list[dict]], scenarios: list[dict], world_size: int) -> None:
    for i, sc in enumerate(scenarios):
        ref = _reference(sc, _plan(sc, world_size))
        tol = FP16_TOL if sc.get("fp16") else TOL
        start = 0
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            rows = slice(start, start + SPLITS[world_size][rank])
            start = rows.stop
            assert got["keys"] == ref["keys"], sc["name"]
            assert_steps_match(
                got, ref, rows=rows, world_size=world_size, num_steps=NUM_STEPS, tol=tol
            )
            # Data-parallel replicas stay bit-identical on every rank.
            for name, replica in got["replicas"].items():
                assert torch.equal(replica, results[0][i]["replicas"][name]), (sc["name"], name)
            if rank:
                assert got["tables"] is None and got["states"] is None
            if sc.get("ssd"):
                assert got["mapped"] > 0, sc["name"]
            assert got["kernel"] == sc.get("kernel", "fbgemm"), sc["name"]
        got = results[0][i]
        assert got["tables"].keys() == ref["tables"].keys()
        for name, weight in ref["tables"].items():
            fp16 = sc.get("fp16") and name != "t4"
            assert got["tables"][name].dtype == (torch.float16 if fp16 else torch.float32)
            if sc.get("precision") and name != "t4":
                _assert_within_one_step(got["tables"][name], weight, sc["precision"], name=name)
                continue
            torch.testing.assert_close(
                got["tables"][name].float(), weight, **tol, msg=f"{sc['name']} {name}"
            )
            assert len(got["states"][name]) == len(ref["states"][name])
            for g, r in zip(got["states"][name], ref["states"][name], strict=True):
                torch.testing.assert_close(g, r, **tol, msg=f"{sc['name']} {name} state")


def _assert_within_one_step(got: torch.Tensor, ref: torch.Tensor, precision: str, name: str):
    """``got`` is ``ref`` quantized row by row with an error below one step (``range / L``):
    bounded per row by the whole row's range (a column block's is at most that), and not
    equal to ``ref`` (the rows were quantized)."""
    levels = 255 if precision == "int8" else 15
    lo, hi = torch.aminmax(ref, dim=1)
    bound = ((hi - lo) / levels * 1.01 + 1e-6).unsqueeze(1)
    excess = ((got - ref).abs() - bound).max()
    assert excess <= 0, f"{name} {precision}: {excess} beyond one step"
    assert not torch.equal(got, ref), name


def test_single_process_all_types() -> None:
    scenarios = SCENARIOS + TORCH_KERNEL
    _check([_worker(0, 1, scenarios)], scenarios, world_size=1)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_multi_process_all_types(world_size: int) -> None:
    scenarios = SCENARIOS + ([GROUPED] if world_size == 4 else [])
    if world_size > 2:
        scenarios = [sc for sc in scenarios if "host" not in sc]
    scenarios += TORCH_KERNEL if world_size == 2 else []
    results = run_distributed(_worker, world_size=world_size, args=(scenarios,), timeout_s=300)
    _check(results, scenarios, world_size=world_size)


def test_grouped_plan_stays_inside_a_group() -> None:
    plan = _plan(GROUPED, 4)
    for t in plan.tables:
        ranks = sorted(t.ranks)
        assert ranks in ([0, 1], [2, 3]), (t.name, ranks)
    assert {tuple(sorted(t.ranks)) for t in plan.tables} == {(0, 1), (2, 3)}


def test_column_wise_split_is_uneven_when_needed() -> None:
    plan = _plan({"default_type": "column_wise", "optimizer": "sgd", "weighted": True}, 2)
    widths = sorted(s.col_end - s.col_start for s in plan.table("t2").shards)
    assert widths == [4, 8]


def test_load_full_tables_every_type() -> None:
    sc = {**next(sc for sc in SCENARIOS if sc["name"] == "mixed/adagrad"), "weighted": False}
    tables, config = _tables(sc), _config(sc)
    ebc = TinyModel(tables).embedding_bags
    sharded = ShardedEmbeddingBagCollection(
        ebc, plan=plan_sharding(tables, world_size=1, config=config), config=config, device="cpu"
    )
    load_full_tables(sharded, {k: w.detach() * 2 + 1 for k, w in ebc.weights.items()})
    after = gather_full_tables(sharded)
    for name, weight in ebc.weights.items():
        torch.testing.assert_close(after[name], weight.detach() * 2 + 1)


def _coverage_errors(plan: ShardingPlan) -> list[str]:
    errors = []
    for t in plan.tables:
        count = torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.int64)
        for s in t.shards:
            count[s.row_start : s.row_end, s.col_start : s.col_end] += 1
        expected = plan.world_size if t.sharding_type == "data_parallel" else 1
        if not bool((count == expected).all()):
            errors.append(t.name)
        if len(set(t.ranks)) != len(t.ranks):
            errors.append(f"{t.name} ranks")
    return errors


def test_planner_covers_every_cell_exactly_once_on_random_tables() -> None:
    kinds = ["table_wise", *TYPES]
    for seed in range(60):
        rng = random.Random(seed)
        world_size = rng.choice([1, 2, 3, 4, 6, 8])
        group_size = rng.choice([d for d in range(1, world_size + 1) if world_size % d == 0])
        tables = [
            EmbeddingBagConfig(
                name=f"t{i}",
                num_embeddings=rng.randint(1, 40),
                embedding_dim=4 * rng.randint(1, 6),
                feature_names=(f"f{i}",),
            )
            for i in range(rng.randint(1, 12))
        ]
        pinned_types = {t.name: rng.choice(kinds) for t in tables if rng.random() < 0.7}
        pinned_ranks = {
            t.name: rng.sample(range(world_size), rng.randint(1, world_size))
            for t in tables
            if rng.random() < 0.3
            and pinned_types.get(t.name) not in ("data_parallel", "table_row_wise")
        }
        config = ShardingConfig(
            default_type=rng.choice(kinds),
            pinned_types=pinned_types,
            pinned_ranks={k: v for k, v in pinned_ranks.items() if k in pinned_types},
            group_size=group_size,
        )
        plan = plan_sharding(tables, world_size=world_size, config=config)
        assert _coverage_errors(plan) == [], seed
        for t in plan.tables:
            assert t.sharding_type == pinned_types.get(t.name, config.default_type)
            if t.name in config.pinned_ranks:
                assert set(t.ranks) <= set(config.pinned_ranks[t.name]), seed


def test_plan_validation_rejects_bad_shards_naming_the_table() -> None:
    tables = make_tables()
    config = ShardingConfig(default_type="row_wise")
    plan = plan_sharding(tables, world_size=2, config=config)
    t0 = plan.table("t0")
    first, second = t0.shards
    t0.shards = [first, type(first)(1, first.row_end - 1, 50, 0, 8)]
    with pytest.raises(ValueError, match=r"table 't0'.*covered twice"):
        plan.validate(tables)
    t0.shards = [first]
    with pytest.raises(ValueError, match=r"table 't0'.*not covered"):
        plan.validate(tables)
    t0.shards = [first, second]
    t0.sharding_type = "data_parallel"
    with pytest.raises(ValueError, match=r"table 't0'.*data_parallel"):
        plan.validate(tables)


def test_planner_rejects_bad_pins_and_group_size() -> None:
    tables = make_tables()
    with pytest.raises(ValueError, match=r"pinned_ranks\.t0: a data_parallel table"):
        plan_sharding(
            tables,
            world_size=2,
            config=ShardingConfig(pinned_types={"t0": "data_parallel"}, pinned_ranks={"t0": [0]}),
        )
    with pytest.raises(ValueError, match="group_size 2 does not divide the world size 3"):
        plan_sharding(tables, world_size=3, config=ShardingConfig(group_size=2))
    with pytest.raises(ValueError, match=r"pinned_types names unknown tables \['nope'\]"):
        plan_sharding(
            tables, world_size=2, config=ShardingConfig(pinned_types={"nope": "row_wise"})
        )
