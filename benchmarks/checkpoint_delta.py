"""Differential checkpoints (Check-N-Run): bytes, save and resume time, and resumed-run AUC.

Three parts, side by side in one run:

1. **Bytes and save time, full vs differential.** A ``Trainer`` (``--tables`` tables of
   ``--rows`` rows x ``--dim``, row-wise Adagrad, the DLRM dense side with Adam, one thread per
   process, table-wise) trains on batches of ``--batch`` samples (global) whose ids are drawn here
   (``hash = false``: the ids are rows): ``powerlaw``, P(rank) ~ (rank + 1) ** -``--zipf``
   over every table's rows, ranks mapped to rows by a fixed random permutation per table, or
   ``uniform`` over the rows (the synthetic generator cannot make either: its per-feature
   cardinalities are log-spaced from 4 up, so most features touch only a few rows). One id
   per feature per sample. For each interval (``--intervals``, checkpoints every that many
   steps, ``--checkpoints`` of each) one run writes, at every checkpoint and from the same
   weights, three checkpoints through three ``Checkpointer`` objects: a full one
   (``differential = false``), a differential one that writes only deltas after its first
   baseline (``baseline_every`` huge and ``baseline_fraction`` infinite: the test is on the
   chain's *cumulative* delta bytes; a delta that would be as large as a baseline is still
   written as a baseline), and one with the
   default policy (``baseline_every = 10``, ``baseline_fraction = 0.5``). The modified rows
   are cleared once all three have saved, and the order of the three rotates from one
   checkpoint to the next (the first save after training steps is the slowest). Bytes: every
   file of the checkpoint directory as stored (all ranks' parts merged, as Ray Train does).
   Save seconds: ``Checkpointer.save``, between barriers: writing the rank's files into its
   temporary directory (DCP, fsynced) and moving them into the run storage (``--workdir``;
   a rename on the same disk, as ``raydlrm.trainers._ray.report`` does on a local storage).
   Rows touched: the rows a delta holds (modified since the previous checkpoint) over all rows.
2. **Resume time from a chain.** ``Trainer.load`` (``load_training_state`` of the chain, plus
   the loop state) of the power-law, first-interval run's baseline alone and of its deltas 1, 5
   and 9 (a baseline + 1, 5, 9 deltas), and of the full checkpoint of the same step as the
   last delta (median of ``--load-repeats``, into one fresh trainer; the files are in the page
   cache after the first repeat). The chain's tables and fused optimizer state are checked
   equal to the full checkpoint's.
3. **Resumed-run AUC at fp32 / fp16 / int8.** One process trains on the synthetic data
   (``generate_synthetic``: ``--auc-train-rows`` training rows, 50,000 eval rows, the default
   planted model of AUC 0.80; ids hashed into the tables) for ``--auc-steps`` steps
   (one epoch), writing a differential chain (a baseline at 1/4, a delta at 1/2) and a full
   checkpoint at 1/2 at ``checkpoint.embedding_precision`` fp32, fp16 and int8. A fresh
   trainer (another seed) resumes from each step-1/2 checkpoint, trains the same batches to
   the end, and is evaluated (ROC AUC, ``raydlrm.trainers.metrics``) on the eval rows against
   the uninterrupted run.

With ``--world-size 2`` parts 1 and 2 run on 2 gloo ranks (spawned, table-wise: 13 tables a
rank, half the global batch each); part 3 always runs in one process.

    .venv/bin/python benchmarks/checkpoint_delta.py --rows 100000 --dim 32 --batch 512 \
        --intervals 100 500 1000 --checkpoints 10 4 3 --world-size 2

(about 4.5 minutes on 2 cores; ``--world-size 1``: about 3.7.)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import socket
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raydlrm._sampling import zipf_ranks
from raydlrm.batch import Batch, KeyedJaggedTensor
from raydlrm.ingestion import Preprocessor
from raydlrm.ingestion.loader import arrow_to_batch
from raydlrm.ingestion.reader import EpochProgress
from raydlrm.ingestion.synthetic import generate_synthetic
from raydlrm.ingestion.synthetic_config import SyntheticConfig
from raydlrm.sharding import plan_sharding
from raydlrm.trainers.checkpoint_cadence import Checkpointer
from raydlrm.trainers.checkpoints import read_state_file, save_training_state
from raydlrm.trainers.config import CheckpointConfig
from raydlrm.trainers.loop import Trainer
from raydlrm.trainers.metrics import binary_metrics
from raydlrm.trainers.reporting import Reporter
from raydlrm.trainers.spec import WorkerSpec

NUM_DENSE = 13
NEVER = 10**9  # baseline_every: every checkpoint after the first is a delta
MB = 1e6


# ---------------------------------------------------------------------------------------------
# Helpers (after tests/trainers/test_differential.py): a report function that stores each
# checkpoint into root/checkpoint_<n>, merging the ranks' parts as Ray Train does, by moving
# the files (``raydlrm.trainers._ray.report`` on a local run storage: a rename on one disk).


@dataclasses.dataclass
class _Stored:
    """A checkpoint as stored in a run's storage (what Ray Train's ``Checkpoint`` gives)."""

    path: str
    filesystem: Any = None

    def __post_init__(self) -> None:
        self.filesystem = self.filesystem or pafs.LocalFileSystem()

    @contextmanager
    def as_directory(self):
        yield self.path


def _storing_report(root: Path):
    count = [0]

    def report(metrics: dict, *, checkpoint_dir: str | None = None) -> _Stored | None:
        if checkpoint_dir is None:
            return None
        target = root / f"checkpoint_{count[0]:03d}"
        count[0] += 1
        target.mkdir(parents=True, exist_ok=True)
        for source in Path(checkpoint_dir).iterdir():  # moved, as raydlrm.trainers._ray does
            shutil.move(source, target / source.name)  # on a local run storage
        _barrier()  # every rank's part stored before it is registered
        return _Stored(str(target))

    return report


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _dir_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _kind(path: str | Path) -> str:
    link = read_state_file(path).get("differential")
    return "full" if link is None else link["kind"]


@contextmanager
def _keeping_modified_rows(collection: Any):
    """While a differential checkpointer saves, the modified rows stay flagged for the others
    saving at the same step (each clears them after its save; cleared once after all)."""
    collection.clear_modified_rows = lambda: None
    try:
        yield
    finally:
        del collection.clear_modified_rows


# ---------------------------------------------------------------------------------------------
# Part 1 and 2: id distributions drawn here, one id per feature per sample.


def _spec(args: argparse.Namespace, world: int, *, hashed: bool, **checkpoint: Any) -> WorkerSpec:
    columns = [f"C{i}" for i in range(1, args.tables + 1)]
    data: dict[str, Any] = {
        "train_path": "unused",
        "eval_path": None,
        "table_size": args.rows,
        "batch_size": args.batch // world,
        "sparse_columns": columns,
    }
    if not hashed:
        data["sparse_specs"] = {c: {"hash": False} for c in columns}
    spec = WorkerSpec(
        data=data,
        model={"embedding_dim": args.dim, "bottom_mlp": [64, args.dim], "top_mlp": [64, 32]},
        training={"seed": 7},
    )
    for key, value in checkpoint.items():
        setattr(spec.checkpoint, key, value)
    return spec


def _trainer(spec: WorkerSpec, rank: int, world: int, report: Any) -> Trainer:
    plan = plan_sharding(spec.tables(), world_size=world, config=spec.sharding)
    return Trainer(spec, plan=plan, rank=rank, device=torch.device("cpu"), report=report)


class _Batches:
    """This rank's share of the global batch of step ``s`` (the same on every rank)."""

    def __init__(self, args: argparse.Namespace, distribution: str, rank: int, world: int):
        self.args, self.distribution, self.rank, self.world = args, distribution, rank, world
        rng = np.random.default_rng([args.seed, 99])
        self.perms = np.stack([rng.permutation(args.rows) for _ in range(args.tables)])
        self.code = {"powerlaw": 0, "uniform": 1}[distribution]

    def __call__(self, step: int) -> Batch:
        a, b = self.args, self.args.batch
        rng = np.random.default_rng([a.seed, self.code, step])
        if self.distribution == "uniform":
            ids = rng.integers(0, a.rows, size=(a.tables, b))
        else:
            ranks = zipf_ranks(rng, size=(a.tables, b), cardinality=a.rows, s=a.zipf)
            ids = np.take_along_axis(self.perms, ranks, axis=1)
        dense = np.log1p(rng.lognormal(1.0, 1.5, size=(b, NUM_DENSE))).astype(np.float32)
        labels = (rng.random(b) < 0.25).astype(np.float32)
        share = b // self.world
        lo, hi = self.rank * share, (self.rank + 1) * share
        mine = np.ascontiguousarray(ids[:, lo:hi])
        return Batch(
            dense=torch.from_numpy(np.ascontiguousarray(dense[lo:hi])),
            sparse=KeyedJaggedTensor(
                keys=[f"C{i}" for i in range(1, a.tables + 1)],
                values=torch.from_numpy(mine.reshape(-1)),
                lengths=torch.ones(a.tables * share, dtype=torch.int64),
                batch_size=share,
            ),
            labels=torch.from_numpy(labels[lo:hi]),
        )


def _sum(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _timed_save(checkpointer: Checkpointer, trainer: Trainer) -> tuple[Any, float]:
    _barrier()
    start = time.perf_counter()
    stored = checkpointer.save({}, loop_state=trainer.state_dict(), progress=EpochProgress(0))
    _barrier()
    return stored, time.perf_counter() - start


def _interval_run(
    args: argparse.Namespace,
    *,
    rank: int,
    world: int,
    distribution: str,
    interval: int,
    count: int,
    root: Path,
    keep: bool,
) -> dict[str, Any]:
    """Trains ``interval * count`` steps, checkpointing every ``interval`` steps with the
    three checkpointers; returns rank 0's records (bytes, seconds, kind per checkpoint)."""
    spec = _spec(
        args,
        world,
        hashed=False,
        differential=True,
        baseline_fraction=math.inf,  # past the config's (0, 1] check: deltas only
        baseline_every=NEVER,
    )
    trainer = _trainer(spec, rank, world, _storing_report(root / "delta"))
    total_rows = args.tables * args.rows

    def other(config: CheckpointConfig, name: str) -> Checkpointer:
        return Checkpointer(
            config=config,
            parts=trainer.parts(),
            reporter=Reporter(_storing_report(root / name), rank=rank, log_every_steps=NEVER),
            hooks=[],
            device=trainer.device,
        )

    writers = {
        "full": other(CheckpointConfig(), "full"),
        "default": other(CheckpointConfig(differential=True), "default"),
        "delta": trainer.checkpointer,
    }
    batches = _Batches(args, distribution, rank, world)
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in writers}
    touched: list[float] = []
    train_seconds = 0.0
    for c in range(count):
        start = time.perf_counter()
        for _ in range(interval):
            trainer.train_step(batches(trainer.step))
        train_seconds += time.perf_counter() - start
        modified = trainer.model.embedding_bags.modified_rows()
        touched.append(_sum(sum(r.numel() for r in modified.values())) / total_rows)
        # The order rotates (the first save after training steps is the slowest); the
        # modified rows stay flagged until all three have saved.
        names = list(writers)
        for name in names[c % 3 :] + names[: c % 3]:
            with _keeping_modified_rows(trainer.model.embedding_bags):
                stored, seconds = _timed_save(writers[name], trainer)
            if rank == 0:
                records[name].append(
                    {
                        "step": trainer.step,
                        "kind": _kind(stored.path),
                        "bytes": _dir_bytes(stored.path),
                        "seconds": seconds,
                    }
                )
            _barrier()
            # The chain needs nothing on disk to go on; keep the first interval's (part 2).
            if rank == 0 and not (
                keep and (name == "delta" or (name == "full" and c == count - 1))
            ):
                shutil.rmtree(stored.path)
            _barrier()
        trainer.model.embedding_bags.clear_modified_rows()
    return {
        "records": records,
        "touched": touched,
        "step_ms": 1000 * train_seconds / (interval * count),
    }


def _table_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    collection = trainer.model.embedding_bags
    out = {f"w.{k}": v.clone() for k, v in collection.local_tables().items()}
    for name, states in collection.optimizer_states().items():
        out.update({f"s.{name}.{i}": s.clone() for i, s in enumerate(states)})
    return out


def _load_times(args: argparse.Namespace, *, rank: int, world: int, root: Path) -> dict[str, Any]:
    """Part 2: ``Trainer.load`` of the kept chain's checkpoints and of the full checkpoint."""
    spec = _spec(
        args, world, hashed=False, differential=True, baseline_fraction=1.0, baseline_every=NEVER
    )
    spec.training.seed = 99
    trainer = _trainer(spec, rank, world, _storing_report(root / "unused"))
    chain = sorted((root / "delta").iterdir())
    full = sorted((root / "full").iterdir())[-1]
    targets = {
        f"baseline + {i} deltas" if i else "baseline alone": chain[i]
        for i in (0, 1, 5, 9)
        if i < len(chain)
    }
    targets[f"full checkpoint (step of delta {len(chain) - 1})"] = full
    out: dict[str, Any] = {"rows": []}
    states = {}
    for label, path in targets.items():
        seconds = []
        for _ in range(args.load_repeats):
            _barrier()
            start = time.perf_counter()
            trainer.load(str(path))
            _barrier()
            seconds.append(time.perf_counter() - start)
        out["rows"].append(
            {
                "what": label,
                "step": trainer.step,
                "kind": _kind(path),
                "chain_bytes": sum(
                    _dir_bytes(p)
                    for p in (chain[: chain.index(path) + 1] if path in chain else [path])
                ),
                "seconds": seconds,
            }
        )
        if path in (chain[-1], full):
            states[path] = _table_state(trainer)
    a, b = states[chain[-1]], states[full]
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out["chain_equals_full"] = bool(_sum(0.0 if same else 1.0) == 0.0)
    return out


def _parts_1_2(rank: int, world: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"part1": {}, "part2": None}
    for distribution in args.distributions:
        for interval, count in zip(args.intervals, args.checkpoints, strict=True):
            keep = distribution == args.distributions[0] and interval == args.intervals[0]
            run_root = root / f"{distribution}-{interval}"
            started = time.perf_counter()
            results["part1"][(distribution, interval)] = _interval_run(
                args,
                rank=rank,
                world=world,
                distribution=distribution,
                interval=interval,
                count=count,
                root=run_root,
                keep=keep,
            )
            results["part1"][(distribution, interval)]["wall"] = time.perf_counter() - started
            if rank == 0:
                print(
                    f"  [part 1] {distribution}, every {interval} steps: "
                    f"{time.perf_counter() - started:.0f} s",
                    flush=True,
                )
            if keep:
                results["part2"] = _load_times(args, rank=rank, world=world, root=run_root)
            if rank == 0:
                shutil.rmtree(run_root, ignore_errors=True)
            _barrier()
    return results


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = _parts_1_2(rank, world, args, Path(root))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def _run_parts_1_2(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    if args.world_size == 1:
        return _parts_1_2(0, 1, args, root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world_size, port, args, str(root), out))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    results = out.get(timeout=3600)
    for p in procs:
        p.join()
    return results


# ---------------------------------------------------------------------------------------------
# Part 3: resumed-run AUC on the synthetic data.


def _eval_logits(trainer: Trainer, batches: list[Batch]) -> torch.Tensor:
    trainer.model.eval()
    with torch.no_grad():
        return torch.cat([trainer.model(b) for b in batches])


def _part_3(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    info = generate_synthetic(
        SyntheticConfig(num_train_rows=args.auc_train_rows, num_eval_rows=50_000, seed=0),
        out_dir=root / "synthetic",
    )
    steps = args.auc_steps
    quarter, half = steps // 4, steps // 2

    def spec(precision: str, seed: int) -> WorkerSpec:
        s = _spec(
            args,
            1,
            hashed=True,
            differential=True,
            baseline_fraction=1.0,
            baseline_every=NEVER,
            embedding_precision=precision,
        )
        s.data.sparse_columns = [f"C{i}" for i in range(1, 27)]
        s.data.dense_columns = [f"I{i}" for i in range(1, 14)]
        s.data.batch_size = args.batch
        s.training.seed = seed
        return s

    base = spec("fp32", 7)
    train = Preprocessor(base.data)(pq.read_table(info.train_path))
    evaluation = Preprocessor(base.data)(pq.read_table(info.eval_path))
    per_epoch = train.num_rows // args.batch
    train_batches = [
        arrow_to_batch(train.slice((s % per_epoch) * args.batch, args.batch), config=base.data)
        for s in range(steps)
    ]
    eval_batches = [
        arrow_to_batch(evaluation.slice(i, 8192), config=base.data)
        for i in range(0, evaluation.num_rows, 8192)
    ]
    labels = torch.cat([b.labels for b in eval_batches])
    out: dict[str, Any] = {
        "planted_auc": info.planted_auc,
        "steps": steps,
        "epochs": steps / per_epoch,
        "rows": [],
    }
    for precision in args.precisions:
        store = root / f"auc-{precision}"
        saving = _trainer(spec(precision, 7), 0, 1, _storing_report(store / "chain"))
        for s in range(steps):
            saving.train_step(train_batches[s])
            if saving.step in (quarter, half):
                stored = saving.checkpointer.save(
                    {}, loop_state=saving.state_dict(), progress=EpochProgress(0)
                )
                if saving.step == half:
                    chain_path = stored.path
                    full_path = str(store / "full")
                    save_training_state(
                        full_path,
                        parts=saving.parts(),
                        loop_state=saving.state_dict(),
                        position=EpochProgress(0).to_dict(),
                    )
        reference = _eval_logits(saving, eval_batches)
        ref_auc = binary_metrics(reference, labels).auc
        for source, path in (("full", full_path), ("delta", chain_path)):
            resumed = _trainer(spec(precision, 99), 0, 1, _storing_report(store / "unused"))
            resumed.load(path)
            assert resumed.step == half, (resumed.step, half)
            for s in range(half, steps):
                resumed.train_step(train_batches[s])
            logits = _eval_logits(resumed, eval_batches)
            out["rows"].append(
                {
                    "precision": precision,
                    "source": f"{source} ({_kind(path)})",
                    "ckpt_bytes": _dir_bytes(path),
                    "uninterrupted_auc": ref_auc,
                    "resumed_auc": binary_metrics(logits, labels).auc,
                    "max_logit_diff": float((logits - reference).abs().max()),
                }
            )
        shutil.rmtree(store, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# Printing


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _print_part_1(args: argparse.Namespace, part1: dict) -> None:
    print()
    print("## Part 1: bytes written per checkpoint and save time, full vs differential")
    print()
    print(
        "full / delta: medians over the run's checkpoints (delta: every checkpoint after the "
        "first baseline, baseline_fraction=inf, baseline_every=1e9: a delta, or a baseline "
        "where a delta would be as large as one). default policy "
        "(baseline_every=10, baseline_fraction=0.5): mean MB per checkpoint over checkpoints "
        "2..n (the first is a baseline under any policy) and how many of those were baselines; "
        "steady state: inferred, the policy's cycle (a baseline, then k deltas while k x delta "
        "<= 0.5 x full, k <= 9) from the medians. rows touched: rows a delta holds / all rows, "
        "median [min, max]."
    )
    print()
    print(
        "| ids | every | ckpts | full MB | delta MB | full/delta | full save s | delta save s "
        "| rows touched | default: MB/ckpt (2..n) | default: baselines in 2..n | default steady "
        "state MB/ckpt (inferred) | step ms |"
    )
    print("|" + "---|" * 13)
    for (distribution, interval), result in part1.items():
        rec = result["records"]
        full_b = _median([r["bytes"] for r in rec["full"]])
        full_s = _median([r["seconds"] for r in rec["full"]])
        # After the first baseline: deltas, or baselines where a delta would be as large.
        deltas = rec["delta"][1:]
        delta_b = _median([r["bytes"] for r in deltas])
        delta_s = _median([r["seconds"] for r in deltas])
        later = rec["default"][1:]
        default_mean = statistics.mean(r["bytes"] for r in later) if later else math.nan
        baselines = sum(r["kind"] == "baseline" for r in later)
        k = min(9, int(0.5 * full_b // delta_b)) if delta_b else 9
        steady = (full_b + k * delta_b) / (k + 1)
        t = result["touched"][1:]
        print(
            f"| {distribution} | {interval} | {len(rec['full'])} | {full_b / MB:.1f} | "
            f"{delta_b / MB:.1f} | {full_b / delta_b:.2f} | {full_s:.2f} | {delta_s:.2f} | "
            f"{_median(t):.3f} [{min(t):.3f}, {max(t):.3f}] | {default_mean / MB:.1f} | "
            f"{baselines} of {len(later)} | {steady / MB:.1f} (k={k}) | "
            f"{result['step_ms']:.1f} |"
        )
    print()
    print("Per checkpoint (MB, kind; save s) of each writer:")
    for (distribution, interval), result in part1.items():
        rec = result["records"]
        for name in ("full", "delta", "default"):
            cells = ", ".join(
                f"{r['bytes'] / MB:.1f} {r['kind'][0]} {r['seconds']:.2f}s" for r in rec[name]
            )
            print(f"- {distribution} every {interval}, {name}: {cells}")


def _print_part_2(args: argparse.Namespace, part2: dict) -> None:
    print()
    print(
        f"## Part 2: resume time (Trainer.load) from a chain, {args.distributions[0]} ids, "
        f"a checkpoint every {args.intervals[0]} steps, {args.world_size} rank(s)"
    )
    print()
    print("| checkpoint loaded | step | kind | MB read (chain) | load s median | load s each |")
    print("|---|---|---|---|---|---|")
    for row in part2["rows"]:
        print(
            f"| {row['what']} | {row['step']} | {row['kind']} | {row['chain_bytes'] / MB:.1f} | "
            f"{_median(row['seconds']):.2f} | "
            f"{', '.join(f'{s:.2f}' for s in row['seconds'])} |"
        )
    print()
    print(
        "Tables and fused optimizer state loaded from the chain equal the full checkpoint's: "
        f"{part2['chain_equals_full']}"
    )


def _print_part_3(part3: dict) -> None:
    print()
    print("## Part 3: resumed-run eval AUC with fp32 / fp16 / int8 checkpoints")
    print()
    print(
        f"{part3['steps']} steps ({part3['epochs']:.2f} epochs), checkpoints at "
        f"{part3['steps'] // 4} (baseline) and {part3['steps'] // 2} (delta, and a full "
        f"checkpoint); resumed at {part3['steps'] // 2}. Planted model's eval AUC "
        f"(ceiling): {part3['planted_auc']:.4f}. Uninterrupted: the saving run of that "
        "precision (one per precision, the same seed: equal AUCs mean saving at a lower "
        "precision leaves the trained weights alone). One process; the resumed trainer has "
        "another seed (everything it continues with comes from the checkpoint)."
    )
    print()
    print(
        "| precision | resumed from | checkpoint MB | uninterrupted AUC | resumed AUC | "
        "resumed - uninterrupted | max abs logit diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in part3["rows"]:
        print(
            f"| {row['precision']} | {row['source']} | {row['ckpt_bytes'] / MB:.1f} | "
            f"{row['uninterrupted_auc']:.6f} | {row['resumed_auc']:.6f} | "
            f"{row['resumed_auc'] - row['uninterrupted_auc']:+.6f} | "
            f"{row['max_logit_diff']:.3g} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=512, help="global batch")
    parser.add_argument("--zipf", type=float, default=1.05, help="power-law exponent")
    parser.add_argument("--distributions", nargs="+", default=["powerlaw", "uniform"])
    parser.add_argument("--intervals", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument(
        "--checkpoints", type=int, nargs="+", default=[10, 4, 3], help="per interval"
    )
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--auc-steps", type=int, default=400)
    parser.add_argument("--auc-train-rows", type=int, default=204_800)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8"])
    parser.add_argument("--world-size", type=int, default=2, choices=[1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument("--skip", nargs="*", default=[], choices=["1", "3"])
    args = parser.parse_args()
    if len(args.intervals) != len(args.checkpoints):
        parser.error("--checkpoints needs one count per interval")
    started = time.perf_counter()
    print(
        f"machine: {os.cpu_count()} CPUs; torch {torch.__version__}; load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"model: {args.tables} tables x {args.rows:,} rows x dim {args.dim} "
        f"({args.tables * args.rows * args.dim * 4 / MB:.0f} MB fp32), row-wise Adagrad, DLRM "
        f"dense side (bottom [64, {args.dim}], top [64, 32], Adam), table-wise, "
        f"{args.world_size} process(es) x 1 thread; global batch {args.batch}, one id per "
        f"table per sample; power law: Zipf exponent {args.zipf} over each table's rows"
    )
    root = Path(args.workdir or tempfile.mkdtemp(prefix="raydlrm-deltabench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"storage and staging: {root} and {tempfile.gettempdir()}", flush=True)
    try:
        if "1" not in args.skip:
            results = _run_parts_1_2(args, root)
            _print_part_1(args, results["part1"])
            if results["part2"] is not None:
                _print_part_2(args, results["part2"])
        if "3" not in args.skip:
            _print_part_3(_part_3(args, root))
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"total wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
