"""Disaggregated Multi-Tower (:mod:`raydlrm.sharding.towers`): towers pinned to hosts equal the
flat model.

Four gloo ranks as 2 hosts x 2 ranks (and as 4 hosts of one rank, one with an empty batch)
each feed their own (unequal) slice of a seeded global
batch through a :class:`ShardedTowerCollection` and a data-parallel head; the reference runs
the whole batch through the unsharded collection, the same tower modules and head, with the
fused optimizer's update written in torch. With identity towers the outputs are the pooled
embeddings, so this is also the flat model's equivalence; with compressing towers (a linear
projection each, data-parallel inside its host) the tower modules' gradients must be those of
the reference too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raydlrm.batch import KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagCollection
from raydlrm.sharding import ShardingConfig
from raydlrm.sharding.planner.tower_plan import plan_towers
from raydlrm.sharding.topology import Topology, topology_groups
from raydlrm.sharding.tower_spec import Tower, check_towers
from raydlrm.sharding.towers import ShardedTowerCollection
from tests._multiprocess import run_distributed
from tests.sharding._fixtures import (
    EPS,
    GLOBAL_BATCH,
    LR,
    NUM_STEPS,
    SPLITS,
    feature_rows,
    gather_full_tables,
    global_batch,
    make_tables,
    parity_tol,
    reference_optimizer,
    targets,
)

# The second tower is on host 0: the output columns are reordered from host order.
TOWERS = [Tower("item", ("f2", "f3"), host=1), Tower("user", ("f0", "f1", "f4"), host=0)]
# One rank per host (no intra-host communication), the towers not in host order either.
TOWERS_4 = [
    Tower("a", ("f0", "f1"), host=0),
    Tower("b", ("f4",), host=3),
    Tower("c", ("f2",), host=1),
    Tower("d", ("f3",), host=2),
]
DIMS = {"f0": 8, "f1": 8, "f2": 4, "f3": 12, "f4": 4}
TOWER_INPUT = {t.name: sum(DIMS[f] for f in t.features) for t in TOWERS + TOWERS_4}
COMPRESSED = 6
# The tower modules add one sum to each step's chain (a tower's outputs, then the dense layer's).
TOWER_TOL = parity_tol(depth=3)
SPLITS_4 = [6, 0, 4, 3]  # rank 1 has an empty batch
SCENARIOS = [
    {"compress": False, "optimizer": "rowwise_adagrad", "weighted": False, "type": "table_wise"},
    {"compress": False, "optimizer": "sgd", "weighted": True, "type": "row_wise"},
    {"compress": True, "optimizer": "adagrad", "weighted": False, "type": "column_wise"},
    {"compress": True, "optimizer": "rowwise_adagrad", "weighted": True, "type": "data_parallel"},
    {"compress": True, "optimizer": "sgd", "weighted": False, "type": "table_wise", "hosts": 4},
]


def _towers(sc: dict) -> list[Tower]:
    return TOWERS_4 if sc.get("hosts") == 4 else TOWERS


def _rows(sc: dict, rank: int) -> slice:
    splits = SPLITS_4 if sc.get("hosts") == 4 else SPLITS[4]
    start = sum(splits[:rank])
    return slice(start, start + splits[rank])


def _tower_modules(sc: dict) -> dict[str, nn.Module | None]:
    torch.manual_seed(1)
    if not sc["compress"]:
        return {}
    return {t.name: nn.Linear(TOWER_INPUT[t.name], COMPRESSED) for t in _towers(sc)}


def _head(sc: dict) -> nn.Module:
    torch.manual_seed(2)
    towers = _towers(sc)
    width = COMPRESSED * len(towers) if sc["compress"] else sum(DIMS.values())
    return nn.Linear(width, 1)


class _Reference(nn.Module):
    """The towers written out on one process: each tower's pooled features, in its order,
    through its module, side by side in tower order."""

    def __init__(self, ebc: EmbeddingBagCollection, sc: dict):
        super().__init__()
        self.ebc = ebc
        self.towers = _towers(sc)
        modules = _tower_modules(sc)
        self.blocks = nn.ModuleDict({k: m for k, m in modules.items() if m is not None})

    def forward(self, kjt):
        pooled = self.ebc(kjt).to_dict()
        outs = []
        for t in self.towers:
            x = torch.cat([pooled[f] for f in t.features], dim=1)
            outs.append(self.blocks[t.name](x) if t.name in self.blocks else x)
        return torch.cat(outs, dim=1)


def _train(collection, head, blocks: dict[str, nn.Module], *, sc: dict, rows: slice, step_fn):
    """NUM_STEPS steps on samples ``rows`` of each global batch: outputs, their gradients (the
    loss scaled by the world size over the global batch, see test_embedding), the head's and
    each tower module's gradients."""
    tables = make_tables(mean_pooling=not sc["weighted"])
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    record = {"out": [], "out_grad": [], "head_grad": [], "tower_grad": []}
    for step in range(NUM_STEPS):
        batch = global_batch(step, weighted=sc["weighted"], rows=feature_rows(tables))
        out = collection(batch.index_rows(torch.arange(rows.start, rows.stop)))
        out = out.values if isinstance(out, KeyedTensor) else out
        out.retain_grad()
        pred = head(out).squeeze(1)
        loss = ((pred - targets(step)[rows]) ** 2).sum() * world_size / GLOBAL_BATCH
        loss.backward()
        if step_fn is not None:
            step_fn()
        record["out"].append(out.detach().clone())
        record["out_grad"].append(out.grad.clone())
        params = list(getattr(head, "module", head).parameters())
        record["head_grad"].append([p.grad.clone() for p in params])
        record["tower_grad"].append(
            {k: [p.grad.clone() for p in m.parameters()] for k, m in blocks.items()}
        )
        for p in [*params, *(p for m in blocks.values() for p in m.parameters())]:
            p.grad = None
    return record


def _reference(sc: dict) -> dict:
    tables = make_tables(mean_pooling=not sc["weighted"])
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables)
    model = _Reference(ebc, sc)
    step, _ = reference_optimizer(ebc, sc["optimizer"], lr=LR, eps=EPS)
    blocks = dict(model.blocks.items())
    record = _train(model, _head(sc), blocks, sc=sc, rows=slice(0, GLOBAL_BATCH), step_fn=step)
    record["tables"] = {k: w.detach() for k, w in ebc.weights.items()}
    return record


def _tower_worker(rank: int, world_size: int, scenarios: list[dict]) -> list[dict]:
    results = []
    by_hosts = {}
    for sc in scenarios:
        hosts = sc.get("hosts", 2)
        if hosts not in by_hosts:
            by_hosts[hosts] = topology_groups(Topology(hosts, world_size // hosts))
        groups, towers, rows = by_hosts[hosts], _towers(sc), _rows(sc, rank)
        topology = groups.topology
        tables = make_tables(mean_pooling=not sc["weighted"])
        config = ShardingConfig(
            optimizer=sc["optimizer"], learning_rate=LR, eps=EPS, default_type=sc["type"]
        )
        plan = plan_towers(tables, towers, topology, config=config)
        modules = _tower_modules(sc)
        torch.manual_seed(0)
        collection = ShardedTowerCollection(
            EmbeddingBagCollection(tables),
            towers=towers,
            modules=modules,
            output_widths={t.name: COMPRESSED for t in towers},
            plan=plan,
            config=config,
            device="cpu",
            groups=groups,
        )
        mine = getattr(collection.tower_modules, "module", collection.tower_modules)
        head = DistributedDataParallel(_head(sc))
        record = _train(collection, head, dict(mine.blocks.items()), sc=sc, rows=rows,
                        step_fn=None)  # fmt: skip
        # A plan over every rank: checkpoints gather the shards as any collection's.
        record["tables"] = gather_full_tables(collection, dst=0)
        record["shards"] = collection.local_shards()
        record["keys"] = collection.feature_names
        record["tower_ddp"] = type(collection.tower_modules).__name__
        record["comm"] = collection.comm_bytes()
        results.append(record)
    return results


@pytest.fixture(scope="module")
def tower_runs() -> list[list[dict]]:
    return run_distributed(_tower_worker, world_size=4, args=(SCENARIOS,))


@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=lambda i: str(SCENARIOS[i]))
def test_towers_on_hosts_equal_the_flat_model(index: int, tower_runs) -> None:
    sc = SCENARIOS[index]
    ref = _reference(sc)
    for rank, got in enumerate(r[index] for r in tower_runs):
        rows = _rows(sc, rank)
        host = rank // (4 // sc.get("hosts", 2))
        if not sc["compress"]:
            assert got["keys"] == ["f2", "f3", "f0", "f1", "f4"]
        for step in range(NUM_STEPS):
            torch.testing.assert_close(got["out"][step], ref["out"][step][rows], **TOWER_TOL)
            torch.testing.assert_close(
                got["out_grad"][step] / 4, ref["out_grad"][step][rows], **TOWER_TOL
            )
            for g, r in zip(got["head_grad"][step], ref["head_grad"][step], strict=True):
                torch.testing.assert_close(g, r, **TOWER_TOL)
            # Each rank holds its host's tower modules only, averaged over the host's ranks.
            mine = [t.name for t in _towers(sc) if t.host == host] if sc["compress"] else []
            assert sorted(got["tower_grad"][step]) == mine
            for name in mine:
                for g, r in zip(
                    got["tower_grad"][step][name], ref["tower_grad"][step][name], strict=True
                ):
                    torch.testing.assert_close(g, r, **TOWER_TOL)
        ddp = sc["compress"] and sc.get("hosts", 2) == 2  # data parallel over a host's 2 ranks
        assert got["tower_ddp"] == ("DistributedDataParallel" if ddp else "_HostTowers")
    # Each rank's shards are of its host's tables, named by their global rank; the updated
    # tables, gathered from every rank's shards, equal the reference's.
    for rank, got in enumerate(r[index] for r in tower_runs):
        host = rank // (4 // sc.get("hosts", 2))
        mine = {f for t in _towers(sc) if t.host == host for f in t.features}
        tables = {t.name: t for t in make_tables()}
        assert all(s.rank == rank for s in got["shards"].values())
        assert all(set(tables[n].feature_names) <= mine for n in got["shards"])
    for name, weight in ref["tables"].items():
        torch.testing.assert_close(tower_runs[0][index]["tables"][name], weight, **TOWER_TOL)


def test_only_tower_outputs_cross_hosts(tower_runs) -> None:
    """Cross-host bytes: the ids each rank sends to the other host, and tower outputs (6
    columns per compressed tower against the tower's 16 or 20 pooled columns): a rank sends
    its host's tower outputs of the other host's samples."""
    for rank, results in enumerate(tower_runs):
        plain, compressed = results[0]["comm"], results[2]["comm"]
        assert plain["cross_input"]["ids"] > 0
        mine = next(t for t in TOWERS if t.host == rank // 2)
        ratio = plain["cross_forward"]["float32"] / compressed["cross_forward"]["float32"]
        assert ratio == pytest.approx(TOWER_INPUT[mine.name] / COMPRESSED)


def test_bad_towers_name_the_tower_and_feature() -> None:
    tables = make_tables()
    good = [Tower("a", ("f0", "f1", "f2"), 0), Tower("b", ("f3", "f4"), 1)]
    check_towers(good, tables, num_hosts=2)
    for towers, message in (
        ([Tower("a", ("f0", "f1", "f2"), 0), Tower("b", ("f3",), 1)], r"\['f4'\] are in no tower"),
        ([*good, Tower("c", ("f4",), 1)], "feature f4 is in towers b and c"),
        ([Tower("a", ("f0", "f2"), 0), Tower("b", ("f1", "f3", "f4"), 1)], "table t0 .* towers"),
        ([good[0], Tower("b", ("f3", "f4"), 2)], "tower b: host 2 is not in 0..1"),
        ([*good, Tower("c", ("f9",), 0)], r"towers \['c'\]: unknown features \['f9'\]"),
        ([Tower("a", ("f0", "f1", "f2", "f3", "f4"), 0)], r"hosts \[1\] have no tower"),
    ):
        with pytest.raises(ValueError, match=message):
            check_towers(towers, tables, num_hosts=2)


def test_one_process_prefetch_dedup_bad_ids_and_per_table_settings() -> None:
    """Without a process group (one host of one rank): a prefetched batch with a dedup group
    is found by its features and gives the same output, another training batch raises; a bad
    id is named on the rank whose
    batch it is; per-table settings and pinned ranks of a plan over hosts go to the host of
    their table, pinned ranks numbered inside it."""
    from raydlrm.batch import DedupGroup

    tables = make_tables()
    config = ShardingConfig()  # no backward here: the tables stay as they are
    towers = [Tower("all", ("f0", "f1", "f2", "f3", "f4"), host=0)]
    topology = Topology(1, 1)
    collection = ShardedTowerCollection(
        EmbeddingBagCollection(tables),
        towers=towers,
        modules={},
        output_widths={},
        plan=plan_towers(tables, towers, topology, config=config),
        config=config,
        device="cpu",
        groups=topology_groups(topology),
    )
    batch = global_batch(0, weighted=False, rows=feature_rows(tables))
    plain = batch.select(["f0", "f1", "f2", "f3"])
    user = batch.select(["f4"]).index_rows(torch.arange(3))
    group = DedupGroup(unique=user, inverse=torch.arange(GLOBAL_BATCH) % 3)
    expected = collection(KeyedJaggedTensor.concat([plain, group.expand()])).values
    for _ in range(2):
        collection.prefetch(plain, [group])
        torch.testing.assert_close(collection(plain, [group]).values, expected)
        assert len(collection.prefetched) == 0
    # An evaluation between routes its own batches and leaves the routed one queued; a training
    # step on another batch than the routed one is a bug, and raises (it once routed anew).
    collection.prefetch(plain, [group])
    other = KeyedJaggedTensor.concat([plain, group.expand()])
    collection.eval()
    torch.testing.assert_close(collection(other).values, expected)
    assert len(collection.prefetched) == 1
    collection.train()
    with pytest.raises(RuntimeError, match=r"routed ahead was routed for other features"):
        collection(other)
    collection.discard_prefetched()
    bad = global_batch(0, weighted=False, rows={**feature_rows(tables), "f3": 41})
    with pytest.raises(ValueError, match=r"table 't2' \(feature 'f3'\): id 40 not in \[0, 40\)"):
        collection(bad)

    two = [Tower("a", ("f0", "f1", "f2"), host=0), Tower("b", ("f3", "f4"), host=1)]
    config = ShardingConfig(
        pinned_ranks={"t2": [3]},
        weights_precision_per_table={"t2": "fp16"},
        comm_precision_per_table={"t0": "fp16"},
    )
    plan = plan_towers(tables, two, Topology(2, 2), config=config, pooling_factors={"t0": 2.0})
    assert [s.rank for s in plan.table("t2").shards] == [3]
    with pytest.raises(ValueError, match=r"pinned_ranks.t0: ranks \[2\] are not on host 0"):
        plan_towers(tables, two, Topology(2, 2), config=ShardingConfig(pinned_ranks={"t0": [2]}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_towers_on_cuda_match_the_reference() -> None:
    """One host of one rank on CUDA, compressing towers with row-wise Adagrad: the outputs, the
    tower modules' gradients and the trained tables equal the CPU reference's; a bad id is
    named on the GPU too (the vectorized check, one host sync)."""
    sc = {"compress": True, "optimizer": "rowwise_adagrad", "weighted": False, "type": "table_wise"}
    reference = _reference(sc)
    # The GPU's kernels sum in other orders than the CPU's.
    gpu_tol = TOWER_TOL  # a GPU's sums in its own orders, bounded alike
    tables = make_tables(mean_pooling=True)
    towers = [Tower(t.name, t.features, host=0) for t in TOWERS]
    topology = Topology(1, 1)
    config = ShardingConfig(optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS)
    torch.manual_seed(0)
    collection = ShardedTowerCollection(
        EmbeddingBagCollection(tables),
        towers=towers,
        modules=_tower_modules(sc),
        output_widths={t.name: COMPRESSED for t in towers},
        plan=plan_towers(tables, towers, topology, config=config),
        config=config,
        device="cuda",
        groups=topology_groups(topology),
    )
    head = _head(sc).cuda()
    blocks = dict(getattr(collection.tower_modules, "module", collection.tower_modules).blocks)
    for step in range(NUM_STEPS):
        batch = global_batch(step, weighted=False, rows=feature_rows(tables)).to("cuda")
        out = collection(batch)
        out = out.values if isinstance(out, KeyedTensor) else out
        loss = ((head(out).squeeze(1) - targets(step).cuda()) ** 2).sum() / GLOBAL_BATCH
        loss.backward()
        torch.testing.assert_close(out.detach().cpu(), reference["out"][step], **gpu_tol)
        for name, grads in reference["tower_grad"][step].items():
            for p, g in zip(blocks[name].parameters(), grads, strict=True):
                torch.testing.assert_close(p.grad.cpu(), g, **gpu_tol)
        for p in [*head.parameters(), *(p for m in blocks.values() for p in m.parameters())]:
            p.grad = None
    for name, weight in collection.local_tables().items():
        torch.testing.assert_close(weight.cpu(), reference["tables"][name], **gpu_tol)
    bad = global_batch(0, weighted=False, rows={**feature_rows(tables), "f3": 41}).to("cuda")
    with pytest.raises(ValueError, match=r"table 't2' \(feature 'f3'\): id 40 not in \[0, 40\)"):
        collection(bad)


def test_tower_modules_on_hosts_autocast_to_the_dense_precision() -> None:
    """``training.precision`` reaches the tower modules a tower collection runs on their hosts:
    they compute in bf16 (other values than fp32's, close to them) and hand fp32 on."""
    from raydlrm.sharding.towers import _HostTowers
    from raydlrm.trainers.config import TrainingConfig
    from raydlrm.trainers.precision import DensePrecision

    torch.manual_seed(0)
    host = _HostTowers([Tower("a", ("f0", "f1"), host=0)], {"a": nn.Linear(8, 4)})
    pooled = {"f0": torch.randn(5, 4), "f1": torch.randn(5, 4)}
    fp32 = host(pooled)
    holder = nn.Module()
    holder.towers = host
    DensePrecision(TrainingConfig(precision="bf16"), holder, torch.device("cpu"))
    assert host.dense_dtype == torch.bfloat16
    low = host(pooled)
    assert low.dtype == torch.float32 and not torch.equal(low, fp32)
    torch.testing.assert_close(low, fp32, atol=0.05, rtol=0.05)
