"""The ``raydlrm`` command line (also ``python -m raydlrm``).

Exit codes: 0 success; 2 bad input (config, data, usage), stopped before training started;
1 a failure during the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from raydlrm._errors import cause_line
from raydlrm._logs import configure_driver
from raydlrm.platform.config import ConfigError, load_config
from raydlrm.storage import is_remote, redact

if TYPE_CHECKING:
    from raydlrm.platform.config import JobConfig
    from raydlrm.sharding import ShardingPlan

app = typer.Typer(
    help="Train deep-learning recommendation models (DLRMs) on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(
    help="Data sets: generate synthetic data, inspect a data set, cluster it by session (RecD).",
    no_args_is_help=True,
)
config_app = typer.Typer(
    help="Run configs: show or validate the resolved config.", no_args_is_help=True
)
checkpoint_app = typer.Typer(
    help="Training-state checkpoints: inspect one, or unshard it into a plain state dict.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")
app.add_typer(config_app, name="config")
app.add_typer(checkpoint_app, name="checkpoint")

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
# `plan` prints one line per rank up to this many ranks, a summary beyond.
_MAX_RANK_LINES = 32

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML run file (defaults if omitted).")
]
VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Show the workers' and libraries' INFO lines too (RAYDLRM_LOG_LEVEL=DEBUG).",
    ),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key: section.key=value (repeatable)."),
]


def _setup_logging(verbose: bool = False) -> None:
    try:
        configure_driver(verbose=verbose)
    except ValueError as e:
        _fail(str(e))


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _run_failed(exc: BaseException, what: str) -> None:
    """Logs the whole error, then stops with one line and exit code 1."""
    logging.getLogger("raydlrm").error("%s failed", what, exc_info=exc)
    _fail(f"{what} failed: {cause_line(exc)}", code=EXIT_FAILED)


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from raydlrm.ingestion import DataValidationError

    return (ConfigError, DataValidationError, FileNotFoundError)


@app.command()
def train(
    config: ConfigOption = None, set_: SetOption = None, verbose: VerboseOption = False
) -> None:
    """Train a model: data -> sharded training on Ray -> MLflow run and registered model."""
    _setup_logging(verbose)
    job = _job(config, set_)
    from raydlrm.platform.launch import train as run_training
    from raydlrm.platform.summary import print_summary

    try:
        with _ray_ends_first():
            result = run_training(job)
    except _bad_input_errors() as e:
        _fail(str(e))
    except Exception as e:
        _run_failed(e, "training")
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
    _setup_logging(verbose)
    job = _job(config, set_)
    from raydlrm.platform.tune import tune as run_sweep

    try:
        with _ray_ends_first():
            result = run_sweep(job, search=search or [], num_trials=trials)
    except _bad_input_errors() as e:
        _fail(str(e))
    except Exception as e:
        _run_failed(e, "the sweep")
    typer.echo(result.summary)


def _job(config: Path | None, overrides: list[str] | None) -> JobConfig:
    """The validated config, read before torch, Ray and MLflow are imported (seconds): a typo
    stops the command at once with one line."""
    try:
        return load_config(config, overrides=overrides or [])
    except ConfigError as e:
        _fail(str(e))


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
    _setup_logging(verbose)
    from raydlrm.platform.scoring import score as run_scoring

    try:
        result = run_scoring(
            model, data, output, keep=keep or None, batch_size=batch_size, num_actors=num_actors
        )
    except (*_bad_input_errors(), ValueError) as e:
        _fail(str(e))
    typer.echo(f"scored {result.rows} rows in {result.seconds:.1f}s: {result.output}")


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
    _setup_logging(verbose)
    from raydlrm.platform.scoring import evaluate as run_evaluation

    try:
        result = run_evaluation(
            model, data, output=output, batch_size=batch_size, num_actors=num_actors
        )
    except (*_bad_input_errors(), ValueError) as e:
        _fail(str(e))
    typer.echo(json.dumps(result.metrics, sort_keys=True))


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
    _setup_logging(verbose)
    job = _job(config, set_)
    from raydlrm.platform.retrain import RetrainError
    from raydlrm.platform.retrain import retrain as run_retrain
    from raydlrm.storage import StorageError

    try:
        with _ray_ends_first():
            result = run_retrain(job, slot=slot)
    except (*_bad_input_errors(), StorageError) as e:
        _fail(str(e))
    except RetrainError as e:
        _fail(f"retrain rejected, champion unchanged: {e}", code=EXIT_FAILED)
    except Exception as e:
        _run_failed(e, "retrain (champion unchanged)")
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
    verbose: VerboseOption = False,
) -> None:
    """Export a checkpoint's model, unsharded, as an MLflow pyfunc model that scores raw rows
    without Ray (to a directory and/or the registry)."""
    _setup_logging(verbose)
    from raydlrm.platform.export import export_model

    if output is None and register is None:
        _fail("give --output DIR and/or --register NAME")
    try:
        with _checkpoint_dir(checkpoint, model_dir_ok=True) as directory:
            out = export_model(
                directory, output=output, registered_model_name=register, example_path=data
            )
    except (*_bad_input_errors(), ValueError) as e:
        _fail(str(e))
    for key in ("path", "model_uri", "run_id"):
        if key in out:
            typer.echo(f"{key}: {out[key]}")
    if "version" in out:
        typer.echo(f"registered: {register} version {out['version']}")


@app.command()
def plan(
    config: ConfigOption = None,
    set_: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="First measure the cost-model constants on this machine (TBE lookups of "
            "sharding.kernel, on its GPU with scaling.use_gpu; gloo "
            "all-to-all, random page reads and write-backs of the SSD tier in "
            "sharding.ssd_path) and store them at sharding.cost_constants_path.",
        ),
    ] = False,
    collect: Annotated[
        int,
        typer.Option(
            "--collect",
            metavar="N",
            help="First measure N random sets of synthetic tables (fused TBE forward + "
            "backward of sharding.kernel, data.batch_size x scaling.num_workers bags a table; "
            "on this machine's GPU with scaling.use_gpu) "
            "and N all-to-alls of "
            "random dim-sum layouts on scaling.num_workers gloo processes, and add them to the "
            "cost samples in sharding.cost_samples_path.",
        ),
    ] = 0,
    train_cost_model: Annotated[
        bool,
        typer.Option(
            "--train-cost-model",
            help="Then train the learned cost model on the cost samples of sharding.kernel, "
            "store it at sharding.learned_cost_path and print its held-out error beside the "
            "analytic model's.",
        ),
    ] = False,
) -> None:
    """Print the sharding plan of a config (a dry run: no Ray, no process group). Like
    training, it reads the training data's first rows for the tables' pooling factors and the
    dedup groups' samples per unique row, when the data is there."""
    try:
        job = load_config(config, overrides=set_ or [])
        if calibrate:
            _calibrate(job)
        if collect:
            _collect_cost_samples(job, collect)
        if train_cost_model:
            _train_cost_model(job)
        sharding_plan = _dry_plan(job)
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    if as_json:
        typer.echo(sharding_plan.to_json())
    elif sharding_plan.world_size > _MAX_RANK_LINES:
        typer.echo(sharding_plan.format_summary())
    else:
        typer.echo(sharding_plan.format_table())


def _calibrate(job: JobConfig) -> None:
    """Measures the cost-model constants and stores them (``raydlrm plan --calibrate``)."""
    from raydlrm.sharding import calibrate as measure
    from raydlrm.sharding import save_constants
    from raydlrm.sharding.tiers import ssd_directory

    device = job.table_device()
    if device == "cuda":
        typer.echo(
            "GPU workers: lookups timed on this machine's GPU; the all-to-all is not (gloo "
            "here does not time NCCL between GPUs): its constants stay the defaults",
            err=True,
        )
    constants = measure(
        ssd_directory=ssd_directory(job.sharding.ssd_path),
        kernel=job.sharding.kernel,
        device=device,
        comm=device == "cpu",
    )
    path = save_constants(constants, job.sharding.cost_constants_path)
    typer.echo(f"cost constants ({constants.source}) written to {path}:", err=True)
    typer.echo(
        f"  lookups {constants.lookup_bytes_per_s:.3g} B/s, comm "
        f"{constants.comm_bytes_per_s:.3g} B/s, latency "
        f"{constants.collective_latency_s:.3g} s, ssd rows "
        f"{constants.ssd_row_reads_per_s:.3g} reads/s, "
        f"{constants.ssd_row_writes_per_s:.3g} write-backs/s",
        err=True,
    )


def _collect_cost_samples(job: JobConfig, n: int) -> None:
    """Measures ``n`` cost samples and adds them to the job's samples (``plan --collect``)."""
    import pyarrow.parquet as pq

    from raydlrm.sharding.learned_cost import collect_samples, save_samples

    def progress(done: int, total: int) -> None:
        if done == total or done % 50 == 0:
            typer.echo(f"cost samples: {done}/{total} measured", err=True)

    samples = collect_samples(
        n,
        kernel=job.sharding.kernel,
        batch_size=job.global_batch_size(),
        progress=progress,
        seed=time.time_ns() % 2**32,
        device=job.table_device(),
    )
    path = save_samples(samples, job.sharding.cost_samples_path)
    kernel = samples.column("kernel")[0].as_py()
    typer.echo(f"{samples.num_rows} cost samples ({kernel} kernel) written to {path}", err=True)
    workers = job.scaling.num_workers
    if workers > 1 and job.table_device() == "cuda":
        typer.echo(
            "no all-to-all samples for GPU workers (gloo here does not time NCCL between "
            "GPUs): the plan costs their transfer analytically",
            err=True,
        )
    elif workers > 1:  # the all-to-all of as many gloo processes here as the job has workers
        from raydlrm.sharding.comm_samples import collect_comm_samples

        comm = collect_comm_samples(
            n, world_size=workers, batch_size=job.global_batch_size(), seed=time.time_ns() % 2**32
        )
        path = path.with_name(path.name.replace(f"{kernel}-", f"comm-w{workers}-", 1))
        pq.write_table(comm, path)
        typer.echo(f"{n} all-to-all samples ({workers} ranks) written to {path}", err=True)


def _train_cost_model(job: JobConfig) -> None:
    """Trains the learned cost model on the job's samples (``plan --train-cost-model``)."""
    from raydlrm.sharding.comm_samples import stored_comm_samples
    from raydlrm.sharding.kernel import resolve_kernel
    from raydlrm.sharding.learned_cost import stored_samples, train_cost_model

    kernel, store, batch = (
        resolve_kernel(job.sharding.kernel),
        job.sharding.cost_samples_path,
        job.global_batch_size(),
    )
    device = job.table_device()
    samples = stored_samples(store, kernel=kernel, batch_size=batch, device=device)
    # The all-to-all samples are gloo's: a model for GPU workers has none (costed analytically).
    comm = stored_comm_samples(store, batch_size=batch) if device == "cpu" else None
    model = train_cost_model(samples, comm_samples=comm)
    path = model.save(job.sharding.learned_cost_path)
    r = model.report
    typer.echo(
        f"learned cost model ({kernel} kernel on {model.device}, {int(r['train_samples'])} "
        f"samples) written to "
        f"{path}; held-out error ({int(r['held_out_samples'])} sets): learned "
        f"{r['neural_mape']:.1%}, analytic {r['analytic_mape']:.1%} (mean absolute percentage)",
        err=True,
    )
    if model.comm is None:
        typer.echo("no all-to-all samples: the plan costs transfer analytically", err=True)
    else:
        typer.echo(
            f"all-to-all model ({model.comm.world_sizes} ranks, "
            f"{int(r['comm_train_layouts'])} layouts): held-out error {r['comm_mape']:.1%}",
            err=True,
        )


def _dry_plan(job: JobConfig) -> ShardingPlan:
    """The plan that training would make of ``job``: with the pooling factors and dedup
    ratios of the training data's first rows when the data is there."""
    from raydlrm.platform.preflight import (
        data_shape,
        make_plan,
        resolve_dedup_groups,
        resolve_paths,
        resolve_towers,
        validate_job_data,
    )

    shape = None
    job = resolve_paths(job)
    if is_remote(job.data.train_path) or Path(job.data.train_path).exists():
        data = validate_job_data(job)
        job = resolve_dedup_groups(job, data)
        shape = data_shape(job, data)
        auto = job.model.towers == "auto"
        job = resolve_towers(job, data, shape, run_name=None)
        if auto:
            for i, features in enumerate(job.model.towers):
                typer.echo(f"tower{i} (auto): {', '.join(features)}", err=True)
    else:
        typer.echo(
            f"no training data at {job.data.train_path} yet: every bag counted as one id",
            err=True,
        )
    return make_plan(job, shape=shape)


@data_app.command("generate")
def data_generate(
    config: ConfigOption = None,
    set_: SetOption = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Output directory (train/ and eval/ inside). "
            "Default: the parent of data.train_path."
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing data set.")] = False,
) -> None:
    """Generate the synthetic Criteo-shaped data set the config's data.synthetic section
    describes."""
    _setup_logging()
    from raydlrm.ingestion import SyntheticConfig, generate_synthetic
    from raydlrm.ingestion.synthetic import SyntheticDataExistsError

    try:
        job = load_config(config, overrides=set_ or [])
    except ConfigError as e:
        _fail(str(e))
    synthetic = job.data.synthetic or SyntheticConfig()
    target = out or Path(job.data.train_path).parent
    try:
        info = generate_synthetic(synthetic, out_dir=target, overwrite=overwrite)
    except SyntheticDataExistsError as e:
        _fail(f"{e.out_dir} holds {e.what}: --overwrite replaces it")
    rows = f"{info.num_train_rows} train and {info.num_eval_rows} eval rows"
    auc = f"planted-model eval AUC {info.planted_auc:.4f}"
    if info.kept:
        typer.echo(f"{target} already holds this data set ({rows}, {auc}): kept, nothing written")
    else:
        typer.echo(f"wrote {rows} to {target} ({auc})")


@data_app.command("inspect")
def data_inspect(
    config: ConfigOption = None,
    set_: SetOption = None,
    path: Annotated[
        str | None,
        typer.Option("--path", help="The data set to inspect (default: data.train_path)."),
    ] = None,
    max_rows: Annotated[
        int, typer.Option("--max-rows", help="Rows read for the column statistics.")
    ] = 200_000,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Inspect a data set through the config: files, rows, schema, bad rows, id cardinalities
    and table use per sparse column, dedup ratio per dedup group, what the file order is
    correlated with (runs of ids, label drift, time)."""
    from raydlrm.ingestion.inspect import inspect_data

    try:
        job = load_config(config, overrides=set_ or [])
        report = inspect_data(path or job.data.train_path, job.data, max_rows=max_rows)
    except _bad_input_errors() as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(
        f"{report['path']}: {report['rows']} rows in {report['files']} files "
        f"({report['row_groups']} row groups); label rate {report['label_rate']:.4f}; "
        f"{report['bad_rows_in_sample']} bad of {report['sampled_rows']} rows read"
    )
    for column, c in report["sparse"].items():
        typer.echo(
            f"  {column:<12} table {c['table']:<12} distinct ids {c['distinct_ids']:>9}  "
            f"table rows used {c['table_rows_used']:>9}/{c['table_size']:<9} "
            f"mean length {c['mean_length']:.2f}  nulls {c['nulls']}"
        )
    for column, c in report["dense"].items():
        if c["nulls"] or c["non_finite"]:
            typer.echo(
                f"  {column:<12} nulls {c['nulls']} ({c['missing_share']:.1%} missing)  "
                f"non-finite {c['non_finite']}"
            )
    for c in report["dense"].values():
        if c["flag"]:
            typer.echo(f"  warning: {c['flag']}")
    for group in report["dedup"]:
        typer.echo(f"  dedup {'+'.join(group['columns'])}: ratio {group['ratio']:.2f}")
    r = report["recd"]
    typer.echo(
        f"  recd: {r['layout']} layout; dedup factor {r['dedup_factor']:.2f} over all sparse "
        f"features; user features {'+'.join(r['user_columns']) or 'none'} "
        f"({r['user_columns_from']}) {r['user_lookup_share']:.1%} of lookups"
    )
    typer.echo("  file order:" + ("" if report["file_order"] else " no order found"))
    for finding in report["file_order"]:
        typer.echo(f"    {finding['kind']} {finding['message']}")


@config_app.command("show")
def config_show(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Print the fully resolved config (after overrides) as JSON."""
    try:
        job = load_config(config, overrides=set_ or [])
    except ConfigError as e:
        _fail(str(e))
    typer.echo(json.dumps(redact(job.to_dict()), indent=2))


@config_app.command("validate")
def config_validate(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Check a config; exit 2 with the offending key if it is invalid."""
    try:
        load_config(config, overrides=set_ or [])
    except ConfigError as e:
        _fail(str(e))
    typer.echo("config is valid")


CheckpointArg = Annotated[
    str,
    typer.Argument(
        help="A checkpoint directory (runs/<run>/checkpoint_...), with trainer_state.json; a run "
        "directory (runs/<run>: its newest intact checkpoint); or an s3:// URI (endpoint, "
        "region and credentials from the AWS_* environment variables)."
    ),
]


@contextlib.contextmanager
def _checkpoint_dir(checkpoint: str, *, model_dir_ok: bool = False) -> Iterator[Path]:
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
            _fail(f"checkpoint {e}")
        if (directory / STATE_FILE).is_file() or (
            model_dir_ok and (directory / SPEC_FILE).is_file()
        ):
            yield directory
            return
        newest = _newest_checkpoint(directory) if directory.is_dir() else None
        if newest is None:
            _fail(
                f"{checkpoint} is not a checkpoint directory (it holds no {STATE_FILE}): give "
                "runs/<run>/checkpoint_<time>/, or the run directory runs/<run> for its newest "
                "intact checkpoint"
            )
        typer.echo(f"{checkpoint}: using its newest intact checkpoint {newest}", err=True)
        yield newest


def _newest_checkpoint(run: Path) -> Path | None:
    """The newest intact ``checkpoint_*`` directory of a run directory (by Ray's time-stamped
    names), or None."""
    from raydlrm.trainers.checkpoints import verify_checkpoint

    candidates = sorted((p for p in run.glob("checkpoint_*") if p.is_dir()), reverse=True)
    return next((p for p in candidates if not verify_checkpoint(p, checksums=False)), None)


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
        with _checkpoint_dir(checkpoint) as directory:
            state = read_state_file(directory)
            problems = verify_checkpoint(directory, checksums=False)
    except (FileNotFoundError, CheckpointDamagedError) as e:
        _fail(str(e))
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
        with _checkpoint_dir(checkpoint) as directory:
            problems = verify_checkpoint(directory)
    except FileNotFoundError as e:
        _fail(str(e))
    if problems:
        for problem in problems:
            typer.echo(f"damaged: {problem}")
        _fail(f"checkpoint {checkpoint} is damaged ({len(problems)} problems)", code=EXIT_FAILED)
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
        with _checkpoint_dir(checkpoint) as directory:
            write_model_weights(directory, output)
            names = [t.name for t in ModelWeights(directory).tensors]
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    # A table is one weight, or a quantized table's codes, qparams and blocks.
    tables = len({k.split(".")[2] for k in names if k.startswith("embedding_bags.")})
    dense = sum(1 for k in names if not k.startswith("embedding_bags."))
    typer.echo(f"wrote {output}: {tables} tables, {dense} dense tensors")


def main() -> None:
    """Console entry point."""
    app()


@data_app.command("cluster")
def data_cluster(
    out: Annotated[str, typer.Option("--out", help="Directory of the clustered data set.")],
    config: ConfigOption = None,
    set_: SetOption = None,
    path: Annotated[
        str | None,
        typer.Option("--path", help="The sample-level data set (default: data.train_path)."),
    ] = None,
    columns: Annotated[
        list[str] | None,
        typer.Option(
            "--column",
            help="A sparse column to store once per session (repeatable; default: the "
            "data.dedup_groups columns, else those constant within sessions).",
        ),
    ] = None,
) -> None:
    """Convert a sample-level data set to the session-clustered layout (RecD): the user
    features once per session beside the samples, partitions kept; checks that each session
    is contiguous and each user column constant within it (data.bad_input = "quarantine"
    sets such sessions aside)."""
    _setup_logging()
    from raydlrm.ingestion.clustering import cluster_data

    try:
        job = load_config(config, overrides=set_ or [])
        result = cluster_data(
            path or job.data.train_path, job.data, out=out, session_columns=columns or None
        )
    except (*_bad_input_errors(), FileExistsError, ValueError) as e:
        _fail(str(e))
    ratio = result.source_bytes / max(1, result.clustered_bytes)
    typer.echo(
        f"wrote {result.num_samples} samples and {result.num_sessions} session rows "
        f"({'+'.join(result.session_columns)} once per session) in {result.num_files} files to "
        f"{result.out}; {result.source_bytes:,} -> {result.clustered_bytes:,} bytes "
        f"({ratio:.2f}x smaller)"
    )
    if result.quarantined_sessions:
        typer.echo(
            f"set aside {result.quarantined_sessions} sessions ({result.quarantined_samples} "
            "samples) whose user columns differ within the session"
        )
