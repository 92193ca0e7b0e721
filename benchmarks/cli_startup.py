"""Start-up time of the command line: ``--help``, the config commands and an argument error.

Every ``raydlrm`` call used to import torch, Ray and MLflow before parsing its arguments (the
packages' ``__init__`` re-exported everything eagerly), about 3 s on a 2-core machine even for
``--help``. The packages now load their names lazily (``raydlrm._lazy``): a command imports what
it runs.

The current source tree and a reference revision (``--ref``, extracted with ``git archive``) run
each command in a fresh interpreter of the same virtual environment (``PYTHONPATH`` puts the
tree's ``src`` first), interleaved over ``--repeats`` so a shared machine's noise falls on both
alike; the table shows medians and their ratio.

Usage::

    .venv/bin/python benchmarks/cli_startup.py [--ref 970ac69] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "--help": ["--help"],
    "config show": ["config", "show", "--config", "configs/quickstart.toml"],
    "config validate": ["config", "validate", "--config", "configs/quickstart.toml"],
    "argument error": ["train", "--no-such-flag"],
    "data --help": ["data", "--help"],
}


def _extract(rev: str, into: Path) -> Path:
    """The ``src`` tree of ``rev``."""
    archive = into / "src.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), rev, "src"],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _seconds(src: Path, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "raydlrm", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="970ac69", help="the revision to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="raydlrm-cli-startup-") as tmp:
        trees = {"now": ROOT / "src", args.ref: _extract(args.ref, Path(tmp))}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for name, command in COMMANDS.items():
                for tree, src in trees.items():
                    times.setdefault((name, tree), []).append(_seconds(src, command))
    print(f"| command | {args.ref} (s) | now (s) | now / {args.ref} |")
    print("|---|---|---|---|")
    for name in COMMANDS:
        before = statistics.median(times[(name, args.ref)])
        after = statistics.median(times[(name, "now")])
        print(f"| `raydlrm {name}` | {before:.2f} | {after:.2f} | {after / before:.2f} |")
    print(f"\nmedians of {args.repeats} interleaved runs each; python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
