"""The per-name lock of ``up``/``down`` (:mod:`warmctl.records.enginelock`) with real processes: a
second holder of a name waits and reads the first's outcome; another name does not wait; a
holder killed with SIGKILL leaves no lock and no answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmctl.records import enginelock
from warmctl.base.errors import CanaryMismatch, WarmctlError

REPO = Path(__file__).resolve().parent.parent

HOLDER = """
import sys, time
from warmctl.records import enginelock
from warmctl.base.errors import CanaryMismatch
run_dir, name, how = sys.argv[1:4]
with enginelock.hold(run_dir, name, "up"):
    print("held", flush=True)
    time.sleep(float(sys.argv[4]))
    if how == "fail":
        raise CanaryMismatch("canary mismatch at position 3")
"""


def _holder(run_dir: Path, name: str, how: str, secs: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), name, how, str(secs)], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline() == "held\n", p.stderr.read()
    return p


def test_second_holder_waits_and_reads_the_first_ones_success(tmp_path):
    first = _holder(tmp_path, "tiny", "ok", 1.0)
    waits = []
    with enginelock.hold(tmp_path, "tiny", "up", on_wait=waits.append) as held:
        assert held.previous is not None and held.previous.ok is True  # only once the first had finished
    assert first.wait() == 0
    assert held.waited and waits and waits[0].pid == first.pid and waits[0].ok is None
    assert held.previous.ok is True and held.previous.pid == first.pid and held.previous.finished_at


def test_the_first_ones_failure_is_reported_with_its_class_and_exit_code(tmp_path):
    first = _holder(tmp_path, "tiny", "fail", 0.5)
    with enginelock.hold(tmp_path, "tiny", "up") as held:
        pass
    assert first.wait() == 1
    assert held.waited and held.previous.ok is False
    err = held.previous.error("tiny")
    assert isinstance(err, CanaryMismatch) and err.exit_code == 3
    assert "canary mismatch at position 3" in str(err) and f"pid {first.pid}" in str(err)


def test_other_names_do_not_wait(tmp_path):
    first = _holder(tmp_path, "a", "ok", 30.0)
    try:
        with enginelock.hold(tmp_path, "b", "up") as held:
            assert not held.waited and first.poll() is None
    finally:
        first.kill()
        first.wait()


def test_a_killed_holder_leaves_no_lock_and_no_answer(tmp_path):
    first = _holder(tmp_path, "tiny", "ok", 60.0)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    t0 = time.monotonic()
    with enginelock.hold(tmp_path, "tiny", "up") as held:
        pass
    assert time.monotonic() - t0 < 30  # not the 60 s the killed holder would have held it
    assert held.previous.pid == first.pid and held.previous.ok is None  # killed: no answer to report


def test_a_failure_in_this_holder_is_recorded_and_raised(tmp_path):
    with pytest.raises(WarmctlError):
        with enginelock.hold(tmp_path, "tiny", "down"):
            raise WarmctlError("boom")
    with enginelock.hold(tmp_path, "tiny", "up") as held:
        assert not held.waited
    assert held.previous.op == "down" and held.previous.ok is False and held.previous.message == "boom"
    assert enginelock.lock_path(tmp_path, "tiny").exists()


def test_the_one_flock_helper_waits_reports_and_times_out(tmp_path):
    """``flock.lock_exclusive``: free at once (no wait), busy (``on_wait`` once, then the lock
    when the holder lets go, or ``TimeoutError``), and the CRIU host lock's error built on it."""
    from warmctl.checkpoint import criu
    from warmctl.base.errors import CheckpointError
    from warmctl.base.flock import lock_exclusive

    p = tmp_path / "l.lock"
    p.touch()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, sys, time
f = open({str(p)!r}); fcntl.flock(f, fcntl.LOCK_EX); print("held", flush=True); time.sleep(1.5)"""],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waits: list[int] = []
        with open(p) as f:
            with pytest.raises(TimeoutError):
                lock_exclusive(f, lambda: waits.append(1), timeout_s=0.3)
            with pytest.raises(CheckpointError, match=rf"held {p} for 0 s"):
                with criu.host_lock(timeout_s=0.3, path=p):
                    pass
            t0 = time.monotonic()
            assert lock_exclusive(f, lambda: waits.append(2)) is True  # blocks until the holder exits
            assert time.monotonic() - t0 > 0.2 and waits == [1, 2]
        with open(p) as f:
            assert lock_exclusive(f, lambda: waits.append(3), timeout_s=0) is False and waits == [1, 2]
    finally:
        holder.kill()
        holder.wait()
