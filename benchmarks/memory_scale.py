"""Peak resident memory of ``raydlrm train``, ``export`` and ``score`` against model size.

Runs the command line (``python -m raydlrm train --config configs/quickstart.toml --set ...``)
as a subprocess, once per (workers, rows per table): ``data.table_size`` rows per table,
``model.embedding_dim`` ``--dim`` (and the last layer of ``model.bottom_mlp``, which a DLRM's
dot interaction needs equal to it), ``training.max_steps`` ``--max-steps``,
``scaling.num_workers`` workers of ``resources_per_worker = {CPU = --cpus-per-worker}``, on
one synthetic data set generated once beforehand (``raydlrm data generate``, the config's
``[data.synthetic]`` or ``--train-rows``/``--eval-rows``; not measured). Each run has its own
working directory (``runs/`` storage, ``mlflow.db`` tracking store, a registered model) and
starts its own local Ray instance. Then ``raydlrm export`` of the run's final checkpoint to a
directory, and ``raydlrm score`` of the exported model over the eval data, each measured the
same way.

A thread polls every ``--interval`` s (default 0.2) the processes of the command: the CLI
process, all its descendants (``psutil``: a local Ray instance's GCS server and raylet are the
driver's children, every Ray worker process the raylet's), and any process whose initial
environment carries a tag variable set for the run. For each it reads ``/proc/<pid>/status``
``VmHWM`` (the process's peak resident set since it started: the last value read before it
exits is its peak, unless it grew in the last poll interval; mapped file pages included),
``RssAnon`` (its anonymous memory, the largest value polled: what it holds of its own, without
the page cache's pages of files it maps, e.g. ``ssd`` tables) and ``VmRSS`` (the sum over all
processes at one poll, whose maximum is the tree's "peak concurrent RSS"; shared pages such as
libraries and the object store's shared memory count once per process). Processes are
classified by their titles (Ray's ``setproctitle`` in ``/proc/<pid>/cmdline``; a process's
titles change, ``ray::IDLE`` -> ``ray::RayTrainWorker`` -> ``ray::RayTrainWorker.method``, and
all titles seen are kept): driver (the CLI process), Ray Train workers (``ray::RayTrainWorker``;
the rank from Ray Train's own log line ``(ip=..., pid=P) world_rank=R`` in the driver's stderr,
with ``RAY_DEDUP_LOGS=0``), the Train controller, Ray Data (``MapWorker``, ``DatasetManager``,
``SplitCoordinator``, ``_StatsActor``, ...), Ray system processes (``gcs_server``, ``raylet``,
dashboard, agents) and other Ray workers.

Each command's disk use is sampled with its processes (``shutil.disk_usage`` of the working
directory's disk, i.e. ``df``): the used bytes at its start and their peak above that.

Prints one line per run and a Markdown table: fp32 embedding bytes (tables x rows x dim x 4,
the tables of ``WorkerSpec.tables()``), peak RSS of the driver, of each worker (by rank), of
the largest Ray Data actor, peak concurrent RSS of the whole tree, peak RSS of ``export`` and of
``score`` (its driver and its largest scoring actor), wall seconds and exit codes. A failed
command records its exit code and the tail of its stderr and the benchmark goes on. Writes
every figure, and every process measured, to ``--out`` (JSON).

    .venv/bin/python benchmarks/memory_scale.py --workers 1,2,3 --table-sizes 100000,500000 \
        --dim 64 --max-steps 20 --out /tmp/raydlrm-memory-scale.json
    .venv/bin/python benchmarks/memory_scale.py --workers 1,2 --table-sizes 20000 --max-steps 5 \
        --train-rows 20000 --eval-rows 5000   # a smoke test, about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
TAG_ENV = "RAYDLRM_MEMORY_SCALE_TAG"
GB = 1e9
TAIL_CHARS = 3000
# Ray Train's controller logs the worker group: "- (ip=10.0.0.1, pid=5020) world_rank=0, ...".
_RANK_LINE = re.compile(r"pid=(\d+)\)\s+world_rank=(\d+)")
# The worker's own line, in case the controller's is missing: "(RayTrainWorker pid=5020)
# Setting up process group for: env:// [rank=0, world_size=2]".
_RANK_LINE_WORKER = re.compile(r"RayTrainWorker pid=(\d+)\).*\[rank=(\d+), world_size=")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DATA_TITLES = (
    "MapWorker",
    "DatasetManager",
    "SplitCoordinator",
    "_StatsActor",
    "ActorLocationTracker",
    "AutoscalingCoordinator",
    "ReadParquet",
    "Read",
    "Write",
    "ListFiles",
    "FooterReader",
)
_SYSTEM_NAMES = ("gcs_server", "raylet")
_SYSTEM_TITLES = (
    "ray-dashboard",
    "dashboard/",
    "DashboardAgent",
    "RuntimeEnvAgent",
    "autoscaler",
    "log_monitor",
    "monitor.py",
    "multiprocessing.",
)


def _status(pid: int) -> dict[str, Any] | None:
    """Name, VmHWM, VmRSS and RssAnon (kB) of a live process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found: dict[str, Any] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Name":
            found["name"] = value.strip()
        elif key in ("VmHWM", "VmRSS", "RssAnon"):
            found[key] = int(value.split()[0])
    return found


def _title(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part for part in raw.decode(errors="replace").split("\0") if part).strip()


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, names the process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _has_tag(pid: int, tag: str) -> bool:
    try:
        return f"{TAG_ENV}={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


class Poller(threading.Thread):
    """Polls the peak RSS of a process, its descendants and the processes carrying a tag."""

    def __init__(self, root: int, tag: str, interval: float, disk_path: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.tag, self.interval = root, tag, interval
        self.procs: dict[tuple[int, int], dict[str, Any]] = {}
        self.max_total_kb = 0
        self.max_total_at_s = 0.0
        self.polls = 0
        self._foreign: set[tuple[int, int]] = set()
        self._done = threading.Event()
        self._t0 = time.monotonic()
        # The disk of the command's working directory: used bytes at the start and their peak.
        self.disk_path = disk_path
        self.disk_start = self.disk_peak = shutil.disk_usage(self.disk_path).used
        self.disk_peak_at_s = 0.0

    def stop(self) -> None:
        self._done.set()
        self.join()

    def _members(self) -> set[int]:
        pids = {self.root}
        with contextlib.suppress(psutil.Error):
            pids.update(p.pid for p in psutil.Process(self.root).children(recursive=True))
        for pid in psutil.pids():  # tagged processes outside the tree (none seen so far)
            if pid in pids:
                continue
            key = (pid, _start_ticks(pid) or 0)
            if key in self.procs:
                pids.add(pid)
            elif key not in self._foreign:
                if _has_tag(pid, self.tag):
                    pids.add(pid)
                else:
                    self._foreign.add(key)
        return pids

    def poll(self) -> None:
        now = time.monotonic() - self._t0
        total = 0
        for pid in self._members():
            ticks = _start_ticks(pid)
            status = _status(pid)
            if ticks is None or status is None or "VmHWM" not in status:
                continue  # gone, or a zombie
            rec = self.procs.setdefault(
                (pid, ticks),
                {"pid": pid, "name": status.get("name", ""), "titles": [], "first_s": now},
            )
            title = _title(pid)
            if title and title not in rec["titles"]:
                rec["titles"].append(title)
            rec["name"] = status.get("name", rec["name"])  # a fork's name changes on exec
            rec["hwm_kb"] = max(rec.get("hwm_kb", 0), status["VmHWM"])
            rec["anon_kb"] = max(rec.get("anon_kb", 0), status.get("RssAnon", 0))
            rec["last_s"] = now
            total += status.get("VmRSS", 0)
        self.polls += 1
        if total > self.max_total_kb:
            self.max_total_kb, self.max_total_at_s = total, now
        used = shutil.disk_usage(self.disk_path).used
        if used > self.disk_peak:
            self.disk_peak, self.disk_peak_at_s = used, now

    def run(self) -> None:
        while not self._done.is_set():
            self.poll()
            self._done.wait(self.interval)
        self.poll()


def _ranks(stderr: str) -> dict[int, int]:
    """pid -> world rank of the Ray Train workers, from the run's log (the last group wins)."""
    text = _ANSI.sub("", stderr)
    ranks = {int(p): int(r) for p, r in _RANK_LINE_WORKER.findall(text)}
    ranks.update({int(p): int(r) for p, r in _RANK_LINE.findall(text)})
    return ranks


def _role(rec: dict[str, Any], driver: int, ranks: dict[int, int]) -> str:
    titles = " ".join(rec["titles"])
    if rec["pid"] == driver:
        return "driver"
    if rec["pid"] in ranks or "ray::RayTrainWorker" in titles:
        return "worker"
    if "TrainController" in titles:
        return "controller"
    if any(f"ray::{t}" in titles or f"ray::_{t}" in titles for t in _DATA_TITLES):
        return "data"
    if rec["name"] in _SYSTEM_NAMES or any(t in titles for t in _SYSTEM_TITLES):
        return "ray-system"
    return "ray-other" if "ray::" in titles else "other"


def _short(title: str) -> str:
    """A title without the interpreter and site-packages noise, at most 100 characters."""
    title = title.replace(sys.executable, "python").replace(str(Path(sys.prefix)), "<venv>")
    return title[:100]


def _kill_session(pid: int, sig: int) -> None:
    """Signals the process group of a command started with ``start_new_session``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _measure(
    cmd: list[str], cwd: Path, name: str, *, interval: float, timeout: float
) -> dict[str, Any]:
    """Runs ``cmd`` in ``cwd`` (stdout and stderr to ``cwd/<name>.stdout|stderr``) and returns
    its exit code, wall time, and the peak RSS of every process of it, classified."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env.update({TAG_ENV: tag, "RAY_DATA_DISABLE_PROGRESS_BARS": "1", "RAY_DEDUP_LOGS": "0"})
    out_path, err_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
    started = time.monotonic()
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True
        )
        poller = Poller(proc.pid, tag, interval, disk_path=cwd)
        try:
            poller.start()
            rc = proc.wait(timeout=timeout)
        except BaseException as exc:  # timeout, Ctrl-C: stop the session started for it
            _kill_session(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_session(proc.pid, signal.SIGKILL)
                proc.wait()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            rc = "timeout"
        wall = time.monotonic() - started
        poller.stop()
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    ranks = _ranks(stderr)
    processes = []
    for rec in poller.procs.values():
        role = _role(rec, proc.pid, ranks)
        processes.append(
            {
                "pid": rec["pid"],
                "role": role,
                "rank": ranks.get(rec["pid"]) if role == "worker" else None,
                "name": rec["name"],
                "titles": [_short(t) for t in rec["titles"]],
                "peak_rss_gb": rec["hwm_kb"] * 1024 / GB,
                "peak_anon_gb": rec.get("anon_kb", 0) * 1024 / GB,
                "seen_s": [round(rec["first_s"], 1), round(rec["last_s"], 1)],
            }
        )
    processes.sort(key=lambda p: (p["role"], -p["peak_rss_gb"]))
    result = {
        "cmd": cmd,
        "rc": rc,
        "wall_s": wall,
        "polls": poller.polls,
        "tree_peak_concurrent_rss_gb": poller.max_total_kb * 1024 / GB,
        "tree_peak_concurrent_at_s": poller.max_total_at_s,
        # The whole disk's used bytes (df), sampled with the processes: the command's files
        # and anything else writing meanwhile (run on a quiet machine).
        "disk_used_at_start_gb": poller.disk_start / GB,
        "disk_peak_above_start_gb": (poller.disk_peak - poller.disk_start) / GB,
        "disk_peak_at_s": poller.disk_peak_at_s,
        "processes": processes,
        "stdout_tail": stdout[-TAIL_CHARS:],
    }
    if rc != 0:
        result["stderr_tail"] = stderr[-TAIL_CHARS:]
        errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
        result["error"] = errors[-1] if errors else f"exit code {rc}"
    return result


def _peak(result: dict[str, Any] | None, role: str) -> float | None:
    """The largest peak RSS (GB) of a role's processes, None when there were none."""
    if not result:
        return None
    peaks = [p["peak_rss_gb"] for p in result["processes"] if p["role"] == role]
    return max(peaks) if peaks else None


def _role_sum(result: dict[str, Any], role: str) -> float:
    return sum(p["peak_rss_gb"] for p in result["processes"] if p["role"] == role)


def _worker_peaks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers' peaks, by rank (workers whose rank is unknown last, by pid)."""
    workers = [p for p in result["processes"] if p["role"] == "worker"]
    workers.sort(key=lambda p: (p["rank"] is None, p["rank"] or 0, p["pid"]))
    return [
        {
            "rank": p["rank"],
            "pid": p["pid"],
            "peak_rss_gb": p["peak_rss_gb"],
            "peak_anon_gb": p.get("peak_anon_gb", 0.0),
        }
        for p in workers
    ]


def _peaks_gb(result: dict[str, Any]) -> list[float]:
    return [round(w["peak_rss_gb"], 2) for w in _worker_peaks(result)]


def _checkpoint(stdout: str, run_dir: Path) -> Path | None:
    """The final checkpoint: the summary's ``checkpoint:`` line, else the newest on disk."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("checkpoint: "):
            return Path(line.removeprefix("checkpoint: ").strip())
    found = sorted(p for p in run_dir.glob("runs/*/checkpoint_*") if p.is_dir())
    return found[-1] if found else None


def _embedding_bytes(config: Path, overrides: list[str]) -> tuple[int, int, int]:
    """(tables, rows of the largest table, fp32 bytes of all tables) of the config."""
    from raydlrm.platform.config import load_config

    tables = load_config(config, overrides=overrides).worker_spec().tables()
    return (
        len(tables),
        max(t.num_embeddings for t in tables),
        sum(t.num_embeddings * t.embedding_dim * 4 for t in tables),
    )


def _overrides(args: argparse.Namespace, root: Path, run_dir: Path, workers: int, rows: int):
    q = json.dumps  # a TOML basic string
    return [
        *args.set,
        f"data.train_path={q(str(root / 'data' / 'train'))}",
        f"data.eval_path={q(str(root / 'data' / 'eval'))}",
        f"data.table_size={rows}",
        f"model.embedding_dim={args.dim}",
        f"model.bottom_mlp={json.dumps(args.bottom_mlp)}",
        f"training.max_steps={args.max_steps}",
        f"scaling.num_workers={workers}",
        f"scaling.resources_per_worker={{CPU = {args.cpus_per_worker}}}",
        f"run.storage_path={q(str(run_dir / 'runs'))}",
        'run.name="memory-scale"',
        f"tracking.tracking_uri={q('sqlite:///' + str(run_dir / 'mlflow.db'))}",
        'tracking.experiment_name="memory_scale"',
        'tracking.registered_model_name="memory-scale"',
    ]


def _wait_gone(result: dict[str, Any], timeout: float = 60) -> None:
    """Waits until the processes of a finished command have exited (a local Ray instance
    shuts down after its driver), so that the next command does not share the memory."""
    pids = {p["pid"] for p in result["processes"]}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.5)


def _python() -> list[str]:
    return [sys.executable, "-m", "raydlrm"]


def _run_one(args: argparse.Namespace, root: Path, workers: int, rows: int) -> dict[str, Any]:
    run_dir = root / f"w{workers}-r{rows}"
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = _overrides(args, root, run_dir, workers, rows)
    row: dict[str, Any] = {"workers": workers, "rows_per_table": rows, "dim": args.dim}
    try:
        row["tables"], row["largest_table_rows"], nbytes = _embedding_bytes(args.config, overrides)
        row["embedding_fp32_gb"] = nbytes / GB
    except Exception as exc:  # the CLI will say it too; measure what fails
        row["embedding_fp32_gb"] = None
        row["config_error"] = f"{type(exc).__name__}: {exc}"
    sets = [a for o in overrides for a in ("--set", o)]
    cmd = [*_python(), "train", "--config", str(args.config), *sets]
    measure = {"interval": args.interval, "timeout": args.timeout}
    row["train"] = train = _measure(cmd, run_dir, "train", **measure)
    _wait_gone(train)
    checkpoint = _checkpoint(train["stdout_tail"], run_dir) if train["rc"] == 0 else None
    row["checkpoint"] = str(checkpoint) if checkpoint else None
    if checkpoint and args.resume_workers:
        # The same run name and storage: the job loads the final checkpoint onto another
        # number of workers (resharded) and trains a few more steps.
        more = [
            *overrides,
            f"scaling.num_workers={args.resume_workers}",
            f"training.max_steps={args.max_steps + 5}",
        ]
        cmd = [
            *_python(),
            "train",
            "--config",
            str(args.config),
            *[a for o in more for a in ("--set", o)],
        ]
        row["resume"] = _measure(cmd, run_dir, "resume", **measure)
        row["resume"]["workers"] = args.resume_workers
        _wait_gone(row["resume"])
        if row["resume"]["rc"] == 0:
            checkpoint = _checkpoint(row["resume"]["stdout_tail"], run_dir) or checkpoint
    model: Path | str | None = checkpoint
    if checkpoint and args.score_registered:  # the run's registered model (the default store)
        model = "models:/memory-scale/1"
    if checkpoint and not args.skip_export:
        out = run_dir / "export"
        cmd = [*_python(), "export", str(checkpoint), "--output", str(out)]
        row["export"] = _measure(cmd, run_dir, "export", **measure)
        _wait_gone(row["export"])
        if row["export"]["rc"] == 0 and not args.score_registered:
            model = out
    if model and not args.skip_score:
        data = root / "data" / ("eval" if (root / "data" / "eval").exists() else "train")
        cmd = [
            *_python(),
            "score",
            str(model),
            str(data),
            str(run_dir / "scored"),
            "--num-actors",
            str(args.score_actors),
        ]
        row["score"] = _measure(cmd, run_dir, "score", **measure)
        row["score"]["model"] = str(model)
        _wait_gone(row["score"])
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rc(result: dict[str, Any] | None) -> str:
    return "-" if result is None else str(result["rc"])


def _line(row: dict[str, Any]) -> str:
    train = row["train"]
    workers = "/".join(_fmt(w["peak_rss_gb"]) for w in _worker_peaks(train)) or "-"
    export, score = row.get("export"), row.get("score")
    return (
        f"| {row['workers']} | {row['rows_per_table']} | {row['dim']} | "
        f"{_fmt(row['embedding_fp32_gb'], 3)} | {_fmt(_peak(train, 'driver'))} | {workers} | "
        f"{_fmt(_peak(train, 'data'))} | {_fmt(train['tree_peak_concurrent_rss_gb'])} | "
        f"{_fmt(train['wall_s'], 0)} | {_rc(train)} | {_fmt(_peak(export, 'driver'))} | "
        f"{_fmt(export and export['wall_s'], 0)} | {_rc(export)} | "
        f"{_fmt(_peak(score, 'driver'))} | {_fmt(_peak(score, 'data'))} | "
        f"{_fmt(score and score['tree_peak_concurrent_rss_gb'])} | {_rc(score)} |"
    )


def _version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "-"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_ints, default=[1, 2, 3], help="e.g. 1,2,3")
    parser.add_argument(
        "--table-sizes", type=_ints, default=[100_000, 500_000], help="rows per table, e.g. 1e5"
    )
    parser.add_argument("--dim", type=int, default=64, help="model.embedding_dim")
    parser.add_argument(
        "--bottom-mlp",
        type=_ints,
        default=None,
        help="model.bottom_mlp, e.g. 256,64 (default: the config's, its last layer --dim)",
    )
    parser.add_argument("--max-steps", type=int, default=20, help="training.max_steps")
    parser.add_argument("--cpus-per-worker", type=float, default=0.5, help="Ray CPUs a worker")
    parser.add_argument(
        "--config", type=Path, default=REPO / "configs" / "quickstart.toml", help="run file"
    )
    parser.add_argument("--set", action="append", default=[], help="an extra override (repeatable)")
    parser.add_argument(
        "--train-rows", type=int, default=None, help="synthetic train rows (default: config's)"
    )
    parser.add_argument(
        "--eval-rows", type=int, default=None, help="synthetic eval rows (default: config's)"
    )
    parser.add_argument(
        "--resume-workers",
        type=int,
        default=None,
        help="after training, resume the run on this many workers (resharded) for 5 more steps",
    )
    parser.add_argument("--skip-export", action="store_true", help="do not measure export")
    parser.add_argument("--skip-score", action="store_true", help="do not measure score")
    parser.add_argument(
        "--score-registered",
        action="store_true",
        help="score the run's registered model (models:/memory-scale/1) rather than the "
        "export or checkpoint",
    )
    parser.add_argument("--score-actors", type=int, default=1, help="raydlrm score --num-actors")
    parser.add_argument("--interval", type=float, default=0.2, help="poll interval, s")
    parser.add_argument("--timeout", type=float, default=1800, help="per command, s")
    parser.add_argument("--keep", action="store_true", help="keep the working directories")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir(), "raydlrm-memory-scale.json"),
        help="results JSON",
    )
    args = parser.parse_args()
    args.config = args.config.resolve()
    if args.bottom_mlp is None:  # a DLRM's dot interaction needs bottom_mlp[-1] == dim
        from raydlrm.platform.config import load_config

        args.bottom_mlp = [*load_config(args.config, overrides=args.set).model.bottom_mlp[:-1]]
        args.bottom_mlp.append(args.dim)

    root = (args.workdir or Path(tempfile.mkdtemp(prefix="raydlrm-memory-scale-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    memory = psutil.virtual_memory().total / GB
    print(
        f"machine: {os.cpu_count()} CPUs, {memory:.1f} GB RAM; torch {_version('torch')}; "
        f"ray {_version('ray')}; fbgemm-gpu {_version('fbgemm-gpu-cpu', 'fbgemm-gpu')}"
    )
    print(
        f"working dir: {root}; config {args.config}; dim {args.dim}, bottom MLP "
        f"{args.bottom_mlp}, {args.max_steps} steps, "
        f"{args.cpus_per_worker} CPU a worker; synthetic rows (train/eval) "
        f"{args.train_rows or 'config'}/{args.eval_rows or 'config'}; poll every "
        f"{args.interval} s",
        flush=True,
    )
    rows_out: list[dict[str, Any]] = []
    try:
        data_sets = []  # 8 files (a row group each) of --train-rows: enough for 8 workers
        if args.train_rows is not None:
            data_sets += [
                f"data.synthetic.num_train_rows={args.train_rows}",
                f"data.synthetic.rows_per_file={max(1, args.train_rows // 8)}",
            ]
        if args.eval_rows is not None:
            data_sets.append(f"data.synthetic.num_eval_rows={args.eval_rows}")
        if not (root / "data" / "train").exists():  # once, outside the measurements
            cmd = [*_python(), "data", "generate", "--config", str(args.config)]
            cmd += [a for o in [*args.set, *data_sets] for a in ("--set", o)]
            subprocess.run([*cmd, "--out", str(root / "data")], check=True, cwd=root)
        for workers in args.workers:
            for rows in args.table_sizes:
                row = _run_one(args, root, workers, rows)
                rows_out.append(row)
                train = row["train"]
                print(
                    f"workers {workers}, {rows} rows/table: embeddings "
                    f"{_fmt(row['embedding_fp32_gb'], 3)} GB fp32; train rc {train['rc']} in "
                    f"{train['wall_s']:.0f} s, driver {_fmt(_peak(train, 'driver'))} GB, "
                    f"workers {_peaks_gb(train)} GB (anonymous "
                    f"{[round(w['peak_anon_gb'], 2) for w in _worker_peaks(train)]} GB), "
                    f"tree {_fmt(train['tree_peak_concurrent_rss_gb'])} GB"
                    + (
                        f"; resume on {row['resume']['workers']} rc {row['resume']['rc']}, "
                        f"workers {_peaks_gb(row['resume'])} GB"
                        if "resume" in row
                        else ""
                    )
                    + "".join(
                        f"; {name} rc {row[name]['rc']} peak {_fmt(_peak(row[name], 'driver'))} GB"
                        for name in ("export", "score")
                        if name in row
                    ),
                    flush=True,
                )
                for name in ("train", "resume", "export", "score"):
                    if name in row and row[name]["rc"] != 0:
                        print(f"  {name} FAILED: {row[name]['error']}", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(
                    json.dumps({"args": vars(args), "runs": rows_out}, indent=1, default=str)
                )
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)

    print()
    print(
        "peak RSS (VmHWM; 1 GB = 1e9 bytes) of each process; data actor: the largest Ray Data "
        "process; tree concurrent: the largest sum of VmRSS over the command's processes at one "
        "poll (shared pages counted once per process)"
    )
    print(
        "| workers | rows/table | dim | emb fp32 GB | driver GB | worker GB by rank | data actor "
        "GB | tree concurrent GB | train s | rc | export GB | export s | rc | score driver GB | "
        "score actor GB | score tree GB | rc |"
    )
    print("|---" * 17 + "|")
    for row in rows_out:
        print(_line(row))
    print()
    for row in rows_out:
        train = row["train"]
        others = {
            role: _role_sum(train, role) for role in ("controller", "ray-system", "ray-other")
        }
        print(
            f"- workers {row['workers']}, {row['rows_per_table']} rows: sum of peaks by role: "
            + ", ".join(f"{role} {gb:.2f} GB" for role, gb in others.items())
            + f", data {_role_sum(train, 'data'):.2f} GB; {len(train['processes'])} processes, "
            f"{train['polls']} polls"
        )
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
