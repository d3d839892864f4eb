"""The engine's CPU binding across a real CRIU dump and restore (CRIU restores no affinity:
:mod:`warmctl.checkpoint.affinity` records it and puts it back)."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from warmctl.checkpoint import affinity, criu
from warmctl.base.proc import ProcessId, kill_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

#: a main thread left on every CPU and one thread that binds itself to CPU 0 (what vLLM's
#: CPU build does to its OpenMP compute threads), then prints its thread ID; SIGTERM ends it
_BOUND_THREAD = """
import os, signal, threading, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # a PID namespace's init ignores it otherwise
def bound():
    os.sched_setaffinity(0, {0})
    print(threading.get_native_id(), flush=True)
    while True:
        time.sleep(0.1)
threading.Thread(target=bound, daemon=True).start()
while True:
    time.sleep(0.1)
"""


def test_cpu_list_round_trip_and_errors():
    for cpus, text in (({0}, "0"), ({0, 1, 2, 3, 8}, "0-3,8"), ({1, 3, 5}, "1,3,5"), ({7, 8, 9, 10}, "7-10")):
        assert affinity.cpu_list(cpus) == text
        assert affinity.parse_cpu_list(text) == cpus
    for bad in ("", "a", "3-1", "1-", "-1", "1,,2", "0x1"):
        with pytest.raises(ValueError, match="not a CPU list"):
            affinity.parse_cpu_list(bad)


def _bound_tree(tmp_path):
    """A process in its own PID namespace with one thread bound to CPU 0: (launcher, root pid)."""
    out = open(tmp_path / "out.log", "ab")
    launcher = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", _BOUND_THREAD],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = psutil.Process(launcher.pid).children()
        if kids and (tmp_path / "out.log").read_text().strip():
            return launcher, kids[0].pid
        time.sleep(0.05)
    raise AssertionError("the bound thread did not start")


def _affinities(pid: int) -> dict[int, set[int]]:
    return {t.id: os.sched_getaffinity(t.id) for t in psutil.Process(pid).threads()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding a thread needs two usable CPUs")
def test_binding_is_recorded_and_put_back_after_restore(tmp_path):
    everywhere = os.sched_getaffinity(0)
    launcher, root = _bound_tree(tmp_path)
    try:
        recorded = affinity.record(root)
        # the bound thread, by its ID inside the namespace (the main thread there is 1)
        assert list(recorded) == ["0"] and len(recorded["0"]) == 1 and recorded["0"][0] != 1, recorded
        criu.dump(root, tmp_path / "img")
        launcher.wait(10)
    finally:
        if launcher.poll() is None:
            kill_tree(ProcessId.of(launcher.pid))
    new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    try:
        before = _affinities(new_root)
        done = affinity.apply(new_root, recorded)
        after = _affinities(new_root)
        assert done.bound == 1 and done.note() is None, done
        assert sorted(map(sorted, after.values())) == sorted([[0], sorted(everywhere)]), \
            f"after apply: {after} (as CRIU restored them: {before})"
        assert after[new_root] == everywhere  # the main thread was not bound and is not now
        assert affinity.record(new_root) == recorded  # same thread, same CPUs, by namespace ID

        # a snapshot from a host with more CPUs: its binding is left off and said, nothing raised
        many = affinity.apply(new_root, {"4096": recorded["0"], "0": [999_999]})
        assert many.bound == 0 and many.foreign == {"4096": 1} and many.missing == [999_999]
        assert "4096" in many.note() and "1 recorded thread(s) not found" in many.note()
        assert _affinities(new_root) == after
    finally:
        kill_tree(ProcessId.of(new_root))


def test_an_unbound_tree_records_nothing(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert affinity.record(p.pid) == {}
        assert affinity.apply(p.pid, {}).note() is None
    finally:
        p.kill()
        p.wait()
