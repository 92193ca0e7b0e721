"""SASRec: causal (a position's state does not see later events), positions counted from the
newest event, the next items of every position, the sampled softmax loss against a brute-force
reference (chunked or not, values and gradients), the user vectors, and the errors."""

from __future__ import annotations

import pytest
import torch

from raydlrm.batch import JaggedTensor
from raydlrm.models.sasrec import SASRecDense, next_items, sampled_softmax_loss

D = 8
LENGTHS = torch.tensor([3, 0, 6, 1, 4])
B, N = LENGTHS.numel(), int(LENGTHS.sum())


def _model(**overrides) -> SASRecDense:
    torch.manual_seed(0)
    knobs = {
        "embedding_dim": D,
        "history": "items",
        "target": "next",
        "max_length": 6,
        "num_blocks": 2,
        "num_heads": 2,
        "dropout": 0.2,
        "temperature": 0.5,
    }
    return SASRecDense(**(knobs | overrides))


def _history(seed: int = 0, lengths: torch.Tensor = LENGTHS) -> JaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    return JaggedTensor(torch.randn(int(lengths.sum()), D, generator=gen), lengths)


def test_a_state_does_not_depend_on_later_events() -> None:
    model = _model().eval()
    history = _history()
    states = model({"items": history}).values
    changed = history.values.clone()
    # Sample 2 (rows 3..8): change its positions 2.. ; sample 4 (rows 10..13): position 3.
    changed[5:9] = torch.randn(4, D)
    changed[13] = torch.randn(D)
    after = model({"items": JaggedTensor(changed, LENGTHS)}).values
    unchanged = [0, 1, 2, 3, 4, 9, 10, 11, 12]
    torch.testing.assert_close(after[unchanged], states[unchanged], rtol=0, atol=1e-6)
    assert not torch.allclose(after[5:9], states[5:9])


def test_positions_count_from_the_newest_event() -> None:
    model = _model(num_blocks=0, dropout=0.0)
    history = _history()
    states = model({"items": history}).values
    newest_first = torch.tensor([2, 1, 0, 5, 4, 3, 2, 1, 0, 0, 3, 2, 1, 0])
    x = history.values * D**0.5 + model.positions.weight[newest_first]
    torch.testing.assert_close(states, model.final_norm(x))


def test_user_vectors_are_the_last_states() -> None:
    model = _model().eval()
    history = _history()
    users = model.user_vectors({"items": history})
    states = model({"items": history}).values
    torch.testing.assert_close(users[[0, 2, 3, 4]], states[[2, 8, 9, 13]])
    assert torch.equal(users[1], torch.zeros(D))


def test_next_items_shift_by_one_and_end_at_the_target() -> None:
    history = JaggedTensor(torch.arange(5.0).view(5, 1), torch.tensor([2, 0, 3]))
    nxt = next_items(
        history,
        history_rows=torch.tensor([10, 11, 12, 13, 14]),
        target_embeddings=torch.tensor([[-1.0], [-2.0], [-3.0]]),
        target_rows=torch.tensor([20, 21, 22]),
    )
    assert nxt.rows.tolist() == [11, 20, 13, 14, 22]
    assert nxt.embeddings.flatten().tolist() == [1.0, -1.0, 3.0, 4.0, -3.0]


def _loss_inputs() -> tuple[torch.Tensor, ...]:
    """States and an item table (float64); the next items repeat (collisions among the
    positions), sampled items collide with them, one is sampled twice."""
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(9, D, generator=gen, dtype=torch.float64).requires_grad_()
    table = torch.randn(9, D, generator=gen, dtype=torch.float64).requires_grad_()
    return states, table, torch.tensor([1, 2, 1, 3, 4, 2, 5, 6, 1]), torch.tensor([2, 7, 1, 8, 7])


def _brute_force_loss(states, table, next_rows, negative_rows, temperature):
    """Column by column: the true next item, every other position's next item unless the same
    item, every sampled item unless the same item."""
    losses = []
    for i, row in enumerate(next_rows.tolist()):
        others = [r for j, r in enumerate(next_rows.tolist()) if j != i and r != row]
        sampled = [r for r in negative_rows.tolist() if r != row]
        candidates = table[[row, *others, *sampled]]
        losses.append(-torch.log_softmax(candidates @ states[i] / temperature, dim=0)[0])
    return torch.stack(losses).mean()


@pytest.mark.parametrize("max_logits", [1 << 22, 20])  # one chunk; chunks of 2 (checkpointed)
def test_sampled_softmax_equals_brute_force(max_logits: int) -> None:
    states, table, next_rows, negative_rows = _loss_inputs()
    got = sampled_softmax_loss(
        states,
        next_embeddings=table[next_rows],
        next_rows=next_rows,
        negative_embeddings=table[negative_rows],
        negative_rows=negative_rows,
        temperature=0.5,
        max_logits=max_logits,
    )
    want = _brute_force_loss(states, table, next_rows, negative_rows, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, b in zip(
        torch.autograd.grad(got, (states, table)),
        torch.autograd.grad(want, (states, table)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_model_loss_trains_every_parameter_and_the_embeddings() -> None:
    model = _model().train()
    history = _history()
    history.values.requires_grad_()
    target = JaggedTensor(torch.randn(B, D), torch.ones(B, dtype=torch.int64))
    sequences = {"items": history, "next": target}
    loss = model.loss(
        model(sequences),
        sequences=sequences,
        history_rows=torch.randint(0, 30, (N,)),
        target_rows=torch.randint(0, 30, (B,)),
        negative_embeddings=torch.randn(5, D),
        negative_rows=torch.randint(0, 30, (5,)),
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert history.values.grad.abs().sum() > 0
    empty = torch.zeros(0, D, requires_grad=True)
    zero = sampled_softmax_loss(
        empty,
        next_embeddings=empty,
        next_rows=torch.zeros(0, dtype=torch.int64),
        negative_embeddings=torch.randn(5, D),
        negative_rows=torch.arange(5),
        temperature=1.0,
    )
    assert zero.item() == 0.0 and zero.requires_grad


def test_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"feature 'items': a history has 7 events, more than"):
        _model()({"items": _history(lengths=torch.tensor([7, 2]))})
    with pytest.raises(ValueError, match=r"SASRec reads the sequence feature 'items'; got \['x'\]"):
        _model()({"x": _history()})
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be positive and divide"):
        _model(num_heads=3)
