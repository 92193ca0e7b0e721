"""One MLflow run per training job.

The driver creates the run before the workers start and logs the resolved config (flattened) as
params and the sharding plan as artifacts. A job submitted again under the same run name and
storage (which resumes its Ray Train run from the latest checkpoint) continues the same MLflow
run: it is found by its ``raydlrm.run_key`` tag, so there is one run per job however often it
restarts, and the metric steps go on from the checkpoint's step. Workers never talk to MLflow: their
``ray.train.report`` metrics reach the run through :class:`MLflowReportCallback`, a Ray Train
``UserCallback`` that runs in the Train controller. Rank 0's metrics are logged (every rank
reports the same, globally reduced values) with the training step as the MLflow step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from ray.train import UserCallback

from raydlrm._errors import cause_line
from raydlrm.platform.config import (
    ConfigError,
    JobConfig,
    TrackingConfig,
    default_tracking_uri,
    flatten,
)
from raydlrm.platform.export import set_experiment
from raydlrm.sharding import ShardingPlan
from raydlrm.storage import redact, with_scheme

__all__ = [
    "TAG_CHECKPOINT",
    "MLflowReportCallback",
    "TrackedRun",
    "check_tracking",
    "check_tracking_of",
    "registered_checkpoint",
    "start_run",
]

logger = logging.getLogger(__name__)

# MLflow limits a param value's length; long values (lists of columns) are cut, with a marker.
_MAX_PARAM_LENGTH = 6000
_BATCH = 100


_CONNECT_TIMEOUT_S = 5.0
"""How long the tracking server has to answer the check before a job starts."""

TAG_CHECKPOINT = "raydlrm.checkpoint"
"""The run's latest (at the end: final) training checkpoint, a URI, however its model holds
its weights."""


def registered_checkpoint(model_uri: str, tracking_uri: str) -> str:
    """The training checkpoint of a registered or logged model (``models:/<name>/<version>``,
    ``models:/<name>@<alias>``, ``models:/<name>/latest``, ``models:/m-<id>``): its run's
    :data:`TAG_CHECKPOINT`.

    Raises:
        ConfigError: no such model, or its run records no checkpoint, naming the model.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    client = MlflowClient(tracking_uri)
    try:
        found = get_model_name_and_version(client, model_uri)
        if len(found) == 1:  # a logged model's id
            run_id = client.get_logged_model(found[0]).source_run_id
        else:
            run_id = client.get_model_version(*found).run_id
        checkpoint = client.get_run(run_id).data.tags.get(TAG_CHECKPOINT)
    except MlflowException as exc:
        raise ConfigError(
            f"{model_uri}: no such registered model version ({exc.message})"
        ) from None
    if checkpoint is None:
        raise ConfigError(
            f"{model_uri} (run {run_id}) records no training checkpoint ({TAG_CHECKPOINT} tag)"
        )
    return checkpoint


def check_tracking_of(job: JobConfig) -> None:
    """:func:`check_tracking` of the job's tracking URI, named by where it came from: the
    config's key, or ``$MLFLOW_TRACKING_URI`` when it is that variable's (also once the job's
    paths are resolved, which writes the URI into the job)."""
    uri = default_tracking_uri(job.tracking)
    from_env = "MLFLOW_TRACKING_URI" in os.environ and (
        not job.tracking.tracking_uri or uri == default_tracking_uri(TrackingConfig())
    )
    check_tracking(uri, key="$MLFLOW_TRACKING_URI" if from_env else "tracking.tracking_uri")


def check_tracking(tracking_uri: str, *, key: str = "tracking.tracking_uri") -> None:
    """Checks that the MLflow tracking store at ``tracking_uri`` can be reached, in seconds:
    an ``http(s)`` server must answer an HTTP request (any answer: the client may need
    credentials this check does not send), a ``sqlite`` store's directory must exist. The
    MLflow client itself retries an unreachable server for minutes. The registry
    (``$MLFLOW_REGISTRY_URI``), when it is another server, is checked the same way.

    Raises:
        ConfigError: naming the URI (credentials redacted), ``key`` and why.
    """
    targets = [(tracking_uri, key)]
    registry = os.environ.get("MLFLOW_REGISTRY_URI")
    if registry and registry != tracking_uri:
        targets.append((registry, "$MLFLOW_REGISTRY_URI"))
    for uri, source in targets:
        shown = _without_credentials(uri)
        if uri.startswith("sqlite:///"):
            parent = Path(uri[len("sqlite:///") :]).parent
            if not parent.is_dir():
                raise ConfigError(f"{source}: {shown}: the directory {parent} does not exist")
        if not uri.startswith(("http://", "https://")):
            continue
        probe = f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?experiment_name=-"
        try:
            urllib.request.urlopen(probe, timeout=_CONNECT_TIMEOUT_S).close()
        except urllib.error.HTTPError:
            pass  # it answered (an error status, e.g. no such experiment, or no credentials)
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConfigError(
                f"{source}: no MLflow tracking server answers at {shown} within "
                f"{_CONNECT_TIMEOUT_S:.0f} s ({reason})"
            ) from None


def _without_credentials(uri: str) -> str:
    """``uri`` with a ``user:password@`` part replaced by ``***@``: what may be printed."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def _metrics_at(values: dict[str, Any], *, step: int) -> list[Metric]:
    now = int(time.time() * 1000)
    return [
        Metric(key=k, value=float(v), timestamp=now, step=step)
        for k, v in values.items()
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and k != "step"
        and not math.isinf(float(v))
    ]


def _log_batch(
    client: MlflowClient, run_id: str, *, metrics: list[Metric] = (), params: list[Param] = ()
) -> None:
    """Writes metrics and params in chunks of ``_BATCH`` (MLflow limits a batch's size)."""
    for items, key in ((list(metrics), "metrics"), (list(params), "params")):
        for i in range(0, len(items), _BATCH):
            client.log_batch(run_id, **{key: items[i : i + _BATCH]})


class TrackedRun:
    """A handle on the job's MLflow run (driver side)."""

    def __init__(self, *, tracking_uri: str, run_id: str, experiment_id: str, submission: int = 1):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.submission = submission
        """This job's submission of the run (1 for a new run; ``raydlrm.submissions``)."""
        self.client = MlflowClient(tracking_uri)

    def log_params(self, params: dict[str, Any]) -> None:
        """Logs params; on a continued run, a param that changed (MLflow params are immutable,
        e.g. the worker count of a resharded restart) is recorded as a
        ``raydlrm.changed.<name>`` tag instead."""
        existing = self.client.get_run(self.run_id).data.params
        changed = {
            k: v
            for k, v in params.items()
            if k in existing and existing[k] != str(v)[:_MAX_PARAM_LENGTH]
        }
        for k, v in changed.items():
            self.client.set_tag(self.run_id, f"raydlrm.changed.{k}", str(v)[:5000])
        params = {k: v for k, v in params.items() if k not in existing}
        items = [
            Param(
                k,
                (
                    str(v)
                    if len(str(v)) <= _MAX_PARAM_LENGTH
                    else str(v)[: _MAX_PARAM_LENGTH - 3] + "..."
                ),
            )
            for k, v in sorted(params.items())
        ]
        _log_batch(self.client, self.run_id, params=items)

    def log_metrics(self, metrics: dict[str, Any], *, step: int) -> None:
        _log_batch(self.client, self.run_id, metrics=_metrics_at(metrics, step=step))

    def log_text(self, text: str, *, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def log_plan(self, plan: ShardingPlan) -> None:
        """The plan as ``sharding/plan.json`` and a readable ``sharding/plan.txt``."""
        self.log_text(plan.to_json(), artifact_file="sharding/plan.json")
        self.log_text(plan.format_table(), artifact_file="sharding/plan.txt")

    def finish(self, *, failed: bool = False) -> None:
        status = RunStatus.to_string(RunStatus.FAILED if failed else RunStatus.FINISHED)
        self.client.set_terminated(self.run_id, status=status)

    def callback(self, storage_scheme: str | None = None) -> MLflowReportCallback:
        """The Ray Train callback that logs the workers' reports to this run."""
        return MLflowReportCallback(
            tracking_uri=self.tracking_uri,
            run_id=self.run_id,
            storage_scheme=storage_scheme,
            submission=self.submission,
        )


def _existing_run(client: MlflowClient, experiment_id: str, run_key: str) -> Any | None:
    escaped = run_key.replace("'", "\\'")
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`raydlrm.run_key` = '{escaped}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


def start_run(config: JobConfig, *, run_name: str, run_key: str | None = None) -> TrackedRun:
    """Creates the job's MLflow run, or continues the run of an earlier submission with the
    same ``run_key`` (run storage and name), and logs the resolved config as params and an
    artifact."""
    uri = default_tracking_uri(config.tracking)
    experiment = set_experiment(config.tracking.experiment_name, tracking_uri=uri)
    client = MlflowClient(uri)
    run = _existing_run(client, experiment.experiment_id, run_key) if run_key else None
    submission = 1
    if run is not None:
        client.update_run(run.info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        submission = int(run.data.tags.get("raydlrm.submissions", "1")) + 1
        client.set_tag(run.info.run_id, "raydlrm.submissions", str(submission))
        logger.info("continuing MLflow run %s (submission %d)", run.info.run_id, submission)
    else:
        tags = {"raydlrm.run_name": run_name, "raydlrm.submissions": "1"}
        if run_key:
            tags["raydlrm.run_key"] = run_key
        if config.tracking.parent_run_id:
            tags["mlflow.parentRunId"] = config.tracking.parent_run_id
        run = client.create_run(experiment.experiment_id, run_name=run_name, tags=tags)
    tracked = TrackedRun(
        tracking_uri=uri,
        run_id=run.info.run_id,
        experiment_id=experiment.experiment_id,
        submission=submission,
    )
    resolved = redact(config.to_dict())  # credentials never reach MLflow
    tracked.log_params(flatten(resolved))
    tracked.log_text(json.dumps(resolved, indent=2), artifact_file="config/resolved.json")
    logger.info(
        "MLflow run %s in experiment %r at %s", tracked.run_id, config.tracking.experiment_name, uri
    )
    return tracked


FAILURE_TAG = "raydlrm.worker_failure"
"""The run's tag that records the last worker failure (JSON; see
:meth:`MLflowReportCallback.after_exception`). A later submission of the run finds it there:
its ``submission`` tells whose failure it was."""


class MLflowReportCallback(UserCallback):
    """Logs every ``ray.train.report`` to the job's MLflow run (runs in the Train controller).

    If the tracking server cannot be reached, training goes on: the metrics are kept (up to
    ``max_pending``) and written with the next report that gets through; beyond that, the oldest
    are dropped and counted, and the count is logged as an error and, once the server answers
    again, as the ``tracking/metrics_lost`` metric.

    Reports carry the last value of every metric (so that a checkpoint-only report still holds
    the metric that ranks checkpoints); a value equal to the one last logged under its key is
    not logged again, so that the history holds each value once, at the step it was computed.

    Args:
        tracking_uri: absolute MLflow tracking URI.
        run_id: the run created by the driver.
        max_pending: metrics kept while the server is unreachable.
        storage_scheme: the run storage's URI scheme (``s3``) when it is remote: Ray names
            checkpoints there without it, the run records them as URIs.
        submission: the job's submission of the run (``raydlrm.submissions``), recorded with
            each worker failure.
    """

    def __init__(
        self,
        *,
        tracking_uri: str,
        run_id: str,
        max_pending: int = 100_000,
        storage_scheme: str | None = None,
        submission: int = 1,
    ):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.max_pending = max_pending
        self.storage_scheme = storage_scheme
        self.submission = submission
        self._client: MlflowClient | None = None
        self._pending: list[Metric] = []
        self._lost = 0
        self._logged: dict[str, float] = {}
        self._failures = 0
        self._checkpoint: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "tracking_uri": self.tracking_uri,
            "run_id": self.run_id,
            "max_pending": self.max_pending,
            "storage_scheme": self.storage_scheme,
            "submission": self.submission,
            "_client": None,
            "_pending": [],
            "_lost": 0,
            "_logged": {},
            "_failures": 0,
            "_checkpoint": None,
        }

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        """Records a worker failure on the run (tag ``raydlrm.worker_failure``: the job's
        submission, the failure's count in it, the failed ranks, their causes' lines and the
        last reported checkpoint), from which the driver writes one line while Ray Train
        restarts the workers."""
        self._failures += 1
        causes: dict[str, list[int]] = {}  # a rank's death fails its peers' collectives too
        for rank in sorted(worker_exceptions):
            causes.setdefault(cause_line(worker_exceptions[rank]), []).append(rank)
        record = {
            "submission": self.submission,
            "failures": self._failures,
            "ranks": sorted(worker_exceptions),
            "cause": "; ".join(
                f"rank {', '.join(map(str, ranks))}: {cause}"
                for cause, ranks in list(causes.items())[:3]
            )
            or "unknown",
            "checkpoint": self._checkpoint,
        }
        try:
            if self._client is None:
                self._client = MlflowClient(self.tracking_uri)
            self._client.set_tag(self.run_id, FAILURE_TAG, json.dumps(record))
        except Exception as exc:  # the failure itself is Ray Train's to handle
            logger.debug("could not record the worker failure: %s", exc)

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
    ) -> None:
        if self._client is None:
            self._client = MlflowClient(self.tracking_uri)
        values = metrics[0] if metrics else {}
        step = int(values.get("step", 0))
        for metric in _metrics_at(values, step=step):
            if self._logged.get(metric.key) != metric.value:
                self._logged[metric.key] = metric.value
                self._pending.append(metric)
        try:
            if self._lost:
                self._pending.append(
                    Metric(
                        "tracking/metrics_lost", float(self._lost), int(time.time() * 1000), step
                    )
                )
            _log_batch(self._client, self.run_id, metrics=self._pending)
            self._pending = []
            if checkpoint is not None:
                uri = with_scheme(checkpoint.path, self.storage_scheme)
                self._checkpoint = uri
                self._client.set_tag(self.run_id, TAG_CHECKPOINT, uri)
        except Exception as exc:
            if self._lost and self._pending and self._pending[-1].key == "tracking/metrics_lost":
                self._pending.pop()
            logger.warning(
                "MLflow at %s unreachable (%s); %d metric values kept for later",
                self.tracking_uri,
                type(exc).__name__,
                len(self._pending),
            )
            if len(self._pending) > self.max_pending:
                dropped = len(self._pending) - self.max_pending
                self._lost += dropped
                del self._pending[:dropped]
                logger.error("MLflow unreachable: %d metric values lost so far", self._lost)
