"""Peak disk use of a whole run: tables on the SSD tier, checkpoints, the registered model.

Runs ``raydlrm.train`` once per variant on a local Ray cluster (2 workers, every table on the
``ssd`` tier in ``<out>/<variant>/ssd``, run storage and MLflow's SQLite store and artifacts
under ``<out>/<variant>``), the model registered at the end. A thread samples the disk's used
bytes every 50 ms (:class:`_DiskPeak`: run it on a quiet machine); the figures are the peak
above the start while training and in all (the model written out and logged to MLflow at the
end), with the tables' own bytes for scale, and what the run left (checkpoints, MLflow
artifacts).

Checkpoints every ``--every`` steps, ``num_to_keep = --keep``. Variants (``--variants``):
``full`` (a full checkpoint each time), ``differential``
(``checkpoint.differential``, baselines every 10), ``differential-int8`` (and
``checkpoint.embedding_precision = "int8"``).

    .venv/bin/python benchmarks/checkpoint_disk.py --out /tmp/raydlrm-ckdisk --rows 300000

The figures before a change come from running this file at that change's parent commit (in a
``git worktree``), with the variants it knows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

NUM_WORKERS = 2
BATCH_SIZE = 512  # per worker
DIM = 64


def _config(
    root: Path, rows: int, steps: int, every: int, variant: str, keep: int
) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"every_steps": every, "num_to_keep": keep}
    if variant.startswith("differential"):
        checkpoint.update(differential=True)
    if variant.endswith("int8"):
        checkpoint.update(embedding_precision="int8")
    return {
        "data": {
            "train_path": str(root.parent / "data" / "train"),
            "eval_path": None,
            "batch_size": BATCH_SIZE,
            "table_size": rows,
            "synthetic": {
                "generate": "if_missing",
                "num_train_rows": steps * BATCH_SIZE * NUM_WORKERS,
                "num_eval_rows": 0,
                "rows_per_file": 8192,
                "max_cardinality": rows,
            },
        },
        "model": {"embedding_dim": DIM, "bottom_mlp": [64, DIM], "top_mlp": [64]},
        "training": {"num_epochs": 1, "log_every_steps": every},
        "sharding": {"default_placement": "ssd", "ssd_path": str(root / "ssd")},
        "checkpoint": checkpoint,
        "scaling": {"num_workers": NUM_WORKERS, "resources_per_worker": {"CPU": 0.5}},
        "run": {"storage_path": str(root / "runs"), "name": variant},
        "tracking": {
            "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
            "experiment_name": "checkpoint_disk",
            "registered_model_name": f"ckdisk-{variant}",
        },
    }


def _allocated(paths: list[Path]) -> int:
    """Bytes the files under ``paths`` take on the disk (allocated blocks: a table file not yet
    written counts what it holds)."""
    total = 0
    for path in paths:
        for p in path.rglob("*") if path.is_dir() else []:
            try:
                if p.is_file():
                    total += p.stat().st_blocks * 512
            except FileNotFoundError:  # deleted while walking
                pass
    return total


class _DiskPeak:
    """The peak of the disk's used bytes above their level at the start (``shutil.disk_usage``:
    the SSD tier's files are unlinked once mapped, so only the disk sees them; other work on
    the machine counts too, so run it on a quiet machine), overall and while training (before
    the driver starts writing the model for MLflow, a ``raydlrm-export-*`` directory)."""

    def __init__(self, root: Path, every_s: float = 0.05) -> None:
        self.root, self.every_s = root, every_s
        self.start = shutil.disk_usage(root).used
        self.peak = self.peak_training = 0
        self._trained = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        temp = Path(tempfile.gettempdir())
        while not self._stop.wait(self.every_s):
            used = shutil.disk_usage(self.root).used - self.start
            self.peak = max(self.peak, used)
            self._trained = self._trained or any(temp.glob("raydlrm-export-*"))
            if not self._trained:
                self.peak_training = max(self.peak_training, used)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _du(path: Path) -> int:
    return _allocated([path])


def _run(out: Path, variant: str, rows: int, steps: int, every: int, keep: int) -> dict[str, Any]:
    import raydlrm

    root = out / variant
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = _config(root, rows, steps, every, variant, keep)
    peak = _DiskPeak(root)
    started = time.perf_counter()
    raydlrm.train(config)
    seconds = time.perf_counter() - started
    checkpoints = sorted((root / "runs" / variant).glob("checkpoint_*"))
    result = {
        "variant": variant,
        "seconds": round(seconds, 1),
        "tables_bytes": 26 * rows * DIM * 4,
        "peak_bytes": peak.stop(),
        "peak_training_bytes": peak.peak_training,
        "checkpoints": len(checkpoints),
        "checkpoint_bytes": sum(_du(p) for p in checkpoints),
        "mlflow_bytes": _du(root / "mlruns"),
    }
    shutil.rmtree(root)  # the next variant has the disk to itself
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=300_000, help="rows of each of 26 tables")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    parser.add_argument("--keep", type=int, default=2, help="checkpoint.num_to_keep")
    parser.add_argument(
        "--variants", nargs="+", default=["full", "differential", "differential-int8"]
    )
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, object_store_memory=1 << 30)
    results = [
        _run(args.out, v, args.rows, args.steps, args.every, args.keep) for v in args.variants
    ]
    ray.shutdown()
    gb = 1e9
    print(
        "| variant | tables GB | peak GB while training (x tables) | peak GB in all (x tables) "
        "| checkpoints left | their GB | MLflow GB | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['variant']} | {r['tables_bytes'] / gb:.2f} | "
            f"{r['peak_training_bytes'] / gb:.2f} "
            f"({r['peak_training_bytes'] / r['tables_bytes']:.2f}x) | {r['peak_bytes'] / gb:.2f} "
            f"({r['peak_bytes'] / r['tables_bytes']:.2f}x) | {r['checkpoints']} | "
            f"{r['checkpoint_bytes'] / gb:.2f} | {r['mlflow_bytes'] / gb:.2f} | {r['seconds']} |"
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
