from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from raydlrm.platform.config import ConfigError, JobConfig, flatten, load_config
from raydlrm.sharding import MemoryBudget

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


def test_null_unsets_an_optional_key_and_is_refused_elsewhere() -> None:
    job = load_config(overrides=["tracking.registered_model_name=null", 'run.name="null"'])
    assert job.tracking.registered_model_name is None
    assert job.run.name == "null"
    with pytest.raises(ConfigError, match=r"training\.learning_rate"):
        load_config(overrides=["training.learning_rate=null"])


def test_unknown_key_is_named_with_its_dotted_path() -> None:
    with pytest.raises(ConfigError, match=r"training\.learning_rte: unknown key"):
        load_config({"training": {"learning_rte": 0.1}})
    with pytest.raises(ConfigError, match=r"bogus: unknown key"):
        load_config(overrides=["bogus.x=1"])


def test_retired_row_cache_keys_are_refused_naming_their_replacements(tmp_path: Path) -> None:
    """The ssd row cache's keys became the one family that sizes every row cache: a config
    that still sets them is refused (it would otherwise size nothing), naming the new keys."""
    f = tmp_path / "run.toml"
    f.write_text("[sharding]\nssd_cache_load_factor = 0.3\n")
    with pytest.raises(
        ConfigError,
        match=r"sharding\.ssd_cache_load_factor: no longer a key: .* set "
        r"sharding\.cache_load_factor \(per table: sharding\.cache_load_factor_per_table\)",
    ):
        load_config(f)
    with pytest.raises(
        ConfigError, match=r"sharding\.ssd_cache_min_rows: no longer a key: .* sharding\.cache_min"
    ):
        load_config(overrides=["sharding.ssd_cache_min_rows=100"])
    job = load_config(overrides=["sharding.cache_load_factor=0.3", "sharding.cache_min_rows=100"])
    assert (job.sharding.cache_load_factor, job.sharding.cache_min_rows) == (0.3, 100)


def test_invalid_values_are_named() -> None:
    with pytest.raises(ConfigError, match=r"model\.arch: .*got 'transformer'"):
        load_config(overrides=["model.arch=transformer"])
    with pytest.raises(ConfigError, match=r"model\.dhen_layers\.0\.1: .*got 'bogus'"):
        load_config(overrides=['model.dhen_layers=[["dot","bogus"]]'])
    with pytest.raises(ConfigError, match=r"data\.batch_size must be positive"):
        load_config(overrides=["data.batch_size=0"])
    with pytest.raises(ConfigError, match=r"training\.num_epochs"):
        load_config(overrides=["training.num_epochs=many"])


def test_missing_dense_value_settings_from_toml_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[data]\ndense_fill = "mean"\n[data.dense_specs.I2]\nmissing_indicator = true\n')
    job = load_config(f, overrides=["data.dense_fill=median", "data.dense_specs.I1.fill=zero"])
    assert job.data.dense_fill == "median" and job.data.dense_fill_of("I1") == "zero"
    assert job.data.fill_key_of("I1") == "data.dense_specs.I1.fill"
    assert job.data.missing_indicator_columns() == ["I2"]
    assert job.data.num_dense_inputs() == len(job.data.dense_columns) + 1
    with pytest.raises(ConfigError, match=r"data\.dense_fill: .*got 'mode'"):
        load_config(overrides=["data.dense_fill=mode"])
    with pytest.raises(ConfigError, match=r"data\.dense_specs\.I1\.fill: .*got 'avg'"):
        load_config(overrides=["data.dense_specs.I1.fill=avg"])
    with pytest.raises(ConfigError, match=r"data\.dense_fill_values\.I1: not a dense column"):
        load_config(overrides=["data.dense_fill_values.I1=1.5"])


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


def test_memory_budget_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"sharding\.device_memory_bytes is a budget but"):
        load_config(overrides=["sharding.device_memory_bytes=1000", "sharding.memory_budget=off"])
    with pytest.raises(ConfigError, match=r"sharding\.worker_overhead_bytes must be >= 0"):
        load_config(overrides=["sharding.worker_overhead_bytes=-1"])
    with pytest.raises(ConfigError, match=r"sharding\.weights_precision_per_table\.t_C1"):
        load_config(overrides=["sharding.weights_precision_per_table={ t_C1 = 'int3' }"])


def _node_memory(monkeypatch: pytest.MonkeyPatch, total: int) -> None:
    """This machine has ``total`` bytes and runs a local Ray cluster."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=total))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_default_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from raydlrm.platform.memory import worker_memory_budget

    _node_memory(monkeypatch, 24 * 2**30)
    node = worker_memory_budget(load_config(overrides=["scaling.num_workers=3"]))
    assert node == MemoryBudget(7 * 2**30, "24.00 GiB node memory / 3 workers - 1.00 GiB overhead")
    no_overhead = load_config(overrides=["sharding.worker_overhead_bytes=0"])
    assert worker_memory_budget(no_overhead).bytes_per_rank == 12 * 2**30
    resource = load_config(overrides=[f"scaling.resources_per_worker={{ memory = {4 * 2**30} }}"])
    assert worker_memory_budget(resource) == MemoryBudget(
        3 * 2**30, "4.00 GiB scaling.resources_per_worker.memory - 1.00 GiB overhead"
    )
    explicit = load_config(overrides=["sharding.device_memory_bytes=5000"])
    assert worker_memory_budget(explicit) == MemoryBudget(5000, "sharding.device_memory_bytes")
    assert worker_memory_budget(load_config(overrides=["sharding.memory_budget=off"])) is None
    with pytest.raises(ConfigError, match=r"sharding\.memory_budget: no memory left .* / 48 work"):
        worker_memory_budget(load_config(overrides=["scaling.num_workers=48"]))


def test_no_default_memory_budget_for_gpus_or_a_remote_cluster(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from raydlrm.platform.memory import worker_memory_budget

    _node_memory(monkeypatch, 24 * 2**30)
    assert worker_memory_budget(load_config(overrides=["scaling.use_gpu=true"])) is None
    assert "GPU memory" in caplog.text and "sharding.device_memory_bytes" in caplog.text
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert worker_memory_budget(load_config()) is None
    assert "Ray cluster at 10.0.0.1:6379" in caplog.text


def test_relative_paths_resolve_against_the_base_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's relative data, storage and MLflow paths resolve against $RAYDLRM_BASE_DIR (else
    the working directory); in Ray's temporary copy of a working directory without it, they
    are refused naming the key (Ray deletes that copy, and the results with it)."""
    from raydlrm.platform.preflight import resolve_job

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    job = load_config(
        overrides=[
            "data.train_path=data/train",
            "data.eval_path=data/eval",
            "run.storage_path=runs",
        ]
    )
    with pytest.raises(
        ConfigError, match=r"data\.train_path: 'data/train' is relative.*RAYDLRM_BASE"
    ):
        resolve_job(job, run_name="r")
    monkeypatch.setenv("RAYDLRM_BASE_DIR", str(tmp_path / "base"))
    resolved = resolve_job(job, run_name="r")
    assert resolved.data.train_path == str(tmp_path / "base" / "data" / "train")
    assert resolved.run.storage_path == str(tmp_path / "base" / "runs")
    assert resolved.tracking.tracking_uri == f"sqlite:///{tmp_path / 'base' / 'mlflow.db'}"
    assert job.run.storage_path == "runs"  # the caller's config is not changed


def test_towers_are_checked_before_ray_names_the_tower_and_key() -> None:
    """A feature in two towers or in none, an unknown feature, a table split across towers,
    fewer towers than hosts, hosts that do not divide the workers, a tower width that is not
    a multiple of the embedding, and the settings towers cannot train with: each refused by
    the config, naming the key and the tower or feature."""
    half = [[f"C{i}" for i in range(1, 14)], [f"C{i}" for i in range(14, 27)]]
    base = {"scaling": {"num_workers": 4, "ranks_per_host": 2}}

    def load(model: dict, **sections: dict) -> JobConfig:
        return load_config({**base, **sections, "model": model})

    job = load({"towers": half, "tower_dim": 32})
    assert job.topology().num_hosts == 2
    for towers, message in (
        ([half[0], [*half[1], "C1"]], r"model\.towers: feature C1 is in towers tower0 and tower1"),
        ([[*half[0], "C1"], half[1]], r"model\.towers: tower tower0: feature C1 is listed twice"),
        ([half[0], half[1][1:]], r"model\.towers: features \['C14'\] are in no tower"),
        ([half[0], [*half[1], "C99"]], r"model\.towers: towers \['tower1'\]: unknown features"),
        ([[*half[0], *half[1]]], r"model\.towers: hosts \[1\] have no tower"),
    ):
        with pytest.raises(ConfigError, match=message):
            load({"towers": towers})
    shared = {"data": {"sparse_specs": {"C1": {"table": "t_shared"}, "C2": {"table": "t_shared"}}}}
    split = [["C1", *half[0][2:]], ["C2", *half[1]]]
    with pytest.raises(ConfigError, match=r"table t_shared is looked up by features of towers"):
        load({"towers": split}, **shared)
    with pytest.raises(ConfigError, match=r"scaling\.ranks_per_host \(3\) must .* divide"):
        load_config({"scaling": {"num_workers": 4, "ranks_per_host": 3}})
    with pytest.raises(ConfigError, match=r"model\.tower_dim \(20\) must be"):
        load({"towers": half, "tower_dim": 20})
    with pytest.raises(ConfigError, match=r"model\.num_towers \(1\) must be at least the hosts"):
        load({"towers": "auto", "num_towers": 1})
    with pytest.raises(ConfigError, match=r"training\.embedding_l2 with model\.towers"):
        load({"towers": half}, training={"embedding_l2": 1e-4})
    with pytest.raises(ConfigError, match=r"training\.pipeline = 'sparse_dist' is not supported"):
        load({"towers": half}, training={"pipeline": "sparse_dist"})
    # A tower's table beyond its host's workers' memory: the host and its towers named.
    from raydlrm.platform.preflight import make_plan

    big = load(
        {"towers": half},
        data={"table_sizes": {"C20": 14_000_000}},
        sharding={"device_memory_bytes": 400_000_000, "worker_overhead_bytes": 0},
    )
    with pytest.raises(
        ConfigError, match=r"model\.towers: host 1 \(towers \['tower1'\]\): table 't_C20'"
    ):
        make_plan(big)


def test_settings_towers_would_ignore_are_refused_naming_both_keys() -> None:
    """The partitioner's settings without ``model.towers = "auto"``, and RecD's dedup groups
    with towers on several hosts (whose lookups take every sample's ids), were once ignored
    without a word; each is now refused naming the keys. Auto towers keep theirs."""
    half = [[f"C{i}" for i in range(1, 14)], [f"C{i}" for i in range(14, 27)]]
    hosts = {"num_workers": 4, "ranks_per_host": 2}
    for model in ({"num_towers": 2}, {"towers": half, "tower_warmup_steps": 10}):
        with pytest.raises(
            ConfigError,
            match=r"model\.(num_towers|tower_warmup_steps) set the "
            r"partitioner of model\.towers = 'auto', and model\.towers is",
        ):
            load_config({"model": model, "scaling": hosts})
    with pytest.raises(ConfigError, match=r"model\.num_towers set the partitioner"):
        load_config(None, overrides=["model.num_towers=2"])
    auto = load_config({"model": {"towers": "auto", "num_towers": 2}, "scaling": hosts})
    assert load_config(auto).model.num_towers == 2  # a config object: its values, not keys
    # A config written out whole (what a sweep hands its trials) gives every key at its
    # default: not a setting (the first version of this check refused every trial).
    assert load_config(load_config({"scaling": hosts}).to_dict()).model.towers is None
    for data, key in (
        ({"dedup_groups": [["C1", "C2"]]}, "data.dedup_groups"),
        ({"dedup": "infer"}, "data.dedup = 'infer'"),
    ):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)} with model\.towers on several"):
            load_config({"model": {"towers": half}, "scaling": hosts, "data": data})
    one_host = {"model": {"towers": half}, "data": {"dedup_groups": [["C1", "C2"]]}}
    assert load_config(one_host).data.dedup_groups == [["C1", "C2"]]  # flat: dedup kept


def test_auto_towers_warm_up_a_sample_sized_model_when_the_tables_do_not_fit_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The scale rule: tables over half the driver's available memory are never trained there.
    The warm-up once refused them; it now trains tables of 16 rows per id of its sample (ids
    hashed into them) and partitions from those, saying so."""
    import logging

    import psutil

    from raydlrm.ingestion import SyntheticConfig, generate_synthetic
    from raydlrm.platform.auto_towers import resolve_towers
    from raydlrm.platform.job_data import data_shape, validate_job_data

    generate_synthetic(
        SyntheticConfig(num_train_rows=400, num_eval_rows=0, rows_per_file=400),
        out_dir=tmp_path / "data",
    )
    job = load_config(
        {
            "data": {
                "train_path": str(tmp_path / "data" / "train"),
                "eval_path": None,
                "batch_size": 64,
                "table_size": 2_000_000,  # 26 tables x 2M rows x 16 x 4 B: 3.1 GiB
                "table_sizes": {"C3": 1_000_000},
                "sparse_specs": {"C1": {"hash": False}},
            },
            "model": {"towers": "auto", "tower_warmup_steps": 2, "embedding_dim": 16},
            "scaling": {"ranks_per_host": 1},
        }
    )
    data = validate_job_data(job)
    total = psutil.virtual_memory().total
    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: SimpleNamespace(total=total, available=2**30)
    )
    with caplog.at_level(logging.INFO, logger="raydlrm.platform.auto_towers"):
        resolved = resolve_towers(job, data, data_shape(job, data), recorded=None)
    assert sorted(f for t in resolved.model.towers for f in t) == sorted(job.data.sparse_columns)
    assert "do not fit the driver's share" in caplog.text and "'t_C1': " in caplog.text
    assert resolved.data.table_sizes == {"C3": 1_000_000}  # the model keeps its tables


def test_one_topology_from_ranks_per_host_or_group_size() -> None:
    """``sharding.group_size`` (table-row-wise groups) and ``scaling.ranks_per_host`` (towers)
    are one concept, a host's workers: either sets the job's one topology, and both set must
    agree (a group size that did not divide a host once failed as "does not divide the world
    size" of a host's planner)."""
    four = {"num_workers": 4}
    assert load_config({"scaling": four}).topology().num_hosts == 1
    assert load_config({"scaling": {**four, "ranks_per_host": 2}}).topology().ranks_per_host == 2
    assert load_config({"scaling": four, "sharding": {"group_size": 2}}).topology().num_hosts == 2
    same = {"scaling": {**four, "ranks_per_host": 2}, "sharding": {"group_size": 2}}
    assert load_config(same).topology().num_hosts == 2
    with pytest.raises(
        ConfigError, match=r"sharding\.group_size \(1\) and scaling\.ranks_per_host \(2\)"
    ):
        load_config({"scaling": {**four, "ranks_per_host": 2}, "sharding": {"group_size": 1}})
    with pytest.raises(ConfigError, match=r"sharding\.group_size \(3\) must divide"):
        load_config({"scaling": four, "sharding": {"group_size": 3}})


def test_auto_towers_of_a_resumed_run_come_from_its_checkpoint() -> None:
    """A run that resumes takes the towers its checkpoint was trained with: no warm-up (which
    would need the data this call does not give)."""
    from raydlrm.platform.auto_towers import resolve_towers

    job = load_config({"model": {"towers": "auto"}, "scaling": {"ranks_per_host": 1}})
    towers = [[f"C{i}" for i in range(1, 27, 2)], [f"C{i}" for i in range(2, 27, 2)]]
    state = {"spec": {"model": {"towers": towers}}}
    assert resolve_towers(job, None, None, recorded=state).model.towers == towers
    assert load_config({"model": {"towers": "auto"}}).model.towers == "auto"  # not resolved yet


def test_auto_towers_of_a_warm_start_keep_its_towers_and_its_statistics(tmp_path: Path) -> None:
    """``model.towers = "auto"`` warm-started (every retrain slot after the first): the towers
    and the dense statistics are the warm start's, not a new partition of, and statistics of,
    the new data (the warm start's tower weights belong to its towers' features, and its
    model to its standardization). They were once partitioned anew, and the new data's
    statistics were written first and kept."""
    from raydlrm.ingestion import SyntheticConfig, generate_synthetic
    from raydlrm.platform.planning import plan_job

    generate_synthetic(
        SyntheticConfig(num_train_rows=400, num_eval_rows=0, rows_per_file=400),
        out_dir=tmp_path / "data",
    )
    towers = [[f"C{i}" for i in range(1, 27, 2)], [f"C{i}" for i in range(2, 27, 2)]]
    warm = tmp_path / "warm"
    warm.mkdir()
    state = {"spec": {"model": {"towers": towers}, "data": {"dense_stats": {"I1": [5.0, 2.0]}}}}
    (warm / "trainer_state.json").write_text(json.dumps(state))
    job = load_config(
        {
            "data": {
                "train_path": str(tmp_path / "data" / "train"),
                "eval_path": None,
                "dense_specs": {"I1": {"transform": "standardize"}},
            },
            "model": {"towers": "auto"},
            "scaling": {"ranks_per_host": 1},
            "run": {"warm_start": str(warm)},
        }
    )
    # The planning pipeline, as `raydlrm plan` runs it (no run: the warm start is read, not
    # checked against a plan).
    resolved = plan_job(job, run_name=None).job
    assert resolved.model.towers == towers
    assert resolved.data.dense_stats == {"I1": (5.0, 2.0)}


def test_managed_tables_are_refused_where_they_do_not_work_naming_the_table() -> None:
    """data.managed_ids reaches the config and --set; what managed tables do not work with
    (a data_parallel table) is refused before Ray starts; rows behind a row cache (int8/int4,
    the ssd tier) and towers are accepted."""
    job = load_config(None, overrides=["data.managed_ids.C1.eviction=lfu"])
    assert job.data.managed_of("t_C1").eviction == "lfu"
    assert {t.name: t.managed for t in job.tables()}["t_C1"].eviction == "lfu"
    managed = ["data.managed_ids.C1.eviction=lru"]
    for extra in (
        ["sharding.weights_precision=int4"],
        ["sharding.placement.t_C1=ssd"],
        ['model.towers="auto"'],
    ):
        assert load_config(None, overrides=managed + extra).data.managed_of("t_C1") is not None
    for extra, match in ((["data.managed_ids.C1.eviction=ttl"], "ttl_steps"),):
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides=managed + extra)
    from raydlrm.sharding import plan_sharding

    pinned = load_config(None, overrides=[*managed, "sharding.pinned_types.t_C1=data_parallel"])
    with pytest.raises(ValueError, match=r"'t_C1' is managed .* cannot be data_parallel"):
        plan_sharding(pinned.tables(), world_size=2, config=pinned.sharding)


def test_bf16_on_a_gpu_without_it_is_refused_before_ray_starts(monkeypatch) -> None:
    """The driver's GPU (a local cluster's workers') without bf16 units: one line naming the
    key and the GPU. (This machine has no GPU: the child process that asks says so, and torch's
    answers for a V100 stand in for one without bf16.)"""
    import torch

    from raydlrm.platform import preflight
    from raydlrm.trainers.precision import bf16_refusal

    assert preflight.bf16_refusal_here() is None  # no GPU here
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(preflight, "bf16_refusal_here", lambda: bf16_refusal(0))
    overrides = ["training.precision=bf16", "scaling.use_gpu=true"]
    with pytest.raises(ConfigError, match=r"^training\.precision = 'bf16': Tesla V100-SXM2-16GB "):
        preflight.check_dense_precision(load_config(None, overrides=overrides))
    fp16 = ["training.precision=fp16", overrides[1]]
    preflight.check_dense_precision(load_config(None, overrides=fp16))
    preflight.check_dense_precision(load_config(None, overrides=overrides[:1]))  # CPU workers


def test_early_stopping_needs_a_validation_set_and_keeps_its_best_itself() -> None:
    """Refused before anything runs, naming the keys: early stopping without a validation
    set, beside ``checkpoint.score_metric``, on a metric that is not a validation metric; the
    section off (``enabled = false``) needs nothing."""
    for overrides, message in (
        (["training.early_stopping.patience=2"], r"needs a validation set: set data\.valid_path"),
        (
            [
                "data.valid_split=time",
                "training.early_stopping.patience=2",
                "checkpoint.score_metric=x",
            ],
            r"checkpoint\.score_metric with training\.early_stopping",
        ),
        (
            ["data.valid_split=time", "training.early_stopping.metric=eval/auc"],
            r"training\.early_stopping\.metric must be one of",
        ),
        (["data.valid_split=time", "data.valid_path=v"], r"data\.valid_path and data\.valid_split"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides)
    off = load_config(overrides=["training.early_stopping.enabled=false"])
    assert off.training.stopping() is None
    on = load_config(
        overrides=["data.valid_split=random", "training.early_stopping.metric=valid/log_loss"]
    )
    assert on.training.stopping().better() == "min"


def test_sequence_models_are_checked_against_the_data_naming_the_key() -> None:
    """A sequence model's history and candidate must fit the data's sequences and tables; a
    retrieval model reads no label and is decided on ranking metrics, a click model on click
    ones."""
    path = Path(__file__).resolve().parents[2] / "configs"
    din = load_config(path / "movielens_din.toml")
    assert [t.pooling for t in din.tables() if t.name == "t_movie"] == ["none"]
    pooled = load_config(
        path / "movielens_din.toml",
        overrides=["model.arch=dcnv2", "model.sequence=null", "model.candidate=[]"],
    )
    assert [t.pooling for t in pooled.tables() if t.name == "t_movie"] == ["mean"]
    sasrec = load_config(path / "movielens_sasrec.toml")
    assert sasrec.data.label_column is None
    assert sasrec.negatives_feature() in sasrec.tables()[0].feature_names
    cases = [
        ("movielens_din.toml", ["model.sequence=other"], "not a data.sequences entry"),
        ("movielens_din.toml", ["model.candidate=['movie_id', 'user_id']"], "one column per"),
        ("movielens_din.toml", ["model.candidate=['user_id']"], "data.sparse_specs.user_id"),
        ("movielens_din.toml", ["model.sequence=null"], "needs model.sequence"),
        ("movielens_din.toml", ["data.label_column=null"], "learns from a click label"),
        ("movielens_din.toml", ["retrain.metric='ndcg_at_10'"], None),
        ("movielens_sasrec.toml", ["model.candidate=[]"], "model.candidate = [<target"),
        ("movielens_sasrec.toml", ["model.sasrec_num_heads=3"], "sasrec_num_heads"),
        ("movielens_sasrec.toml", ["data.managed_ids={ t_movie = {} }"], "managed table"),
        ("movielens_sasrec.toml", ["retrain.metric='bleu'"], "retrain.metric must be"),
        (
            "movielens_sasrec.toml",
            ["training.early_stopping.metric='valid/auc'"],
            "reports valid/ndcg_at_K",
        ),
        (
            "movielens_sasrec.toml",
            ["training.early_stopping.metric='valid/hr_at_20'"],
            "K in model.retrieval_k",
        ),
        ("movielens_din.toml", ["training.early_stopping.metric='valid/hr_at_10'"], "click metric"),
    ]
    for name, overrides, message in cases:
        if message is None:  # loads; refused when a retraining starts
            job = load_config(path / name, overrides=overrides)
            with pytest.raises(ValueError, match="needs a retrieval model"):
                job.check_retrain_metric()
            continue
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path / name, overrides=overrides)
    with pytest.raises(ValueError, match="is a click metric"):
        load_config(
            path / "movielens_sasrec.toml", overrides=["retrain.metric='auc'"]
        ).check_retrain_metric()
