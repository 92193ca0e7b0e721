"""The planted model of the synthetic data set: the rows it draws and the labels' logits.

Labels are ``Bernoulli(sigmoid(logit))`` with a planted logit: a bias, a linear term on
``log1p`` of the (null-filled) dense features, per-id effects for half of the sparse features (a
hash of (feature, raw id) turned into a normal deviate, the mean over the list for list
features) and interaction terms, each a product of per-id factors of several features
(``interaction_orders``; by default one product of two features), so the interaction layer
matters. The planted model is derived from the seed alone: its term scales and bias are
calibrated once on a sample so that its AUC is ``target_auc``, the positive rate
``positive_rate`` and the interactions' share of the logit's variance ``interaction_share``.

The rows are drawn per file by ``raydlrm.ingestion.synthetic`` (:func:`sample_rows` from each
file's own random stream); :func:`plant` draws the model from ``SyntheticConfig.seed``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from raydlrm._sampling import zipf_ranks
from raydlrm.ingestion.preprocess import mix64
from raydlrm.ingestion.synthetic_config import SyntheticConfig

__all__ = ["PlantedModel", "Rows", "logit", "plant", "sample_rows", "sigmoid", "terms"]

_CALIBRATION_CODE = 2
_CALIBRATION_ROWS = 20_000
_MIN_CARDINALITY = 4
# The dense linear term's part of the planted logit's variance left by the interactions (the
# per-id effects take the rest).
_DENSE_FRACTION = 0.3125
# Seeds the features and factors of interaction terms beyond the first pair.
_INTERACTION_CODE = 1


@dataclass(frozen=True)
class PlantedModel:
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
class Rows:
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


def sample_rows(
    config: SyntheticConfig, model: PlantedModel, rng: np.random.Generator, num_rows: int
) -> Rows:
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
    return Rows(session_start=session_start, dense=dense, ids=ids, offsets=offsets)


def terms(model: PlantedModel, rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def logit(model: PlantedModel, rows: Rows) -> np.ndarray:
    dense, effects, interaction = terms(model, rows)
    return (
        model.bias
        + dense @ model.dense_weights
        + effects @ model.effect_weights
        + model.interaction_weight * interaction
    )


def sigmoid(x: np.ndarray) -> np.ndarray:
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
        p = sigmoid(bias + z)
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
        if _soft_auc(unit, sigmoid(bias + mid * unit)) < config.target_auc:
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


def plant(config: SyntheticConfig) -> PlantedModel:
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
    draft = PlantedModel(
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
    rows = sample_rows(config, draft, rng, _CALIBRATION_ROWS)
    dense, effects, interaction = terms(draft, rows)
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
