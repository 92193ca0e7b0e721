"""The trained model as an MLflow model that scores raw feature rows.

The logged model is an MLflow ``pyfunc``: its artifacts are a model directory (the config,
plan and metrics, and the weights; see ``raydlrm.trainers.model_dir``) and its ``predict``
takes a pandas DataFrame of raw rows, shaped like the training Parquet (dense and sparse
columns; the label is not needed), applies the same preprocessing as training (the same stable
id hashing and dense transform) and returns click probabilities. It needs neither
Ray nor a process group.

A run's final model holds its weights in one of two ways (``tracking.model_weights``):

* **by reference** (``reference``; ``auto`` where the registry can reach the run storage): the
  model directory holds ``weights_ref.json``, the URI of the run's final checkpoint, whose
  shards are the weights (no copy is written: the run's tables stay the only copy). Loading
  reads them from there (downloaded first when remote). The checkpoint must stay where the run
  stored it; ``raydlrm export`` makes a standalone copy.
* **by copy** (``copy``; ``auto`` otherwise, said in one line): ``model.safetensors`` written
  from the checkpoint's shards one table at a time, memory-mapped when loaded, and stored with
  the model in MLflow's artifact store.

``auto`` references a checkpoint in an object store (``s3://``) always, and one on this
machine's disk when the tracking store is on this machine too (a SQLite or file store, or a
server on loopback); it copies a local checkpoint for a tracking server elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from raydlrm._logs import quiet_libraries
from raydlrm.ingestion import DataConfig, Preprocessor, arrow_to_batch
from raydlrm.ingestion.badinput import BadInputError
from raydlrm.ingestion.clustered import read_rows
from raydlrm.ingestion.schema import check_id_kinds
from raydlrm.storage import is_remote, scratch_directory
from raydlrm.trainers import WorkerSpec, load_model_checkpoint
from raydlrm.trainers.checkpoints import STATE_FILE, check_intact, local_checkpoint
from raydlrm.trainers.model_delta import write_model_delta
from raydlrm.trainers.model_dir import (
    FINAL_METRICS_FILE,
    METRICS_FILE,
    PLAN_FILE,
    REFERENCE_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    find_model_dir,
    model_metrics,
    write_model_dir,
)
from raydlrm.trainers.model_prune import prune_model_dir, prune_rules
from raydlrm.trainers.retrieval import (
    TARGET_RANK_COLUMN,
    TOP_ITEMS_COLUMN,
    TOP_SCORES_COLUMN,
    item_shard,
)

__all__ = [
    "RecModelPythonModel",
    "example_rows",
    "export_model",
    "log_model",
    "register_version",
    "retrieve_table",
    "run_model_dir",
    "save_model",
    "score_table",
    "set_experiment",
    "weights_by_reference",
]

logger = logging.getLogger(__name__)

MODEL_ARTIFACT = "model"
_EXAMPLE_ROWS = 5
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_REQUIREMENTS = ("numpy", "pandas", "pyarrow", "pydantic", "scikit-learn", "mlflow", "ray")


class RecModelPythonModel(mlflow.pyfunc.PythonModel):
    """Scores raw feature rows with an unsharded model restored from a checkpoint."""

    def load_context(self, context: Any) -> None:
        loaded = load_model_checkpoint(context.artifacts["checkpoint"])
        self._model = loaded.model
        self._data = loaded.spec.data
        self._k = max(loaded.spec.model.retrieval_k)
        self._preprocess = Preprocessor(loaded.spec.data)

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: Any = None
    ) -> np.ndarray | pd.DataFrame:
        """Click probabilities, shape ``(N,)``, for ``N`` raw rows (a pandas DataFrame); a
        retrieval model's top-K items per row instead (:func:`retrieve_table`'s columns).

        Raises:
            DataValidationError: a sparse column holds ids of another kind (integer or string)
                than the model was trained on (named, with both kinds).
        """
        table = pa.Table.from_pandas(pd.DataFrame(model_input), preserve_index=False)
        check_id_kinds(table.schema, self._data, what="model input")
        if self._model.retrieval is not None:
            return retrieve_table(
                self._model, self._preprocess, self._data, table, k=self._k
            ).to_pandas()
        return score_table(self._model, self._preprocess, self._data, table)


def score_table(
    model: torch.nn.Module, preprocess: Preprocessor, data: DataConfig, table: pa.Table
) -> np.ndarray:
    """Click probabilities, shape ``(N,)``, of ``N`` raw rows (an Arrow table with the model's
    input columns; a label column, if any, is ignored)."""
    batch = arrow_to_batch(preprocess(with_zero_labels(table, data)), config=data)
    with torch.no_grad():
        return torch.sigmoid(model(batch)).numpy()


def retrieve_table(
    model: torch.nn.Module,
    preprocess: Preprocessor,
    data: DataConfig,
    table: pa.Table,
    *,
    k: int,
) -> pa.Table:
    """A retrieval model's top ``k`` items of each of ``N`` raw rows, ranked against the whole
    item table, and the rank of each row's target item: the columns
    :data:`TOP_ITEMS_COLUMN`, :data:`TOP_SCORES_COLUMN`, :data:`TARGET_RANK_COLUMN`."""
    from raydlrm.sharding.retrieval import target_ranks, top_k

    batch = arrow_to_batch(preprocess(with_zero_labels(table, data)), config=data)
    features = model.retrieval
    items = item_shard(model)
    with torch.no_grad():
        queries = model.user_vectors(batch)
        best = top_k(queries, k=min(k, items.num_embeddings), items=items)
        every = batch.all_sparse()
        ranked = every.select([features.history]).lengths > 0
        ranks = torch.full((batch.batch_size,), -1, dtype=torch.int64)
        ranks[ranked] = target_ranks(
            queries[ranked], targets=every.select([features.target]).values[ranked], items=items
        )
    width = best.rows.shape[1]
    offsets = pa.array(np.arange(0, (batch.batch_size + 1) * width, width, dtype=np.int32))
    return pa.table(
        {
            TOP_ITEMS_COLUMN: pa.ListArray.from_arrays(offsets, best.rows.reshape(-1).numpy()),
            TOP_SCORES_COLUMN: pa.ListArray.from_arrays(
                offsets, best.scores.reshape(-1).numpy().astype(np.float32)
            ),
            TARGET_RANK_COLUMN: pa.array(ranks.numpy()),
        }
    )


def with_zero_labels(table: pa.Table, data: DataConfig) -> pa.Table:
    """``table`` with its label column (if any) replaced by zeros: the preprocessor expects a
    label; scoring has none (or must not use it)."""
    if data.label_column is None:  # no label to hide: the preprocessor makes zeros
        return table
    labels = pa.array(np.zeros(table.num_rows, dtype=np.float32))
    if data.label_column in table.column_names:
        table = table.drop_columns([data.label_column])
    return table.append_column(data.label_column, labels)


def example_rows(path: str, data: DataConfig, *, role: str = "train") -> pd.DataFrame:
    """A few raw input rows (no label) of the ``train`` or ``eval`` data set (its partitions),
    for a model signature.

    Raises:
        BadInputError: no file under ``path`` can be read.
    """
    columns = [c for c in data.input_columns() if c != data.label_column]
    try:  # the first readable rows (a quarantined data set may hold broken files)
        rows = read_rows(path, data, columns=columns, max_rows=_EXAMPLE_ROWS, role=role)
    except BadInputError as exc:
        raise BadInputError(f"for the model signature: {exc}") from None
    return rows.select([c for c in columns if c in rows.column_names]).to_pandas()


def _signature(example: pd.DataFrame, *, retrieval: bool) -> mlflow.models.ModelSignature:
    """The model's signature: the example's columns in, a click probability out (a retrieval
    model: its top items, their scores and the target's rank, :func:`retrieve_table`).
    Written from the columns rather than inferred: inference warns about every integer column
    (it might hold missing values; the preprocessing rejects or maps those itself)."""
    from mlflow.types import ColSpec, Schema
    from mlflow.types.schema import Array

    columns = [ColSpec(_column_type(example[name]), str(name)) for name in example.columns]
    outputs = [ColSpec("float")]
    if retrieval:
        outputs = [
            ColSpec(Array("long"), TOP_ITEMS_COLUMN),
            ColSpec(Array("float"), TOP_SCORES_COLUMN),
            ColSpec("long", TARGET_RANK_COLUMN),
        ]
    return mlflow.models.ModelSignature(inputs=Schema(columns), outputs=Schema(outputs))


def _column_type(values: pd.Series) -> Any:
    """MLflow's type of a column: ``long``/``integer``, ``double``/``float``, ``boolean``,
    ``string``, or an ``Array`` of one of them for a multi-valued (list) column."""
    from mlflow.types.schema import Array

    dtype = values.dtype
    if dtype.kind in "iu":
        return "long" if dtype.itemsize == 8 else "integer"
    if dtype.kind == "f":
        return "double" if dtype.itemsize == 8 else "float"
    if dtype.kind == "b":
        return "boolean"
    first = next((v for v in values if v is not None), None)
    if isinstance(first, list | tuple | np.ndarray):
        return Array(_column_type(pd.Series(list(first))))
    return "string"


def _is_retrieval(model_dir: Path) -> bool:
    """Whether the model in ``model_dir`` is a retrieval model (its stored config's arch)."""
    from raydlrm.trainers.spec import WorkerSpec

    spec = WorkerSpec.stored(json.loads((model_dir / SPEC_FILE).read_text()))
    return spec.model.retrieval


def _pyfunc_kwargs(model_dir: Path, example: pd.DataFrame) -> dict[str, Any]:
    """What ``mlflow.pyfunc.log_model`` and ``save_model`` take to store the model."""
    # The raydlrm source travels with the model (code_paths); these are what it imports.
    # Scoring runs the unsharded model in PyTorch operators: no fbgemm.
    requirements = [
        f"torch=={metadata.version('torch').split('+')[0]}",
        *(f"{name}=={metadata.version(name)}" for name in _REQUIREMENTS),
    ]
    return {
        # Models from code: loading runs this file (no pickled scorer in the model).
        "python_model": str(Path(__file__).with_name("_pyfunc_model.py")),
        "artifacts": {"checkpoint": str(model_dir)},
        "signature": _signature(example, retrieval=_is_retrieval(model_dir)),
        "input_example": example,
        "pip_requirements": requirements,
        # The raydlrm package (this file is raydlrm/platform/export.py).
        "code_paths": [str(Path(__file__).resolve().parents[1])],
    }


def _checked_export(
    checkpoint_dir: str | Path, *, output: str | Path | None, register: str | None
) -> WorkerSpec:
    """The checkpoint's config, once the export is known to be able to finish: before
    anything is read from the shards or written (a damaged checkpoint, an output directory in
    the way).

    Raises:
        ValueError: no destination, or an output directory that is not empty.
        CheckpointDamagedError: a training checkpoint whose files do not match its manifests.
        FileNotFoundError: the checkpoint holds no model.
    """
    if output is None and register is None:
        raise ValueError("export needs an output directory or a registered model name")
    if output is not None and Path(output).exists() and any(Path(output).iterdir()):
        raise ValueError(f"--output {output} exists and is not empty: give a new directory")
    if Path(checkpoint_dir, STATE_FILE).is_file():
        check_intact(checkpoint_dir)
    spec_file = Path(checkpoint_dir, SPEC_FILE)
    if not spec_file.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint_dir} has no {SPEC_FILE}: not a model")
    return WorkerSpec.stored(json.loads(spec_file.read_text()))


@contextlib.contextmanager
def _model_dir(checkpoint_dir: str | Path) -> Iterator[Path]:
    """The checkpoint's model directory (weights assembled from the shards one table at a
    time), in a temporary directory for the duration of the block."""
    with scratch_directory("export") as tmp:
        yield write_model_dir(checkpoint_dir, Path(tmp, "checkpoint"))


def _export_delta(
    checkpoint_dir: str | Path, since: str | Path, *, output: str | Path | None, pruned: bool
) -> dict[str, str]:
    """A delta export (see :func:`export_model`'s ``since``)."""
    if output is None or pruned:
        raise ValueError("a delta export (--since) writes to --output, and cannot be pruned")
    base = find_model_dir(since)
    if base is None:
        raise FileNotFoundError(f"--since {since}: no model directory there")
    with contextlib.ExitStack() as stack:
        if not Path(base, WEIGHTS_FILE).is_file():  # a checkpoint: its weights assembled
            base = stack.enter_context(_model_dir(base))
        new = stack.enter_context(_model_dir(checkpoint_dir))
        info = write_model_delta(new, base, output)
    rows = ", ".join(f"{t} {n:,}" for t, n in sorted(info["rows"].items()))
    return {"path": str(output), "rows": rows}


def save_model(checkpoint_dir: str | Path, path: str | Path, example: pd.DataFrame) -> Path:
    """Writes the checkpoint's model as a self-contained MLflow pyfunc model directory
    (``mlflow.pyfunc.load_model(path)`` scores raw rows; no Ray, no MLflow server)."""
    with _model_dir(checkpoint_dir) as model_dir:
        return _save(model_dir, path, example)


def _save(model_dir: Path, path: str | Path, example: pd.DataFrame) -> Path:
    mlflow.pyfunc.save_model(path=str(path), **_pyfunc_kwargs(model_dir, example))
    logger.debug("saved model to %s", path)  # the caller says where (the command line once)
    return Path(path)


def weights_by_reference(
    mode: Literal["auto", "reference", "copy"], checkpoint_uri: str, tracking_uri: str
) -> bool:
    """Whether a run's model is logged with its weights referenced at its final checkpoint
    ``checkpoint_uri`` rather than copied (``tracking.model_weights``; see the module
    docstring). ``auto`` says in one line why it copies."""
    if mode != "auto":
        return mode == "reference"
    reason = _cannot_reference(checkpoint_uri, tracking_uri)
    if reason:
        logger.info("the model's weights are logged by copy: %s", reason)
    return reason is None


def _cannot_reference(checkpoint_uri: str, tracking_uri: str) -> str | None:
    """Why the registry at ``tracking_uri`` could not load weights left at ``checkpoint_uri``,
    or None when it can."""
    if is_remote(checkpoint_uri):
        return None
    tracking = urlparse(tracking_uri)
    local_store = tracking.scheme in ("", "file", "sqlite") and tracking_uri != "databricks"
    if local_store or tracking.hostname in _LOOPBACK:
        return None
    return (
        f"the checkpoint {checkpoint_uri} is on this machine's disk, the tracking server "
        f"({tracking.scheme}://{tracking.hostname}) is not (set run.storage_path to an object "
        "store to register by reference)"
    )


@contextlib.contextmanager
def run_model_dir(checkpoint: Any, uri: str, *, by_reference: bool) -> Iterator[Path]:
    """The model directory to log for a run's final checkpoint (a Ray Train ``Checkpoint``:
    ``path``, ``filesystem``; ``uri``: its URI), for the duration of the block: a reference to
    it (its config, plan and metrics files copied, nothing else read), or its weights assembled
    from its shards (and its chain's)."""
    filesystem = checkpoint.filesystem or pafs.LocalFileSystem()
    if not by_reference:
        with (
            local_checkpoint(checkpoint.path, filesystem=filesystem) as directory,
            _model_dir(directory) as model_dir,
        ):
            yield model_dir
        return
    with scratch_directory("export") as tmp:
        target = Path(tmp, "checkpoint")
        target.mkdir()
        for name in (SPEC_FILE, PLAN_FILE, METRICS_FILE, FINAL_METRICS_FILE):
            path = f"{checkpoint.path.rstrip('/')}/{name}"
            if filesystem.get_file_info(path).type == pafs.FileType.File:  # metrics: optional
                with filesystem.open_input_stream(path) as f:
                    Path(target, name).write_bytes(f.read())
        # One metrics file, the final evaluation's over the checkpoint's, as write_model_dir.
        metrics = model_metrics(target)
        Path(target, FINAL_METRICS_FILE).unlink(missing_ok=True)
        Path(target, METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
        Path(target, REFERENCE_FILE).write_text(json.dumps({"checkpoint": uri}))
        yield target


def log_model(
    *,
    run_id: str,
    model_dir: Path,
    example: pd.DataFrame,
    registered_model_name: str | None,
    tags: dict[str, str] | None = None,
) -> mlflow.models.model.ModelInfo:
    """Logs a model directory (:func:`run_model_dir`) as a pyfunc model on run ``run_id`` and
    registers it if a name is given.

    Args:
        run_id: the job's MLflow run.
        model_dir: a model directory (``raydlrm.trainers.model_dir``).
        example: a few raw input rows, used for the model signature and input example.
        registered_model_name: registry name, or None to log without registering.
        tags: the registered version's tags.
    """
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(name=MODEL_ARTIFACT, **_pyfunc_kwargs(model_dir, example))
    if registered_model_name:
        info.registered_model_version = register_version(
            info.model_uri, registered_model_name, run_id=run_id, tags=tags
        )
    logger.debug(
        "logged model %s%s",
        info.model_uri,
        f" as {registered_model_name} v{info.registered_model_version}"
        if registered_model_name
        else "",
    )
    return info


def register_version(
    model_uri: str,
    name: str,
    *,
    run_id: str,
    tags: dict[str, str] | None = None,
    client: mlflow.MlflowClient | None = None,
) -> int:
    """Registers a logged model (``models:/m-<id>``) as a new version of ``name`` (created if
    new), with ``tags``, through the client API (``mlflow.register_model`` prints what it does
    to stderr, on a screen that is otherwise quiet); returns the version."""
    from mlflow.exceptions import MlflowException

    client = client or mlflow.MlflowClient()
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(
        name,
        source=model_uri,
        run_id=run_id,
        tags=tags,
        model_id=model_uri.removeprefix("models:/"),
    )
    return int(version.version)


def tagged_version(
    name: str, *, run_id: str, tags: dict[str, str], client: mlflow.MlflowClient
) -> Any | None:
    """The version of ``name`` registered from run ``run_id`` with ``tags`` (None: none, or
    no such registered model)."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    except MlflowException:
        return None
    for version in versions:
        if all(version.tags.get(k) == v for k, v in tags.items()):
            return version
    return None


def set_experiment(name: str, *, tracking_uri: str | None = None) -> Any:
    """``mlflow.set_experiment(name)`` on ``tracking_uri`` (default: MLflow's), except that a
    new experiment in a local SQLite store keeps its artifacts next to the database
    (``<its directory>/mlruns/<name>``). MLflow's default is ``mlruns/`` under the working
    directory, which under ``ray job submit`` is Ray's temporary copy of the upload, deleted
    with the job (taking the registered model's files with it)."""
    from mlflow.exceptions import MlflowException

    uri = tracking_uri or mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    root = _local_artifact_root(uri)
    client = mlflow.MlflowClient(uri)
    if root is not None and client.get_experiment_by_name(name) is None:
        folder = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip(".") or "experiment"
        try:
            client.create_experiment(name, artifact_location=str(root / folder))
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another job created it meanwhile
                raise
    return mlflow.set_experiment(name)


def _local_artifact_root(tracking_uri: str) -> Path | None:
    """``mlruns/`` beside the database of a local SQLite tracking URI, else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    if not database or database == ":memory:":
        return None
    return Path(database).expanduser().resolve().parent / "mlruns"


def export_model(
    checkpoint_dir: str | Path,
    *,
    output: str | Path | None = None,
    registered_model_name: str | None = None,
    example_path: str | None = None,
    tracking_uri: str | None = None,
    experiment_name: str = "raydlrm-export",
    max_rows: dict[str, int] | None = None,
    keep: Literal["recent", "frequent"] | None = None,
    since: str | Path | None = None,
) -> dict[str, str]:
    """Exports a checkpoint's model (a training checkpoint or a model checkpoint) as a
    self-contained, unsharded MLflow pyfunc model: to a directory (``output``) and/or logged on
    a new MLflow run and registered (``registered_model_name``).

    Args:
        checkpoint_dir: a local checkpoint directory.
        output: a directory to write the model to (must not exist).
        registered_model_name: register the model under this name.
        example_path: data for the signature's example rows (default: the config's eval, else
            train, data set).
        tracking_uri: MLflow tracking URI for registering (default: MLflow's).
        experiment_name: the experiment of the export run.
        max_rows: managed tables (or their columns) -> the rows to cut them to, over their
            ``data.managed_ids.<table>.export_rows`` (:mod:`raydlrm.trainers.model_prune`).
        keep: the ids a cut table keeps (``recent`` or ``frequent``; default: each table's
            ``export_keep``, else ``recent``).
        since: an earlier exported model (or model directory) of the same tables: write only
            what changed since it to ``output`` (:mod:`raydlrm.trainers.model_delta`).

    Returns:
        ``path`` and/or ``model_uri``, ``run_id`` and ``version``.

    Raises:
        FileNotFoundError: the checkpoint holds no model.
        ValueError: neither ``output`` nor ``registered_model_name`` given, or ``output`` is a
            directory that is not empty.
        CheckpointDamagedError: a training checkpoint whose files do not match its manifests.
    """
    quiet_libraries()  # importing MLflow set its INFO lines going again
    spec = _checked_export(checkpoint_dir, output=output, register=registered_model_name)
    data, rules = spec.data, prune_rules(spec, max_rows, keep)
    if since is not None:
        return _export_delta(checkpoint_dir, since, output=output, pruned=bool(rules))
    example = _example(data, example_path)
    out: dict[str, str] = {}
    # The weights are assembled from the checkpoint's shards once, for both destinations.
    with _model_dir(checkpoint_dir) as model_dir:
        if rules:
            pruned = model_dir.parent / "pruned" / "checkpoint"
            model_dir = prune_model_dir(model_dir, pruned, rules)
        if output is not None:
            out["path"] = str(_save(model_dir, output, example))
        if registered_model_name is not None:
            experiment = set_experiment(experiment_name, tracking_uri=tracking_uri)
            name = registered_model_name
            out.update(_register_export(checkpoint_dir, model_dir, example, name, experiment))
    return out


def _example(data: DataConfig, path: str | None) -> pd.DataFrame:
    """The signature's example rows: from ``path``, else the eval data, else the train data."""
    if path is None and data.eval_path:
        return example_rows(data.eval_path, data, role="eval")
    return example_rows(path or data.train_path, data)


def _register_export(
    checkpoint_dir: str | Path, model_dir: Path, example: pd.DataFrame, name: str, experiment: Any
) -> dict[str, str]:
    """Logs an exported model on a new run of ``experiment`` and registers it as ``name``."""
    with mlflow.start_run(experiment_id=experiment.experiment_id) as run:
        mlflow.set_tag("raydlrm.exported_from", str(checkpoint_dir))
    info = log_model(
        run_id=run.info.run_id, model_dir=model_dir, example=example, registered_model_name=name
    )
    return {
        "model_uri": info.model_uri,
        "run_id": run.info.run_id,
        "version": str(info.registered_model_version),
    }
