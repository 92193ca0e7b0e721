"""A validation set carved out of the training data (``data.valid_split``).

The split is by whole row groups, the unit the readers are dealt, so that no validation row
trains and nothing is read twice: ``time`` holds out the latest row groups (in the order of
``data.time_column``'s per-row-group minimum, else the file order: the last files of a log
written day by day), ``random`` row groups drawn with a fixed seed, the same for every
``training.seed`` (seeds are then compared on one validation set). Either takes row groups until
they hold ``data.valid_fraction`` of the rows. Both parts keep the data set's file order, so a
checkpoint's position and file list (:mod:`raydlrm.ingestion.epoch_files`) mean what they meant.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from raydlrm.ingestion.config import DataConfig
from raydlrm.ingestion.reader import time_order
from raydlrm.ingestion.schema import DataSummary, DataValidationError

__all__ = ["SPLIT_SEED", "carve_validation"]

SPLIT_SEED = 20_261_128
"""The seed of ``random`` splits (fixed: the same validation rows for every training seed)."""


def carve_validation(train: DataSummary, config: DataConfig) -> tuple[DataSummary, DataSummary]:
    """``train`` cut into (training, validation) by ``config.valid_split`` (see the module).

    Raises:
        DataValidationError: the training data has too few row groups for the split, named
            with the path, its row groups and the keys to change.
    """
    groups = train.row_groups
    if config.valid_split == "time":
        candidates = time_order(groups)[::-1]  # the latest first
    else:
        candidates = np.random.default_rng(SPLIT_SEED).permutation(len(groups)).tolist()
    wanted = math.ceil(config.valid_fraction * train.num_rows)
    held: set[int] = set()
    rows = 0
    for i in candidates:
        if rows >= wanted:
            break
        held.add(i)
        rows += groups[i].num_rows
    if len(held) >= len(groups):
        raise DataValidationError(
            f"data.valid_split = {config.valid_split!r}: the training data at {train.path!r} has "
            f"{len(groups)} row group(s); {config.valid_fraction:g} of its rows "
            "(data.valid_fraction) would leave none to train on. The split is by whole row "
            "groups: write smaller row groups, lower data.valid_fraction, or give "
            "data.valid_path"
        )
    kept = [g for i, g in enumerate(groups) if i not in held]
    valid = [g for i, g in enumerate(groups) if i in held]
    return _part(train, kept), _part(train, valid)


def _part(summary: DataSummary, groups: list) -> DataSummary:
    """``summary`` restricted to ``groups`` (in its order)."""
    return dataclasses.replace(
        summary,
        num_rows=sum(g.num_rows for g in groups),
        num_files=len({g.file for g in groups}),
        row_groups=groups,
    )
