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

Labels are ``Bernoulli(sigmoid(logit))`` with a planted logit: a bias, a linear term on
``log1p`` of the (null-filled) dense features, per-id effects for half of the sparse features (a
hash of (feature, raw id) turned into a normal deviate, the mean over the list for list
features) and interaction terms, each a product of per-id factors of several features
(``interaction_orders``; by default one product of two features), so the interaction layer
matters. The planted model is derived from the seed alone: its term scales and bias are
calibrated once on a sample so that its AUC is ``target_auc``, the positive rate
``positive_rate`` and the interactions' share of the logit's variance ``interaction_share``.

Each file is generated from its own random stream, seeded by (seed, split, file index): files are
reproducible (the same seed gives byte-identical files), independent of each other, and only one
is held in memory at a time.
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

from raydlrm._sampling import zipf_ranks
from raydlrm.ingestion.clustered import WRITE_OPTIONS, split_sessions
from raydlrm.ingestion.config import SyntheticConfig
from raydlrm.ingestion.layout import ClusteredLayout, write_layout
from raydlrm.ingestion.preprocess import mix64
from raydlrm.storage import SAMPLES_DIR, SESSIONS_DIR

__all__ = ["SyntheticDataExistsError", "SyntheticInfo", "generate_synthetic"]

logger = logging.getLogger(__name__)

_METADATA = "metadata.json"
_FORMAT_VERSION = 1
_SPLIT_CODES = {"train": 0, "eval": 1}
_CALIBRATION_CODE = 2
_CALIBRATION_ROWS = 20_000
_MIN_CARDINALITY = 4
# The dense linear term's part of the planted logit's variance left by the interactions (the
# per-id effects take the rest).
_DENSE_FRACTION = 0.3125
# Seeds the features and factors of interaction terms beyond the first pair.
_INTERACTION_CODE = 1
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
            can reach (None when there are no eval rows).
        positive_rate: fraction of positive labels over both splits.
        kept: the data set was already there, generated from the same config, and was kept
            as it is (nothing written).
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


@dataclass(frozen=True)
class _PlantedModel:
    """The model the labels are drawn from; derived from the config's seed alone."""

    cardinalities: np.ndarray  # (F,) int64
    id_salts: np.ndarray  # (F,) uint64, scrambles ranks into raw ids
    effect_salts: np.ndarray  # (F,) uint64, per-id effects
    dense_mu: np.ndarray  # (D,) of the log-normal count generator
    dense_sigma: np.ndarray  # (D,)
    dense_center: np.ndarray  # (D,) mean of log1p(filled dense)
    dense_weights: np.ndarray  # (D,) per standardized log1p(dense)
    effect_weights: np.ndarray  # (F,) 0 for features without an effect
    # Per interaction term, its (feature, factor salt) pairs; the term is their factors' product.
    interactions: tuple[tuple[tuple[int, int], ...], ...]
    interaction_weight: float
    bias: float


@dataclass
class _Rows:
    """Raw columns of one chunk and the planted logit's terms."""

    session_start: np.ndarray  # (N,) row index of each row's session start
    dense: np.ndarray  # (N, D) float32, NaN where missing
    ids: list[np.ndarray]  # per feature: (N,) or (sum L,) raw int64 ids
    offsets: list[np.ndarray | None]  # per feature: (N + 1,) int32 for lists, else None


def _num_single(config: SyntheticConfig) -> int:
    return config.num_sparse - config.num_list_features


def _hash_normal(raw_ids: np.ndarray, salt: int) -> np.ndarray:
    """A standard-normal value per id, a deterministic function of (salt, id) (Box-Muller)."""
    h1 = mix64(raw_ids.view(np.uint64) ^ np.uint64(salt))
    h2 = mix64(h1)
    scale = 2.0**-53
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) * scale
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * scale
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _per_row(values: np.ndarray, offsets: np.ndarray | None) -> np.ndarray:
    """Per-row values of a feature: as is, or the mean over each row's list (lengths >= 1)."""
    if offsets is None:
        return values
    return np.add.reduceat(values, offsets[:-1].astype(np.int64)) / np.diff(offsets)


def _user_histories(
    config: SyntheticConfig,
    rng: np.random.Generator,
    *,
    session: np.ndarray,
    num_sessions: int,
    cardinality: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One user feature's id lists: ranks ``(sum L,)`` and offsets ``(N + 1,)`` int32, a list
    of ``1 + Poisson(user_history_length - 1)`` power-law ranks per session, repeated by each
    of the session's samples (``session``: each row's session)."""
    lengths = 1 + rng.poisson(config.user_history_length - 1, size=num_sessions)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    ranks = zipf_ranks(rng, size=int(starts[-1]), cardinality=cardinality, s=config.zipf_exponent)
    row_lengths = lengths[session]
    offsets = np.zeros(session.size + 1, dtype=np.int32)
    np.cumsum(row_lengths, out=offsets[1:])
    # Each row's ids are its session's: the session's start plus the position in the list.
    within = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], row_lengths)
    return ranks[np.repeat(starts[session], row_lengths) + within], offsets


def _sample_rows(
    config: SyntheticConfig, model: _PlantedModel, rng: np.random.Generator, num_rows: int
) -> _Rows:
    p = 1.0 / config.mean_session_length
    lengths = rng.geometric(p, size=int(num_rows * p * 1.5) + 16)
    while lengths.sum() < num_rows:
        lengths = np.concatenate([lengths, rng.geometric(p, size=len(lengths))])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    num_sessions = int(np.searchsorted(starts, num_rows, side="left"))
    session = np.repeat(np.arange(num_sessions), lengths[:num_sessions])[:num_rows]
    session_start = starts[session]

    normal = rng.standard_normal((num_rows, config.num_dense))
    counts = np.floor(np.exp(model.dense_mu + model.dense_sigma * normal)) - 1.0
    dense = np.maximum(counts, 0.0).astype(np.float32)
    dense[rng.random(dense.shape) < config.dense_null_fraction] = np.nan

    ids: list[np.ndarray] = []
    offsets: list[np.ndarray | None] = []
    for f in range(config.num_sparse):
        card = int(model.cardinalities[f])
        if f < config.num_user_features and config.user_history_length:
            ranks, offs = _user_histories(
                config, rng, session=session, num_sessions=num_sessions, cardinality=card
            )
        elif f < config.num_user_features:
            ranks = zipf_ranks(rng, size=num_sessions, cardinality=card, s=config.zipf_exponent)
            ranks = ranks[session]
            offs = None
        elif f < _num_single(config):
            ranks = zipf_ranks(rng, size=num_rows, cardinality=card, s=config.zipf_exponent)
            offs = None
        else:
            list_lengths = rng.integers(1, config.max_list_length + 1, size=num_rows)
            offs = np.zeros(num_rows + 1, dtype=np.int32)
            np.cumsum(list_lengths, out=offs[1:])
            ranks = zipf_ranks(rng, size=int(offs[-1]), cardinality=card, s=config.zipf_exponent)
        raw = mix64(ranks.astype(np.uint64) + model.id_salts[f]) >> np.uint64(1)
        ids.append(raw.view(np.int64))
        offsets.append(offs)
    return _Rows(session_start=session_start, dense=dense, ids=ids, offsets=offsets)


def _terms(model: _PlantedModel, rows: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The planted logit's unscaled terms: standardized log1p dense ``(N, D)``, per-id effects
    ``(N, F)`` and the sum of the interaction products ``(N,)``."""
    dense = np.log1p(np.nan_to_num(rows.dense, nan=0.0).astype(np.float64)) - model.dense_center
    effects = np.zeros((dense.shape[0], len(rows.ids)))
    for f, (raw, offs) in enumerate(zip(rows.ids, rows.offsets, strict=True)):
        if model.effect_weights[f] != 0.0:
            effects[:, f] = _per_row(_hash_normal(raw, int(model.effect_salts[f])), offs)
    interaction = np.zeros(dense.shape[0])
    for term in model.interactions:
        product = np.ones(dense.shape[0])
        for f, salt in term:
            product = product * _per_row(_hash_normal(rows.ids[f], salt), rows.offsets[f])
        interaction = interaction + product
    return dense, effects, interaction


def _logit(model: _PlantedModel, rows: _Rows) -> np.ndarray:
    dense, effects, interaction = _terms(model, rows)
    return (
        model.bias
        + dense @ model.dense_weights
        + effects @ model.effect_weights
        + model.interaction_weight * interaction
    )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _soft_auc(scores: np.ndarray, probs: np.ndarray) -> float:
    """Expected AUC of ``scores`` when labels are Bernoulli(``probs``)."""
    order = np.argsort(scores, kind="stable")
    p = probs[order]
    negatives_below = np.cumsum(1.0 - p) - (1.0 - p)
    return float((p * negatives_below).sum() / (p.sum() * (1.0 - p).sum()))


def _solve_bias(z: np.ndarray, rate: float) -> float:
    """The bias ``b`` with ``mean(sigmoid(b + z)) == rate`` (Newton's method; it is monotone)."""
    bias = math.log(rate / (1.0 - rate))
    for _ in range(50):
        p = _sigmoid(bias + z)
        gap = float(p.mean()) - rate
        if abs(gap) < 1e-7:
            break
        bias -= gap / max(float((p * (1.0 - p)).mean()), 1e-6)
    return bias


def _interaction_terms(
    config: SyntheticConfig, *, cardinalities: np.ndarray, pair_salts: tuple[int, int]
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The interaction terms' (feature, salt) pairs.

    The first term starts with the first feature (a user feature when there are any) and the
    first single-valued non-user feature, or the last feature; the other features of the terms
    are those with the fewest distinct ids, each in at most one term (their factors' salts come
    from a random stream of their own). With one categorical
    feature there is no interaction.
    """
    f_count = config.num_sparse
    if not config.interaction_orders or f_count < 2:
        return ()
    first_item = config.num_user_features
    b = first_item if 0 < first_item < _num_single(config) else f_count - 1
    rng = np.random.default_rng([config.seed, _CALIBRATION_CODE, _INTERACTION_CODE])
    # The fewest distinct ids first: a product of k features' factors has as many values as
    # the product of their cardinalities, which a model can only learn when each is seen often.
    others = [int(f) for f in np.argsort(cardinalities, kind="stable") if f not in (0, b)]
    extra_salts = rng.integers(0, 2**63, size=f_count, dtype=np.int64).view(np.uint64)
    terms = []
    for index, order in enumerate(config.interaction_orders):
        head = [(0, pair_salts[0]), (b, pair_salts[1])] if index == 0 else []
        tail = [others.pop(0) for _ in range(order - len(head))]
        terms.append(tuple(head + [(f, int(extra_salts[f])) for f in tail]))
    return tuple(terms)


def _scale_for_auc(unit: np.ndarray, *, config: SyntheticConfig) -> float:
    """The scale of the unit-variance logit ``unit`` at which the planted model's expected AUC
    is ``config.target_auc`` (bisection; the AUC grows with the scale)."""
    lo, hi = 0.01, 20.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        bias = _solve_bias(mid * unit, config.positive_rate)
        if _soft_auc(unit, _sigmoid(bias + mid * unit)) < config.target_auc:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _histories_widest(cards: np.ndarray, *, config: SyntheticConfig) -> np.ndarray:
    """With user histories, the user features swap cardinalities with the features holding the
    largest ones (a history lists items of a large vocabulary); otherwise ``cards`` as is."""
    users = config.num_user_features
    if not config.user_history_length or not users:
        return cards
    cards = cards.copy()
    widest = set(np.argsort(-cards, kind="stable")[:users].tolist())
    inside = [f for f in range(users) if f not in widest]
    outside = sorted(f for f in widest if f >= users)
    cards[inside + outside] = cards[outside + inside]
    return cards


def _plant(config: SyntheticConfig) -> _PlantedModel:
    """Draws the planted model from the seed and calibrates its scales on a sample."""
    rng = np.random.default_rng([config.seed, _CALIBRATION_CODE, 0])
    f_count, d_count = config.num_sparse, config.num_dense
    low = min(_MIN_CARDINALITY, config.max_cardinality)
    cards = np.geomspace(low, config.max_cardinality, f_count).round().astype(np.int64)
    cards = _histories_widest(rng.permutation(cards), config=config)
    salts = rng.integers(0, 2**63, size=(3, f_count), dtype=np.int64).view(np.uint64)
    with_effect = np.zeros(f_count, dtype=bool)
    with_effect[rng.permutation(f_count)[: max(1, f_count // 2)]] = True
    interactions = _interaction_terms(
        config, cardinalities=cards, pair_salts=(int(salts[2, 0]), int(salts[2, 1 % f_count]))
    )
    draft = _PlantedModel(
        cardinalities=cards,
        id_salts=salts[0],
        effect_salts=salts[1],
        dense_mu=rng.uniform(0.0, 3.0, d_count),
        dense_sigma=rng.uniform(0.8, 2.0, d_count),
        dense_center=np.zeros(d_count),
        dense_weights=rng.standard_normal(d_count),
        effect_weights=np.where(with_effect, rng.uniform(0.5, 1.5, f_count), 0.0),
        interactions=interactions,
        interaction_weight=1.0,
        bias=0.0,
    )
    rows = _sample_rows(config, draft, rng, _CALIBRATION_ROWS)
    dense, effects, interaction = _terms(draft, rows)
    center = dense.mean(axis=0)
    dense = dense - center
    parts = [dense @ draft.dense_weights, effects @ draft.effect_weights, interaction]
    share = config.interaction_share if interactions else 0.0
    dense_share = (1.0 - config.interaction_share) * _DENSE_FRACTION
    shares = [dense_share, 1.0 - config.interaction_share - dense_share, share]
    scales = [math.sqrt(s) / max(float(x.std()), 1e-12) for s, x in zip(shares, parts, strict=True)]
    unit = sum(s * x for s, x in zip(scales, parts, strict=True))
    unit = unit / max(float(unit.std()), 1e-12)
    total = _scale_for_auc(unit, config=config)
    total_std = float(np.std(sum(s * x for s, x in zip(scales, parts, strict=True))))
    k = total / max(total_std, 1e-12)
    return dataclasses.replace(
        draft,
        dense_center=draft.dense_center + center,
        dense_weights=draft.dense_weights * scales[0] * k,
        effect_weights=draft.effect_weights * scales[1] * k,
        interaction_weight=scales[2] * k,
        bias=_solve_bias(total * unit, config.positive_rate),
    )


def _file_table(
    config: SyntheticConfig,
    model: _PlantedModel,
    *,
    split: str,
    index: int,
    first_id: int,
    num_rows: int,
) -> tuple[pa.Table, np.ndarray]:
    """One file's rows and their planted logits ``(num_rows,)``."""
    rng = np.random.default_rng([config.seed, _SPLIT_CODES[split], index])
    rows = _sample_rows(config, model, rng, num_rows)
    logit = _logit(model, rows)
    labels = (rng.random(num_rows) < _sigmoid(logit)).astype(np.int64)
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
    return pa.table(columns), logit


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
    )
    return _Stored(info=info, config=meta["config"])


def generate_synthetic(
    config: SyntheticConfig, *, out_dir: str | Path, overwrite: bool = False
) -> SyntheticInfo:
    """Writes the synthetic data set described by ``config`` (see the module docstring).

    If ``out_dir`` already holds a complete data set generated from the same config, it is
    returned as is.

    Args:
        config: sizes, shapes and seed of the data set.
        out_dir: root directory; ``train/``, ``eval/`` and ``metadata.json`` are written in it.
        overwrite: replace an existing (complete or partial) data set in ``out_dir``.

    Returns:
        The paths, row counts, files and planted AUC of the data set.

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
    written = _write_splits(config, model=_plant(config), out_dir=out_dir)
    info = SyntheticInfo(
        out_dir=out_dir,
        train_path=out_dir / "train",
        eval_path=out_dir / "eval" if config.num_eval_rows else None,
        num_train_rows=config.num_train_rows,
        num_eval_rows=config.num_eval_rows,
        train_files=written.files["train"],
        eval_files=written.files["eval"],
        planted_auc=written.auc.compute(),
        positive_rate=written.positives / (config.num_train_rows + config.num_eval_rows),
    )
    _write_metadata(info, config=config)
    return info


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


def _write_splits(config: SyntheticConfig, *, model: _PlantedModel, out_dir: Path) -> _Written:
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
    model: _PlantedModel,
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
        table, logit = _file_table(
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
            written.auc.update(logit, labels)
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
    tmp = info.out_dir / f".{_METADATA}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(info.out_dir / _METADATA)
