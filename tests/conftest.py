"""Shared fixtures: debug-mode batch validation, one local Ray cluster per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAYDLRM_DEBUG", "1")
# Ray Data / Train print progress bars to stderr; keep test logs readable.
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the whole test session (tests marked ``ray``)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            object_store_memory=512 * 1024 * 1024,
            include_dashboard=False,
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped where CUDA is not available (CI, CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
