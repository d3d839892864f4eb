"""The suite's two streams (tests/conftest.py, ``WARMCTL_TEST_STREAM``; scripts/test.sh runs them
side by side): every collected test is in exactly one, each file whole in one, every file with a
test marked ``host_wide``, or ``e2e`` without ``fast_stream``, in the engine stream (the fast
stream runs beside the engines in a private ``/dev/shm``: a host-wide check or a real engine
there would see, or miss, the other stream's files), and the ``fast_stream`` files (the fault
matrix) in the fast stream. An unknown stream name is a usage error, not an empty run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _collect(stream: str | None, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "WARMCTL_TEST_STREAM"}
    if stream is not None:
        env["WARMCTL_TEST_STREAM"] = stream
    return subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ids(p: subprocess.Popen) -> set[str]:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    return {ln.strip() for ln in out.splitlines() if "::" in ln}


def _files(ids: set[str]) -> set[str]:
    return {i.split("::", 1)[0] for i in ids}


def test_every_test_is_in_one_stream_and_the_engine_files_in_the_engine_stream():
    runs = {"all": _collect(None), "engines": _collect("engines"), "fast": _collect("fast"),
            "marked": _collect(None, "-m", "(e2e and not fast_stream) or host_wide"),
            "moved": _collect(None, "-m", "fast_stream"), "bad": _collect("both")}
    bad_out, _ = runs.pop("bad").communicate(timeout=300)
    ids = {name: _ids(p) for name, p in runs.items()}
    assert ids["engines"] and ids["fast"] and ids["marked"] and ids["moved"]
    assert ids["engines"] | ids["fast"] == ids["all"]
    assert not _files(ids["engines"]) & _files(ids["fast"])
    assert _files(ids["marked"]) <= _files(ids["engines"])
    assert "tests/test_fault_matrix.py" in _files(ids["moved"])
    assert _files(ids["moved"]) <= _files(ids["fast"])
    assert "tests/test_streams.py" in _files(ids["fast"])
    assert "WARMCTL_TEST_STREAM='both'" in bad_out and "engines, fast" in bad_out, bad_out
