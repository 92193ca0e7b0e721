"""``raydlrm checkpoint``: show, verify or unshard a training-state checkpoint, and
``checkpoint_dir``, which finds the checkpoint a command was given (a remote one downloaded
first, a run directory's newest intact one)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from raydlrm.platform._cli_common import EXIT_FAILED, checkpoint_app, fail

CheckpointArg = Annotated[
    str,
    typer.Argument(
        help="A checkpoint directory (runs/<run>/checkpoint_...), with trainer_state.json; a run "
        "directory (runs/<run>: its newest intact checkpoint); or an s3:// URI (endpoint, "
        "region and credentials from the AWS_* environment variables)."
    ),
]


@contextlib.contextmanager
def checkpoint_dir(checkpoint: str, *, model_dir_ok: bool = False) -> Iterator[Path]:
    """A local directory holding ``checkpoint`` (downloaded first when it is remote); for a
    local run directory (``runs/<run>``), its newest intact checkpoint, said on stderr. Stops
    with one line when there is none, or ``checkpoint`` is not a checkpoint directory (an
    exported model directory also passes with ``model_dir_ok``)."""
    from raydlrm.storage import StorageConfig, StorageError
    from raydlrm.trainers.checkpoints import STATE_FILE, local_checkpoint
    from raydlrm.trainers.model_dir import SPEC_FILE

    with contextlib.ExitStack() as stack:
        try:
            directory = stack.enter_context(local_checkpoint(checkpoint, StorageConfig()))
        except (StorageError, FileNotFoundError) as e:
            fail(f"checkpoint {e}")
        if (directory / STATE_FILE).is_file() or (
            model_dir_ok and (directory / SPEC_FILE).is_file()
        ):
            yield directory
            return
        newest = _newest_checkpoint(directory) if directory.is_dir() else None
        if newest is None:
            fail(_no_checkpoint(checkpoint, directory))
        typer.echo(f"{checkpoint}: using its newest intact checkpoint {newest}", err=True)
        yield newest


def _no_checkpoint(given: str, directory: Path) -> str:
    """Why ``directory`` (the command's argument ``given``) yields no checkpoint, and what to
    do: it is no run's directory, or its run has checkpoints but none intact, or none yet."""
    import pyarrow.fs as pafs

    from raydlrm.platform.run_lock import LOCK_FILE
    from raydlrm.platform.run_snapshot import SNAPSHOT_FILE
    from raydlrm.trainers.checkpoints import STATE_FILE, checkpoint_names, resume_blocker
    from raydlrm.trainers.hooks import PROGRESS_FILE

    local = pafs.LocalFileSystem()
    names = checkpoint_names(local, str(directory)) if directory.is_dir() else []
    if names:
        return (
            f"run {given} has {len(names)} checkpoints, none intact: "
            f"{resume_blocker(str(directory), local) or 'each is damaged'}"
        )
    run_files = (LOCK_FILE, PROGRESS_FILE, SNAPSHOT_FILE)
    if not directory.is_dir() or not any((directory / n).exists() for n in run_files):
        return (
            f"{given} is not a checkpoint directory (it holds no {STATE_FILE}) and holds no "
            "run's files: give a checkpoint directory runs/<run>/checkpoint_<time>/, or a run "
            "directory runs/<run> for its newest intact checkpoint"
        )
    return f"run {given} has no checkpoint: {_why_no_checkpoint(directory)}"


def _why_no_checkpoint(run: Path) -> str:
    """What the run directory ``run`` tells of why its run has no checkpoint (its lock: a job
    that still runs, or died; its progress: how far it trained), and what to do."""
    import time

    import pyarrow.fs as pafs

    from raydlrm.platform.run_lock import RunLock
    from raydlrm.trainers.hooks import PROGRESS_FILE

    now = time.time()
    holder = RunLock(pafs.LocalFileSystem(), str(run), run_name=run.name).read()
    if holder is not None and not holder.is_stale(now):
        return (
            f"its job still runs ({holder.describe(now)}) and has written none yet: export it "
            "once it has (every checkpoint.every_steps steps or checkpoint.every_minutes "
            "minutes, and at the end of the run)"
        )
    try:
        progress = json.loads((run / PROGRESS_FILE).read_text())
        trained = (
            f"it trained {progress['step']} steps ({progress['samples']:,} samples, last "
            f"progress {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(progress['time']))})"
        )
    except (OSError, ValueError, KeyError, TypeError):
        trained = "it recorded no training step"
    ended = "its job ended" if holder is None else f"its job died ({holder.describe(now)})"
    return (
        f"{ended} before its first checkpoint, {trained}; a run writes one every "
        "checkpoint.every_steps steps or checkpoint.every_minutes minutes (both 0 by default: "
        "only at its end). Submit the run again to train it (it starts over), with "
        "checkpoint.every_steps or checkpoint.every_minutes set to keep a failed run's work"
    )


def _newest_checkpoint(run: Path) -> Path | None:
    """The newest intact ``checkpoint_*`` directory of a run directory (by Ray's time-stamped
    names), or None."""
    import pyarrow.fs as pafs

    from raydlrm.trainers.checkpoints import newest_intact_path

    path = newest_intact_path(pafs.LocalFileSystem(), str(run))
    return None if path is None else Path(path)


@checkpoint_app.command("show")
def checkpoint_show(checkpoint: CheckpointArg) -> None:
    """Print a checkpoint's step, epoch, world size, plan summary, data position, its place in
    a chain of differential checkpoints, and whether its files (and its chain's) match their
    manifests (sizes; `checkpoint verify` also checks the checksums)."""
    from raydlrm.sharding import ShardingPlan
    from raydlrm.trainers.checkpoints import (
        CheckpointDamagedError,
        read_state_file,
        verify_checkpoint,
    )

    try:
        with checkpoint_dir(checkpoint) as directory:
            state = read_state_file(directory)
            problems = verify_checkpoint(directory, checksums=False)
    except (FileNotFoundError, CheckpointDamagedError) as e:
        fail(str(e))
    if problems:
        typer.echo(f"DAMAGED: {'; '.join(problems)}")
    plan = ShardingPlan.from_json(json.dumps(state["plan"]))
    position = state["position"]
    typer.echo(
        f"step {state['step']}, epoch {state['epoch']}, {state['samples_seen']} samples seen, "
        f"written by {state['world_size']} workers"
    )
    typer.echo(
        f"data position: {sum(position['consumed'].values())} rows of epoch "
        f"{position['epoch']} trained, in {len(position['consumed'])} row groups"
    )
    link = state.get("differential")
    if link and link["kind"] == "delta":
        typer.echo(
            f"differential: delta {len(link['chain'])} of the chain of baseline "
            f"{link['chain'][0]} (read with {', '.join(link['chain'][1:]) or 'no other delta'})"
        )
    elif link:
        typer.echo("differential: a baseline (full)")
    precisions = sorted(set(state.get("saved_precisions", {}).values()))
    if precisions:
        typer.echo(f"tables saved in {', '.join(precisions)}")
    typer.echo(plan.format_summary())


@checkpoint_app.command("verify")
def checkpoint_verify(checkpoint: CheckpointArg) -> None:
    """Check a checkpoint against its manifests: every rank's part present, every file with
    its size and CRC-32. Exit 0 when intact, 1 (naming each problem) when damaged."""
    from raydlrm.trainers.checkpoints import verify_checkpoint

    try:
        with checkpoint_dir(checkpoint) as directory:
            problems = verify_checkpoint(directory)
    except FileNotFoundError as e:
        fail(str(e))
    if problems:
        for problem in problems:
            typer.echo(f"damaged: {problem}")
        fail(f"checkpoint {checkpoint} is damaged ({len(problems)} problems)", code=EXIT_FAILED)
    typer.echo(f"checkpoint {checkpoint} is intact")


@checkpoint_app.command("unshard")
def checkpoint_unshard(
    checkpoint: CheckpointArg,
    output: Annotated[Path, typer.Argument(help="Where to write the weights (.safetensors).")],
) -> None:
    """Assemble the sharded tables into one tensor per table, plus the dense model, into a
    safetensors file (one table in memory at a time): the unsharded model's state dict, usable
    without raydlrm (safetensors.torch.load_file, memory-mappable, no pickle)."""
    from raydlrm.trainers.model_dir import ModelWeights, write_model_weights

    try:
        with checkpoint_dir(checkpoint) as directory:
            write_model_weights(directory, output)
            names = [t.name for t in ModelWeights(directory).tensors]
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    # A table is one weight, or a quantized table's codes, qparams and blocks.
    tables = len({k.split(".")[2] for k in names if k.startswith("embedding_bags.")})
    dense = sum(1 for k in names if not k.startswith("embedding_bags."))
    typer.echo(f"wrote {output}: {tables} tables, {dense} dense tensors")
