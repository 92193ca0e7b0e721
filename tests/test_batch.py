from __future__ import annotations

import pytest
import torch

from raydlrm.batch import Batch, DedupGroup, KeyedJaggedTensor, KeyedTensor


def _kjt() -> KeyedJaggedTensor:
    # F=2 (a, b), B=3: a = [1], [], [2, 3]; b = [4], [5, 6], [7]
    return KeyedJaggedTensor.from_lengths(
        ["a", "b"], torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([1, 0, 2, 1, 2, 1])
    )


def test_offsets_and_per_key() -> None:
    kjt = _kjt()
    assert kjt.batch_size == 3
    assert kjt.offsets.tolist() == [0, 1, 1, 3, 4, 6, 7]
    assert kjt.length_per_key().tolist() == [3, 4]
    assert kjt.offset_per_key().tolist() == [0, 3, 7]


def test_select_reorders_keys() -> None:
    sel = _kjt().select(["b", "a"])
    assert sel.keys == ["b", "a"]
    assert sel.values.tolist() == [4, 5, 6, 7, 1, 2, 3]
    assert sel.lengths.tolist() == [1, 2, 1, 1, 0, 2]
    with pytest.raises(KeyError, match="'c'"):
        _kjt().select(["c"])


def test_index_rows_gathers_bags() -> None:
    out = _kjt().index_rows(torch.tensor([2, 2, 0]))
    assert out.batch_size == 3
    assert out.lengths.tolist() == [2, 2, 1, 1, 1, 1]
    assert out.values.tolist() == [2, 3, 2, 3, 1, 7, 7, 4]


def test_validation_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="lengths sum to 3 but values has 2"):
        KeyedJaggedTensor(
            keys=["a"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 2]), batch_size=2
        )
    with pytest.raises(ValueError, match="expected F \\* B"):
        KeyedJaggedTensor(
            keys=["a", "b"], values=torch.tensor([1]), lengths=torch.tensor([1]), batch_size=1
        )
    with pytest.raises(ValueError, match="weights shape"):
        KeyedJaggedTensor(
            keys=["a"],
            values=torch.tensor([1]),
            lengths=torch.tensor([1]),
            batch_size=1,
            weights=torch.ones(2),
        )


def test_dedup_group_expands_to_full_batch() -> None:
    unique = KeyedJaggedTensor.from_lengths(["u"], torch.tensor([10, 11, 12]), torch.tensor([1, 2]))
    group = DedupGroup(unique=unique, inverse=torch.tensor([0, 0, 1, 1, 0]))
    expanded = group.expand()
    assert expanded.batch_size == 5
    assert expanded.values.tolist() == [10, 10, 11, 12, 11, 12, 10]
    with pytest.raises(ValueError, match="inverse index out of range"):
        DedupGroup(unique=unique, inverse=torch.tensor([0, 2]))


def test_batch_all_sparse_includes_dedup_groups() -> None:
    unique = KeyedJaggedTensor.from_lengths(["u"], torch.tensor([10, 11]), torch.tensor([1, 1]))
    batch = Batch(
        dense=torch.zeros(3, 2),
        sparse=_kjt(),
        labels=torch.zeros(3),
        dedup_groups=[DedupGroup(unique=unique, inverse=torch.tensor([1, 0, 1]))],
    )
    assert batch.feature_names == ["a", "b", "u"]
    full = batch.all_sparse()
    assert full.keys == ["a", "b", "u"]
    assert full.select(["u"]).values.tolist() == [11, 10, 11]
    with pytest.raises(ValueError, match="dense shape"):
        Batch(dense=torch.zeros(2, 2), sparse=_kjt(), labels=torch.zeros(3))


def test_keyed_tensor_views() -> None:
    kt = KeyedTensor(keys=["a", "b"], dims=[4, 4], values=torch.arange(16.0).view(2, 8))
    assert kt.stacked().shape == (2, 2, 4)
    assert kt.to_dict()["b"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]


def test_jagged_tensor_padding_last_and_positions():
    from raydlrm.batch import JaggedTensor

    values = torch.arange(12.0).view(6, 2)
    jagged = JaggedTensor(values=values, lengths=torch.tensor([2, 0, 4]))
    padded, mask = jagged.to_padded()
    assert padded.shape == (3, 4, 2)
    assert mask.tolist() == [[True, True, False, False], [False] * 4, [True] * 4]
    assert torch.equal(padded[mask], values)
    assert torch.equal(jagged.last(), torch.tensor([[2.0, 3.0], [0.0, 0.0], [10.0, 11.0]]))
    assert jagged.positions().tolist() == [0, 1, 0, 1, 2, 3]
    assert jagged.segment_ids().tolist() == [0, 0, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="more than max_length 3"):
        jagged.to_padded(3)
