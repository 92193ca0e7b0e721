"""Kill-and-resume reliability: a worker killed at many points, the job resumed bit for bit.

Runs one uninterrupted reference job and then one job per kill spec on a single local Ray
cluster and one synthetic data set (``--rows`` training rows, 2 workers, batch 128 per worker,
2 epochs, a checkpoint every 3 steps, metrics every step, ``run.max_failures=1``). Each kill
spec is ``rank=R,step=S[,during=step|checkpoint]``, injected through ``RAYDLRM_FAULT``: the
worker writes ``<run dir>/fault-injected.rank{R}.step{S}.{during}`` and dies with
``os._exit`` (see ``raydlrm.trainers.loop``), Ray Train restarts the workers from the latest
checkpoint. The defaults (2048 rows: 8 steps an epoch, 16 in all, checkpoints at 3, 6, ...,
15) kill before any checkpoint, right before and right after one, at the first step of epoch 1
(back into epoch 0), in epoch 1, and while writing a checkpoint (a periodic one and the final
one), on both ranks.

Per trial it checks the final weights against the reference (every key, ``torch.equal``),
``samples_seen``, the per-step sample ids (``training.sample_log_dir``) and the step the run
restored from (MLflow ``restore/from_step``, against the latest checkpoint before the kill), and
measures:

- kill-to-training: from the kill (the marker file's mtime, written just before ``os._exit``)
  to the MLflow timestamp (ms, the driver's clock when it logged the report) of the first
  training report after the restart, i.e. the first report with ``train/loss`` for a step after
  the restored one. That report is found by its ``restore/from_step`` entry (or, after a
  restart from scratch, as the first report logged after the kill); the tracking callback does
  not log again a metric whose value did not change, so a ``train/loss`` that repeats the value
  last logged before the kill (a retrained step) has no row of its own, and its report's
  timestamp is taken from the report's other rows. The first ``train/loss`` row after the
  restart is shown too. The driver takes reports when Ray Train's controller polls the workers
  (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, default 2 s), so the figure is up to one poll
  late;
- job wall time, against the reference's.

Prints a Markdown table and a summary line; writes ``results.json`` under ``--out``.

    .venv/bin/python benchmarks/kill_resume.py --out /tmp/raydlrm-kill-resume
    .venv/bin/python benchmarks/kill_resume.py --out /tmp/kr2 \
        --trials rank=1,step=11 rank=0,step=12,during=checkpoint
    .venv/bin/python benchmarks/kill_resume.py --set checkpoint.differential=true \
        --set checkpoint.num_to_keep=1 --set checkpoint.baseline_every=2 \
        --set checkpoint.baseline_fraction=1.0 --trials rank=1,step=8 rank=1,step=11 \
        rank=0,step=12,during=checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

BATCH_SIZE = 128  # per worker
NUM_WORKERS = 2
EPOCHS = 2
EVERY_STEPS = 3
DEFAULT_TRIALS = [  # for 2048 rows: 8 steps an epoch, 16 in all, checkpoints at 3, 6, ..., 15
    "rank=0,step=2",  # epoch 0, before the first checkpoint: restart from scratch
    "rank=1,step=5",  # epoch 0, right before the checkpoint of step 6
    "rank=0,step=7",  # epoch 0, right after the checkpoint of step 6
    "rank=0,step=9",  # the first step of epoch 1 (before its checkpoint): back into epoch 0
    "rank=1,step=11",  # epoch 1, two steps after the checkpoint of step 9 (as in the tests)
    "rank=0,step=12,during=checkpoint",  # while writing the checkpoint of step 12
    "rank=1,step=13",  # epoch 1, right after the checkpoint of step 12
    "rank=1,step=16,during=checkpoint",  # while writing the final checkpoint (with the model)
]


def _config(root: Path, name: str, rows: int, *, max_failures: int) -> dict[str, Any]:
    return {
        "data": {
            "train_path": str(root / "data" / "train"),
            "eval_path": None,
            "batch_size": BATCH_SIZE,
            "table_size": 500,
            "synthetic": {
                "generate": "if_missing",
                "num_train_rows": rows,
                "num_eval_rows": 0,
                "rows_per_file": 512,
                "max_cardinality": 400,
            },
        },
        "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
        "training": {
            "num_epochs": EPOCHS,
            "log_every_steps": 1,
            "sample_log_dir": str(root / "samples" / name),
        },
        "checkpoint": {"every_steps": EVERY_STEPS},
        "scaling": {"num_workers": NUM_WORKERS},
        "run": {"storage_path": str(root / "runs"), "name": name, "max_failures": max_failures},
        "tracking": {
            "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
            "experiment_name": "kill_resume",
            "registered_model_name": None,
        },
    }


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    from raydlrm.trainers.model_dir import ModelWeights

    return dict(ModelWeights(checkpoint).items())


def _sample_log(root: Path, name: str) -> dict[str, np.ndarray]:
    return {
        p.name: np.load(p, allow_pickle=False)
        for p in sorted(Path(root, "samples", name).glob("*.npy"))
    }


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (or exist on one side only), with the largest difference."""
    diffs = [f"{k} (missing)" for k in sorted(a.keys() ^ b.keys())]
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            diffs.append(f"{key} (shape/dtype {tuple(x.shape)}/{x.dtype} vs {tuple(y.shape)})")
        elif not torch.equal(x, y):
            delta = (x.double() - y.double()).abs()
            rows = int((delta.reshape(delta.shape[0], -1).amax(1) > 0).sum()) if x.ndim else 1
            diffs.append(f"{key} (max |diff| {float(delta.max()):.3g}, {rows} rows differ)")
    return diffs


def _parse(spec: str) -> dict[str, Any]:
    from raydlrm.trainers.config import FaultConfig

    fault = FaultConfig.from_env(spec)
    return {"rank": fault.rank, "step": fault.at_step, "during": fault.during}


def _expected_restore(step: int) -> int | None:
    """The latest checkpoint strictly before the kill (the kill's own step never gets one)."""
    latest = (step - 1) // EVERY_STEPS * EVERY_STEPS
    return latest or None


def _complete_checkpoints(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mtime of its last file) of every checkpoint directory of the run holding every
    rank's shards and the training state, registered by Ray Train or not."""
    from raydlrm.trainers.checkpoints import STATE_FILE, read_state_file

    found = []
    for path in run_dir.glob("checkpoint_*"):
        if not path.is_dir():  # checkpoint_manager_snapshot.json
            continue
        files = list(path.iterdir())
        if Path(path, STATE_FILE).is_file() and (
            sum(f.suffix == ".distcp" for f in files) >= NUM_WORKERS
        ):
            found.append((read_state_file(path)["step"], max(f.stat().st_mtime for f in files)))
    return sorted(found)


def _history(client: Any, run_id: str, key: str) -> list[Any]:
    return sorted(client.get_metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))


def _restart_timing(client: Any, run_id: str, restored: int | None, kill: float) -> dict:
    """Timestamps (s since the epoch) of the first training report after the restart and of the
    first ``train/loss`` row after it."""
    throughput = _history(client, run_id, "train/samples_per_second")  # changes every report
    if restored is not None:
        first = min(m.timestamp for m in _history(client, run_id, "restore/from_step"))
    else:  # restarted from scratch: the first report after the kill (the controller takes no
        # report of a worker group with a dead worker)
        first = next((m.timestamp for m in throughput if m.timestamp / 1000 > kill), None)
    if first is None:
        return {"report_ts": None, "loss_ts": None, "loss_step": None}
    floor = restored or 0
    loss = [
        m for m in _history(client, run_id, "train/loss") if m.timestamp >= first and m.step > floor
    ]
    return {
        "report_ts": first / 1000,
        "loss_ts": loss[0].timestamp / 1000 if loss else None,
        "loss_step": loss[0].step if loss else None,
    }


def _trial(
    root: Path, name: str, spec: str, rows: int, reference: dict, overrides: list[str]
) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    import raydlrm

    fault = _parse(spec)
    os.environ["RAYDLRM_FAULT"] = spec
    started = time.time()
    try:
        result = raydlrm.train(_config(root, name, rows, max_failures=1), overrides=overrides)
    except Exception as exc:  # a failed trial is a finding, not the end of the benchmark
        return {"name": name, "spec": spec, **fault, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ.pop("RAYDLRM_FAULT", None)
    wall = time.time() - started
    marker = Path(
        root,
        "runs",
        name,
        f"fault-injected.rank{fault['rank']}.step{fault['step']}.{fault['during']}",
    )
    kill = marker.stat().st_mtime if marker.is_file() else None

    on_disk = _complete_checkpoints(Path(root, "runs", name))
    before = [(step, t) for step, t in on_disk if kill is not None and t < kill]
    latest = max(before, default=None)
    client = MlflowClient(result.tracking_uri)
    restores = client.get_metric_history(result.run_id, "restore/from_step")
    restored_values = sorted({int(m.value) for m in restores})
    restored = restored_values[0] if len(restored_values) == 1 else None
    timing = (
        _restart_timing(client, result.run_id, restored, kill)
        if kill is not None
        else {"report_ts": None, "loss_ts": None, "loss_step": None}
    )
    diffs = _compare(reference["weights"], _weights(result.checkpoint_path))
    log = _sample_log(root, name)
    same_batches = log.keys() == reference["samples"].keys() and all(
        np.array_equal(log[k], reference["samples"][k]) for k in log
    )
    return {
        "name": name,
        "spec": spec,
        **fault,
        "fired": kill is not None,
        "restored_from": restored_values,
        "expected_restore": _expected_restore(fault["step"]),
        "latest_on_disk_before_kill": None if latest is None else latest[0],
        "latest_on_disk_age_s": None if latest is None else kill - latest[1],
        "identical": not diffs,
        "differing_keys": diffs,
        "same_batches": same_batches,
        "samples_seen": result.metrics.get("samples_seen"),
        "final_step": result.metrics.get("step"),
        "kill_to_training_s": None if timing["report_ts"] is None else timing["report_ts"] - kill,
        "kill_to_loss_row_s": None if timing["loss_ts"] is None else timing["loss_ts"] - kill,
        "first_loss_row_step": timing["loss_step"],
        "wall_s": wall,
        "checkpoint": result.checkpoint_path,
        "run_id": result.run_id,
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trials",
        nargs="+",
        default=DEFAULT_TRIALS,
        help="kill specs, rank=R,step=S[,during=step|checkpoint] (one trial each)",
    )
    parser.add_argument("--rows", type=int, default=2048, help="synthetic training rows")
    parser.add_argument("--out", type=Path, default=None, help="working dir (default: a temp)")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of local Ray")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="a config override for every job, e.g. checkpoint.differential=true (repeatable)",
    )
    args = parser.parse_args()
    specs = [(s, _parse(s)) for s in args.trials]  # bad specs fail before anything runs

    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "0")
    os.environ.pop("RAYDLRM_FAULT", None)
    from raydlrm.platform.ray_init import LOCAL_RAY_ENV

    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    import raydlrm

    root = (args.out or Path(tempfile.mkdtemp(prefix="raydlrm-kill-resume-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    tag = time.strftime("%Y%m%d-%H%M%S")  # fresh run names: a reused name would resume
    print(f"machine: {os.cpu_count()} CPUs; torch {torch.__version__}; ray {ray.__version__}")
    print(f"working dir: {root}; {args.rows} rows, {NUM_WORKERS} workers x batch {BATCH_SIZE}")
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        object_store_memory=512 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        if not Path(root, "data", "train").exists():  # generated once, outside the timings
            from raydlrm.platform.config import load_config
            from raydlrm.platform.job_data import prepare_data

            prepare_data(load_config(_config(root, "data", args.rows, max_failures=0)))
        name = f"reference-{tag}"
        started = time.time()
        clean = raydlrm.train(_config(root, name, args.rows, max_failures=0), overrides=args.set)
        reference = {
            "weights": _weights(clean.checkpoint_path),
            "samples": _sample_log(root, name),
            "wall_s": time.time() - started,
            "samples_seen": clean.metrics.get("samples_seen"),
            "step": clean.metrics.get("step"),
        }
        print(
            f"reference: {reference['step']:.0f} steps, samples_seen "
            f"{reference['samples_seen']:.0f}, wall {reference['wall_s']:.1f} s",
            flush=True,
        )
        trials = []
        for i, (spec, fault) in enumerate(specs, 1):
            if fault["step"] > reference["step"]:
                print(f"trial {i} ({spec}): step past the run's {reference['step']:.0f} steps")
            trial = _trial(root, f"t{i}-{tag}", spec, args.rows, reference, args.set)
            trial["samples_seen_equal"] = trial.get("samples_seen") == reference["samples_seen"]
            trials.append(trial)
            print(json.dumps({k: v for k, v in trial.items() if k != "checkpoint"}), flush=True)
    finally:
        ray.shutdown()

    print()
    print(
        "| trial | rank | kill step | during | restored from step | identical weights "
        "| kill-to-training s | job wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, t in enumerate(trials, 1):
        if "error" in t:
            print(f"| {i} | {t['rank']} | {t['step']} | {t['during']} | - | FAILED | - | - |")
            continue
        restored = ",".join(map(str, t["restored_from"])) or "none (from scratch)"
        print(
            f"| {i} | {t['rank']} | {t['step']} | {t['during']} | {restored} | "
            f"{'yes' if t['identical'] else 'no'} | {_fmt(t['kill_to_training_s'])} | "
            f"{_fmt(t['wall_s'])} |"
        )
    print(f"| reference | - | - | - | - | - | - | {_fmt(reference['wall_s'])} |")
    done = [t for t in trials if "error" not in t]
    identical = sum(t["identical"] for t in done)
    latencies = [t["kill_to_training_s"] for t in done if t["kill_to_training_s"] is not None]
    extra = [t["wall_s"] - reference["wall_s"] for t in done]
    print()
    print(
        f"trials: {len(trials)}, identical weights: {identical}/{len(trials)}, "
        f"median kill-to-training: {_fmt(statistics.median(latencies) if latencies else None)} s"
        f", median job wall over the reference: "
        f"{_fmt(statistics.median(extra) if extra else None)} s"
    )
    print()
    print("checks per trial:")
    for i, t in enumerate(trials, 1):
        if "error" in t:
            print(f"- {i} ({t['spec']}): FAILED: {t['error']}")
            continue
        expected = t["expected_restore"]
        restore_ok = t["restored_from"] == ([] if expected is None else [expected])
        print(
            f"- {i} ({t['spec']}): fault fired {t['fired']}; samples_seen "
            f"{t['samples_seen']:.0f} ({'equal' if t['samples_seen_equal'] else 'DIFFERS'}); "
            f"same batches per step {t['same_batches']}; restored from {t['restored_from']} "
            f"(latest checkpoint due before the kill: {expected}, "
            f"{'ok' if restore_ok else 'DIFFERS'}; latest complete on disk before the kill: "
            f"{t['latest_on_disk_before_kill']}, written {_fmt(t['latest_on_disk_age_s'])} s "
            f"before it); first train/loss row "
            f"after the restart: step {t['first_loss_row_step']}, "
            f"{_fmt(t['kill_to_loss_row_s'])} s after the kill"
            + (f"; differing keys: {t['differing_keys']}" if t["differing_keys"] else "")
        )
    Path(root, "results.json").write_text(
        json.dumps(
            {
                "rows": args.rows,
                "reference": {
                    k: v for k, v in reference.items() if k not in ("weights", "samples")
                },
                "trials": trials,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
