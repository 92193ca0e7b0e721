"""Synthetic daily partitions with id churn and popularity drift, for daily retraining.

:func:`write_churn` (reached through :func:`raydlrm.ingestion.generate_synthetic` with
``SyntheticConfig.kind = "churn"``) writes one hive partition per day,
``train/<partition_key>=<YYYY-MM-DD>/part-NNNNN.parquet``: ``data.train_path`` reads them all,
``data.partitions`` a range of them and ``raydlrm retrain`` one day after another. Columns:

- ``sample_id`` int64, unique over all days;
- ``label`` int64 0/1;
- ``I1..In`` float32, heavy-tailed non-negative counts with some nulls (as the Criteo-shaped
  data's);
- one int64 column per entry of ``churn.num_active_ids`` (default ``user_id``, ``item_id``):
  raw ids spread over the non-negative int64 range, to be hashed or mapped downstream.

Churn: each id column has ``n`` active ids, ranked by popularity; a row draws a rank from a
(continuous) Zipf law of exponent ``zipf_exponent`` over the ``n`` ranks, so rank ``r`` has
probability ``((r + 1)^(1-s) - (r + 2)^(1-s)) / (1 - (n + 1)^(1-s))``. From the second day on,
``round(new_id_share * n)`` ranks, drawn uniformly, retire their ids for ids never active
before; then ``round(rank_drift * n)`` ranks, drawn uniformly, reshuffle their ids among
themselves. An id's serial number (the order in which ids became active) maps to its raw id by
a bijection of [0, 2^63): ids never collide, and a retired id never comes back.

Labels are ``Bernoulli(sigmoid(logit))``; the logit is a bias, plus a per-id bias of every id
column, plus the dot product of the user's and the item's latent vectors (the first two
columns, ``latent_dim`` wide), plus a linear term of the dense features. An id's bias and
vector are normal deviates hashed from (column, raw id): the same every day. The user-item
term takes ``interaction_share`` of the logit's variance, the dense term a tenth and the id
biases the rest; the scale is calibrated on a sample of the first day so that the
planted AUC is about ``target_auc`` and the positive rate ``positive_rate``. Most of the signal
is per id: a model that gives each id a row of its own can learn it, one whose ids collide
cannot, and a new id's bias is unknown until its rows are seen.

Each file is drawn from its own random stream, seeded by (seed, day, file index), and the
populations from one stream per column: the same seed gives byte-identical files.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydlrm._sampling import zipf_ranks
from raydlrm.ingestion._planted import _scale_for_auc, _solve_bias, sigmoid
from raydlrm.ingestion.preprocess import mix64
from raydlrm.ingestion.synthetic_config import SyntheticConfig

__all__ = ["ChurnData", "ChurnStats", "write_churn"]

logger = logging.getLogger(__name__)

# Random streams: (seed, code, ...), apart from each other and from the Criteo-shaped data's.
_POPULATION_CODE = 10
_ROWS_CODE = 11
_MODEL_CODE = 12
_CALIBRATION_ROWS = 20_000
# The dense term's share of the logit's variance: small, the signal is meant to be in the ids.
_DENSE_SHARE = 0.1
_MASK63 = np.uint64((1 << 63) - 1)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class ChurnStats:
    """Per day and per id column, the ids of a churn data set (what tables are sized by).

    Attributes:
        days: the days' partition values, oldest first.
        distinct_ids: per column, the distinct ids in each day's rows.
        new_ids: per column, the ids of each day's rows that no earlier day's rows hold (all
            of them on the first day).
        total_distinct_ids: per column, the distinct ids over all days.
        ids_ever_active: per column, the ids ever active (drawn from); rare ones may never
            appear in a row.
        planted_auc: per day, the AUC of the planted logits on the day's labels (the ceiling
            a trainer can reach; None when the day has one class only).
    """

    days: list[str]
    distinct_ids: dict[str, list[int]]
    new_ids: dict[str, list[int]]
    total_distinct_ids: dict[str, int]
    ids_ever_active: dict[str, int]
    planted_auc: list[float | None]


@dataclass(frozen=True)
class ChurnData:
    """What :func:`write_churn` wrote."""

    files: list[Path]
    """The Parquet files, day by day, in order."""
    num_rows: int
    positives: int
    """Rows labelled 1."""
    stats: ChurnStats


@dataclass(frozen=True)
class _Model:
    """The label model, derived from the seed alone."""

    id_salts: np.ndarray  # (C,) uint64: scrambles serial numbers into raw ids
    bias_salts: np.ndarray  # (C,) uint64: per-id biases
    factor_salts: np.ndarray  # (C,) uint64: per-id latent vectors (the first two columns')
    dense_mu: np.ndarray  # (D,) of the log-normal count generator
    dense_sigma: np.ndarray  # (D,)
    dense_center: np.ndarray  # (D,) mean of log1p(filled dense)
    dense_weights: np.ndarray  # (D,)
    term_weights: tuple[float, float, float]  # of the dense, id-bias and user-item terms
    bias: float


@dataclass(frozen=True)
class _Active:
    """One day's active ids, per column by popularity rank, and their label-model values."""

    serials: list[np.ndarray]  # per column (n,) int64
    raw: list[np.ndarray]  # per column (n,) int64 raw ids
    biases: list[np.ndarray]  # per column (n,) float64
    factors: list[np.ndarray]  # user and item (n, latent_dim); empty with one column


@dataclass(frozen=True)
class _Rows:
    ranks: list[np.ndarray]  # per column (N,) int64 popularity ranks
    dense: np.ndarray  # (N, D) float32, NaN where missing


def _raw_ids(serials: np.ndarray, salt: int) -> np.ndarray:
    """Raw ids ``(n,)`` int64 of serial numbers: a splitmix64-like bijection of [0, 2^63), so
    distinct serials give distinct non-negative ids spread over the whole range."""
    z = (serials.astype(np.uint64) + np.uint64(salt)) & _MASK63
    with np.errstate(over="ignore"):
        z = ((z ^ (z >> np.uint64(30))) * _MUL1) & _MASK63
        z = ((z ^ (z >> np.uint64(27))) * _MUL2) & _MASK63
    return (z ^ (z >> np.uint64(31))).view(np.int64)


def _hash_normals(raw: np.ndarray, salt: int, width: int) -> np.ndarray:
    """Standard-normal values ``(n, width)``, a deterministic function of (salt, raw id)."""
    salts = mix64(np.arange(width, dtype=np.uint64) + np.uint64(salt))
    h1 = mix64(raw.view(np.uint64)[:, None] ^ salts[None, :])
    h2 = mix64(h1)
    scale = 2.0**-53
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) * scale
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * scale
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _num_new(config: SyntheticConfig, size: int) -> int:
    return round(config.churn.new_id_share * size)


def _populations(config: SyntheticConfig) -> Iterator[list[np.ndarray]]:
    """Each day's active id serials, per column by popularity rank (rank 0 the most popular).

    The first day's are ``0..n-1``; day ``d`` brings ``n + (d - 1) * k .. n + d * k - 1``
    (``k = round(new_id_share * n)``) in place of ``k`` retired ids, then reshuffles
    ``round(rank_drift * n)`` ranks.
    """
    churn = config.churn
    sizes = list(churn.num_active_ids.values())
    rngs = [np.random.default_rng([config.seed, _POPULATION_CODE, c]) for c in range(len(sizes))]
    serials = [np.arange(n, dtype=np.int64) for n in sizes]
    yield serials
    for day in range(1, churn.num_days):
        next_serials = []
        for ids, rng in zip(serials, rngs, strict=True):
            n, k = ids.size, _num_new(config, ids.size)
            ids = ids.copy()
            ids[rng.choice(n, size=k, replace=False)] = np.arange(n + (day - 1) * k, n + day * k)
            moved = rng.choice(n, size=round(churn.rank_drift * n), replace=False)
            ids[moved] = ids[rng.permutation(moved)]
            next_serials.append(ids)
        serials = next_serials
        yield serials


def _active(config: SyntheticConfig, model: _Model, serials: list[np.ndarray]) -> _Active:
    raw = [_raw_ids(s, int(salt)) for s, salt in zip(serials, model.id_salts, strict=True)]
    biases = [
        _hash_normals(r, int(salt), 1)[:, 0] for r, salt in zip(raw, model.bias_salts, strict=True)
    ]
    factors = []
    if len(raw) >= 2:
        factors = [
            _hash_normals(r, int(salt), config.churn.latent_dim)
            for r, salt in zip(raw[:2], model.factor_salts[:2], strict=True)
        ]
    return _Active(serials=serials, raw=raw, biases=biases, factors=factors)


def _sample(
    config: SyntheticConfig, model: _Model, active: _Active, rng: np.random.Generator, n: int
) -> _Rows:
    """``n`` rows' id ranks (Zipf) and dense features (log-normal counts, some null)."""
    ranks = [
        zipf_ranks(rng, size=n, cardinality=s.size, s=config.zipf_exponent) for s in active.serials
    ]
    normal = rng.standard_normal((n, config.num_dense))
    counts = np.floor(np.exp(model.dense_mu + model.dense_sigma * normal)) - 1.0
    dense = np.maximum(counts, 0.0).astype(np.float32)
    dense[rng.random(dense.shape) < config.dense_null_fraction] = np.nan
    return _Rows(ranks=ranks, dense=dense)


def _terms(model: _Model, active: _Active, rows: _Rows) -> list[np.ndarray]:
    """The logit's unweighted terms, ``(N,)`` each: dense, id biases, user-item."""
    dense = np.log1p(np.nan_to_num(rows.dense, nan=0.0).astype(np.float64)) - model.dense_center
    biases = sum(b[r] for b, r in zip(active.biases, rows.ranks, strict=True))
    biases = biases / math.sqrt(len(active.biases))
    if active.factors:
        users = active.factors[0][rows.ranks[0]]
        items = active.factors[1][rows.ranks[1]]
        pairs = np.einsum("nk,nk->n", users, items) / math.sqrt(users.shape[1])
    else:
        pairs = np.zeros(rows.dense.shape[0])
    return [dense @ model.dense_weights, biases, pairs]


def _logit(model: _Model, terms: list[np.ndarray]) -> np.ndarray:
    return model.bias + sum(w * t for w, t in zip(model.term_weights, terms, strict=True))


def _plant(config: SyntheticConfig) -> _Model:
    """Draws the label model from the seed; calibrates its term weights and bias on a sample of
    the first day (the shares of the logit's variance, ``target_auc``, ``positive_rate``)."""
    rng = np.random.default_rng([config.seed, _MODEL_CODE])
    num_columns, num_dense = len(config.churn.num_active_ids), config.num_dense
    salts = rng.integers(0, 2**63, size=(3, num_columns), dtype=np.int64).view(np.uint64)
    draft = _Model(
        id_salts=salts[0],
        bias_salts=salts[1],
        factor_salts=salts[2],
        dense_mu=rng.uniform(0.0, 3.0, num_dense),
        dense_sigma=rng.uniform(0.8, 2.0, num_dense),
        dense_center=np.zeros(num_dense),
        dense_weights=rng.standard_normal(num_dense),
        term_weights=(1.0, 1.0, 1.0),
        bias=0.0,
    )
    active = _active(config, draft, next(_populations(config)))
    rows = _sample(config, draft, active, rng, _CALIBRATION_ROWS)
    center = np.log1p(np.nan_to_num(rows.dense, nan=0.0).astype(np.float64)).mean(axis=0)
    draft = dataclasses.replace(draft, dense_center=center)
    terms = _terms(draft, active, rows)
    pair_share = config.interaction_share if active.factors else 0.0
    shares = [_DENSE_SHARE, 1.0 - pair_share - _DENSE_SHARE, pair_share]
    scales = [math.sqrt(s) / max(float(t.std()), 1e-12) for s, t in zip(shares, terms, strict=True)]
    mixed = sum(s * t for s, t in zip(scales, terms, strict=True))
    unit = mixed / max(float(mixed.std()), 1e-12)
    total = _scale_for_auc(unit, config=config)
    k = total / max(float(mixed.std()), 1e-12)
    return dataclasses.replace(
        draft,
        term_weights=(scales[0] * k, scales[1] * k, scales[2] * k),
        bias=_solve_bias(total * unit, config.positive_rate),
    )


class _Tally:
    """Which ids each day's rows hold, by serial number, and the counts of :class:`ChurnStats`."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.columns = list(config.churn.num_active_ids)
        sizes = config.churn.num_active_ids.values()
        self.ever = [n + (config.churn.num_days - 1) * _num_new(config, n) for n in sizes]
        self.seen = [np.zeros(n, dtype=bool) for n in self.ever]
        self.today = [np.zeros(n, dtype=bool) for n in self.ever]
        self.distinct: dict[str, list[int]] = {c: [] for c in self.columns}
        self.new: dict[str, list[int]] = {c: [] for c in self.columns}

    def add(self, active: _Active, rows: _Rows) -> None:
        for today, serials, ranks in zip(self.today, active.serials, rows.ranks, strict=True):
            today[serials[ranks]] = True

    def close_day(self) -> None:
        for c, column in enumerate(self.columns):
            today, seen = self.today[c], self.seen[c]
            self.distinct[column].append(int(today.sum()))
            self.new[column].append(int((today & ~seen).sum()))
            seen |= today
            today[:] = False

    def stats(self, days: list[str], planted_auc: list[float | None]) -> ChurnStats:
        return ChurnStats(
            days=days,
            distinct_ids=self.distinct,
            new_ids=self.new,
            total_distinct_ids={
                c: int(s.sum()) for c, s in zip(self.columns, self.seen, strict=True)
            },
            ids_ever_active=dict(zip(self.columns, self.ever, strict=True)),
            planted_auc=planted_auc,
        )


def _table(
    config: SyntheticConfig, active: _Active, rows: _Rows, *, labels: np.ndarray, first_id: int
) -> pa.Table:
    n = labels.size
    columns: dict[str, pa.Array] = {
        "sample_id": pa.array(np.arange(first_id, first_id + n, dtype=np.int64)),
        "label": pa.array(labels),
    }
    missing = np.isnan(rows.dense)
    for j in range(config.num_dense):
        columns[f"I{j + 1}"] = pa.array(rows.dense[:, j], mask=missing[:, j])
    for column, raw, ranks in zip(config.churn.num_active_ids, active.raw, rows.ranks, strict=True):
        columns[column] = pa.array(raw[ranks])
    return pa.table(columns)


@dataclass
class _Day:
    """What one day's files add up to."""

    files: list[Path]
    positives: int
    planted_auc: float | None


def _write_day(
    config: SyntheticConfig,
    model: _Model,
    active: _Active,
    *,
    index: int,
    day_dir: Path,
    tally: _Tally,
) -> _Day:
    """Writes day ``index``'s rows file by file into ``day_dir``."""
    from sklearn.metrics import roc_auc_score  # a second to import: only when writing

    total = config.churn.rows_per_day
    day = _Day(files=[], positives=0, planted_auc=None)
    logits, labels = [], []
    for file_index in range(math.ceil(total / config.rows_per_file)):
        start = file_index * config.rows_per_file
        num_rows = min(config.rows_per_file, total - start)
        rng = np.random.default_rng([config.seed, _ROWS_CODE, index, file_index])
        rows = _sample(config, model, active, rng, num_rows)
        logits.append(_logit(model, _terms(model, active, rows)))
        labels.append((rng.random(num_rows) < sigmoid(logits[-1])).astype(np.int64))
        table = _table(config, active, rows, labels=labels[-1], first_id=index * total + start)
        path = day_dir / f"part-{file_index:05d}.parquet"
        pq.write_table(table, path)
        day.files.append(path)
        day.positives += int(labels[-1].sum())
        tally.add(active, rows)
    if 0 < day.positives < total:
        day.planted_auc = float(roc_auc_score(np.concatenate(labels), np.concatenate(logits)))
    return day


def write_churn(config: SyntheticConfig, *, train_dir: Path) -> ChurnData:
    """Writes the churn data set of ``config`` (``kind = "churn"``) under ``train_dir``, one
    ``<partition_key>=<day>/`` directory per day (see the module docstring).

    Args:
        config: the data set; ``config.churn`` says its days, rows and id populations.
        train_dir: the directory of the day partitions (created).

    Returns:
        The files, row and positive counts, and the per-day id counts.
    """
    assert config.kind == "churn", config.kind
    model = _plant(config)
    days = config.churn.days()
    tally = _Tally(config)
    files: list[Path] = []
    positives = 0
    planted_auc: list[float | None] = []
    for index, (day, serials) in enumerate(zip(days, _populations(config), strict=True)):
        day_dir = train_dir / f"{config.partition_key}={day}"
        day_dir.mkdir(parents=True)
        active = _active(config, model, serials)
        written = _write_day(config, model, active, index=index, day_dir=day_dir, tally=tally)
        tally.close_day()
        files += written.files
        positives += written.positives
        planted_auc.append(written.planted_auc)
        logger.info(
            "wrote %d rows of %s=%s in %d files",
            config.churn.rows_per_day,
            config.partition_key,
            day,
            len(written.files),
        )
    return ChurnData(
        files=files,
        num_rows=config.churn.rows_per_day * len(days),
        positives=positives,
        stats=tally.stats(days, planted_auc),
    )
