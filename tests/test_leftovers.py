"""The session's leftover check (``tests/_leftovers.py``) finds what a session leaves behind, and
only its own while another session runs beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from raydlrm.storage import scratch_origin
from tests import _leftovers


def test_finds_and_removes_a_marked_process_and_a_temporary_file() -> None:
    before = _leftovers.snapshot()
    sleeper = subprocess.Popen(["sleep", "60"])  # inherits the session's mark
    stale = Path(tempfile.mkdtemp(prefix="raydlrm-leftover-"))
    try:
        # The session's own servers and Ray cluster are running too, and are found: only the
        # two made here are removed.
        left = _leftovers.find(before, wait_s=0.2)
        ours = [x for x in left if x.pid == sleeper.pid or x.name == str(stale)]
        assert sorted(x.kind for x in ours) == ["file", "process"]
        beside = _leftovers.find(before, wait_s=0.2, alone=False)
        assert sleeper.pid in {x.pid for x in beside}
        assert "file" not in {x.kind for x in beside}  # the file may be another session's
        _leftovers.remove(ours)
        assert sleeper.wait(timeout=10) != 0 and not stale.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_another_session_is_a_pytest_process_without_this_sessions_mark() -> None:
    code = "import time; time.sleep(60)"
    env = {**os.environ, _leftovers.MARK: "another"}
    unmarked = {k: v for k, v in os.environ.items() if k != _leftovers.MARK}
    other = subprocess.Popen([sys.executable, "-c", code, "pytest"], env=env)
    # A session started from a shell: its mark is set after it started, so it shows none.
    shell = subprocess.Popen([sys.executable, "-c", code, "pytest"], env=unmarked)
    ours = subprocess.Popen([sys.executable, "-c", code, "pytest"])  # this session's mark
    orphan = subprocess.Popen(["sleep", "60"], env=env)  # an earlier session's leftover
    try:
        found = _leftovers.other_sessions()
        assert other.pid in found and shell.pid in found
        assert ours.pid not in found and orphan.pid not in found and os.getpid() not in found
    finally:
        for p in (other, shell, ours, orphan):
            p.kill()
            p.wait()


def test_a_running_programs_scratch_directory_is_not_the_sessions() -> None:
    """A benchmark or job beside the tests keeps its scratch directories: only those of this
    session's processes, or of a process that is gone, are leftovers."""
    import tempfile

    before = _leftovers.snapshot()
    env = {k: v for k, v in os.environ.items() if k != _leftovers.MARK}
    other = subprocess.Popen(["sleep", "60"], env=env)
    tmp = Path(tempfile.gettempdir())
    origin = scratch_origin()
    theirs = tmp / f"raydlrm-ckpt-{other.pid}-{origin}-abcdefgh"
    ours = tmp / f"raydlrm-ckpt-{os.getpid()}-{origin}-abcdefgh"
    try:
        for path in (theirs, ours):
            path.mkdir()
        left = {x.name for x in _leftovers.find(before, wait_s=0.2) if x.kind == "file"}
        assert str(ours) in left and str(theirs) not in left
        other.kill()
        other.wait()
        left = {x.name for x in _leftovers.find(before, wait_s=0.2) if x.kind == "file"}
        assert str(theirs) in left  # its process is gone
    finally:
        other.kill()
        other.wait()
        for path in (theirs, ours):
            path.rmdir()
