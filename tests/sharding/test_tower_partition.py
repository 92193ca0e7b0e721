"""The tower partitioner (:mod:`raydlrm.sharding.planner.tower_partition`) on a planted data
set: the label depends on products of features inside two hidden groups (and on every feature
alone), a DLRM trained briefly on it, its interaction strengths measured, and the two towers it
makes must be the planted groups."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from raydlrm.batch import KeyedJaggedTensor
from raydlrm.models.config import ModelConfig
from raydlrm.models.dlrm import build_model
from raydlrm.models.embedding import EmbeddingBagConfig
from raydlrm.sharding.planner.tower_partition import (
    inside_strength,
    interaction_strength,
    partition_towers,
)

FEATURES = 6
ROWS = 20
GROUPS = [[0, 3, 4], [1, 2, 5]]  # not contiguous: the partitioner cannot just cut in order


def _planted(batch: int, gen: torch.Generator, signs: torch.Tensor, bias: torch.Tensor):
    ids = torch.randint(0, ROWS, (batch, FEATURES), generator=gen)
    s = signs[torch.arange(FEATURES), ids]  # B x F, each feature's +-1 of its id
    logit = bias[torch.arange(FEATURES), ids].sum(1)  # additive effects: no interaction
    for group in GROUPS:
        for i, j in itertools.combinations(group, 2):
            logit = logit + 1.5 * s[:, i] * s[:, j]
    labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths(
        [f"f{i}" for i in range(FEATURES)],
        ids.t().reshape(-1),
        torch.ones(FEATURES * batch, dtype=torch.int64),
    )
    return kjt, torch.zeros(batch, 1), labels


@pytest.fixture(scope="module")
def strength() -> np.ndarray:
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (FEATURES, ROWS), generator=gen).float() * 2 - 1
    bias = torch.randn(FEATURES, ROWS, generator=gen) * 0.5
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=8,
                           feature_names=(f"f{i}",))
        for i in range(FEATURES)
    ]  # fmt: skip
    torch.manual_seed(0)
    config = ModelConfig(arch="dlrm", embedding_dim=8, bottom_mlp=[8], top_mlp=[32, 16])
    model = build_model(config, tables=tables, num_dense=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(600):  # the warm-up run
        kjt, dense, labels = _planted(256, gen, signs, bias)
        logits = model.dense(dense, model.embedding_bags(kjt).values)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    kjt, dense, _ = _planted(2048, gen, signs, bias)
    pooled = model.embedding_bags(kjt).values.detach()
    return interaction_strength(model.dense, dense, pooled, [8] * FEATURES)


def test_the_partitioner_recovers_the_planted_groups(strength: np.ndarray) -> None:
    inside = [(i, j) for g in GROUPS for i, j in itertools.combinations(g, 2)]
    across = [(i, j) for i in GROUPS[0] for j in GROUPS[1]]
    # Every planted pair interacts more than every pair across the groups.
    assert min(strength[p] for p in inside) > 2 * max(strength[p] for p in across), strength
    towers = partition_towers(
        strength, units=[[i] for i in range(FEATURES)], loads=[1.0] * FEATURES, num_towers=2
    )
    assert towers == sorted(GROUPS)
    # Against every other balanced split (a random grouping's best case): the planted one keeps
    # the most strength inside towers.
    kept = inside_strength(strength, towers)
    for half in itertools.combinations(range(FEATURES), 3):
        other = [list(half), [f for f in range(FEATURES) if f not in half]]
        if sorted(other) != sorted(GROUPS):
            assert inside_strength(strength, other) < kept
    assert kept > 0.6  # the model's spurious interactions across the groups are the rest


def test_loads_and_tables_bound_the_towers() -> None:
    strength = np.zeros((4, 4))
    strength[0, 1] = strength[1, 0] = 5.0  # 0 and 1 interact, but are too heavy together
    strength[2, 3] = strength[3, 2] = 1.0
    towers = partition_towers(
        strength, units=[[0], [1], [2], [3]], loads=[3.0, 3.0, 1.0, 1.0], num_towers=2
    )
    # Merging 2 and 3 first leaves 3 + 1 + 1 against 3: one of them moves over.
    assert towers in ([[0, 3], [1, 2]], [[0, 2], [1, 3]])
    # A table's features stay together.
    together = partition_towers(
        strength, units=[[0, 2], [1], [3]], loads=[1.0, 1.0, 1.0], num_towers=2
    )
    assert any({0, 2} <= set(t) for t in together)
    with pytest.raises(ValueError, match="cannot make 5 towers of 4 tables"):
        partition_towers(strength, units=[[0], [1], [2], [3]], loads=[1.0] * 4, num_towers=5)


def test_coarse_units_are_balanced_and_towers_ordered_for_the_hosts() -> None:
    """Units too coarse for the load cap (14 tables of one lookup in 4 towers: cap 3.85) still
    end balanced (4, 4, 3, 3, not 5, 3, 3, 3), and the towers are ordered so that the hosts of
    ``model.towers``' placement (tower i on host i % H) carry equal loads where they can."""
    from raydlrm.platform.auto_towers import host_order

    towers = partition_towers(
        np.zeros((14, 14)), units=[[i] for i in range(14)], loads=[1.0] * 14, num_towers=4
    )
    assert sorted(len(t) for t in towers) == [3, 3, 4, 4]

    def host_loads(loads: list[float], hosts: int) -> list[float]:
        order = host_order(loads, hosts)
        assert sorted(order) == list(range(len(loads)))
        return [sum(loads[t] for i, t in enumerate(order) if i % hosts == h) for h in range(hosts)]

    assert host_loads([4, 4, 3, 3], 2) == [7, 7]  # in the given order: 8 and 6
    assert host_loads([1, 2, 3], 2) == [3, 3]  # host 0 takes two towers
    assert host_loads([7, 1, 1, 1, 1, 1], 3) == [8, 2, 2]
