from __future__ import annotations

import pytest
import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.models import (
    CrossNet,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    ModelConfig,
    build_model,
)
from raydlrm.models.embedding import INIT_BLOCK_ROWS, init_rows_


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig("t0", 10, 4, ("f0", "f1")),
        EmbeddingBagConfig("t1", 7, 4, ("f2",), pooling="mean"),
    ]


def test_ebc_pools_rows_per_bag() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables())
    # B=2: f0 = [1, 2], [3]; f1 = [], [4]; f2 = [5, 6], [0]
    kjt = KeyedJaggedTensor.from_lengths(
        ["f2", "f0", "f1"],
        torch.tensor([5, 6, 0, 1, 2, 3, 4]),
        torch.tensor([2, 1, 2, 1, 0, 1]),
    )
    out = ebc(kjt)
    assert out.keys == ["f0", "f1", "f2"]
    w0, w1 = ebc.weights["t0"], ebc.weights["t1"]
    got = out.to_dict()
    torch.testing.assert_close(got["f0"], torch.stack([w0[1] + w0[2], w0[3]]))
    torch.testing.assert_close(got["f1"], torch.stack([torch.zeros(4), w0[4]]))
    torch.testing.assert_close(got["f2"], torch.stack([(w1[5] + w1[6]) / 2, w1[0]]))


def test_ebc_weighted_bags() -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 5, 4, ("f",))])
    kjt = KeyedJaggedTensor.from_lengths(
        ["f"], torch.tensor([1, 2]), torch.tensor([2]), weights=torch.tensor([0.5, 2.0])
    )
    w = ebc.weights["t"]
    torch.testing.assert_close(ebc(kjt).values[0], 0.5 * w[1] + 2.0 * w[2])


def test_ebc_rejects_out_of_range_ids_naming_table() -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("clicks", 5, 4, ("f",))])
    kjt = KeyedJaggedTensor.from_lengths(["f"], torch.tensor([5]), torch.tensor([1]))
    with pytest.raises(ValueError, match="table clicks"):
        ebc(kjt)


def test_ebc_rejects_feature_in_two_tables() -> None:
    with pytest.raises(ValueError, match=r"\['f'\]"):
        EmbeddingBagCollection(
            [EmbeddingBagConfig("a", 5, 4, ("f",)), EmbeddingBagConfig("b", 5, 4, ("f",))]
        )


def test_cross_layer_formula() -> None:
    torch.manual_seed(0)
    cross = CrossNet(in_features=6, num_layers=1, low_rank=3)
    x0 = torch.randn(4, 6)
    down, up = cross.down[0], cross.up[0]
    expected = x0 * (x0 @ down.weight.T @ up.weight.T + up.bias) + x0
    torch.testing.assert_close(cross(x0), expected)


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_model_learns_a_planted_signal(arch: str) -> None:
    """A few hundred steps on a planted problem must beat chance clearly; a model whose
    embeddings or dense path were disconnected would not."""
    torch.manual_seed(0)
    config = ModelConfig(
        arch=arch,
        embedding_dim=8,
        bottom_mlp=[16, 8],
        top_mlp=[16],
        dcn_num_layers=1,
        dcn_low_rank=4,
    )
    tables = [EmbeddingBagConfig(f"t{i}", 20, 8, (f"f{i}",)) for i in range(3)]
    model = build_model(config, tables=tables, num_dense=2)
    effect = torch.randn(3, 20) * 2
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    b = 256

    def sample() -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        ids = torch.randint(0, 20, (3, b))
        dense = torch.randn(b, 2)
        logit = effect.gather(1, ids).sum(0) + dense[:, 0]
        labels = torch.bernoulli(torch.sigmoid(logit))
        kjt = KeyedJaggedTensor.from_lengths(
            ["f0", "f1", "f2"], ids.reshape(-1), torch.ones(3 * b, dtype=torch.int64)
        )
        return dense, kjt, labels

    for _ in range(150):
        dense, kjt, labels = sample()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model.forward_features(dense, kjt), labels
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    dense, kjt, labels = sample()
    with torch.no_grad():
        final = torch.nn.functional.binary_cross_entropy_with_logits(
            model.forward_features(dense, kjt), labels
        )
    assert final < 0.5  # chance level is ~0.69


def test_dlrm_requires_bottom_mlp_to_match_dim() -> None:
    with pytest.raises(ValueError, match="bottom_mlp"):
        ModelConfig(arch="dlrm", embedding_dim=16, bottom_mlp=[32, 8])


def test_build_model_rejects_table_dim_mismatch() -> None:
    with pytest.raises(ValueError, match="table t0"):
        build_model(ModelConfig(), tables=[EmbeddingBagConfig("t0", 5, 8, ("f",))], num_dense=2)


def test_block_init_of_any_rectangle_equals_the_whole_table() -> None:
    """Scale: a shard (any rows and columns, crossing init blocks) is initialized on its own to
    the values of the same part of the whole table; the seed and table name change them."""
    table = EmbeddingBagConfig("t", 2 * INIT_BLOCK_ROWS + 100, 12, ("f",))
    whole = init_rows_(torch.empty(table.num_embeddings, 12), table=table, seed=5)
    bound = (1.0 / table.num_embeddings) ** 0.5
    assert whole.abs().max() <= bound and whole.std() > bound / 3
    for row_start, rows, col_start, cols in [
        (0, 10, 0, 12),
        (INIT_BLOCK_ROWS - 3, 7, 4, 8),
        (INIT_BLOCK_ROWS * 2, 100, 8, 4),
    ]:
        part = init_rows_(
            torch.empty(rows, cols, dtype=torch.float16),
            table=table,
            seed=5,
            row_start=row_start,
            col_start=col_start,
        )
        expected = whole[row_start : row_start + rows, col_start : col_start + cols]
        assert torch.equal(part, expected.half())
    assert not torch.equal(init_rows_(torch.empty_like(whole), table=table, seed=6), whole)
    other = EmbeddingBagConfig("u", table.num_embeddings, 12, ("f",))
    assert not torch.equal(init_rows_(torch.empty_like(whole), table=other, seed=5), whole)
    assert torch.equal(EmbeddingBagCollection([table], seed=5).weights["t"].detach(), whole)
    with pytest.raises(ValueError, match="table t: rows"):
        init_rows_(torch.empty(5, 12), table=table, seed=5, row_start=table.num_embeddings - 2)
