"""Batch scoring and evaluation of a trained model over a Parquet data set, on Ray Data.

:func:`score` reads a data set (local or ``s3://``, only the columns the model needs plus the
ones to keep), scores it on a pool of Ray Data actors, each holding the unsharded model (the
same preprocessing as training: stable id hashing, dense transforms), and writes Parquet with
the kept columns (by default ``sample_id`` and the label, when present) and ``prediction``, the
click probability. :func:`evaluate` scores a labelled data set and returns AUC and log loss.

The model is a registered or logged MLflow model or a model checkpoint directory, made ready
once on the driver as a local directory (:mod:`raydlrm.platform.model_files`); the data set is
read by :mod:`raydlrm.platform.score_source`, and scored by the actors of
:mod:`raydlrm.platform.scorer`. Every row gets a prediction: a bad row (null id, NaN dense
value, ...) stops the job with a message naming its file, row group, row and column
(:func:`raydlrm.ingestion.badinput.locate_unscorable_row`), instead of being dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import torch

from raydlrm.ingestion.badinput import bad_input_in, locate_unscorable_row
from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.reader import PREPROCESS_ACTOR_CPUS
from raydlrm.ingestion.schema import check_id_kinds
from raydlrm.platform.model_files import ModelFiles, model_files
from raydlrm.platform.score_source import ScoreSource
from raydlrm.platform.scorer import (
    PREDICTION_COLUMN,
    Scorer,
    UnknownIds,
    model_for_actors,
)
from raydlrm.storage import PartitionSelector, StorageConfig, filesystem_for, scratch_directory
from raydlrm.trainers.metrics import binary_metrics
from raydlrm.trainers.retrieval import TARGET_RANK_COLUMN
from raydlrm.trainers.spec import WorkerSpec

__all__ = ["PREDICTION_COLUMN", "ModelFiles", "ScoreResult", "evaluate", "model_files", "score"]

logger = logging.getLogger(__name__)


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


def _data_config(files: ModelFiles) -> DataConfig:
    from raydlrm.trainers.spec import WorkerSpec

    return WorkerSpec.stored(files.spec).data


def _columns_to_keep(
    data: str,
    schema: pa.Schema,
    *,
    needed: list[str],
    keep: list[str] | None,
    label: str | None,
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
    source = ScoreSource.of(data, storage, partitions)
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
    unknown = ray.remote(num_cpus=0)(UnknownIds).remote() if data_config.managed_ids else None
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
        cause = bad_input_in(exc)
        if cause is None:
            raise exc from None
        raise locate_unscorable_row(
            cause,
            files=source.paths,
            row_groups=lambda file: source.row_groups(file, needed),
            config=data_config,
        ) from None
    rows = pads.dataset(out_path, filesystem=out_fs, format="parquet").count_rows()
    if rows != source.num_rows:
        raise RuntimeError(f"scored {rows} rows of {source.num_rows} in {data}: output {output}")
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
    """``dataset`` scored by a pool of :class:`Scorer` actors (a lazy Ray Data dataset)."""
    import ray.data
    from ray.util.annotations import RayDeprecationWarning

    with warnings.catch_warnings():
        # Ray 2.60 takes max_restarts only as one of map_batches' **ray_remote_args, which it
        # says are to go in Ray 2.64 (with no named replacement yet).
        warnings.filterwarnings("ignore", "`ray_remote_args`", RayDeprecationWarning)
        return dataset.map_batches(
            Scorer,
            fn_constructor_kwargs={
                "model": model_for_actors(files),
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
    and log loss (and the predictions under ``output`` when given); for a retrieval model,
    HR@K and NDCG@K of each row's target item against the whole item table.

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
            keep=[label] if label is not None else [],
            storage=storage,
            partitions=partitions or {},
            batch_size=batch_size,
            num_actors=num_actors,
        )
        out_fs, out_path = filesystem_for(target, storage)
        table = pads.dataset(out_path, filesystem=out_fs, format="parquet").to_table()
    result.output = output
    if TARGET_RANK_COLUMN in table.column_names:  # a retrieval model
        ks = WorkerSpec.stored(files.spec).model.retrieval_k
        result.metrics = {**_retrieval_metrics(table, ks=ks), "rows": float(result.rows)}
    else:
        result.metrics = {**_metrics(table, label=label), "rows": float(result.rows)}
    return result


def _retrieval_metrics(table: pa.Table, *, ks: list[int]) -> dict[str, float]:
    """HR@K and NDCG@K over the rows with a history (training's definitions,
    :func:`raydlrm.sharding.retrieval.retrieval_metrics`), and how many had none."""
    from raydlrm.sharding.retrieval import retrieval_metrics

    ranks = torch.from_numpy(table.column(TARGET_RANK_COLUMN).to_numpy().astype(np.int64))
    ranked = ranks[ranks >= 0]
    metrics = {
        name: float(values.mean()) if ranked.numel() else float("nan")
        for name, values in retrieval_metrics(ranked, ks=tuple(ks)).items()
    }
    return {**metrics, "empty_histories": float((ranks < 0).sum())}


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
