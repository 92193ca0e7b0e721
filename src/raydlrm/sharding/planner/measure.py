"""What the cost samples and models share: this machine's description and the error measure."""

from __future__ import annotations

import os
import platform

import numpy as np
import torch

__all__ = ["check_device", "machine_description", "mape", "synchronize"]


def machine_description(device: str = "cpu") -> str:
    """This machine, as the samples and models record it: CPUs, memory, processor, torch, and
    the GPU where ``device`` is ``cuda``."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    gpu = f", {torch.cuda.get_device_name(0)}" if device == "cuda" else ""
    return (
        f"{os.cpu_count()} CPUs, {memory:.1f} GB RAM, {platform.machine()} "
        f"{platform.processor() or ''}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads{gpu}".replace("  ", " ")
    )


def check_device(device: str) -> None:
    """Raises ValueError unless the cost measurements can run on ``device`` here (``cpu``, or
    ``cuda`` with a CUDA device)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"cost measurements run on cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "scaling.use_gpu is true but this machine has no CUDA device: measure the GPU "
            "workers' costs on a GPU node (raydlrm plan there)"
        )


def synchronize(device: str) -> None:
    """Waits for ``device``'s queued work (a timed GPU step ends when its kernels do)."""
    if device == "cuda":
        torch.cuda.synchronize()


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error (a fraction)."""
    return float(np.mean(np.abs(predicted - measured) / measured))
