"""Scoring's bad rows, without Ray: a scoring actor names the file of the first bad row of its
batch (a batch may span files), and the driver finds that row in the file again. Scoring
refuses bad rows whatever data.bad_input says, so no quarantine is suggested."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydlrm.ingestion import Preprocessor, SyntheticConfig, generate_synthetic
from raydlrm.ingestion.badinput import BadInputError, locate_unscorable_row
from raydlrm.ingestion.config import DataConfig
from raydlrm.platform.score_source import PATH_COLUMN, ScoreSource
from raydlrm.platform.scorer import Scorer
from raydlrm.storage import StorageConfig


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    root = tmp_path_factory.mktemp("data")
    config = SyntheticConfig(num_train_rows=300, num_eval_rows=0, max_cardinality=100)
    info = generate_synthetic(config, out_dir=root)
    return pq.read_table(info.train_files[0])


def _with_nan(table: pa.Table, row: int, column: str = "I2") -> pa.Table:
    values = table.column(column).to_pylist()
    values[row] = float("nan")
    index = table.schema.get_field_index(column)
    return table.set_column(index, column, pa.array(values, table.schema.field(column).type))


def test_an_actor_names_the_file_of_the_first_bad_row(rows: pa.Table) -> None:
    data = DataConfig()
    scorer = Scorer.__new__(Scorer)  # the model is not reached: the rows are checked first
    scorer.model, scorer.data, scorer.keep = None, data, []
    scorer.preprocess = Preprocessor(data)
    batch = _with_nan(rows.slice(0, 20), 15)
    paths = ["data/a.parquet"] * 10 + ["data/b.parquet"] * 10  # a batch over two files
    batch = batch.append_column(PATH_COLUMN, pa.array(paths))
    with pytest.raises(BadInputError) as caught:
        scorer(batch)
    assert str(caught.value) == "data/b.parquet: dense column 'I2': NaN or infinite value"


def test_the_driver_names_the_row_group_row_and_column(rows: pa.Table, tmp_path: Path) -> None:
    data = DataConfig()
    good, bad = str(tmp_path / "good.parquet"), str(tmp_path / "bad.parquet")
    pq.write_table(rows, good)
    pq.write_table(_with_nan(rows, 130), bad, row_group_size=100)
    cause = BadInputError(f"{bad}: dense column 'I2': NaN or infinite value")
    columns = [c for c in data.input_columns() if c != data.label_column]
    source = ScoreSource.of(str(tmp_path), StorageConfig(), {})
    assert source.paths == sorted([good, bad]) and source.num_rows == 2 * rows.num_rows
    located = locate_unscorable_row(
        cause, files=source.paths, row_groups=lambda f: source.row_groups(f, columns), config=data
    )
    message = str(located)
    assert message.startswith(
        f"bad input in {bad}, row group 1, row 30: dense column 'I2': NaN or infinite value"
    )
    assert good not in message and "quarantine" not in message and "bad_input" not in message
