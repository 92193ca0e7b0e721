"""Shared fixtures: debug-mode batch validation, one local Ray cluster per test session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
        from raydlrm.platform.ray_init import LOCAL_RAY_ENV

        # Set as raydlrm sets them for a local instance it starts (its processes inherit them).
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
        # No dashboard: the cluster's processes (which inherit the environment at ray.init)
        # point the State API where nothing answers, so that Ray Train's placement-group
        # cleaner cannot ask another Ray instance on the machine (which knows no such
        # controller) and remove a live test run's workers. Subprocesses do not inherit it.
        previous = os.environ.get("RAY_API_SERVER_ADDRESS")
        os.environ["RAY_API_SERVER_ADDRESS"] = "http://127.0.0.1:9"
        try:
            ray.init(
                address="local",
                num_cpus=4,
                object_store_memory=512 * 1024 * 1024,
                include_dashboard=False,
                log_to_driver=False,
            )
        finally:
            if previous is None:
                del os.environ["RAY_API_SERVER_ADDRESS"]
            else:
                os.environ["RAY_API_SERVER_ADDRESS"] = previous
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def no_fbgemm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory that, first on a process's ``PYTHONPATH``, makes ``import fbgemm_gpu`` fail
    there (and in the Ray processes it starts): a machine without fbgemm."""
    package = tmp_path_factory.mktemp("no_fbgemm") / "fbgemm_gpu"
    package.mkdir()
    (package / "__init__.py").write_text('raise ImportError("fbgemm_gpu made unimportable")\n')
    return str(package.parent)


def free_port() -> int:
    """A TCP port free on loopback at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


S3_SECRET = "s3cr3t-do-not-log"
"""The loopback S3 server's secret key: tests check it never reaches a log."""


@pytest.fixture(scope="module")
def s3_server():
    """An S3-compatible server on loopback (moto's ``ThreadedMotoServer``); yields a function
    that creates a bucket and returns the :class:`StorageConfig` that reaches it."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    from raydlrm.storage import StorageConfig

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
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


MLFLOW_SERVER_START_S = 120.0


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real ``mlflow server`` process on loopback, the way production tracks: runs and the
    model registry in SQLite, artifacts proxied by the server (``mlflow-artifacts:/``) onto an
    S3 bucket of a loopback moto server. Yields the tracking URI (``http://127.0.0.1:<port>``);
    clients need no S3 credentials."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    root = tmp_path_factory.mktemp("mlflow-server")
    s3 = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    s3.start()
    host, s3_port = s3.get_host_and_port()
    endpoint = f"http://{host}:{s3_port}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key=S3_SECRET,
    ).create_bucket(Bucket="mlflow-artifacts")
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    log = (root / "server.log").open("w")
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    process = subprocess.Popen(
        [
            str(mlflow_bin),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            "s3://mlflow-artifacts/artifacts",
            "--workers",
            "1",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=root,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + MLFLOW_SERVER_START_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"mlflow server exited with {process.returncode}: "
                f"{(root / 'server.log').read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"mlflow server did not answer on {uri} in {MLFLOW_SERVER_START_S}s")
        time.sleep(0.5)
    yield uri
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()
    s3.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped where CUDA is not available (CI, CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
