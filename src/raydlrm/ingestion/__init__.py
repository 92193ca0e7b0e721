"""Data ingestion: Parquet in, ``Batch`` es out.

Synthetic data (:func:`generate_synthetic`), schema checks (:func:`validate_data`), the
per-worker row-group readers (``raydlrm.ingestion.reader``: each training worker reads its own
row groups and preprocesses them with :class:`Preprocessor` on a Ray Data actor pool), a plain
Ray Data pipeline for batch jobs (:func:`build_dataset`) and the conversion to
:class:`raydlrm.batch.Batch` (:func:`iter_train_batches`, :func:`arrow_to_batch`).

The names are loaded lazily (PEP 562): importing one submodule, e.g.
``raydlrm.ingestion.preprocess`` in a Ray Data actor that unpickles :class:`Preprocessor`, runs
this package's ``__init__`` but does not import torch (``loader``) or Ray; that
keeps the start-up of every preprocessing actor (one pool per pass over a data set) short.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raydlrm.ingestion.config import DataConfig, SyntheticConfig
    from raydlrm.ingestion.dataset import build_dataset
    from raydlrm.ingestion.loader import arrow_to_batch, iter_train_batches
    from raydlrm.ingestion.preprocess import Preprocessor, hash_ids, mix64
    from raydlrm.ingestion.reader import default_num_actors
    from raydlrm.ingestion.schema import (
        SAMPLE_ID_COLUMN,
        DataSummary,
        DataValidationError,
        validate_data,
    )
    from raydlrm.ingestion.synthetic import SyntheticInfo, generate_synthetic

# Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "DataConfig": "config",
    "SyntheticConfig": "config",
    "build_dataset": "dataset",
    "default_num_actors": "reader",
    "arrow_to_batch": "loader",
    "iter_train_batches": "loader",
    "Preprocessor": "preprocess",
    "hash_ids": "preprocess",
    "mix64": "preprocess",
    "SAMPLE_ID_COLUMN": "schema",
    "DataSummary": "schema",
    "DataValidationError": "schema",
    "validate_data": "schema",
    "SyntheticInfo": "synthetic",
    "generate_synthetic": "synthetic",
}

__all__ = [
    "SAMPLE_ID_COLUMN",
    "DataConfig",
    "DataSummary",
    "DataValidationError",
    "Preprocessor",
    "SyntheticConfig",
    "SyntheticInfo",
    "arrow_to_batch",
    "build_dataset",
    "default_num_actors",
    "generate_synthetic",
    "hash_ids",
    "iter_train_batches",
    "mix64",
    "validate_data",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
