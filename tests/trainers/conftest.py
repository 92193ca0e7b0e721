"""A small synthetic data set shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydlrm.ingestion import SyntheticConfig, generate_synthetic


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loopdata")
    generate_synthetic(
        SyntheticConfig(
            num_train_rows=640, num_eval_rows=256, rows_per_file=640, max_cardinality=800, seed=3
        ),
        out_dir=root,
    )
    return root
