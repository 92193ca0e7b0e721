"""``training.precision`` and ``training.compile`` in the training loop: autocast with fp32
weights, fp16's loss scale and its skipped steps (one decision on every rank, nothing moves on
any), tower modules on hosts trained at their true gradient, and the compiled dense module.

The GPU check runs this file's ``gpu`` tests on a machine without safetensors: the helpers of
``test_checkpoint`` (which imports it) are imported where the CPU tests use them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raydlrm.sharding import plan_sharding
from raydlrm.sharding.parallelize import unwrap_dense
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.precision import LossScale
from tests._multiprocess import run_distributed
from tests.sharding._fixtures import gather_full_optimizer_states, gather_full_tables
from tests.trainers._fixtures import unsharded_state_dict
from tests.trainers.test_loop import _run, _spec


@pytest.mark.parametrize(
    ("precision", "device"),
    [
        ("bf16", "cpu"),
        ("fp16", "cpu"),
        pytest.param("bf16", "cuda", marks=pytest.mark.gpu),
        pytest.param("fp16", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_dense_precision_autocasts_the_dense_side_and_keeps_fp32_weights(
    data_dir: Path, precision: str, device: str
) -> None:
    """``training.precision``: the dense side computes in bf16/fp16 (other losses than fp32's,
    close to them), the weights stay fp32, the loss and metrics are fp32; fp16 counts its
    skipped steps and keeps its loss scale in the loop's checkpointed state."""
    plain = _run(0, 1, str(data_dir), max_steps=6, device=device)
    low = _run(0, 1, str(data_dir), max_steps=6, device=device, training={"precision": precision})
    assert low["losses"] != plain["losses"]
    assert low["losses"] == pytest.approx(plain["losses"], rel=0.02)
    assert {k: v.dtype for k, v in low["state"].items()} == {
        k: v.dtype for k, v in plain["state"].items()
    }
    assert abs(low["final"]["eval/auc"] - plain["final"]["eval/auc"]) < 0.02
    if precision == "fp16":
        assert low["final"]["train/skipped_steps"] == 0
        # torch.amp.GradScaler's state format: checkpoints of either load.
        scaler = low["loop_state"]["precision"]["scaler"]
        assert scaler == {
            "scale": 2.0**16,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 6,
        }
        loaded = torch.amp.GradScaler("cpu")
        loaded.load_state_dict(scaler)
        assert loaded.get_scale() == 2.0**16
    else:
        assert "train/skipped_steps" not in low["final"] and "precision" not in low["loop_state"]


def test_loss_scale_follows_the_grad_scaler_rule() -> None:
    """Halved after an overflow (its streak restarts), doubled after ``growth_interval`` steps
    in a row without one."""
    scale = LossScale(8.0, growth_interval=3)
    for overflow, expected in [(False, 8), (False, 8), (True, 4), (False, 4), (False, 4)]:
        scale.update(overflow=overflow)
        assert scale.scale == expected
    scale.update(overflow=False)
    assert scale.scale == 8 and scale.growth_tracker == 0


def test_compiled_dense_module_runs_compiled_and_trains_as_eager(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``training.compile`` compiles the dense module in place: training steps run the
    compiled graph (dynamo traces it, forward and backward) and give eager's losses within
    the compiled kernels' rounding; the parameters keep their names, so checkpoints do not
    change. Compiled with AOTAutograd's eager backend (the graphs traced as inductor gets them,
    without its C++ code generation, 20 s of a fresh machine's test time); the GPU check runs
    inductor itself."""
    import torch._dynamo

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module,
        "compile",
        lambda module, **kw: compile_module(module, **{**kw, "backend": "aot_eager"}),
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = _run(0, 1, str(data_dir), max_steps=2)
    fast = _run(0, 1, str(data_dir), max_steps=2, training={"compile": True})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert fast["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert fast["state"].keys() == eager["state"].keys()
    spec = _spec(data_dir, batch_size=64, optimizer="sgd")
    spec.training.compile = True
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
    compiled = Trainer(spec, plan=plan, rank=0, device=torch.device("cpu"))
    assert compiled.model.dense._compiled_call_impl is not None


@pytest.mark.gpu
def test_compiled_dense_side_trains_as_eager_with_the_same_checkpoint_keys(
    data_dir: Path,
) -> None:
    """``training.compile``: the dense architecture compiled in place (on CUDA, what the GPU
    check measures) trains as the eager one, within the compiled kernels' rounding, and its
    parameters keep their names."""

    def compiled(trainer: Trainer) -> None:
        assert trainer.model.dense._compiled_call_impl is not None

    eager = _run(0, 1, str(data_dir), max_steps=4, device="cuda", training={"tf32": False})
    fast = _run(
        0,
        1,
        str(data_dir),
        max_steps=4,
        device="cuda",
        training={"tf32": False, "compile": True},
        setup=compiled,
    )
    assert fast["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert fast["state"].keys() == eager["state"].keys()


def test_fp16_steps_that_overflow_move_no_weight(data_dir: Path) -> None:
    """A loss scale so large that every gradient overflows: each step is skipped (counted),
    the dense weights and the embedding rows (updated inside the backward pass) stay as they
    were."""

    def huge_scale(trainer: Trainer) -> dict:
        trainer.precision.loss_scale = LossScale(2.0**100)
        return unsharded_state_dict(trainer)

    run = _run(0, 1, str(data_dir), max_steps=3, training={"precision": "fp16"}, setup=huge_scale)
    assert run["final"]["train/skipped_steps"] == 3
    for key, value in run["before"].items():
        assert torch.equal(run["state"][key], value), key


def _weights(trainer: Trainer) -> dict:
    """The full tables and their optimizer state (on rank 0; collectives), this rank's dense
    parameters."""
    collection = trainer.model.embedding_bags
    return {
        "tables": gather_full_tables(collection),
        "states": gather_full_optimizer_states(collection),
        "dense": {k: v.detach().clone() for k, v in unwrap_dense(trainer.model).named_parameters()},
    }


def _overflow_on_rank_1(rank: int, world_size: int, data_dir: str, where: str) -> dict:
    """Two fp16 steps on 2 ranks; in the first, rank 1 alone sees an overflow in its pooled
    gradient (``where = "pooled"``) or in one dense gradient (``"dense"``, which the
    data-parallel all-reduce then hands every rank)."""
    from tests.trainers.test_checkpoint import _global_batches, _steps, _trainer

    trainer = _trainer(
        rank, world_size, data_dir, "row_wise", "adagrad", seed=5, training={"precision": "fp16"}
    )
    batches = _global_batches(data_dir, trainer.spec)[:2]
    before = _weights(trainer)
    handle = None
    if rank == 1:

        def poison(grad: torch.Tensor) -> torch.Tensor:
            return torch.full_like(grad, float("inf"))

        if where == "pooled":
            handle = trainer.model.embedding_bags.register_forward_hook(
                lambda _m, _i, out: out.values.register_hook(poison) and None
            )
        else:
            handle = next(unwrap_dense(trainer.model).parameters()).register_hook(poison)
    _steps(trainer, batches[:1], world_size)
    if handle is not None:
        handle.remove()
    skipped = _weights(trainer)
    scale = trainer.precision.loss_scale.scale
    _steps(trainer, batches[1:], world_size)
    return {
        "before": before,
        "skipped": skipped,
        "trained": _weights(trainer),
        "scale": scale,
        "skipped_steps": trainer.precision.skipped_steps,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["pooled", "dense"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(data_dir: Path, where) -> None:
    """An fp16 step whose gradients overflow on one rank only, in its pooled embeddings'
    gradient or in the dense part only: every rank skips it whole (no row, no Adagrad state,
    no dense weight moves; the scale halves on both) and counts it; the next step trains."""
    results = run_distributed(_overflow_on_rank_1, world_size=2, args=(str(data_dir), where))
    for r in results:
        assert r["skipped_steps"] == 1 and r["scale"] == 2.0**15
        for name, value in r["before"]["dense"].items():
            assert torch.equal(r["skipped"]["dense"][name], value), name
        assert any(
            not torch.equal(r["trained"]["dense"][k], v) for k, v in r["skipped"]["dense"].items()
        )
    first = results[0]
    for part in ("tables", "states"):
        for name, value in first["before"][part].items():
            before, skipped = (value, first["skipped"][part][name])
            pairs = zip(before, skipped, strict=True) if part == "states" else [(before, skipped)]
            for x, y in pairs:
                assert torch.equal(x, y), (part, name)
    assert any(
        not torch.equal(first["trained"]["tables"][n], t)
        for n, t in first["skipped"]["tables"].items()
    )


def _tower_updates(rank: int, world_size: int, data_dir: str) -> dict:
    """One SGD step of compressing towers on 2 hosts of one rank (the tower collection runs
    the tower modules), in fp32 and in fp16: each dense parameter's update."""
    from tests.trainers.test_checkpoint import TOWERS, _global_batches, _steps, _trainer

    updates = {}
    for precision in ("fp32", "fp16"):
        trainer = _trainer(
            rank,
            world_size,
            data_dir,
            "table_wise",
            "sgd",
            seed=5,
            model={"towers": TOWERS, "tower_dim": 16},
            ranks_per_host=1,
            training={"precision": precision, "dense_optimizer": "sgd", "learning_rate": 0.1},
        )
        dense = dict(unwrap_dense(trainer.model).named_parameters())
        before = {k: v.detach().clone() for k, v in dense.items()}
        _steps(trainer, _global_batches(data_dir, trainer.spec)[:1], world_size)
        updates[precision] = {k: dense[k].detach() - before[k] for k in dense}
    return updates


@pytest.mark.distributed
def test_fp16_tower_modules_on_two_hosts_update_as_in_fp32(data_dir: Path) -> None:
    """fp16 with towers on 2 hosts: the tower modules (run by the tower collection, trained by
    the dense optimizer) get their gradient unscaled once, so an SGD step moves them as fp32's
    does (within fp16's rounding; unscaled twice, they moved 65,536 times less)."""
    for updates in run_distributed(_tower_updates, world_size=2, args=(str(data_dir),)):
        towers = [k for k in updates["fp32"] if k.startswith("blocks.")]
        assert towers and len(towers) < len(updates["fp32"])
        for name, fp32 in updates["fp32"].items():
            fp16 = updates["fp16"][name]
            assert fp32.norm() > 0, name
            assert (fp16 - fp32).norm() / fp32.norm() < 0.05, name
