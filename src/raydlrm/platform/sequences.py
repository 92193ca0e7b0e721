"""``raydlrm.build_sequences``: examples with user histories from an interaction log, the
Python API of ``raydlrm data sequences`` (the build itself is
:mod:`raydlrm.ingestion.sequences`, a Ray Data job)."""

from __future__ import annotations

from typing import Any

from raydlrm._logs import configure_api, quiet_libraries
from raydlrm.ingestion.sequences import SequenceInfo, write_sequences
from raydlrm.ingestion.sequences_config import SequenceBuildConfig
from raydlrm.platform.config import JobConfig, load_config
from raydlrm.storage import StorageConfig

__all__ = ["build_sequences"]


def build_sequences(
    log: str | None = None,
    *,
    out: str,
    config: SequenceBuildConfig | dict[str, Any] | None = None,
    storage: StorageConfig | None = None,
    overwrite: bool = False,
    job: JobConfig | None = None,
) -> SequenceInfo:
    """Builds training examples with user histories from the interaction log ``log`` into
    ``out``: ``train/``, ``valid/``, ``test/``, ``items.parquet`` and ``metadata.json`` (see
    :mod:`raydlrm.ingestion.sequences`).

    It runs on the Ray instance this process is connected to, else on the one ``job``'s
    ``[ray]`` section names (by default a new local one, as :func:`raydlrm.train` starts it),
    joined once the log's footers are checked.

    Example: ``raydlrm.build_sequences("data/log", out="data/seq", config={"examples":
    "last"})``.

    Args:
        log: the interaction log, a Parquet file or directory (local or ``s3://``); default:
            ``config.log_path``.
        out: the output directory (local or ``s3://``).
        config: the build's options (``[data.sequence_build]``), a
            :class:`~raydlrm.ingestion.SequenceBuildConfig` or a dict of its fields; default:
            the defaults.
        storage: object-store access of ``log`` and ``out``.
        overwrite: replace an earlier build in ``out``.
        job: the job config whose ``[ray]`` section says which Ray to start or join.

    Returns:
        The counts of the build.

    Raises:
        ValueError: no log is named, or options that do not validate (naming the key).
        DataValidationError, BadInputError, FileExistsError: as
            :func:`~raydlrm.ingestion.write_sequences`.
    """
    import ray
    import ray.data

    from raydlrm.platform.ray_init import init_ray

    configure_api()
    quiet_libraries()  # importing Ray Data set its per-data-set INFO lines going again
    if not isinstance(config, SequenceBuildConfig):
        config = SequenceBuildConfig(**(config or {}))
    log = log or config.log_path
    if log is None:
        raise ValueError("no interaction log: pass log or set data.sequence_build.log_path")
    return write_sequences(
        log,
        out=out,
        config=config,
        storage=storage,
        overwrite=overwrite,
        connect=None if ray.is_initialized() else lambda: init_ray(job or load_config(None)),
    )
