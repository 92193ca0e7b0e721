"""The learned cost model (NeuroShard): table features from a batch's ids, a set model that
ignores the order of a shard's tables, cost samples measured with the kernel, training, and a
model that round-trips to disk and refuses another kernel."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from raydlrm.sharding.planner.learned_cost import (
    HISTOGRAM_BINS,
    NUM_FEATURES,
    CostModelError,
    LearnedCostModel,
    SetCostNet,
    TableStats,
    access_histogram,
    collect_samples,
    sample_sets,
    save_samples,
    stored_samples,
    train_cost_model,
)
from raydlrm.sharding.planner.measure import mape


def test_table_features_from_a_batch() -> None:
    # 4 distinct ids: looked up 1, 2, 3 and 9 times -> bins 0, 1, 1, 3.
    ids = np.array([5] + [6] * 2 + [7] * 3 + [8] * 9)
    assert access_histogram(ids) == (0.25, 0.5, 0.0, 0.25) + (0.0,) * (HISTOGRAM_BINS - 4)
    stats = TableStats.of_batch(rows=1000, dim=16, ids=ids, bags=5)
    assert stats.pooling == 3.0
    features = stats.features()
    assert len(features) == NUM_FEATURES and features[:3] == [3.0, 16.0, 3.0]
    assert access_histogram(np.array([1] * 70000))[-1] == 1.0  # 2^16 and more: the last bin
    assert access_histogram(np.array([], dtype=np.int64)) == (0.0,) * HISTOGRAM_BINS


def test_the_set_model_ignores_the_order_of_a_shards_tables() -> None:
    torch.manual_seed(0)
    net = SetCostNet()
    features = torch.randn(1, 5, NUM_FEATURES)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])  # 3 tables, 2 padding slots
    shuffled = features[:, [2, 0, 1, 3, 4]]
    assert torch.allclose(net(features, mask), net(shuffled, mask), atol=1e-6)
    padding_changed = features.clone()
    padding_changed[:, 3:] = 100.0
    assert torch.allclose(net(features, mask), net(padding_changed, mask))
    assert not torch.allclose(net(features, mask), net(features, torch.ones(1, 5)))


@pytest.fixture(scope="module")
def samples():
    """A few small measured sets (the machine's kernel)."""
    return collect_samples(
        14, kernel="auto", batch_size=64, seed=3, max_tables=3, max_rows=5000, repeats=1
    )


def test_samples_are_measured_sets_of_tables(samples) -> None:
    assert samples.num_rows == 14
    counts = samples.column("num_tables").to_pylist()
    features = samples.column("features").to_pylist()
    assert all(1 <= c <= 3 for c in counts)
    assert [len(f) for f in features] == [c * NUM_FEATURES for c in counts]
    assert all(s > 0 for s in samples.column("seconds").to_pylist())
    assert set(samples.column("kernel").to_pylist()) <= {"fbgemm", "torch"}
    assert set(samples.column("device").to_pylist()) == {"cpu"}
    for flat in features:  # rows in [10^3, 5000], dims multiples of 4, histograms sum to 1
        for t in range(len(flat) // NUM_FEATURES):
            table = flat[t * NUM_FEATURES : (t + 1) * NUM_FEATURES]
            assert 3.0 <= table[0] <= np.log10(5000) + 1e-9 and table[1] % 4 == 0
            assert abs(sum(table[3:]) - 1.0) < 1e-9


def test_a_trained_model_round_trips_and_refuses_another_kernel(
    samples, tmp_path: Path, caplog
) -> None:
    model = train_cost_model(samples, epochs=20)
    assert model.report["held_out_samples"] == 3 and model.report["train_samples"] == 11
    # The reported error is the model's on the held-out sets (the first 3 of the seed's order).
    sets, seconds = sample_sets(samples), np.asarray(samples.column("seconds").to_pylist())
    held = np.random.default_rng(0).permutation(len(sets))[:3]
    predicted_held = np.array(model.predict_features([sets[i] for i in held]))
    assert model.report["neural_mape"] == pytest.approx(mape(predicted_held, seconds[held]))
    shards = [
        [TableStats(2000, 16, 2.0, (1.0,) + (0.0,) * 16)],
        [],
        [TableStats(4000, 64, 5.0, (0.5, 0.5) + (0.0,) * 15)] * 2,
    ]
    predicted = model.predict(shards)
    assert predicted[1] == 0.0 and predicted[0] > 0 and predicted[2] > 0
    path = model.save(tmp_path / "model.json")
    again = LearnedCostModel.load(path, kernel=model.kernel)
    assert again.predict(shards) == predicted
    assert again.report == model.report
    other = "torch" if model.kernel == "fbgemm" else "fbgemm"
    with pytest.raises(CostModelError, match=f"trained for the {model.kernel} kernel"):
        LearnedCostModel.load(path, kernel=other)
    assert model.device == "cpu" and LearnedCostModel.load(path, device="cpu").device == "cpu"
    with pytest.raises(CostModelError, match=r"measured on cpu, the job's tables are on cuda"):
        LearnedCostModel.load(path, device="cuda")
    with pytest.raises(CostModelError, match="no learned cost model at"):
        LearnedCostModel.load(tmp_path / "missing.json")
    with pytest.raises(CostModelError, match="too few to train on"):
        train_cost_model(samples.slice(0, 5))
    gpu = samples.set_column(
        samples.column_names.index("device"), "device", pa.array(["cuda"] * 7 + ["cpu"] * 7)
    )
    with pytest.raises(CostModelError, match=r"several devices \['cpu', 'cuda'\]"):
        train_cost_model(gpu)
    other = samples.set_column(
        samples.column_names.index("machine"),
        "machine",
        pa.array([samples.column("machine")[0].as_py()] * 7 + ["another machine"] * 7),
    )
    with pytest.raises(CostModelError, match=r"several machines \[.*'another machine'\]"):
        train_cost_model(other)
    # A damaged weights file: named, and under sharding.cost_model = "auto" the analytic model
    # plans (with a warning); under "neural" it is a config error (exit 2).
    weights = Path(f"{path}.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CostModelError, match=rf"its weights {re.escape(str(weights))} are damaged"):
        LearnedCostModel.load(path)
    from raydlrm.platform.config import ConfigError, load_config
    from raydlrm.platform.preflight import learned_cost_model

    def job(choice: str):
        return load_config({"sharding": {"cost_model": choice, "learned_cost_path": str(path)}})

    with caplog.at_level(logging.WARNING, logger="raydlrm.platform.preflight"):
        assert learned_cost_model(job("auto")) is None
    assert "planning with the analytic model" in caplog.text and "are damaged" in caplog.text
    with pytest.raises(ConfigError, match=r"sharding\.cost_model = 'neural': .* are damaged"):
        learned_cost_model(job("neural"))


def test_samples_stored_before_gpu_measurements_read_as_cpu(samples, tmp_path: Path) -> None:
    """A sample file without the ``device`` column (written before GPU measurements) is CPU;
    the store keeps GPU samples apart (their own file names)."""
    old = tmp_path / "torch-b64-20261101-000000.parquet"
    pq.write_table(samples.drop_columns(["device"]), old)
    assert set(stored_samples(tmp_path, kernel="torch", batch_size=64)["device"].to_pylist()) == {
        "cpu"
    }
    on_gpu = samples.set_column(
        samples.column_names.index("device"), "device", pa.array(["cuda"] * samples.num_rows)
    )
    path = save_samples(on_gpu.set_column(3, "kernel", pa.array(["torch"] * 14)), tmp_path)
    assert path.name.startswith("torch-cuda-b64-")
    assert stored_samples(tmp_path, kernel="torch", batch_size=64, device="cuda").num_rows == 14
    assert stored_samples(tmp_path, kernel="torch", batch_size=64).num_rows == 14  # the old file
    with pytest.raises(CostModelError, match="no cost samples of the torch kernel on cuda"):
        stored_samples(tmp_path, kernel="torch", batch_size=32, device="cuda")


def test_plan_collects_samples_and_trains_the_model(tmp_path: Path) -> None:
    """``raydlrm plan --collect N --train-cost-model``: compute and all-to-all samples (2
    gloo ranks) added to ``sharding.cost_samples_path``, the model written to
    ``sharding.learned_cost_path``, the held-out errors printed; training with no samples is
    one line."""
    from raydlrm.platform.cli import app

    sets = [
        f'sharding.cost_samples_path="{tmp_path / "samples"}"',
        f'sharding.learned_cost_path="{tmp_path / "cost.json"}"',
        "data.batch_size=32",  # x 2 workers: a global batch of 64
        f'data.train_path="{tmp_path / "nothing"}"',
    ]
    args = [a for s in sets for a in ("--set", s)]
    runner = CliRunner()
    empty = runner.invoke(app, ["plan", *args, "--train-cost-model"])
    assert empty.exit_code == 2 and "run raydlrm plan --collect N first" in empty.output
    result = runner.invoke(app, ["plan", *args, "--collect", "12", "--train-cost-model"])
    assert result.exit_code == 0, result.output
    (written,) = (tmp_path / "samples").glob("[ft]*-b64-*.parquet")  # fbgemm or torch
    assert pq.read_table(written).num_rows == 12
    # And 12 all-to-alls of random dim-sum layouts on 2 gloo ranks (scaling.num_workers).
    (comm_file,) = (tmp_path / "samples").glob("comm-w2-b64-*.parquet")
    comm = pq.read_table(comm_file).to_pydict()
    assert comm["world_size"] == [2] * 12 and comm["batch_size"] == [64] * 12
    for dims, delays, fwd, bwd in zip(
        comm["dim_sums"],
        comm["delays"],
        comm["forward_seconds"],
        comm["backward_seconds"],
        strict=True,
    ):
        assert len(dims) == len(delays) == len(fwd) == len(bwd) == 2
        assert all(d % 4 == 0 and 4 <= d <= 2048 for d in dims)
        assert all(0 <= x <= 0.005 for x in delays) and all(t > 0 for t in fwd + bwd)
    assert "held-out error" in result.output and (tmp_path / "cost.json").is_file()
    model = LearnedCostModel.load(tmp_path / "cost.json")
    assert model.batch_size == 64 and model.comm is not None and model.comm.world_sizes == [2]
    assert "all-to-all model ([2] ranks" in result.output
    # Planning with it (no data: the tables are costed as looked up uniformly).
    neural = runner.invoke(app, ["plan", *args, "--set", "sharding.cost_model=neural"])
    assert neural.exit_code == 0, neural.output
    assert "predicted s" in neural.output
    missing = [*args, "--set", f'sharding.learned_cost_path="{tmp_path / "none.json"}"']
    refused = runner.invoke(app, ["plan", *missing, "--set", "sharding.cost_model=neural"])
    assert refused.exit_code == 2
    assert "sharding.cost_model = 'neural': no learned cost model at" in refused.output
    other_batch = runner.invoke(
        app, ["plan", *args, "--set", "sharding.cost_model=neural", "--set", "data.batch_size=16"]
    )
    assert other_batch.exit_code == 2 and "measured at batch size 64" in other_batch.output
    fallback = runner.invoke(app, ["plan", *missing, "--set", "sharding.cost_model=auto"])
    assert fallback.exit_code == 0 and "est. cost" in fallback.output
    if not torch.cuda.is_available():  # GPU workers' costs are measured on a GPU
        gpu = runner.invoke(app, ["plan", *args, "--set", "scaling.use_gpu=true", "--collect", "2"])
        assert gpu.exit_code == 2
        assert "scaling.use_gpu is true but this machine has no CUDA device" in gpu.output


@pytest.mark.gpu
def test_gpu_workers_costs_are_measured_on_the_gpu() -> None:
    """With the tables in GPU memory: samples timed on the GPU (its kernels waited for), the GPU
    named in the machine; the lookup throughput calibrated there."""
    from raydlrm.sharding.planner.calibration import CalibrationSizes, calibrate

    samples = collect_samples(
        6, kernel="torch", batch_size=256, seed=5, max_tables=4, repeats=2, device="cuda"
    )
    assert samples.column("device").to_pylist() == ["cuda"] * 6
    assert torch.cuda.get_device_name(0) in samples.column("machine")[0].as_py()
    assert all(s > 0 for s in samples.column("seconds").to_pylist())
    constants = calibrate(
        sizes=CalibrationSizes(lookups=((10_000, 64, 16_384), (10_000, 64, 65_536)), repeats=3),
        comm=False,
        kernel="torch",
        device="cuda",
    )
    assert constants.lookup_bytes_per_s > 0 and "on cuda" in constants.source
