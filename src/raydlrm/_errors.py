"""One line for an error: what a failed run shows its user.

Errors raised inside Ray workers and Ray Data actors reach the driver as text (Ray Train's
worker-group errors carry the workers' tracebacks; Ray Data wraps a UDF's error in
``UserCodeException: UDF failed to process a data block``). The line to show is the innermost
``SomeError: message`` line, preferring an error that names its culprit (file, row group, row,
column).

Ray Train cuts each worker's error in its message to the first and last 500 characters, which
drops the middle of a long traceback: the chained cause (a ``BadInputError`` wrapped by Ray
Data) sits there. The error also carries every worker's whole error (``worker_failures``, and
``controller_failure`` for a controller error), which is read instead of the message.
"""

from __future__ import annotations

import re
import traceback

__all__ = ["cause_line"]

_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")
_NAMING_ERRORS = ("BadInputError", "DataValidationError")


def _full_text(exc: BaseException) -> str:
    """``exc``'s text, or for a Ray Train error the whole text of every worker's (or the
    controller's) error, which its message only quotes cut short."""
    failures = getattr(exc, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        return "\n".join(_printed(e) for _, e in sorted(failures.items()))
    controller = getattr(exc, "controller_failure", None)
    if isinstance(controller, BaseException):
        return _printed(controller)
    return str(exc)


def _printed(exc: BaseException) -> str:
    """``exc`` as Python prints its last line(s), ``Name: message`` (a worker's exception
    reaches the driver as the object, whose text lacks its name), after its chained causes."""
    text = "".join(traceback.format_exception_only(type(exc), exc))
    cause = exc.__cause__ or exc.__context__
    return text if cause is None or cause is exc else f"{_printed(cause)}\n{text}"


def cause_line(exc: BaseException) -> str:
    """``ErrorName: message`` of the innermost error line of ``exc``'s text, a bad-input error's
    when there is one; else the type and the first line of the text."""
    matches = [m for m in map(_ERROR_LINE.match, _full_text(exc).splitlines()) if m]
    naming = [m for m in matches if m.group(1) in _NAMING_ERRORS]
    if naming or matches:
        found = (naming or matches)[-1]
        return f"{found.group(1)}: {found.group(2).strip()}"
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
