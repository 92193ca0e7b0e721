"""The SSD tier's pieces (``raydlrm.sharding.tiers``) and how the planner and the config treat
placements. (Training on the SSD tier equals training in DRAM:
``tests/sharding/test_sharding_types.py``, scenarios ``mixed/ssd/*``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raydlrm.sharding import ShardingConfig, ShardingPlan, plan_sharding
from raydlrm.sharding.planner import table_memory_bytes
from raydlrm.sharding.tiers import TierError, mapped_buffer
from tests.sharding._fixtures import make_tables


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
    config = ShardingConfig(placement={t0.name: "ssd"})
    plan = plan_sharding(tables, world_size=2, config=config)
    assert plan.table(t0.name).placement == "ssd"
    assert {t.placement for t in plan.tables if t.name != t0.name} == {"dram"}
    # Row-wise Adagrad's per-row state stays in memory; Adagrad's per-weight state goes to disk.
    assert plan.table(t0.name).memory_bytes == t0.num_embeddings * 4
    assert table_memory_bytes(t0, optimizer="adagrad", placement="ssd") == 0
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
    from raydlrm.sharding.tiers import major_page_faults, resident_bytes

    touched = torch.ones(1 << 20)  # 4 MiB written: all resident
    assert resident_bytes(touched) == touched.numel() * 4
    untouched = torch.empty(1 << 24)  # 64 MiB allocated, never written: not in memory yet
    assert resident_bytes(untouched) < (1 << 26) // 2
    mapped = mapped_buffer(tmp_path, 1 << 22, torch.float32, tables=["t0"])  # 16 MiB
    mapped[: 1 << 20] = 1.0  # the first 4 MiB written through the page cache
    held = resident_bytes(mapped)
    assert 4 << 20 <= held <= 16 << 20
    assert resident_bytes(mapped[:0]) == 0
    assert major_page_faults() >= 0


def test_auto_placement_spills_the_coldest_rows_to_ssd_until_the_plan_fits() -> None:
    from raydlrm.models.embedding import EmbeddingBagConfig
    from raydlrm.sharding import MemoryBudget
    from raydlrm.sharding.planner import BudgetError

    def table(name: str, rows: int) -> EmbeddingBagConfig:
        return EmbeddingBagConfig(
            name=name, num_embeddings=rows, embedding_dim=16, feature_names=(f"f_{name}",)
        )

    # 68 bytes a row in DRAM (16 fp32 weights + the row-wise state), 4 on SSD.
    tables = [table("hot", 1_000), table("warm", 20_000), table("cold", 40_000)]
    pooling = {"hot": 4.0, "warm": 2.0, "cold": 1.0}
    config = ShardingConfig(default_placement="auto", pinned_ranks={"cold": [0], "warm": [0]})

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
