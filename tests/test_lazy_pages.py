"""Lazy restore: the lazy-pages daemon's log, and the gate's watch on the daemon.

The log excerpts are written from CRIU 4.2's messages (``criu/uffd.c``: ``lp_debug`` prefixes
``PID-UFFD_FD: ``; ``Found N pages to be handled by UFFD`` when a process is served, ``UFFD
transferred pages: (COPIED/TOTAL)`` when its copy ended, ``REMOVE:``/``UNMAP:``/``EXIT`` when the
process discarded memory or exited). The gate tests run the real gate process with real
processes standing in for the daemon and the engine (the gate knows the daemon only by its
identity, its exit and its log); the real CRIU daemon is in tests/test_e2e_lazy.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import listening, wait_until
from warmctl import gate
from warmctl.checkpoint import criu
from warmctl.base.proc import ProcessId
from tests.ports import free_port

HEAD = """(00.000000) Version: 4.2 (gitid 0)
(00.000321) Waiting for incoming connections on lazy-pages.socket
(00.512000) Received PID: 1, uffd: 5
(00.512400) 1-5: Found 390012 pages to be handled by UFFD
(00.530000) Received PID: 84, uffd: 6
(00.530300) 84-6: Found 186000 pages to be handled by UFFD
(00.600000) 1-5: #PF at 0x7f3a12345000
(00.600010) 1-5: uffd_copy: 0x7f3a12345000/4096
(00.700000) 84-6: uffd_copy: 0x7f3a00000000/65536
"""


def test_complete_log_every_process_summarised_with_all_pages():
    text = HEAD + ("(03.100000) 1-5: UFFD transferred pages: (390012/390012)\n"
                   "(03.900000) 84-6: UFFD transferred pages: (186000/186000)\n")
    st = criu.parse_lazy_log(text)
    assert st.complete and st.reason == ""
    assert st.processes == [1, 84] and st.copied == st.total == 576012


def test_killed_daemon_lacks_a_summary_and_is_incomplete():
    text = HEAD + "(03.100000) 1-5: UFFD transferred pages: (390012/390012)\n"  # killed while copying 84
    st = criu.parse_lazy_log(text)
    assert not st.complete
    assert "84" in st.reason and "did not end" in st.reason


def test_daemon_that_served_nothing_is_incomplete():
    st = criu.parse_lazy_log("(00.000000) Version: 4.2\n(00.000321) Waiting for incoming connections on lazy-pages.socket\n")
    assert not st.complete and "served no process" in st.reason
    assert not criu.parse_lazy_log("").complete


def test_short_summary_is_incomplete_unless_the_process_discarded_memory():
    short = HEAD + ("(03.100000) 1-5: UFFD transferred pages: (390012/390012)\n"
                    "(03.900000) 84-6: UFFD transferred pages: (185990/186000)\n")
    st = criu.parse_lazy_log(short)
    assert not st.complete and "84 (185990/186000)" in st.reason
    # a process that munmapped / madvise(DONTNEED)ed lazy memory: CRIU dropped those pages from its
    # list but not from TOTAL, so fewer copied is complete
    for event in ("84-6: REMOVE: 7f3a00000000(a000)", "84-6: UNMAP: 7f3a00000000(a000)", "84-6: EXIT"):
        assert criu.parse_lazy_log(short.replace("(03.900000)", f"(02.000000) {event}\n(03.900000)")).complete, event


def test_forked_process_needs_its_own_summary():
    text = HEAD + ("(01.000000) 84-6: FORK: child with ufd=7\n"
                   "(03.100000) 1-5: UFFD transferred pages: (390012/390012)\n"
                   "(03.900000) 84-6: UFFD transferred pages: (186000/186000)\n")
    assert not criu.parse_lazy_log(text).complete
    assert criu.parse_lazy_log(text + "(04.000000) 84-7: UFFD transferred pages: (186000/186000)\n").complete


def test_unreadable_log_is_incomplete(tmp_path):
    st = criu.lazy_log_status(tmp_path / "missing.log")
    assert not st.complete and "cannot read" in st.reason


def test_uffd_check_is_cached_per_binary_and_kernel(tmp_path):
    binary = criu.check()
    first = criu.uffd_supported(binary, tmp_path)
    cached = json.loads((tmp_path / "criu-uffd.json").read_text())
    assert cached["uffd_noncoop"] is first and binary in cached["key"]
    (tmp_path / "criu-uffd.json").write_text(json.dumps({**cached, "uffd_noncoop": not first}))
    assert criu.uffd_supported(binary, tmp_path) is (not first)  # answered from the cache
    (tmp_path / "criu-uffd.json").write_text(json.dumps({**cached, "key": "other", "uffd_noncoop": not first}))
    assert criu.uffd_supported(binary, tmp_path) is first  # another binary/kernel: checked again


# --- the gate's watch -----------------------------------------------------------------------


def _orphan_sleeper() -> ProcessId:
    """A process that is not our child (reparented once its parent exits), as a restored
    engine's root is not the caller's child: killed, it is reaped by init, not left a zombie."""
    out = subprocess.run([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                          "'import time; time.sleep(120)'], start_new_session=True, "
                          "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"],
                         capture_output=True, text=True, check=True).stdout
    ident = ProcessId.of(int(out))
    assert ident is not None
    return ident


@pytest.fixture
def upstream():
    """A loopback listener standing in for the engine's port (accepts, never answers)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("complete", [False, True])
def test_gate_takes_the_engine_down_when_the_daemon_dies_before_its_copy_ended(tmp_path, upstream, complete):
    engine = _orphan_sleeper()
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    log = tmp_path / "lazy-pages.log"
    log.write_text(HEAD + "(03.100000) 1-5: UFFD transferred pages: (390012/390012)\n"
                   + ("(03.900000) 84-6: UFFD transferred pages: (186000/186000)\n" if complete else ""))
    port = free_port()
    pending = gate.prestart("127.0.0.1", port, upstream, tmp_path / "gate.log")
    try:
        watch = gate.LazyWatch(ProcessId.of(daemon.pid), log, engine, tmp_path / "lazy-pages.failed")
        pending.open(engine.pid, lazy=watch)
        client = socket.create_connection(("127.0.0.1", port))  # an open client connection
        time.sleep(0.3)
        assert listening(port) and engine.alive()
        daemon.kill()  # SIGKILL: as an OOM kill or an operator's kill
        daemon.wait()
        if complete:
            time.sleep(1.5)
            assert listening(port) and engine.alive() and pending.proc.poll() is None
            assert not (tmp_path / "lazy-pages.failed").exists()
            assert "finished" in (tmp_path / "gate.log").read_text()
        else:
            assert wait_until(lambda: not listening(port)), "the public port stayed open"
            assert wait_until(lambda: not engine.alive()), "the engine was not killed"
            client.settimeout(5)
            try:
                assert client.recv(1) == b""  # the open connection was cut
            except ConnectionResetError:
                pass
            assert "84" in (tmp_path / "lazy-pages.failed").read_text()
            assert pending.proc.wait(timeout=10) == 0
            assert "killing the engine" in (tmp_path / "gate.log").read_text()
        client.close()
    finally:
        pending.proc.kill()
        pending.proc.wait()
        daemon.kill()
        daemon.wait()
        from warmctl.base.proc import kill_tree

        kill_tree(engine, timeout_s=2)


def test_gate_refuses_to_open_when_the_daemon_already_died_incomplete(tmp_path, upstream):
    engine = _orphan_sleeper()
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ident = ProcessId.of(daemon.pid)
    daemon.kill()
    daemon.wait()
    log = tmp_path / "lazy-pages.log"
    log.write_text(HEAD)  # no summary at all
    port = free_port()
    pending = gate.prestart("127.0.0.1", port, upstream, tmp_path / "gate.log")
    try:
        with pytest.raises(criu.LazyPagesError, match="port was not opened"):
            pending.open(engine.pid, lazy=gate.LazyWatch(ident, log, engine, tmp_path / "f"))
        assert not listening(port)
        assert criu.LazyPagesError.exit_code == 36
    finally:
        pending.proc.kill()
        pending.proc.wait()
        from warmctl.base.proc import kill_tree

        kill_tree(engine, timeout_s=2)
