"""Shared fixtures: debug-mode batch validation, one local Ray cluster per test session, S3 and
MLflow servers on loopback, and a check that the session leaves nothing running behind it."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import _leftovers

os.environ.setdefault("RAYDLRM_DEBUG", "1")
# Ray Data / Train print progress bars to stderr; keep test logs readable.
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "0")
# Every Ray instance the session starts (its own cluster, the notebook's, the CLI runs', the
# `ray start` head, the simulated nodes) runs its workers at the driver's priority, as a local
# instance of raydlrm does: at Ray's default niceness (15) they give the CPU to anything else
# busy on the machine, and a Ray test took 11x as long next to two busy processes.
os.environ.setdefault("RAY_worker_niceness", "0")
# Every process this session starts inherits this mark (Ray's workers through its raylet, the
# servers, the notebook's kernel, the CLI runs): what still runs with it at the end was left
# behind (see ``session_leaves_nothing_behind``).
os.environ[_leftovers.MARK] = uuid.uuid4().hex


@pytest.fixture(scope="session", autouse=True)
def session_leaves_nothing_behind() -> Iterator[None]:
    """Fails the run (an error at the last test's teardown) when the session leaves a process,
    a network namespace, a ``tc`` rule or a temporary file of its own behind it: a process
    that inherited this session's mark, a namespace or qdisc of the emulated hosts, a
    ``raydlrm-*`` entry in the temporary directory, anything new in ``/dev/shm``. The
    leftovers are removed after they are named, and so are the ``pymp-*`` directories that
    Ray's dashboards leave (see ``tests/_leftovers.py``). Torn down after every other
    session fixture (it is set up first), so the Ray cluster and the servers are gone by then.
    Beside another test session (``make test`` and ``make test-scenarios`` at once), only
    this session's processes are checked: the rest may be the other session's."""
    before = _leftovers.snapshot()
    alone = not _leftovers.other_sessions()
    yield
    from tests._multiprocess import close_pools

    close_pools()
    alone = alone and not _leftovers.other_sessions()
    left = _leftovers.find(before, alone=alone)
    if alone:
        for stale in _leftovers.multiprocessing_dirs(before):
            shutil.rmtree(stale, ignore_errors=True)
    if left:
        _leftovers.remove(left)
        pytest.fail("the test session left behind:\n" + "\n".join(f"  {x}" for x in left))


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

SERVER_START_S = 120.0


def wait_until_up(
    process: subprocess.Popen,
    request: str | urllib.request.Request,
    *,
    log: Path,
    what: str,
    timeout_s: float = SERVER_START_S,
) -> None:
    """Waits until ``request`` (a URL) answers HTTP 200, failing with ``log``'s tail if
    ``process`` exits or nothing answers within ``timeout_s`` (then ``process`` is killed)."""
    url = request.full_url if isinstance(request, urllib.request.Request) else request
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {process.returncode}: {log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(
                f"{what} did not answer on {url} in {timeout_s}s: {log.read_text()[-3000:]}"
            )
        time.sleep(0.25)


@contextlib.contextmanager
def _served(argv: list[str], health: str, *, log: Path, what: str, **popen) -> Iterator[None]:
    """A server process of ``argv`` (its output in ``log``), up once ``health`` answers,
    stopped at the end."""
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **popen)
    try:
        wait_until_up(process, health, log=log, what=what)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _moto_server(directory: Path) -> Iterator[str]:
    """An S3-compatible server (moto) on loopback, in a process of its own: served from a
    thread of this process (``ThreadedMotoServer``), every upload and download of a test
    competed for this process's GIL with the driver it was testing. Yields its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with _served(argv, f"{endpoint}/moto-api/", log=directory / "moto.log", what="moto server"):
        yield endpoint


def _s3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key=S3_SECRET,
    )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], object]]:
    """An S3-compatible server on loopback (moto, in a process of its own), one per session;
    yields a function that creates a bucket (each test its own name) and returns the
    :class:`StorageConfig` that reaches it."""
    pytest.importorskip("moto.server")
    from raydlrm.storage import StorageConfig

    with _moto_server(tmp_path_factory.mktemp("s3")) as endpoint:
        storage = StorageConfig(
            endpoint_url=endpoint,
            region="us-east-1",
            access_key_id="testing",
            secret_access_key=S3_SECRET,
        )
        client = _s3_client(endpoint)

        def bucket(name: str) -> StorageConfig:
            client.create_bucket(Bucket=name)
            return storage

        yield bucket


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` process on loopback, the way production tracks: runs and the
    model registry in SQLite, artifacts proxied by the server (``mlflow-artifacts:/``) onto an
    S3 bucket of a loopback moto server. Yields the tracking URI (``http://127.0.0.1:<port>``);
    clients need no S3 credentials. The server's job runner (eight processes for MLflow's
    GenAI jobs, which nothing here submits) is off: starting it took the CPU from the tests
    for seconds, and it left its queue in ``/dev/shm``."""
    pytest.importorskip("moto.server")
    root = tmp_path_factory.mktemp("mlflow-server")
    with _moto_server(root) as endpoint:
        _s3_client(endpoint).create_bucket(Bucket="mlflow-artifacts")
        port = free_port()
        env = {
            **os.environ,
            "MLFLOW_S3_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        argv = [
            str(Path(sys.executable).with_name("mlflow")),
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
        ]
        uri = f"http://127.0.0.1:{port}"
        log = root / "server.log"
        with _served(argv, f"{uri}/health", log=log, what="mlflow server", env=env, cwd=root):
            yield uri


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped where CUDA is not available (CI, CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
