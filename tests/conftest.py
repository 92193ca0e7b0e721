"""Shared fixtures: debug-mode batch validation, one local Ray cluster per test session."""

from __future__ import annotations

import os
import socket

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


S3_SECRET = "s3cr3t-do-not-log"
"""The loopback S3 server's secret key: tests check it never reaches a log."""


@pytest.fixture(scope="module")
def s3_server():
    """An S3-compatible server on loopback (moto's ``ThreadedMotoServer``); yields a function
    that creates a bucket and returns the :class:`StorageConfig` that reaches it."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    from raydlrm.ingestion.storage import StorageConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    host, port = server.get_host_and_port()
    storage = StorageConfig(
        endpoint_url=f"http://{host}:{port}",
        region="us-east-1",
        access_key_id="testing",
        secret_access_key=S3_SECRET,
    )
    client = boto3.client(
        "s3",
        endpoint_url=storage.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key=S3_SECRET,
    )

    def bucket(name: str) -> StorageConfig:
        client.create_bucket(Bucket=name)
        return storage

    yield bucket
    server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped where CUDA is not available (CI, CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
