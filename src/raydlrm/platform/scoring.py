"""Batch scoring and evaluation of a trained model over a Parquet data set, on Ray Data.

:func:`score` reads a data set (local or ``s3://``, only the columns the model needs plus the
ones to keep), scores it on a pool of Ray Data actors, each holding the unsharded model (the
same preprocessing as training: stable id hashing, dense transforms), and writes Parquet with
the kept columns (by default ``sample_id`` and the label, when present) and ``prediction``, the
click probability. :func:`evaluate` scores a labelled data set and returns AUC and log loss.

The model is a registered or logged MLflow model (``models:/name@champion``, ``models:/name/3``,
``runs:/<id>/model``) or a model checkpoint directory (``runs/<run>/checkpoint_...``), made
ready once on the driver as a local directory with ``model.safetensors`` (downloaded, or written
table by table from a training checkpoint: one given, or the one a model registered by
reference names). On a single-node cluster the actors map that file
(every actor shares the page cache; a model larger than RAM scores, its hot rows in memory); on
several nodes its files travel to the actors through Ray's object store, so the actors need
neither MLflow nor the driver's disk (the model must then fit the object store). Every row
gets a prediction: a bad row (null id, NaN dense value, ...) stops the job with a message
naming its file and column, instead of being dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from raydlrm.ingestion.clustered import file_row_groups
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.layout import ClusteredLayout, read_layout, sessions_file_of
from raydlrm.ingestion.reader import PREPROCESS_ACTOR_CPUS
from raydlrm.ingestion.schema import check_id_kinds
from raydlrm.storage import (
    PartitionSelector,
    StorageConfig,
    StorageError,
    filesystem_for,
    is_remote,
    list_files,
    scratch_directory,
)
from raydlrm.trainers.checkpoints import local_checkpoint
from raydlrm.trainers.metrics import binary_metrics
from raydlrm.trainers.model_dir import (
    METADATA_FILES,
    PLAN_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    find_model_dir,
    write_model_dir,
)

__all__ = ["PREDICTION_COLUMN", "ModelFiles", "ScoreResult", "evaluate", "model_files", "score"]

logger = logging.getLogger(__name__)

PREDICTION_COLUMN = "prediction"
_PATH_COLUMN = "path"  # Ray Data's include_paths column


@dataclass
class ScoreResult:
    """What a scoring or evaluation job did."""

    rows: int
    """Rows scored."""
    output: str | None
    """Where the predictions were written (None: evaluation into a temporary directory)."""
    seconds: float
    """Wall time of reading, scoring and writing."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """``auc`` and ``log_loss`` (evaluation only)."""
    unknown_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per managed table (``data.managed_ids``), lookups of ids its map does not hold: they
    read their bucket's fallback row (empty for a model without managed tables)."""


@dataclass
class ModelFiles:
    """A model ready to score: a local directory with ``model.safetensors``, its config, plan
    and metrics (a temporary copy when the model was downloaded or converted, removed by
    :meth:`close`). A context manager."""

    directory: Path
    """The model directory."""
    spec: dict[str, Any]
    """Its worker config (``spec.json``)."""
    _copies: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    def close(self) -> None:
        self._copies.close()

    def __enter__(self) -> ModelFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def model_files(model: str) -> ModelFiles:
    """The model of a checkpoint or exported model directory (local or ``s3://``, the store
    from the standard AWS variables), or of an MLflow model URI, as a local directory with
    ``model.safetensors`` (see :class:`ModelFiles`).

    Raises:
        FileNotFoundError: naming the model when it holds no raydlrm model.
    """
    copies = contextlib.ExitStack()

    def scratch() -> str:
        return copies.enter_context(scratch_directory("model"))

    try:
        if is_remote(model):
            try:
                root = copies.enter_context(local_checkpoint(model, StorageConfig()))
            except (StorageError, FileNotFoundError) as exc:
                raise FileNotFoundError(f"model {exc}") from exc
        elif Path(model).is_dir():
            root = Path(model)
        else:
            import mlflow

            try:
                root = Path(
                    mlflow.artifacts.download_artifacts(artifact_uri=model, dst_path=scratch())
                )
            except Exception as exc:  # MlflowException, OSError: a model that is not there
                raise FileNotFoundError(f"model {model} cannot be loaded: {exc}") from exc
        directory = find_model_dir(root) or root
        for name in (SPEC_FILE, PLAN_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"model {model} has no {name}")
        if not (directory / WEIGHTS_FILE).is_file():
            # A training checkpoint (or a model referencing one): its tables, one at a time,
            # into a safetensors file that the actors can map.
            directory = write_model_dir(directory, Path(scratch(), "model"))
        spec = json.loads((directory / SPEC_FILE).read_text())
    except BaseException:
        copies.close()
        raise
    return ModelFiles(directory=directory, spec=spec, _copies=copies)


def _model_for_actors(files: ModelFiles) -> dict[str, Any]:
    """How the scoring actors get the model: its directory, and on a cluster of several nodes
    (where an actor may not see the driver's disk) its files through the object store."""
    import ray

    weights = files.directory / WEIGHTS_FILE
    shipped = None
    if sum(1 for node in ray.nodes() if node.get("Alive")) > 1:
        blobs = {
            p.name: p.read_bytes()
            for p in files.directory.iterdir()
            if p.name in (WEIGHTS_FILE, *METADATA_FILES)
        }
        shipped = [ray.put(blobs)]  # in a list: Ray Data passes the reference, not its value
    return {
        "directory": str(files.directory),
        "weights_bytes": weights.stat().st_size,
        "files_ref": shipped,
    }


class _UnknownIds:
    """A Ray actor summing the scoring actors' counts of ids unknown to managed tables."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, counts: dict[str, int]) -> None:
        for table, n in counts.items():
            self.counts[table] = self.counts.get(table, 0) + n

    def total(self) -> dict[str, int]:
        return dict(self.counts)


class _Scorer:
    """A Ray Data actor: the unsharded model, scoring raw Arrow batches; the lookups of ids
    its managed tables do not know are added to ``unknown`` (an :class:`_UnknownIds` actor)
    after each batch."""

    def __init__(self, model: dict[str, Any], keep: list[str], unknown: Any = None) -> None:
        import torch

        from raydlrm.ingestion import Preprocessor
        from raydlrm.trainers.model_dir import load_model_checkpoint

        torch.set_num_threads(1)
        weights = Path(model["directory"], WEIGHTS_FILE)
        if weights.is_file() and weights.stat().st_size == model["weights_bytes"]:
            # The driver's file, mapped: actors on this node share its pages.
            loaded = load_model_checkpoint(model["directory"])
        else:
            import ray

            if model["files_ref"] is None:
                raise FileNotFoundError(f"scoring actor: no model at {weights}")
            files: dict[str, bytes] = ray.get(model["files_ref"][0])
            with scratch_directory("scorer") as tmp:
                for name, blob in files.items():
                    Path(tmp, name).write_bytes(blob)
                loaded = load_model_checkpoint(tmp)  # mapped; the mapping outlives the file
        self.model = loaded.model
        # Every row is scored or the job stops: nothing is set aside.
        self.data = dataclasses.replace(loaded.spec.data, bad_input="fail")
        self.preprocess = Preprocessor(self.data)
        self.keep = keep
        self.unknown, self._counted = unknown, None

    def __call__(self, table: pa.Table) -> pa.Table:
        from raydlrm.ingestion.badinput import BadInputError
        from raydlrm.platform.export import score_table

        try:
            probs = score_table(self.model, self.preprocess, self.data, table)
        except BadInputError:
            # A batch may span files: the one of the first bad row (the driver finds its row).
            found = _first_bad_row(table, self.data)
            assert found is not None, "the preprocessor refuses what find_bad_rows finds"
            row, reason = found
            raise BadInputError(f"{table.column(_PATH_COLUMN)[row].as_py()}: {reason}") from None
        self._count_unknown()
        out = table.select([c for c in self.keep if c in table.column_names])
        return out.append_column(PREDICTION_COLUMN, pa.array(probs, pa.float32()))

    def _count_unknown(self) -> None:
        """Adds the unknown-id lookups of the batch just scored to the job's count (waiting
        for it: the driver reads the count once the output is written)."""
        if self.unknown is None:
            return
        import ray

        now = self.model.embedding_bags.id_maps.unknown()
        before = self._counted or dict.fromkeys(now, 0)
        self._counted = now
        ray.get(self.unknown.add.remote({t: n - before[t] for t, n in now.items()}))


def _check_sizes(*, batch_size: int, num_actors: int) -> None:
    """Raises ``ValueError`` naming the argument (and its command-line option) below 1."""
    for name, value in (("batch_size", batch_size), ("num_actors", num_actors)):
        if value < 1:
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{name} ({option}) must be at least 1, got {value}")


def score(
    model: str,
    data: str,
    output: str,
    *,
    keep: list[str] | None = None,
    storage: StorageConfig | None = None,
    partitions: dict[str, PartitionSelector] | None = None,
    batch_size: int = 4096,
    num_actors: int = 2,
) -> ScoreResult:
    """Scores every row of a Parquet data set with Ray Data and writes the predictions.

    Args:
        model: an MLflow model URI or a model checkpoint directory.
        data: the data set (a file or directory, local or ``s3://``).
        output: a directory for the prediction Parquet files (local or ``s3://``).
        keep: input columns to copy next to ``prediction`` (default: ``sample_id`` and the
            model's label column, those present).
        storage: object-store access for ``s3://`` paths (default: the AWS environment).
        partitions: the hive partitions of ``data`` to score (default: all files).
        batch_size: rows per scoring batch.
        num_actors: the most scoring actors (each holds a copy of the model).

    Raises:
        FileNotFoundError: the model or the data is missing.
        ValueError: ``batch_size`` or ``num_actors`` below 1, ``output`` holds files already
            (checked first), or the data lacks a column the model needs (named).
        DataValidationError: a sparse column holds ids of another kind (integer or string)
            than the model was trained on (named, with both kinds).
    """
    _check_sizes(batch_size=batch_size, num_actors=num_actors)
    _check_output(output, storage or StorageConfig())
    with model_files(model) as files:
        return _score(
            files,
            data,
            output,
            keep=keep,
            storage=storage or StorageConfig(),
            partitions=partitions or {},
            batch_size=batch_size,
            num_actors=num_actors,
        )


def _check_output(output: str, storage: StorageConfig) -> None:
    """Checks that ``output`` (local or ``s3://``) is a new or empty directory: Ray Data adds
    its files to what is there, and a second scoring into the same directory would mix two
    sets of predictions.

    Raises:
        ValueError: naming ``output`` when it is a file or a directory that holds files.
    """
    filesystem, path = filesystem_for(output, storage)
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return
    if info.type != pafs.FileType.Directory or filesystem.get_file_info(pafs.FileSelector(path)):
        raise ValueError(f"output {output} exists and is not empty: give a new directory")


@dataclass(frozen=True)
class _Source:
    """The data set to score: its files (of a session-clustered set, the samples files, each
    read with its sessions file), their filesystem, the raw schema and the row count."""

    data: str
    filesystem: pafs.FileSystem
    paths: list[str]
    schema: pa.Schema
    num_rows: int
    layout: ClusteredLayout | None
    root: str

    @classmethod
    def of(cls, data: str, storage: StorageConfig, partitions: dict) -> _Source:
        filesystem, paths = list_files(data, storage, partitions, role="scoring")
        footers = []
        for path in paths:
            with filesystem.open_input_file(path) as f:
                footers.append(pq.read_metadata(f))
        schema = footers[0].schema.to_arrow_schema()
        layout, root = read_layout(data, storage), filesystem_for(data, storage)[1]
        if layout is not None:  # the per-session columns are in the sessions files
            with filesystem.open_input_file(sessions_file_of(paths[0], root=root)) as f:
                sessions = pq.read_schema(f)
            for name in layout.session_columns:
                if name in sessions.names and name not in schema.names:
                    schema = schema.append(sessions.field(name))
        rows = sum(footer.num_rows for footer in footers)
        return cls(data, filesystem, paths, schema, rows, layout, root)

    def row_groups(self, file: str, columns: list[str]) -> Iterator[pa.Table]:
        """``file``'s rows of ``columns``, a row group at a time."""
        return file_row_groups(
            file, filesystem=self.filesystem, root=self.root, layout=self.layout, columns=columns
        )

    def dataset(self, columns: list[str]) -> Any:
        """A Ray Data dataset of the rows' ``columns`` and their file (to name a bad row's)."""
        import ray.data

        if self.layout is None:
            return ray.data.read_parquet(
                self.paths, filesystem=self.filesystem, columns=columns, include_paths=True
            )
        files = ray.data.from_items([{"file": p} for p in self.paths])
        return files.map_batches(
            _read_clustered,
            fn_kwargs={"source": self, "columns": columns},
            batch_size=1,
            batch_format="pyarrow",
        )


def _read_clustered(files: pa.Table, source: _Source, columns: list[str]) -> Iterator[pa.Table]:
    """A Ray Data task: the rows of session-clustered files, joined with their sessions."""
    for file in files.column("file").to_pylist():
        for table in source.row_groups(file, columns):
            yield table.append_column(_PATH_COLUMN, pa.array([file] * table.num_rows))


def _bad_input_cause(exc: BaseException) -> BaseException | None:
    """The :class:`BadInputError` behind an error of Ray Data's actors, if any. Ray Data
    re-raises a UDF's error as a ``UserCodeException`` that keeps only its text, so the error
    is found by its name in the message and raised again with its own message."""
    from raydlrm.ingestion.badinput import BadInputError

    marker = f"{BadInputError.__name__}: "
    for line in str(exc).splitlines():
        if marker in line:
            return BadInputError(line.split(marker, 1)[1].strip())
    return None


def _first_bad_row(table: pa.Table, data: DataConfig) -> tuple[int, str] | None:
    """The index and reason of the first row of raw ``table`` that cannot be scored (its label
    is not scored, so not checked), or None."""
    from raydlrm.ingestion.badinput import find_bad_rows
    from raydlrm.platform.export import with_zero_labels

    bad, reasons = find_bad_rows(with_zero_labels(table, data), data)
    if not bad.any():
        return None
    first = int(np.flatnonzero(bad)[0])
    return first, str(reasons[first])


def _bad_row_located(
    cause: BaseException, *, source: _Source, data: DataConfig, columns: list[str]
) -> BaseException:
    """The bad row a scoring actor named by its file (``<file>: <reason>``), with its row
    group and row, found by reading that file again; ``cause`` as it is when it names no file
    of ``paths``. Scoring refuses bad rows whatever ``data.bad_input`` says (it applies to
    training), so the message suggests no quarantine."""
    from raydlrm.ingestion.badinput import BadInputError

    file = next((p for p in source.paths if str(cause).startswith(f"{p}: ")), None)
    if file is None:
        return cause
    for group, table in enumerate(source.row_groups(file, columns)):
        found = _first_bad_row(table, data)
        if found is not None:
            row, reason = found
            return BadInputError(
                f"bad input in {file}, row group {group}, row {row}: {reason} (scoring "
                "takes every row: fix or remove it)"
            )
    return cause


def _data_config(files: ModelFiles) -> DataConfig:
    from raydlrm.trainers.spec import WorkerSpec

    return WorkerSpec(**files.spec).data


def _columns_to_keep(
    data: str,
    schema: pa.Schema,
    *,
    needed: list[str],
    keep: list[str] | None,
    label: str,
) -> list[str]:
    """The columns scored rows keep beside the prediction (default: ``sample_id`` and the label
    where present), after checking that the data holds the model's inputs.

    Raises:
        ValueError: naming the data set and the missing columns.
    """
    missing = [c for c in needed if c not in schema.names]
    if missing:
        raise ValueError(f"data set {data} lacks the model's input columns {missing}")
    if keep is None:
        keep = [c for c in ("sample_id", label) if c in schema.names]
    absent = [c for c in keep if c not in schema.names]
    if absent:
        raise ValueError(f"data set {data} has no columns {absent} to keep")
    return keep


def _score(
    files: ModelFiles,
    data: str,
    output: str,
    *,
    keep: list[str] | None,
    storage: StorageConfig,
    partitions: dict[str, PartitionSelector],
    batch_size: int,
    num_actors: int,
) -> ScoreResult:
    import ray
    import ray.data

    data_config = _data_config(files)
    source = _Source.of(data, storage, partitions)
    schema = source.schema
    needed = [c for c in data_config.input_columns() if c != data_config.label_column]
    keep = _columns_to_keep(data, schema, needed=needed, keep=keep, label=data_config.label_column)
    check_id_kinds(schema, data_config, what=f"data set {data}")
    started = time.perf_counter()
    if not ray.is_initialized():
        from raydlrm.platform.config import load_config
        from raydlrm.platform.ray_init import init_ray

        init_ray(load_config(None))
    dataset = source.dataset(list(dict.fromkeys(needed + keep)))
    unknown = ray.remote(num_cpus=0)(_UnknownIds).remote() if data_config.managed_ids else None
    scored = _scored(
        dataset,
        files=files,
        keep=keep,
        batch_size=batch_size,
        num_actors=num_actors,
        unknown=unknown,
    )
    out_fs, out_path = filesystem_for(output, storage)
    try:
        scored.write_parquet(out_path, filesystem=out_fs)
    except Exception as exc:
        cause = _bad_input_cause(exc)
        if cause is None:
            raise exc from None
        raise _bad_row_located(cause, source=source, data=data_config, columns=needed) from None
    rows = pads.dataset(out_path, filesystem=out_fs, format="parquet").count_rows()
    expected = source.num_rows
    if rows != expected:
        raise RuntimeError(f"scored {rows} rows of {expected} in {data}: output {output}")
    seconds = time.perf_counter() - started
    counts: dict[str, int] = {}
    if unknown is not None:
        counts = ray.get(unknown.total.remote())
        ray.kill(unknown)
    # (The command line prints the result; an evaluation's output is a directory it deletes.)
    logger.debug("scored %d rows of %s in %.1fs into %s", rows, data, seconds, output)
    return ScoreResult(rows=rows, output=output, seconds=seconds, unknown_ids=counts)


def _scored(
    dataset: Any,
    *,
    files: ModelFiles,
    keep: list[str],
    batch_size: int,
    num_actors: int,
    unknown: Any = None,
) -> Any:
    """``dataset`` scored by a pool of :class:`_Scorer` actors (a lazy Ray Data dataset)."""
    import ray.data
    from ray.util.annotations import RayDeprecationWarning

    with warnings.catch_warnings():
        # Ray 2.60 takes max_restarts only as one of map_batches' **ray_remote_args, which it
        # says are to go in Ray 2.64 (with no named replacement yet).
        warnings.filterwarnings("ignore", "`ray_remote_args`", RayDeprecationWarning)
        return dataset.map_batches(
            _Scorer,
            fn_constructor_kwargs={
                "model": _model_for_actors(files),
                "keep": keep,
                "unknown": unknown,
            },
            batch_size=batch_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, num_actors)),
            num_cpus=PREPROCESS_ACTOR_CPUS,
            # No actor restarts: Ray Data passes an actor's constructor arguments through the
            # object store, from where a restart may not get them back, and Ray's core says so
            # in an ERROR line per actor (ray-project/ray#53727) on every run's screen. A
            # scoring job that lost an actor is rerun instead.
            max_restarts=0,
        )


def evaluate(
    model: str | ModelFiles,
    data: str,
    *,
    output: str | None = None,
    storage: StorageConfig | None = None,
    partitions: dict[str, PartitionSelector] | None = None,
    batch_size: int = 4096,
    num_actors: int = 2,
) -> ScoreResult:
    """Scores a labelled data set (its selected ``partitions``, default all) and returns AUC
    and log loss (and the predictions under ``output`` when given).

    ``model`` is a model URI or directory, or :func:`model_files` of one.

    Raises:
        ValueError: the data set has no label column, or ``output`` holds files already.
    """
    _check_sizes(batch_size=batch_size, num_actors=num_actors)
    if output is not None:
        _check_output(output, storage or StorageConfig())
    if not isinstance(model, ModelFiles):
        with model_files(model) as files:
            return evaluate(
                files,
                data,
                output=output,
                storage=storage,
                partitions=partitions,
                batch_size=batch_size,
                num_actors=num_actors,
            )
    files = model
    label = _data_config(files).label_column
    storage = storage or StorageConfig()
    with scratch_directory("eval") as tmp:
        target = output or str(Path(tmp, "predictions"))
        result = _score(
            files,
            data,
            target,
            keep=[label],
            storage=storage,
            partitions=partitions or {},
            batch_size=batch_size,
            num_actors=num_actors,
        )
        out_fs, out_path = filesystem_for(target, storage)
        table = pads.dataset(out_path, filesystem=out_fs, format="parquet").to_table()
    result.output = output
    result.metrics = {**_metrics(table, label=label), "rows": float(result.rows)}
    return result


def _metrics(table: pa.Table, *, label: str) -> dict[str, float]:
    """AUC, log loss and normalized entropy of the predictions in ``table``: the training
    metrics' definitions (raydlrm.trainers.metrics), on the predicted probabilities' logits
    (clipped to 1e-7 from 0 and 1 as the log loss needs)."""
    labels = torch.from_numpy(table.column(label).to_numpy().astype(np.float64))
    probs = torch.from_numpy(table.column(PREDICTION_COLUMN).to_numpy().astype(np.float64))
    metrics = binary_metrics(torch.logit(probs, eps=1e-7), labels)
    return {
        "auc": metrics.auc,
        "log_loss": metrics.log_loss,
        "normalized_entropy": metrics.normalized_entropy,
    }
