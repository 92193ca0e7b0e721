"""Scheduled retraining: newest partitions in, a registered model out, the champion moved only
when the new model is better.

``raydlrm retrain`` (and :func:`retrain`) run one schedule slot:

1. The slot is a value of the hive partition key ``retrain.partition_key`` of
   ``data.train_path`` (e.g. a day): ``--slot``, or the newest partition. The newest
   ``retrain.holdout_partitions`` partitions up to the slot are held out; the
   ``retrain.train_partitions`` before them are trained on.
2. A slot already retrained (a registered version tagged with it) is not trained again: the
   call reports that version's decision and finishes what a crash may have left undone (moving
   the alias).
3. The version holding the ``champion`` alias is the warm start: its run's training-state
   checkpoint (weights and optimizer states, resharded to this job's workers). With no champion
   the model trains from scratch, and says so.
4. The job trains (under a run name of its own per slot, so a killed retrain resumes exactly
   where it stopped when started again), then the new model and the champion are both scored
   on the held-out partitions by the same Ray Data scoring job.
5. Guards: a new model with non-finite weights or metrics, or worse than the champion by more
   than ``retrain.max_regression``, is an error; it is not registered and the champion stays.
6. The new model is registered, tagged with the slot, the decision and its reason; it takes the
   ``champion`` alias if it beats the champion by more than ``retrain.min_improvement``, else
   the ``challenger`` alias.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from raydlrm.platform.config import (
    ConfigError,
    JobConfig,
    RetrainConfig,
    default_tracking_uri,
    load_config,
)
from raydlrm.platform.export import register_version
from raydlrm.platform.job_data import prepare_data
from raydlrm.platform.launch import TrainResult
from raydlrm.platform.launch import train as run_training
from raydlrm.platform.preflight import resolve_paths
from raydlrm.platform.scoring import ModelFiles, evaluate, model_files
from raydlrm.platform.tracking import TAG_CHECKPOINT, check_tracking_of
from raydlrm.storage import PartitionSelector, StorageError, partition_values
from raydlrm.trainers.model_dir import ModelWeights

__all__ = [
    "Judgement",
    "RetrainError",
    "RetrainResult",
    "decide",
    "non_finite_tensors",
    "retrain",
]

logger = logging.getLogger(__name__)

TAG_SLOT = "raydlrm.retrain.slot"
TAG_DECISION = "raydlrm.retrain.decision"
TAG_REASON = "raydlrm.retrain.reason"
TAG_CHAMPION = "raydlrm.retrain.previous_champion"
CHAMPION, CHALLENGER = "champion", "challenger"
_METRIC_PREFIX = "retrain/"  # new/auc is logged as retrain/new_auc


class RetrainError(RuntimeError):
    """A retrained model that must not be registered (non-finite, regressed), or a champion
    that cannot be warm-started from; the champion is left as it was."""


@dataclass
class RetrainResult:
    """What one retraining slot did."""

    slot: str
    """The schedule slot (a partition value)."""
    model_name: str
    version: str
    """The registered version of this slot."""
    decision: str
    """``champion`` (it took the champion alias) or ``challenger``."""
    reason: str
    """Why, in words (the metrics and the margin)."""
    skipped: bool = False
    """True when the slot had already been retrained: nothing was trained this time."""
    from_scratch: bool = False
    """True when there was no champion to warm-start from (or ``retrain.warm_start`` is off)."""
    champion_version: str | None = None
    """The champion when the slot was decided (None: there was none)."""
    train_partitions: list[str] = field(default_factory=list)
    holdout_partitions: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """``new/<metric>`` and ``champion/<metric>`` on the held-out partitions."""
    run_id: str | None = None
    """The training job's MLflow run."""
    train: TrainResult | None = field(default=None, repr=False)


def _split(values: list[str], slot: str, config: RetrainConfig, key: str) -> tuple[list, list]:
    """The training and held-out partitions of ``slot``."""
    index = values.index(slot)
    needed = config.train_partitions + config.holdout_partitions
    if index + 1 < needed:
        raise StorageError(
            f"retrain: slot {key}={slot} needs {needed} partitions up to it "
            f"({config.train_partitions} to train on, {config.holdout_partitions} held out), "
            f"found {index + 1}: {values[: index + 1]}"
        )
    holdout = values[index + 1 - config.holdout_partitions : index + 1]
    train = values[index + 1 - needed : index + 1 - config.holdout_partitions]
    return train, holdout


def decide(new: float, champion: float | None, config: RetrainConfig) -> tuple[str, str]:
    """The decision (``champion`` or ``challenger``) and its reason for a new model's held-out
    ``config.metric`` against the champion's.

    Raises:
        RetrainError: a non-finite metric, or a regression beyond ``config.max_regression``.
    """
    metric = config.metric
    if not math.isfinite(new):
        raise RetrainError(f"the new model's held-out {metric} is {new}")
    if champion is None:
        return CHAMPION, f"no champion before: the new model ({metric} {new:.6f}) becomes it"
    # Positive: the new model is better.
    gain = champion - new if metric == "log_loss" else new - champion
    compared = f"{metric} {new:.6f} vs champion {champion:.6f} ({gain:+.6f})"
    if not math.isfinite(champion):
        return CHAMPION, f"{compared}: the champion's held-out {metric} is not finite"
    if -gain > config.max_regression:
        raise RetrainError(
            f"the new model regressed beyond retrain.max_regression={config.max_regression}: "
            f"{compared}"
        )
    if gain > config.min_improvement:
        return CHAMPION, f"{compared} beats retrain.min_improvement={config.min_improvement}"
    return CHALLENGER, f"{compared} does not beat retrain.min_improvement={config.min_improvement}"


def non_finite_tensors(files: ModelFiles) -> list[str]:
    """The names of a model's weights (from :func:`model_files`) that hold NaN or infinite
    values; one tensor in memory at a time."""
    return sorted(
        name
        for name, tensor in ModelWeights(files.directory).items()
        if tensor.is_floating_point() and not bool(tensor.isfinite().all())
    )


def _slot_version(client: MlflowClient, name: str, slot: str) -> Any | None:
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    done = [v for v in versions if v.tags.get(TAG_SLOT) == slot]
    return max(done, key=lambda v: int(v.version)) if done else None


def _alias_version(client: MlflowClient, name: str, alias: str) -> Any | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def _finish_slot(
    client: MlflowClient, name: str, version: Any, config: RetrainConfig
) -> RetrainResult:
    """The result of a slot retrained before; moves the champion alias to it when its decision
    was recorded but the alias move was lost (a crash in between), unless another version took
    the alias since."""
    decision = version.tags.get(TAG_DECISION, CHALLENGER)
    previous = version.tags.get(TAG_CHAMPION) or None
    if decision == CHAMPION:
        current = _alias_version(client, name, config.champion_alias)
        current_version = None if current is None else str(current.version)
        if current_version == previous and current_version != str(version.version):
            client.set_registered_model_alias(name, config.champion_alias, version.version)
            logger.info("moved %s to version %s (left undone)", config.champion_alias, version)
    # DEBUG: the caller reports the result (the CLI prints it once).
    logger.debug(
        "slot %s=%s was already retrained: version %s (%s); nothing to train",
        config.partition_key,
        version.tags[TAG_SLOT],
        version.version,
        decision,
    )
    logged = client.get_run(version.run_id).data.metrics
    return RetrainResult(
        slot=version.tags[TAG_SLOT],
        model_name=name,
        version=str(version.version),
        decision=decision,
        reason=version.tags.get(TAG_REASON, ""),
        skipped=True,
        champion_version=previous,
        # The held-out metrics the decision was made on, as _record logged them.
        metrics={
            key.removeprefix(_METRIC_PREFIX).replace("_", "/", 1): value
            for key, value in logged.items()
            if key.startswith(_METRIC_PREFIX)
        },
        run_id=version.run_id,
    )


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


@dataclass(frozen=True)
class _Slot:
    """The schedule slot to retrain and its partitions."""

    value: str
    train: list[str]
    holdout: list[str]


@dataclass(frozen=True)
class Judgement:
    """A retrained model judged against the champion on the held-out partitions."""

    decision: str
    """``champion`` or ``challenger``."""
    reason: str
    metrics: dict[str, float]
    """``new/<metric>`` and ``champion/<metric>``."""


def _retrain_job(
    config: str | Path | dict[str, Any] | JobConfig | None, overrides: list[str] | tuple[str, ...]
) -> JobConfig:
    """The job config a retraining runs, its metric checked against the model (a ranking
    metric for a retrieval model, a click one otherwise).

    Raises:
        ConfigError: naming the mismatch.
    """
    job = resolve_paths(load_config(config, overrides=overrides))
    try:
        job.check_retrain_metric()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return job


def retrain(
    config: str | Path | dict[str, Any] | JobConfig | None = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    slot: str | None = None,
) -> RetrainResult:
    """Retrains for one schedule slot (see the module docstring).

    Args:
        config: a TOML path, a dict of sections, a :class:`JobConfig`, or None (defaults).
        overrides: ``section.key=value`` strings applied on top of ``config``.
        slot: the partition value to retrain for (default: the newest partition).

    Returns:
        The slot's registered version, its decision and reason, the held-out metrics.

    Raises:
        ConfigError: no registered model name, or a bad config.
        StorageError: the data has no such partition, or not enough partitions.
        RetrainError: the new model failed a guard, or the champion has no checkpoint.
    """
    job = _retrain_job(config, overrides)
    name = job.tracking.registered_model_name
    if not name:
        raise ConfigError("retrain needs tracking.registered_model_name (the champion's model)")
    chosen = _pick_slot(job, slot)
    check_tracking_of(job)
    tracking_uri = default_tracking_uri(job.tracking)
    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri)
    done = _slot_version(client, name, chosen.value)
    if done is not None:
        return _finish_slot(client, name, done, job.retrain)
    champion = _alias_version(client, name, job.retrain.champion_alias)
    warm_start = _champion_warm_start(client, job, champion)
    trained = run_training(_slot_job(job, chosen, warm_start=warm_start, tracking_uri=tracking_uri))
    try:
        judged = _judge(trained, job=job, champion=champion, slot=chosen)
    except RetrainError as exc:
        rejected = {TAG_SLOT: chosen.value, TAG_DECISION: "rejected"}
        _tag(client, trained.run_id, tags=rejected, reason=str(exc))
        raise
    version = _record(client, trained, judged, job=job, slot=chosen, champion=champion)
    return RetrainResult(
        slot=chosen.value,
        model_name=name,
        version=str(version),
        decision=judged.decision,
        reason=judged.reason,
        from_scratch=warm_start is None,
        champion_version=None if champion is None else str(champion.version),
        train_partitions=list(chosen.train),
        holdout_partitions=list(chosen.holdout),
        metrics=judged.metrics,
        run_id=trained.run_id,
        train=trained,
    )


def _pick_slot(job: JobConfig, slot: str | None) -> _Slot:
    """The slot (default: the newest partition) and its training and held-out partitions.

    Raises:
        StorageError: no such partition, or too few before it.
    """
    key = job.retrain.partition_key
    prepare_data(job)
    values = partition_values(job.data.train_path, job.data.storage, key)
    value = slot if slot is not None else values[-1]
    if value not in values:
        raise StorageError(
            f"retrain: partition {key}={value} does not exist under {job.data.train_path}; "
            f"partitions: {values}"
        )
    train, holdout = _split(values, value, job.retrain, key)
    return _Slot(value=value, train=train, holdout=holdout)


def _champion_warm_start(client: MlflowClient, job: JobConfig, champion: Any | None) -> str | None:
    """The champion's training checkpoint to warm-start from (None: from scratch, said why).

    Raises:
        RetrainError: the champion's run records no checkpoint.
    """
    cfg, name = job.retrain, job.tracking.registered_model_name
    if champion is None:
        logger.warning(
            "model %s has no %s version: training from scratch", name, cfg.champion_alias
        )
        return None
    if not cfg.warm_start:
        logger.info("retrain.warm_start is off: training from scratch")
        return None
    warm_start = client.get_run(champion.run_id).data.tags.get(TAG_CHECKPOINT)
    if warm_start is None:
        raise RetrainError(
            f"the {cfg.champion_alias} version {champion.version} of {name} (run "
            f"{champion.run_id}) records no training checkpoint ({TAG_CHECKPOINT} tag) to "
            "warm-start from; set retrain.warm_start=false to train from scratch"
        )
    logger.info(
        "warm start from %s version %s: %s", cfg.champion_alias, champion.version, warm_start
    )
    return warm_start


def _slot_job(
    job: JobConfig, slot: _Slot, *, warm_start: str | None, tracking_uri: str
) -> JobConfig:
    """The training job of a slot: its partitions, a run name of its own (a retrain killed
    mid-way resumes from its checkpoints), the warm start; registered later, by the guards."""
    key = job.retrain.partition_key
    name = job.tracking.registered_model_name
    logger.info(
        "retraining %s for %s=%s: train on %s, hold out %s",
        name,
        key,
        slot.value,
        slot.train,
        slot.holdout,
    )
    return dataclasses.replace(
        job,
        data=dataclasses.replace(
            job.data,
            partitions={key: PartitionSelector(values=list(slot.train))},
            data_date=_date_of(slot.train[-1]) or job.data.data_date,
            eval_path=job.data.train_path,
            eval_partitions={key: PartitionSelector(values=list(slot.holdout))},
        ),
        run=dataclasses.replace(
            job.run,
            name=f"{job.run.name or 'retrain'}-{_safe(name or '')}-{_safe(slot.value)}",
            warm_start=warm_start,
        ),
        tracking=dataclasses.replace(
            job.tracking, tracking_uri=tracking_uri, registered_model_name=None
        ),
    )


def _date_of(value: str) -> str | None:
    """A partition value that is a date (``YYYY-MM-DD``), as it is; else None."""
    try:
        return datetime.date.fromisoformat(value).isoformat()
    except ValueError:
        return None


def _tag(client: MlflowClient, run_id: str, *, tags: dict[str, str], reason: str) -> None:
    for tag, value in {**tags, TAG_REASON: reason[:5000]}.items():
        client.set_tag(run_id, tag, value)


def _record(
    client: MlflowClient,
    trained: TrainResult,
    judged: Judgement,
    *,
    job: JobConfig,
    slot: _Slot,
    champion: Any | None,
) -> str:
    """Tags the run, registers the new version with its decision and moves the alias;
    returns the version."""
    cfg, name = job.retrain, job.tracking.registered_model_name
    run_tags = {TAG_SLOT: slot.value, TAG_DECISION: judged.decision}
    _tag(client, trained.run_id, tags=run_tags, reason=judged.reason)
    for metric, value in judged.metrics.items():
        client.log_metric(trained.run_id, f"{_METRIC_PREFIX}{metric.replace('/', '_')}", value)
    version_tags = {
        **run_tags,
        TAG_REASON: judged.reason,
        TAG_CHAMPION: "" if champion is None else str(champion.version),
    }
    version = register_version(
        trained.model_uri, name, run_id=trained.run_id, tags=version_tags, client=client
    )
    alias = cfg.champion_alias if judged.decision == CHAMPION else cfg.challenger_alias
    client.set_registered_model_alias(name, alias, str(version))
    # DEBUG: the caller reports the decision (the CLI prints it once).
    logger.debug("%s version %s is the %s: %s", name, version, alias, judged.reason)
    return str(version)


def _judge(trained: TrainResult, *, job: JobConfig, champion: Any | None, slot: _Slot) -> Judgement:
    """Guards, then the new model and the champion on the held-out partitions, the same way."""
    metric = job.retrain.metric
    holdout = {job.retrain.partition_key: PartitionSelector(values=list(slot.holdout))}

    def held_out(model: str | ModelFiles, role: str) -> float:
        scored = evaluate(model, job.data.train_path, storage=job.data.storage, partitions=holdout)
        for table, n in scored.unknown_ids.items():  # ids a managed table's map never saw
            metrics[f"{role}/unknown_ids.{table}"] = float(n)
        return scored.metrics[metric]

    metrics: dict[str, float] = {}

    with model_files(trained.model_uri) as new_model:  # downloaded once: checked, then scored
        bad = non_finite_tensors(new_model)
        if bad:
            raise RetrainError(
                f"the retrained model has non-finite weights in {len(bad)} tensors: {bad[:5]}"
            )
        metrics[f"new/{metric}"] = held_out(new_model, "new")
    champion_metric = None
    if champion is not None:
        champion_metric = held_out(f"models:/{champion.name}/{champion.version}", "champion")
        metrics[f"champion/{metric}"] = champion_metric
    decision, reason = decide(metrics[f"new/{metric}"], champion_metric, job.retrain)
    return Judgement(decision=decision, reason=reason, metrics=metrics)
