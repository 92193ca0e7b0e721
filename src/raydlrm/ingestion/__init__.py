"""Data ingestion: Parquet in, ``Batch`` es out.

Synthetic data (:func:`generate_synthetic`), schema checks (:func:`validate_data`), the
per-worker row-group readers (``raydlrm.ingestion.reader``: each training worker reads its own
row groups and preprocesses them with :class:`Preprocessor` on a Ray Data actor pool) and the
conversion to :class:`raydlrm.batch.Batch` (:func:`iter_train_batches`, :func:`arrow_to_batch`).

The names are loaded lazily (PEP 562): importing one submodule, e.g.
``raydlrm.ingestion.preprocess`` in a Ray Data actor that unpickles :class:`Preprocessor`, runs
this package's ``__init__`` but does not import torch (``loader``) or Ray; that
keeps the start-up of every preprocessing actor (one pool per pass over a data set) short.
"""

from __future__ import annotations

import importlib
from typing import Any

# The public names by the submodule that defines them; __getattr__ imports that submodule on the
# first use of one of its names.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": ("DataConfig", "SyntheticConfig"),
    "loader": ("arrow_to_batch", "iter_train_batches"),
    "preprocess": ("Preprocessor", "hash_ids", "mix64"),
    "reader": ("default_num_actors",),
    "schema": (
        "SAMPLE_ID_COLUMN",
        "DataSummary",
        "DataValidationError",
        "check_id_kinds",
        "id_kinds_of",
        "validate_data",
    ),
    "synthetic": ("SyntheticInfo", "generate_synthetic"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
