"""RecD parity: looking dedup groups up on their unique rows gives the plain path's outputs,
gradients, updated tables and optimizer state, for every sharding type and 1-4 ranks, with a
batch size per rank and per feature (a group's unique rows) and a rank whose unique rows hold
no ids; the unsharded collection too. Plus one input and one output all-to-all per step, the
group-boundary error and the statistics."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from raydlrm.batch import DedupGroup, KeyedJaggedTensor
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding import ShardingConfig, plan_sharding, shard_model
from raydlrm.sharding._layout import batch_classes
from raydlrm.sharding.planner.cost import estimate_table_cost
from tests._multiprocess import run_distributed
from tests._tolerance import assert_sums_close, sum_order_tol
from tests.sharding._fixtures import (
    MAGNITUDE,
    TinyModel,
    gather_full_optimizer_states,
    gather_full_tables,
    make_tables,
)

GROUPS = [["f0", "f1"], ["f3"]]  # t0 (two features) and t2 deduplicated; t1, t3 plain
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "mixed"]
MIXED = {"t0": "row_wise", "t1": "data_parallel", "t2": "column_wise", "t3": "table_wise"}
STEPS = 2
LR = 0.1


def _tol(world_size: int) -> dict[str, float]:
    """The dedup path sums a row's gradient in another order (the duplicates' first): at most
    every id of t0's two features in the global batch (rank r has 6 + r samples of up to 3 ids);
    each step carries the difference on, an update's gain at most 1 (eps = lr); the values stay
    below the shared fixtures' :data:`MAGNITUDE` (the same tiny model)."""
    samples = sum(6 + r for r in range(world_size))
    return sum_order_tol(2 * 3 * samples, MAGNITUDE, k=2 * STEPS)


def _kjt(keys: list[str], rows: int, gen: torch.Generator, *, weighted: bool) -> KeyedJaggedTensor:
    sizes = {"f0": 50, "f1": 50, "f2": 30, "f3": 40, "f4": 20}
    lengths = torch.randint(0, 4, (len(keys) * rows,), generator=gen)
    per_key = lengths.view(len(keys), rows).sum(1).tolist() if rows else [0] * len(keys)
    values = torch.cat(
        [
            torch.randint(0, sizes[k], (n,), generator=gen)
            for k, n in zip(keys, per_key, strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths(keys, values, lengths, weights=weights)


def _batch(rank: int, step: int, *, weighted: bool):
    """This rank's batch: plain features of B rows, and each group as U unique rows + inverse
    (B and U differ across ranks; rank 1's first group has no ids at all)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    batch = 6 + rank
    plain = _kjt(["f2", "f4"], batch, gen, weighted=weighted)
    groups = []
    for g, keys in enumerate(GROUPS):
        unique = 2 + (rank + g) % 3
        inverse = torch.cat([torch.arange(unique), torch.randint(0, unique, (batch - unique,))])
        inverse = inverse[torch.randperm(batch, generator=gen)]
        kjt = _kjt(keys, unique, gen, weighted=weighted)
        if rank == 1 and g == 0:
            kjt = KeyedJaggedTensor.from_lengths(
                keys,
                kjt.values[:0],
                torch.zeros_like(kjt.lengths),
                weights=None if kjt.weights is None else kjt.weights[:0],
            )
        groups.append(DedupGroup(kjt, inverse))
    return plain, groups


@contextlib.contextmanager
def _count_collectives() -> Iterator[Counter]:
    """Counts the calls of torch.distributed's collectives the collection uses, by name."""
    calls: Counter = Counter()
    names = ("all_to_all_single", "all_gather")
    originals = {n: getattr(dist, n) for n in names}

    def counting(name: str):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _run(
    rank: int, world_size: int, kind: str, *, optimizer: str, weighted: bool, kernel: str = "auto"
) -> dict:
    tables = make_tables(mean_pooling=not weighted)
    config = ShardingConfig(
        kernel=kernel,
        optimizer=optimizer,
        learning_rate=LR,
        eps=LR,  # an update's gain at most 1 (tests/_tolerance.py)
        default_type="table_wise" if kind == "mixed" else kind,
        pinned_types=MIXED if kind == "mixed" else {},
    )
    plan = plan_sharding(tables, world_size=world_size, config=config)
    plain_model = shard_model(TinyModel(tables), plan=plan, config=config, device="cpu")
    dedup_model = shard_model(
        TinyModel(tables), plan=plan, config=config, device="cpu", dedup_groups=GROUPS
    )
    out = {"plain": [], "dedup": [], "collectives": {}}
    for step in range(STEPS):
        plain, groups = _batch(rank, step, weighted=weighted)
        expanded = KeyedJaggedTensor.concat([plain] + [g.expand() for g in groups])
        for name, model, args in (
            ("plain", plain_model, (expanded,)),
            ("dedup", dedup_model, (plain, groups)),
        ):
            with _count_collectives() as calls:
                pooled = model.embedding_bags(*args).values
                loss = model.dense(pooled).pow(2).mean()
                model.dense.zero_grad()
                loss.backward()
            out["collectives"][name] = calls
            dense = getattr(model.dense, "module", model.dense)
            out[name].append(
                {"pooled": pooled.detach(), "grad": [p.grad.clone() for p in dense.parameters()]}
            )
    for name, model in (("plain", plain_model), ("dedup", dedup_model)):
        out[f"{name}_tables"] = gather_full_tables(model.embedding_bags, dst=0)
        out[f"{name}_states"] = gather_full_optimizer_states(model.embedding_bags, dst=0)
    out["stats"] = dedup_model.embedding_bags.dedup_stats()
    out["bytes"] = (
        plain_model.embedding_bags.comm_bytes(),
        dedup_model.embedding_bags.comm_bytes(),
    )
    return out


def _worker(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    return [_run(rank, world_size, k, optimizer=o, weighted=w, kernel=n) for k, o, w, n in cases]


def _assert_parity(result: dict, rank: int, world_size: int) -> None:
    tol = _tol(world_size)
    for p, d in zip(result["plain"], result["dedup"], strict=True):
        torch.testing.assert_close(d["pooled"], p["pooled"], **tol)
        for gd, gp in zip(d["grad"], p["grad"], strict=True):
            torch.testing.assert_close(gd, gp, **tol)
    if rank == 0:
        for name, table in result["plain_tables"].items():
            torch.testing.assert_close(result["dedup_tables"][name], table, **tol)
            for sd, sp in zip(
                result["dedup_states"][name], result["plain_states"][name], strict=True
            ):
                torch.testing.assert_close(sd, sp, **tol)


CASES = [(kind, "rowwise_adagrad", False, "auto") for kind in TYPES] + [
    ("mixed", "adagrad", True, "auto"),
    ("table_wise", "sgd", True, "auto"),
]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_dedup_matches_the_plain_path(world_size: int) -> None:
    results = run_distributed(_worker, world_size=world_size, args=(CASES,), timeout_s=240)
    for rank, per_case in enumerate(results):
        for case, result in zip(CASES, per_case, strict=True):
            try:
                _assert_parity(result, rank, world_size)
            except AssertionError as e:
                raise AssertionError(f"case {case}, rank {rank}/{world_size}: {e}") from e
    # Only unique rows crossed the network: fewer output bytes than the plain path, in as many
    # collectives (one input and one output all-to-all per step, whatever the groups).
    plain_bytes, dedup_bytes = results[0][0]["bytes"]
    if world_size > 1:
        assert sum(dedup_bytes["forward"].values()) < sum(plain_bytes["forward"].values())
        for case, result in zip(CASES, results[0], strict=True):
            calls = result["collectives"]
            assert calls["dedup"] == calls["plain"], (case, calls)
        # table-wise, unweighted: lengths and ids, the batch sizes, forward and backward
        assert results[0][0]["collectives"]["dedup"] == Counter(all_to_all_single=4, all_gather=1)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [3, 4])
def test_dedup_matches_the_plain_path_on_more_ranks(world_size: int) -> None:
    # the torch kernel's permutations too (the cases above run fbgemm's where it is installed)
    cases = [("mixed", "rowwise_adagrad", True, "torch"), ("row_wise", "adagrad", False, "torch")]
    results = run_distributed(_worker, world_size=world_size, args=(cases,))
    for rank, per_case in enumerate(results):
        for case, result in zip(cases, per_case, strict=True):
            try:
                _assert_parity(result, rank, world_size)
            except AssertionError as e:
                raise AssertionError(f"case {case}, rank {rank}/{world_size}: {e}") from e


def test_unsharded_collection_dedup_parity() -> None:
    model = TinyModel(make_tables())
    plain, groups = _batch(0, 0, weighted=False)
    expanded = KeyedJaggedTensor.concat([plain] + [g.expand() for g in groups])
    reference = model.embedding_bags(expanded).values
    reference.sum().backward()
    grads = {k: w.grad.clone() for k, w in model.embedding_bags.weights.items()}
    model.zero_grad()
    got = model.embedding_bags(plain, groups).values
    got.sum().backward()
    # Each bag pools the same ids in the same order: the same arithmetic.
    assert torch.equal(got, reference)
    # A row's gradient sums positive terms (1, or 1 / length for t1's mean bags), the
    # duplicates' first: at most every id of t0's two features in the batch's 6 samples.
    for k, w in model.embedding_bags.weights.items():
        assert_sums_close(w.grad, grads[k], n_terms=2 * 3 * 6)


def test_a_table_across_a_group_boundary_is_an_error() -> None:
    tables = make_tables()  # t0 is looked up by f0 and f1
    with pytest.raises(ValueError, match=r"table 't0'.*not all in the same dedup group"):
        batch_classes(tables, [["f0"]])
    with pytest.raises(ValueError, match=r"features \['nope'\]"):
        batch_classes(tables, [["nope"]])
    classes = batch_classes(tables, GROUPS)
    assert classes == {"f0": 1, "f1": 1, "f2": 0, "f3": 2, "f4": 0}


def test_dedup_stats_count_rows_and_lookups_saved() -> None:
    tables = [
        EmbeddingBagConfig(name="u", num_embeddings=10, embedding_dim=4, feature_names=("f",))
    ]
    config = ShardingConfig()
    plan = plan_sharding(tables, world_size=1, config=config)
    model = shard_model(
        TinyModel(tables), plan=plan, config=config, device="cpu", dedup_groups=[["f"]]
    )
    unique = KeyedJaggedTensor.from_lengths(["f"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
    group = DedupGroup(unique, torch.tensor([0, 1, 1, 1, 0, 1]))  # 6 samples, 2 unique rows
    other = KeyedJaggedTensor.from_lengths(  # no table reads it: the group is all there is
        ["other"], torch.zeros(0, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    )
    model.embedding_bags(other, [group])
    stats = model.embedding_bags.dedup_stats()["u"]
    assert stats["ratio"] == 3.0
    # Expanded: 2 samples x 1 id + 4 samples x 2 ids = 10 ids; looked up: 3.
    assert stats["lookups_saved"] == 7.0


def test_the_planner_counts_a_dedup_table_on_its_unique_rows() -> None:
    user = EmbeddingBagConfig(name="u", num_embeddings=1000, embedding_dim=16, feature_names=("u",))
    kwargs = {"world_size": 2, "config": ShardingConfig(), "batch_size": 4096}
    pooling = {"pooling_factors": {"u": 100.0}}
    plain = plan_sharding([user], **kwargs, **pooling).table("u").cost
    dedup = plan_sharding([user], **kwargs, **pooling, dedup_ratios={"u": 8.0}).table("u").cost

    def cost(rows: float):
        return estimate_table_cost(
            user,
            sharding_type="table_wise",
            num_shards=1,
            world_size=2,
            batch_size=rows,
            pooling_factor=100.0,
        )

    assert plain == pytest.approx(cost(4096).seconds)
    assert dedup == pytest.approx(cost(512).seconds) and dedup < plain / 4
    full, eighth = cost(4096), cost(512)
    assert eighth.compute_bytes == pytest.approx(full.compute_bytes / 8)
    assert eighth.input_comm_bytes == pytest.approx(full.input_comm_bytes / 8)
    assert eighth.output_comm_bytes == pytest.approx(full.output_comm_bytes / 8)
    with pytest.raises(ValueError, match=r"dedup_ratios below 1 .*'u': 0.5"):
        plan_sharding([user], **kwargs, dedup_ratios={"u": 0.5})
    with pytest.raises(ValueError, match=r"dedup_ratios names unknown tables \['v'\]"):
        plan_sharding([user], **kwargs, dedup_ratios={"v": 2.0})
