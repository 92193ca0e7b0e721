"""The job config: every layer's config composed, loaded from TOML with dotted overrides.

A run file is TOML with one table per section (``[data]``, ``[model]``, ``[sharding]``,
``[training]``, ``[scaling]``, ``[run]``, ``[tracking]``, ``[retrain]``, ``[ray]``). Overrides are
``section.key=value`` strings (``--set training.learning_rate=0.01`` on the command line); the
value is read as a TOML value when it parses as one (numbers, booleans, arrays, inline tables)
and as a plain string otherwise. Unknown keys and invalid values stop with a :class:`ConfigError`
naming the full dotted key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import pydantic
import tomllib

from raydlrm._config import config_dataclass
from raydlrm.models.config import ModelConfig
from raydlrm.sharding import config as sharding_config
from raydlrm.sharding.topology import Topology
from raydlrm.storage import StorageConfig
from raydlrm.trainers import FaultConfig, WorkerSpec
from raydlrm.trainers.config import FAULT_ENV, RETRIEVAL_METRIC

__all__ = [
    "ConfigError",
    "JobConfig",
    "RayInitConfig",
    "RetrainConfig",
    "RunSpec",
    "ScalingSpec",
    "TrackingConfig",
    "flatten",
    "load_config",
    "replaced",
]


@dataclass(frozen=True)
class _TableFeatures:
    """A table's name and features (what the towers' check reads of a table)."""

    name: str
    feature_names: tuple[str, ...]


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the dotted key."""


@config_dataclass
class ScalingSpec:
    """Fields of Ray Train's ``ScalingConfig``."""

    num_workers: int = 2
    """Ray Train workers; each holds a shard of the embedding tables."""
    use_gpu: bool = False
    """One GPU per worker (NCCL and CUDA kernels) instead of CPU (gloo)."""
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    """Ray resources per worker; fractional CPUs leave room for Ray Data on small machines."""
    ranks_per_host: int | None = None
    """Workers per host: workers ``h * ranks_per_host`` to ``(h + 1) * ranks_per_host - 1`` are
    host ``h`` (Ray Train numbers a node's workers together). The one topology of the job
    (:meth:`JobConfig.topology`): ``table_row_wise`` tables are sharded inside a host, towers
    (``model.towers``) are looked up on theirs. Set it to the workers (GPUs) per node, or lower
    to emulate hosts on one machine. Default: ``sharding.group_size``, else every worker on one
    host."""

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ValueError(f"scaling.num_workers must be positive, got {self.num_workers}")
        if self.ranks_per_host is not None and (
            self.ranks_per_host <= 0 or self.num_workers % self.ranks_per_host
        ):
            raise ValueError(
                f"scaling.ranks_per_host ({self.ranks_per_host}) must be positive and divide "
                f"scaling.num_workers ({self.num_workers})"
            )


@config_dataclass
class RunSpec:
    """Fields of Ray Train's ``RunConfig`` and ``FailureConfig``."""

    name: str | None = None
    """Run name; also the name of the Ray Train run directory. Default: ``raydlrm-<time>``.
    Submitting again with the same name and storage resumes the run from its latest checkpoint
    (and continues its MLflow run)."""
    storage_path: str = "runs"
    """Where Ray Train keeps run state and checkpoints (a local path or ``s3://...``)."""
    storage: StorageConfig | None = None
    """Object-store access for an ``s3://`` ``storage_path`` (``[run.storage]``: endpoint,
    region, credentials). Default: ``[data.storage]``."""
    max_failures: int = 0
    """Worker failures to recover from before the run fails."""
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    """Training progress on the driver: a progress bar (``bar``), a log line every 15 s
    (``lines``), or nothing; ``auto`` draws a bar in a terminal or notebook, lines otherwise
    (``ray job submit``, schedulers, pipes)."""
    warm_start: str | None = None
    """A training-state checkpoint (``runs/<run>/checkpoint_...`` or ``s3://...``, read with
    ``[run.storage]``), or a registered model (``models:/<name>@<alias>``,
    ``models:/<name>/<version>``: its run's final checkpoint), to start from: its embedding
    tables, dense weights and optimizer states, resharded to this job's plan; step, epoch and
    data position start at zero. A run that has checkpoints of its own resumes from them
    instead."""

    def storage_or(self, data: StorageConfig) -> StorageConfig:
        """The object-store access of the run storage."""
        return self.storage if self.storage is not None else data

    def __post_init__(self) -> None:
        if self.max_failures < -1:
            raise ValueError(f"run.max_failures must be >= -1, got {self.max_failures}")


@config_dataclass
class TrackingConfig:
    """Where the MLflow run and the registered model go."""

    tracking_uri: str | None = None
    """MLflow tracking URI. Default: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the
    working directory."""
    experiment_name: str = "raydlrm"
    """MLflow experiment of the run."""
    registered_model_name: str | None = "raydlrm-model"
    """Name under which the final model is registered; None logs it without registering."""
    model_weights: Literal["auto", "reference", "copy"] = "auto"
    """How the logged model holds its weights: ``reference`` leaves them in the run's final
    checkpoint (no copy; the model reads them there, so the checkpoint must stay), ``copy``
    stores ``model.safetensors`` with the model in MLflow's artifact store. ``auto``
    references a checkpoint in an object store, or on this machine when the tracking store is
    here too, and copies otherwise (said in one line)."""
    parent_run_id: str | None = None
    """MLflow run this job's run is a child of (``raydlrm tune`` sets it for its trials)."""


RANKED_METRIC = re.compile(r"(hr|ndcg)_at_(\d+)")
"""A retrieval model's held-out metrics (:mod:`raydlrm.trainers.retrieval`)."""


@config_dataclass
class RetrainConfig:
    """Scheduled retraining (``raydlrm retrain``): which partitions, and when a new model
    replaces the champion."""

    partition_key: str = "date"
    """The hive partition key of ``data.train_path`` that orders the data in time."""
    train_partitions: int = 1
    """How many partitions, the newest before the held-out ones, to train on."""
    holdout_partitions: int = 1
    """How many of the newest partitions to hold out: the new model and the champion are both
    evaluated on them."""
    metric: str = "auc"
    """The held-out metric that decides: ``auc`` (higher is better) or ``log_loss`` (lower is
    better) for a click model; ``ndcg_at_K`` or ``hr_at_K`` (higher is better, ``K`` in
    ``model.retrieval_k``) for a retrieval model."""
    min_improvement: float = 0.0
    """The new model takes the champion alias only if it beats the champion by more than this
    (in units of ``metric``); otherwise it is registered as the challenger."""
    max_regression: float = 0.05
    """A new model worse than the champion by more than this is an error: it is not registered
    and the job fails."""
    warm_start: bool = True
    """Start from the champion's training-state checkpoint (weights and optimizer states,
    resharded); false trains from scratch every time."""
    champion_alias: str = "champion"
    """The registry alias of the serving model."""
    challenger_alias: str = "challenger"
    """The alias of a new model that did not beat the champion."""

    def __post_init__(self) -> None:
        if self.train_partitions < 1:
            raise ValueError(f"retrain.train_partitions must be >= 1, got {self.train_partitions}")
        if self.holdout_partitions < 1:
            raise ValueError(
                f"retrain.holdout_partitions must be >= 1, got {self.holdout_partitions}"
            )
        if self.max_regression < 0:
            raise ValueError(f"retrain.max_regression must be >= 0, got {self.max_regression}")
        if self.champion_alias == self.challenger_alias:
            raise ValueError("retrain.champion_alias and retrain.challenger_alias must differ")
        if self.metric not in ("auc", "log_loss") and not RANKED_METRIC.fullmatch(self.metric):
            raise ValueError(
                f"retrain.metric must be auc, log_loss, hr_at_K or ndcg_at_K, got {self.metric!r}"
            )


@config_dataclass
class TuneConfig:
    """A hyperparameter sweep (``raydlrm tune``; :mod:`raydlrm.platform.tune`)."""

    search: dict[str, str] = field(default_factory=dict)
    """Dotted config key -> its distribution: ``choice(a, b, ...)``, ``grid(a, b, ...)``
    (every value, each with ``num_trials`` samples of the rest), ``uniform(lo, hi)``,
    ``loguniform(lo, hi)``, ``randint(lo, hi)`` (``hi`` excluded); values as in ``--set``."""
    num_trials: int | None = None
    """Trials to sample (with ``grid``: per grid point). Default: 8, or 1 when every key is a
    ``grid`` (each point once; more would repeat the same trials, with a warning)."""
    metric: str | None = None
    """The metric trials are ranked and stopped early on (reported at each evaluation,
    ``training.eval_every_steps`` or ``training.valid_every_steps``, and at the end). Default:
    ``valid/auc`` with a validation set (``data.valid_path``, ``data.valid_split``), else
    ``eval/auc``."""
    mode: Literal["max", "min"] = "max"
    """Whether ``metric`` is better high (``max``, AUC) or low (``min``, log loss)."""
    scheduler: Literal["asha", "fifo"] = "asha"
    """``asha``: stop the trials whose ``metric`` trails the others' at the same evaluation
    (asynchronous successive halving); ``fifo``: run every trial to the end."""
    grace_period: int = 1
    """Evaluations a trial gets before ASHA may stop it."""
    reduction_factor: int = 3
    """ASHA keeps the best ``1 / reduction_factor`` of the trials at each rung."""
    max_concurrent_trials: int = 0
    """Trials run at once; 0: as many as the cluster's CPUs fit (each trial's workers'
    ``scaling.resources_per_worker`` CPUs, at least 1 a trial)."""
    seed: int | None = None
    """Seed of the sampler (None: random)."""

    def __post_init__(self) -> None:
        if self.num_trials is not None and self.num_trials < 1:
            raise ValueError(f"tune.num_trials must be >= 1, got {self.num_trials}")
        if self.grace_period < 1:
            raise ValueError(f"tune.grace_period must be >= 1, got {self.grace_period}")
        if self.reduction_factor < 2:
            raise ValueError(f"tune.reduction_factor must be >= 2, got {self.reduction_factor}")
        if self.max_concurrent_trials < 0:
            raise ValueError(
                f"tune.max_concurrent_trials must be >= 0, got {self.max_concurrent_trials}"
            )


@config_dataclass
class RayInitConfig:
    """How to reach (or start) Ray when the caller has not initialized it."""

    address: str | None = None
    """Cluster address. Default: ``$RAY_ADDRESS`` (set by ``ray job submit``), else a new local
    Ray instance."""
    num_cpus: int | None = None
    """CPUs of a new local instance (default: the machine's)."""
    object_store_memory: int | None = None
    """Object store bytes of a new local instance."""
    include_dashboard: bool | None = None
    """Start Ray's dashboard with a new local instance (default: Ray's choice, on when it is
    installed). It serves the Jobs API (``ray job submit``), the web UI and the State API; a job
    run directly needs none of them, and off saves its start-up time and processes."""
    log_to_driver: bool = True
    """Forward the output of Ray's worker processes (the training workers' log lines) to the
    driver's screen; off in a notebook keeps the cell's output to raydlrm's own lines (the
    workers' output stays in Ray's log files, ``/tmp/ray/session_latest/logs``)."""


@config_dataclass
class JobConfig(WorkerSpec):
    """Everything a training job needs: the workers' sections (:class:`WorkerSpec`: ``[data]``,
    ``[model]``, ``[sharding]``, ``[training]``, ``[checkpoint]``, ``[fault]``) and the
    driver's. (An extension rather than a ``worker`` field: run files keep flat sections.)"""

    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    run: RunSpec = field(default_factory=RunSpec)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)
    ray: RayInitConfig = field(default_factory=RayInitConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    def __post_init__(self) -> None:
        self._check_topology()
        self._check_towers()
        self._check_validation()
        if self.model.retrieval:  # it learns from the items: no label is read
            self.data.label_column = None
        self.check_sequence_model()

    def check_retrain_metric(self) -> None:
        """A retrieval model is decided on a ranking metric, a click model on a click one."""
        ranked = RANKED_METRIC.fullmatch(self.retrain.metric)
        if self.model.retrieval and not ranked:
            raise ValueError(
                f"retrain.metric {self.retrain.metric!r} is a click metric: a retrieval model "
                f"(arch 'sasrec') is decided on ndcg_at_K or hr_at_K, K in model.retrieval_k "
                f"{self.model.retrieval_k}"
            )
        if ranked and (not self.model.retrieval or int(ranked[2]) not in self.model.retrieval_k):
            raise ValueError(
                f"retrain.metric {self.retrain.metric!r} needs a retrieval model (arch 'sasrec') "
                f"with {ranked[2]} in model.retrieval_k"
            )

    def _check_validation(self) -> None:
        """``training.early_stopping`` needs a validation set and keeps its best checkpoint
        itself."""
        if self.training.stopping() is None:
            return
        if not self.data.has_validation():
            raise ValueError(
                "training.early_stopping needs a validation set: set data.valid_path, or "
                "data.valid_split = 'time' or 'random'"
            )
        if self.checkpoint.score_metric is not None:
            raise ValueError(
                "checkpoint.score_metric with training.early_stopping: early stopping keeps the "
                "best checkpoint by its validation metric; unset checkpoint.score_metric"
            )
        metric = self.training.stopping().metric
        ranked = RETRIEVAL_METRIC.fullmatch(metric)
        if bool(ranked) != self.model.retrieval or (
            ranked and int(ranked[2]) not in self.model.retrieval_k
        ):
            wanted = (
                f"valid/ndcg_at_K or valid/hr_at_K, K in model.retrieval_k {self.model.retrieval_k}"
                if self.model.retrieval
                else "a click metric (valid/auc, valid/log_loss, valid/normalized_entropy)"
            )
            raise ValueError(
                f"training.early_stopping.metric {metric!r}: arch {self.model.arch!r} reports "
                f"{wanted}"
            )

    def topology(self) -> Topology:
        """The hosts of the workers: ``scaling.ranks_per_host`` (or ``sharding.group_size``,
        the same concept) workers each, else one host of them all. The one place the job's
        host count is derived."""
        per_host = self.scaling.ranks_per_host or self.sharding.group_size
        return Topology.of(self.scaling.num_workers, per_host)

    def _check_topology(self) -> None:
        """``scaling.ranks_per_host`` and ``sharding.group_size`` name one thing, the workers
        of a host: given both, they must agree."""
        per_host, group = self.scaling.ranks_per_host, self.sharding.group_size
        if per_host is not None and group is not None and per_host != group:
            raise ValueError(
                f"sharding.group_size ({group}) and scaling.ranks_per_host ({per_host}) both "
                "set the workers of a host (a table_row_wise group is a host's workers): set "
                "one of them"
            )
        try:
            self.topology()  # the one derivation, checked here with the keys named
        except ValueError:
            raise ValueError(
                f"sharding.group_size ({group}) must divide scaling.num_workers "
                f"({self.scaling.num_workers})"
            ) from None

    def _check_towers(self) -> None:
        """``model.towers`` against the data's features and the hosts (before Ray starts)."""
        towers = self.model.towers
        if towers is None:
            return
        from raydlrm.sharding.tower_spec import check_towers, model_towers

        hosts = self.topology().num_hosts
        if towers == "auto":
            made = self.model.num_towers or hosts
            if not hosts <= made <= len(self.data.table_columns()):
                raise ValueError(
                    f"model.num_towers ({made}) must be at least the hosts ({hosts}) and at most "
                    f"the tables ({len(self.data.table_columns())})"
                )
            towers = None
        tables = [
            _TableFeatures(name, tuple(columns))
            for name, columns in self.data.table_columns().items()
        ]
        try:
            if towers is not None:
                check_towers(model_towers(towers, hosts), tables, hosts)
        except ValueError as e:
            where = f"{hosts} hosts of scaling.ranks_per_host = {self.scaling.ranks_per_host}"
            raise ValueError(
                f"model.towers: {e} ({where})" if hosts > 1 else f"model.towers: {e}"
            ) from None
        if self.training.embedding_l2:
            raise ValueError(
                "training.embedding_l2 with model.towers would regularize the towers' outputs, "
                "not the embeddings: unset one of them"
            )
        if hosts > 1 and (self.data.dedup_groups or self.data.dedup == "infer"):
            key = "data.dedup_groups" if self.data.dedup_groups else "data.dedup = 'infer'"
            raise ValueError(
                f"{key} with model.towers on several hosts (scaling.ranks_per_host): the "
                "towers look up every sample's ids on their host, so RecD's deduplication would "
                "be dropped; unset one of them"
            )
        if hosts > 1 and self.training.pipeline != "none":
            raise ValueError(
                "training.pipeline = 'sparse_dist' is not supported with towers on several hosts "
                "(scaling.ranks_per_host): the towers' exchanges run on their own process groups"
            )

    def global_batch_size(self) -> int:
        """Samples a training step over all workers, ``data.batch_size x scaling.num_workers``:
        the bags of a table each rank's kernel looks up (table-wise), what the learned cost
        model is measured at."""
        return self.data.batch_size * self.scaling.num_workers

    def table_device(self) -> str:
        """Where the workers' tables are, as the cost measurements name it: ``cuda`` with
        ``scaling.use_gpu``, else ``cpu``."""
        return "cuda" if self.scaling.use_gpu else "cpu"

    def worker_spec(self) -> WorkerSpec:
        """The part of the config the workers get."""
        return WorkerSpec(**{f.name: getattr(self, f.name) for f in fields(WorkerSpec)})

    def run_name(self) -> str:
        return self.run.name or time.strftime("raydlrm-%Y%m%d-%H%M%S")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty dicts are leaves."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def parse_value(text: str) -> Any:
    """A value as TOML reads it; a bare ``null`` is None (unsets an optional key: TOML has no
    null, and the word would otherwise become the string "null"; quote it for that string)."""
    if text == "null":
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_override(tree: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form section.key=value")
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section"
            )
        node = child
    node[parts[-1]] = parse_value(text.strip())


def replaced(config: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` of a config dataclass, its checks run again (a value they refuse
    is a :class:`ConfigError` naming the key, not pydantic's error)."""
    try:
        return dataclasses.replace(config, **changes)
    except pydantic.ValidationError as e:
        raise ConfigError(_format_error(e)) from None


RETIRED_KEYS = {f"sharding.{k}": v for k, v in sharding_config.RETIRED_KEYS.items()}
"""Keys a release has retired -> the keys that replaced them. A config that still sets one is
refused, naming its replacement: silently dropping it would size something else than the user
asked. The ``ssd`` row cache keys became the one family that sizes every row cache (``ssd``,
``host``, quantized), whose unset defaults are per kind
(:data:`raydlrm.sharding.config.CACHE_DEFAULTS`)."""


def _format_error(error: pydantic.ValidationError) -> str:
    lines = []
    for e in error.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument") and key in RETIRED_KEYS:
            msg = (
                "no longer a key: one family of keys sizes the row caches of every kind "
                f"(ssd, host, int8 / int4); set {RETIRED_KEYS[key]} (unset: a default per kind)"
            )
        elif e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]  # a __post_init__ check: it names its key
        elif e["type"] == "literal_error":
            msg = f"{msg}, got {e['input']!r}"
        # A section's own check names its full dotted key already.
        lines.append(msg if not key or msg.startswith(f"{key}.") else f"{key}: {msg}")
    return "invalid config: " + "; ".join(lines)


def load_config(
    source: str | Path | dict[str, Any] | JobConfig | None = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
) -> JobConfig:
    """Builds a validated :class:`JobConfig`.

    Args:
        source: a TOML file path, a dict of sections, a ``JobConfig``, or None (defaults).
        overrides: ``section.key=value`` strings applied on top, in order.

    Returns:
        The resolved config.

    Raises:
        ConfigError: a missing or unreadable file, an unknown key or an invalid value, named.
    """
    if isinstance(source, JobConfig):
        tree = source.to_dict()
    elif isinstance(source, dict):
        tree = dict(source)
    elif source is None:
        tree = {}
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    given = set() if isinstance(source, JobConfig) else set(flatten(tree))
    for override in overrides:
        _apply_override(tree, override)
        given.add(override.partition("=")[0].strip())
    _check_partitioner_keys(tree, given)
    fault = os.environ.get(FAULT_ENV)
    if fault:
        try:
            parsed = FaultConfig.from_env(fault)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        tree["fault"] = {"at_step": parsed.at_step, "rank": parsed.rank, "during": parsed.during}
    try:
        return JobConfig(**tree)
    except pydantic.ValidationError as e:
        raise ConfigError(_format_error(e)) from None
    except TypeError as e:  # a section given as a scalar
        raise ConfigError(f"invalid config: {e}") from None


_PARTITIONER_KEYS = ("model.num_towers", "model.tower_warmup_steps")
"""Settings of the tower partitioner that ``model.towers = "auto"`` runs, nothing else."""


def _check_partitioner_keys(tree: dict[str, Any], given: set[str]) -> None:
    """Refuses a partitioner setting the config gives (``given``: its dotted keys) with a value
    of its own when ``model.towers`` is not ``"auto"``, where it would be ignored. A config
    written out whole (a sweep's trials get the sweep's config as a dict) gives every key, at
    its default value: that is not a setting.

    Raises:
        ConfigError: naming the key and ``model.towers``.
    """
    model = tree.get("model")
    if not isinstance(model, dict):
        return
    towers = model.get("towers")
    defaults = {f"model.{f.name}": f.default for f in fields(ModelConfig)}
    ignored = [
        key
        for key in _PARTITIONER_KEYS
        if key in given and model.get(key.removeprefix("model."), defaults[key]) != defaults[key]
    ]
    if ignored and towers != "auto":
        raise ConfigError(
            f"{' and '.join(ignored)} set the partitioner of model.towers = 'auto', and "
            f"model.towers is {towers!r}: they would be ignored (unset them, or set "
            "model.towers = 'auto')"
        )


BASE_DIR_ENV = "RAYDLRM_BASE_DIR"
"""Where a job's relative local paths (data, run storage, the default ``mlflow.db``) resolve;
default: the working directory. ``ray job submit --working-dir`` runs a job in a temporary copy
of the directory, which Ray deletes: pass the submitting directory in the runtime env."""


def base_dir() -> Path:
    """The directory relative local paths resolve against (:data:`BASE_DIR_ENV`, else the
    working directory)."""
    return Path(os.environ.get(BASE_DIR_ENV) or Path.cwd()).expanduser().resolve()


def default_tracking_uri(config: TrackingConfig) -> str:
    """The MLflow tracking URI, made absolute (the Ray Train controller runs elsewhere):
    ``tracking.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else ``mlflow.db`` in
    :func:`base_dir`; a relative SQLite path resolves against :func:`base_dir`."""
    uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{base_dir() / 'mlflow.db'}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{base_dir() / uri[len('sqlite:///') :]}"
    return uri
