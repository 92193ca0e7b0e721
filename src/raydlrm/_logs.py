"""How much a run prints: raydlrm's own lines, the libraries' and the training workers'.

Quiet by default: the driver shows raydlrm's progress lines, warnings and the summary; the
training workers and the libraries under them (Ray, Ray Train, Ray Data, MLflow, fbgemm) show
warnings and errors only; their INFO chatter (fbgemm's TBE argument dumps, Ray Data's execution
plans and progress bars, Ray Train's per-report lines) stays out of the way (Ray's own log files
under ``/tmp/ray/session_latest/logs`` still hold Ray's). ``RAYDLRM_LOG_LEVEL`` changes it:
``INFO`` adds the workers' raydlrm lines (one per log step, restores, warm starts), ``DEBUG``
(``raydlrm train --verbose``) everything, the libraries' INFO lines included; ``WARNING`` leaves
warnings and the summary only.

Standard library only at import: the training workers and Ray's worker processes import it.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = [
    "LOG_LEVEL_ENV",
    "configure_api",
    "configure_driver",
    "configure_worker",
    "driver_level",
    "library_level",
    "log_level",
    "quiet_libraries",
    "worker_level",
]

LOG_LEVEL_ENV = "RAYDLRM_LOG_LEVEL"

# Loggers of the libraries a run drives (their INFO lines are chatter to a user). fbgemm's TBE
# logs through the root logger, which the workers' quieting covers.
_LIBRARIES = ("mlflow", "alembic", "ray", "ray.data", "ray.train", "ray.tune", "fbgemm_gpu")

# Loggers whose warnings need no action from the user, kept to errors unless verbose: Ray warns
# on every start of a local instance that it turned on token authentication (its default,
# which raydlrm keeps).
_NOTICES = ("ray._private.authentication.authentication_token_setup",)

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level() -> int | None:
    """The level ``RAYDLRM_LOG_LEVEL`` asks for, None when unset (quiet defaults).

    Raises:
        ValueError: an unknown level name, naming the variable.
    """
    value = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    if not value:
        return None
    if value not in _LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV}={value!r}: expected one of {', '.join(_LEVELS)}")
    return getattr(logging, value)


def driver_level() -> int:
    """raydlrm's own level on the driver: INFO (progress lines) unless asked otherwise."""
    level = log_level()
    return logging.INFO if level is None else level


def worker_level() -> int:
    """raydlrm's level in the training workers: WARNING unless asked otherwise (the driver
    shows progress; a worker's per-step lines would repeat it once per worker)."""
    level = log_level()
    return logging.WARNING if level is None else level


def library_level() -> int:
    """The libraries' level: their INFO lines only at ``DEBUG``."""
    level = log_level()
    return logging.INFO if level is not None and level <= logging.DEBUG else logging.WARNING


def quiet_libraries(level: int | None = None) -> None:
    """Sets the libraries' loggers in this process to ``level`` (default
    :func:`library_level`); their notices to errors unless ``level`` lets INFO through."""
    level = library_level() if level is None else level
    for name in _LIBRARIES:
        logging.getLogger(name).setLevel(level)
    for name in _NOTICES:
        logging.getLogger(name).setLevel(level if level <= logging.INFO else logging.ERROR)


class _DriverFormatter(logging.Formatter):
    """raydlrm's INFO lines as they are (progress, what was written where); everything else
    with its level and logger, so a warning stands out."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and record.name.startswith("raydlrm"):
            return record.getMessage()
        return f"{record.levelname} {record.name}: {super().format(record)}"


def configure_driver(*, verbose: bool = False) -> None:
    """The command line's logging: one stderr handler, raydlrm at :func:`driver_level`, the
    libraries at :func:`library_level`. ``verbose`` sets ``RAYDLRM_LOG_LEVEL=DEBUG`` (for this
    process and the Ray processes it starts).

    Raises:
        ValueError: ``RAYDLRM_LOG_LEVEL`` names no level.
    """
    if verbose:
        os.environ[LOG_LEVEL_ENV] = "DEBUG"
    handler = logging.StreamHandler()
    handler.setFormatter(_DriverFormatter())
    # force: importing fbgemm logs through the root logger, which gives it a default handler.
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("raydlrm").setLevel(driver_level())
    quiet_libraries()


def configure_api() -> None:
    """For the Python API (``raydlrm.train`` in a script): where the application configured no
    logging (neither the root logger nor raydlrm's has a handler), raydlrm's lines (the MLflow
    run, progress, warnings) go to stderr as on the command line, at :func:`driver_level`.
    An application's own logging setup is left as it is."""
    package = logging.getLogger("raydlrm")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(_DriverFormatter())
    package.addHandler(handler)
    package.setLevel(driver_level())


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to ``sys.stderr`` as it is when a line is logged, not as it
    was when the handler was made (a notebook or a test harness replaces and closes it)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_worker(level: int, library: int) -> None:
    """In a training worker (after Ray Train set up its logging): raydlrm's lines at ``level``
    on their own handler, the root logger (fbgemm's TBE dumps its arguments there at INFO) and
    the libraries at ``library``. (Ray Data's per-data-set output is the Ray seam's:
    ``raydlrm.trainers._ray.configure_data_output``.)"""
    package = logging.getLogger("raydlrm")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        package.addHandler(handler)
        package.propagate = False  # Ray's root handler would print every line a second time
    package.setLevel(level)
    logging.getLogger().setLevel(library)
    quiet_libraries(library)
