"""The SSD tier's pieces (``raydlrm.sharding.tiers``) and how the planner and the config treat
placements. (Training on the SSD tier equals training in DRAM:
``tests/sharding/test_sharding_types.py``, scenarios ``mixed/ssd/*``.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from raydlrm.sharding import ShardingConfig, ShardingPlan, plan_sharding
from raydlrm.sharding.sizes import table_memory_bytes
from raydlrm.sharding.tiers import TierError, mapped_buffer
from tests._tolerance import EPS16
from tests.sharding._fixtures import make_tables


def _collection(tables: list, *, seed: int, device: str = "cpu", **settings):
    """A sharded collection of ``tables`` on one rank, created from ``seed``, with the
    :class:`ShardingConfig` of ``settings``."""
    from raydlrm.models.embedding import EmbeddingBagCollection
    from raydlrm.sharding import ShardedEmbeddingBagCollection

    config = ShardingConfig(**settings)
    plan = plan_sharding(tables, world_size=1, config=config)
    ebc = EmbeddingBagCollection(tables, device="meta", seed=seed)
    return ShardedEmbeddingBagCollection(ebc, plan=plan, config=config, device=device)


def test_mapped_buffer_is_a_file_on_disk_gone_from_the_directory(tmp_path: Path) -> None:
    buffer = mapped_buffer(tmp_path, 1000, torch.float16, tables=["t0"])
    assert buffer.dtype == torch.float16 and buffer.shape == (1000,)
    assert torch.count_nonzero(buffer) == 0
    buffer[10:20] = 3.0
    assert float(buffer[15]) == 3.0
    assert not list(tmp_path.iterdir())  # unlinked at once: nothing left behind
    maps = Path("/proc/self/maps").read_text()
    assert any(str(tmp_path) in line and "(deleted)" in line for line in maps.splitlines())


def test_unwritable_or_too_small_directory_names_tables_and_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(TierError, match=r"ssd tables \['t_big'\]: cannot write to .*a-file"):
        mapped_buffer(blocker / "ssd", 10, torch.float32, tables=["t_big"])
    with pytest.raises(
        TierError, match=rf"ssd tables \['t_big'\] need 4\.00 TiB on {tmp_path} .* free there"
    ):
        mapped_buffer(tmp_path, 2**40, torch.float32, tables=["t_big"])


def test_planner_counts_only_the_memory_an_ssd_table_keeps_in_dram() -> None:
    tables = make_tables()
    t0 = tables[0]
    config = ShardingConfig(placement={t0.name: "ssd"}, cache_load_factor=0.0)
    plan = plan_sharding(tables, world_size=2, config=config)
    assert plan.table(t0.name).placement == "ssd"
    assert {t.placement for t in plan.tables if t.name != t0.name} == {"dram"}
    # Row-wise Adagrad's per-row state stays in memory; Adagrad's per-weight state goes to disk.
    assert plan.table(t0.name).memory_bytes == t0.num_embeddings * 4
    assert table_memory_bytes(t0, optimizer="adagrad", placement="ssd") == 0
    # With a DRAM row cache of 20 rows: their weights, state and bookkeeping, and the row map.
    cached = ShardingConfig(placement={t0.name: "ssd"}, cache_load_factor=0.4, cache_min_rows=10)
    plan_cached = plan_sharding(tables, world_size=2, config=cached)
    assert plan_cached.table(t0.name).memory_bytes == 50 * 4 + 50 * 4 + 20 * (8 * 4 + 4 + 16)
    assert f"{t0.name} (ssd)" in plan.format_table()
    # The ssd column: the table's weights on disk (row-wise Adagrad's state stays in DRAM).
    assert sum(plan.per_rank_disk()) == t0.num_embeddings * t0.embedding_dim * 4
    assert plan.format_table().splitlines()[0].split()[-1] == "ssd"
    restored = ShardingPlan.from_json(plan.to_json())
    assert restored.table(t0.name).placement == "ssd"
    with pytest.raises(ValueError, match=r"sharding\.placement names unknown tables \['nope'\]"):
        plan_sharding(tables, world_size=2, config=ShardingConfig(placement={"nope": "ssd"}))


def test_unknown_tier_is_named_with_its_dotted_key() -> None:
    from raydlrm.platform.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"sharding\.placement\.t_C1"):
        load_config(None, overrides=['sharding.placement={ t_C1 = "tape" }'])
    with pytest.raises(ConfigError, match=r"sharding\.default_placement"):
        load_config(None, overrides=["sharding.default_placement=nvme"])


def test_resident_bytes_counts_pages_in_memory(tmp_path: Path) -> None:
    from raydlrm.sharding.tiers import resident_bytes

    touched = torch.ones(1 << 20)  # 4 MiB written: all resident
    assert resident_bytes(touched) == touched.numel() * 4
    untouched = torch.empty(1 << 24)  # 64 MiB allocated, never written: not in memory yet
    assert resident_bytes(untouched) < (1 << 26) // 2
    mapped = mapped_buffer(tmp_path, 1 << 22, torch.float32, tables=["t0"])  # 16 MiB
    mapped[: 1 << 20] = 1.0  # the first 4 MiB written through the page cache
    held = resident_bytes(mapped)
    assert 4 << 20 <= held <= 16 << 20
    assert resident_bytes(mapped[:0]) == 0


def test_major_page_faults_count_pages_read_from_the_disk(tmp_path: Path) -> None:
    """A mapped file dropped from the page cache, then read: this process waited for the disk
    (each major fault brings a readahead's pages)."""
    import mmap
    import os

    from raydlrm.sharding.tiers import major_page_faults

    mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
    mount = max((m for m in mounts if str(tmp_path).startswith(m[1])), key=lambda m: len(m[1]))
    if mount[2] in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {mount[2]}: its pages never leave memory")
    path = tmp_path / "rows.bin"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = major_page_faults()
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
            assert sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE)) >= 0
        assert major_page_faults() > before
    finally:
        os.close(fd)


def test_auto_placement_spills_the_coldest_rows_to_ssd_until_the_plan_fits() -> None:
    from raydlrm.models.embedding import EmbeddingBagConfig
    from raydlrm.sharding import MemoryBudget
    from raydlrm.sharding.planner.request import BudgetError

    def table(name: str, rows: int) -> EmbeddingBagConfig:
        return EmbeddingBagConfig(
            name=name, num_embeddings=rows, embedding_dim=16, feature_names=(f"f_{name}",)
        )

    # 68 bytes a row in DRAM (16 fp32 weights + the row-wise state), 4 on SSD.
    tables = [table("hot", 1_000), table("warm", 20_000), table("cold", 40_000)]
    pooling = {"hot": 4.0, "warm": 2.0, "cold": 1.0}
    config = ShardingConfig(
        default_placement="auto",
        pinned_ranks={"cold": [0], "warm": [0]},
        cache_load_factor=0.0,  # no row cache: all but the row-wise state leaves DRAM
    )

    def placements(budget_bytes: int | None) -> dict[str, str]:
        budget = None if budget_bytes is None else MemoryBudget(budget_bytes, "test")
        plan = plan_sharding(
            tables, world_size=2, config=config, pooling_factors=pooling, memory_budget=budget
        )
        return {t.name: t.placement for t in plan.tables}

    assert placements(None) == dict.fromkeys(("hot", "warm", "cold"), "dram")
    assert placements(10_000_000) == dict.fromkeys(("hot", "warm", "cold"), "dram")
    # Rank 0 holds warm and cold (4.08 MB in DRAM): 2 MB forces the coldest rows out first.
    assert placements(2_000_000) == {"hot": "dram", "warm": "dram", "cold": "ssd"}
    assert placements(1_000_000) == {"hot": "dram", "warm": "ssd", "cold": "ssd"}
    with pytest.raises(BudgetError, match=r"does not fit|cannot fit"):
        placements(100_000)  # even on SSD, 240 KB of row-wise state stays in DRAM on rank 0
    # GPU workers spill to host memory: a cache of 1/20 of the rows and 4 bytes a row stay.
    config = dataclasses.replace(config, spill_placement="host", cache_load_factor=0.05)
    assert placements(2_000_000) == {"hot": "dram", "warm": "dram", "cold": "host"}
    assert placements(1_000_000) == {"hot": "dram", "warm": "host", "cold": "host"}


def test_the_plan_costs_ssd_tables_with_their_disk_time_and_spreads_them() -> None:
    from raydlrm.models.embedding import EmbeddingBagConfig
    from raydlrm.sharding import CostConstants, MemoryBudget
    from raydlrm.sharding.planner.storage import page_cache_hit

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=10_000, embedding_dim=16, feature_names=(f"f{i}",)
        )
        for i in range(6)
    ]
    # t4 and t5 on SSD: each 640 KB of weights on disk and 40 KB of row-wise state in DRAM.
    config = ShardingConfig(placement={"t4": "ssd", "t5": "ssd"}, cache_load_factor=0.0)
    slow_disk = CostConstants(ssd_row_reads_per_s=1e3, ssd_row_writes_per_s=1e3)
    budget = MemoryBudget(1_800_000, "test")

    def plan(constants: CostConstants, budget: MemoryBudget | None = budget):
        return plan_sharding(
            tables, world_size=2, config=config, constants=constants, memory_budget=budget
        )

    # The ranks leave 3.6 MB - 4 x 680 KB - 2 x 40 KB = 800 KB for 1.28 MB on disk.
    hit = page_cache_hit(tables, config=config, world_size=2, memory_budget=budget)
    assert hit == pytest.approx(800_000 / 1_280_000)
    tiered = plan(slow_disk)
    assert tiered.page_cache_hit == pytest.approx(hit)
    assert plan(slow_disk, None).page_cache_hit == 0.0  # no budget: nothing known of memory
    assert plan_sharding(tables, world_size=2, config=ShardingConfig()).page_cache_hit is None
    ssd_cost = tiered.table("t4").cost
    assert ssd_cost > 100 * tiered.table("t0").cost  # the disk dominates on a slow disk
    # Each rank gets one of the two costly tables, and the rest balance around them.
    assert {tuple(tiered.table(t).ranks) for t in ("t4", "t5")} == {(0,), (1,)}
    assert max(tiered.per_rank_cost()) == pytest.approx(min(tiered.per_rank_cost()))
    assert "assuming the page cache holds 62% of the rows they touch" in tiered.format_table()
    assert ShardingPlan.from_json(tiered.to_json()).page_cache_hit == tiered.page_cache_hit


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_the_dram_row_cache_trains_exactly_like_dram(tmp_path: Path, optimizer: str) -> None:
    """An ``ssd`` table behind a cache of 150 of its 1,000 rows: rows are evicted and read back
    every step, checkpoint-style reads (``local_tables``) flush the cache mid-run, and the
    outputs, rows and optimizer state equal the DRAM table's bit for bit."""
    from raydlrm.batch import KeyedJaggedTensor
    from raydlrm.models.embedding import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(
            name="big", num_embeddings=1000, embedding_dim=16, feature_names=("a", "b")
        ),
        EmbeddingBagConfig(name="small", num_embeddings=40, embedding_dim=8, feature_names=("c",)),
    ]

    def build(placement: str):
        return _collection(
            tables,
            seed=3,
            optimizer=optimizer,
            learning_rate=0.1,
            default_placement=placement,
            ssd_path=str(tmp_path),
            cache_load_factor=0.1,
            cache_min_rows=150,
        )

    dram, ssd = build("dram"), build("ssd")
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        lengths = torch.randint(0, 3, (3 * 32,), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen)
        ids = (torch.exp(u * 6.9) - 1).long().clamp(0, 999)  # log-uniform over the rows
        c = int(lengths[:64].sum())
        ids[c:] = ids[c:] % 40  # feature c: the small table
        outputs = []
        for collection in (dram, ssd):
            kjt = KeyedJaggedTensor.from_lengths(["a", "b", "c"], ids, lengths)
            pooled = collection(kjt).values
            (pooled * torch.arange(pooled.shape[1])).square().sum().backward()
            outputs.append(pooled.detach())
        assert torch.equal(outputs[0], outputs[1]), step
        if step in (5, 11):  # a checkpoint's reads: the cache is flushed and emptied
            for name, weight in dram.local_tables().items():
                assert torch.equal(ssd.local_tables()[name], weight), (step, name)
            for name, states in dram.optimizer_states().items():
                got = ssd.optimizer_states()[name]
                assert len(got) == len(states)
                for g, r in zip(got, states, strict=True):
                    assert torch.equal(g.reshape(r.shape), r), (step, name)
    cache = next(c for c in ssd._caches if c is not None)
    hits, lookups = cache.hit_rates()["big"]
    assert lookups - hits > 150  # more rows read in than the cache holds: evictions happened
    assert 0 < hits < lookups
    statistics = ssd.ssd_tables()
    assert statistics["big"][1] == (hits, lookups) and statistics["big"][0].shape == (1000, 16)


def test_a_step_larger_than_the_row_cache_names_the_table(tmp_path: Path) -> None:
    from raydlrm.batch import KeyedJaggedTensor
    from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
    from raydlrm.sharding import ShardedEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name="t_big", num_embeddings=100, embedding_dim=4, feature_names=("a",))
    ]
    config = ShardingConfig(
        default_placement="ssd",
        ssd_path=str(tmp_path),
        cache_load_factor=0.05,
        cache_min_rows=10,
    )
    plan = plan_sharding(tables, world_size=1, config=config)
    sebc = ShardedEmbeddingBagCollection(
        EmbeddingBagCollection(tables, device="meta"), plan=plan, config=config, device="cpu"
    )
    kjt = KeyedJaggedTensor.from_lengths(["a"], torch.arange(20), torch.ones(20, dtype=torch.long))
    with pytest.raises(
        TierError,
        match=r"table 't_big': a step looks up 20 distinct rows "
        r"of its shard but its cache holds 10 \(.*\); set data\.sparse_specs\.<column>\."
        r"max_length, or raise sharding\.cache_load_factor \(= 0\.05; or "
        r"cache_load_factor_per_table\.t_big\) or sharding\.cache_min_rows = 10$",
    ):
        sebc(kjt)
    with pytest.raises(ValueError, match=r"sharding\.cache_load_factor must be in \[0, 1\]"):
        ShardingConfig(cache_load_factor=1.5)


def test_host_tables_plan_their_gpu_cache_and_their_host_memory() -> None:
    """A ``host`` table takes its row cache (and a slot per row) of the device's memory, and its
    rows with their state of the host's; a plan over the host budget names the table; the
    copies of its cache's misses are in its cost; quantized ``host`` tables are refused."""
    from raydlrm.sharding import MemoryBudget
    from raydlrm.sharding.planner.cost import CostConstants, estimate_table_cost

    tables = make_tables()
    t0 = tables[0]  # 50 x 8
    config = ShardingConfig(placement={t0.name: "host"}, cache_load_factor_per_table={"t0": 0.2})
    plan = plan_sharding(tables, world_size=2, config=config)
    table = plan.table(t0.name)
    assert table.placement == "host"
    # 10 slots of weights and row-wise state plus 16 bytes each, and 4 bytes a row.
    assert table.memory_bytes == 50 * 4 + 10 * (8 * 4 + 4 + 16)
    assert table.host_bytes == 50 * (8 * 4 + 4)
    assert sum(plan.per_rank_host()) == table.host_bytes
    header = plan.format_table().splitlines()[0].split()
    assert header[-1] == "host" and f"{t0.name} (host)" in plan.format_table()
    assert ShardingPlan.from_json(plan.to_json()).table(t0.name).host_bytes == table.host_bytes
    plan.check_host_memory(MemoryBudget(table.host_bytes, "test"))
    with pytest.raises(ValueError, match=r"host-memory tables \(the largest 't0'\), short by 1 "):
        plan.check_host_memory(MemoryBudget(table.host_bytes - 1, "sharding.host_memory_bytes"))

    def cost(placement: str) -> float:
        return estimate_table_cost(
            t0,
            sharding_type="table_wise",
            num_shards=1,
            world_size=1,
            batch_size=100,
            constants=CostConstants(host_copy_bytes_per_s=1e6),
            placement=placement,
            cache_rows=10,
        ).seconds

    # 200 lookups touch about 49 of 50 rows, 4/5 of them missed: ~39 rows of 36 bytes, each way.
    assert cost("host") - cost("dram") == pytest.approx(2 * 39.3 * 36 / 1e6, rel=0.01)
    with pytest.raises(ValueError, match=r"sharding\.placement\.t0 = 'host' with int8 weights"):
        ShardingConfig(placement={"t0": "host"}, weights_precision="int8")
    with pytest.raises(ValueError, match=r"sharding\.default_placement = 'host' with int4"):
        ShardingConfig(default_placement="host", weights_precision="int4")


def test_tiers_for_cpu_and_gpu_jobs(caplog) -> None:
    """A CPU job plans ``host`` tables ``dram`` (warned) and refuses a ``host`` spill; a GPU
    job refuses ``ssd``, spills ``auto`` tables to ``host`` and checks their host memory."""
    from raydlrm.platform.config import ConfigError, load_config
    from raydlrm.platform.preflight import make_plan

    overrides = ['sharding.placement={ t_C1 = "host" }', "sharding.memory_budget=off"]
    job = load_config("configs/quickstart.toml", overrides=overrides)
    with caplog.at_level("WARNING", logger="raydlrm.platform.preflight"):
        plan = make_plan(job)
    assert plan.table("t_C1").placement == "dram"
    assert "'host' is for GPU workers (scaling.use_gpu)" in caplog.text
    with pytest.raises(ConfigError, match=r"spill_placement = 'host' is for GPU workers"):
        make_plan(
            load_config("configs/quickstart.toml", overrides=["sharding.spill_placement=host"])
        )
    gpu = ["scaling.use_gpu=true", "sharding.host_memory_bytes=1000"]
    ssd = ['sharding.placement={ t_C1 = "ssd" }', gpu[0]]
    with pytest.raises(ConfigError, match=r"'ssd' \(or spill_placement\) is for CPU workers"):
        make_plan(load_config("configs/quickstart.toml", overrides=ssd))
    # A GPU job's auto tables spill to host memory when the GPU's budget is short.
    auto = ["sharding.default_placement=auto", "sharding.device_memory_bytes=40000000", gpu[0]]
    plan = make_plan(load_config("configs/quickstart.toml", overrides=auto))
    assert {t.placement for t in plan.tables} == {"dram", "host"}
    with pytest.raises(
        ConfigError,
        match=r"'host': rank \d holds \d+ bytes of host-memory "
        r"tables \(the largest 't_C1'\).*sharding\.host_memory_bytes",
    ):
        make_plan(load_config("configs/quickstart.toml", overrides=overrides + gpu))
    plan = make_plan(load_config("configs/quickstart.toml", overrides=[*overrides, gpu[0]]))
    assert plan.table("t_C1").placement == "host"


@pytest.mark.parametrize(
    ("optimizer", "precision"), [("rowwise_adagrad", "fp32"), ("adagrad", "fp16")]
)
def test_a_host_tables_staged_copies_train_as_its_cache_in_one_memory(
    optimizer: str, precision: str
) -> None:
    """The copies of a ``host`` table's cache through its pinned staging buffers (on CPU: to
    the same memory) train as the cache without them, reuse the buffers (one for the rows, one
    for their state), and read and overwrite rows (a managed table's) alike, in fp16 too."""
    from raydlrm.batch import KeyedJaggedTensor
    from raydlrm.models.embedding import EmbeddingBagConfig
    from raydlrm.sharding.row_cache import _Staging

    tables = [
        EmbeddingBagConfig(name="big", num_embeddings=400, embedding_dim=8, feature_names=("a",))
    ]

    def build():
        return _collection(
            tables,
            seed=1,
            optimizer=optimizer,
            weights_precision=precision,
            default_placement="host",
            cache_load_factor=0.3,
            learning_rate=0.1,
        )

    plain, staged = build(), build()
    (table,) = staged._caches[0]._tables
    table.staging = _Staging(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        ids = torch.randint(0, 400, (60,), generator=gen)
        outputs = []
        for collection in (plain, staged):
            kjt = KeyedJaggedTensor.from_lengths(["a"], ids, torch.full((30,), 2))
            pooled = collection(kjt).values
            pooled.square().sum().backward()
            outputs.append(pooled.detach())
        assert torch.equal(*outputs)
    rows, values = torch.tensor([3, 77, 399]), torch.randn(3, 8, generator=gen)
    held = int((table.find(rows) >= 0).sum())
    reads = [c._caches[0].read(0, rows) for c in (plain, staged)]
    assert torch.equal(*reads) and reads[0].dtype == torch.float32
    for collection in (plain, staged):
        collection._caches[0].overwrite(0, rows, values)
    assert held and not bool((table.find(rows) >= 0).any())  # cached copies dropped
    reads = [c._caches[0].read(0, rows) for c in (plain, staged)]
    assert torch.equal(*reads)
    # fp16 rows round the values to nearest: half a spacing (EPS16 at 1) of the largest.
    half = EPS16 / 2 * float(values.abs().max()) if precision == "fp16" else 0.0
    torch.testing.assert_close(reads[0], values, atol=half, rtol=0)
    assert torch.equal(plain.local_tables()["big"], staged.local_tables()["big"])
    for got, want in zip(
        staged.optimizer_states()["big"], plain.optimizer_states()["big"], strict=True
    ):
        assert torch.equal(got, want)
        assert not bool(got[rows].any())  # the overwritten rows' state is zeroed
    assert staged._caches[0].written_rows()["big"] > 120  # evicted and written back
    assert len(table.staging._buffers) == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("optimizer", "precision"), [("rowwise_adagrad", "fp32"), ("adagrad", "fp16")]
)
def test_host_tables_on_cuda_train_as_in_gpu_memory(optimizer: str, precision: str) -> None:
    """On a GPU (torch kernel) a ``host`` table's rows and state are in page-locked host
    memory, its cache on the GPU, the misses copied through the staging buffers: it trains as
    the table in GPU memory (the same values within the GPU's summation order), and reads and
    overwrites rows (a managed table's) across the two memories."""
    from raydlrm.batch import KeyedJaggedTensor
    from raydlrm.models.embedding import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(name="big", num_embeddings=5000, embedding_dim=32, feature_names=("a",))
    ]

    def build(placement: str):
        return _collection(
            tables,
            seed=1,
            device="cuda",
            optimizer=optimizer,
            kernel="torch",
            weights_precision=precision,
            default_placement=placement,
            cache_load_factor=0.1,
            learning_rate=0.1,
        )

    gpu, host = build("dram"), build("host")
    # fp16 rows: a summation-order difference can flip an update's rounding.
    close = {"atol": 1e-5, "rtol": 1e-5} if precision == "fp32" else {"atol": 5e-3, "rtol": 1e-2}
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        ids = (torch.exp(torch.rand(400, generator=gen) * 8.5) - 1).long().clamp(0, 4999)
        outputs = []
        for collection in (gpu, host):
            kjt = KeyedJaggedTensor.from_lengths(["a"], ids, torch.full((200,), 2)).to("cuda")
            pooled = collection(kjt).values
            pooled.square().sum().backward()
            outputs.append(pooled.detach())
        torch.testing.assert_close(outputs[1], outputs[0], **close)
    cache = host._caches[0]
    rows = cache.rows()["big"]
    assert rows.device.type == "cpu" and rows.is_pinned()
    assert cache._tables[0].slots.device.type == "cuda" and cache._tables[0].staging is not None
    assert cache.written_rows()["big"] > 0  # evictions copied back
    torch.testing.assert_close(
        host.local_tables()["big"].cuda(), gpu.local_tables()["big"], **close
    )
    assert host.memory_bytes() < gpu.memory_bytes() / 5
    rows = torch.tensor([0, 9, 4999], device="cuda")
    torch.testing.assert_close(
        cache.read(0, rows), gpu.local_tables()["big"][rows].float(), **close
    )
    values = torch.randn(3, 32, device="cuda")
    cache.overwrite(0, rows, values)
    half = EPS16 / 2 * float(values.abs().max()) if precision == "fp16" else 0.0
    torch.testing.assert_close(cache.read(0, rows), values, atol=half, rtol=0)
    assert cache.read(0, rows).device.type == "cuda"
