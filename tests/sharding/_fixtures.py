"""Shared test data for the sharding tests: tables, a tiny model, seeded batches; whole tables
gathered from (and loaded into) a sharded collection."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.models.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from raydlrm.sharding.kernel import WEIGHT_DTYPES
from raydlrm.sharding.quantized import QuantizedRows
from raydlrm.sharding.types import ShardedTables
from tests._tolerance import sum_order_tol

GLOBAL_BATCH = 13
# Unequal per-rank slices of the global batch, as with a last, short batch.
SPLITS = {1: [13], 2: [8, 5], 3: [5, 2, 6], 4: [4, 3, 4, 2]}
# Input feature order differs from the collection's, plus a feature no table uses.
INPUT_KEYS = ["f3", "fx", "f0", "f4", "f2", "f1"]
# The parity runs' steps, fused optimizer settings and tolerance (sharded against unsharded).
NUM_STEPS = 2
LR = 0.1
EPS = LR
"""Adagrad's eps: its gain ``lr / eps`` is at most 1, so a gradient that cancels to near zero
cannot turn the rounding of another summation order into a visible update (with 1e-8 it could:
``tests/_tolerance.py``)."""
MAX_TERMS = 78
"""The most terms one compared value sums: a row of ``t0``, looked up by ``f0`` and ``f1`` with
up to 3 ids a bag, in the 13 samples of a step (a prediction sums 37, a dense gradient 13)."""
MAGNITUDE = 2.0
"""Bounds the terms' absolute sum of every compared value: the values stay below 1 (weights
at most 0.51 after training, pooled vectors 0.88, dense gradients 0.71, checked by
:func:`assert_steps_match`), and their terms' sum is taken at twice that."""


def parity_tol(steps: int = NUM_STEPS, *, depth: int = 2) -> dict[str, float]:
    """The tolerance of a sharded run against the unsharded reference after ``steps`` steps
    (:func:`~tests._tolerance.sum_order_tol`): each step a value goes through at most ``depth``
    sums that another kernel or rank count orders differently (a row's gradient, the forward
    that carries the rows into the next step), each with a gain of at most 1."""
    return sum_order_tol(MAX_TERMS, MAGNITUDE, k=depth * steps)


TOL = parity_tol()


def make_tables(*, mean_pooling: bool = True) -> list[EmbeddingBagConfig]:
    """Four small tables; ``t0`` is shared by two features, ``t1`` mean-pooled if asked."""
    return [
        EmbeddingBagConfig(
            name="t0", num_embeddings=50, embedding_dim=8, feature_names=("f0", "f1")
        ),
        EmbeddingBagConfig(
            name="t1",
            num_embeddings=30,
            embedding_dim=4,
            feature_names=("f2",),
            pooling="mean" if mean_pooling else "sum",
        ),
        EmbeddingBagConfig(name="t2", num_embeddings=40, embedding_dim=12, feature_names=("f3",)),
        EmbeddingBagConfig(name="t3", num_embeddings=20, embedding_dim=4, feature_names=("f4",)),
    ]


class TinyModel(nn.Module):
    """Embedding bags plus one linear layer on the pooled output (the dense side)."""

    def __init__(self, tables: list[EmbeddingBagConfig]):
        super().__init__()
        torch.manual_seed(0)
        self.embedding_bags = EmbeddingBagCollection(tables)
        self.dense = nn.Linear(sum(self.embedding_bags.feature_dims), 1)


def global_batch(step: int, *, weighted: bool, rows: dict[str, int]) -> KeyedJaggedTensor:
    """A seeded batch of ``GLOBAL_BATCH`` samples over ``INPUT_KEYS``, with empty bags.

    Args:
        step: seeds the batch.
        weighted: attach per-id weights.
        rows: feature -> table size (ids are drawn below it).
    """
    gen = torch.Generator().manual_seed(1000 + step)
    num_keys = len(INPUT_KEYS)
    lengths = torch.randint(0, 4, (num_keys * GLOBAL_BATCH,), generator=gen)
    lengths[INPUT_KEYS.index("f2") * GLOBAL_BATCH] = 0  # an empty mean-pooled bag
    lengths[INPUT_KEYS.index("f0") * GLOBAL_BATCH + GLOBAL_BATCH - 1] = 0
    per_key = lengths.view(num_keys, GLOBAL_BATCH).sum(1).tolist()
    values = torch.cat(
        [
            torch.randint(0, rows.get(k, 1000), (n,), generator=gen)
            for k, n in zip(INPUT_KEYS, per_key, strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths(INPUT_KEYS, values, lengths, weights=weights)


def targets(step: int) -> torch.Tensor:
    """Seeded regression targets, shape ``(GLOBAL_BATCH,)``."""
    return torch.randn(GLOBAL_BATCH, generator=torch.Generator().manual_seed(2000 + step))


def feature_rows(tables: list[EmbeddingBagConfig]) -> dict[str, int]:
    return {f: t.num_embeddings for t in tables for f in t.feature_names}


def reference_optimizer(ebc: EmbeddingBagCollection, optimizer: str, *, lr: float, eps: float):
    """The fused optimizers' update rules written in torch, for an unsharded collection's
    tables: returns ``(step, states)``; ``step()`` applies and clears the tables' gradients."""
    states = {
        t.name: {
            "rowwise_adagrad": [torch.zeros(t.num_embeddings)],
            "adagrad": [torch.zeros(t.num_embeddings, t.embedding_dim)],
            "sgd": [],
        }[optimizer]
        for t in ebc.tables
    }

    @torch.no_grad()
    def step() -> None:
        for name, weight in ebc.weights.items():
            grad = weight.grad
            if optimizer == "rowwise_adagrad":
                states[name][0] += (grad * grad).mean(dim=1)
                weight -= lr * grad / (states[name][0].sqrt() + eps).unsqueeze(1)
            elif optimizer == "adagrad":
                states[name][0] += grad * grad
                weight -= lr * grad / (states[name][0].sqrt() + eps)
            else:
                weight -= lr * grad
            weight.grad = None

    return step, states


def assert_steps_match(
    got: dict, ref: dict, *, rows: slice, world_size: int, num_steps: int, tol: dict
) -> None:
    """One rank's recorded steps equal the single-process reference on its rows: pooled output,
    gradient reaching the pooled output (scaled by the world size, see ``_train``), dense grads
    (whose magnitudes :data:`MAGNITUDE` assumes)."""
    for step in range(num_steps):
        for value in (ref["pooled"][step], ref["pooled_grad"][step], *ref["dense_grad"][step]):
            assert float(value.abs().max()) < MAGNITUDE / 2
        torch.testing.assert_close(got["pooled"][step], ref["pooled"][step][rows], **tol)
        torch.testing.assert_close(
            got["pooled_grad"][step] / world_size, ref["pooled_grad"][step][rows], **tol
        )
        for g, r in zip(got["dense_grad"][step], ref["dense_grad"][step], strict=True):
            torch.testing.assert_close(g, r, **tol)


# -- whole tables out of a sharded collection (tests only: checkpoints and exports never gather
#    a table on one rank; they move one shard or chunk at a time) --------------------------


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_pieces(collection: ShardedTables, local: dict[str, torch.Tensor], *, dst: int):
    """Every rank's ``local[table]`` with its shard, on ``dst`` (None elsewhere); a
    data-parallel table contributes only the replica of its first shard's rank."""
    rank, world = _rank_and_world()
    shards = collection.local_shards()
    mine = {
        name: (shards[name], tensor.detach().cpu().clone())
        for name, tensor in local.items()
        if collection.plan.table(name).sharding_type != "data_parallel"
        or shards[name] == collection.plan.table(name).shards[0]
    }
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank != dst:
        return None
    return {
        name: [p[name] for p in everyone if name in p] for name in {n for p in everyone for n in p}
    }


def gather_id_maps(collection: ShardedTables) -> dict[str, torch.Tensor]:
    """Every managed table's whole id map, ``(4, rows)``, on every rank (all ranks call)."""
    shards = collection.local_shards()
    mine = {
        name: (m.row_start, m.state.cpu().clone())
        for name, m in collection.id_maps().items()
        if shards[name].col_start == 0
    }
    everyone = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    names = {n for p in everyone for n in p}
    return {
        n: torch.cat([s for _, s in sorted(p[n] for p in everyone if n in p)], dim=1)
        for n in sorted(names)
    }


@torch.no_grad()
def gather_full_tables(collection: ShardedTables, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The full, unsharded tables on rank ``dst`` (table name -> ``(num_embeddings, dim)``, in
    the collection's table order; None on other ranks); every rank must call."""
    local = {
        name: w.dequantize() if isinstance(w, QuantizedRows) else w
        for name, w in collection.local_tables().items()
    }
    pieces = _gather_pieces(collection, local, dst=dst)
    if pieces is None:
        return None
    dtypes = {
        n: WEIGHT_DTYPES.get(p, torch.float32) for n, p in collection.weight_precisions().items()
    }
    full = {}
    for t in collection.tables:
        weight = torch.empty(t.num_embeddings, t.embedding_dim, dtype=dtypes[t.name])
        for s, chunk in pieces[t.name]:
            weight[s.row_start : s.row_end, s.col_start : s.col_end] = chunk
        full[t.name] = weight
    return full


@torch.no_grad()
def gather_full_optimizer_states(
    collection: ShardedTables, dst: int = 0
) -> dict[str, list[torch.Tensor]] | None:
    """The fused optimizer state of the full tables on rank ``dst``, as
    ``optimizer_states()`` holds it per shard (none for SGD). Row-wise Adagrad's momentum of a
    column-sharded table is the width-weighted mean of its column shards' momenta: the mean over
    the whole row of the accumulated squared gradients, as the unsharded optimizer defines it."""
    states = collection.optimizer_states()
    firsts = {name: s[0] for name, s in states.items() if s}
    pieces = _gather_pieces(collection, firsts, dst=dst)
    if pieces is None:
        return None
    full = {}
    for t in collection.tables:
        if not pieces.get(t.name):
            full[t.name] = []
            continue
        rowwise = pieces[t.name][0][1].dim() == 1
        if rowwise:
            state = torch.zeros(t.num_embeddings)
            for s, chunk in pieces[t.name]:
                state[s.row_start : s.row_end] += (
                    chunk * (s.col_end - s.col_start) / t.embedding_dim
                )
        else:
            state = torch.empty(t.num_embeddings, t.embedding_dim)
            for s, chunk in pieces[t.name]:
                state[s.row_start : s.row_end, s.col_start : s.col_end] = chunk
        full[t.name] = [state]
    return full


@torch.no_grad()
def load_full_tables(collection: ShardedTables, tables: dict[str, torch.Tensor]) -> None:
    """Copies this rank's shards out of full, unsharded tables (every table it holds)."""
    shards = collection.local_shards()
    for name, weight in collection.local_tables().items():
        s = shards[name]
        rows = tables[name][s.row_start : s.row_end, s.col_start : s.col_end]
        if isinstance(weight, QuantizedRows):
            weight.assign(rows)
        else:
            weight.copy_(rows)
