"""Synthetic user histories: one row per user, a target item and the user's history, for the
sequence models and their throughput benchmark.

:func:`write_sequences_data` (reached through :func:`raydlrm.ingestion.generate_synthetic` with
``SyntheticConfig.kind = "sequences"``) writes ``train/part-NNNNN.parquet`` and
``eval/part-NNNNN.parquet`` in the layout ``raydlrm data sequences`` writes with ``examples =
"last"``. Columns:

- ``user_id`` int64, unique over both splits (train rows first);
- ``item_id`` int64, the target item's row in ``[0, num_items)``;
- ``label`` int64 0/1;
- ``I1..In`` float32, heavy-tailed non-negative counts with some nulls (noise: not in the
  label model);
- ``hist_item_id`` ``list<int64>``, the history's item rows, oldest first, of a length drawn
  uniformly from ``[min_length, max_length]``.

Items: each is drawn as a popularity rank, Zipf (``zipf_exponent``) over the ``num_items``
ranks, and a rank's item row is an affine permutation of it (``(a * rank + b) mod num_items``),
so that popular items are spread over the rows of a row-wise sharded table instead of filling
its first shard. A rank's category is ``rank mod num_categories``. Each user favours one
category: each of its events (history and target) is, with probability ``taste_share``, moved
to the nearest rank of that category (Zipf within it), else kept.

Labels are ``Bernoulli(sigmoid(logit))``; the logit grows with the share of the history's
events in the target's category (what target attention over the history finds), calibrated on
a sample so that the planted AUC is about ``target_auc`` and the positive rate
``positive_rate``.

Each file is written a row group (:data:`CHUNK_ROWS` users) at a time, each from its own random
stream seeded by (seed, split, file, chunk): at most one row group is in memory, and the same
seed gives byte-identical files.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydlrm._sampling import zipf_ranks
from raydlrm.ingestion._planted import _scale_for_auc, _solve_bias, sigmoid
from raydlrm.ingestion.synthetic_config import SyntheticConfig

__all__ = ["CHUNK_ROWS", "SequenceStats", "SequencesData", "write_sequences_data"]

logger = logging.getLogger(__name__)

CHUNK_ROWS = 2048
"""Users per row group, the most the writer holds at once."""
# Random streams: (seed, code, ...), apart from the other kinds'.
_ROWS_CODE = 20
_MODEL_CODE = 21
_SPLIT_CODES = {"train": 0, "eval": 1}
_CALIBRATION_ROWS = 4096


@dataclass(frozen=True)
class SequenceStats:
    """The histories of a sequence data set (what its tables and throughput are sized by).

    Attributes:
        num_items: the item table's rows (ids are ``0..num_items-1``).
        history_ids: history events over both splits.
        mean_history_length: their mean per row.
        min_history_length: the shortest history written.
        max_history_length: the longest history written.
    """

    num_items: int
    history_ids: int
    mean_history_length: float
    min_history_length: int
    max_history_length: int


@dataclass(frozen=True)
class SequencesData:
    """What :func:`write_sequences_data` wrote."""

    files: dict[str, list[Path]]
    """The Parquet files per split (``train``, ``eval``), in order."""
    positives: int
    """Rows labelled 1."""
    planted_auc: float | None
    """AUC of the planted logits on the eval labels (None without eval rows or one class)."""
    stats: SequenceStats


@dataclass(frozen=True)
class _Model:
    """The item permutation and the calibrated label model, from the seed alone."""

    multiplier: int  # of the rank -> row permutation, coprime with num_items
    offset: int
    center: float  # mean and spread of the category share, on the calibration sample
    spread: float
    scale: float
    bias: float


@dataclass(frozen=True)
class _Rows:
    ranks: np.ndarray  # (n,) the targets' popularity ranks
    lengths: np.ndarray  # (n,) history lengths
    history: np.ndarray  # (sum lengths,) the histories' ranks, row after row
    share: np.ndarray  # (n,) share of the history in the target's category


def _events(
    config: SyntheticConfig, rng: np.random.Generator, categories: np.ndarray
) -> np.ndarray:
    """Ranks ``(len(categories),)``: Zipf, each moved into its user's category with
    probability ``taste_share`` (to the rank of that category in the same block of ranks)."""
    s = config.sequences
    ranks = zipf_ranks(rng, size=categories.size, cardinality=s.num_items, s=config.zipf_exponent)
    moved = ranks - ranks % s.num_categories + categories
    moved = np.where(moved >= s.num_items, moved - s.num_categories, moved)
    return np.where(rng.random(categories.size) < s.taste_share, moved, ranks)


def _draw(config: SyntheticConfig, rng: np.random.Generator, n: int) -> _Rows:
    """``n`` users' targets and histories (as ranks) and their category shares."""
    s = config.sequences
    taste = rng.integers(0, s.num_categories, n)
    lengths = rng.integers(s.min_length, s.max_length + 1, n)
    history = _events(config, rng, np.repeat(taste, lengths))
    ranks = _events(config, rng, taste)
    same = history % s.num_categories == np.repeat(ranks % s.num_categories, lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    share = np.add.reduceat(same.astype(np.float64), starts) / lengths
    return _Rows(ranks=ranks, lengths=lengths, history=history, share=share)


def _plant(config: SyntheticConfig) -> _Model:
    """Draws the permutation and calibrates the label model on a sample of users."""
    rng = np.random.default_rng([config.seed, _MODEL_CODE])
    n = config.sequences.num_items
    multiplier = int(rng.integers(n // 2, n)) if n > 2 else 1
    while math.gcd(multiplier, n) != 1:
        multiplier += 1
    share = _draw(config, rng, _CALIBRATION_ROWS).share
    center, spread = float(share.mean()), max(float(share.std()), 1e-12)
    unit = (share - center) / spread
    # The share is skewed (users' own category against the rest): the bisection's largest
    # scales saturate the sigmoid, which it reads as "AUC reached" and backs off from.
    with np.errstate(over="ignore", invalid="ignore"):
        scale = _scale_for_auc(unit, config=config)
    return _Model(
        multiplier=multiplier,
        offset=int(rng.integers(0, n)),
        center=center,
        spread=spread,
        scale=scale,
        bias=_solve_bias(scale * unit, config.positive_rate),
    )


def _item_rows(model: _Model, ranks: np.ndarray, num_items: int) -> np.ndarray:
    """The item rows of popularity ranks: a permutation of ``[0, num_items)`` (products stay
    below 2^62 since ``num_items < 2^31``)."""
    return (ranks * model.multiplier + model.offset) % num_items


def _chunk(
    config: SyntheticConfig, model: _Model, rng: np.random.Generator, *, first_user: int, n: int
) -> tuple[pa.Table, np.ndarray]:
    """One row group of ``n`` users and its planted logits ``(n,)``."""
    rows = _draw(config, rng, n)
    logits = model.bias + model.scale * (rows.share - model.center) / model.spread
    labels = (rng.random(n) < sigmoid(logits)).astype(np.int64)
    num_items = config.sequences.num_items
    offsets = np.concatenate([[0], np.cumsum(rows.lengths)]).astype(np.int32)
    columns: dict[str, pa.Array] = {
        "user_id": pa.array(np.arange(first_user, first_user + n, dtype=np.int64)),
        "item_id": pa.array(_item_rows(model, rows.ranks, num_items)),
        "label": pa.array(labels),
    }
    counts = np.floor(np.exp(1.0 + 1.5 * rng.standard_normal((n, config.num_dense)))) - 1.0
    dense = np.maximum(counts, 0.0).astype(np.float32)
    missing = rng.random(dense.shape) < config.dense_null_fraction
    for j in range(config.num_dense):
        columns[f"I{j + 1}"] = pa.array(dense[:, j], mask=missing[:, j])
    history = pa.array(_item_rows(model, rows.history, num_items))
    columns["hist_item_id"] = pa.ListArray.from_arrays(pa.array(offsets), history)
    return pa.table(columns), logits


class _Tally:
    """What the written rows add up to: labels, history lengths, the eval logits."""

    def __init__(self) -> None:
        self.positives = self.ids = self.rows = 0
        self.shortest, self.longest = math.inf, 0
        self.eval_logits: list[np.ndarray] = []
        self.eval_labels: list[np.ndarray] = []

    def add(self, table: pa.Table, logits: np.ndarray, *, split: str) -> None:
        labels = table.column("label").to_numpy()
        history = table.column("hist_item_id").combine_chunks()
        lengths = np.diff(history.offsets.to_numpy())
        self.positives += int(labels.sum())
        self.ids += int(lengths.sum())
        self.rows += table.num_rows
        self.shortest = min(self.shortest, int(lengths.min()))
        self.longest = max(self.longest, int(lengths.max()))
        if split == "eval":
            self.eval_logits.append(logits)
            self.eval_labels.append(labels)

    def planted_auc(self) -> float | None:
        from sklearn.metrics import roc_auc_score  # a second to import: only when writing

        if not self.eval_labels:
            return None
        labels = np.concatenate(self.eval_labels)
        if labels.min() == labels.max():
            return None
        return float(roc_auc_score(labels, np.concatenate(self.eval_logits)))

    def stats(self, num_items: int) -> SequenceStats:
        return SequenceStats(
            num_items=num_items,
            history_ids=self.ids,
            mean_history_length=self.ids / max(1, self.rows),
            min_history_length=int(self.shortest),
            max_history_length=self.longest,
        )


def _write_file(
    config: SyntheticConfig,
    model: _Model,
    path: Path,
    *,
    key: tuple[int, int],
    first_user: int,
    num_rows: int,
    tally: _Tally,
) -> None:
    """Writes ``num_rows`` users to ``path``, a row group of :data:`CHUNK_ROWS` at a time;
    ``key`` is (split code, file index) of the random streams."""
    split = "eval" if key[0] == _SPLIT_CODES["eval"] else "train"
    writer = None
    for chunk, begin in enumerate(range(0, num_rows, CHUNK_ROWS)):
        n = min(CHUNK_ROWS, num_rows - begin)
        rng = np.random.default_rng([config.seed, _ROWS_CODE, *key, chunk])
        table, logits = _chunk(config, model, rng, first_user=first_user + begin, n=n)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
        tally.add(table, logits, split=split)
    assert writer is not None
    writer.close()


def write_sequences_data(config: SyntheticConfig, *, out_dir: Path) -> SequencesData:
    """Writes the user-history data set of ``config`` (``kind = "sequences"``): ``train/`` and
    ``eval/`` (when ``num_eval_rows``) under ``out_dir`` (see the module docstring).

    Returns:
        The files, the positives, the planted AUC on eval and the histories' statistics.
    """
    assert config.kind == "sequences", config.kind
    model = _plant(config)
    tally = _Tally()
    files: dict[str, list[Path]] = {"train": [], "eval": []}
    first_user = 0
    for split, total in (("train", config.num_train_rows), ("eval", config.num_eval_rows)):
        if not total:
            continue
        split_dir = out_dir / split
        split_dir.mkdir(parents=True, exist_ok=True)
        for index in range(math.ceil(total / config.rows_per_file)):
            num_rows = min(config.rows_per_file, total - index * config.rows_per_file)
            path = split_dir / f"part-{index:05d}.parquet"
            key = (_SPLIT_CODES[split], index)
            _write_file(
                config, model, path, key=key, first_user=first_user, num_rows=num_rows, tally=tally
            )
            files[split].append(path)
            first_user += num_rows
        logger.info(
            "wrote %d %s users in %d files to %s", total, split, len(files[split]), split_dir
        )
    return SequencesData(
        files=files,
        positives=tally.positives,
        planted_auc=tally.planted_auc(),
        stats=tally.stats(config.sequences.num_items),
    )
