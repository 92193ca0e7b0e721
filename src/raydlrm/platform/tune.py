"""Hyperparameter sweeps: Ray Tune over whole training jobs (``raydlrm tune``, :func:`tune`).

A sweep is one Tune experiment whose trials are training jobs (:func:`raydlrm.train`, each with
its own Ray Train run, workers and MLflow run) that differ in the config keys of the search
space (``[tune.search]``, ``--search``: a dotted key and a distribution, see
:mod:`raydlrm.platform.search_space`). Before any trial starts, the driver checks every key and
the values at the ends of its range against the config (one error naming the key), plans the
job once (:func:`raydlrm.platform.planning.plan_job`: data, plan, tracking), and computes the
dense statistics, bucket boundaries, id kinds and auto towers that every trial then reuses
(unless the search changes what they are computed from: then each trial computes its own).
Trials report ``tune.metric`` to Tune at each evaluation (``training.eval_every_steps``, or
on the validation set ``training.valid_every_steps``) and at the end; ASHA stops those that
trail. With a validation set (``data.valid_path``, ``data.valid_split``) the default metric is
``valid/auc``: the best trial is chosen on validation (with ``training.early_stopping``, each
trial's best checkpoint) and its ``eval/*`` metrics score it on held-out data it was not chosen
on; a failing trial
(an invalid combination, a diverging run) is recorded with its reason and the sweep goes on.

In MLflow the sweep is a parent run (its search space, the best trial's values and metrics, the
summary of all trials) and every trial a child run; the best trial's model is registered as
``tracking.registered_model_name``. Run again with the same ``run.name`` and storage, a sweep
that was interrupted continues (Tune's experiment restore): finished trials are kept and the
rest run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydlrm._text import text_table
from raydlrm.platform.config import ConfigError, JobConfig, load_config, replaced
from raydlrm.platform.search_space import (
    Dimension,
    check_space,
    num_samples,
    override,
    parse_search,
)
from raydlrm.trainers.evaluation import EVAL_STEP, VALID_STEP

__all__ = ["TuneResult", "check_trial_fits", "tune"]

logger = logging.getLogger(__name__)

RUN_ID = "raydlrm/run_id"
MODEL_URI = "raydlrm/model_uri"


@dataclass
class TuneResult:
    """What a sweep produced."""

    best_config: dict[str, Any]
    """The best trial's values of the searched keys."""
    best_metrics: dict[str, float]
    """The best trial's final metrics."""
    trials: list[dict[str, Any]] = field(default_factory=list)
    """Every trial: ``trial``, ``status`` (``done``, ``stopped early``, ``failed: ...``), its
    values, the metric and the evaluations reported."""
    run_id: str = ""
    """The sweep's MLflow (parent) run."""
    best_run_id: str | None = None
    """The best trial's MLflow (child) run."""
    model_uri: str | None = None
    """The best trial's logged model."""
    registered_model_version: str | None = None
    """The version the best model was registered as (None: not registered)."""
    summary: str = ""
    """A table of the trials and the best config, as ``raydlrm tune`` prints it."""


def tune(
    config: str | Path | dict[str, Any] | JobConfig | None = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    search: Sequence[str] = (),
    num_trials: int | None = None,
) -> TuneResult:
    """Runs a sweep (see the module): the job of ``config`` and ``overrides``, searched over
    ``[tune.search]`` and ``search`` (``key=distribution`` strings, which win), ``num_trials``
    (default ``tune.num_trials``).

    Raises:
        ConfigError: an invalid config or search space, before any trial starts.
        DataValidationError: missing or malformed data, before any trial starts.
    """
    from raydlrm._logs import configure_api, quiet_libraries

    job = load_config(config, overrides=overrides)
    if num_trials is not None:
        job = replaced(job, tune=replaced(job.tune, num_trials=num_trials))
    if job.tune.metric is None:  # on validation where there is a validation set
        name = f"ndcg_at_{min(job.model.retrieval_k)}" if job.model.retrieval else "auc"
        metric = f"valid/{name}" if job.data.has_validation() else f"eval/{name}"
        job = replaced(job, tune=replaced(job.tune, metric=metric))
    space = {**parse_search(job.tune.search), **parse_search(list(search))}
    if not space:
        raise ConfigError("nothing to search: give --search key=distribution or [tune.search]")
    check_space(job, space)
    configure_api()
    quiet_libraries()
    sweep = job.run.name or f"tune-{time.strftime('%Y%m%d-%H%M%S')}"
    job = _prepared(job, sweep, space)
    from raydlrm.platform.ray_init import init_ray
    from raydlrm.platform.tracking import start_run

    init_ray(job)
    import ray

    from raydlrm.platform.ray_init import ray_address

    check_trial_fits(job, space, cluster=ray.cluster_resources(), local=ray_address(job) == "local")
    parent = start_run(job, run_name=sweep, run_key=f"tune:{job.run.storage_path}/{sweep}")
    try:
        parent.log_params({f"tune.search.{k}": f"{d.kind}{d.values}" for k, d in space.items()})
        grid = _fit(job, space, sweep=sweep, parent_run_id=parent.run_id)
        result = _outcome(job, grid, space=space, parent=parent, sweep=sweep)
    except BaseException:
        parent.finish(failed=True)
        raise
    parent.finish()
    return result


def check_trial_fits(
    job: JobConfig, space: Mapping[str, Dimension], *, cluster: Mapping[str, float], local: bool
) -> None:
    """Checks that the cluster's resources (``cluster``, as ``ray.cluster_resources()``) hold
    one trial's workers: ``scaling.num_workers`` (its largest searched value) times
    ``scaling.resources_per_worker``, and a GPU each with ``scaling.use_gpu``.

    Raises:
        ConfigError: a local cluster (``local``) lacks a resource, naming the keys and both
            amounts. A remote cluster only gets a warning: an autoscaler may add nodes.
    """
    workers = job.scaling.num_workers
    searched = space.get("scaling.num_workers")
    if searched is not None:  # its largest value (randint's upper end is excluded)
        workers = max(workers, *(int(v) for v in searched.corners()))
    need = {k: workers * float(v) for k, v in job.scaling.resources_per_worker.items()}
    if job.scaling.use_gpu:
        need["GPU"] = need.get("GPU", 0.0) + workers
    keys = {
        k: "scaling.use_gpu" if k == "GPU" else f"scaling.resources_per_worker.{k}" for k in need
    }
    short = [
        f"{workers} workers x {need[k] / workers:g} {k} = {need[k]:g} {k} (scaling.num_workers, "
        f"{keys[k]}), the cluster has {cluster.get(k, 0.0):g}"
        for k in need
        if need[k] > cluster.get(k, 0.0) + 1e-9
    ]
    if not short:
        return
    message = f"one trial does not fit the cluster: {'; '.join(short)}"
    if local:
        raise ConfigError(message)
    logger.warning("%s (waiting for an autoscaler to add nodes)", message)


_STATISTICS_KEYS = (
    "data.train_path",
    "data.partitions",
    "data.dense_columns",
    "data.dense_transform",
    "data.dense_fill",
    "data.dense_specs",
    "data.dense_buckets",
)
"""Keys whose value decides the dense statistics, fill values or bucket boundaries of the
training data."""


def _prepared(job: JobConfig, sweep: str, space: Mapping[str, Dimension]) -> JobConfig:
    """The checks of a training job, once for the sweep: its data, plan, storage and tracking;
    returns the job with the dense statistics, fill values, bucket boundaries and id kinds
    every trial reuses (the statistics only when the search leaves what they depend on
    alone)."""
    from raydlrm.platform.planning import plan_job

    _check_searchable(job, space)
    # The trials share the sweep's towers and statistics, unless the search changes them.
    planned = plan_job(job, run_name=sweep)
    if job.tune.scheduler == "asha" and not job.training.eval_every_steps:
        logger.warning(
            "tune.scheduler = 'asha' stops trials on %s at each evaluation, and "
            "training.eval_every_steps is 0: trials evaluate only at the end, none stops early",
            job.tune.metric,
        )
    prepared = planned.job
    if any(key.startswith(_STATISTICS_KEYS) for key in space):
        data = replaced(
            prepared.data,
            dense_stats=job.data.dense_stats,
            dense_fill_values=job.data.dense_fill_values,
            bucket_boundaries=job.data.bucket_boundaries,
        )
        prepared = replaced(prepared, data=data)
    if job.model.towers == "auto" and space:
        # The warm-up trains the flat model with the trial's settings, and the towers it finds
        # follow from them (model.num_towers, the steps, the rates, the features): each trial
        # resolves its own.
        prepared = replaced(prepared, model=replaced(prepared.model, towers="auto"))
    return prepared


_GLOBAL_BATCH_KEYS = ("data.batch_size", "scaling.num_workers")
"""Keys whose value decides the global batch, which a learned cost model is trained at."""


def _check_searchable(job: JobConfig, space: Mapping[str, Dimension]) -> None:
    """Refuses a search that the job's settings would make fail trial by trial.

    Raises:
        ConfigError: ``sharding.cost_model = "neural"`` (a learned model trained at one global
            batch) with a search over the batch size or the workers, naming both keys.
    """
    searched = [key for key in _GLOBAL_BATCH_KEYS if key in space]
    if job.sharding.cost_model == "neural" and searched:
        raise ConfigError(
            f"sharding.cost_model = 'neural' with a search over {', '.join(searched)}: the "
            "learned cost model at sharding.learned_cost_path holds for one global batch "
            "(data.batch_size x scaling.num_workers), so every trial but one would fail; set "
            "sharding.cost_model = 'auto' (the analytic model where it does not hold) or fix "
            f"{' and '.join(searched)}"
        )


def _concurrency(job: JobConfig) -> int:
    """``tune.max_concurrent_trials``, or as many trials as the cluster's CPUs fit: a trial's
    workers' CPUs plus one for its input pipeline."""
    import ray

    if job.tune.max_concurrent_trials:
        return job.tune.max_concurrent_trials
    per_worker = float(job.scaling.resources_per_worker.get("CPU", 1.0))
    per_trial = job.scaling.num_workers * per_worker + 1.0
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    return max(1, math.floor(cpus / per_trial))


def _fit(job: JobConfig, space: Mapping[str, Dimension], *, sweep: str, parent_run_id: str):
    """Tune's experiment of the sweep (restored when an earlier one of the same name is in
    the run storage); returns its result grid."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    from raydlrm.platform.preflight import run_storage

    cfg = job.tune
    base = job.to_dict()
    base["tracking"] |= {"parent_run_id": parent_run_id, "registered_model_name": None}
    base["run"] |= {"progress": "off"}  # one progress line a trial would interleave
    trainable = tune.with_resources(
        tune.with_parameters(_trial, base=base, sweep=sweep, metric=cfg.metric),
        {"CPU": 0.01},  # the trial's driver; its workers and data pipeline ask for their own
    )
    storage, filesystem = run_storage(job)
    path = f"{storage.rstrip('/')}/{sweep}"
    if tune.Tuner.can_restore(path, storage_filesystem=filesystem):
        logger.info("continuing the sweep in %s", path)
        tuner = tune.Tuner.restore(
            path, trainable=trainable, storage_filesystem=filesystem, restart_errored=False
        )
        return tuner.fit()
    scheduler = (
        ASHAScheduler(grace_period=cfg.grace_period, reduction_factor=cfg.reduction_factor)
        if cfg.scheduler == "asha"
        else FIFOScheduler()
    )
    tuner = tune.Tuner(
        trainable,
        param_space={key: dim.domain() for key, dim in space.items()},
        tune_config=tune.TuneConfig(
            metric=cfg.metric,
            mode=cfg.mode,
            num_samples=num_samples(cfg.num_trials, space),
            scheduler=scheduler,
            # The limit goes to the search algorithm: Tune ignores max_concurrent_trials (with a
            # warning) when given a BasicVariantGenerator, and every trial would start at once.
            search_alg=BasicVariantGenerator(
                random_state=cfg.seed, max_concurrent=_concurrency(job)
            ),
        ),
        run_config=tune.RunConfig(
            name=sweep,
            storage_path=storage,
            storage_filesystem=filesystem,
            failure_config=tune.FailureConfig(fail_fast=False),
            verbose=0,
        ),
    )
    return tuner.fit()


def _trial(params: dict[str, Any], *, base: dict[str, Any], sweep: str, metric: str) -> None:
    """One trial: the sweep's job with ``params``, trained as a child run; its evaluations
    reported to Tune as they come, its final metrics and model at the end."""
    from ray import tune

    from raydlrm.platform.launch import train

    trial = tune.get_context().get_trial_id()
    overrides = [override(k, v) for k, v in params.items()]
    overrides.append(override("run.name", f"{sweep}-{trial}"))
    result = train(base, overrides=overrides, callbacks=[_evaluation_reports(metric)])
    final = {k: v for k, v in result.metrics.items() if isinstance(v, int | float)}
    stopping = load_config(base, overrides=overrides).training.stopping()
    if stopping is not None and stopping.metric == metric and "early_stopping/best" in final:
        # The trial's model is its best checkpoint: ranked by that, not the last evaluation.
        final[metric] = final["early_stopping/best"]
    tune.report({**final, RUN_ID: result.run_id, MODEL_URI: result.model_uri})


def _evaluation_reports(metric: str) -> Any:
    """A Ray Train callback that passes a trial's reports to Tune at each evaluation: a report
    whose ``metric`` comes from an evaluation not passed yet (by its step, ``eval/step`` or
    ``valid/step``; the reports in between carry the last one). Keyed by the step, not the
    value: a trial whose metric repeats exactly (a collapsed model's AUC of 0.5) still reaches
    ASHA's rungs."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class EvaluationReports(TuneReportCallback):
        def __init__(self) -> None:
            super().__init__()
            self.last: Any = None

        def after_report(self, run_context, metrics, checkpoint) -> None:
            report = metrics[0]
            step = report.get(VALID_STEP if metric.startswith("valid/") else EVAL_STEP)
            if report.get(metric) is None or step is None or step == self.last:
                return
            self.last = step
            super().after_report(run_context, metrics, None)

    return EvaluationReports()


def _status(result: Any) -> str:
    if result.error is not None:
        reason = str(result.error).strip().splitlines()
        return f"failed: {reason[-1] if reason else type(result.error).__name__}"
    return "done" if MODEL_URI in (result.metrics or {}) else "stopped early"


def _outcome(
    job: JobConfig, grid: Any, *, space: Mapping[str, Dimension], parent: Any, sweep: str
) -> TuneResult:
    """The trials' table, the best trial registered and logged to the parent run; the runs of
    trials stopped early marked killed."""
    cfg = job.tune
    trials = []
    for result in grid:
        metrics = result.metrics or {}
        trials.append(
            {
                "trial": metrics.get("trial_id", Path(result.path or "?").name),
                "status": _status(result),
                **{k: (result.config or {}).get(k) for k in space},
                cfg.metric: metrics.get(cfg.metric),
                "evaluations": metrics.get("training_iteration", 0),
                RUN_ID: metrics.get(RUN_ID),
                MODEL_URI: metrics.get(MODEL_URI),
            }
        )
    stopped = {f"{sweep}-{t['trial']}" for t in trials if t["status"] == "stopped early"}
    _close_stopped_runs(parent, stopped)
    done = [t for t in trials if t["status"] == "done" and t[cfg.metric] is not None]
    if not done:
        summary = _table(trials, space, cfg.metric)
        raise RuntimeError(f"no trial of the sweep finished:\n{summary}")
    sign = 1 if cfg.mode == "max" else -1
    best = max(done, key=lambda t: sign * t[cfg.metric])
    best_metrics = {
        k: v
        for k, v in (grid[trials.index(best)].metrics or {}).items()
        if "/" in k and isinstance(v, int | float)
    }
    result = TuneResult(
        best_config={k: best[k] for k in space},
        best_metrics=best_metrics,
        trials=trials,
        run_id=parent.run_id,
        best_run_id=best[RUN_ID],
        model_uri=best[MODEL_URI],
    )
    _record_best(job, result, parent)
    result.summary = _table(trials, space, cfg.metric) + "\n" + _best_line(result, cfg.metric)
    parent.log_text(result.summary, artifact_file="tune/summary.txt")
    parent.log_text(json.dumps(trials, indent=2, default=str), artifact_file="tune/trials.json")
    return result


def _record_best(job: JobConfig, result: TuneResult, parent: Any) -> None:
    """The best trial's values and metrics on the parent run, its model registered."""
    from raydlrm.platform.export import register_version

    parent.log_params({f"best.{k}": v for k, v in result.best_config.items()})
    parent.log_metrics(result.best_metrics, step=0)
    tags = parent.client.get_run(parent.run_id).data.tags
    name = job.tracking.registered_model_name
    if tags.get("raydlrm.tune.best_run_id") == result.best_run_id:  # a finished sweep again
        result.registered_model_version = tags.get("raydlrm.tune.registered_version")
    elif name and result.model_uri:
        version = register_version(
            result.model_uri,
            name,
            run_id=str(result.best_run_id),
            tags={"raydlrm.tune.run_id": parent.run_id},
            client=parent.client,
        )
        result.registered_model_version = str(version)
    parent.set_tags(
        {
            "raydlrm.tune.best_run_id": str(result.best_run_id),
            **(
                {"raydlrm.tune.registered_version": result.registered_model_version}
                if result.registered_model_version
                else {}
            ),
        }
    )


def _close_stopped_runs(parent: Any, stopped: set[str]) -> None:
    """Marks killed the child runs of the trials ASHA stopped (run names ``stopped``; their
    job ended as failed when its trial was stopped) and those left running (a trial process
    that died)."""
    client = parent.client
    runs = client.search_runs(
        [parent.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'"
    )
    for run in runs:
        if run.data.tags.get("raydlrm.run_name") in stopped:
            client.set_tag(run.info.run_id, "raydlrm.tune.stopped_early", "true")
            client.set_terminated(run.info.run_id, status="KILLED")
        elif run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, status="KILLED")


def _table(trials: list[dict[str, Any]], space: Mapping[str, Dimension], metric: str) -> str:
    header = ["trial", *space, metric, "evaluations", "status"]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    rows = [[cell(t.get(h)) for h in header] for t in trials]
    return "\n".join(text_table(header, rows))


def _best_line(result: TuneResult, metric: str) -> str:
    values = ", ".join(f"{k}={v!r}" for k, v in result.best_config.items())
    registered = (
        f"; registered as version {result.registered_model_version}"
        if result.registered_model_version
        else ""
    )
    return (
        f"best: {values} ({metric} {result.best_metrics.get(metric, float('nan')):.4f}; "
        f"run {result.best_run_id}{registered})"
    )
