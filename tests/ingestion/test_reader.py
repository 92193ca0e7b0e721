"""Row-group reading: exactly-once epochs by sample id, seeded and different every epoch,
sessions kept whole, reproducible across runs."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydlrm.ingestion import (
    DataConfig,
    Preprocessor,
    SyntheticConfig,
    generate_synthetic,
    iter_train_batches,
    validate_data,
)
from raydlrm.ingestion._shuffle import session_order
from raydlrm.ingestion.reader import (
    EpochProgress,
    WorkerSource,
    assign_row_groups,
    assign_windows,
    time_order,
)
from raydlrm.ingestion.row_group_reader import RG_ID_COLUMN, RowGroupReader, read_columns
from raydlrm.ingestion.schema import DataSummary, RowGroup


def _groups(sizes: list[int]) -> list[RowGroup]:
    """Row groups of ``sizes`` rows, three a file, whose times are not in file order."""
    times = np.random.default_rng(0).permutation(len(sizes)).astype(float)
    return [
        RowGroup(f"f{i // 3}.parquet", i % 3, n, time=t)
        for i, (n, t) in enumerate(zip(sizes, times, strict=True))
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_row_group_goes_to_exactly_one_worker_each_epoch(world_size: int) -> None:
    groups = _groups([100, 250, 80, 80, 300, 120, 90, 60, 200, 110, 70])
    orders = []
    for epoch in range(3):
        assigned = assign_row_groups(
            groups, world_size=world_size, seed=5, epoch=epoch, shuffle=True
        )
        flat = [groups[i] for worker in assigned for i, skip in worker]
        assert Counter(flat) == Counter(groups)
        assert all(skip == 0 for worker in assigned for _, skip in worker)
        rows = [sum(groups[i].num_rows for i, _ in worker) for worker in assigned]
        # Greedy to the least-loaded worker: no worker is more than one row group ahead.
        assert max(rows) - min(rows) <= max(g.num_rows for g in groups)
        orders.append(flat)
        again = assign_row_groups(groups, world_size=world_size, seed=5, epoch=epoch, shuffle=True)
        assert again == assigned  # deterministic
    assert orders[0] != orders[1] != orders[2]
    unshuffled = assign_row_groups(groups, world_size=1, seed=5, epoch=7, shuffle=False)
    assert unshuffled == [[(i, 0) for i in range(len(groups))]]


@pytest.mark.parametrize("order", ["shuffled", "time"])
@pytest.mark.parametrize(("saved", "resumed"), [(2, 2), (2, 3), (3, 2), (4, 1)])
def test_resume_covers_the_untrained_rows_once(saved: int, resumed: int, order: str) -> None:
    """A checkpoint's progress leaves out finished row groups, skips the trained head of
    started ones, and (same world size) keeps each worker's own row groups."""
    groups = _groups([100, 250, 80, 80, 300, 120, 90, 60, 200, 110, 70])
    before = assign_row_groups(groups, world_size=saved, seed=5, epoch=1, shuffle=True, order=order)
    progress = EpochProgress(epoch=1)
    for worker in before:  # each worker: its first row group done, 30 rows of its second
        first = worker[0][0]
        progress.consumed[first] = progress.totals[first] = groups[first].num_rows
        for second, _ in worker[1:2]:
            progress.consumed[second], progress.totals[second] = 30, groups[second].num_rows
    after = assign_row_groups(
        groups,
        world_size=resumed,
        seed=5,
        epoch=1,
        shuffle=True,
        order=order,
        resume=progress,
        resume_world_size=saved,
    )
    trained = {i: progress.consumed.get(i, 0) for i in range(len(groups))}
    remaining = Counter()
    for worker in after:
        for i, skip in worker:
            assert skip == trained[i]
            remaining[i] += groups[i].num_rows - skip
    assert all(trained[i] + remaining[i] == g.num_rows for i, g in enumerate(groups))
    assert all(remaining[i] == 0 for i in progress.finished())
    if saved == resumed:
        assert after == [[(i, progress.consumed.get(i, 0)) for i, _ in w[1:]] for w in before]
    # Progress of another epoch does not apply.
    other = assign_row_groups(
        groups,
        world_size=resumed,
        seed=5,
        epoch=2,
        shuffle=True,
        order=order,
        resume=progress,
        resume_world_size=saved,
    )
    assert other == assign_row_groups(
        groups, world_size=resumed, seed=5, epoch=2, shuffle=True, order=order
    )


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_windows_are_consecutive_dealt_row_groups_up_to_the_window(world_size: int) -> None:
    groups = _groups([100, 250, 80, 80, 300, 120, 90, 60, 200, 110, 70])
    deal = {"world_size": world_size, "seed": 5, "epoch": 2, "shuffle": True}
    windows = assign_windows(groups, **deal, window_rows=400)
    for worker, dealt in zip(windows, assign_row_groups(groups, **deal), strict=True):
        assert [item for window in worker for item in window] == dealt
        for window in worker:
            assert len(window) == 1 or sum(groups[i].num_rows for i, _ in window) <= 400
    assert any(len(window) > 1 for worker in windows for window in worker)
    # Off, or not shuffling: one row group per window.
    for off in ({**deal, "window_rows": 0}, {**deal, "shuffle": False, "window_rows": 400}):
        off_deal = {k: v for k, v in off.items() if k != "window_rows"}
        assert assign_windows(groups, **off) == [
            [[item] for item in worker] for worker in assign_row_groups(groups, **off_deal)
        ]


@pytest.mark.parametrize("order", ["shuffled", "time"])
@pytest.mark.parametrize(("saved", "resumed"), [(2, 2), (2, 3), (3, 1)])
def test_resumed_windows_cover_the_untrained_rows_once(
    saved: int, resumed: int, order: str
) -> None:
    """With the checkpoint's world size each worker keeps its windows, less the finished row
    groups, each started one skipping its trained rows; otherwise the rest is dealt anew (in
    time order too, under ``time``)."""
    groups = _groups([100, 250, 80, 80, 300, 120, 90, 60, 200, 110, 70])
    deal = {"seed": 5, "epoch": 1, "shuffle": True, "window_rows": 400, "order": order}
    before = assign_windows(groups, world_size=saved, **deal)
    progress = EpochProgress(epoch=1, window_rows=400)
    for worker in before:  # its first window done; every row group of its second 10 rows in
        for i, _ in worker[0]:
            progress.consumed[i] = progress.totals[i] = groups[i].num_rows
        for i, _ in worker[1] if len(worker) > 1 else []:
            progress.consumed[i], progress.totals[i] = 10, groups[i].num_rows
    after = assign_windows(
        groups, world_size=resumed, **deal, resume=progress, resume_world_size=saved
    )
    remaining = Counter()
    for worker in after:
        for window in worker:
            for i, skip in window:
                assert skip == progress.consumed.get(i, 0)
                remaining[i] += groups[i].num_rows - skip
    assert all(
        progress.consumed.get(i, 0) + remaining[i] == g.num_rows for i, g in enumerate(groups)
    )
    if saved == resumed:
        assert after == [
            [[(i, progress.consumed.get(i, 0)) for i, _ in w] for w in worker[1:]]
            for worker in before
        ]
    elif order == "time":
        by_time = time_order(groups)
        for worker in after:
            dealt = [i for window in worker for i, _ in window]
            assert dealt == sorted(dealt, key=by_time.index)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_time_ordered_epoch_deals_row_groups_in_time_order(world_size: int) -> None:
    """Under ``time`` every epoch deals the row groups in the order of their times (not the
    file order), the same every epoch, each to the worker with the fewest rows (so the workers
    advance through time together), exactly once; a window holds consecutive row groups of a
    worker's, in time. Eval keeps the file order."""
    groups = _groups([100, 250, 80, 80, 300, 120, 90, 60, 200, 110, 70])
    by_time = time_order(groups)
    assert [groups[i].time for i in by_time] == sorted(g.time for g in groups)
    assert by_time != list(range(len(groups)))  # the times are not in file order
    deal = {"world_size": world_size, "seed": 5, "shuffle": True, "order": "time"}
    windows = assign_windows(groups, **deal, epoch=0, window_rows=400)
    assert assign_windows(groups, **deal, epoch=3, window_rows=400) == windows
    dealt = assign_row_groups(groups, **deal, epoch=0)
    assert dealt == assign_row_groups(groups, **deal, epoch=2)
    assert sorted(i for worker in dealt for i, _ in worker) == list(range(len(groups)))
    rows = [0] * world_size
    for i in by_time:  # the fewest-rows deal over the time order
        rank = next(r for r, worker in enumerate(dealt) if (i, 0) in worker)
        assert rows[rank] == min(rows)
        rows[rank] += groups[i].num_rows
    for worker, mine in zip(windows, dealt, strict=True):
        assert [item for window in worker for item in window] == mine
        for window in worker:
            assert len(window) == 1 or sum(groups[i].num_rows for i, _ in window) <= 400
    assert assign_row_groups(groups, **{**deal, "shuffle": False}, epoch=0) == assign_row_groups(
        groups, world_size=world_size, seed=5, shuffle=False, epoch=0
    )


def test_time_order_without_times_is_the_file_order() -> None:
    groups = _groups([10, 20, 30, 40])
    untimed = [dataclasses.replace(g, time=None) for g in groups]
    assert time_order(untimed) == [0, 1, 2, 3]
    ties = [dataclasses.replace(g, time=1.0) for g in groups]
    assert time_order(ties) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"row group 1 of f0\.parquet has no time"):
        time_order([groups[0], untimed[1]])


def test_a_resumed_epoch_keeps_the_window_it_began_with(data: Path) -> None:
    config = DataConfig(train_path=str(data), eval_path=None, table_size=1000)
    summary = validate_data(str(data), config)
    source = _source(summary, config=config, rank=0, world_size=1, seed=0, shuffle=True)
    source.start(3, resume=EpochProgress(3, window_rows=77), world_size=1)
    assert source.window_rows(3) == 77 and source.window_rows(4) == config.shuffle_window_rows
    # A checkpoint made before shuffle windows read its epoch without one.
    assert EpochProgress.from_dict({"epoch": 3}).window_rows == 0
    assert EpochProgress.merged([EpochProgress(3, window_rows=77)]).window_rows == 77
    unshuffled = _source(summary, config=config, rank=0, world_size=1, seed=0, shuffle=False)
    assert unshuffled.window_rows(0) == 0


def _read_epoch(source: WorkerSource, epoch: int) -> pa.Table:
    """A worker's rows of ``epoch`` (after :meth:`WorkerSource.start`), read as its actors would
    read them, in order, without Ray."""
    reader = RowGroupReader(source.config, **source._reader_kwargs(epoch))
    tables = [reader(pa.Table.from_pylist([item])) for item in source.window_items(epoch)]
    return pa.concat_tables(tables) if tables else reader.empty_table()


def _trained(heads: list[pa.Table], *, began: EpochProgress) -> EpochProgress:
    """A checkpoint's merged progress in the epoch that ``began`` after each worker trained
    the rows ``heads``."""
    parts = []
    for head in heads:
        part = EpochProgress(began.epoch, window_rows=began.window_rows, files=began.files)
        part.add(EpochProgress.rows_of(head))
        parts.append(part)
    return EpochProgress.merged(parts)


@pytest.mark.parametrize("resumed_world_size", [2, 1])
def test_a_resumed_epoch_reads_with_a_smaller_window_every_row_once(
    data: Path, resumed_world_size: int
) -> None:
    """A window whose actors ran out of memory can be lowered on resume: the rest of the epoch
    is read with the smaller window (in other batches), and every row is still trained once
    (keys are drawn per row group; the trained rows are a head of each). A larger window waits
    for the next epoch."""
    config = DataConfig(
        train_path=str(data), eval_path=None, table_size=1000, shuffle_window_rows=600
    )
    summary = validate_data(str(data), config)

    def sources(config: DataConfig, world_size: int) -> list[WorkerSource]:
        return [
            _source(summary, config=config, rank=r, world_size=world_size, seed=7, shuffle=True)
            for r in range(world_size)
        ]

    before = sources(config, 2)
    progress = [s.start(1, resume=None, world_size=None) for s in before]
    assert progress[0].window_rows == 600
    heads = [_read_epoch(s, 1).slice(0, n) for s, n in zip(before, (250, 90), strict=True)]
    saved = _trained(heads, began=progress[0])
    smaller = dataclasses.replace(config, shuffle_window_rows=150)
    after = sources(smaller, resumed_world_size)
    resumed = [s.start(1, resume=saved, world_size=2) for s in after]
    assert {p.window_rows for p in resumed} == {150}  # what the next checkpoint records
    rest = []
    for source in after:
        assert source.window_rows(1) == 150
        for window in source.windows(1):
            rows = sum(summary.row_groups[i].num_rows - skip for i, skip in window)
            assert len(window) == 1 or rows <= 150
        rest.append(_read_epoch(source, 1))
    ids = [i for t in (*heads, *rest) for i in t.column("sample_id").to_pylist()]
    assert sorted(ids) == list(range(summary.num_rows))  # every row once
    larger = _source(
        summary,
        config=dataclasses.replace(config, shuffle_window_rows=10**6),
        rank=0,
        world_size=2,
        seed=7,
        shuffle=True,
    )
    assert larger.start(1, resume=saved, world_size=2).window_rows == 600
    assert larger.start(2, resume=saved, world_size=2).window_rows == 10**6


def test_a_resumed_epoch_reads_the_files_it_began_with(data: Path, tmp_path: Path) -> None:
    """Files added to the data set after an epoch began (a late file in a partition, a new
    one at the end) are not dealt into its rest: the checkpoint's position counts rows by
    place in the epoch's list of files, which the resumed epoch reads again (every row of it
    once); the next epoch reads them. A file of the epoch that is gone cannot be read."""
    import shutil

    files = sorted(data.glob("*.parquet"))
    root = tmp_path / "train"
    root.mkdir()
    for name, file in (("a", files[0]), ("c", files[2])):
        shutil.copy(file, root / f"{name}.parquet")
    config = DataConfig(
        train_path=str(root), eval_path=None, table_size=1000, shuffle_window_rows=150
    )
    first = validate_data(str(root), config)
    source = _source(first, config=config, rank=0, world_size=1, seed=3, shuffle=True)
    began = source.start(1, resume=None, world_size=None)
    assert began.files == [["a.parquet", [64, 64, 64, 8]], ["c.parquet", [200]]]
    epoch = _read_epoch(source, 1)
    head = epoch.slice(0, 150)
    for name, file in (("b", files[1]), ("d", files[3])):
        shutil.copy(file, root / f"{name}.parquet")
    later = validate_data(str(root), config)
    assert len(later.row_groups) == len(first.row_groups) + 2
    source = _source(later, config=config, rank=0, world_size=1, seed=3, shuffle=True)
    resumed = source.start(1, resume=_trained([head], began=began), world_size=1)
    assert resumed.files == began.files
    rest = _read_epoch(source, 1)
    ids = head.column("sample_id").to_pylist() + rest.column("sample_id").to_pylist()
    assert ids == epoch.column("sample_id").to_pylist()  # the very rows it would have had
    assert len(source.start(2, resume=None, world_size=None).files) == 4
    assert _read_epoch(source, 2).num_rows == later.num_rows  # the next epoch: all four
    (root / "c.parquet").unlink()
    gone = validate_data(str(root), config)
    source = _source(gone, config=config, rank=0, world_size=1, seed=3, shuffle=True)
    with pytest.raises(ValueError, match=r"data file c\.parquet of the resumed epoch is gone"):
        source.start(1, resume=_trained([head], began=began), world_size=1)


def _times(path: Path) -> np.ndarray:
    """The ``ts`` of each row of a data set (seconds), indexed by its sample id."""
    table = pq.read_table(path, columns=["sample_id", "ts"])
    times = np.empty(table.num_rows, dtype=np.int64)
    times[table.column("sample_id").to_numpy()] = table.column("ts").cast(pa.int64()).to_numpy()
    return times


@pytest.mark.parametrize("window", [0, 250])
def test_time_ordered_workers_read_through_time(timed: Path, window: int) -> None:
    """Under ``time`` each worker reads its row groups in the time order of ``ts`` (not the
    file order), the same every epoch: without a window every row in time order (each row
    group in its file order, sessions too), with one the rows of each window mixed among
    themselves only, a span of time after the previous window's; every row once."""
    config = DataConfig(
        train_path=str(timed),
        eval_path=None,
        table_size=1000,
        order="time",
        time_column="ts",
        shuffle_window_rows=window,
    )
    summary = validate_data(str(timed), config)
    times = _times(timed)
    seen: list[int] = []
    for rank in range(2):
        source = _source(summary, config=config, rank=rank, world_size=2, seed=7, shuffle=True)
        source.start(0, resume=None, world_size=None)
        assert source.windows(0) == source.windows(1)
        rows = _read_epoch(source, 0)
        ids = rows.column("sample_id").to_numpy()
        seen += ids.tolist()
        if not window:
            assert (np.diff(times[ids]) > 0).all()
            continue
        start, end_of_previous, mixed = 0, -1, False
        for items in source.windows(0):
            n = sum(summary.row_groups[i].num_rows for i, _ in items)
            span = times[ids[start : start + n]]
            groups = rows.column(RG_ID_COLUMN).to_numpy()[start : start + n]
            assert set(groups.tolist()) == {i for i, _ in items}
            assert span.min() > end_of_previous
            end_of_previous, start = span.max(), start + n
            mixed |= bool((np.diff(span) < 0).any())
        assert mixed
    assert sorted(seen) == list(range(summary.num_rows))


@pytest.mark.parametrize("order", ["shuffled", "time"])
@pytest.mark.parametrize("resumed_world_size", [2, 3])
def test_a_resumed_epoch_reads_the_rest_once_in_the_same_order(
    timed: Path, order: str, resumed_world_size: int
) -> None:
    """Killed mid-epoch and resumed with the checkpoint's world size, each worker reads exactly
    the rest of what it would have read, in the same order (bit-identical data order); with
    another world size, every remaining row once (under ``time``, dealt anew in time order)."""
    config = DataConfig(
        train_path=str(timed),
        eval_path=None,
        table_size=1000,
        order=order,
        time_column="ts",
        shuffle_window_rows=250,
    )
    summary = validate_data(str(timed), config)

    def sources(world_size: int) -> list[WorkerSource]:
        return [
            _source(summary, config=config, rank=r, world_size=world_size, seed=7, shuffle=True)
            for r in range(world_size)
        ]

    before = sources(2)
    began = [s.start(1, resume=None, world_size=None) for s in before]
    read = [_read_epoch(s, 1) for s in before]
    epochs = [table.column("sample_id").to_pylist() for table in read]
    heads = [table.slice(0, n) for table, n in zip(read, (130, 260), strict=True)]
    after = sources(resumed_world_size)
    saved = _trained(heads, began=began[0])
    rests = []
    for source in after:
        source.start(1, resume=saved, world_size=2)
        rests.append(_read_epoch(source, 1).column("sample_id").to_pylist())
    heads_ids = [head.column("sample_id").to_pylist() for head in heads]
    assert sorted(i for ids in (*heads_ids, *rests) for i in ids) == list(range(summary.num_rows))
    if resumed_world_size == 2:
        assert [h + r for h, r in zip(heads_ids, rests, strict=True)] == epochs
    elif order == "time":
        by_time = time_order(summary.row_groups)
        for source in after:
            dealt = [i for window in source.windows(1) for i, _ in window]
            assert dealt == sorted(dealt, key=by_time.index)


def test_session_order_permutes_whole_sessions() -> None:
    sessions = pa.table({"s": pa.array([1, 1, 1, 2, 3, 3, 4, 5, 5, 5, 5])})
    order = session_order(sessions, "s", np.random.default_rng(0))
    shuffled = sessions.column("s").to_numpy()[order]
    assert sorted(order.tolist()) == list(range(11))
    runs = [shuffled[0]] + [b for a, b in itertools.pairwise(shuffled) if a != b]
    assert sorted(runs) == [1, 2, 3, 4, 5]  # each session is one contiguous run
    assert shuffled.tolist() != sessions.column("s").to_numpy().tolist()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reader")
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=1200, num_eval_rows=0, rows_per_file=200, max_cardinality=500, seed=4
        ),
        out_dir=root,
    )
    # Split one file into several row groups, so row groups (not files) are the unit.
    path = root / "train" / "part-00000.parquet"
    pq.write_table(pq.read_table(path), path, row_group_size=64)
    return root / "train"


@pytest.fixture(scope="module")
def timed(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rows of ``data`` in 4 files of 3 row groups, with a timestamp ``ts`` that rises
    inside each file but whose files are not in time order (their spans: 3rd, 1st, 4th,
    2nd)."""
    table = pq.read_table(data).sort_by("sample_id")
    root = tmp_path_factory.mktemp("timed") / "train"
    root.mkdir()
    for k, span in enumerate([2, 0, 3, 1]):
        ts = pa.array(1_700_000_000 + 300 * span + np.arange(300), pa.timestamp("s"))
        part = table.slice(300 * k, 300).append_column("ts", ts)
        pq.write_table(part, root / f"part-{k}.parquet", row_group_size=100)
    return root


def _source(
    summary: DataSummary,
    *,
    config: DataConfig,
    rank: int,
    world_size: int,
    seed: int,
    shuffle: bool,
) -> WorkerSource:
    """Worker ``rank``'s source over the row groups of ``summary``, on one preprocessing actor."""
    return WorkerSource(
        summary.row_groups,
        config,
        source_path=summary.path,
        rank=rank,
        world_size=world_size,
        seed=seed,
        shuffle=shuffle,
        num_actors=1,
        schema=summary.schema,
    )


def _epoch_ids(sources: list[WorkerSource]) -> list[list[int]]:
    """Every worker's sample ids of its next epoch, in order."""
    out = []
    for source in sources:
        ids: list[int] = []
        for table in source.iter_batches(batch_size=100, batch_format="pyarrow"):
            ids.extend(table.column("sample_id").to_pylist())
            assert table.num_rows <= 100
        out.append(ids)
    return out


@pytest.mark.ray
def test_two_workers_see_every_row_exactly_once_per_epoch(data: Path, ray_cluster) -> None:
    config = DataConfig(train_path=str(data), eval_path=None, table_size=1000, batch_size=100)
    summary = validate_data(str(data), config)
    assert len(summary.row_groups) == 5 + 4  # 4 files of one group, one file of 4 groups

    def sources() -> list[WorkerSource]:
        return [
            _source(summary, config=config, rank=rank, world_size=2, seed=11, shuffle=True)
            for rank in range(2)
        ]

    run = sources()
    epochs = [_epoch_ids(run) for _ in range(2)]
    everything = set(pq.read_table(data, columns=["sample_id"]).column("sample_id").to_pylist())
    for workers in epochs:
        seen = [i for worker in workers for i in worker]
        assert len(seen) == len(set(seen)) == len(everything)  # exactly once
        assert set(seen) == everything
        assert abs(len(workers[0]) - len(workers[1])) <= 200  # split by row groups
    assert epochs[0] != epochs[1]  # a different order every epoch
    # Reproducible: the same seed gives the same assignment and order.
    rerun = sources()
    assert [_epoch_ids(rerun) for _ in range(2)] == epochs
    # Sessions stay whole inside a row group: consecutive samples of a session stay adjacent.
    table = pq.read_table(data, columns=["sample_id", "session_id"])
    session_of = dict(
        zip(
            table.column("sample_id").to_pylist(),
            table.column("session_id").to_pylist(),
            strict=True,
        )
    )
    # A session cut by a row-group (or file) boundary is the only one that may appear twice.
    group_sessions: Counter[int] = Counter()
    for file in sorted(data.glob("*.parquet")):
        parquet = pq.ParquetFile(file)
        for i in range(parquet.num_row_groups):
            ids = parquet.read_row_group(i, columns=["session_id"]).column("session_id")
            group_sessions.update(set(ids.to_pylist()))
    cut = {s for s, n in group_sessions.items() if n > 1}
    for worker in epochs[1]:
        sessions = [session_of[i] for i in worker]
        runs = [sessions[0]] + [b for a, b in itertools.pairwise(sessions) if a != b]
        repeated = {s for s, n in Counter(runs).items() if n > 1}
        assert repeated <= cut


@pytest.mark.ray
def test_a_worker_without_row_groups_gets_an_empty_stream(data: Path, ray_cluster) -> None:
    config = DataConfig(train_path=str(data), eval_path=None, table_size=1000)
    summary = validate_data(str(data), config)
    one = dataclasses.replace(summary, row_groups=summary.row_groups[:1])
    source = _source(one, config=config, rank=1, world_size=2, seed=0, shuffle=False)
    assert list(source.iter_batches(batch_size=10)) == []
    empty = source.empty_table()
    assert empty.num_rows == 0 and "dense" in empty.column_names


@pytest.mark.ray
def test_worker_batches_hold_the_preprocessed_rows(data: Path, ray_cluster) -> None:
    """A worker's source through ``iter_train_batches``, as training reads it: every row once,
    in batches of at most ``batch_size``, holding what the preprocessor makes of the raw row."""
    config = DataConfig(train_path=str(data), eval_path=None, table_size=1000, batch_size=256)
    summary = validate_data(str(data), config)
    source = _source(summary, config=config, rank=0, world_size=1, seed=5, shuffle=True)
    batches = list(iter_train_batches(source, config=config))
    assert all(b.batch_size <= 256 for b in batches)
    ids = np.concatenate([b.sample_ids.numpy() for b in batches])
    np.testing.assert_array_equal(np.sort(ids), np.arange(summary.num_rows))

    expected = Preprocessor(config)(pq.read_table(data))
    by_id = np.argsort(expected.column("sample_id").to_numpy())
    first = batches[0]
    rows = by_id[first.sample_ids.numpy()]
    c1 = first.sparse.values[: first.batch_size].numpy()  # C1 holds one id per row
    np.testing.assert_array_equal(c1, expected.column("C1").to_numpy()[rows])
    np.testing.assert_array_equal(first.labels.numpy(), expected.column("label").to_numpy()[rows])
    dense = expected.column("dense").combine_chunks().flatten().to_numpy().reshape(-1, 13)
    np.testing.assert_allclose(first.dense.numpy(), dense[rows])


def test_session_shuffle_depends_on_the_data_not_its_location(data: Path, tmp_path: Path) -> None:
    """The same data set copied to another directory reads in the same shuffled order (the
    shuffle was seeded by the file's full path, so a copy trained to a different model)."""
    import shutil

    copy = tmp_path / "elsewhere" / "train"
    shutil.copytree(data, copy)
    config = DataConfig(train_path=str(data), eval_path=None, table_size=1000, batch_size=100)
    orders = []
    for root in (data, copy):
        summary = validate_data(str(root), config)
        reader = RowGroupReader(
            config,
            source_path=str(root),
            columns=read_columns(config, summary.schema),
            schema=summary.schema,
            seed=3,
            epoch=1,
            shuffle=True,
        )
        orders.append(reader(_one_window_each(summary)).column("sample_id").to_pylist())
    assert orders[0] == orders[1]
    unshuffled = pq.read_table(data, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(orders[0]) == sorted(unshuffled) and orders[0] != unshuffled


def _one_window_each(summary: DataSummary) -> pa.Table:
    """A reader's input: every row group of ``summary`` as a window of its own."""
    return pa.Table.from_pylist(
        [
            {"window": [{"group": g.to_dict(), "id": i, "skip": 0}]}
            for i, g in enumerate(summary.row_groups)
        ]
    )


def _one_window(summary: DataSummary, skips: dict[int, int] | None = None) -> pa.Table:
    """A reader's input: every row group of ``summary`` in one window, skipping ``skips``."""
    refs = [
        {"group": g.to_dict(), "id": i, "skip": (skips or {}).get(i, 0)}
        for i, g in enumerate(summary.row_groups)
    ]
    return pa.Table.from_pylist([{"window": refs}])


@pytest.mark.parametrize("session_column", ["session_id", None])
def test_a_window_mixes_its_row_groups_and_resumes_where_it_stopped(
    data: Path, session_column: str | None
) -> None:
    """The rows of a window come in a random order across its row groups (sessions whole),
    every row once, the same on every run; a window resumed after some of its rows (their
    counts per row group, as a checkpoint holds them) continues with exactly the rest."""
    config = DataConfig(
        train_path=str(data), eval_path=None, table_size=1000, session_column=session_column
    )
    summary = validate_data(str(data), config)

    def read(skips: dict[int, int] | None = None, seed: int = 3) -> pa.Table:
        reader = RowGroupReader(
            config,
            source_path=str(data),
            columns=read_columns(config, summary.schema),
            schema=summary.schema,
            seed=seed,
            epoch=1,
            shuffle=True,
            window_rows=10**6,
        )
        return reader(_one_window(summary, skips))

    out = read()
    ids = out.column("sample_id").to_numpy()
    np.testing.assert_array_equal(np.sort(ids), np.arange(summary.num_rows))
    groups = out.column(RG_ID_COLUMN).to_numpy()
    assert len(set(groups[:100].tolist())) >= 6  # 9 row groups, mixed from the start
    assert read().equals(out) and not read(seed=4).equals(out)
    table = pq.read_table(data, columns=["sample_id", "session_id"]).sort_by("sample_id")
    sessions = table.column("session_id").to_numpy()[ids]
    runs = Counter([sessions[0]] + [b for a, b in itertools.pairwise(sessions) if a != b])
    whole = sum(n > 1 for n in runs.values())  # sessions in more than one piece
    if session_column is None:
        assert whole > 50  # rows are the units: sessions scattered
    else:
        assert whole <= len(summary.row_groups)  # only those cut by a row-group boundary
    for head in (1, 300, summary.num_rows - 5):
        trained = EpochProgress()
        trained.add(EpochProgress.rows_of(out.slice(0, head)))
        rest = read(trained.consumed)
        np.testing.assert_array_equal(rest.column("sample_id").to_numpy(), ids[head:])


def test_a_window_over_half_a_workers_memory_is_refused_before_ray_starts(data: Path) -> None:
    from raydlrm.ingestion.reader import WINDOW_COPIES, window_bytes
    from raydlrm.platform.config import ConfigError, load_config
    from raydlrm.platform.memory import check_shuffle_window

    def job(*overrides: str):
        return load_config(
            overrides=[
                f"data.train_path={data}",
                "data.eval_path=null",
                "data.num_preprocess_actors=2",
                *overrides,
            ]
        )

    summary = validate_data(str(data), job().data)
    first = pq.ParquetFile(data / "part-00000.parquet").metadata.row_group(0)
    per_row = first.total_byte_size / first.num_rows
    # The window is at most the data set: 1200 rows.
    assert window_bytes(summary, job().data) == int(WINDOW_COPIES * 1200 * per_row)
    assert window_bytes(summary, job("data.shuffle_window_rows=0").data) == 0
    need = 2 * window_bytes(summary, job().data)  # two actors
    check_shuffle_window(job(f"scaling.resources_per_worker={{ memory = {2 * need} }}"), summary)
    small = job(f"scaling.resources_per_worker={{ memory = {need} }}")
    with pytest.raises(ConfigError, match=r"data\.shuffle_window_rows = 262144: 2 preprocessing"):
        check_shuffle_window(small, summary)
    with pytest.raises(ConfigError, match=r"at most 600 \(0: off\)"):
        check_shuffle_window(small, summary)
    check_shuffle_window(
        job("data.shuffle_window_rows=0", "scaling.resources_per_worker={ memory = 1 }"), summary
    )
    # A resumed run reads its last epoch with the window it began with, or a smaller configured
    # one: that is the window checked; with an epoch after it, the configured one is read too.
    began = {"position": {"epoch": 0, "window_rows": 100}}
    check_shuffle_window(small, summary, resumed=began)
    later = job(f"scaling.resources_per_worker={{ memory = {need} }}", "training.num_epochs=2")
    with pytest.raises(ConfigError, match=r"data\.shuffle_window_rows = 262144: 2 preprocessing"):
        check_shuffle_window(later, summary, resumed=began)
    began["position"]["window_rows"] = 1000
    with pytest.raises(
        ConfigError,
        match=r"262144 \(the resumed last epoch 0 reads with 1000 rows\): .* at most 600 ",
    ):
        check_shuffle_window(small, summary, resumed=began)
