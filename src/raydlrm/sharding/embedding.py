"""Table-wise sharded embedding-bag collection on fbgemm's table-batched embedding kernels.

Every rank owns whole tables (the :class:`~raydlrm.sharding.plan.ShardingPlan` says which) and
looks them up, for the whole global batch, with one fbgemm ``SplitTableBatchedEmbeddingBags``
(TBE) per pooling mode. A forward pass:

1. all-gathers the per-rank batch sizes (they may differ, e.g. the last batch);
2. all-to-alls the lengths, then the ids (and per-id weights) of each feature to its owner; the
   receiver derives the id counts from the lengths it received, so no separate count exchange;
3. permutes the received bags from rank-major ``(source rank, feature, sample)`` to the
   feature-major ``(feature, global sample)`` layout TBE reads, with fbgemm's
   ``permute_1D_sparse_data`` (vectorized);
4. looks up and pools with TBE;
5. sends each rank the pooled rows of its samples (:class:`~raydlrm.sharding._comm.PooledAllToAll`,
   whose backward is the reverse all-to-all) and reorders the columns to the unsharded
   collection's feature order.

The TBE's fused optimizer updates the rows in the backward pass: embeddings need no separate
optimizer step. Ids are checked against their table's size on the rank that sends them, so the
error names the table and shows up where the bad batch is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from raydlrm._versions import import_fbgemm
from raydlrm.batch import KeyedJaggedTensor, KeyedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig, init_table_
from raydlrm.sharding._comm import (
    IdentityCodec,
    PooledAllToAll,
    PooledCodec,
    all_gather_ints,
    all_to_all,
    rank_and_world_size,
)
from raydlrm.sharding.config import ShardingConfig
from raydlrm.sharding.plan import ShardingPlan

import_fbgemm()

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

__all__ = ["ShardedEmbeddingBagCollection"]

_OPTIMIZERS = {
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "sgd": EmbOptimType.EXACT_SGD,
}
_POOLING = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


class ShardedEmbeddingBagCollection(nn.Module):
    """An :class:`EmbeddingBagCollection` sharded table-wise across the ranks of ``pg``.

    Input and output are those of the unsharded collection: a KJT of shape ``(F, B, L[f][b])``
    holding this rank's ``B`` samples (``B`` may differ across ranks), and a
    :class:`KeyedTensor` of shape ``B x sum(D_f)`` in ``ebc.feature_names`` order.

    Args:
        ebc: the unsharded collection; its tables' weights initialize the shards (every rank
            must build it with the same seed). On the meta device, shards are freshly
            initialized instead.
        plan: where each table lives; its world size must be the size of ``pg``.
        config: the fused optimizer and its hyper-parameters.
        device: ``cpu`` (host TBE, gloo) or a CUDA device (device TBE, NCCL).
        pg: process group (default: torch.distributed's default group; none initialized or a
            world size of 1 means no communication).
        codec: encodes the pooled output all-to-all payload (default: uncompressed fp32).

    Raises:
        ValueError: if the plan does not match the tables or the process group's size.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        *,
        plan: ShardingPlan,
        config: ShardingConfig,
        device: torch.device | str,
        pg: ProcessGroup | None = None,
        codec: PooledCodec | None = None,
    ):
        super().__init__()
        plan.validate(ebc.tables)
        self._pg = pg
        self._rank, self._world_size = rank_and_world_size(pg)
        if plan.world_size != self._world_size:
            raise ValueError(
                f"sharding plan is for world_size {plan.world_size}, but the process group has "
                f"{self._world_size} ranks"
            )
        self._device = torch.device(device)
        self._codec = codec or IdentityCodec()
        self.tables = list(ebc.tables)
        self.feature_names = ebc.feature_names
        self.feature_dims = ebc.feature_dims
        self.plan = plan

        # Tables of each rank, grouped by pooling mode (one TBE per mode), so that each rank's
        # features are in TBE output order: mode by mode, table by table.
        self._rank_tables: list[list[EmbeddingBagConfig]] = [
            sorted(
                (t for t in self.tables if plan.table(t.name).shards[0].rank == r),
                key=lambda t: t.pooling != "sum",
            )
            for r in range(self._world_size)
        ]
        rank_features = [[f for t in ts for f in t.feature_names] for ts in self._rank_tables]
        self._num_rank_features = [len(fs) for fs in rank_features]
        self._rank_dims = [
            sum(t.embedding_dim * len(t.feature_names) for t in ts) for ts in self._rank_tables
        ]
        # Features in send order (rank-major), and what the output all-to-all returns.
        self._send_keys = [f for fs in rank_features for f in fs]
        table_of = {f: t for t in self.tables for f in t.feature_names}
        self._send_tables = [table_of[f].name for f in self._send_keys]
        self.register_buffer(
            "_send_limits",
            torch.tensor(
                [table_of[f].num_embeddings for f in self._send_keys],
                dtype=torch.int64,
                device=self._device,
            ),
            persistent=False,
        )
        column_start, start = {}, 0
        for f in self._send_keys:
            column_start[f] = start
            start += table_of[f].embedding_dim
        self.register_buffer(
            "_column_index",
            torch.cat(
                [
                    torch.arange(column_start[f], column_start[f] + table_of[f].embedding_dim)
                    for f in self.feature_names
                ]
            ).to(self._device),
            persistent=False,
        )

        self.local_table_configs = self._rank_tables[self._rank]
        by_mode = [[t for t in self.local_table_configs if t.pooling == m] for m in ("sum", "mean")]
        self._groups = [g for g in by_mode if g]
        self.tbes = nn.ModuleList(self._build_tbe(g, config) for g in self._groups)
        self._init_weights(ebc)

    def _build_tbe(
        self, tables: list[EmbeddingBagConfig], config: ShardingConfig
    ) -> SplitTableBatchedEmbeddingBagsCodegen:
        if self._device.type == "cuda":
            location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
        else:
            location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
        return SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (t.num_embeddings, t.embedding_dim, location, compute) for t in tables
            ],
            feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
            optimizer=_OPTIMIZERS[config.optimizer],
            learning_rate=config.learning_rate,
            eps=config.eps,
            pooling_mode=_POOLING[tables[0].pooling],
            device=self._device,
        )

    @torch.no_grad()
    def _init_weights(self, ebc: EmbeddingBagCollection) -> None:
        for name, weight in self.local_tables().items():
            source = ebc.weights[name]
            if source.device.type == "meta":
                init_table_(weight, num_embeddings=weight.shape[0])
            else:
                weight.copy_(source.detach())

    def local_tables(self) -> dict[str, torch.Tensor]:
        """Views of the weights of this rank's tables, shape ``(num_embeddings, dim)`` each."""
        return {
            t.name: w
            for group, tbe in zip(self._groups, self.tbes, strict=True)
            for t, w in zip(group, tbe.split_embedding_weights(), strict=True)
        }

    def optimizer_states(self) -> dict[str, list[torch.Tensor]]:
        """Fused optimizer state of this rank's tables (views).

        Returns:
            Table name -> state tensors: row-wise Adagrad one ``(num_embeddings,)`` tensor,
            Adagrad one ``(num_embeddings, dim)`` tensor, SGD none.
        """
        states: dict[str, list[torch.Tensor]] = {}
        for group, tbe in zip(self._groups, self.tbes, strict=True):
            split = tbe.split_optimizer_states() or [[] for _ in group]
            states.update({t.name: list(s) for t, s in zip(group, split, strict=True)})
        return states

    @torch.no_grad()
    def gather_full_tables(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The full, unsharded tables on rank ``dst``; every rank must call this.

        Args:
            dst: rank (in the process group) that receives the tables.

        Returns:
            On ``dst``: table name -> ``(num_embeddings, dim)`` tensor (a copy), in the
            collection's table order. ``None`` on other ranks.
        """
        local = self.local_tables()
        if self._world_size == 1:
            return {t.name: local[t.name].clone() for t in self.tables}
        # Flattened in the order of self._rank_tables[rank] (local_tables() follows it).
        flat = [w.reshape(-1) for w in local.values()]
        payload = torch.cat(flat) if flat else torch.empty(0, device=self._device)
        sizes = [sum(t.num_embeddings * t.embedding_dim for t in ts) for ts in self._rank_tables]
        is_dst = self._rank == dst
        received = all_to_all(
            payload,
            input_splits=[payload.numel() if r == dst else 0 for r in range(self._world_size)],
            output_splits=sizes if is_dst else [0] * self._world_size,
            pg=self._pg,
        )
        if not is_dst:
            return None
        flat_tables = [t for ts in self._rank_tables for t in ts]
        chunks = received.split([t.num_embeddings * t.embedding_dim for t in flat_tables])
        by_name = {
            t.name: c.view(t.num_embeddings, t.embedding_dim)
            for t, c in zip(flat_tables, chunks, strict=True)
        }
        return {t.name: by_name[t.name] for t in self.tables}

    @torch.no_grad()
    def load_full_tables(self, tables: dict[str, torch.Tensor]) -> None:
        """Copies the rows this rank owns from full, unsharded tables.

        Args:
            tables: table name -> ``(num_embeddings, dim)`` tensor; must hold every table this
                rank owns.

        Raises:
            ValueError: naming a missing table or one of the wrong shape.
        """
        for name, weight in self.local_tables().items():
            if name not in tables:
                raise ValueError(f"load_full_tables: table {name!r} is missing")
            source = tables[name]
            if tuple(source.shape) != tuple(weight.shape):
                raise ValueError(
                    f"load_full_tables: table {name!r} has shape {tuple(source.shape)}, "
                    f"expected {tuple(weight.shape)}"
                )
            weight.copy_(source)

    def _check_ids(self, kjt: KeyedJaggedTensor) -> None:
        """Raises ValueError naming the table of the first id outside ``[0, num_embeddings)``."""
        limits = torch.repeat_interleave(
            self._send_limits, kjt.length_per_key(), output_size=kjt.values.numel()
        )
        bad = (kjt.values < 0) | (kjt.values >= limits)
        if not bool(bad.any()):
            return
        pos = int(torch.nonzero(bad)[0, 0])
        feature = int(torch.searchsorted(kjt.offset_per_key(), pos, right=True)) - 1
        name = self._send_tables[feature]
        raise ValueError(
            f"table {name!r} (feature {self._send_keys[feature]!r}): id {int(kjt.values[pos])} "
            f"not in [0, {int(self._send_limits[feature])})"
        )

    def _bag_permutation(self, batch_sizes: list[int]) -> torch.Tensor:
        """Bag index mapping ``(feature, global sample)`` order to the received
        ``(source rank, feature, sample)`` order, int32, shape ``(F_local * sum(B),)``."""
        device = self._device
        num_features = self._num_rank_features[self._rank]
        sizes = torch.tensor(batch_sizes, dtype=torch.int64, device=device)
        total = int(sum(batch_sizes))
        starts = _offsets(sizes)[:-1]
        source = torch.repeat_interleave(
            torch.arange(len(batch_sizes), device=device), sizes, output_size=total
        )
        sample = torch.arange(total, device=device) - starts[source]
        base = num_features * starts[source] + sample
        feature = torch.arange(num_features, device=device).unsqueeze(1)
        return (base.unsqueeze(0) + feature * sizes[source].unsqueeze(0)).reshape(-1).int()

    def _distribute_input(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
        """Sends each feature's bags to its owner; returns this rank's features over the global
        batch, feature-major: lengths ``(F_local * sum(B),)``, ids, weights, batch sizes."""
        if self._world_size == 1:
            return kjt.lengths, kjt.values, kjt.weights, [kjt.batch_size]
        pg = self._pg
        batch_sizes = all_gather_ints(kjt.batch_size, device=self._device, pg=pg)
        lengths = all_to_all(
            kjt.lengths,
            input_splits=[n * kjt.batch_size for n in self._num_rank_features],
            output_splits=[self._num_rank_features[self._rank] * b for b in batch_sizes],
            pg=pg,
        )
        recv_splits = [self._num_rank_features[self._rank] * b for b in batch_sizes]
        send_ids = [
            int(s)
            for s in torch.stack(
                [x.sum() for x in kjt.length_per_key().split(self._num_rank_features)]
            ).tolist()
        ]
        recv_ids = [
            int(s) for s in torch.stack([x.sum() for x in lengths.split(recv_splits)]).tolist()
        ]
        values = all_to_all(kjt.values, input_splits=send_ids, output_splits=recv_ids, pg=pg)
        weights = None
        if kjt.weights is not None:
            weights = all_to_all(kjt.weights, input_splits=send_ids, output_splits=recv_ids, pg=pg)
        lengths, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
            self._bag_permutation(batch_sizes), lengths, values, weights, values.numel()
        )
        return lengths, values, weights, batch_sizes

    def _lookup(
        self,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        total_batch: int,
    ) -> torch.Tensor:
        """Pooled vectors of this rank's features, shape ``(total_batch, D_local)``."""
        if not self._groups:
            # Requires grad so that backward still reaches the output all-to-all on this rank.
            return torch.zeros(total_batch, 0, device=self._device, requires_grad=True)
        offsets = _offsets(lengths)
        pooled, first_feature = [], 0
        for group, tbe in zip(self._groups, self.tbes, strict=True):
            last_feature = first_feature + sum(len(t.feature_names) for t in group)
            lo, hi = first_feature * total_batch, last_feature * total_batch
            id_lo, id_hi = int(offsets[lo]), int(offsets[hi])
            pooled.append(
                tbe(
                    values[id_lo:id_hi].to(torch.int64),
                    offsets[lo : hi + 1] - id_lo,
                    per_sample_weights=None if weights is None else weights[id_lo:id_hi],
                )
            )
            first_feature = last_feature
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of this rank's samples.

        Args:
            features: KJT of shape ``(F, B, L[f][b])`` holding at least every feature of the
                collection; ``weights`` (if present) weight each id.

        Returns:
            KeyedTensor of shape ``B x sum(D_f)``, features in ``feature_names`` order.

        Raises:
            ValueError: naming the table of an id outside ``[0, num_embeddings)``.
        """
        kjt = features.select(self._send_keys)
        self._check_ids(kjt)
        lengths, values, weights, batch_sizes = self._distribute_input(kjt)
        pooled = self._lookup(lengths, values, weights, sum(batch_sizes))
        if self._world_size > 1:
            pooled = PooledAllToAll.apply(
                pooled, batch_sizes, self._rank_dims, self._pg, self._codec
            )
        return KeyedTensor(
            keys=list(self.feature_names),
            dims=list(self.feature_dims),
            values=pooled.index_select(1, self._column_index),
        )
