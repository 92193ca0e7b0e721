"""Cluster jobs: ``ray job submit`` onto a real Ray cluster, and no cluster at all.

A head node is started the way an operator starts one (``ray start --head``, here on loopback
with ports of its own and token authentication on, the token made by ``ray get-auth-token
--generate``); the training job is submitted with ``ray job submit --working-dir .`` and the
runtime env of ``deploy/runtime_env.yaml``, and its MLflow run and registered model are checked
on a real ``mlflow server``. The head is stopped by its own process, not ``ray stop`` (which
stops every Ray instance of the user): other Ray instances keep running.

Without a reachable cluster, ``raydlrm train`` stops in seconds with one line and exit code 2.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import free_port, wait_until_up

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
# Variables of this test process that would point the cluster or the client elsewhere.
_OUTSIDE_ENV = (
    "RAY_ADDRESS",
    "RAY_API_SERVER_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "MLFLOW_TRACKING_URI",
)
HEAD_START_S = 180.0


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _OUTSIDE_ENV}


@dataclass
class Head:
    """A ``ray start --head --block`` process and what a client needs to reach it."""

    process: subprocess.Popen
    address: str
    """The Jobs API (dashboard) address, ``http://127.0.0.1:<port>``."""
    temp_dir: Path
    token: str
    client_home: Path
    """A HOME whose ``~/.ray/auth_token`` is the cluster's token (Ray's default path)."""
    log: Path

    def client_env(self, **changes: str | None) -> dict[str, str]:
        env = {**_base_env(), "HOME": str(self.client_home), "RAY_AUTH_MODE": "token"}
        env.update({k: v for k, v in changes.items() if v is not None})
        return {k: v for k, v in env.items() if changes.get(k, "") is not None}

    def ray(self, *args: str, timeout: float = 120, **env: str | None):
        """``ray <args> --address <head>`` as a client; stdout and stderr together."""
        return subprocess.run(
            [RAY, *args[:2], "--address", self.address, *args[2:]],
            env=self.client_env(**env),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )

    def processes(self) -> list[psutil.Process]:
        """This head's processes: its session (``ray start`` ran in a session of its own) and
        everything they started, such as job drivers, which get sessions of their own."""
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.process.pid:
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
            except (psutil.Error, OSError):
                continue
        return list(found.values())

    def stop(self) -> list[str]:
        """Stops this head only: SIGTERM to ``ray start --block`` takes down what it started;
        anything still running after that is killed. Returns what had to be killed."""
        processes = self.processes()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # Workers exit on their own once their raylet is gone.
        deadline = time.monotonic() + 30
        while (alive := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        killed = []
        for p in alive:
            try:
                killed.append(p.name())
                p.kill()
            except psutil.Error:
                continue
        return killed


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[Head]:
    """A Ray head node on loopback, token authentication on, stopped afterwards."""
    client_home = tmp_path / "client-home"
    client_home.mkdir()
    made = subprocess.run(
        [RAY, "get-auth-token", "--generate"],
        env={**_base_env(), "HOME": str(client_home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    token_file = client_home / ".ray" / "auth_token"
    token = made.stdout.strip()
    assert len(token) == 64 and token_file.read_text() == token
    # Unix socket paths are limited to ~107 bytes: the temp dir must be short.
    temp_dir = Path(tempfile.mkdtemp(prefix="rj-", dir="/tmp"))
    ports = {
        "--port": free_port(),
        "--dashboard-port": free_port(),
        "--ray-client-server-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    env = {
        **_base_env(),
        # As in an activated venv: a job's `python` is the venv's, as the workers' is.
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_file),
    }
    log = tmp_path / "ray-start.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                "--dashboard-host=127.0.0.1",
                "--include-dashboard=true",
                *(f"{flag}={port}" for flag, port in ports.items()),
                "--num-cpus=4",
                "--num-gpus=0",
                f"--object-store-memory={400 * 1024 * 1024}",
                f"--temp-dir={temp_dir}",
                "--disable-usage-stats",
            ],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    head = Head(
        process=process,
        address=f"http://127.0.0.1:{ports['--dashboard-port']}",
        temp_dir=temp_dir,
        token=token,
        client_home=client_home,
        log=log,
    )
    try:
        _wait_ready(head)
        yield head
    finally:
        head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_ready(head: Head) -> None:
    request = urllib.request.Request(
        f"{head.address}/api/version", headers={"Authorization": f"Bearer {head.token}"}
    )
    wait_until_up(head.process, request, log=head.log, what="ray start", timeout_s=HEAD_START_S)


def _uploaded_packages(head: Head) -> list[Path]:
    root = head.temp_dir / "session_latest" / "runtime_resources" / "working_dir_files"
    return [p for p in root.glob("_ray_pkg_*") if p.is_dir()]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.scenario
@pytest.mark.timeout(1500)
def test_ray_job_submit_trains_registers_and_stops_cleanly(
    ray_head: Head, mlflow_server: str, ray_cluster, tmp_path: Path
) -> None:
    head = ray_head
    from ray.job_submission import JobStatus, JobSubmissionClient

    jobs = JobSubmissionClient(head.address, headers={"Authorization": f"Bearer {head.token}"})

    # Token authentication is on: without token mode the client sends no token (401), with a
    # token that is not the cluster's it is refused (403).
    no_token = head.ray("job", "list", RAY_AUTH_MODE=None)
    assert no_token.returncode != 0 and "Authentication required" in no_token.stdout
    wrong = head.ray("job", "list", RAY_AUTH_TOKEN=secrets.token_hex(32))
    assert wrong.returncode != 0 and "Authentication failed" in wrong.stdout

    runtime_env = yaml.safe_load((REPO / "deploy" / "runtime_env.yaml").read_text())
    runtime_env["env_vars"]["MLFLOW_TRACKING_URI"] = mlflow_server
    upload = ["--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env)]

    # What a job runs: the venv's python, and the raydlrm of the uploaded working directory.
    probe = "import sys, raydlrm; print('probe', sys.executable, raydlrm.__file__)"
    probe_id = "probe"
    submitted = head.ray(
        "job",
        "submit",
        "--no-wait",
        "--submission-id",
        probe_id,
        *upload,
        "--",
        "python",
        "-c",
        probe,
    )
    assert submitted.returncode == 0, submitted.stdout[-3000:]
    logs = head.ray("job", "logs", "--follow", probe_id)
    assert logs.returncode == 0, logs.stdout[-3000:]
    (line,) = [line for line in logs.stdout.splitlines() if line.startswith("probe ")]
    _, executable, module = line.split()
    assert Path(executable).parent == VENV_BIN
    assert Path(module).is_relative_to(head.temp_dir), module
    assert Path(module).parts[-3:] == ("src", "raydlrm", "__init__.py")
    status = head.ray("job", "status", probe_id)
    assert f"Job '{probe_id}' succeeded" in status.stdout, status.stdout[-2000:]

    # `ray job stop` ends a running job.
    sleeper = head.ray(
        "job", "submit", "--no-wait", "--submission-id", "sleeper", "--", "sleep", "600"
    )
    assert sleeper.returncode == 0, sleeper.stdout[-3000:]
    stopped = head.ray("job", "stop", "sleeper")
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    assert jobs.get_job_status("sleeper") == JobStatus.STOPPED

    # Relative paths in a job that runs in Ray's temporary copy of its working directory
    # would put the data, checkpoints and mlflow.db there: refused, naming the key...
    lost = head.ray(
        "job",
        "submit",
        *upload,
        "--",
        "python",
        "-m",
        "raydlrm",
        "train",
        "--config",
        "configs/quickstart.toml",
    )
    assert lost.returncode != 0, lost.stdout[-3000:]
    assert "error: data.train_path: 'data/synthetic/train' is relative" in lost.stdout
    assert "RAYDLRM_BASE_DIR" in lost.stdout
    # ...unless the submitting side says where relative paths go (the README's recipe).
    runtime_env["env_vars"]["RAYDLRM_BASE_DIR"] = str(tmp_path)
    upload = ["--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env)]

    # The training job: blocks until it ends, exit code 0 only if it succeeded.
    model_name = f"ray-job-submit-{uuid.uuid4().hex[:8]}"
    overrides = {
        "data.train_path": "data/train",
        "data.eval_path": "data/eval",
        "data.synthetic.generate": "if_missing",
        "data.synthetic.num_train_rows": 4000,
        "data.synthetic.num_eval_rows": 1000,
        "data.synthetic.rows_per_file": 1000,
        "data.batch_size": 256,
        "data.table_size": 2000,
        "run.storage_path": "runs",
        "run.name": "ray-job-submit",
        "tracking.experiment_name": "ray-job-submit",
        "tracking.registered_model_name": model_name,
    }
    sets = [a for key, value in overrides.items() for a in ("--set", f"{key}={value}")]
    train = ["python", "-m", "raydlrm", "train", "--config", "configs/quickstart.toml", *sets]
    job_id = f"train-{model_name}"
    started = time.monotonic()
    proc = head.ray("job", "submit", "--submission-id", job_id, *upload, "--", *train, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert f"Job '{job_id}' succeeded" in proc.stdout
    print(f"training job: {time.monotonic() - started:.0f}s")
    status = head.ray("job", "status", job_id)
    assert status.returncode == 0 and f"Job '{job_id}' succeeded" in status.stdout
    info = jobs.get_job_info(job_id)
    assert info.status == JobStatus.SUCCEEDED
    listed = head.ray("job", "list")
    assert listed.returncode == 0 and f"submission_id='{job_id}'" in listed.stdout

    # The job's MLflow run and registered model, on the tracking server.
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    versions = client.search_model_versions(f"name='{model_name}'")
    assert len(versions) == 1
    run = client.get_run(versions[0].run_id)
    assert f"MLflow run: {run.info.run_id}" in jobs.get_job_logs(job_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["data.train_rows"] == "4000"
    metrics = run.data.metrics
    assert 0.0 < metrics["eval/auc"] < 1.0
    assert metrics["data/rows_trained"] == metrics["data/rows_read"] == 4000
    # The relative paths landed under RAYDLRM_BASE_DIR, which outlives the job.
    assert list((tmp_path / "data" / "train").glob("*.parquet"))
    assert list((tmp_path / "runs" / "ray-job-submit").glob("checkpoint_*"))

    # The upload: the checkout's code and configs, none of what git ignores.
    packages = _uploaded_packages(head)
    assert packages
    for package in packages:
        names = {p.name for p in package.iterdir()}
        assert {"src", "configs", "deploy", "pyproject.toml"} <= names
        for ignored in (".venv", ".git", ".pytest_cache", ".ruff_cache", "data", "runs"):
            assert ignored not in names
        assert not list(package.glob("src/*.egg-info"))
        size = sum(f.stat().st_size for f in package.rglob("*") if f.is_file())
        assert size < 20 * 1024 * 1024, size

    # Stopping this head stops all of its processes and no other Ray instance's.
    import ray

    ours = head.processes()
    assert {"gcs_server", "raylet"} <= {p.name() for p in ours}
    started = time.monotonic()
    killed = head.stop()
    print(f"head stopped in {time.monotonic() - started:.0f}s; killed after its shutdown: {killed}")
    assert not [p for p in ours if _running(p)]
    # The test session's own Ray instance (the ray_cluster fixture) still runs tasks.
    assert ray.get(ray.remote(lambda: 1).remote()) == 1


TINY = """
[data]
train_path = "data/train"
eval_path = "data/eval"
batch_size = 100
table_size = 500

[data.synthetic]
generate = "if_missing"
num_train_rows = 400
num_eval_rows = 100
rows_per_file = 200
"""


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("no-cluster")
    (workdir / "run.toml").write_text(TINY)
    return workdir


@pytest.mark.parametrize("via", ["config", "RAY_ADDRESS", "not-ray"])
def test_train_without_a_reachable_cluster_fails_fast_with_one_line(
    via: str, tiny_job: Path
) -> None:
    """Nothing listens at the address, or (``not-ray``) an HTTP server does, as a wrong port or
    a proxy would: one line, exit 2, in seconds, not ray.init's retries and a traceback."""
    import http.server
    import threading

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    argv = [sys.executable, "-m", "raydlrm", "train", "--config", "run.toml"]
    env = _base_env()
    server = None
    if via == "not-ray":
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), http.server.BaseHTTPRequestHandler
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        address = f"127.0.0.1:{server.server_address[1]}"
    if via in ("config", "not-ray"):
        argv += ["--set", f"ray.address={address}"]
        source = "ray.address"
    else:
        address = f"ray://{address}"
        env["RAY_ADDRESS"] = address
        source = "$RAY_ADDRESS"
    started = time.monotonic()
    try:
        proc = subprocess.run(
            argv, cwd=tiny_job, env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        if server is not None:
            server.shutdown()
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no Ray cluster reachable at {address} ({source}): "), last
    assert "Traceback" not in proc.stderr
    # ray.init would retry for many minutes; the check gives up in seconds (the rest is start-up).
    assert elapsed < 90, elapsed
    # Stopped before anything started: no MLflow run.
    assert not (tiny_job / "mlflow.db").exists()
