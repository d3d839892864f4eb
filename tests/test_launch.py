"""The io_uring seccomp filter, exercised in a real child process."""

import subprocess
import sys

from warmctl.engine.launch import io_uring_block_filter

PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
r = libc.syscall(425, 4, ctypes.create_string_buffer(120))
print(r, ctypes.get_errno(), os.getpid() > 0)
"""


def test_filter_program_shape():
    prog = io_uring_block_filter("x86_64")
    assert len(prog) == 6 * 8  # six sock_filter instructions


def test_io_uring_blocked_only_under_launcher():
    plain = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True).stdout.split()
    assert plain[1] != "38"  # ENOSYS only under the filter (anything else: supported, or EINVAL...)
    blocked = subprocess.run([sys.executable, "-m", "warmctl.engine.launch", "--", sys.executable, "-c", PROBE],
                             capture_output=True, text=True)
    r, errno_, alive = blocked.stdout.split()
    assert (r, errno_, alive) == ("-1", "38", "True")


def test_filter_inherited_by_grandchildren():
    inner = f"import subprocess, sys; print(subprocess.run([sys.executable, '-c', {PROBE!r}], capture_output=True, text=True).stdout)"
    out = subprocess.run([sys.executable, "-m", "warmctl.engine.launch", "--", sys.executable, "-c", inner],
                         capture_output=True, text=True).stdout.split()
    assert out[:2] == ["-1", "38"]


def test_stdio_is_opened_by_the_launcher_itself(tmp_path):
    """``--stdio LOG``: stdin /dev/null, stdout and stderr appended to LOG, whatever the caller
    gave; usage errors name the form."""
    log = tmp_path / "engine.log"
    log.write_text("before\n")
    inner = "import os, sys; print('out', os.readlink('/proc/self/fd/0')); print('err', file=sys.stderr)"
    r = subprocess.run([sys.executable, "-m", "warmctl.engine.launch", "--stdio", str(log), "--", sys.executable, "-c", inner],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == r.stderr == ""
    assert log.read_text().splitlines() == ["before", "out /dev/null", "err"]
    bad = subprocess.run([sys.executable, "-m", "warmctl.engine.launch", "--stdio"], capture_output=True, text=True)
    assert bad.returncode == 1 and "usage:" in bad.stderr and "--stdio LOG" in bad.stderr
