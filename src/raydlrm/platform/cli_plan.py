"""``raydlrm plan``: the sharding plan of a config as a dry run (no Ray, no process group),
first measuring the cost-model constants (``--calibrate``), collecting cost samples
(``--collect``) or training the learned cost model (``--train-cost-model``) when asked."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from raydlrm.platform._cli_common import ConfigOption, SetOption, app, fail
from raydlrm.platform.config import ConfigError, load_config

if TYPE_CHECKING:
    from raydlrm.platform.config import JobConfig
    from raydlrm.sharding import ShardingPlan

# `plan` prints one line per rank up to this many ranks, a summary beyond.
_MAX_RANK_LINES = 32


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
        fail(str(e))
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

    from raydlrm.sharding.planner.learned_cost import collect_samples, save_samples

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
        from raydlrm.sharding.planner.comm_samples import collect_comm_samples

        comm = collect_comm_samples(
            n, world_size=workers, batch_size=job.global_batch_size(), seed=time.time_ns() % 2**32
        )
        path = path.with_name(path.name.replace(f"{kernel}-", f"comm-w{workers}-", 1))
        pq.write_table(comm, path)
        typer.echo(f"{n} all-to-all samples ({workers} ranks) written to {path}", err=True)


def _train_cost_model(job: JobConfig) -> None:
    """Trains the learned cost model on the job's samples (``plan --train-cost-model``)."""
    from raydlrm.sharding.kernel import resolve_kernel
    from raydlrm.sharding.planner.comm_samples import stored_comm_samples
    from raydlrm.sharding.planner.learned_cost import stored_samples, train_cost_model

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
    from raydlrm.platform.planning import plan_job

    planned = plan_job(job, run_name=None)
    if planned.data is None:
        typer.echo(
            f"no training data at {planned.job.data.train_path} yet: every bag counted as one id",
            err=True,
        )
    elif job.model.towers == "auto":
        for i, features in enumerate(planned.job.model.towers):
            typer.echo(f"tower{i} (auto): {', '.join(features)}", err=True)
    return planned.plan
