"""Data ingestion: Parquet in, ``Batch`` es out.

Synthetic data (:func:`generate_synthetic`), schema checks (:func:`validate_data`), the Ray Data
pipeline (:func:`build_dataset` with :class:`Preprocessor` on an actor pool) and the worker-side
conversion to :class:`raydlrm.batch.Batch` (:func:`iter_train_batches`, :func:`arrow_to_batch`).
"""

from raydlrm.ingestion.config import DataConfig, SyntheticConfig
from raydlrm.ingestion.dataset import build_dataset, default_num_actors
from raydlrm.ingestion.loader import arrow_to_batch, iter_train_batches
from raydlrm.ingestion.preprocess import Preprocessor, hash_ids, mix64
from raydlrm.ingestion.schema import (
    SAMPLE_ID_COLUMN,
    DataSummary,
    DataValidationError,
    validate_data,
)
from raydlrm.ingestion.synthetic import SyntheticInfo, generate_synthetic, planted_auc

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
    "planted_auc",
    "validate_data",
]
