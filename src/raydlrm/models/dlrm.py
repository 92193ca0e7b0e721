"""The recommendation model (:class:`RecModel`), DLRM and DCNv2, written unsharded;
:func:`build_model` also builds Wukong (:mod:`.wukong`) and DHEN (:mod:`.dhen`).

Every model here is a :class:`RecModel`: an :class:`EmbeddingBagCollection` (``embedding_bags``,
the sparse, model-parallel part) and a dense module (``dense``, the data-parallel part) that takes
the dense features and the pooled embeddings as plain tensors. ``raydlrm.sharding.shard_model``
relies on exactly these two attribute names: it replaces ``embedding_bags`` by its sharded form
and wraps ``dense`` in DDP. No parallelism lives here.

* DLRM (Naumov et al., 2019): bottom MLP over dense features, pairwise dot products between the
  bottom output and every pooled embedding, top MLP over the bottom output and the dot products.
* DCNv2 (Wang et al., 2021), as in MLPerf DLRMv2: the bottom output and the embeddings are
  concatenated and go through low-rank cross layers ``x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l``,
  then the top MLP.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from raydlrm.batch import Batch, JaggedTensor, KeyedJaggedTensor
from raydlrm.models.config import ModelConfig
from raydlrm.models.dhen import DHENDense
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.models.layers import CrossNet, autocast_fp32, mlp
from raydlrm.models.sequence_models import RetrievalFeatures, RetrievalRows, sequence_dense
from raydlrm.models.towers import TowerDense, tower_vectors
from raydlrm.models.wukong import WukongDense

__all__ = ["DCNv2Dense", "DLRMDense", "RecModel", "build_model"]


class DLRMDense(nn.Module):
    """The dense side of DLRM: bottom MLP, dot interaction, top MLP.

    Args:
        num_dense: dense input features.
        num_sparse: ``F``, pooled embeddings per sample.
        embedding_dim: ``D``; the bottom MLP must end at ``D``.
        bottom_mlp: bottom MLP sizes (without the input size).
        top_mlp: top MLP hidden sizes (a 1-unit logit layer is appended).
    """

    def __init__(
        self,
        *,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
    ):
        super().__init__()
        if bottom_mlp[-1] != embedding_dim:
            raise ValueError(
                f"DLRM bottom MLP must end at embedding_dim={embedding_dim}, got {bottom_mlp}"
            )
        self.num_sparse = num_sparse
        self.embedding_dim = embedding_dim
        self.bottom = mlp([num_dense, *bottom_mlp], final_activation=True)
        num_vectors = num_sparse + 1
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        # Flat positions in the B x (F+1)^2 dot products: one index_select (whose backward is
        # an index_add) rather than advanced indexing (whose backward is a slower index_put).
        self.register_buffer("_triu", rows * num_vectors + cols, persistent=False)
        num_interactions = num_vectors * (num_vectors - 1) // 2
        self.top = mlp([embedding_dim + num_interactions, *top_mlp, 1], final_activation=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(B,)`` from dense ``B x num_dense`` and pooled ``B x (F * D)``."""
        x = self.bottom(dense)  # B x D
        vectors = torch.cat(
            [x.unsqueeze(1), pooled.view(-1, self.num_sparse, self.embedding_dim)], dim=1
        )  # B x (F+1) x D
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # B x (F+1) x (F+1)
        interactions = dots.flatten(1).index_select(1, self._triu)
        return self.top(torch.cat([x, interactions], dim=1)).squeeze(1)


class DCNv2Dense(nn.Module):
    """The dense side of DCNv2 (MLPerf DLRMv2): bottom MLP, cross network, top MLP."""

    def __init__(
        self,
        *,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: list[int],
        top_mlp: list[int],
        num_layers: int,
        low_rank: int,
    ):
        super().__init__()
        self.bottom = mlp([num_dense, *bottom_mlp], final_activation=True)
        width = bottom_mlp[-1] + num_sparse * embedding_dim
        self.cross = CrossNet(in_features=width, num_layers=num_layers, low_rank=low_rank)
        self.top = mlp([width, *top_mlp, 1], final_activation=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(B,)`` from dense ``B x num_dense`` and pooled ``B x (F * D)``."""
        x0 = torch.cat([self.bottom(dense), pooled], dim=1)
        return self.top(self.cross(x0)).squeeze(1)


class RecModel(nn.Module):
    """A recommendation model: sparse ``embedding_bags`` plus a ``dense`` module.

    Args:
        embedding_bags: the embedding tables (unsharded; sharding replaces this attribute).
        dense: a module mapping ``(dense B x num_dense, pooled B x sum D_f)`` to logits ``(B,)``.
    """

    def __init__(
        self,
        embedding_bags: EmbeddingBagCollection,
        dense: nn.Module,
        *,
        retrieval: RetrievalFeatures | None = None,
    ):
        super().__init__()
        self.embedding_bags = embedding_bags
        self.dense = dense
        self.dense_dtype: torch.dtype | None = None
        """Autocast the dense module to this type (``training.precision``; None: fp32)."""
        self.retrieval = retrieval
        """A retrieval model's item features (None: the model scores clicks)."""

    def _dense(
        self,
        dense: torch.Tensor,
        pooled: torch.Tensor,
        sequences: dict[str, JaggedTensor] | None = None,
    ) -> torch.Tensor:
        """The dense module's logits, autocast to :attr:`dense_dtype`, returned in fp32; a
        sequence model's dense module also reads the per-position embeddings."""
        args = (dense, pooled) if not sequences else (dense, pooled, sequences)
        return autocast_fp32(self.dense_dtype, pooled.device.type, self.dense, *args)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Click logits of shape ``(B,)``."""
        return self.forward_pooled(batch)[0]

    def forward_pooled(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Click logits ``(B,)`` and the pooled embeddings ``B x sum D_f`` they came from."""
        out = self.embedding_bags(batch.sparse, batch.dedup_groups)
        return self._dense(batch.dense, out.values, out.jagged), out.values

    def retrieval_loss(self, batch: Batch, negatives: torch.Tensor) -> torch.Tensor:
        """A retrieval model's mean next-item loss on ``batch`` (0-d), against the batch's
        other next items and the sampled item rows ``negatives`` ``(K,)``, looked up in the
        same pass as the batch."""
        features = self.retrieval
        assert features is not None, "not a retrieval model"
        sparse = features.with_negatives(batch.sparse, negatives)
        out = self.embedding_bags(sparse, batch.dedup_groups)
        every = batch.all_sparse()
        rows = RetrievalRows(
            history=every.select([features.history]).values,
            target=every.select([features.target]).values,
            negatives=negatives,
        )
        return autocast_fp32(
            self.dense_dtype,
            batch.dense.device.type,
            self.dense,
            batch.dense,
            out.values,
            out.jagged,
            rows,
        )

    def user_vectors(self, batch: Batch) -> torch.Tensor:
        """A retrieval model's query of each sample, ``(B, D)``: an item's score is its
        embedding's dot product with it."""
        features = self.retrieval
        assert features is not None, "not a retrieval model"
        empty = batch.sparse.values.new_zeros(0)
        out = self.embedding_bags(features.with_negatives(batch.sparse, empty), batch.dedup_groups)
        return self._dense(batch.dense, out.values, out.jagged)

    def forward_features(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Click logits of shape ``(B,)`` from dense ``B x num_dense`` and a KJT of batch ``B``."""
        out = self.embedding_bags(sparse)
        return self._dense(dense, out.values, out.jagged)


def build_model(
    config: ModelConfig,
    *,
    tables: list[EmbeddingBagConfig],
    num_dense: int,
    device: torch.device | str = "cpu",
    embedding_device: torch.device | str | None = None,
    seed: int = 0,
    history: Sequence[str] = (),
    max_length: int = 0,
    negatives: str | None = None,
) -> RecModel:
    """Builds the model ``config.arch`` over ``tables``.

    The dense part is initialized from torch's global generator; the tables block by block
    from ``seed`` (:func:`~raydlrm.models.embedding.init_rows_`).

    Args:
        config: architecture and sizes.
        tables: embedding tables; every table must have ``config.embedding_dim`` columns.
        num_dense: number of dense input features.
        device: where to allocate parameters (``meta`` defers allocation).
        embedding_device: where to allocate the tables (default ``device``); ``meta`` for a
            model whose tables are created shard by shard (``raydlrm.sharding.shard_model``) or
            loaded from files.
        seed: the seed of the tables' initialization.
        history: a sequence model's history columns (``model.sequence``'s).
        max_length: the most events its history holds.
        negatives: ``sasrec``: the feature its sampled negatives are looked up through.

    Raises:
        ValueError: if a table's dim differs from ``model.embedding_dim``.
    """
    _check_table_dims(tables, embedding_dim=config.embedding_dim)
    embedding_bags = EmbeddingBagCollection(
        tables, device=device if embedding_device is None else embedding_device, seed=seed
    )
    if config.reads_sequences:
        return _sequence_model(
            config,
            embedding_bags,
            num_dense=num_dense,
            device=device,
            history=history,
            max_length=max_length,
            negatives=negatives,
        )
    return RecModel(embedding_bags, _pooled_dense(config, embedding_bags, num_dense, device))


def _pooled_dense(
    config: ModelConfig,
    embedding_bags: EmbeddingBagCollection,
    num_dense: int,
    device: torch.device | str,
) -> nn.Module:
    """The dense side of a pooled arch (``dlrm``, ``dcnv2``, ``wukong``, ``dhen``), behind its
    towers when ``model.towers`` is set."""
    num_sparse = len(embedding_bags.feature_names)
    if config.towers == "auto":
        raise ValueError("model.towers = 'auto' is resolved by the driver before a model is built")
    if config.towers is not None:
        num_sparse = tower_vectors(
            config.towers, embedding_dim=config.embedding_dim, tower_dim=config.tower_dim
        )
    with torch.device(device):
        dense = _DENSE_CLASSES[config.arch](
            num_dense=num_dense,
            num_sparse=num_sparse,
            embedding_dim=config.embedding_dim,
            bottom_mlp=config.bottom_mlp,
            top_mlp=config.top_mlp,
            **_arch_knobs(config),
        )
        if config.towers is not None:
            dense = TowerDense(
                towers=config.towers,
                feature_names=embedding_bags.feature_names,
                embedding_dim=config.embedding_dim,
                tower_dim=config.tower_dim,
                inner=dense,
            )
    return dense


def _sequence_model(
    config: ModelConfig,
    embedding_bags: EmbeddingBagCollection,
    *,
    num_dense: int,
    device: torch.device | str,
    history: Sequence[str],
    max_length: int,
    negatives: str | None,
) -> RecModel:
    """A sequence model (``din``, ``sasrec``) over ``embedding_bags``."""
    if not history or max_length <= 0:
        raise ValueError(f"arch {config.arch!r} needs its history columns and max_length")
    with torch.device(device):
        dense = sequence_dense(
            config,
            num_dense=num_dense,
            pooled_features=embedding_bags.pooled_feature_names,
            history=history,
            max_length=max_length,
            negatives=negatives,
        )
    retrieval = None
    if config.retrieval:
        assert negatives is not None
        table_of = {f: t.name for t in embedding_bags.tables for f in t.feature_names}
        retrieval = RetrievalFeatures(
            history=history[0],
            target=config.candidate[0],
            negatives=negatives,
            item_table=table_of[history[0]],
        )
    return RecModel(embedding_bags, dense, retrieval=retrieval)


_DENSE_CLASSES: dict[str, type[nn.Module]] = {
    "dlrm": DLRMDense,
    "dcnv2": DCNv2Dense,
    "wukong": WukongDense,
    "dhen": DHENDense,
}


def _check_table_dims(tables: list[EmbeddingBagConfig], *, embedding_dim: int) -> None:
    """Raises ``ValueError`` naming the first table whose dim is not ``embedding_dim``."""
    for t in tables:
        if t.embedding_dim != embedding_dim:
            raise ValueError(
                f"table {t.name}: embedding_dim {t.embedding_dim} != model.embedding_dim "
                f"{embedding_dim}"
            )


def _arch_knobs(config: ModelConfig) -> dict[str, object]:
    """The keyword arguments of ``config.arch``'s dense class beyond the sizes all of them take."""
    if config.arch == "dcnv2":
        return {"num_layers": config.dcn_num_layers, "low_rank": config.dcn_low_rank}
    if config.arch == "wukong":
        return {
            "num_layers": config.wukong_num_layers,
            "num_fm": config.wukong_num_fm,
            "num_lc": config.wukong_num_lc,
            "rank": config.wukong_rank,
            "fm_mlp": config.wukong_fm_mlp,
        }
    if config.arch == "dhen":
        return {
            "layers": config.dhen_layers,
            "ensemble": config.dhen_ensemble,
            "low_rank": config.dcn_low_rank,
            "heads": config.dhen_attention_heads,
        }
    return {}  # dlrm: the sizes are all it takes
