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
from tests._tolerance import assert_sums_close


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
    # One addition (and a halving) a bag, in any order the same: exactly.
    assert torch.equal(got["f0"], torch.stack([w0[1] + w0[2], w0[3]]))
    assert torch.equal(got["f1"], torch.stack([torch.zeros(4), w0[4]]))
    assert torch.equal(got["f2"], torch.stack([(w1[5] + w1[6]) / 2, w1[0]]))


def test_ebc_weighted_bags() -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("t", 5, 4, ("f",))])
    kjt = KeyedJaggedTensor.from_lengths(
        ["f"], torch.tensor([1, 2]), torch.tensor([2]), weights=torch.tensor([0.5, 2.0])
    )
    w = ebc.weights["t"]
    # Weights that are powers of two scale exactly: one addition, exactly.
    assert torch.equal(ebc(kjt).values[0], 0.5 * w[1] + 2.0 * w[2])


def test_ebc_rejects_out_of_range_ids_naming_table() -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("clicks", 5, 4, ("f",))])
    kjt = KeyedJaggedTensor.from_lengths(["f"], torch.tensor([5]), torch.tensor([1]))
    # The message of every collection's one id range check (models.embedding.check_id_range).
    with pytest.raises(ValueError, match=r"table 'clicks' \(feature 'f'\): id 5 not in \[0, 5\)"):
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
    # Two matmuls (6 and 3 terms, the bias added apart or fused), a product and a sum.
    assert_sums_close(cross(x0), expected, n_terms=6 + 1, k=3)


# Small sizes of every architecture's knobs (the tests' models).
SMALL = {
    "embedding_dim": 8,
    "bottom_mlp": [16, 8],
    "top_mlp": [16],
    "dcn_num_layers": 1,
    "dcn_low_rank": 4,
    "wukong_num_layers": 2,
    "wukong_num_fm": 3,
    "wukong_num_lc": 2,
    "wukong_rank": 3,
    "wukong_fm_mlp": [16],
    "dhen_layers": [["dot", "cross", "attention", "linear", "conv"], ["dot", "attention"]],
}
ARCHS = ["dlrm", "dcnv2", "wukong", "dhen"]


@pytest.mark.parametrize("arch", ARCHS)
def test_model_learns_a_planted_signal(arch: str) -> None:
    """A few hundred steps on a planted problem must beat chance clearly; a model whose
    embeddings or dense path were disconnected would not."""
    torch.manual_seed(0)
    config = ModelConfig(arch=arch, **SMALL)
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


@pytest.mark.parametrize(
    ("arch", "ensemble"), [("wukong", None), ("dhen", "concat"), ("dhen", "sum")]
)
def test_new_arches_shapes_and_a_gradient_reaching_every_parameter(
    arch: str, ensemble: str | None
) -> None:
    knobs = {**SMALL, "bottom_mlp": [16, 16]}  # two dense vectors of 8
    if ensemble:
        knobs["dhen_ensemble"] = ensemble
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(f"t{i}", 20, 8, (f"f{i}",)) for i in range(3)]
    model = build_model(ModelConfig(arch=arch, **knobs), tables=tables, num_dense=2)
    logits = model.dense(torch.randn(5, 2), torch.randn(5, 24, requires_grad=True))
    assert logits.shape == (5,)
    logits.square().sum().backward()
    missing = [n for n, p in model.dense.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing
    if arch == "wukong":  # 2 + 3 vectors in, 3 + 2 out of each layer: no residual projection
        assert all(layer.residual is None for layer in model.dense.layers)
        assert model.dense.top[0].in_features == (3 + 2) * 8


def test_wukong_factorization_machine_is_the_low_rank_projection_of_all_dot_products() -> None:
    from raydlrm.models.wukong import FactorizationMachineBlock

    torch.manual_seed(0)
    fmb = FactorizationMachineBlock(n_in=4, n_out=2, dim=8, rank=3, hidden=[])
    x = torch.randn(5, 4, 8)
    expected = torch.bmm(x, x.transpose(1, 2)) @ fmb.projection  # (X X^T) Y
    out = fmb.mlp(fmb.norm(expected.flatten(1))).view(5, 2, 8)
    # Another association of X X^T Y: 8 x 4 products an entry; the norm and the projection
    # after it keep the error relative to the values.
    assert_sums_close(fmb(x), out, n_terms=8 * 4, k=3)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"arch": "wukong", "bottom_mlp": [16, 12]},
            r"model\.bottom_mlp\[-1\] \(12\) must be a multiple",
        ),
        ({"arch": "wukong", "wukong_rank": 0}, r"model\.wukong_rank must be positive"),
        ({"arch": "wukong", "wukong_fm_mlp": [0]}, r"model\.wukong_fm_mlp must be positive"),
        (
            {"arch": "dhen", "dhen_layers": [["dot", "mlp"]]},
            r"dhen_layers\.0\.1\s+Input should be 'dot', .* input_value='mlp'",
        ),
        ({"arch": "dhen", "dhen_layers": [[]]}, r"model\.dhen_layers must be non-empty"),
        ({"arch": "dhen", "dhen_attention_heads": 3}, r"model\.dhen_attention_heads \(3\) must"),
    ],
)
def test_invalid_knobs_are_named_with_their_dotted_key(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SMALL, **override})


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


def _quantized_state(
    table: EmbeddingBagConfig, precision: str, blocks: list[tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """A quantized table's state-dict entries as a checkpoint saves them: each column block
    quantized on its own, the codes side by side, the (scale, bias) pairs side by side."""
    from raydlrm.models.quantized import quantize_rows

    values = torch.randn(table.num_embeddings, table.embedding_dim)
    parts = [quantize_rows(values[:, a:b], precision=precision) for a, b in blocks]
    prefix = f"quantized.{table.name}."
    return {
        prefix + "codes": torch.cat([c for c, _ in parts], dim=1),
        prefix + "qparams": torch.cat([p for _, p in parts], dim=1),
        prefix + "blocks": torch.tensor(blocks, dtype=torch.int64),
    }


@pytest.mark.parametrize(
    ("precision", "blocks"), [("int8", [(0, 4), (4, 12)]), ("int4", [(0, 12)])]
)
def test_quantized_table_dequantizes_only_the_rows_a_lookup_gathers(
    precision: str, blocks: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state dict holding a table's codes makes the collection hold it quantized (buffers,
    assign=True too); a lookup equals embedding_bag over the whole table dequantized (sum,
    weighted, mean) and dequantizes only the distinct rows it looks up; a state dict with a
    weight makes it a weight again."""
    from raydlrm.models import embedding as embedding_module
    from raydlrm.models import quantized

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig("q", 50, 12, ("f0",)),
        EmbeddingBagConfig("m", 50, 12, ("f1",), pooling="mean"),
    ]
    state = _quantized_state(tables[0], precision, blocks)
    state.update({k.replace(".q.", ".m."): v for k, v in state.items()})
    for assign in (False, True):
        ebc = EmbeddingBagCollection(tables, device="meta" if assign else "cpu")
        ebc.load_state_dict(state, assign=assign)
        assert not ebc.weights and ebc.precisions() == {"q": precision, "m": precision}
        assert ebc.quantized["q"].codes.dtype == torch.uint8
        assert ebc.quantized["q"].qparams.shape == (50, 2 * len(blocks))
        assert ebc.state_dict().keys() == state.keys()
    whole = quantized.dequantize_blocks(
        state["quantized.q.codes"],
        state["quantized.q.qparams"],
        blocks=blocks,
        precision=precision,
    )
    ids, lengths = torch.tensor([3, 7, 3, 49, 0, 7]), torch.tensor([2, 0, 4])
    offsets = torch.tensor([0, 2, 2])
    seen: list[int] = []
    dequantize = quantized.dequantize_blocks

    def counting(codes: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seen.append(codes.shape[0])
        return dequantize(codes, *args, **kwargs)

    monkeypatch.setattr(embedding_module, "dequantize_blocks", counting)
    kjt = KeyedJaggedTensor.from_lengths(
        ["f0", "f1"], torch.cat([ids, ids]), torch.cat([lengths, lengths])
    )
    out = ebc(kjt).to_dict()
    for feature, mode in (("f0", "sum"), ("f1", "mean")):
        expected = torch.nn.functional.embedding_bag(ids, whole, offsets, mode=mode)
        assert torch.equal(out[feature], expected), feature
    weights = torch.rand(6)
    weighted = EmbeddingBagCollection(tables[:1], device="meta")
    weighted.load_state_dict({k: v for k, v in state.items() if ".q." in k}, assign=True)
    got = weighted(KeyedJaggedTensor.from_lengths(["f0"], ids, lengths, weights=weights))
    expected = torch.nn.functional.embedding_bag(
        ids, whole, offsets, mode="sum", per_sample_weights=weights
    )
    assert torch.equal(got.values, expected)
    assert seen and max(seen) == len(set(ids.tolist()))  # 4 distinct rows, never the table
    # A weight in the state dict: a weight again.
    ebc.load_state_dict(
        {"weights.q": torch.ones(50, 12), **{k: v for k, v in state.items() if ".m." in k}}
    )
    assert ebc.precisions() == {"q": "fp32", "m": precision}
    assert torch.equal(ebc.weights["q"].detach(), torch.ones(50, 12))


def test_quantized_table_blocks_that_do_not_tile_the_row_are_named() -> None:
    """The column blocks are checked when a model is loaded (model_dir), not at each lookup."""
    from raydlrm.models.embedding import QuantizedTable

    table = QuantizedTable(10, 8, precision="int8", num_blocks=2)
    assert table.column_blocks() == [(0, 4), (4, 8)]
    table.blocks.copy_(torch.tensor([[0, 3], [4, 8]]))
    with pytest.raises(ValueError, match=r"column blocks \[\(0, 3\), \(4, 8\)\] do not tile"):
        table.column_blocks()
