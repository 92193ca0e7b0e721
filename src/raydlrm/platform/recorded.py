"""What a run continues from, read and checked before Ray starts: the newest checkpoint of a
run that resumes (whose settings the job must keep) and the warm start's checkpoint (whose
model the job must be)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import ray.train

from raydlrm.ingestion.badinput import bad_row_rules
from raydlrm.ingestion.epoch_files import FileList, file_changes, file_list
from raydlrm.ingestion.layout import layout_of
from raydlrm.ingestion.reader import resumed_window
from raydlrm.ingestion.schema import DataSummary
from raydlrm.platform.config import ConfigError, JobConfig, default_tracking_uri
from raydlrm.platform.preflight import run_storage
from raydlrm.platform.tracking import registered_checkpoint
from raydlrm.sharding import ShardingPlan
from raydlrm.sharding.plan import managed_mismatches
from raydlrm.storage import filesystem_for
from raydlrm.trainers.checkpoints import STATE_FILE, check_intact, check_state_matches

__all__ = [
    "WarmStart",
    "check_resume",
    "check_warm_start",
    "data_order_differences",
    "log_resumed_epoch",
    "model_differences",
    "resume_differences",
    "resumed_state",
    "warm_start_state",
]

logger = logging.getLogger(__name__)


def resumed_state(job: JobConfig, run_name: str) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint of the run with a readable state (``trainer_state.json``): its
    path and state; None when the run has none (it starts afresh)."""
    root, filesystem = run_storage(job)
    filesystem = filesystem or pafs.LocalFileSystem()
    selector = pafs.FileSelector(f"{root.rstrip('/')}/{run_name}", allow_not_found=True)
    checkpoints = sorted(
        (
            i.path
            for i in filesystem.get_file_info(selector)
            if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
        ),
        reverse=True,
    )
    for path in checkpoints:
        try:
            with filesystem.open_input_stream(f"{path}/{STATE_FILE}") as f:
                return path, json.loads(f.read())
        except (OSError, ValueError):
            continue  # a damaged or partial checkpoint: the workers pass it over too
    return None


def check_resume(
    job: JobConfig,
    plan: ShardingPlan,
    run_name: str,
    resumed: tuple[str, dict[str, Any]],
    *,
    train: DataSummary,
) -> None:
    """A run that resumes from ``resumed`` (its newest readable checkpoint: path and state)
    must keep the model and features that checkpoint was trained with, and what the order of
    its epoch's rows depends on (:func:`data_order_differences`; the training data
    ``train``). What the rest of the epoch reads otherwise is logged
    (:func:`log_resumed_epoch`).

    Raises:
        ConfigError: naming the run, the checkpoint and every setting that differs, with both
            values.
    """
    path, state = resumed
    differences = resume_differences(state, job=job, plan=plan)
    differences += data_order_differences(state, job=job, train=train)
    if differences:
        raise ConfigError(
            f"run {run_name} would resume from {path}, trained with other settings: "
            f"{'; '.join(differences)} (keep the checkpoint's settings to resume, or "
            "start a new run with another run.name)"
        )
    log_resumed_epoch(state, job=job, train=train)


def data_order_differences(
    state: dict[str, Any], *, job: JobConfig, train: DataSummary
) -> list[str]:
    """What the rest of a checkpoint's epoch would be read in another order with: its data
    position counts the rows trained per row group, a head of each row group's order, which
    ``training.seed``, ``data.order`` (and under ``time`` its ``data.time_column``), the
    session column and the rows ``data.bad_input`` sets aside decide, of the files the epoch
    began with (each by its place in their list). One phrase each.

    ``data.bad_input`` itself may change (``fail`` to ``quarantine`` is how a run stopped by
    bad input goes on): a row group read under ``fail`` had no bad row, and one read under
    ``quarantine`` fails loudly under ``fail`` if it had any. What it judges rows by may not,
    unless both are ``fail``.
    """
    spec = state["spec"]
    out = []
    seed = spec["training"]["seed"]
    if seed != job.training.seed:
        out.append(
            f"training.seed: {seed!r} in the checkpoint, {job.training.seed!r} in the config "
            "(it draws the epoch's row order)"
        )
    out += _order_mode_differences(spec["data"], job=job)
    out += _split_differences(spec["data"], job=job)
    theirs = spec["data"].get("session_column")
    if _order_column(theirs, train) != _order_column(job.data.session_column, train):
        out.append(
            f"data.session_column: {theirs!r} in the checkpoint, "
            f"{job.data.session_column!r} in the config (its sessions are the units shuffled)"
        )
    if {spec["data"].get("bad_input", "fail"), job.data.bad_input} != {"fail"}:
        saved, ours = bad_row_rules(spec["data"]), bad_row_rules(dataclasses.asdict(job.data))
        out += [
            f"{key}: {saved[key]!r} in the checkpoint, {rule!r} in the config (data.bad_input "
            "= 'quarantine' sets other rows aside before the order is drawn)"
            for key, rule in ours.items()
            if key in saved and _plain(saved[key]) != _plain(rule)
        ]
    files = state.get("position", {}).get("files")
    if files is not None:
        problems = file_changes(files, _file_list(job, train)).problems()
        if problems:
            more = f"; {len(problems) - 4} more" if problems[4:] else ""
            out.append(
                f"data.train_path: {'; '.join(problems[:4])}{more} (the checkpoint's data "
                "position counts the rows trained by row group of the files its epoch began "
                "with: restore them to resume)"
            )
    return out


def _order_mode_differences(data: dict[str, Any], *, job: JobConfig) -> list[str]:
    """``data.order`` and, under ``time``, ``data.time_column``: what deals the row groups (a
    checkpoint of an earlier release read in the ``shuffled`` order, the only one it had)."""
    order = data.get("order", "shuffled")
    if order != job.data.order:
        return [
            f"data.order: {order!r} in the checkpoint, {job.data.order!r} in the config (it "
            "deals the epoch's row groups)"
        ]
    column = data.get("time_column")
    if order == "time" and column != job.data.time_column:
        return [
            f"data.time_column: {column!r} in the checkpoint, {job.data.time_column!r} in the "
            "config (it orders the epoch's row groups)"
        ]
    return []


def _split_differences(data: dict[str, Any], *, job: JobConfig) -> list[str]:
    """``data.valid_split`` and what it carves by (``valid_fraction``; under ``time``,
    ``time_column``): they decide which row groups train (a checkpoint of an earlier release
    carved none)."""
    ours = job.data
    keys = ["valid_split"]
    if ours.valid_split != "none":
        keys.append("valid_fraction")
    if ours.valid_split == "time":
        keys.append("time_column")
    defaults = {"valid_split": "none", "valid_fraction": 0.1, "time_column": None}
    return [
        f"data.{key}: {data.get(key, defaults[key])!r} in the checkpoint, "
        f"{getattr(ours, key)!r} in the config (it decides which row groups train)"
        for key in keys
        if data.get(key, defaults[key]) != getattr(ours, key)
    ]


def _order_column(column: str | None, train: DataSummary) -> str | None:
    """The column whose sessions the reader shuffles as units: ``data.session_column`` when
    the sample-level data has it (session-clustered data: its own, whatever the config says)."""
    if layout_of(train.schema) is not None or column not in train.schema.names:
        return None
    return column


def _file_list(job: JobConfig, train: DataSummary) -> FileList:
    return file_list(train.row_groups, root=filesystem_for(train.path, job.data.storage)[1])


def log_resumed_epoch(state: dict[str, Any], *, job: JobConfig, train: DataSummary) -> None:
    """Logs what the rest of a checkpoint's epoch reads otherwise than it began: files added to
    the data set since (read from the next epoch on), the shuffle window (a smaller configured
    one is taken, a larger one waits for the next epoch), and that a checkpoint of an earlier
    release could not be checked for its files."""
    position = state.get("position", {})
    epoch = position.get("epoch", state.get("epoch", 0))
    files = position.get("files")
    if files is None:
        logger.warning(
            "resuming epoch %d from a checkpoint without the list of its files (an earlier "
            "release): cannot check that data.train_path still holds the files it began with "
            "(a file added, removed or rewritten since would shift its data position)",
            epoch,
        )
    else:
        added = file_changes(files, _file_list(job, train)).added
        if added:
            later = (
                f"read from epoch {epoch + 1} on"
                if epoch + 1 < job.training.num_epochs
                else f"not read by this run (training.num_epochs = {job.training.num_epochs})"
            )
            logger.warning(
                "%d file(s) added to data.train_path since epoch %d began (%s%s): the rest of "
                "the epoch reads the files it began with; these are %s",
                len(added),
                epoch,
                ", ".join(added[:3]),
                f" and {len(added) - 3} more" if added[3:] else "",
                later,
            )
    _log_resumed_window(position.get("window_rows", 0), epoch=epoch, job=job)


def _log_resumed_window(saved: int, *, epoch: int, job: JobConfig) -> None:
    configured = job.data.shuffle_window_rows
    window = resumed_window(saved, configured=configured)
    if window < saved:
        logger.warning(
            "epoch %d resumes with data.shuffle_window_rows = %d%s, smaller than the %d rows it "
            "began with: the rest of the epoch comes in other batches than the interrupted "
            "run's would have (each row still once)",
            epoch,
            configured,
            "" if configured else " (one row group a window, each in the order it had)",
            saved,
        )
    elif window < configured:
        logger.info(
            "epoch %d keeps the shuffle window it began with (%s): data.shuffle_window_rows = "
            "%d applies from the next epoch",
            epoch,
            f"{window} rows" if window else "none",
            configured,
        )


def resume_differences(state: dict[str, Any], *, job: JobConfig, plan: ShardingPlan) -> list[str]:
    """What a checkpoint's ``trainer_state.json`` (``state``) and the job disagree on that a
    resume cannot change: the model, the dense and sparse columns and their statistics (what
    a standardized value and a bucket mean), the sequences (which columns, how many events),
    the fused optimizer, the tables (names and shapes; tables that differ alike are named
    together); one phrase each, with both values."""
    spec = state["spec"]
    settings = _model_settings(spec, job=job)
    for key in ("dense_columns", "sparse_columns"):
        settings[f"data.{key}"] = (spec["data"][key], getattr(job.data, key))
    for key in ("dense_stats", "dense_fill_values", "bucket_boundaries"):  # older: may lack
        settings[f"data.{key}"] = (spec["data"].get(key, {}), getattr(job.data, key))
    # Which columns are one history, and how many of its events are kept.
    sequences = {n: dataclasses.asdict(s) for n, s in job.data.sequences.items()}
    settings["data.sequences"] = (spec["data"].get("sequences", {}), sequences)
    settings.update(_indicator_settings(spec, job=job))
    settings["sharding.optimizer"] = (spec["sharding"]["optimizer"], job.sharding.optimizer)
    out = [
        f"{key}: {theirs!r} in the checkpoint, {mine!r} in the config"
        for key, (theirs, mine) in settings.items()
        if _plain(theirs) != _plain(mine)
    ]
    saved = {t["name"]: (t["num_embeddings"], t["embedding_dim"]) for t in state["plan"]["tables"]}
    ours = {t.name: (t.num_embeddings, t.embedding_dim) for t in plan.tables}
    gone = [n for n in saved if n not in ours]
    new = [n for n in ours if n not in saved]
    if gone:
        out.append(f"{_names(gone)} {_are(gone)} in the checkpoint but not in the config")
    if new:
        out.append(f"{_names(new)} {_are(new)} in the config but not in the checkpoint")
    reshaped: dict[tuple, list[str]] = {}
    for n in ours:
        if n in saved and saved[n] != ours[n]:
            reshaped.setdefault((saved[n], ours[n]), []).append(n)
    for ((rows, dim), (rows2, dim2)), names in reshaped.items():
        out.append(
            f"{_names(names)}: {rows} x {dim} in the checkpoint, {rows2} x {dim2} in the config"
        )
    out += managed_mismatches(ShardingPlan.from_json(json.dumps(state["plan"])), plan)
    return out


def _indicator_settings(spec: dict[str, Any], *, job: JobConfig) -> dict[str, tuple[Any, Any]]:
    """The dense columns with a missing indicator (the model's dense input is one wider per
    column): (the checkpoint's, the job's); a checkpoint of a release before them has none."""
    data = spec.get("data") or {}
    specs = data.get("dense_specs") or {}
    default = data.get("dense_missing_indicator", False)
    own = {c: (specs.get(c) or {}).get("missing_indicator") for c in data.get("dense_columns", [])}
    theirs = [c for c, flag in own.items() if (default if flag is None else flag)]
    mine = job.data.missing_indicator_columns()
    return {"data.dense_missing_indicator (columns)": (theirs, mine)}


def _model_settings(
    spec: dict[str, Any], *, job: JobConfig, skip: tuple[str, ...] = ()
) -> dict[str, tuple[Any, Any]]:
    """``model.<key>``: (the checkpoint's value, the job's) for the model keys both know."""
    return {
        f"model.{k}": (v, getattr(job.model, k))
        for k, v in spec["model"].items()
        if hasattr(job.model, k) and k not in skip  # a knob of an older release: not compared
    }


def model_differences(
    state: dict[str, Any], *, job: JobConfig, skip: tuple[str, ...] = ()
) -> list[str]:
    """The model settings (but ``skip``) that a checkpoint's state and the job disagree on,
    one phrase each with both values."""
    return [
        f"{key}: {theirs!r} in the checkpoint, {mine!r} in the config"
        for key, (theirs, mine) in {
            **_model_settings(state["spec"], job=job, skip=skip),
            **_indicator_settings(state["spec"], job=job),
        }.items()
        if _plain(theirs) != _plain(mine)
    ]


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more tables"


def _are(names: list[str]) -> str:
    return "is" if len(names) == 1 else "are"


def _plain(value: Any) -> Any:
    """A config value as JSON has it (tuples as lists), for comparing with a stored one."""
    return json.loads(json.dumps(value))


@dataclass(frozen=True)
class WarmStart:
    uri: str
    """The checkpoint (a registered model's run's, for ``models:/``)."""
    filesystem: pafs.FileSystem
    path: str
    state: dict[str, Any]
    """Its ``trainer_state.json``."""

    @property
    def data(self) -> dict[str, Any]:
        """The data config its model was trained with, as stored (statistics, id kinds)."""
        return self.state["spec"]["data"]

    @property
    def checkpoint(self) -> ray.train.Checkpoint:
        if isinstance(self.filesystem, pafs.LocalFileSystem):
            return ray.train.Checkpoint(self.path)
        return ray.train.Checkpoint(self.path, filesystem=self.filesystem)


def warm_start_state(job: JobConfig) -> WarmStart:
    """The ``run.warm_start`` checkpoint and its state, read (not yet checked).

    Raises:
        ConfigError: naming the checkpoint when it cannot be read.
    """
    uri = job.run.warm_start
    assert uri is not None
    if uri.startswith("models:/"):  # a registered model: its run's final checkpoint
        try:
            uri = registered_checkpoint(uri, default_tracking_uri(job.tracking))
        except ConfigError as exc:
            raise ConfigError(f"run.warm_start: {exc}") from None
    try:
        filesystem, path = filesystem_for(uri, job.run.storage_or(job.data.storage))
        with filesystem.open_input_stream(f"{path}/{STATE_FILE}") as f:
            state = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"run.warm_start: {uri} is not a readable training checkpoint ({exc})"
        ) from None
    return WarmStart(uri=uri, filesystem=filesystem, path=path, state=state)


# Settings of the tower partitioner, not of the model: the towers it made are compared.
_PARTITIONER_KEYS = ("num_towers", "tower_warmup_steps")


def check_warm_start(warm: WarmStart, *, job: JobConfig, plan: ShardingPlan) -> None:
    """The ``run.warm_start`` checkpoint (:func:`warm_start_state`) checked against the job
    before the workers load it: it must be intact, hold the job's tables, names and shapes, and
    fused optimizer, and have been trained with the job's model (its architecture, layers and
    towers).

    Raises:
        ConfigError: naming the checkpoint and what does not match.
    """
    try:
        check_state_matches(warm.state, plan, job.sharding.optimizer, source=warm.uri)
        check_intact(warm.path, filesystem=warm.filesystem)
    except ValueError as exc:  # CheckpointDamagedError too
        raise ConfigError(f"run.warm_start: {exc}") from None
    differences = model_differences(warm.state, job=job, skip=_PARTITIONER_KEYS)
    if differences:
        raise ConfigError(
            f"run.warm_start: {warm.uri} was trained with another model: "
            f"{'; '.join(differences)} (its weights would load into other layers: warm-start "
            "from a checkpoint of this model, or train from scratch)"
        )
    state = warm.state
    logger.info(
        "warm start from %s (step %d, %d workers)", warm.uri, state["step"], state["world_size"]
    )
