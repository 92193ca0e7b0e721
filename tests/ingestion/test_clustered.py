"""Session-clustered data (RecD): the layout and its converter, storage bytes, bad input, reading
through the worker sources (every sample once, resumable), dedup groups from dictionaries,
inference of the groups, inspection, and the synthetic user histories."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from raydlrm.ingestion import (
    DataConfig,
    DataValidationError,
    Preprocessor,
    SyntheticConfig,
    arrow_to_batch,
    generate_synthetic,
    iter_train_batches,
    validate_data,
)
from raydlrm.ingestion.badinput import BadInputError, quarantine_counts
from raydlrm.ingestion.clustered import data_bytes, read_rows
from raydlrm.ingestion.clustering import ClusterResult, cluster_data
from raydlrm.ingestion.dedup import batch_dedup_factor, infer_dedup_groups
from raydlrm.ingestion.inspect import inspect_data
from raydlrm.ingestion.layout import layout_of
from raydlrm.ingestion.reader import EpochProgress, WorkerSource
from raydlrm.ingestion.row_group_reader import (
    RG_ID_COLUMN,
    SessionGroupReader,
    read_columns,
    reader_class,
)

USERS = ["C1", "C2", "C3"]
SPARSE = [f"C{i}" for i in range(1, 11)]
SYNTHETIC = {
    "num_train_rows": 3000,
    "num_eval_rows": 0,
    "rows_per_file": 1000,
    "num_sparse": 10,
    "num_list_features": 2,
    "num_user_features": 3,
    "user_history_length": 8,
    "mean_session_length": 5,
    "max_cardinality": 2000,
    "partitions": ["d1", "d2"],
    "seed": 7,
}
BATCH = 128


def _config(path: Path, **overrides) -> DataConfig:
    return DataConfig(
        train_path=str(path),
        eval_path=None,
        sparse_columns=SPARSE,
        table_size=1000,
        batch_size=BATCH,
        **overrides,
    )


def _rewrite(path: Path, groups: list[pa.Table]) -> None:
    """Writes ``groups`` to ``path``, one row group each."""
    with pq.ParquetWriter(path, groups[0].schema) as writer:
        for group in groups:
            writer.write_table(group, row_group_size=max(1, group.num_rows))


def _row_groups(path: Path) -> list[pa.Table]:
    parquet = pq.ParquetFile(path)
    return [parquet.read_row_group(i) for i in range(parquet.num_row_groups)]


@dataclass(frozen=True)
class Recd:
    samples: Path  # the sample-level training set (its first file in row groups of 300)
    converted: Path  # converted by cluster_data
    generated: Path  # generated clustered by the synthetic generator
    result: ClusterResult


@pytest.fixture(scope="module")
def recd(tmp_path_factory: pytest.TempPathFactory) -> Recd:
    root = tmp_path_factory.mktemp("recd")
    samples = generate_synthetic(SyntheticConfig(**SYNTHETIC), out_dir=root / "samples")
    # Several row groups in one file: sessions cut by a row-group boundary are covered.
    first = samples.train_files[0]
    pq.write_table(pq.ParquetFile(first).read(), first, row_group_size=300)
    result = cluster_data(
        str(samples.train_path), _config(samples.train_path), out=str(root / "converted")
    )
    generated = generate_synthetic(
        SyntheticConfig(**SYNTHETIC, layout="clustered"), out_dir=root / "generated"
    )
    return Recd(samples.train_path, root / "converted", generated.train_path, result)


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / source.name))


def _runs(ids: np.ndarray) -> int:
    return int(1 + np.count_nonzero(ids[1:] != ids[:-1])) if ids.size else 0


# The layout and the converter.


def test_converted_layout_keeps_paths_row_groups_and_rows(recd: Recd) -> None:
    sources = sorted(recd.samples.rglob("*.parquet"))
    relative = [p.relative_to(recd.samples) for p in sources]
    assert [str(r.parent) for r in relative] == ["date=d1", "date=d1", "date=d2"]
    marker = json.loads((recd.converted / "_clustered.json").read_text())
    assert marker == {"format_version": 1, "session_column": "session_id", "session_columns": USERS}
    sessions_total = 0
    for source, rel in zip(sources, relative, strict=True):
        samples = pq.ParquetFile(recd.converted / "samples" / rel)
        sessions = pq.ParquetFile(recd.converted / "sessions" / rel)
        original = pq.ParquetFile(source)
        assert samples.metadata.num_row_groups == original.metadata.num_row_groups
        assert sessions.metadata.num_row_groups == original.metadata.num_row_groups
        assert not set(USERS) & set(samples.schema_arrow.names)
        assert sessions.schema_arrow.names == ["session_id", *USERS]
        for i in range(original.metadata.num_row_groups):
            rows = original.read_row_group(i)
            ids = rows.column("session_id").to_numpy()
            group_sessions = sessions.read_row_group(i)
            # Row group i of the sessions file: exactly the sessions of row group i, in order.
            assert group_sessions.column("session_id").to_numpy().tolist() == list(
                dict.fromkeys(ids.tolist())
            )
            assert samples.read_row_group(i).equals(rows.drop_columns(USERS))
            sessions_total += group_sessions.num_rows
    assert sessions_total == recd.result.num_sessions < recd.result.num_samples == 3000
    # Read back (sessions joined), the rows are the source's.
    columns = pq.ParquetFile(sources[0]).schema_arrow.names
    config = _config(recd.converted)
    joined = read_rows(str(recd.converted), config, columns=columns, max_rows=10_000)
    original = read_rows(str(recd.samples), config, columns=columns, max_rows=10_000)
    assert joined.equals(original)
    # Generating clustered data writes the same rows as converting (and the same sessions
    # where the fixture did not cut the source file into row groups).
    for rel in relative:
        for part in ("samples", "sessions"):
            ours = pq.ParquetFile(recd.generated / part / rel).read()
            theirs = pq.ParquetFile(recd.converted / part / rel).read()
            assert ours.equals(theirs) or (part, rel) == ("sessions", relative[0])


def test_storage_bytes_are_the_files_on_disk(recd: Recd) -> None:
    config = _config(recd.samples)
    on_disk = sum(p.stat().st_size for p in recd.samples.rglob("*.parquet"))
    clustered = sum(p.stat().st_size for p in recd.converted.rglob("*") if p.is_file())
    assert data_bytes(str(recd.samples), config) == recd.result.source_bytes == on_disk
    assert data_bytes(str(recd.converted), config) == recd.result.clustered_bytes == clustered
    assert clustered < on_disk


def test_validate_data_reads_the_clustered_layout(recd: Recd, tmp_path: Path) -> None:
    config = _config(recd.converted)
    summary = validate_data(str(recd.converted), config)
    plain = validate_data(str(recd.samples), config)
    assert summary.num_rows == plain.num_rows == 3000
    assert [g.num_rows for g in summary.row_groups] == [g.num_rows for g in plain.row_groups]
    assert all(
        g.sessions_file == g.file.replace("/samples/", "/sessions/") for g in summary.row_groups
    )
    assert layout_of(summary.schema).session_columns == USERS
    assert set(summary.schema.names) == set(plain.schema.names)
    assert summary.list_columns == plain.list_columns == [*USERS, "C9", "C10"]
    # A missing sessions file, or one of other row groups, is named.
    broken = _copy(recd.converted, tmp_path)
    (broken / "sessions" / "date=d2" / "part-00002.parquet").unlink()
    with pytest.raises(DataValidationError, match=r"no sessions file .*date=d2/part-00002"):
        validate_data(str(broken), config)
    sessions = broken / "sessions" / "date=d1" / "part-00000.parquet"
    groups = _row_groups(sessions)
    (broken / "sessions" / "date=d2" / "part-00002.parquet").write_bytes(
        (recd.converted / "sessions" / "date=d2" / "part-00002.parquet").read_bytes()
    )
    _rewrite(sessions, [pa.concat_tables(groups[:2]), *groups[2:]])
    with pytest.raises(DataValidationError, match=r"3 row groups, its samples file .* 4"):
        validate_data(str(broken), config)


def _tampered(source: Path, tmp_path: Path, *, column: str, rows: list[int]) -> Path:
    """A copy of the sample-level set whose ``column`` differs from the row before at each of
    ``rows`` of its last file (rows inside a session)."""
    copy = _copy(source, tmp_path)
    path = copy / "date=d2" / "part-00002.parquet"
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    for row in rows:
        values[row] = [*values[row][:-1], values[row][-1] + 1]
    table = table.set_column(table.schema.get_field_index(column), column, pa.array(values))
    pq.write_table(table, path)
    return copy


def _inside_sessions(path: Path, count: int) -> list[int]:
    """Rows of ``path`` that are not their session's first, in different sessions."""
    ids = pq.read_table(path, columns=["session_id"]).column("session_id").to_numpy()
    inside = np.flatnonzero(ids[1:] == ids[:-1]) + 1
    rows, seen = [], set()
    for row in inside.tolist():
        if ids[row] not in seen:
            rows.append(row)
            seen.add(ids[row])
        if len(rows) == count:
            return rows
    raise AssertionError("too few sessions with several samples")


def test_a_user_column_varying_within_a_session_stops_or_is_set_aside(
    recd: Recd, tmp_path: Path
) -> None:
    last = recd.samples / "date=d2" / "part-00002.parquet"
    first, later = _inside_sessions(last, 6)[4:6]
    source = _tampered(recd.samples, tmp_path, column="C2", rows=[later, first])
    ids = pq.read_table(last, columns=["session_id"]).column("session_id").to_numpy()
    with pytest.raises(DataValidationError) as error:
        cluster_data(str(source), _config(source), out=str(tmp_path / "out"), session_columns=USERS)
    message = str(error.value)
    assert f"'C2' is not constant within session {ids[first]}" in message
    assert "part-00002.parquet" in message and f"rows {first - 1} and {first}" in message
    # Nothing of the failed conversion is left (it was left, and refused the rerun into the
    # same directory): the rerun below writes there.
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    # Quarantine: both sessions' samples are set aside, counted and written with the reason.
    quarantine = tmp_path / "quarantine"
    config = _config(source, bad_input="quarantine", quarantine_path=str(quarantine))
    result = cluster_data(str(source), config, out=str(tmp_path / "out"), session_columns=USERS)
    sizes = [int((ids == ids[row]).sum()) for row in (first, later)]
    assert result.quarantined_sessions == 2 and result.quarantined_samples == sum(sizes)
    assert result.num_samples == 3000 - sum(sizes)
    assert quarantine_counts(config)["bad_rows"] == sum(sizes)
    kept = read_rows(str(tmp_path / "out"), config, columns=["session_id"], max_rows=10_000)
    assert not set(kept.column("session_id").to_pylist()) & {ids[first], ids[later]}


def test_inferred_columns_name_a_nearly_constant_one_and_out_stays_out_of_the_source(
    recd: Recd, tmp_path: Path, caplog
) -> None:
    """Inferring the per-session columns, a column that differs within one session is left
    out, as before, but named with that session (it was dropped without a word); an output
    directory inside the source data set (whose files it would join) is refused, as is the
    source inside the output; the partial output of an unfinished run is taken over."""
    last = recd.samples / "date=d2" / "part-00002.parquet"
    (row,) = _inside_sessions(last, 1)
    source = _tampered(recd.samples, tmp_path, column="C2", rows=[row])
    session = pq.read_table(last, columns=["session_id"]).column("session_id")[row].as_py()
    with caplog.at_level(logging.WARNING, logger="raydlrm.ingestion.sessions"):
        result = cluster_data(str(source), _config(source), out=str(tmp_path / "out"))
    assert "C2" not in result.session_columns and "C3" in result.session_columns
    assert "sparse column 'C2' is constant within the sessions" in caplog.text
    # The changed row and the next one of its session differ from the row before them.
    assert re.search(rf"at [12] samples \(the first: session {session}, ", caplog.text)
    for out in (source / "clustered", tmp_path):
        with pytest.raises(ValueError, match="inside one another"):
            cluster_data(str(source), _config(source), out=str(out))
    assert not (source / "clustered").exists()
    partial = tmp_path / "again"
    (partial / "samples" / "date=d1").mkdir(parents=True)
    (partial / "samples" / "date=d1" / "part-00000.parquet").write_bytes(b"cut")
    again = cluster_data(str(source), _config(source), out=str(partial))
    assert again.num_samples == result.num_samples


def test_sessions_must_be_contiguous(recd: Recd, tmp_path: Path) -> None:
    copy = _copy(recd.samples, tmp_path)
    path = copy / "date=d2" / "part-00002.parquet"
    table = pq.read_table(path)
    row = _inside_sessions(path, 1)[0]
    order = np.arange(table.num_rows)
    order[[row, table.num_rows - 1]] = order[[table.num_rows - 1, row]]  # one sample moves away
    pq.write_table(table.take(pa.array(order)), path)
    session = table.column("session_id")[row].as_py()
    with pytest.raises(DataValidationError, match=rf"not contiguous in .*part-00002.*{session}"):
        cluster_data(str(copy), _config(copy), out=str(tmp_path / "out"))


# Reading clustered data: bad input, dictionaries, preprocessing per session.


def _read(path: Path, config: DataConfig, *, shuffle: bool = False) -> list[pa.Table]:
    """Every batch the reader of ``path``'s layout makes of all its row groups (no Ray)."""
    summary = validate_data(str(path), config)
    kind = reader_class(summary.schema)
    reader = kind(
        config,
        source_path=str(path),
        columns=read_columns(config, summary.schema),
        schema=summary.schema,
        seed=3,
        epoch=0,
        shuffle=shuffle,
    )
    refs = pa.Table.from_pylist(
        [
            {"window": [{"group": g.to_dict(), "id": i, "skip": 0}]}
            for i, g in enumerate(summary.row_groups)
        ]
    )
    out = reader(refs)
    return [out] if isinstance(out, pa.Table) else list(out)


def _sample_ids(tables: list[pa.Table]) -> list[int]:
    return [i for t in tables for i in t.column("sample_id").to_pylist()]


def _edit_sessions(copy: Path, edit) -> Path:
    """Applies ``edit`` to row group 1 of the first sessions file of ``copy``; its path."""
    path = copy / "sessions" / "date=d1" / "part-00000.parquet"
    groups = _row_groups(path)
    groups[1] = edit(groups[1])
    _rewrite(path, groups)
    return path


def test_a_sample_without_its_session_row_is_named(recd: Recd, tmp_path: Path) -> None:
    copy = _copy(recd.converted, tmp_path)
    removed: list[int] = []

    def drop(sessions: pa.Table) -> pa.Table:
        removed.append(sessions.column("session_id")[5].as_py())
        return sessions.filter(pa.array(np.arange(sessions.num_rows) != 5))

    sessions = _edit_sessions(copy, drop)
    with pytest.raises(BadInputError) as error:
        _read(copy, _config(copy))
    samples = str(copy / "samples" / "date=d1" / "part-00000.parquet")
    assert f"{samples}, row group 1, row " in str(error.value)
    assert f"session {removed[0]} has no row in the sessions file {sessions}" in str(error.value)
    config = _config(copy, bad_input="quarantine", quarantine_path=str(tmp_path / "q"))
    ids = _sample_ids(_read(copy, config))
    group = pq.ParquetFile(samples).read_row_group(1)
    lost = group.filter(pc.equal(group.column("session_id"), removed[0]))
    assert quarantine_counts(config)["bad_rows"] == lost.num_rows > 0
    assert sorted(ids + lost.column("sample_id").to_pylist()) == list(range(3000))


def test_a_bad_user_id_is_found_once_per_session(recd: Recd, tmp_path: Path) -> None:
    copy = _copy(recd.converted, tmp_path)
    samples = copy / "samples" / "date=d1" / "part-00000.parquet"
    ids = pq.ParquetFile(samples).read_row_group(1).column("session_id").to_numpy()
    sessions_of_group = list(dict.fromkeys(ids.tolist()))
    # A session of several samples, not cut by the row group's boundaries.
    at = next(i for i, s in enumerate(sessions_of_group[1:-1], 1) if (ids == s).sum() > 1)

    def null_id(sessions: pa.Table) -> pa.Table:
        histories = sessions.column("C1").to_pylist()
        histories[at] = [None, *histories[at][1:]]
        field = sessions.schema.get_field_index("C1")
        return sessions.set_column(field, "C1", pa.array(histories, sessions.schema.field(1).type))

    sessions = _edit_sessions(copy, null_id)
    with pytest.raises(BadInputError) as error:
        _read(copy, _config(copy))
    assert f"{sessions}, row group 1, row {at}: sparse column 'C1': null id" in str(error.value)
    assert f"(session {sessions_of_group[at]})" in str(error.value)
    config = _config(copy, bad_input="quarantine", quarantine_path=str(tmp_path / "q"))
    kept = _sample_ids(_read(copy, config))
    lost = int((ids == sessions_of_group[at]).sum())
    assert quarantine_counts(config)["bad_rows"] == lost  # the whole session, checked once
    assert len(kept) == 3000 - lost


def _unique_rows(group) -> set:
    """The unique rows of a dedup group as a set of per-feature id tuples."""
    kjt = group.unique
    bags = kjt.values.split(kjt.lengths.tolist())
    rows = [[] for _ in range(kjt.batch_size)]
    for f in range(len(kjt.keys)):
        for b in range(kjt.batch_size):
            rows[b].append(tuple(bags[f * kjt.batch_size + b].tolist()))
    return {tuple(r) for r in rows}


@pytest.mark.parametrize(
    "groups", [[USERS], [["C1", "C5"], ["C2", "C3"]]], ids=["users", "mixed-group"]
)
def test_dedup_groups_from_dictionaries_equal_the_key_based_ones(
    recd: Recd, groups: list[list[str]]
) -> None:
    """Unshuffled, both layouts read the same rows in the same order: the batches' dedup groups
    (from dictionaries for a group of per-session columns, from row keys otherwise) hold the
    same unique rows and expand to the same rows."""
    config = _config(recd.samples, dedup_groups=groups)
    plain = pa.concat_tables(_read(recd.samples, config))
    clustered = _read(recd.converted, config)
    assert all(t.num_rows == BATCH for t in clustered[:2])
    start = 0
    for table in clustered[:6]:
        ours = arrow_to_batch(table, config=config)
        theirs = arrow_to_batch(plain.slice(start, table.num_rows), config=config)
        start += table.num_rows
        torch.testing.assert_close(ours.sample_ids, theirs.sample_ids)
        torch.testing.assert_close(ours.labels, theirs.labels)
        torch.testing.assert_close(ours.dense, theirs.dense)
        all_ours, all_theirs = ours.all_sparse(), theirs.all_sparse()
        assert all_ours.keys == all_theirs.keys
        torch.testing.assert_close(all_ours.values, all_theirs.values)
        torch.testing.assert_close(all_ours.lengths, all_theirs.lengths)
        for mine, key_based in zip(ours.dedup_groups, theirs.dedup_groups, strict=True):
            assert _unique_rows(mine) == _unique_rows(key_based)
            assert mine.unique.batch_size == key_based.unique.batch_size < table.num_rows
    dictionary = clustered[0].schema.field("C1").type
    assert pa.types.is_dictionary(dictionary) and ("dedup:0" in clustered[0].column_names) == (
        groups != [USERS]
    )


def _session_reader(
    recd: Recd, config: DataConfig, summary, *, seed: int, window_rows: int = 0
) -> SessionGroupReader:
    """A shuffling reader of the converted data set's epoch 0."""
    return SessionGroupReader(
        config,
        source_path=str(recd.converted),
        columns=read_columns(config, summary.schema),
        schema=summary.schema,
        seed=seed,
        epoch=0,
        shuffle=True,
        window_rows=window_rows,
    )


def test_user_columns_are_preprocessed_once_per_session(recd: Recd) -> None:
    config = _config(recd.converted, dedup_groups=[USERS])
    summary = validate_data(str(recd.converted), config)
    reader = _session_reader(recd, config, summary, seed=0)
    group = summary.row_groups[0]
    rows = reader._rows(group)
    sessions = pq.ParquetFile(group.sessions_file).read_row_group(group.index)
    # The hashed user histories: one row per session of the row group, not per sample.
    assert rows.sessions.num_rows == sessions.num_rows < rows.num_rows == group.num_rows
    assert rows.sessions.column_names == USERS
    # Each batch's dictionary holds exactly its sessions (in order of their first sample),
    # its indices each sample's.
    column = rows.batch(BATCH, 2 * BATCH).column("C1").chunk(0)
    used = rows.session_of[BATCH : 2 * BATCH]
    firsts = used[np.concatenate([[True], used[1:] != used[:-1]])]
    assert len(column.dictionary) == _runs(used) == len(firsts)
    expected = rows.sessions.column("C1").combine_chunks().take(pa.array(firsts))
    assert column.dictionary.equals(expected)
    np.testing.assert_array_equal(firsts[column.indices.to_numpy()], used)


def test_a_window_of_clustered_row_groups_mixes_whole_sessions_and_resumes(recd: Recd) -> None:
    """A shuffle window over clustered data: batches of several row groups' sessions (each
    session whole, its user features once per batch), every sample once; resumed after some
    batches, the same remaining batches."""
    config = _config(recd.converted, dedup_groups=[USERS])
    summary = validate_data(str(recd.converted), config)

    def read(skips: dict[int, int]) -> list[pa.Table]:
        reader = _session_reader(recd, config, summary, seed=2, window_rows=10**6)
        refs = [
            {"group": g.to_dict(), "id": i, "skip": skips.get(i, 0)}
            for i, g in enumerate(summary.row_groups)
        ]
        return list(reader(pa.Table.from_pylist([{"window": refs}])))

    batches = read({})
    assert sorted(_sample_ids(batches)) == list(range(3000))
    assert all(b.num_rows == BATCH for b in batches[:-1])  # cut across row groups
    assert len(set(batches[0].column(RG_ID_COLUMN).to_pylist())) >= 4
    session_of = dict(
        zip(
            *pq.read_table(recd.samples, columns=["sample_id", "session_id"]).to_pydict().values(),
            strict=True,
        )
    )
    sessions = [session_of[i] for i in _sample_ids(batches)]
    pieces = Counter([sessions[0]] + [b for a, b in itertools.pairwise(sessions) if a != b])
    assert sum(n > 1 for n in pieces.values()) <= len(summary.row_groups)  # whole, unless cut
    for batch in batches[:3]:  # the dictionary: the batch's sessions, once each
        ids = [session_of[i] for i in batch.column("sample_id").to_pylist()]
        assert len(batch.column("C1").chunk(0).dictionary) == _runs(np.array(ids))
    for done in (1, 7):
        trained = EpochProgress()
        for batch in batches[:done]:
            trained.add(EpochProgress.rows_of(batch))
        rest = read(trained.consumed)
        assert len(rest) == len(batches) - done
        assert all(a.equals(b) for a, b in zip(rest, batches[done:], strict=True))


# The worker sources, through Ray Data.


def _source(path: Path, config: DataConfig, *, seed: int = 5) -> WorkerSource:
    summary = validate_data(str(path), config)
    return WorkerSource(
        summary.row_groups,
        config,
        source_path=str(path),
        rank=0,
        world_size=1,
        seed=seed,
        shuffle=True,
        num_actors=1,
        schema=summary.schema,
    )


def _samples(batches) -> dict[int, tuple]:
    """sample id -> (label, dense values, every feature's ids), over ``batches``."""
    out = {}
    for batch in batches:
        sparse = batch.all_sparse()
        b = batch.batch_size
        bags = sparse.values.split(sparse.lengths.tolist())
        for i, sample in enumerate(batch.sample_ids.tolist()):
            ids = tuple((key, tuple(bags[f * b + i].tolist())) for f, key in enumerate(sparse.keys))
            assert sample not in out
            out[sample] = (float(batch.labels[i]), tuple(batch.dense[i].tolist()), sorted(ids))
    return out


@pytest.mark.ray
def test_clustered_round_trip_through_the_worker_source(recd: Recd, ray_cluster) -> None:
    """Training reads the same samples from both layouts: every sample once, the same hashed
    ids per column, labels and dense values; clustered batches carry the user features
    deduplicated per session, and their row groups for exactly-once accounting."""
    config = _config(recd.samples, dedup_groups=[USERS])
    plain = list(iter_train_batches(_source(recd.samples, config), config=config))
    source = _source(recd.converted, config)
    clustered = list(iter_train_batches(source, config=config, track_rows=True))
    ours = _samples(clustered)
    assert sorted(ours) == list(range(3000))
    assert ours == _samples(plain)
    assert all(b.batch_size <= BATCH for b in clustered)
    assert sum(b.batch_size == BATCH for b in clustered) >= len(clustered) - 6  # one per group
    sessions = sum(b.dedup_groups[0].unique.batch_size for b in clustered)
    assert sessions < 3000 / 3  # ~5 samples per session
    progress = EpochProgress()
    for batch in clustered:
        progress.add(batch.row_groups)
    summary = validate_data(str(recd.converted), config)
    assert progress.totals == {i: g.num_rows for i, g in enumerate(summary.row_groups)}
    assert progress.finished() == set(progress.totals)
    empty = arrow_to_batch(source.empty_table(), config=config)
    assert empty.batch_size == 0 and empty.dedup_groups[0].keys == USERS


@pytest.mark.ray
def test_resume_mid_epoch_on_clustered_data_reads_every_sample_once(
    recd: Recd, ray_cluster
) -> None:
    config = _config(recd.converted, dedup_groups=[USERS])
    whole = [
        b.sample_ids.tolist()
        for b in iter_train_batches(_source(recd.converted, config), config=config)
    ]
    first = _source(recd.converted, config)
    progress = EpochProgress(epoch=0, window_rows=config.shuffle_window_rows)
    trained = []
    for batch in iter_train_batches(first, config=config, track_rows=True):
        progress.add(batch.row_groups)
        trained.append(batch.sample_ids.tolist())
        if len(trained) >= 4 and set(progress.consumed) - progress.finished():
            break  # in the middle of a row group
    resumed = _source(recd.converted, config)
    resumed.start(0, resume=EpochProgress.from_dict(progress.to_dict()), world_size=1)
    rest = [b.sample_ids.tolist() for b in iter_train_batches(resumed, config=config)]
    assert trained + rest == whole  # the same batches, each sample once
    assert Counter(i for ids in trained + rest for i in ids) == Counter(range(3000))


# Dedup groups inferred, and inspection.


def test_infer_dedup_groups(recd: Recd, tmp_path: Path) -> None:
    config = _config(recd.samples, dedup="infer")
    assert infer_dedup_groups(validate_data(str(recd.samples), config), config) == [USERS]
    clustered = validate_data(str(recd.converted), config)
    assert infer_dedup_groups(clustered, config) == [USERS]
    # A table shared by a user column and an item column keeps them out of the group.
    shared = _config(
        recd.samples,
        sparse_specs={"C1": {"table": "t"}, "C5": {"table": "t"}},
    )
    summary = validate_data(str(recd.samples), shared)
    assert infer_dedup_groups(summary, shared) == [["C2", "C3"]]
    no_sessions = dataclasses.replace(config, session_column="visit")
    with pytest.raises(ValueError, match=r"data.dedup = 'infer' needs sessions.*'visit'"):
        infer_dedup_groups(summary, no_sessions)
    single = generate_synthetic(
        SyntheticConfig(**{**SYNTHETIC, "mean_session_length": 1.0, "partitions": []}),
        out_dir=tmp_path / "single",
    )
    summary = validate_data(str(single.train_path), config)
    with pytest.raises(ValueError, match=r"data.session_column: 'session_id' has 0 samples"):
        infer_dedup_groups(summary, config)


def _naive_factor(table: pa.Table, batch: int) -> float:
    factors = []
    for start in range(0, table.num_rows, batch):
        part = table.slice(start, batch)
        occurrences, distinct = 0, set()
        for column in SPARSE:
            for row in part.column(column).to_pylist():
                ids = row if isinstance(row, list) else [row]
                occurrences += len(ids)
                distinct.update((column, i) for i in ids)
        factors.append(occurrences / len(distinct))
    return float(np.mean(factors))


def test_inspect_reports_dedup_factor_user_share_and_constant_columns(recd: Recd) -> None:
    config = _config(recd.samples)
    report = inspect_data(str(recd.samples), config)["recd"]
    assert report["layout"] == "samples" and report["session_column"] == "session_id"
    assert report["session_constant_columns"] == USERS
    assert report["user_columns"] == USERS
    assert report["user_columns_from"] == "constant within sessions"
    raw = pq.read_table(recd.samples)
    lengths = {
        c: sum(len(v) if isinstance(v, list) else 1 for v in raw.column(c).to_pylist())
        for c in SPARSE
    }
    share = sum(lengths[c] for c in USERS) / sum(lengths.values())
    assert report["user_lookup_share"] == pytest.approx(share)
    processed = Preprocessor(config)(
        read_rows(str(recd.samples), config, columns=config.input_columns(), max_rows=10_000)
    )
    assert report["dedup_factor"] == pytest.approx(_naive_factor(processed, BATCH))
    items = batch_dedup_factor(processed, columns=SPARSE[3:], batch_size=BATCH)
    assert report["dedup_factor"] > items  # the user histories repeat within sessions
    clustered = inspect_data(str(recd.converted), config)["recd"]
    assert clustered["layout"] == "clustered"
    assert clustered["user_columns_from"] == "per-session columns of the clustered layout"
    assert clustered["session_constant_columns"] == USERS
    for key in ("dedup_factor", "user_lookup_share"):
        assert clustered[key] == pytest.approx(report[key])


# The synthetic user histories.


def _content_digest(path: Path) -> str:
    """A digest of a Parquet file's values (not of pyarrow's writer metadata)."""
    table = pq.read_table(path)
    digest = hashlib.sha256()
    for name in table.column_names:
        array = table.column(name).combine_chunks()
        digest.update(name.encode())
        if pa.types.is_list(array.type):
            digest.update(np.asarray(array.offsets).tobytes())
            array = array.flatten()
        digest.update(np.asarray(array.is_null()).tobytes())
        digest.update(array.fill_null(0).to_numpy(zero_copy_only=False).tobytes())
    return digest.hexdigest()


def test_default_synthetic_files_are_unchanged(tmp_path: Path) -> None:
    """Pinned before user histories existed: the default config's rows did not change."""
    config = SyntheticConfig(num_train_rows=3000, num_eval_rows=1000, rows_per_file=1500)
    info = generate_synthetic(config, out_dir=tmp_path)
    assert [_content_digest(f) for f in info.train_files + info.eval_files] == [
        "61f4e0351a52453caf4a2ad985841fee4d10d9cb6dd2d827b19d4e0980e759d8",
        "be7e509c67c5c26a02f8abfc6b5dc0cabe8355c258e7991325304bd2d2c77c6f",
        "acb90f345c2d3c0cf7f0facde00fea2ace255549eb42b00d8e5d3517f8b0acc8",
    ]


def test_user_histories_are_per_session_lists(recd: Recd) -> None:
    table = pq.read_table(recd.samples)
    ids = table.column("session_id").to_numpy()
    starts = np.concatenate([[True], ids[1:] != ids[:-1]])
    for column in USERS:
        lists = table.column(column).combine_chunks()
        assert pa.types.is_list(lists.type)
        lengths = lists.value_lengths().to_numpy()[starts]
        assert lengths.min() >= 1 and abs(lengths.mean() - 8) < 0.5  # 1 + Poisson(7)
        values = lists.to_pylist()
        assert all(values[i] == values[i - 1] for i in np.flatnonzero(~starts))
        histories = {tuple(values[i]) for i in np.flatnonzero(starts)}
        assert len(histories) > 0.9 * starts.sum()  # drawn per session
    # Item features stay per sample: they change inside sessions.
    items = table.column("C4").to_numpy()
    assert (items[1:] != items[:-1])[~starts[1:]].mean() > 0.2


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"user_history_length": 0.5}, r"data\.synthetic\.user_history_length must be 0"),
        ({"layout": "clustered", "num_user_features": 0}, r"data\.synthetic\.num_user_features"),
    ],
)
def test_invalid_history_knobs_name_the_key(knobs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**knobs)
