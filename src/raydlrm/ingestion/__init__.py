"""Data ingestion: Parquet in, ``Batch`` es out.

Synthetic data (:func:`generate_synthetic`), user histories from an interaction log
(:func:`write_sequences`, on Ray Data), session-clustered data sets for RecD
(:func:`cluster_data`, :func:`infer_dedup_groups`), schema checks (:func:`validate_data`), the
per-worker row-group readers (``raydlrm.ingestion.reader``: each training worker reads its own
row groups and preprocesses them with :class:`Preprocessor` on a Ray Data actor pool) and the
conversion to :class:`raydlrm.batch.Batch` (:func:`iter_train_batches`, :func:`arrow_to_batch`).

The names are loaded lazily (PEP 562): importing one submodule, e.g.
``raydlrm.ingestion.preprocess`` in a Ray Data actor that unpickles :class:`Preprocessor`, runs
this package's ``__init__`` but does not import torch (``loader``) or Ray; that
keeps the start-up of every preprocessing actor (one pool per pass over a data set) short.
"""

from __future__ import annotations

from raydlrm._lazy import lazy_exports

# The public names by the submodule that defines them (imported on first use).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "clustered": (
        "data_bytes",
        "read_rows",
    ),
    "clustering": (
        "ClusterResult",
        "cluster_data",
    ),
    "config": ("DataConfig",),
    "dedup": ("infer_dedup_groups",),
    "loader": (
        "arrow_to_batch",
        "iter_train_batches",
    ),
    "preprocess": (
        "Preprocessor",
        "hash_ids",
        "mix64",
    ),
    "reader": (
        "default_num_actors",
        "time_order",
    ),
    "schema": (
        "SAMPLE_ID_COLUMN",
        "DataSummary",
        "DataValidationError",
        "check_id_kinds",
        "id_kinds_of",
        "validate_data",
    ),
    "sequence_specs": ("SequenceSpec",),
    "sequences": (
        "SequenceInfo",
        "write_sequences",
    ),
    "sequences_config": ("SequenceBuildConfig",),
    "stats": (
        "compute_bucket_boundaries",
        "compute_dense_fill_values",
        "compute_dense_stats",
        "training_statistics",
    ),
    "synthetic": (
        "SyntheticInfo",
        "generate_synthetic",
    ),
    "synthetic_churn": ("ChurnStats",),
    "synthetic_config": (
        "ChurnConfig",
        "SequencesConfig",
        "SyntheticConfig",
    ),
    "synthetic_sequences": ("SequenceStats",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
