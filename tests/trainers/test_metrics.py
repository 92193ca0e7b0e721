from __future__ import annotations

import math

import torch
from sklearn.metrics import log_loss, roc_auc_score

from raydlrm.trainers.metrics import PredictionBuffer, binary_metrics


def test_metrics_match_sklearn() -> None:
    torch.manual_seed(0)
    labels = torch.bernoulli(torch.full((500,), 0.3))
    logits = labels * 1.5 + torch.randn(500)
    m = binary_metrics(logits, labels)
    probs = torch.sigmoid(logits.double()).numpy()
    assert math.isclose(m.auc, roc_auc_score(labels.numpy(), probs), rel_tol=1e-9)
    assert math.isclose(m.log_loss, log_loss(labels.numpy(), probs), rel_tol=1e-6)
    assert m.num_samples == 500


def test_auc_with_tied_scores_matches_sklearn() -> None:
    """Tied scores (a coarse model, fp16 logits, a constant stretch) share their average rank,
    as in scikit-learn."""
    torch.manual_seed(1)
    labels = torch.bernoulli(torch.full((2000,), 0.2))
    for logits in (
        torch.round(labels + torch.randn(2000)),  # a handful of distinct values
        (labels * 0.3 + torch.randn(2000)).half().float(),
        torch.cat([torch.zeros(1000), labels[1000:] + torch.randn(1000)]),
    ):
        expected = roc_auc_score(labels.numpy(), logits.numpy())
        assert math.isclose(binary_metrics(logits, labels).auc, expected, rel_tol=1e-12)
    assert binary_metrics(torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 1.0])).auc == 0.5


def test_normalized_entropy_is_one_for_base_rate_predictor() -> None:
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    p = 0.25
    logits = torch.full((4,), math.log(p / (1 - p)))
    m = binary_metrics(logits, labels)
    assert math.isclose(m.normalized_entropy, 1.0, rel_tol=1e-9)


def test_single_class_gives_nan_auc() -> None:
    m = binary_metrics(torch.zeros(3), torch.ones(3))
    assert math.isnan(m.auc)


def test_buffer_concatenates_and_clears() -> None:
    buf = PredictionBuffer()
    buf.add(torch.tensor([2.0, -2.0]), torch.tensor([1.0, 0.0]))
    buf.add(torch.tensor([1.0]), torch.tensor([1.0]))
    m = buf.compute()
    assert m.num_samples == 3 and m.auc == 1.0
    assert buf.compute().num_samples == 0
