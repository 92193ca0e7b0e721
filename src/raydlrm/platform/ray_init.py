"""Connecting the driver to Ray: the cluster the job names, or a new local instance.

``ray.address`` (else ``$RAY_ADDRESS``, set by ``ray job submit``) names a cluster, which must
answer on TCP before ``ray.init`` is asked to join it (``ray.init`` retries an unreachable one
for many minutes). Without one, a new local Ray instance starts with settings for a single
machine (:data:`LOCAL_RAY_ENV`, enough CPUs for the workers and Ray Data's tasks, the State API
pinned to its own dashboard), and a reaper process ends it if the driver is killed.

A local instance whose start-up fails (Ray waits a fixed time for its GCS and raylet, which a
busy machine can exceed) leaves the processes it started running: they are stopped and the
start is tried once more, then the job stops with :class:`RayStartError`, one line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from typing import Any

import psutil
import ray

from raydlrm._errors import cause_line
from raydlrm._logs import library_level, quiet_libraries
from raydlrm.platform import _reaper
from raydlrm.platform.config import ConfigError, JobConfig

__all__ = ["LOCAL_RAY_ENV", "RayStartError", "filter_worker_output", "init_ray", "ray_address"]

logger = logging.getLogger(__name__)


class RayStartError(ConfigError):
    """A new local Ray instance did not start, twice (before anything of the job ran)."""


def ray_address(job: JobConfig) -> str:
    """The Ray cluster the job runs on: ``ray.address``, else ``$RAY_ADDRESS``, else ``local``
    (a new Ray instance on this machine)."""
    return job.ray.address or os.environ.get("RAY_ADDRESS") or "local"


# Environment of a new local Ray instance (its raylet and worker processes inherit the
# driver's); a value already in the environment wins.
LOCAL_RAY_ENV = {
    # Ray Data's Parquet reader starts this many footer-reading actors (default 32, each a
    # fresh worker process) on every pass over a data set: on a small machine most of the time
    # before the first batch of every epoch and evaluation. Local files need one.
    "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1",
    # Ray Train's preemption watcher has no preempted nodes to watch on one machine.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Ray Train's controller polls its workers this often (Ray's default 2 s): the poll paces
    # the start of a run, every report (a barrier it releases) and the end; 0.5 s takes about
    # 2 s off a small run (benchmarks/train_overhead.py).
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # Ray starts its worker processes at niceness 15 (below its own raylet and GCS): they then
    # yield the CPU to every other program at the default priority, the driver included. On a
    # workstation or a small machine shared with anything busy, a run slowed down 11x with two
    # busy programs beside it; at 0 it took its fair share (1.9x), and it runs as fast alone
    # (benchmarks/RESULTS.md, "The suite's time"). The training workers are the job here.
    "RAY_worker_niceness": "0",
}
# CPUs a local instance keeps beyond the training workers: a preprocessing actor, read tasks.
_LOCAL_DATA_CPUS = 3


def _local_num_cpus(job: JobConfig) -> int:
    """Logical CPUs of a new local Ray instance: at least the machine's, and enough that the
    training workers, a preprocessing actor and Ray Data's read tasks (1 CPU each) can all be
    scheduled at once. On a 2-core machine the default (2) leaves Ray Data no CPU for its read
    tasks once two 0.5-CPU workers and an actor hold theirs, and the job waits forever."""
    per_worker = job.scaling.resources_per_worker.get("CPU", 1.0)
    training = job.scaling.num_workers * per_worker
    return max(os.cpu_count() or 1, math.ceil(training) + _LOCAL_DATA_CPUS)


# Ray's core logs at ERROR level, once per preprocessing actor a training worker starts, that an
# actor with restarts whose constructor arguments are in the object store may fail to restart
# (ray-project/ray#53727). Ray Data passes every actor pool's arguments that way (its map
# function and context, by reference), so the line shows on every run's first screen and reads
# as a failure; nothing here can pass them by value. It is dropped from what this driver prints
# of the workers' output; Ray's log files keep it.
_DROPPED_WORKER_LINES = ("has constructor arguments in the object store and max_restarts > 0",)

# Ray Train's controller warns with a traceback when a resource request to its autoscaling
# coordinator times out, which "if this only happens transiently during network partition or
# CPU being overloaded" is "safe to ignore" (its own words): on a busy machine a run's screen
# filled with them (20-30 lines each). The warning and its traceback are dropped from what
# this driver prints; Ray's log files keep them.
_DROPPED_WORKER_BLOCKS = ("Failed to send resource request for",)


_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def kept_worker_lines(lines: list[str]) -> list[str]:
    """``lines`` of the workers' output without the dropped lines (:data:`_DROPPED_WORKER_LINES`)
    and dropped warnings with the traceback that follows them (:data:`_DROPPED_WORKER_BLOCKS`:
    its ``Traceback`` lines, indented lines and exception lines, chained ones included)."""
    kept: list[str] = []
    in_block = in_traceback = False
    for line in lines:
        if any(start in line for start in _DROPPED_WORKER_BLOCKS):
            in_block, in_traceback = True, False
            continue
        if in_block:
            if line.startswith("Traceback (most recent call last)"):
                in_traceback = True
                continue
            if in_traceback:  # indented frames, then the exception's own line
                in_traceback = line.startswith((" ", "\t"))
                continue
            if not line.strip() or line.startswith(_CHAINED):
                continue
            in_block = False
        if not any(dropped in line for dropped in _DROPPED_WORKER_LINES):
            kept.append(line)
    return kept


def filter_worker_output() -> None:
    """Drops the lines :func:`kept_worker_lines` drops from the workers' output this
    process prints (Ray's own printer, wrapped; the rest passes unchanged). Idempotent; a Ray
    without that printer is left as it is."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    for name, handle in list(dispatcher.handlers):
        if name != "ray_print_logs" or getattr(handle, "raydlrm_filtered", False):
            continue

        def filtered(data: dict[str, Any], handle: Any = handle) -> None:
            lines = kept_worker_lines(data.get("lines", []))
            if lines:
                handle({**data, "lines": lines})

        filtered.raydlrm_filtered = True  # type: ignore[attr-defined]
        dispatcher.remove_handler(name)
        dispatcher.add_handler(name, filtered)


def init_ray(job: JobConfig) -> None:
    """Connects to the job's Ray cluster or starts a local instance (see the module
    docstring); nothing when Ray is already initialized in this process. The workers' output
    this process prints is filtered (:func:`filter_worker_output`).

    Raises:
        ConfigError: the named cluster does not answer (naming the address and its source).
        RayStartError: a new local instance did not start, tried twice.
    """
    if ray.is_initialized():
        filter_worker_output()
        return
    config = job.ray
    address = ray_address(job)
    kwargs: dict[str, Any] = {}
    if address == "local":
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
        kwargs = {
            "num_cpus": config.num_cpus or _local_num_cpus(job),
            "object_store_memory": config.object_store_memory,
            "include_dashboard": config.include_dashboard,
        }
        port = _pin_state_api()
        quiet_libraries()  # Ray's start-up notices (a Python API call may not have set them)
        if config.include_dashboard is False:
            # Nothing listens on the pinned port: the State API fails (and is quiet) rather
            # than asking another instance.
            kwargs["runtime_env"] = {
                "worker_process_setup_hook": "raydlrm._ray_setup.without_dashboard"
            }
        else:
            kwargs["dashboard_port"] = port
    elif address != "auto":
        _check_reachable(address, source="ray.address" if config.address else "$RAY_ADDRESS")
    kwargs["log_to_driver"] = config.log_to_driver
    kwargs["logging_level"] = library_level()  # "Started a local Ray instance" and the like
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if address == "local":
        _start_local(kwargs)
    else:
        ray.init(address=address, **kwargs)
    filter_worker_output()
    if address == "local":
        _reaper.start()


def _start_local(kwargs: dict[str, Any]) -> None:
    """Starts a new local Ray instance, a second time if the first start timed out (nothing of
    the job has run yet; the failed start's processes are stopped, and what ``ray.init`` set
    up of it undone, first). A start that failed otherwise is not tried again.

    Raises:
        RayStartError: the start failed (twice, for a timeout).
    """
    for attempt in (1, 2):
        before = _ray_processes()
        try:
            ray.init(address="local", **kwargs)
            return
        except (TypeError, ValueError):
            raise  # Ray refused the arguments: no start-up to retry
        except Exception as error:
            # ray.init keeps no handle on what it started before it failed (its GCS, a
            # raylet): they would run, idle, as long as this process.
            with contextlib.suppress(Exception):
                ray.shutdown()
            _reaper.stop(
                (p for key, p in _ray_processes().items() if key not in before), grace_s=5.0
            )
            if not _timed_out(error):
                raise RayStartError(
                    f"Ray did not start: a new local Ray instance failed to start "
                    f"({cause_line(error)}); Ray's logs are under its temporary directory "
                    "(/tmp/ray by default), or set ray.address to a running cluster"
                ) from error
            if attempt == 2:
                raise RayStartError(
                    f"Ray did not start: a new local Ray instance failed to start twice "
                    f"({cause_line(error)}); the machine may be too busy for Ray's start-up "
                    "timeouts: run the command again when it is quieter, or set ray.address "
                    "to a running cluster"
                ) from error
            logger.warning("Ray did not start (%s); trying once more", cause_line(error))


def _timed_out(error: BaseException) -> bool:
    """Whether a failed start timed out (a busy machine: Ray's start-up waits for its GCS,
    its raylet's files, its node's registration), which a second start may get past."""
    text = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in text or "timeout" in text


def _ray_processes() -> dict[tuple[int, float], psutil.Process]:
    """This process's descendants that are Ray's (its binaries and scripts, its workers), by
    pid and start time (a pid can be reused)."""
    package = os.path.dirname(ray.__file__)
    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            if package in " ".join(process.cmdline()) or process.name().startswith("ray::"):
                found[(process.pid, process.create_time())] = process
        except psutil.Error:
            continue
    return found


# The State API address this process pinned for the local instance it started (None: none).
_pinned_state_api: str | None = None


def _pin_state_api() -> int | None:
    """Points the State API of a new local instance at its own dashboard: returns the dashboard
    port to start it on (None: the user's ``$RAY_API_SERVER_ADDRESS`` stands).

    Without an address the State API asks the newest Ray instance on the machine
    (``/tmp/ray/ray_current_cluster``). Ray Train's placement-group cleaner asks it whether the
    run's controller is alive: with another Ray instance on the machine (another user's job, a
    test suite) that instance answers "no such actor", and the cleaner removes the live run's
    placement group, killing its workers. Every Ray process inherits the driver's environment."""
    global _pinned_state_api
    current = os.environ.get("RAY_API_SERVER_ADDRESS")
    if current is not None and current != _pinned_state_api:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _pinned_state_api = os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return port


# How long to wait for a TCP connection to a cluster's address before calling it unreachable.
_CONNECT_TIMEOUT_S = 5.0


def _check_reachable(address: str, *, source: str) -> None:
    """Raises :class:`ConfigError` unless ``address`` (``host:port`` or ``ray://host:port``)
    answers as a Ray cluster does: a TCP connection opens, and a gRPC channel (HTTP/2, which
    the GCS and the Ray client server speak) gets ready. ``ray.init`` retries an unreachable
    GCS for many minutes, and one that is not a GCS (a wrong port, a proxy) for about 20 s of
    warnings and a traceback, instead of failing."""
    scheme, sep, rest = address.rpartition("://")
    if sep and scheme != "ray":
        return  # another client scheme (e.g. anyscale://): ray.init resolves it
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"{source}: {address!r} is not host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"no Ray cluster reachable at {address} ({source}): {e}") from None
    import grpc

    channel = grpc.insecure_channel(rest)
    try:
        grpc.channel_ready_future(channel).result(timeout=_CONNECT_TIMEOUT_S)
    except grpc.FutureTimeoutError:
        raise ConfigError(
            f"no Ray cluster reachable at {address} ({source}): something answers on that "
            "port, but not as Ray does (no gRPC; a wrong port or a proxy?)"
        ) from None
    finally:
        channel.close()
