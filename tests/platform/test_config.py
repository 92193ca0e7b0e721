from __future__ import annotations

from pathlib import Path

import pytest

from raydlrm.platform.config import ConfigError, JobConfig, flatten, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    assert isinstance(load_config(path), JobConfig)


def test_overrides_are_typed_and_nested(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[training]\nlearning_rate = 0.1\n[model]\narch = "dlrm"\n')
    job = load_config(
        f,
        overrides=[
            "training.learning_rate=0.01",
            "model.arch=dcnv2",
            "model.top_mlp=[8, 4]",
            "scaling.resources_per_worker={ CPU = 1.5 }",
            "data.table_sizes.C1=77",
            "run.name=my run",
        ],
    )
    assert job.training.learning_rate == 0.01
    assert job.model.arch == "dcnv2"
    assert job.model.top_mlp == [8, 4]
    assert job.scaling.resources_per_worker == {"CPU": 1.5}
    assert job.data.table_size_of("C1") == 77
    assert job.run.name == "my run"


def test_unknown_key_is_named_with_its_dotted_path() -> None:
    with pytest.raises(ConfigError, match=r"training\.learning_rte: unknown key"):
        load_config({"training": {"learning_rte": 0.1}})
    with pytest.raises(ConfigError, match=r"bogus: unknown key"):
        load_config(overrides=["bogus.x=1"])


def test_invalid_values_are_named() -> None:
    with pytest.raises(ConfigError, match=r"model\.arch"):
        load_config(overrides=["model.arch=transformer"])
    with pytest.raises(ConfigError, match=r"data\.batch_size must be positive"):
        load_config(overrides=["data.batch_size=0"])
    with pytest.raises(ConfigError, match=r"training\.num_epochs"):
        load_config(overrides=["training.num_epochs=many"])


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(overrides=["training.learning_rate"])


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": 1, "a.c": [1, 2], "d": {}}
    flat = flatten(JobConfig().to_dict())
    assert flat["model.arch"] == "dlrm" and "scaling.resources_per_worker.CPU" in flat
