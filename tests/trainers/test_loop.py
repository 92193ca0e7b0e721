"""The training loop without Ray: a tiny deterministic run pins its first losses (so refactors
that change numerics are seen), on 1 process and on 2 gloo ranks with sharded tables."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydlrm.ingestion import Preprocessor
from raydlrm.ingestion.badinput import BadInputError
from raydlrm.sharding import plan_sharding
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.spec import WorkerSpec
from tests._multiprocess import run_distributed
from tests.trainers._fixtures import (
    assert_losses_close,
    auc_tol,
    trained_tol,
    unsharded_state_dict,
)

# Losses of the first 4 steps of the run below (global batch of 64 samples). Change only
# deliberately, when numerics are meant to change (last: tables initialized block by block from
# the seed on the meta-device build, so the dense init no longer follows the tables' draws).
PINNED_LOSSES = [0.664618, 0.646848, 0.650306, 0.601394]


class _Stream:
    """Stands in for a Ray DataIterator: yields preprocessed Arrow batches of this rank's rows;
    with ``fail_after``, raises a bad-input error after that many batches."""

    def __init__(self, table: pa.Table, fail_after: int | None = None):
        self.table = table
        self.fail_after = fail_after

    def iter_batches(self, *, batch_size: int, **_: object) -> Iterator[pa.Table]:
        for i, start in enumerate(range(0, self.table.num_rows, batch_size)):
            if i == self.fail_after:
                raise BadInputError("data/part-7.parquet, row group 3, row 2: dense column 'I1'")
            yield self.table.slice(start, batch_size)


# Wukong and DHEN, small; their first losses on the run below, pinned like PINNED_LOSSES.
NEW_ARCHS = {
    "wukong": {
        "arch": "wukong",
        "wukong_num_fm": 4,
        "wukong_num_lc": 4,
        "wukong_rank": 4,
        "wukong_fm_mlp": [16],
    },
    "dhen": {"arch": "dhen", "dhen_layers": [["dot", "cross", "attention", "linear", "conv"]]},
}
PINNED_ARCH_LOSSES = {"wukong": [0.656173, 0.508986], "dhen": [0.665496, 0.528697]}


def _spec(data_dir: Path, batch_size: int, optimizer: str, model: dict | None = None) -> WorkerSpec:
    return WorkerSpec(
        sharding={"optimizer": optimizer, "learning_rate": 0.5 if optimizer == "sgd" else 0.05},
        data={
            "train_path": str(data_dir / "train"),
            "eval_path": str(data_dir / "eval"),
            "table_size": 1000,
            "batch_size": batch_size,
        },
        model={"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16], **(model or {})},
        training={"seed": 7, "log_every_steps": 2, "learning_rate": 0.01},
    )


def _run(
    rank: int,
    world_size: int,
    data_dir: str,
    optimizer: str = "rowwise_adagrad",
    device: str = "cpu",
    pinned_types: dict[str, str] | None = None,
    eval_fails_on_rank: int | None = None,
    report_seconds: float = 0.0,
    model: dict | None = None,
    kernel: str = "auto",
    pipeline: str = "none",
    dedup: bool = False,
    short_rank: int | None = None,
    max_steps: int | None = None,
    eval_every: int = 0,
    embedding_l2: float = 0.0,
    data: dict | None = None,
    training: dict | None = None,
    setup=None,
) -> dict[str, object]:
    spec = _spec(Path(data_dir), batch_size=64 // world_size, optimizer=optimizer, model=model)
    for key, value in (data or {}).items():
        setattr(spec.data, key, value)
    for key, value in (training or {}).items():
        setattr(spec.training, key, value)
    spec.training.embedding_l2 = embedding_l2
    spec.training.eval_every_steps = eval_every
    spec.sharding.kernel = kernel
    spec.training.pipeline = pipeline
    spec.training.max_steps = max_steps
    if dedup:  # the synthetic user features repeat over a session
        spec.data.dedup_groups = [[f"C{i}" for i in range(1, 9)]]
    if pinned_types:
        spec.sharding.pinned_types = pinned_types
    table = Preprocessor(spec.data)(pq.read_table(Path(data_dir) / "train"))
    # Rank r takes every world_size-th block of its batch size: the global batch of step i
    # is the same rows whatever the world size.
    b = spec.data.batch_size
    blocks = [table.slice(start, b) for start in range(rank * b, table.num_rows, world_size * b)]
    if rank == short_rank:  # its data ends 3 steps early: it steps with empty batches
        blocks = blocks[:-3]
    evaluation = Preprocessor(spec.data)(pq.read_table(Path(data_dir) / "eval"))
    half = evaluation.num_rows // world_size
    plan = plan_sharding(spec.tables(), world_size=world_size, config=spec.sharding)
    losses: list[float] = []
    counted: list[int | None] = []  # the samples_seen the step hooks get

    def record_loss(moment, *, batch=None, loss=None, samples_seen=None, **_):
        if moment == "step":  # the global loss of every step
            counted.append(samples_seen)
            total = loss * batch.batch_size
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(total)
            losses.append(float(total) / 64)

    reports: list[dict] = []
    trainer = Trainer(
        spec,
        plan=plan,
        rank=rank,
        device=torch.device(device),
        hooks=[record_loss],
        report=lambda metrics, checkpoint_dir: (
            reports.append({**metrics, "has_checkpoint": checkpoint_dir is not None}),
            time.sleep(report_seconds),
        )[0],
    )
    # Where each training step's ids were routed to their shards (the input all-to-all).
    routed_on: list[str] = []
    collection = trainer.model.embedding_bags
    route = collection.input_dist

    def recording_route(*args, **kwargs):
        if trainer.model.training:
            routed_on.append(threading.current_thread().name)
        return route(*args, **kwargs)

    collection.input_dist = recording_route
    before = setup(trainer) if setup is not None else None
    final = trainer.fit(
        train_data=_Stream(pa.concat_tables(blocks)),
        eval_data=_Stream(
            evaluation.slice(rank * half, half),
            # No periodic evaluations here: the final one fails on its second batch.
            fail_after=None if eval_fails_on_rank != rank else 1,
        ),
    )
    state = unsharded_state_dict(trainer)  # a collective; the full model on rank 0
    return {
        "losses": losses,
        "counted": counted,
        "final": final,
        "reports": reports,
        "state": state,
        "routed_on": routed_on,
        # Input distributions routed ahead and never consumed (none may be left).
        "prefetched_left": len(collection.prefetched),
        "before": before,
        "loop_state": trainer.state_dict(),
    }


def test_single_process_run_pins_first_losses(data_dir: Path, caplog) -> None:
    """Also: reports that take far longer than the steps between them are warned about once
    (Ray Train's report barrier would dominate the run); ``eval_every_steps`` is honoured on its
    own cadence, log step or not (3 with ``log_every_steps = 2``: steps 3, 6 and 9)."""
    with caplog.at_level(logging.WARNING, logger="raydlrm"):
        out = _run(0, 1, str(data_dir), report_seconds=0.3, eval_every=3)
    (warning,) = [r.getMessage() for r in caplog.records if "log_every_steps" in r.getMessage()]
    assert "metrics reports take 0.3" in warning and "at least" in warning
    losses = out["losses"]
    assert len(losses) == 10
    # Pinned on another CPU: its kernels may sum in other orders.
    assert_losses_close(losses[:4], PINNED_LOSSES)
    assert out["counted"][0] == 0  # no checkpoint: nothing restored (the progress file's base)
    assert all(isinstance(n, int) for n in out["counted"]), out["counted"]
    reports = out["reports"]
    # Log steps, evaluations, the final checkpoint (step 10), then the final evaluation.
    assert [r["step"] for r in reports] == [2, 3, 4, 6, 8, 9, 10, 10, 10]
    assert [r["has_checkpoint"] for r in reports] == [False] * 7 + [True, False]
    # Steps 3 and 9 report only because they evaluate (metrics ride along from before).
    assert "eval/auc" not in reports[0] and "eval/auc" in reports[1]
    assert len({r["eval/auc"] for r in reports[1:6]}) == 3  # evaluated at 3, 6 and 9
    assert "eval/auc" in reports[-1] and "eval/error" not in reports[-1]
    final = out["final"]
    assert final["eval/num_samples"] == 256
    assert "dropped_samples" not in final


@pytest.mark.distributed
@pytest.mark.parametrize(("optimizer", "embedding_l2"), [("rowwise_adagrad", 0.0), ("sgd", 0.5)])
def test_two_ranks_match_single_process(
    data_dir: Path, optimizer: str, embedding_l2: float
) -> None:
    """Sharded tables on 2 ranks train exactly like one process on the global batch. SGD is not
    invariant to the gradient's scale, so it catches embedding gradients summed over ranks
    instead of averaged (with the embeddings' L2 term too)."""
    single = _run(0, 1, str(data_dir), optimizer, embedding_l2=embedding_l2)
    results = run_distributed(
        functools.partial(_run, embedding_l2=embedding_l2),
        world_size=2,
        args=(str(data_dir), optimizer),
    )
    for r in results:  # the batch's sums split over 2 ranks
        assert_losses_close(r["losses"], single["losses"])
    auc = results[0]["final"]["eval/auc"]
    assert auc == pytest.approx(single["final"]["eval/auc"], abs=auc_tol(data_dir))
    # Every rank carries its part of the final checkpoint and reports the same number of times.
    assert results[0]["reports"][-2]["has_checkpoint"]
    assert results[1]["reports"][-2]["has_checkpoint"]
    assert len(results[0]["reports"]) == len(results[1]["reports"])
    # Wire bytes are reported, summed over ranks: ids went out, pooled vectors came back.
    final = results[0]["final"]
    assert final["comm/input_ids_bytes"] > 0
    # Evaluation sends pooled vectors forward only, so forward exceeds backward.
    assert final["comm/forward_fp32_bytes"] > final["comm/backward_fp32_bytes"] > 0
    assert results[1]["final"]["comm/forward_fp32_bytes"] == final["comm/forward_fp32_bytes"]


def test_embedding_l2_pulls_the_looked_up_rows_toward_zero(data_dir: Path) -> None:
    """``training.embedding_l2``: the rows that differ from a run without it are closer to
    zero, and not every row differs (rows no step looked up are not decayed); ``train/loss``
    stays the log loss (the first step's, before any update, is the same)."""
    plain = _run(0, 1, str(data_dir), "sgd", max_steps=3)
    decayed = _run(0, 1, str(data_dir), "sgd", max_steps=3, embedding_l2=2.0)
    assert decayed["losses"][0] == plain["losses"][0]
    assert decayed["losses"][1] != plain["losses"][1]
    tables = [k for k in plain["state"] if k.startswith("embedding_bags.weights.")]
    assert tables
    changed = 0
    for key in tables:
        a, b = plain["state"][key], decayed["state"][key]
        rows = (a != b).any(dim=1)
        changed += int(rows.sum())
        assert b[rows].norm() < a[rows].norm(), key
    assert 0 < changed < sum(plain["state"][k].shape[0] for k in tables)


@pytest.mark.distributed
def _run_new_archs(rank: int, world_size: int, data_dir: str) -> dict[str, dict]:
    return {
        name: _run(rank, world_size, data_dir, model=knobs) for name, knobs in NEW_ARCHS.items()
    }


@pytest.mark.distributed
def test_wukong_and_dhen_on_two_ranks_match_one_process_and_pin_first_losses(
    data_dir: Path,
) -> None:
    """Both models' dense sides are data-parallel over sharded tables: 2 ranks train exactly
    like one process on the global batch."""
    single = _run_new_archs(0, 1, str(data_dir))
    results = run_distributed(_run_new_archs, world_size=2, args=(str(data_dir),))
    for name, pinned in PINNED_ARCH_LOSSES.items():
        assert_losses_close(single[name]["losses"][:2], pinned)
        for r in results:
            assert_losses_close(r[name]["losses"], single[name]["losses"])
        assert results[0][name]["final"]["eval/auc"] == pytest.approx(
            single[name]["final"]["eval/auc"], abs=auc_tol(data_dir)
        )


def test_bad_eval_data_after_training_keeps_the_checkpoint(data_dir: Path) -> None:
    """The final checkpoint is reported before the final evaluation; a bad held-out row found
    there on one rank: every rank finishes its collectives and reports the error line."""
    results = run_distributed(
        _run, world_size=2, args=(str(data_dir), "rowwise_adagrad", "cpu", None, 1)
    )
    for r in results:
        checkpoint, last = r["reports"][-2:]
        assert checkpoint["has_checkpoint"] and checkpoint["step"] == 10
        assert not any(k.startswith("eval/") for k in checkpoint)
        assert not last["has_checkpoint"] and last["step"] == 10
        assert last["eval/error"].startswith("BadInputError: data/part-7.parquet")
        assert "eval/auc" not in r["final"]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["fbgemm", "torch"])
def test_cuda_run_matches_cpu(data_dir: Path, kernel: str) -> None:
    """The same run on CUDA (the kernel's device-resident tables; fbgemm needs its CUDA build,
    the torch kernel only torch) gives the CPU run's losses and eval AUC, pipelined or not
    (the pipelined CUDA run copies from pinned memory on a stream of its own)."""
    if kernel == "fbgemm":
        pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu's CUDA build")
    cpu = _run(0, 1, str(data_dir), kernel=kernel)
    fp32 = {"tf32": False}  # TF32 (the GPU default) rounds matmuls to a 10-bit mantissa
    cuda = _run(0, 1, str(data_dir), device="cuda", kernel=kernel, training=fp32)
    piped = _run(
        0, 1, str(data_dir), device="cuda", kernel=kernel, pipeline="sparse_dist", training=fp32
    )
    assert cuda["losses"] == pytest.approx(cpu["losses"], abs=1e-4)
    assert cuda["final"]["eval/auc"] == pytest.approx(cpu["final"]["eval/auc"], abs=1e-3)
    assert piped["losses"] == pytest.approx(cuda["losses"], abs=1e-6)


MIXED_TYPES = {
    "t_C1": "row_wise",
    "t_C2": "column_wise",
    "t_C3": "data_parallel",
    "t_C4": "table_row_wise",
}


def test_missing_indicators_widen_the_dense_input_that_trains(data_dir: Path) -> None:
    """``data.dense_fill = "median"`` with missing indicators: the dense arch takes one input
    per dense column and one per indicator (the synthetic columns all have missing values),
    and trains on them."""
    from raydlrm.ingestion import compute_dense_fill_values

    config = _spec(data_dir, batch_size=64, optimizer="sgd").data
    config.dense_fill, config.dense_missing_indicator = "median", True
    fills = compute_dense_fill_values([pq.read_table(data_dir / "train")], config)
    assert sorted(fills) == sorted(config.dense_columns)
    data = {"dense_fill": "median", "dense_missing_indicator": True, "dense_fill_values": fills}
    run = _run(0, 1, str(data_dir), "sgd", max_steps=3, data=data)
    first = next(v for k, v in run["state"].items() if k.startswith("dense.bottom"))
    assert first.shape[1] == 2 * len(config.dense_columns)
    plain = _run(0, 1, str(data_dir), "sgd", max_steps=3)
    assert run["losses"][0] != plain["losses"][0]  # filled otherwise, and wider


@pytest.mark.distributed
def test_same_seed_and_world_size_give_bit_identical_weights(data_dir: Path) -> None:
    """Determinism: two runs with a mixed plan (every sharding type) end with the same bits.
    The same run on the torch kernel ends with the same model within float rounding."""
    runs = [
        run_distributed(
            _run,
            world_size=2,
            args=(str(data_dir), "rowwise_adagrad", "cpu", MIXED_TYPES, None, 0.0, None, kernel),
        )[0]
        for kernel in ("fbgemm", "fbgemm", "torch")
    ]
    first, second, torch_kernel = (r["state"] for r in runs)
    assert first.keys() == second.keys() == torch_kernel.keys()
    assert any(k.startswith("embedding_bags.") for k in first)
    for key in first:
        assert torch.equal(first[key], second[key]), key
        tol = trained_tol(first[key], steps=len(runs[0]["losses"]))
        torch.testing.assert_close(torch_kernel[key], first[key], **tol, msg=key)
    assert runs[0]["losses"] == runs[1]["losses"]
    assert_losses_close(runs[2]["losses"], runs[0]["losses"])
    auc = runs[0]["final"]["eval/auc"]
    assert runs[2]["final"]["eval/auc"] == pytest.approx(auc, abs=auc_tol(data_dir))


def _pipelined_pair(rank: int, world_size: int, data_dir: str) -> list[dict]:
    """Each case run unpipelined, then pipelined: every sharding type with a rank whose data
    ends early (it steps with empty batches); dedup groups; the torch kernel."""
    cases = [
        {"pinned_types": MIXED_TYPES, "short_rank": 1},
        {"dedup": True},
        {"kernel": "torch", "pinned_types": MIXED_TYPES},
        {"dedup": True, "max_steps": 4},  # stopped early: the batch routed ahead is dropped
    ]
    return [
        [
            _run(rank, world_size, data_dir, **{"pipeline": pipeline, **case})
            for pipeline in ("none", "sparse_dist")
        ]
        for case in cases
    ]


@pytest.mark.distributed
def test_pipelined_training_is_bit_identical(data_dir: Path) -> None:
    """training.pipeline = "sparse_dist" (the next batch's any-rank check, copy and input
    all-to-all during the current step) trains exactly as the plain loop."""
    results = run_distributed(_pipelined_pair, world_size=2, args=(str(data_dir),))
    for case in range(4):
        plain, pipelined = results[0][case]
        assert plain["losses"] == pipelined["losses"], case
        assert len(plain["losses"]) == (4 if case == 3 else 10)
        assert pipelined["prefetched_left"] == plain["prefetched_left"] == 0
        assert plain["state"].keys() == pipelined["state"].keys()
        for key, value in plain["state"].items():
            assert torch.equal(value, pipelined["state"][key]), (case, key)
        assert plain["final"]["eval/auc"] == pipelined["final"]["eval/auc"]
        # The same number of reports on both ranks (every report is a barrier).
        assert len(results[1][case][1]["reports"]) == len(pipelined["reports"])
        # Pipelined, every training step's ids were routed in the background thread.
        assert set(plain["routed_on"]) == {"MainThread"}
        assert pipelined["routed_on"] and all(
            name.startswith("raydlrm-pipe") for name in pipelined["routed_on"]
        ), pipelined["routed_on"]
