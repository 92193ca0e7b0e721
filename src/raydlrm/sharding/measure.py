"""What the cost samples and models share: this machine's description and the error measure."""

from __future__ import annotations

import os
import platform

import numpy as np
import torch

__all__ = ["machine_description", "mape"]


def machine_description() -> str:
    """This machine, as the samples and models record it: CPUs, memory, processor, torch."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return (
        f"{os.cpu_count()} CPUs, {memory:.1f} GB RAM, {platform.machine()} "
        f"{platform.processor() or ''}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads".replace("  ", " ")
    )


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error (a fraction)."""
    return float(np.mean(np.abs(predicted - measured) / measured))
