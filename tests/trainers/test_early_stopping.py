"""Validation and early stopping in the training loop (no Ray): a planted validation curve
stops the run at the right evaluation, the run ends with the best checkpoint's weights (what
the final checkpoint, the registered model, holds), and a run killed after its best
checkpoint resumes with its best checkpoint and patience counter to the same end."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from raydlrm.ingestion import Preprocessor
from raydlrm.sharding import plan_sharding
from raydlrm.trainers.checkpoints import read_state_file
from raydlrm.trainers.config import EarlyStoppingConfig
from raydlrm.trainers.early_stopping import EarlyStopping
from raydlrm.trainers.loop import Trainer
from tests.trainers._fixtures import unsharded_state_dict
from tests.trainers.test_differential import _Stored
from tests.trainers.test_loop import _spec, _Stream

# valid/auc by step (evaluations every 2 steps); patience 2, min_delta 0.005: the best is step
# 8 (0.66: step 6 fell, step 8 beat 0.65 by 0.01), then steps 10 and 12 do not beat 0.665.
CURVE = {2: 0.60, 4: 0.65, 6: 0.64, 8: 0.66, 10: 0.655, 12: 0.664, 14: 0.70, 16: 0.71}
STOPPING = {"patience": 2, "min_delta": 0.005}


def test_planted_curve_stops_at_the_right_evaluation() -> None:
    """Patience counts evaluations in a row without an improvement beyond ``min_delta``; a
    NaN never improves; the lower-is-better losses count the other way."""
    stopping = EarlyStopping(EarlyStoppingConfig(**STOPPING))
    improved = [stopping.update({"valid/auc": v}, step=s) for s, v in CURVE.items() if s <= 12]
    assert improved == [True, True, False, True, False, False]
    assert (stopping.best, stopping.best_step, stopping.stopped_step) == (0.66, 8, 12)
    losses = EarlyStopping(EarlyStoppingConfig(metric="valid/log_loss", patience=1))
    assert losses.update({"valid/log_loss": 0.5}, step=1)
    assert losses.update({"valid/log_loss": 0.4}, step=2)
    assert not losses.update({"valid/log_loss": math.nan}, step=3)
    assert (losses.best_step, losses.stopped_step) == (2, 3)
    # The state round-trips (a checkpoint's loop state).
    again = EarlyStopping(EarlyStoppingConfig(**STOPPING))
    again.load_state_dict(stopping.state_dict())
    assert again.state_dict() == stopping.state_dict()


class _Killed(Exception):
    pass


def _trainer(
    data_dir: Path,
    root: Path,
    *,
    every: int,
    epochs: int,
    kill_at: int | None,
    curve: dict[int, float] = CURVE,
):
    spec = _spec(data_dir, batch_size=64, optimizer="rowwise_adagrad")
    spec.training.num_epochs = epochs
    spec.training.valid_every_steps = every
    spec.training.early_stopping = EarlyStoppingConfig(**STOPPING)
    spec.checkpoint.every_steps = 5
    spec.checkpoint.num_to_keep = 1  # the best must survive retention
    plan = plan_sharding(spec.tables(), world_size=1, config=spec.sharding)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def hook(moment, *, step=0, **_):
        if moment != "step":
            return
        if step == kill_at:
            raise _Killed(step)
        snapshots[step] = unsharded_state_dict(trainer)

    trainer = Trainer(
        spec,
        plan=plan,
        rank=0,
        device=torch.device("cpu"),
        hooks=[hook],
        report=_storing_report(root),
    )
    # The planted curve: the validation evaluator's metrics by the step it evaluates at.
    trainer.validation.evaluator.run = lambda: {"valid/auc": curve.get(trainer.step, 0.5)}
    return trainer, snapshots


def _storing_report(root: Path):
    """Stores each checkpoint as ``root/checkpoint_<n>``, numbered on from those there (a
    resumed run's come after the killed run's, as Ray Train's time-stamped names do)."""
    root.mkdir(parents=True, exist_ok=True)
    count = [1 + max((int(p.name.split("_")[1]) for p in root.iterdir()), default=-1)]

    def report(metrics: dict, *, checkpoint_dir: str | None = None) -> _Stored | None:
        if checkpoint_dir is None:
            return None
        target = root / f"checkpoint_{count[0]:03d}"
        count[0] += 1
        shutil.copytree(checkpoint_dir, target)
        return _Stored(str(target))

    return report


def _fit(trainer: Trainer, data_dir: Path) -> dict:
    preprocess = Preprocessor(trainer.spec.data)
    train = preprocess(pq.read_table(data_dir / "train"))
    held_out = preprocess(pq.read_table(data_dir / "eval"))
    return trainer.fit(
        train_data=_Stream(train), eval_data=_Stream(held_out), valid_data=_Stream(held_out)
    )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_run_ends_with_the_best_checkpoint_and_resumes_its_patience(
    data_dir: Path, tmp_path: Path
) -> None:
    """Stopped at step 12 (of 30), the model is step 8's: the weights at the end, and the final
    checkpoint's state names the best; retention (``num_to_keep = 1``) kept the best
    checkpoint. Killed at step 11 and resumed from step 10's checkpoint (best step 8, one
    evaluation without improvement), the run stops at step 12 with the same weights."""
    whole, snapshots = _trainer(data_dir, tmp_path / "a", every=2, epochs=3, kill_at=None)
    final = _fit(whole, data_dir)
    assert whole.step == 12
    assert final["early_stopping/best_step"] == 8 and final["early_stopping/stopped_step"] == 12
    # The model's (the best) validation AUC; the curve's last point stays the last one's.
    assert final["early_stopping/best"] == 0.66 and final["valid/auc"] == 0.664
    assert "eval/auc" in final  # the final evaluation scored the best model
    best = unsharded_state_dict(whole)
    assert _same(best, snapshots[8]) and not _same(best, snapshots[12])
    stored = sorted((tmp_path / "a").iterdir())
    state = read_state_file(stored[-1])  # the final checkpoint
    assert state["validation"]["early_stopping"]["best_step"] == 8
    kept = state["validation"]["early_stopping"]["best_checkpoint"]
    assert Path(kept).is_dir() and read_state_file(Path(kept))["step"] == 8

    killed, _ = _trainer(data_dir, tmp_path / "b", every=2, epochs=3, kill_at=11)
    with pytest.raises(_Killed):
        _fit(killed, data_dir)
    latest = sorted((tmp_path / "b").iterdir())[-1]
    assert read_state_file(latest)["validation"]["early_stopping"]["bad"] == 1
    resumed, _ = _trainer(data_dir, tmp_path / "b", every=2, epochs=3, kill_at=None)
    resumed.load(str(latest), stored=_Stored(str(latest)))
    assert resumed.step == 10
    again = _fit(resumed, data_dir)
    assert resumed.step == 12 and again["early_stopping/best_step"] == 8
    assert _same(unsharded_state_dict(resumed), best)


@pytest.mark.distributed
def test_epoch_end_validation_stops_before_the_last_epoch(data_dir: Path, tmp_path: Path) -> None:
    """With ``valid_every_steps = 0`` the validation runs at each epoch's end (10 steps an
    epoch): 0.60 at step 10, 0.66 at 20, then two epochs without improvement stop the run at
    step 40 of 50, with step 20's weights."""
    curve = {10: 0.60, 20: 0.66, 30: 0.65, 40: 0.62}
    trainer, snapshots = _trainer(data_dir, tmp_path, every=0, epochs=5, kill_at=None, curve=curve)
    final = _fit(trainer, data_dir)
    assert trainer.step == 40
    assert final["early_stopping/best_step"] == 20
    assert _same(unsharded_state_dict(trainer), snapshots[20])
