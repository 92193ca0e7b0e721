"""The managed id map (:mod:`raydlrm.models.managed_ids`) on one process: own rows until
capacity, admission, eviction (LRU, LFU, TTL, none), evaluation lookups, determinism and
shard independence, and the counter-based fresh values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from raydlrm.ids import ManagedIds, bucket_bounds, clock
from raydlrm.ingestion.preprocess import mix64
from raydlrm.models.managed_ids import (
    EMPTY,
    FALLBACK,
    ID,
    IdMap,
    ManagedIdsError,
    bucket_of,
    fresh_rows,
    mix_ids,
)


def _map(rows: int = 1024, **policy) -> IdMap:
    return IdMap(ManagedIds(**policy), table="t", num_embeddings=rows, row_start=0, row_end=rows)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1 << 62, (n,), generator=torch.Generator().manual_seed(seed))


def test_mix_ids_matches_the_preprocessing_hash() -> None:
    ids = np.array([0, 1, 12345, -7, (1 << 62) + 3], dtype=np.int64)
    assert (mix_ids(torch.from_numpy(ids)).numpy() == mix64(ids).view(np.int64)).all()


def test_every_id_gets_its_own_row_until_capacity_and_keeps_it() -> None:
    m = _map(4096, buckets=4)
    ids = _ids(3000)  # 73% of the 4092 slots
    first = m.assign(ids[:1000], now=1, training=True).rows
    second = m.assign(ids, now=2, training=True).rows
    assert torch.equal(second[:1000], first)
    assert second.unique().numel() == 3000
    assert (m.state[ID][second] == ids).all()
    stats = m.stats()
    assert stats["occupied"] == stats["admissions"] == 3000
    assert stats["evictions"] == stats["rejections"] == 0
    # Repeats in one batch share the row.
    again = m.assign(torch.cat([ids[:5], ids[:5]]), now=3, training=True).rows
    assert torch.equal(again[:5], again[5:]) and torch.equal(again[:5], second[:5])


def test_evaluation_reads_the_fallback_row_and_changes_nothing() -> None:
    m = _map(256, buckets=1)
    known = _ids(10)
    rows = m.assign(known, now=1, training=True).rows
    before = m.state.clone()
    unknown = _ids(4, seed=1)
    out = m.assign(torch.cat([known, unknown]), now=2, training=False)
    assert torch.equal(out.rows[:10], rows)
    assert (out.rows[10:] == 0).all()  # bucket 0's fallback row
    assert torch.equal(m.state, before)
    assert m.stats()["unknown"] == 4


def test_admission_waits_for_the_threshold() -> None:
    m = _map(1024, buckets=2, admit_after=3)
    ids = _ids(20)
    for step in (1, 2):
        out = m.assign(ids, now=step, training=True)
        assert (m.state[ID][out.rows] == FALLBACK).all()
        assert out.reset.numel() == 0 and out.counted.numel() > 0
    out = m.assign(ids, now=3, training=True)
    assert (m.state[ID][out.rows] == ids).all()
    assert sorted(out.reset.tolist()) == sorted(out.rows.tolist())
    assert m.stats()["rejections"] == 40


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_full_window_evicts_by_the_policy(policy: str) -> None:
    m = _map(9, buckets=1, eviction=policy, probe_window=8)  # 8 slots, one window
    ids = torch.arange(100, 108)
    m.assign(ids, now=1, training=True)
    # id 100 looked up often (LFU keeps it) but long ago; 101.. recently (LRU keeps them).
    m.assign(ids[:1].repeat(5), now=2, training=True)
    m.assign(ids[1:], now=3, training=True)
    row_of = dict(zip(m.state[ID].tolist(), range(9), strict=True))
    out = m.assign(torch.tensor([500]), now=4, training=True)
    assert out.rows.tolist() == out.reset.tolist()
    held = set(m.state[ID].tolist())
    if policy == "lru":
        assert out.rows.tolist() == [row_of[100]] and 100 not in held
    else:  # 101..107 tie on lookups (2) and recency: one of them goes, 100 stays
        assert 100 in held and len(set(ids[1:].tolist()) - held) == 1
    assert m.stats()["evictions"] == 1


def test_ttl_frees_rows_not_looked_up_for_ttl_steps() -> None:
    m = _map(9, buckets=1, eviction="ttl", ttl_steps=2, probe_window=8)
    m.assign(torch.arange(100, 108), now=1, training=True)  # the 8 slots full
    m.assign(torch.arange(102, 108), now=3, training=True)
    out = m.assign(torch.tensor([900, 901]), now=4, training=True)
    held = set(m.state[ID].tolist())
    # 100 and 101 expired (last looked up at 1, now 4 > 1 + 2): the new ids take their rows.
    assert {900, 901} <= held and not {100, 101} & held
    assert sorted(out.reset.tolist()) == sorted(out.rows.tolist())
    assert m.stats()["evictions"] == 2


def test_eviction_none_refuses_a_full_window_naming_the_table() -> None:
    m = _map(5, buckets=1, eviction="none")
    m.assign(torch.arange(4), now=1, training=True)
    with pytest.raises(ManagedIdsError, match=r"table t:.*eviction is 'none'"):
        m.assign(torch.tensor([77]), now=2, training=True)


def test_rows_of_one_step_are_never_evicted_in_that_step() -> None:
    """The error suggests a wider probe_window only where the window is narrower than the
    bucket (it once did when it covered the whole bucket, where it cannot help)."""
    m = _map(5, buckets=1, eviction="lru")  # 4 slots, all in the window of 128
    with pytest.raises(ManagedIdsError, match="looked up in this step") as whole:
        m.assign(torch.arange(5), now=1, training=True)
    assert "probe_window" not in str(whole.value)
    assert "raise data.table_sizes.t (the table's rows), or lower data.batch_size" in str(
        whole.value
    )
    m = _map(9, buckets=1, eviction="lru", probe_window=2)  # 8 slots, windows of 2
    with pytest.raises(ManagedIdsError, match="looked up in this step") as narrow:
        m.assign(torch.arange(8), now=1, training=True)
    assert "raise data.managed_ids.t.probe_window (up to 8), data.table_sizes.t" in str(
        narrow.value
    )


def test_shards_of_whole_buckets_hold_what_the_whole_table_holds() -> None:
    rows, buckets = 4096, 8
    whole = _map(rows, buckets=buckets)
    bounds = bucket_bounds(rows, buckets)
    halves = [
        IdMap(
            ManagedIds(buckets=buckets),
            table="t",
            num_embeddings=rows,
            row_start=lo,
            row_end=hi,
        )
        for lo, hi in ((0, bounds[3]), (bounds[3], rows))
    ]
    for step, ids in enumerate((_ids(1500), _ids(1500, seed=1)), start=1):
        whole.assign(ids, now=step, training=True)
        bucket = bucket_of(mix_ids(ids), buckets)
        for half, mine in zip(halves, (bucket < 3, bucket >= 3), strict=True):
            half.assign(ids[mine], now=step, training=True)
    assert torch.equal(torch.cat([h.state for h in halves], dim=1), whole.state)
    with pytest.raises(ValueError, match="belong to other buckets"):
        halves[0].assign(_ids(100, seed=5), now=3, training=True)
    with pytest.raises(ValueError, match="bucket bounds"):
        IdMap(ManagedIds(buckets=8), table="t", num_embeddings=rows, row_start=1, row_end=rows)


def test_bucket_means_are_the_mean_rows_of_each_buckets_ids_on_any_shard() -> None:
    rows, buckets = 1024, 8
    whole = _map(rows, buckets=buckets)
    whole.assign(_ids(5), now=1, training=True)  # some buckets hold no id
    weight = torch.randn(rows, 6)
    fallback, means = whole.bucket_means(lambda r: weight[r], chunk_rows=rows)
    bounds = bucket_bounds(rows, buckets)
    held = whole.state[ID] >= 0
    expected = {
        lo: weight[lo:hi][held[lo:hi]].double().mean(0)
        for lo, hi in itertools.pairwise(bounds)
        if held[lo:hi].any()
    }
    assert 0 < len(expected) < buckets
    assert fallback.tolist() == sorted(expected)  # buckets holding no id: left out
    torch.testing.assert_close(means, torch.stack([expected[lo] for lo in sorted(expected)]))
    # Shards of whole buckets, column shards too, give the whole table's values bit for bit.
    split = bounds[3]
    half = IdMap(
        ManagedIds(buckets=buckets), table="t", num_embeddings=rows, row_start=split, row_end=rows
    )
    half.state.copy_(whole.state[:, split:])
    rows_half, means_half = half.bucket_means(lambda r: weight[split:, 2:5][r], chunk_rows=300)
    mine = fallback >= split
    assert mine.any()  # the half holds buckets with ids: the comparison compares something
    assert torch.equal(rows_half + split, fallback[mine])
    assert torch.equal(means_half, means[mine][:, 2:5])


def test_bucket_means_read_the_shard_in_chunks_with_the_same_values() -> None:
    """A refresh never reads the shard at once: ``read`` gets at most ``chunk_rows``
    consecutive rows' held ones, and the means are those of one read, bit for bit; a map
    holding no id reads nothing and gives no rows."""
    rows = 1024
    m = _map(rows, buckets=8)
    m.assign(_ids(700), now=1, training=True)
    weight = torch.randn(rows, 5).half()  # read in the table's precision
    whole = m.bucket_means(lambda r: weight[r], chunk_rows=rows)
    calls: list[torch.Tensor] = []

    def read(r: torch.Tensor) -> torch.Tensor:
        calls.append(r)
        return weight[r]

    chunked = m.bucket_means(read, chunk_rows=64)
    assert len(calls) == rows // 64 and all(int(c.max() - c.min()) < 64 for c in calls)
    assert torch.equal(torch.cat(calls), (m.state[ID] >= 0).nonzero().squeeze(1))
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    assert whole[1].dtype == torch.float64 and whole[0].numel() == 8
    empty = _map(rows, buckets=8).bucket_means(lambda r: weight[r], chunk_rows=64)
    assert empty[0].numel() == 0 and empty[1].shape == (0, 5)


def test_fresh_rows_agree_across_column_shards_and_differ_by_salt() -> None:
    rows = torch.tensor([3, 77])
    kwargs = dict(table="t", num_embeddings=1000, seed=0)
    whole = fresh_rows(rows, salt=5, col_start=0, cols=8, **kwargs)
    right = fresh_rows(rows, salt=5, col_start=4, cols=4, **kwargs)
    assert torch.equal(whole[:, 4:], right)
    assert whole.abs().max() <= (1 / 1000) ** 0.5
    assert not torch.equal(whole, fresh_rows(rows, salt=6, col_start=0, cols=8, **kwargs))


def test_the_policy_checks_its_keys() -> None:
    with pytest.raises(ValueError, match="ttl_steps"):
        ManagedIds(eviction="ttl")
    with pytest.raises(ValueError, match="admit_after"):
        ManagedIds(admit_after=0)
    with pytest.raises(ValueError, match="at least 16 rows"):
        ManagedIds(buckets=8).buckets_for(10)
    assert EMPTY != FALLBACK


def test_without_reset_on_evict_the_new_id_inherits_the_row() -> None:
    m = _map(9, buckets=1, probe_window=8, reset_on_evict=False)
    first = m.assign(torch.arange(100, 108), now=1, training=True)
    assert sorted(first.reset.tolist()) == sorted(first.rows.tolist())  # never held: fresh
    out = m.assign(torch.tensor([500]), now=2, training=True)
    assert m.stats()["evictions"] == 1 and out.reset.numel() == 0


@pytest.mark.gpu
def test_the_map_on_cuda_decides_as_on_cpu() -> None:
    """On a GPU the map's state, rows and resets are the CPU's, bit for bit, through inserts,
    admission, LRU evictions and evaluation lookups; and its lookup-and-insert rate is printed
    (make gpu-check records it)."""
    import time

    maps = {
        device: IdMap(
            ManagedIds(buckets=8, admit_after=2, probe_window=16),
            table="t",
            num_embeddings=4096,
            row_start=0,
            row_end=4096,
            device=device,
        )
        for device in ("cpu", "cuda")
    }
    for step in range(1, 6):
        ids = _ids(3000, seed=step) % 5000  # repeats: admissions, then a full table evicts
        out = {d: m.assign(ids.to(d), now=step, training=True) for d, m in maps.items()}
        assert torch.equal(out["cpu"].rows, out["cuda"].rows.cpu())
        assert torch.equal(out["cpu"].reset.sort().values, out["cuda"].reset.cpu().sort().values)
    assert torch.equal(maps["cpu"].state, maps["cuda"].state.cpu())
    assert maps["cpu"].stats() == maps["cuda"].stats() and maps["cpu"].stats()["evictions"] > 0
    weight = torch.randn(4096, 8)
    means = {
        d: m.bucket_means(lambda r, w=weight.to(d): w[r], chunk_rows=1000) for d, m in maps.items()
    }
    assert torch.equal(means["cpu"][0], means["cuda"][0].cpu())
    torch.testing.assert_close(means["cpu"][1], means["cuda"][1].cpu())
    big = IdMap(
        ManagedIds(), table="t", num_embeddings=1 << 24, row_start=0, row_end=1 << 24, device="cuda"
    )
    big.assign(_ids(1 << 23, seed=9).cuda(), now=1, training=True)  # load 0.5
    batch = torch.cat([_ids(1 << 21, seed=9), _ids(1 << 18, seed=10)]).cuda()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(2, 7):
        big.assign(batch, now=step, training=True)
    torch.cuda.synchronize()
    rate = 5 * batch.numel() / (time.perf_counter() - start) / 1e6
    print(f"managed ids on cuda: {rate:.1f} M ids/s lookup-and-insert at load 0.5")


def test_ttl_in_days_of_data_time() -> None:
    """With ttl_days the clock's day (data.data_date) expires a row: a new id whose probe
    meets it first takes it (rather than an empty row) once its id went unseen for more than
    ttl_days days, whatever the steps, and not before."""
    for ttl, expired in ((2, True), (5, False)):
        m = _map(9, buckets=1, eviction="ttl", ttl_days=ttl, probe_window=8)
        m.assign(torch.tensor([100]), now=clock(1, 20000), training=True)
        row = int((m.state[ID] == 100).nonzero())
        candidates = torch.arange(1000, 3000)
        lo, _, home = m._home(candidates)
        new = int(candidates[lo + 1 + home == row][0])  # an id whose home row is 100's
        out = m.assign(torch.tensor([new]), now=clock(2, 20003), training=True)
        assert (out.rows.item() == row) == expired
        assert (100 in m.state[ID].tolist()) != expired
        assert m.stats()["evictions"] == int(expired)
