"""The GPU check in one step: the ``gpu``-marked tests and the worker-loop benchmark on CUDA.

On a machine with CUDA (``make gpu-check``, or ``python3 benchmarks/gpu_check.py``), in this
order, each stage skipped once ``--budget`` seconds are spent:

1. the device, and ``pytest -m gpu`` on the files that hold the GPU tests;
2. ``benchmarks/worker_loop.py --device cuda --world-size 1 --mlperf`` (DLRM and DCNv2 at
   MLPerf's layer sizes) with the torch kernel: ``torch-none``, ``torch-sparse_dist``,
   ``torch-none-bf16`` and ``-fp16`` (the dense side in bf16 / fp16, ``training.precision``)
   and the plain-PyTorch ``reference``;
3. the host tier (``sharding.placement = "host"``): DCNv2 in bf16 with 26 tables of
   ``--host-rows`` rows in GPU memory, and in host memory behind GPU caches of 1/2 and 1/10 of
   their rows, on power-law ids (``--host-cardinality``): step rate, miss rate, bytes copied;
   beside them the pinned host-to-GPU copy rate, contiguous and gathered as the cache gathers
   its rows (what PCIe gives);
4. ``training.compile``: bf16 with and without it (``torch-none-bf16+compile``), a run of its
   own (a run killed at the budget records nothing, and compiling takes what it takes);
5. the learned sharding search on GPU lookups (``benchmarks/gpu_cost_model.sh``, lookups only,
   shortened: ``COLLECT_S`` 45 s, 8 tasks).

It writes ``gpu-check.md`` and ``gpu-check.json`` (figures, test counts) with the logs to
``--out`` (default: ``$OUT`` where set, else ``runs/gpu-check``). Exits non-zero if a test or a
benchmark fails. Without CUDA (or without torch) it says so in one line and exits 0.

Neither Ray, MLflow nor fbgemm-gpu is needed: the tests and the benchmark import only
``raydlrm``'s worker side (torch kernel, plain ``torch.distributed``), which needs pydantic on
top of torch, numpy, pyarrow and pandas. A machine that has torch but not pydantic (the lent GPU
machine, which has no network) gets it as wheels: ``make gpu-wheels`` (``python
benchmarks/gpu_check.py wheels``) downloads the pinned wheels (:data:`WHEELS`, Python 3.12,
manylinux x86_64) into ``.whl/``; carried there, the check installs them with ``pip install
--no-index --target`` into ``--site`` and puts that first on the ``PYTHONPATH`` of what it runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_DIR = ROOT / ".whl"
GPU_TEST_FILES = [
    "tests/trainers/test_loop.py",
    "tests/trainers/test_precision.py",  # bf16/fp16 and compile on CUDA
    "tests/sharding/test_kernel.py",
    "tests/sharding/test_quantized.py",
    "tests/sharding/test_codecs.py",
    "tests/sharding/test_learned_cost.py",
    "tests/sharding/test_towers.py",
    "tests/models/test_managed_ids.py",  # the managed-id map on CUDA (and its rate, printed)
    "tests/sharding/test_tiers.py",  # host tables behind a GPU row cache
]
VARIANTS = "torch-none,torch-sparse_dist,torch-none-bf16,torch-none-fp16,reference"
# training.compile, a stage of its own after the host tier: its compilation time is unknown,
# and a run killed at the budget records nothing.
COMPILE_VARIANTS = "torch-none-bf16,torch-none-bf16+compile"
HOST_VARIANTS = "torch-none-bf16,torch-none-bf16+host2,torch-none-bf16+host10"
RATIOS = [
    ("torch-sparse_dist", "torch-none"),
    ("torch-none", "reference"),
    ("torch-sparse_dist", "reference"),
    ("torch-none-bf16", "torch-none"),  # training.precision (issue 49): bf16 against fp32/TF32
    ("torch-none-fp16", "torch-none"),
    ("torch-none-bf16+compile", "torch-none-bf16"),  # training.compile
    ("torch-none-bf16+host2", "torch-none-bf16"),  # host tables, cache of 1/2 (1/10) of the rows
    ("torch-none-bf16+host10", "torch-none-bf16"),
]

# What the worker side needs beyond a torch image (torch, numpy, pyarrow, pandas, pytest):
# pydantic and its requirements, pinned to the dev venv's versions (pyproject: pydantic>=2.6).
# typing_extensions travels too: pydantic 2.14 needs >= 4.16, newer than an image may hold.
WHEELS = {
    "pydantic": "2.14.4",
    "pydantic_core": "2.50.5",
    "annotated_types": "0.8.0",
    "typing_inspection": "0.4.5",
    "typing_extensions": "4.16.0",
}
WHEEL_PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
CARRY_LIMIT = 64 * 1024 * 1024  # the lent machine's limit: working tree + carried paths
# What the check imports before running anything (a missing package shows here, in one place).
PREFLIGHT = "import pydantic, raydlrm.sharding.kernel, raydlrm.trainers.loop, raydlrm.ingestion"


def _say(line: str) -> None:
    print(f"gpu-check: {line}", flush=True)


# --- wheels (run here, where pip can download) ------------------------------------------------


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return name.lower().replace("-", "_").replace(".", "_"), version


def _travelling_bytes() -> int:
    """The working tree as a device call sends it: tracked and untracked-but-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    paths = (ROOT / p.decode() for p in listed.split(b"\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def fetch_wheels(dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):  # one version of each: two stop the whole install
        name, version = _wheel_name(stale)
        if name in WHEELS and WHEELS[name] != version:
            stale.unlink()
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        + ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        + platforms
        + ["-d", str(dest)]
        + [f"{name}=={version}" for name, version in WHEELS.items()],
        check=True,
    )
    wheels = sorted(dest.glob("*.whl"))
    have = {_wheel_name(w)[0] for w in wheels}
    missing = sorted(set(WHEELS) - have)
    if missing:
        _say(f"not downloaded: {', '.join(missing)}")
        return 1
    size = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        extra = "" if _wheel_name(w)[0] in WHEELS else "  (not in the pinned list)"
        print(f"{w.stat().st_size / 1e6:8.2f} MB  {w.name}{extra}")
    for name, version in WHEELS.items():  # the pins follow what the tests run against here
        try:
            here = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if here != version:
            _say(f"note: {name} is {here} in {sys.prefix}, the pin is {version}")
    tree = _travelling_bytes()
    total = size + tree
    print(
        f"{size / 2**20:.2f} MiB of wheels in {dest}/ + {tree / 2**20:.2f} MiB "
        f"of working tree = {total / 2**20:.2f} MiB (limit {CARRY_LIMIT / 2**20:.0f} MiB)"
    )
    if total > CARRY_LIMIT:
        _say("too large to carry to the lent GPU machine")
        return 1
    return 0


# --- the check (run on the CUDA machine) -------------------------------------------------------


def _env(site: Path | None) -> dict[str, str]:
    paths = [str(site)] if site else []
    paths.append(str(ROOT / "src"))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def _preflight(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PREFLIGHT], env=env, cwd=ROOT, capture_output=True, text=True
    )


def _dependencies(site: Path) -> tuple[dict[str, str] | None, str]:
    """The environment the tests and the benchmark run in: ``src`` on the path, and the carried
    wheels installed into ``site`` first on it if raydlrm's worker side does not import
    without them. None (and why) if it does not import either way."""
    env = _env(None)
    done = _preflight(env)
    if done.returncode == 0:
        return env, "imports without the carried wheels"
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    if not wheels:
        why = (done.stderr.strip() or "?").splitlines()[-1]
        return None, (
            f"raydlrm's worker side does not import ({why}) and "
            f"{WHEEL_DIR.relative_to(ROOT)}/ holds no wheels: run `make gpu-wheels` where pip "
            "can download, and carry .whl"
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        + ["--no-cache-dir", "--upgrade", "--target", str(site)]
        + [str(w) for w in wheels],
        check=True,
    )
    env = _env(site)
    done = _preflight(env)
    if done.returncode != 0:
        return None, f"raydlrm's worker side does not import with the wheels:\n{done.stderr}"
    return env, f"{len(wheels)} carried wheels installed into {site}"


def _stream(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run ``cmd``, its output both on the console and in ``log``; 124 if killed past
    ``timeout`` seconds."""
    with log.open("w") as f:
        process = subprocess.Popen(
            cmd,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a timeout ends its ranks too
        )

        def copy() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                f.write(line)

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        try:
            rc = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            rc = 124
        copier.join(timeout=10)
        if rc == 124:
            f.write(f"\n[gpu-check: killed after {timeout:.0f} s]\n")
        return rc


def _tests(env, out: Path, timeout: float, cuda: bool) -> dict:
    junit = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider"]
    rc = _stream(
        [*cmd, f"--junitxml={junit}", *GPU_TEST_FILES], env, out / "gpu-tests.log", timeout
    )
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in counts} if suite is not None else counts
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    # On CUDA the torch kernel's tests run (fbgemm's skip without its CUDA build): none passing
    # means nothing was checked. Without CUDA (--device cpu, a dry run) all skip.
    ok = rc == 0 and (passed > 0 or not cuda)
    return {"returncode": rc, "passed": passed, **counts, "ok": ok}


def _bench(env, out: Path, args, batch_size: int, timeout: float, **over) -> dict:
    """A worker-loop run at ``batch_size``; ``over`` replaces ``variants``, ``archs``,
    ``rows``, ``steps``, ``repeats`` or adds ``cardinality`` (``name``: its log's suffix)."""
    data_dir = Path(tempfile.mkdtemp(prefix="raydlrm-gpu-check-"))
    knobs = {k: getattr(args, k) for k in ("variants", "archs", "rows", "steps", "repeats")}
    name = over.pop("name", "")
    knobs.update(over)
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "worker_loop.py"),
        f"--device={args.device}",
        "--world-size=1",
        *(f"--{k}={v}" for k, v in knobs.items()),
        f"--batch-size={batch_size}",
        f"--data-dir={data_dir}",
        *(["--mlperf"] if args.mlperf else []),
    ]
    try:
        rc = _stream(cmd, env, out / f"worker-loop{name}-b{batch_size}.log", timeout)
        results_file = data_dir / "results.json"
        if rc != 0 or not results_file.exists():
            return {"batch_size": batch_size, "returncode": rc, "ok": False}
        results = json.loads(results_file.read_text())
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    figures = {}
    for arch, r in results.items():
        figures[arch] = {}
        for variant, times in r["times"].items():
            median = statistics.median(times)
            figures[arch][variant] = {
                "kernel": r["kernels"][variant],
                "samples_per_s": batch_size * knobs["steps"] / median,
                "ms_per_step": 1000 * median / knobs["steps"],
                "times_s": times,
                **({"cache": r["caches"][variant]} if variant in r.get("caches", {}) else {}),
            }
    ratios = {  # median over repeats of the paired times, b / a: >= 1 when a is faster
        f"{arch}: {a} / {b}": statistics.median(
            tb / ta for ta, tb in zip(r["times"][a], r["times"][b], strict=True)
        )
        for arch, r in results.items()
        for a, b in RATIOS
        if a in r["times"] and b in r["times"]
    }
    return {
        "batch_size": batch_size,
        "returncode": 0,
        "ok": True,
        "knobs": knobs,
        "figures": figures,
        "ratios": ratios,
    }


def _copy_rates(gib: float = 1.0) -> dict:
    """Pinned host-to-GPU copy rates (GB/s): ``gib`` GiB contiguous, and the same bytes as
    512-byte rows gathered at random (``index_select`` into a pinned buffer, then copied: what a
    ``host`` table's cache does with its misses), each the median of 5."""
    import torch

    n = int(gib * 2**30)
    rows = n // 512
    source = torch.randn(rows, 128, pin_memory=True)
    staging = torch.empty(rows // 4, 128, pin_memory=True)
    ids = torch.randint(0, rows, (rows // 4,))
    device = torch.empty(rows // 4, 128, device="cuda")

    def timed(fn) -> float:
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    contiguous = timed(lambda: device.copy_(staging, non_blocking=True))
    gathered = timed(
        lambda: (
            torch.index_select(source, 0, ids, out=staging),
            device.copy_(staging, non_blocking=True),
        )
    )
    out_of = timed(lambda: staging.copy_(device, non_blocking=True))
    size = staging.numel() * 4
    return {
        "bytes": size,
        "h2d_contiguous_gb_s": size / contiguous / 1e9,
        "h2d_gathered_gb_s": size / gathered / 1e9,
        "d2h_contiguous_gb_s": size / out_of / 1e9,
    }


def _cost_model(env, out: Path, timeout: float, device: str) -> dict:
    """``benchmarks/gpu_cost_model.sh``, shortened (45 s of samples, 8 tasks), into
    ``out/gpu-cost``."""
    target = out / "gpu-cost"
    env = {**env, "OUT_DIR": str(target), "COLLECT_S": "45", "TASKS": "8", "PY": sys.executable}
    if device == "cpu":  # the check's own plumbing: a dry run
        env.update(DEVICE="cpu", COLLECT="60", COLLECT_S="20", TASKS="2")
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_cost_model.sh")]
    rc = _stream(cmd, env, out / "gpu-cost-model.log", timeout)
    tasks = target / "sharding_tasks.json"
    return {
        "returncode": rc,
        "ok": rc == 0,
        "tasks": json.loads(tasks.read_text()) if tasks.exists() else None,
    }


def _markdown(summary: dict) -> str:
    d, a = summary["device"], summary["args"]
    lines = [
        f"# GPU check ({summary['finished'] or 'unfinished'})",
        "",
        f"Device: {d['name']} (CUDA {d['cuda']}, torch {d['torch']}, Python {d['python']}); "
        f"dependencies: {summary['dependencies']}.",
        "",
    ]
    t = summary.get("tests")
    if t:
        lines += [
            f"Tests (`pytest -m gpu {' '.join(GPU_TEST_FILES)}`): {t['passed']} passed, "
            f"{t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped "
            f"({'ok' if t['ok'] else 'FAILED'}).",
            "",
        ]
    if summary.get("bench"):
        lines += [
            f"Worker loop (`benchmarks/worker_loop.py --device {a['device']} --world-size 1 "
            f"--variants {a['variants']}{' --mlperf' if a['mlperf'] else ''}`): 26 tables x "
            f"{a['rows']:,} rows, {a['steps']} steps x {a['repeats']} interleaved repeats "
            "(medians), samples/s per rank (ms/step).",
            "",
            "| batch | arch | " + " | ".join(a["variants"].split(",")) + " |",
            "|---|---|" + "---|" * len(a["variants"].split(",")),
        ]
        for run in summary["bench"]:
            if not run["ok"]:
                lines.append(f"| {run['batch_size']:,} | FAILED (exit {run['returncode']}) |")
                continue
            for arch, per in run["figures"].items():
                cells = [
                    f"{per[v]['samples_per_s']:,.0f} ({per[v]['ms_per_step']:.2f})"
                    if v in per
                    else "-"
                    for v in a["variants"].split(",")
                ]
                lines.append(f"| {run['batch_size']:,} | {arch} | " + " | ".join(cells) + " |")
        lines += ["", "Speed ratios (median of paired repeats; >= 1: the first is faster):", ""]
        for run in summary["bench"]:
            for pair, ratio in run.get("ratios", {}).items():
                lines.append(f"- batch {run['batch_size']:,}, {pair}: {ratio:.2f}")
        lines.append("")
    return "\n".join(
        lines + _host_lines(summary) + _compile_lines(summary) + _cost_model_lines(summary)
    )


def _run_lines(head: str, run: dict | None) -> list[str]:
    """A stage's worker-loop run in Markdown: ``head``, each variant's rate (and a ``host``
    variant's caches), the ratios; or that it failed or was skipped."""
    if not run:
        return []
    if not run.get("ok"):
        return [head, "", "FAILED or skipped.", ""]
    lines = [head, ""]
    for arch, per in run["figures"].items():
        for variant, f in per.items():
            cache = f.get("cache")
            extra = (
                f"; miss rate {cache['miss_rate']:.3f}, {cache['bytes_in_per_step'] / 1e6:.1f} "
                f"MB copied in a step, {cache['memory_bytes'] / 2**30:.2f} GiB on the GPU, "
                f"{cache['host_bytes'] / 2**30:.2f} GiB in host memory"
                if cache
                else ""
            )
            lines.append(
                f"- batch {run['batch_size']:,}, {arch}, {variant}: "
                f"{f['samples_per_s']:,.0f} samples/s ({f['ms_per_step']:.2f} ms){extra}"
            )
    lines += [f"- {pair}: {ratio:.2f}" for pair, ratio in run["ratios"].items()]
    return [*lines, ""]


def _compile_lines(summary: dict) -> list[str]:
    head = f"training.compile (`worker_loop.py --variants {COMPILE_VARIANTS} --repeats 2`):"
    return _run_lines(head, summary.get("compile"))


def _host_lines(summary: dict) -> list[str]:
    copy, a = summary.get("copy"), summary["args"]
    head = (
        f"Host tier (`worker_loop.py --archs dcnv2 --variants {HOST_VARIANTS} --rows "
        f"{a['host_rows']} --cardinality {a['host_cardinality']} --steps 10 --repeats 2 "
        f"--batch-size {a['host_batch_size']}{' --mlperf' if a['mlperf'] else ''}`):"
    )
    lines = _run_lines(head, summary.get("host"))
    if copy and lines:
        lines.insert(
            -1,
            f"- pinned host -> GPU: {copy['h2d_contiguous_gb_s']:.1f} GB/s contiguous, "
            f"{copy['h2d_gathered_gb_s']:.1f} GB/s gathering 512-byte rows; GPU -> host "
            f"{copy['d2h_contiguous_gb_s']:.1f} GB/s ({copy['bytes'] / 2**20:.0f} MiB)",
        )
    return lines


def _cost_model_lines(summary: dict) -> list[str]:
    cost = summary.get("cost_model")
    if not cost:
        return []
    if not cost.get("ok"):
        return ["Learned sharding search: FAILED or skipped (see gpu-cost-model.log).", ""]
    return [
        "Learned sharding search on GPU lookups (`gpu_cost_model.sh`, COLLECT_S=45, TASKS=8): "
        "see gpu-cost-model.log and gpu-cost/sharding_tasks.json.",
        "",
    ]


def _write(out: Path, summary: dict) -> None:
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu-check.md").write_text(_markdown(summary))


def _host_stage(env, out: Path, args, summary: dict, remaining) -> bool:
    """Stage 3: the host tier's worker-loop run and the copy rates; whether it went well."""
    if remaining() < 60:
        _say(f"out of time (--budget {args.budget:.0f} s) before the host tier")
        summary["host"] = {"ok": False, "skipped": True}
        return False
    _say("copy rates between pinned host memory and the GPU")
    summary["copy"] = _copy_rates() if args.device == "cuda" else None
    _say(f"host tier: {HOST_VARIANTS}, tables of {args.host_rows:,} rows")
    summary["host"] = _bench(
        env,
        out,
        args,
        args.host_batch_size,
        remaining() - 10,
        name="-host",
        variants=HOST_VARIANTS,
        archs="dcnv2",
        rows=args.host_rows,
        cardinality=args.host_cardinality,
        steps=10,
        repeats=2,
    )
    _write(out, summary)
    return summary["host"]["ok"]


def _compile_stage(env, out: Path, args, summary: dict, remaining) -> bool:
    """Stage 4: bf16 with and without ``training.compile``, at the largest batch size."""
    if remaining() < 120:
        _say(f"out of time (--budget {args.budget:.0f} s) before training.compile")
        summary["compile"] = {"ok": False, "skipped": True}
        return False
    batch_size = max(int(b) for b in args.batch_sizes.split(","))
    _say(f"training.compile: {COMPILE_VARIANTS}, batch {batch_size}")
    summary["compile"] = _bench(
        env,
        out,
        args,
        batch_size,
        remaining() - 10,
        name="-compile",
        variants=COMPILE_VARIANTS,
        repeats=2,
    )
    _write(out, summary)
    return summary["compile"]["ok"]


def check(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        _say("torch is not installed here, so there is no CUDA to check; nothing run")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        _say(f"no CUDA device here (torch {torch.__version__}); nothing run")
        return 0
    cuda = args.device == "cuda"
    start = time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu-check").resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if cuda else f"no CUDA: {os.cpu_count()} CPUs"
    device = {
        "name": name,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        device.update(
            memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count
        )
    _say(f"{name} (torch {torch.__version__}, CUDA {torch.version.cuda}); writing to {out}")
    env, how = _dependencies(Path(args.site))
    summary = {
        "device": device,
        "dependencies": how,
        "args": {k: v for k, v in vars(args).items() if k not in ("command", "dest")},
        "tests": None,
        "bench": [],
        "host": None,
        "copy": None,
        "compile": None,
        "cost_model": None,
        "finished": None,
        "ok": False,
    }
    if env is None:
        _say(how)
        _write(out, summary)
        return 2
    _say(how)

    def remaining() -> float:
        return args.budget - (time.monotonic() - start)

    ok = True
    if not args.no_tests:
        _say(f"pytest -m gpu {' '.join(GPU_TEST_FILES)}")
        summary["tests"] = _tests(env, out, max(30.0, remaining() - 60), cuda)
        ok &= summary["tests"]["ok"]
        _write(out, summary)
    if not args.no_bench:
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            if remaining() < 30:
                _say(f"out of time (--budget {args.budget:.0f} s) before batch {batch_size}")
                summary["bench"].append(
                    {"batch_size": batch_size, "returncode": None, "ok": False, "skipped": True}
                )
                ok = False
                continue
            _say(f"worker loop, batch {batch_size}")
            run = _bench(env, out, args, batch_size, remaining() - 10)
            summary["bench"].append(run)
            ok &= run["ok"]
            _write(out, summary)
    if not args.no_host:
        ok &= _host_stage(env, out, args, summary, remaining)
    if not args.no_compile:
        ok &= _compile_stage(env, out, args, summary, remaining)
    if not args.no_cost_model:
        if remaining() < 120:
            _say(f"out of time (--budget {args.budget:.0f} s) before the learned sharding search")
            summary["cost_model"] = {"ok": False, "skipped": True}
            ok = False
        else:
            _say("the learned sharding search on GPU lookups (gpu_cost_model.sh, shortened)")
            summary["cost_model"] = _cost_model(env, out, remaining() - 5, args.device)
            ok &= summary["cost_model"]["ok"]
        _write(out, summary)
    summary["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    summary["ok"] = ok
    summary["seconds"] = round(time.monotonic() - start, 1)
    _write(out, summary)
    print()
    print(_markdown(summary))
    _say(f"{'ok' if ok else 'FAILED'} in {summary['seconds']:.0f} s; summary in {out}/gpu-check.md")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["check", "wheels"], default="check")
    parser.add_argument("--out", default=None, help="where the summary goes (default: $OUT)")
    parser.add_argument(
        "--site", default="/tmp/raydlrm-gpu-site", help="where carried wheels are installed"
    )
    parser.add_argument("--dest", default=str(WHEEL_DIR), help="wheels: where they are saved")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--archs", default="dlrm,dcnv2")
    parser.add_argument("--batch-sizes", default="8192", help="samples per step, a run each")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-mlperf", dest="mlperf", action="store_false")
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--no-host", action="store_true", help="skip the host-tier stage")
    parser.add_argument("--host-rows", type=int, default=500_000, help="host stage: rows a table")
    parser.add_argument("--host-cardinality", type=int, default=5_000_000)
    parser.add_argument("--host-batch-size", type=int, default=8192)
    parser.add_argument("--no-compile", action="store_true", help="skip training.compile")
    parser.add_argument(
        "--no-cost-model", action="store_true", help="skip the learned sharding search"
    )
    parser.add_argument(
        "--budget", type=float, default=570.0, help="seconds: later runs are skipped past it"
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: the check's own plumbing on a machine without CUDA (a dry run: tests skip)",
    )
    args = parser.parse_args(argv)
    if args.command == "wheels":
        return fetch_wheels(Path(args.dest).resolve())
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
