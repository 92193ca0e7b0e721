"""Differential checkpoints (Check-N-Run) and checkpoints at a lower precision: a chain of a
baseline and deltas resumes training bit for bit as the run that wrote it, in any plan;
retention keeps the baselines the kept deltas need; a damaged or foreign link is named and the
newest intact point taken."""

from __future__ import annotations

import logging
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
from typer.testing import CliRunner

from raydlrm.ingestion.reader import EpochProgress
from raydlrm.models.quantized import dequantize_blocks
from raydlrm.platform.cli import app
from raydlrm.trainers.checkpoints import (
    CheckpointDamagedError,
    load_training_state,
    newest_intact,
    open_chain,
    read_state_file,
    resume_blocker,
    verify_checkpoint,
)
from raydlrm.trainers.model_dir import ModelWeights
from tests._multiprocess import run_distributed
from tests.trainers._fixtures import trained_tol, unsharded_state_dict
from tests.trainers.test_checkpoint import (
    STEPS_AFTER,
    STEPS_BEFORE,
    _global_batches,
    _logits,
    _snapshot,
    _steps,
    _trainer,
)


@dataclass
class _Stored:
    """A checkpoint as stored in a run's storage (what Ray Train's ``Checkpoint`` gives)."""

    path: str
    filesystem: Any = None

    def __post_init__(self) -> None:
        self.filesystem = self.filesystem or pafs.LocalFileSystem()

    @contextmanager
    def as_directory(self):
        yield self.path


def _storing_report(root: Path, rank: int):
    """A report function storing each rank's checkpoint files into ``root/checkpoint_<n>``
    (merged, as Ray Train does) and returning it as stored."""
    count = [0]

    def report(metrics: dict, *, checkpoint_dir: str | None = None) -> _Stored | None:
        if checkpoint_dir is None:
            return None
        target = root / f"checkpoint_{count[0]:03d}"
        count[0] += 1
        shutil.copytree(checkpoint_dir, target, dirs_exist_ok=True)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank's part stored before it is registered
        return _Stored(str(target))

    return report


def _differential_trainer(rank, world_size, data_dir, types, optimizer, seed, root, **ckpt):
    settings = {"differential": True, "baseline_fraction": 1.0, **ckpt}
    report = _storing_report(Path(root), rank)
    return _trainer(
        rank, world_size, data_dir, types, optimizer, seed=seed, checkpoint=settings, report=report
    )


def _save_chain(rank, world_size, data_dir, root, types, optimizer) -> dict:
    """A checkpoint after each of the first steps (a baseline, then deltas)."""
    trainer = _differential_trainer(rank, world_size, data_dir, types, optimizer, 7, root)
    batches = _global_batches(data_dir, trainer.spec)
    for batch in batches[:STEPS_BEFORE]:
        _steps(trainer, [batch], world_size)
        trainer.checkpointer.save({}, loop_state=trainer.state_dict(), progress=EpochProgress(0))
    before = _snapshot(trainer, data_dir, world_size)
    _steps(trainer, batches[STEPS_BEFORE:], world_size)
    return {"before": before, "after": _snapshot(trainer, data_dir, world_size)}


def _load_chain(rank, world_size, data_dir, root, types, optimizer) -> dict:
    trainer = _differential_trainer(rank, world_size, data_dir, types, optimizer, 99, root)
    trainer.load(str(Path(root) / f"checkpoint_{STEPS_BEFORE - 1:03d}"))
    assert trainer.step == STEPS_BEFORE
    before = _snapshot(trainer, data_dir, world_size)
    _steps(trainer, _global_batches(data_dir, trainer.spec)[STEPS_BEFORE:], world_size)
    return {"before": before, "after": _snapshot(trainer, data_dir, world_size)}


def _chain_bytes(root: Path) -> list[tuple[str, int]]:
    out = []
    for i in range(STEPS_BEFORE):
        path = root / f"checkpoint_{i:03d}"
        state = read_state_file(path)
        size = sum(p.stat().st_size for p in path.iterdir() if p.name.startswith("__"))
        out.append((state["differential"]["kind"], size))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("optimizer", "saved", "loaded"),
    [
        ("rowwise_adagrad", (2, "row_wise"), (2, "row_wise")),
        ("rowwise_adagrad", (2, "table_wise+int8"), (2, "table_wise+int8")),
        ("adagrad", (2, "column_wise@torch"), (2, "column_wise@torch")),
        # the SSD tier (files behind a DRAM row cache), on both kernels
        ("rowwise_adagrad", (2, "table_wise!ssd"), (2, "table_wise!ssd")),
        ("adagrad", (2, "row_wise@torch!ssd"), (2, "row_wise@torch!ssd")),
        ("sgd", (2, "data_parallel"), (2, "data_parallel")),
        # reshard from a chain: another world size and sharding type
        ("rowwise_adagrad", (2, "column_wise"), (3, "table_wise")),
        ("rowwise_adagrad", (3, "row_wise+int8"), (1, "table_wise+int8")),
        # managed tables (one evicting from step 3): the deltas carry the changed map rows
        ("adagrad", (2, "row_wise^managed"), (2, "row_wise^managed")),
        ("rowwise_adagrad", (2, "table_wise^managed"), (3, "table_wise^managed")),
    ],
)
def test_chain_resumes_as_the_run_went_on(
    data_dir: Path, tmp_path: Path, optimizer: str, saved, loaded
) -> None:
    """Resumed from a baseline and two deltas, the model, its fused optimizer state and its
    predictions are those of the saving run at that step, bit for bit, and with the same plan
    the next steps are too; each delta is smaller than the baseline."""
    root = tmp_path / "run"
    args = (str(data_dir), str(root), saved[1], optimizer)
    a = run_distributed(_save_chain, world_size=saved[0], args=args)
    kinds = _chain_bytes(root)
    assert [k for k, _ in kinds] == ["baseline", "delta", "delta"]
    assert all(size < kinds[0][1] for _, size in kinds[1:]), kinds
    args = (str(data_dir), str(root), loaded[1], optimizer)
    if loaded[0] == 1:
        b = [_load_chain(0, 1, *args)]
    else:
        b = run_distributed(_load_chain, world_size=loaded[0], args=args)
    # The loading run has another seed: int8 rows round their updates with other noise.
    exact = ["before"] + (["after"] if saved == loaded and "int8" not in saved[1] else [])
    # A column-wise table's per-block momenta merge into one (their mean): later steps differ
    # from the saving run's, as from any column-wise checkpoint.
    resharded_columns = saved[1] != loaded[1] and "column" in saved[1]
    for when in ("before",) if resharded_columns else ("before", "after"):
        sa, sb = a[0][when]["state"], b[0][when]["state"]
        for key in sa:
            if when in exact:
                assert torch.equal(sa[key], sb[key]), (when, key)
            elif "int8" in saved[1]:  # each step's write-back rounds a row to a step of its
                # range (at most twice its largest value, over 255 levels) with other noise
                atol = STEPS_AFTER * 2 * float(sa[key].abs().max()) / 255
                torch.testing.assert_close(sa[key], sb[key], rtol=0.0, atol=atol, msg=key)
            else:
                tol = trained_tol(sa[key], steps=STEPS_AFTER)
                torch.testing.assert_close(sa[key], sb[key], **tol, msg=key)
        for table, states in a[0][when]["optimizer"].items():
            for x, y in zip(states, b[0][when]["optimizer"][table], strict=True):
                if when in exact and saved[1] == loaded[1]:
                    assert torch.equal(x, y), (when, table)
                else:
                    torch.testing.assert_close(x, y, **trained_tol(x, steps=STEPS_AFTER), msg=table)
    logits = _logits(a, "before")
    if saved == loaded:  # the same plan on as many ranks: the same arithmetic
        assert torch.equal(logits, _logits(b, "before"))
    else:  # another plan sums a bag's row-wise partial sums, a matmul's rows, otherwise
        torch.testing.assert_close(logits, _logits(b, "before"), **trained_tol(logits))


def _ckpt(root: Path, i: int) -> Path:
    return root / f"checkpoint_{i:03d}"


def test_retention_damage_export_and_precision(data_dir: Path, tmp_path: Path, caplog) -> None:
    """One process: retention keeps the newest checkpoints and every baseline and delta they
    need; a chain exports as the model at its step; a damaged delta, a missing baseline and a
    delta of another chain are named, and a resume takes the newest intact point; fp16 and
    int8 checkpoints hold tables within their rounding."""
    root = tmp_path / "run"
    trainer = _differential_trainer(
        0, 1, str(data_dir), "row_wise", "rowwise_adagrad", 7, root, num_to_keep=2, baseline_every=4
    )
    batches = _global_batches(data_dir, trainer.spec)

    def save(final: bool = False) -> None:
        trainer.checkpointer.save(
            {}, loop_state=trainer.state_dict(), progress=EpochProgress(0), final=final
        )

    models = []
    for i in range(4):  # baseline 0, deltas 1-3: all needed by the newest two
        _steps(trainer, [batches[i % len(batches)]], 1)
        save()
        models.append({k: v.clone() for k, v in unsharded_state_dict(trainer).items()})
    assert sorted(p.name for p in root.iterdir()) == [_ckpt(root, i).name for i in range(4)]
    exported = dict(ModelWeights(_ckpt(root, 3)).items())
    assert exported.keys() == models[3].keys()
    assert all(torch.equal(exported[k], v) for k, v in models[3].items())
    shown = CliRunner().invoke(app, ["checkpoint", "show", str(_ckpt(root, 3))])
    assert shown.exit_code == 0, shown.output
    assert "differential: delta 3 of the chain of baseline checkpoint_000" in shown.output
    verified = CliRunner().invoke(app, ["checkpoint", "verify", str(_ckpt(root, 3))])
    assert verified.exit_code == 0, verified.output
    # A warm start (another run) from the delta takes the chain's tables.
    warm = _trainer(0, 1, str(data_dir), "table_wise", "rowwise_adagrad", seed=99)
    warm.warm_start(str(_ckpt(root, 3)))
    assert all(torch.equal(v, models[3][k]) for k, v in unsharded_state_dict(warm).items())
    save(final=True)  # a baseline: baseline_every reached (being final does not decide)
    assert read_state_file(_ckpt(root, 4))["differential"]["kind"] == "baseline"
    foreign = tmp_path / "foreign"  # a baseline of another chain, for later
    shutil.copytree(_ckpt(root, 4), foreign)
    _steps(trainer, [batches[0]], 1)
    save()  # a delta of 4: 0-3 are needed no more
    assert sorted(p.name for p in root.iterdir()) == [_ckpt(root, 4).name, _ckpt(root, 5).name]

    # Deltas 6, 7 of 4; another chain of 3 (baseline 8: baseline_every; deltas 9, 10); damage
    # delta 9.
    for i in range(5):
        _steps(trainer, [batches[i % len(batches)]], 1)
        save()
    kinds = {p.name: read_state_file(p)["differential"]["kind"] for p in sorted(root.iterdir())}
    assert kinds == {
        _ckpt(root, 8).name: "baseline",
        **{_ckpt(root, i).name: "delta" for i in (9, 10)},
    }
    shard = next(p for p in _ckpt(root, 9).iterdir() if p.name.startswith("__"))
    shard.write_bytes(shard.read_bytes()[:-3])
    problems = verify_checkpoint(_ckpt(root, 10), checksums=False)
    assert any("the chain's checkpoint_009 is damaged" in p for p in problems), problems
    verified = CliRunner().invoke(app, ["checkpoint", "verify", str(_ckpt(root, 10))])
    assert verified.exit_code == 1 and "checkpoint_009 is damaged" in verified.output
    with (
        caplog.at_level(logging.WARNING),
        newest_intact(_Stored(str(_ckpt(root, 10)))) as (
            directory,
            _,
        ),
    ):
        assert Path(directory).name == "checkpoint_008"
    assert "checkpoint_010 is damaged, passed over" in caplog.text
    # A delta whose baseline is gone, or of another chain.
    shutil.rmtree(_ckpt(root, 8))
    assert any(
        "checkpoint_008 is damaged or missing" in p for p in verify_checkpoint(_ckpt(root, 10))
    )
    # No checkpoint left intact: what a resume says before Ray starts names each broken link
    # once (it listed every dependent checkpoint's problems, after Ray had started).
    blocker = resume_blocker(str(root), pafs.LocalFileSystem())
    assert blocker.startswith("none of its 2 checkpoints is intact: ")
    assert "checkpoint_008 is missing, which the chain of 1 later checkpoint needs;" in blocker
    assert "checkpoint_009 is damaged (" in blocker and blocker.count("checkpoint_009") == 1
    shutil.copytree(foreign, _ckpt(root, 8))
    assert any("belongs to another chain" in p for p in verify_checkpoint(_ckpt(root, 10)))
    alone = tmp_path / "alone" / "checkpoint_010"
    shutil.copytree(_ckpt(root, 10), alone)  # a delta copied without its chain
    with pytest.raises(CheckpointDamagedError, match="the chain's checkpoint_008 is damaged or"):
        ModelWeights(alone)
    with (
        pytest.raises(FileNotFoundError, match="checkpoint_008 of its chain is not beside it"),
        open_chain(alone),
    ):
        pass
    fresh = _trainer(0, 1, str(data_dir), "row_wise", "rowwise_adagrad", seed=99)
    with pytest.raises(CheckpointDamagedError, match="belongs to another chain"):
        load_training_state(_ckpt(root, 10), parts=fresh.parts())

    # Lower precision checkpoints: fp16 rounds to nearest, int8 within half a step a row.
    for precision in ("fp16", "int8"):
        store = tmp_path / precision
        saving = _trainer(
            0,
            1,
            str(data_dir),
            "row_wise",
            "rowwise_adagrad",
            seed=7,
            checkpoint={
                "embedding_precision": precision,
                "differential": True,
                "baseline_fraction": 10.0,
            },
            report=_storing_report(store, 0),
        )
        _steps(saving, batches[:2], 1)
        full = unsharded_state_dict(saving)
        saving.checkpointer.save({}, loop_state=saving.state_dict(), progress=EpochProgress(0))
        loading = _trainer(0, 1, str(data_dir), "row_wise", "rowwise_adagrad", seed=99)
        load_training_state(_ckpt(store, 0), parts=loading.parts())
        got = unsharded_state_dict(loading)
        for key, value in full.items():
            if not key.startswith("embedding_bags."):
                assert torch.equal(got[key], value), key
            elif precision == "fp16":
                assert torch.equal(got[key], value.half().float()), key
            else:
                step = (value.amax(1) - value.amin(1)).unsqueeze(1) / 255
                assert bool(((got[key] - value).abs() <= step * (1 + 2**-9) / 2 + 1e-6).all())
                assert not torch.equal(got[key], value)
    # An int8 chain unshards as the codes it loads (the delta's rows patched in).
    _steps(saving, batches[2:3], 1)
    saving.checkpointer.save({}, loop_state=saving.state_dict(), progress=EpochProgress(0))
    assert read_state_file(_ckpt(store, 1))["differential"]["kind"] == "delta"
    exported = dict(ModelWeights(_ckpt(store, 1)).items())
    load_training_state(_ckpt(store, 1), parts=loading.parts())
    got = unsharded_state_dict(loading)
    for key, value in got.items():
        if key.startswith("embedding_bags."):
            prefix = key.replace(".weights.", ".quantized.") + "."
            blocks = [tuple(b) for b in exported[prefix + "blocks"].tolist()]
            rows = dequantize_blocks(
                exported[prefix + "codes"],
                exported[prefix + "qparams"],
                blocks=blocks,
                precision="int8",
            )
            assert torch.equal(rows, value), key
