"""DIN: shapes and gradients, the activation unit's formula, attention that depends on the
candidate, empty histories, a candidate read from a pooled column or a one-position sequence
alike, Dice, and the errors naming the features."""

from __future__ import annotations

import pytest
import torch

from raydlrm.batch import JaggedTensor
from raydlrm.models.din import Dice, DINDense

D = 8
LENGTHS = torch.tensor([3, 0, 5, 1, 2])
B = LENGTHS.numel()


def _model(**overrides) -> DINDense:
    torch.manual_seed(0)
    knobs = {
        "num_dense": 3,
        "num_sparse": 2,
        "embedding_dim": D,
        "bottom_mlp": [16, 8],
        "top_mlp": [20, 10],
        "pooled_features": ["user", "category"],
        "history": ["item_history", "category_history"],
        "candidate": ["item", "category"],
        "attention_mlp": [16, 8],
        "attention_normalization": "none",
        "activation": "dice",
    }
    return DINDense(**(knobs | overrides))


def _inputs(seed: int = 0, lengths: torch.Tensor = LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    n = int(lengths.sum())
    dense = torch.randn(B, 3, generator=gen)
    pooled = torch.randn(B, 2 * D, generator=gen, requires_grad=True)
    sequences = {
        "item_history": JaggedTensor(torch.randn(n, D, generator=gen).requires_grad_(), lengths),
        "category_history": JaggedTensor(torch.randn(n, D, generator=gen), lengths),
        "item": JaggedTensor(torch.randn(B, D, generator=gen), torch.ones(B, dtype=torch.int64)),
    }
    return dense, pooled, sequences


def test_forward_backward_shapes_and_gradients() -> None:
    model = _model()
    dense, pooled, sequences = _inputs()
    logits = model(dense, pooled, sequences)
    assert logits.shape == (B,) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert sequences["item_history"].values.grad.abs().sum() > 0
    assert pooled.grad.abs().sum() > 0


def test_attention_unit_formula_and_dependence_on_the_candidate() -> None:
    model = _model().eval()
    _, pooled, sequences = _inputs()
    history = model.history_rows(sequences)
    candidate = model.candidate_rows(pooled, sequences)
    weights = model.attention.weights(history, candidate).values
    # Sample 2's position 1 (row 3 + 1): the unit on [h, c, h - c, h * c], unnormalized.
    h, c = history.values[4], candidate[2]
    want = model.attention.unit(torch.cat([h, c, h - c, h * c]).unsqueeze(0)).squeeze()
    torch.testing.assert_close(weights[4], want)
    other = model.attention.weights(history, candidate.flip(0)).values
    assert not torch.allclose(weights, other)
    # The interest is the weighted sum of the positions.
    interest = model.attention(history, candidate)
    torch.testing.assert_close(interest[2], (weights[3:8, None] * history.values[3:8]).sum(0))


def test_softmax_normalization_sums_to_one_per_history() -> None:
    model = _model(attention_normalization="softmax").eval()
    _, pooled, sequences = _inputs()
    history = model.history_rows(sequences)
    weights = model.attention.weights(history, model.candidate_rows(pooled, sequences))
    sums = torch.segment_reduce(weights.values, "sum", lengths=LENGTHS)
    torch.testing.assert_close(sums, torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))


@pytest.mark.parametrize("activation", ["dice", "prelu"])
def test_empty_histories_give_finite_outputs_and_gradients(activation: str) -> None:
    model = _model(activation=activation).train()
    dense, pooled, sequences = _inputs(lengths=torch.zeros(B, dtype=torch.int64))
    logits = model(dense, pooled, sequences)
    logits.sum().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_candidate_from_a_pooled_column_or_a_one_position_sequence_alike() -> None:
    as_sequence = _model(pooled_features=["user"], num_sparse=1, candidate=["item", "cat"])
    as_pooled = _model(pooled_features=["user", "item"], num_sparse=2, candidate=["item", "cat"])
    as_pooled.load_state_dict(as_sequence.state_dict())
    dense, pooled, sequences = _inputs()
    sequences["cat"] = JaggedTensor(pooled[:, D:].detach(), torch.ones(B, dtype=torch.int64))
    user = pooled[:, :D]
    from_sequence = as_sequence.eval()(dense, user, sequences)
    item = sequences.pop("item").values
    from_pooled = as_pooled.eval()(dense, torch.cat([user, item], dim=1), sequences)
    torch.testing.assert_close(from_pooled, from_sequence, rtol=0, atol=0)


def test_dice_formula_and_a_batch_of_one() -> None:
    dice = Dice(4)
    with torch.no_grad():
        dice.alpha.fill_(0.25)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    p = torch.sigmoid((x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + 1e-8))
    torch.testing.assert_close(dice(x), p * x + (1 - p) * 0.25 * x)
    assert dice(x[:1]).shape == (1, 4)  # training: the running statistics, no error


def test_errors_name_the_features() -> None:
    dense, pooled, sequences = _inputs()
    with pytest.raises(ValueError, match=r"got unexpected \['extra'\], missing \[\]"):
        _model()(dense, pooled, sequences | {"extra": sequences["item"]})
    del sequences["item"]
    with pytest.raises(ValueError, match="DIN candidate feature 'item' is neither"):
        _model()(dense, pooled, sequences)
    with pytest.raises(ValueError, match="one candidate feature per history feature"):
        _model(candidate=["item"])
    with pytest.raises(ValueError, match="num_sparse=3 but 2 pooled features"):
        _model(num_sparse=3)
    with pytest.raises(ValueError, match=r"history features .* must be sequence features"):
        _model(history=["user", "category_history"])
