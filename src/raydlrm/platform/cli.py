"""The ``raydlrm`` command line (also ``python -m raydlrm``): the run commands (``train``,
``tune``, ``score``, ``evaluate``, ``retrain``, ``export``) and the console entry point. The
other commands live beside it: ``plan`` in ``cli_plan``, ``data`` and ``config`` in
``cli_data``, ``checkpoint`` in ``cli_checkpoint``; the apps, options and error handling they
share in ``_cli_common``.

Exit codes: 0 success; 2 bad input (config, data, usage), stopped before training started;
1 a failure during the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from raydlrm.platform._cli_common import (
    EXIT_FAILED,
    ConfigOption,
    SetOption,
    VerboseOption,
    app,
    bad_input_errors,
    fail,
    run_failed,
    setup_logging,
)
from raydlrm.platform.cli_checkpoint import checkpoint_dir
from raydlrm.platform.config import ConfigError, load_config

if TYPE_CHECKING:
    from raydlrm.platform.config import JobConfig

__all__ = ["app", "main"]


@app.command()
def train(
    config: ConfigOption = None, set_: SetOption = None, verbose: VerboseOption = False
) -> None:
    """Train a model: data -> sharded training on Ray -> MLflow run and registered model."""
    setup_logging(verbose)
    job = _job(config, set_)
    from raydlrm.platform.launch import train as run_training
    from raydlrm.platform.summary import print_summary

    try:
        with _ray_ends_first():
            result = run_training(job)
    except bad_input_errors() as e:
        fail(str(e))
    except Exception as e:
        run_failed(e, "training")
    print_summary(result)


@app.command()
def tune(
    config: ConfigOption = None,
    set_: SetOption = None,
    search: Annotated[
        list[str] | None,
        typer.Option(
            "--search",
            metavar="KEY=DIST",
            help="A config key and its distribution: choice(a, b), grid(a, b), uniform(lo, hi), "
            "loguniform(lo, hi), randint(lo, hi); repeat for more keys (adds to [tune.search]).",
        ),
    ] = None,
    trials: Annotated[
        int | None, typer.Option("--trials", help="Trials to run (default: tune.num_trials).")
    ] = None,
    verbose: VerboseOption = False,
) -> None:
    """Sweep hyperparameters: Ray Tune over training jobs, early stopping (ASHA), MLflow child
    runs under one parent, the best model registered; run again with the same run.name to
    continue an interrupted sweep."""
    setup_logging(verbose)
    job = _job(config, set_)
    from raydlrm.platform.tune import tune as run_sweep

    try:
        with _ray_ends_first():
            result = run_sweep(job, search=search or [], num_trials=trials)
    except bad_input_errors() as e:
        fail(str(e))
    except Exception as e:
        run_failed(e, "the sweep")
    typer.echo(result.summary)


def _job(config: Path | None, overrides: list[str] | None) -> JobConfig:
    """The validated config, read before torch, Ray and MLflow are imported (seconds): a typo
    stops the command at once with one line."""
    try:
        return load_config(config, overrides=overrides or [])
    except ConfigError as e:
        fail(str(e))


@contextlib.contextmanager
def _ray_ends_first() -> Iterator[None]:
    """Disconnects from (and so stops a local) Ray that the command itself started, before the
    command prints its result: the workers' output reaches the screen through Ray's log
    monitor, seconds late (a worker's last lines are flushed when its process exits), and
    would otherwise land after the summary. What was not printed yet stays in Ray's log files.
    A Ray the caller had already initialized (a notebook, a test session) is left running."""
    import ray

    started_here = not ray.is_initialized()
    try:
        yield
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()


ModelArg = Annotated[
    str,
    typer.Argument(
        help="An MLflow model URI (models:/name@champion, models:/name/3, runs:/<id>/model; "
        "tracking server from MLFLOW_TRACKING_URI) or a model checkpoint directory."
    ),
]
DataArg = Annotated[
    str, typer.Argument(help="A Parquet file or directory, local or s3:// (AWS_* variables).")
]
BatchSizeOption = Annotated[int, typer.Option("--batch-size", help="Rows per scoring batch.")]
ActorsOption = Annotated[
    int, typer.Option("--num-actors", help="The most scoring actors (each holds the model).")
]


@app.command()
def score(
    model: ModelArg,
    data: DataArg,
    output: Annotated[str, typer.Argument(help="Directory for the prediction Parquet files.")],
    keep: Annotated[
        list[str] | None,
        typer.Option(
            "--keep",
            help="Input column to copy next to `prediction` (repeatable; default: sample_id "
            "and the label, those present).",
        ),
    ] = None,
    batch_size: BatchSizeOption = 4096,
    num_actors: ActorsOption = 2,
    verbose: VerboseOption = False,
) -> None:
    """Score every row of a Parquet data set with a trained model (Ray Data), writing
    Parquet with the kept columns and `prediction` (click probability)."""
    setup_logging(verbose)
    from raydlrm.platform.scoring import score as run_scoring

    try:
        result = run_scoring(
            model, data, output, keep=keep or None, batch_size=batch_size, num_actors=num_actors
        )
    except (*bad_input_errors(), ValueError) as e:
        fail(str(e))
    typer.echo(f"scored {result.rows} rows in {result.seconds:.1f}s: {result.output}")
    _echo_unknown_ids(result.unknown_ids)


@app.command()
def evaluate(
    model: ModelArg,
    data: DataArg,
    output: Annotated[
        str | None, typer.Option("--output", help="Also write the predictions here.")
    ] = None,
    batch_size: BatchSizeOption = 4096,
    num_actors: ActorsOption = 2,
    verbose: VerboseOption = False,
) -> None:
    """Evaluate a trained model on a labelled Parquet data set: AUC and log loss."""
    setup_logging(verbose)
    from raydlrm.platform.scoring import evaluate as run_evaluation

    try:
        result = run_evaluation(
            model, data, output=output, batch_size=batch_size, num_actors=num_actors
        )
    except (*bad_input_errors(), ValueError) as e:
        fail(str(e))
    typer.echo(json.dumps(result.metrics, sort_keys=True))
    _echo_unknown_ids(result.unknown_ids)


def _echo_unknown_ids(counts: dict[str, int]) -> None:
    """The lookups of ids a managed table's map does not hold (scoring and evaluation)."""
    if counts:
        listed = ", ".join(f"{t} {n:,}" for t, n in sorted(counts.items()))
        typer.echo(f"ids unknown to managed tables (read their bucket's fallback row): {listed}")


@app.command()
def retrain(
    config: ConfigOption = None,
    set_: SetOption = None,
    slot: Annotated[
        str | None,
        typer.Option(
            "--slot",
            help="The partition value (of retrain.partition_key, e.g. a date) to retrain for; "
            "its partition and the ones before are used. Default: the newest partition.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    verbose: VerboseOption = False,
) -> None:
    """Scheduled retraining for one slot: train on the newest partitions warm-started from the
    registry's champion, evaluate both on the held-out partition, register the new version and
    move the champion alias only if it is better (else it is the challenger). A slot already
    retrained is not trained again. Exit 1 (champion untouched) when the new model has
    non-finite weights or regresses beyond retrain.max_regression."""
    setup_logging(verbose)
    job = _job(config, set_)
    from raydlrm.platform.retrain import RetrainError
    from raydlrm.platform.retrain import retrain as run_retrain
    from raydlrm.storage import StorageError

    try:
        with _ray_ends_first():
            result = run_retrain(job, slot=slot)
    except (*bad_input_errors(), StorageError) as e:
        fail(str(e))
    except RetrainError as e:
        fail(f"retrain rejected, champion unchanged: {e}", code=EXIT_FAILED)
    except Exception as e:
        run_failed(e, "retrain (champion unchanged)")
    if as_json:
        # Not asdict(): it would deep-copy the training result (plan included) to drop it.
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        del fields["train"]
        typer.echo(json.dumps(fields, indent=2, default=str))
        return
    if result.skipped:
        typer.echo(
            f"slot {result.slot} was already retrained: {result.model_name} version "
            f"{result.version} ({result.decision}); nothing trained"
        )
        return
    if result.champion_version is None:
        start = "from scratch (no champion yet)"
    elif result.from_scratch:
        start = "from scratch (retrain.warm_start is off)"
    else:
        start = f"warm-started from version {result.champion_version}"
    typer.echo(
        f"{result.model_name} version {result.version} trained {start} on "
        f"{result.train_partitions}, held out {result.holdout_partitions}: "
        f"{result.decision} ({result.reason})"
    )


MaxRowsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--max-rows",
        help="TABLE=ROWS: cut a managed table to ROWS rows, keeping its most recent (or --keep "
        "frequent) ids; repeatable (default: data.managed_ids.<table>.export_rows).",
    ),
]
KeepOption = Annotated[
    str | None, typer.Option("--keep", help="The ids a cut table keeps: recent or frequent.")
]
SinceOption = Annotated[
    str | None,
    typer.Option(
        "--since",
        help="An earlier exported model of the same tables: write only the rows (and id-map "
        "entries) changed since it, and the dense part, to --output.",
    ),
]


def _row_caps(items: list[str]) -> dict[str, int]:
    """``--max-rows TABLE=ROWS`` items as a dict."""
    caps = {}
    for item in items:
        table, _, rows = item.partition("=")
        if not rows.isdigit():
            fail(f"--max-rows {item!r}: give TABLE=ROWS")
        caps[table] = int(rows)
    return caps


@app.command()
def export(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="A checkpoint directory (runs/<run>/checkpoint_...) or an s3:// URI (AWS_* "
            "variables)."
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write a self-contained MLflow model directory."),
    ] = None,
    register: Annotated[
        str | None,
        typer.Option("--register", help="Log the model on a new MLflow run, register it."),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option("--data", help="Data for the signature's example rows (default: config's)."),
    ] = None,
    max_rows: MaxRowsOption = None,
    keep: KeepOption = None,
    since: SinceOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Export a checkpoint's model, unsharded, as an MLflow pyfunc model that scores raw rows
    without Ray (to a directory and/or the registry)."""
    setup_logging(verbose)
    from raydlrm.platform.export import export_model

    if output is None and register is None:
        fail("give --output DIR and/or --register NAME")
    if keep not in (None, "recent", "frequent"):
        fail(f"--keep must be recent or frequent, got {keep!r}")
    caps = _row_caps(max_rows or [])
    try:
        with checkpoint_dir(checkpoint, model_dir_ok=True) as directory:
            out = export_model(
                directory,
                output=output,
                registered_model_name=register,
                example_path=data,
                max_rows=caps,
                keep=keep,
                since=since,
            )
    except (*bad_input_errors(), ValueError) as e:
        fail(str(e))
    for key in ("path", "model_uri", "run_id", "rows"):
        if key in out:
            typer.echo(f"{key}: {out[key]}")
    if "version" in out:
        typer.echo(f"registered: {register} version {out['version']}")


def main() -> None:
    """Console entry point."""
    app()


# The other command modules register their commands when imported: here, after the run
# commands, since `raydlrm --help` lists the commands in the order they were registered.
from raydlrm.platform import cli_data, cli_plan  # noqa: E402, F401
