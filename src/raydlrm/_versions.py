"""Start-up check that torch and fbgemm-gpu are a matching pair.

torch and fbgemm-gpu are released in lock-step; a mismatched pair fails inside fbgemm's
native library with an undefined-symbol error that does not say what is wrong. This module checks
the installed versions against the pinned pairs first and raises a clear message instead.

fbgemm is optional: ``sharding.kernel = "torch"`` (or ``auto`` without a usable fbgemm) runs on
PyTorch operators alone (:mod:`raydlrm.sharding.kernel`), so the lock-step binds only those who
install the ``cpu`` or ``gpu`` extra.
"""

from __future__ import annotations

import functools
from importlib import metadata

# torch release -> the fbgemm-gpu release built against it.
COMPATIBLE_PAIRS: dict[str, str] = {"2.13": "1.8", "2.11": "1.6"}
_FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly")


class IncompatibleVersionsError(ImportError):
    """torch and fbgemm-gpu are not a matching pair."""


def _release(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def installed_fbgemm() -> tuple[str, str] | None:
    """The installed fbgemm-gpu distribution and its version, or None."""
    for dist in _FBGEMM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_versions(
    *, torch_version: str | None = None, fbgemm: tuple[str, str] | None = None
) -> None:
    """Raises :class:`IncompatibleVersionsError` if torch and fbgemm-gpu do not match.

    Args:
        torch_version: the torch version to check (default: the installed one).
        fbgemm: ``(distribution, version)`` to check (default: the installed one).
    """
    if torch_version is None:
        torch_version = metadata.version("torch")
    if fbgemm is None:
        fbgemm = installed_fbgemm()
    if fbgemm is None:
        raise IncompatibleVersionsError(
            "fbgemm-gpu is not installed: install raydlrm with the 'cpu' extra "
            "(fbgemm-gpu-cpu) or the 'gpu' extra (fbgemm-gpu)"
        )
    dist, fbgemm_version = fbgemm
    want = COMPATIBLE_PAIRS.get(_release(torch_version))
    if want is None or _release(fbgemm_version) != want:
        pairs = ", ".join(f"torch {t}.x with fbgemm-gpu {f}.x" for t, f in COMPATIBLE_PAIRS.items())
        raise IncompatibleVersionsError(
            f"torch {torch_version} and {dist} {fbgemm_version} are not a matching pair "
            f"(supported: {pairs}); reinstall with `pip install torch==2.13.0 "
            f"{dist}==1.8.0`"
        )


def import_fbgemm() -> None:
    """Checks the pair, then imports fbgemm-gpu (registering its torch ops)."""
    check_versions()
    import fbgemm_gpu  # noqa: F401


@functools.cache
def fbgemm_problem() -> str | None:
    """Why fbgemm-gpu cannot be used here (missing, mismatched or failing to import), or None
    when it can (it is then imported)."""
    try:
        import_fbgemm()
    except (ImportError, OSError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None
