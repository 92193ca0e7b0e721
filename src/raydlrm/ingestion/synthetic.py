"""A Criteo-shaped synthetic data set with a planted model, so training has a known ceiling.

:func:`generate_synthetic` writes ``out_dir/train/part-NNNNN.parquet`` (or, with
``partitions``, ``out_dir/train/date=<value>/part-NNNNN.parquet``) and
``out_dir/eval/part-NNNNN.parquet`` and, last, ``out_dir/metadata.json`` (the config, row counts,
files and the planted model's AUC); a directory without ``metadata.json`` is an incomplete data
set. Columns:

- ``sample_id`` int64, globally unique (train rows first, then eval rows);
- ``session_id`` int64, the ``sample_id`` of the session's first sample; sessions are runs of
  consecutive rows of geometric length;
- ``label`` int64 0/1;
- ``I1..In`` float32, heavy-tailed non-negative counts with some nulls (so ``log1p`` matters);
- ``C1..Cm`` int64 raw ids, the last ``num_list_features`` as ``list<int64>`` of 1 to
  ``max_list_length`` ids. Ids follow a power law over per-feature cardinalities log-spaced up to
  ``max_cardinality`` and are scrambled into the whole int64 range, so they must be hashed.
  The first ``num_user_features`` are user features, identical over a session's samples: single
  ids, or with ``user_history_length`` (RecD-shaped data) id lists of ``1 + Poisson(mean - 1)``
  power-law ids, drawn once per session (a user's history, repeated by each of its samples).

With ``layout = "clustered"`` each split is written session-clustered
(:mod:`raydlrm.ingestion.clustered`): ``<split>/samples/part-NNNNN.parquet`` without the user
features, ``<split>/sessions/part-NNNNN.parquet`` with them once per session, and the marker
``<split>/_clustered.json``; the rows are the same as the sample-level layout's.

The labels are drawn from a planted model (``raydlrm.ingestion._planted``): a logit of the
dense features, per-id effects and interaction terms, derived from the seed alone and
calibrated to ``target_auc``, so training has a known ceiling.

Each file is generated from its own random stream, seeded by (seed, split, file index): files are
reproducible (the same seed gives byte-identical files), independent of each other, and only one
is held in memory at a time.

With ``kind = "churn"`` the data set is daily partitions with id churn instead
(``out_dir/train/<partition_key>=<YYYY-MM-DD>/part-NNNNN.parquet``, no eval split; see
``raydlrm.ingestion.synthetic_churn``), and ``metadata.json`` adds its per-day id counts. With
``kind = "sequences"`` it is user histories (one row per user, a target item and a
``list<int64>`` history; see ``raydlrm.ingestion.synthetic_sequences``), and
``metadata.json`` adds the histories' lengths.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydlrm.ingestion._planted import PlantedModel, logit, plant, sample_rows, sigmoid
from raydlrm.ingestion.clustered import WRITE_OPTIONS, split_sessions
from raydlrm.ingestion.layout import ClusteredLayout, write_layout
from raydlrm.ingestion.synthetic_churn import ChurnStats, write_churn
from raydlrm.ingestion.synthetic_config import SyntheticConfig
from raydlrm.ingestion.synthetic_sequences import SequenceStats, write_sequences_data
from raydlrm.storage import SAMPLES_DIR, SESSIONS_DIR

__all__ = ["SyntheticDataExistsError", "SyntheticInfo", "generate_synthetic"]

logger = logging.getLogger(__name__)

_METADATA = "metadata.json"
_FORMAT_VERSION = 1
_SPLIT_CODES = {"train": 0, "eval": 1}
_SESSION_COLUMN = "session_id"
_AUC_BINS = 1 << 16
_AUC_RANGE = 40.0


@dataclass(frozen=True)
class SyntheticInfo:
    """A generated data set.

    Attributes:
        out_dir: the data set's root directory.
        train_path: directory of the training files.
        eval_path: directory of the evaluation files (None when there are no eval rows).
        num_train_rows: rows in the training split.
        num_eval_rows: rows in the evaluation split.
        train_files: training Parquet files, in order (clustered: each samples file, then its
            sessions file).
        eval_files: evaluation Parquet files, in order (likewise).
        planted_auc: AUC of the planted logits on the evaluation labels, the ceiling a trainer
            can reach (None when there are no eval rows); of churn data, on the newest day's
            labels (the day a retrain holds out).
        positive_rate: fraction of positive labels over both splits.
        kept: the data set was already there, generated from the same config, and was kept
            as it is (nothing written).
        churn: of churn data (``kind = "churn"``), the per-day and total distinct ids of each
            id column; None otherwise.
        sequences: of user histories (``kind = "sequences"``), the item table's rows and the
            histories' lengths; None otherwise.
    """

    out_dir: Path
    train_path: Path
    eval_path: Path | None
    num_train_rows: int
    num_eval_rows: int
    train_files: list[Path]
    eval_files: list[Path]
    planted_auc: float | None
    positive_rate: float
    kept: bool = False
    churn: ChurnStats | None = None
    sequences: SequenceStats | None = None


def _file_table(
    config: SyntheticConfig,
    model: PlantedModel,
    *,
    split: str,
    index: int,
    first_id: int,
    num_rows: int,
) -> tuple[pa.Table, np.ndarray]:
    """One file's rows and their planted logits ``(num_rows,)``."""
    rng = np.random.default_rng([config.seed, _SPLIT_CODES[split], index])
    rows = sample_rows(config, model, rng, num_rows)
    logits = logit(model, rows)
    labels = (rng.random(num_rows) < sigmoid(logits)).astype(np.int64)
    sample_ids = np.arange(first_id, first_id + num_rows, dtype=np.int64)
    columns: dict[str, pa.Array] = {
        "sample_id": pa.array(sample_ids),
        _SESSION_COLUMN: pa.array(sample_ids[rows.session_start]),
        "label": pa.array(labels),
    }
    missing = np.isnan(rows.dense)
    for j in range(config.num_dense):
        columns[f"I{j + 1}"] = pa.array(rows.dense[:, j], mask=missing[:, j])
    for f, (raw, offs) in enumerate(zip(rows.ids, rows.offsets, strict=True)):
        values = pa.array(raw)
        columns[f"C{f + 1}"] = (
            values if offs is None else pa.ListArray.from_arrays(pa.array(offs), values)
        )
    return pa.table(columns), logits


def _file_path(
    config: SyntheticConfig, split_dir: Path, *, split: str, index: int, num_files: int
) -> Path:
    """Where file ``index`` of a split goes: training files spread over the partitions in
    order (``train/date=<value>/``), if any."""
    name = f"part-{index:05d}.parquet"
    if split != "train" or not config.partitions:
        return split_dir / name
    value = config.partitions[index * len(config.partitions) // num_files]
    directory = split_dir / f"{config.partition_key}={value}"
    directory.mkdir(exist_ok=True)
    return directory / name


class _HistogramAUC:
    """Streaming AUC over binned scores (bin width ~1e-3 in logit units), in constant memory."""

    def __init__(self) -> None:
        self.positives = np.zeros(_AUC_BINS, dtype=np.int64)
        self.negatives = np.zeros(_AUC_BINS, dtype=np.int64)

    def update(self, scores: np.ndarray, labels: np.ndarray) -> None:
        bins = np.clip(
            ((scores + _AUC_RANGE / 2) / _AUC_RANGE * _AUC_BINS).astype(np.int64), 0, _AUC_BINS - 1
        )
        self.positives += np.bincount(bins[labels == 1], minlength=_AUC_BINS)
        self.negatives += np.bincount(bins[labels == 0], minlength=_AUC_BINS)

    def compute(self) -> float | None:
        num_pos, num_neg = int(self.positives.sum()), int(self.negatives.sum())
        if num_pos == 0 or num_neg == 0:
            return None
        below = np.cumsum(self.negatives) - self.negatives
        wins = (self.positives * (below + 0.5 * self.negatives)).sum()
        return float(wins / (num_pos * num_neg))


@dataclass(frozen=True)
class _Stored:
    """A complete data set found in ``out_dir``: its info and the config it was made from."""

    info: SyntheticInfo
    config: dict


def _read_info(out_dir: Path) -> _Stored | None:
    meta_path = out_dir / _METADATA
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    info = SyntheticInfo(
        out_dir=out_dir,
        train_path=out_dir / "train",
        eval_path=out_dir / "eval" if meta["num_eval_rows"] else None,
        num_train_rows=meta["num_train_rows"],
        num_eval_rows=meta["num_eval_rows"],
        train_files=[out_dir / p for p in meta["train_files"]],
        eval_files=[out_dir / p for p in meta["eval_files"]],
        planted_auc=meta["planted_auc"],
        positive_rate=meta["positive_rate"],
        churn=ChurnStats(**meta["churn"]) if meta.get("churn") else None,
        sequences=SequenceStats(**meta["sequences"]) if meta.get("sequences") else None,
    )
    return _Stored(info=info, config=meta["config"])


def generate_synthetic(
    config: SyntheticConfig, *, out_dir: str | Path, overwrite: bool = False
) -> SyntheticInfo:
    """Writes the synthetic data set described by ``config`` (see the module docstring).

    If ``out_dir`` already holds a complete data set generated from the same config, it is
    returned as is.

    Args:
        config: kind, sizes, shapes and seed of the data set.
        out_dir: root directory; ``train/``, ``eval/`` (not of churn data) and
            ``metadata.json`` are written in it.
        overwrite: replace an existing (complete or partial) data set in ``out_dir``.

    Returns:
        The paths, row counts, files and planted AUC of the data set (and of churn data, its
        per-day id counts).

    Raises:
        FileExistsError: ``out_dir`` holds a different or incomplete data set and ``overwrite``
            is False.
    """
    out_dir = Path(out_dir)
    if not overwrite:
        existing = _existing(config, out_dir=out_dir)
        if existing is not None:
            return existing
    _clear(out_dir)
    writers = {"criteo": _write_criteo, "churn": _write_churn, "sequences": _write_sequences}
    info = writers[config.kind](config, out_dir)
    _write_metadata(info, config=config)
    return info


def _write_churn(config: SyntheticConfig, out_dir: Path) -> SyntheticInfo:
    written = write_churn(config, train_dir=out_dir / "train")
    return SyntheticInfo(
        out_dir=out_dir,
        train_path=out_dir / "train",
        eval_path=None,
        num_train_rows=written.num_rows,
        num_eval_rows=0,
        train_files=written.files,
        eval_files=[],
        planted_auc=written.stats.planted_auc[-1],
        positive_rate=written.positives / written.num_rows,
        churn=written.stats,
    )


def _split_info(
    config: SyntheticConfig,
    out_dir: Path,
    *,
    files: dict[str, list[Path]],
    planted_auc: float,
    positives: int,
    **extra: Any,
) -> SyntheticInfo:
    """What a train/eval data set written into ``out_dir`` holds."""
    return SyntheticInfo(
        out_dir=out_dir,
        train_path=out_dir / "train",
        eval_path=out_dir / "eval" if config.num_eval_rows else None,
        num_train_rows=config.num_train_rows,
        num_eval_rows=config.num_eval_rows,
        train_files=files["train"],
        eval_files=files["eval"],
        planted_auc=planted_auc,
        positive_rate=positives / (config.num_train_rows + config.num_eval_rows),
        **extra,
    )


def _write_sequences(config: SyntheticConfig, out_dir: Path) -> SyntheticInfo:
    written = write_sequences_data(config, out_dir=out_dir)
    return _split_info(
        config,
        out_dir,
        files=written.files,
        planted_auc=written.planted_auc,
        positives=written.positives,
        sequences=written.stats,
    )


def _write_criteo(config: SyntheticConfig, out_dir: Path) -> SyntheticInfo:
    written = _write_splits(config, model=plant(config), out_dir=out_dir)
    return _split_info(
        config,
        out_dir,
        files=written.files,
        planted_auc=written.auc.compute(),
        positives=written.positives,
    )


def _existing(config: SyntheticConfig, *, out_dir: Path) -> SyntheticInfo | None:
    """The data set in ``out_dir`` if it was generated from ``config``; None if there is none.

    Raises:
        FileExistsError: ``out_dir`` holds a different or incomplete data set.
    """
    stored = _read_info(out_dir)
    # Keys added to SyntheticConfig later take their defaults in older metadata.
    defaults = _data_fields(SyntheticConfig())
    if stored is not None and {**defaults, **stored.config} == _data_fields(config):
        return dataclasses.replace(stored.info, kept=True)
    if stored is not None or (out_dir / "train").exists() or (out_dir / "eval").exists():
        raise SyntheticDataExistsError(out_dir, different=stored is not None)
    return None


class SyntheticDataExistsError(FileExistsError):
    """The output directory holds a synthetic data set of another config, or an incomplete one.

    Attributes:
        out_dir: the directory.
        what: ``a different synthetic data set (of another [data.synthetic])`` or ``an
            incomplete synthetic data set``.
    """

    def __init__(self, out_dir: Path, *, different: bool) -> None:
        self.out_dir = out_dir
        self.what = (
            "a different synthetic data set (of another [data.synthetic])"
            if different
            else "an incomplete synthetic data set"
        )
        super().__init__(f"{out_dir} holds {self.what}; pass overwrite=True to replace it")


def _clear(out_dir: Path) -> None:
    """Removes a data set from ``out_dir``, its ``metadata.json`` (the completeness mark) first."""
    (out_dir / _METADATA).unlink(missing_ok=True)
    for split in _SPLIT_CODES:
        shutil.rmtree(out_dir / split, ignore_errors=True)


@dataclass
class _Written:
    """The files written so far and what their rows add up to."""

    files: dict[str, list[Path]] = field(default_factory=dict)  # per split, in order
    positives: int = 0
    next_id: int = 0  # the ``sample_id`` of the next row
    auc: _HistogramAUC = field(default_factory=_HistogramAUC)  # of the planted logits on eval


def _write_splits(config: SyntheticConfig, *, model: PlantedModel, out_dir: Path) -> _Written:
    """Writes the training files, then the evaluation files (sample ids run on over both)."""
    written = _Written()
    for split, total in (("train", config.num_train_rows), ("eval", config.num_eval_rows)):
        written.files[split] = []
        if total:
            _write_split(
                config, model=model, split=split, total=total, out_dir=out_dir, written=written
            )
    return written


def _write_split(
    config: SyntheticConfig,
    *,
    model: PlantedModel,
    split: str,
    total: int,
    out_dir: Path,
    written: _Written,
) -> None:
    """Writes the ``total`` rows of ``split`` file by file, adding them to ``written``."""
    split_dir = out_dir / split
    split_dir.mkdir(parents=True, exist_ok=True)
    num_files = math.ceil(total / config.rows_per_file)
    user_columns = [f"C{f + 1}" for f in range(config.num_user_features)]
    for index in range(num_files):
        num_rows = min(config.rows_per_file, total - index * config.rows_per_file)
        table, logits = _file_table(
            config, model, split=split, index=index, first_id=written.next_id, num_rows=num_rows
        )
        if config.layout == "clustered":
            split_rows = split_sessions(
                table, session_column=_SESSION_COLUMN, session_columns=user_columns
            )
            parts = [(SAMPLES_DIR, split_rows.samples), (SESSIONS_DIR, split_rows.sessions)]
        else:
            parts = [("", table)]
        for directory, rows in parts:
            base = split_dir / directory
            base.mkdir(exist_ok=True)
            path = _file_path(config, base, split=split, index=index, num_files=num_files)
            pq.write_table(rows, path, **(WRITE_OPTIONS if directory else {}))
            written.files[split].append(path)
        labels = table.column("label").to_numpy()
        written.positives += int(labels.sum())
        if split == "eval":
            written.auc.update(logits, labels)
        written.next_id += num_rows
    if config.layout == "clustered":
        layout = ClusteredLayout(_SESSION_COLUMN, user_columns)
        write_layout(layout, filesystem=pafs.LocalFileSystem(), root=str(split_dir.resolve()))
    logger.info("wrote %d %s rows in %d files to %s", total, split, num_files, split_dir)


def _data_fields(config: SyntheticConfig) -> dict[str, Any]:
    """What of ``config`` makes the data set (not ``generate``, which says who writes it)."""
    fields = dataclasses.asdict(config)
    del fields["generate"]
    return fields


def _write_metadata(info: SyntheticInfo, *, config: SyntheticConfig) -> None:
    """Writes ``metadata.json``, atomically: its presence marks the data set complete."""
    meta = {
        "format_version": _FORMAT_VERSION,
        "config": _data_fields(config),
        "num_train_rows": info.num_train_rows,
        "num_eval_rows": info.num_eval_rows,
        "train_files": [str(p.relative_to(info.out_dir)) for p in info.train_files],
        "eval_files": [str(p.relative_to(info.out_dir)) for p in info.eval_files],
        "planted_auc": info.planted_auc,
        "positive_rate": info.positive_rate,
    }
    if info.churn is not None:
        meta["churn"] = dataclasses.asdict(info.churn)
    if info.sequences is not None:
        meta["sequences"] = dataclasses.asdict(info.sequences)
    tmp = info.out_dir / f".{_METADATA}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(info.out_dir / _METADATA)
