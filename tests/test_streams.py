"""The suite's two streams (tests/conftest.py, ``WARMCTL_TEST_STREAM``; scripts/test.sh runs them
side by side): every collected test is in exactly one, each file whole in one, every file with a
test marked ``host_wide``, or ``e2e`` without ``fast_stream``, in the engine stream (the fast
stream runs beside the engines in a private ``/dev/shm``: a host-wide check or a real engine
there would see, or miss, the other stream's files), and the ``fast_stream`` files (the fault
matrix) in the fast stream; the fast stream's shards (``WARMCTL_TEST_SHARD=K/N``, as the fast tier
runs it) split its files between them, each whole in one. An unknown stream name or a malformed
shard is a usage error, not an empty run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _collect(stream: str | None, *args: str, shard: str = "") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("WARMCTL_TEST_STREAM", "WARMCTL_TEST_SHARD")}
    if stream is not None:
        env["WARMCTL_TEST_STREAM"] = stream
    if shard:
        env["WARMCTL_TEST_SHARD"] = shard
    return subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ids(p: subprocess.Popen) -> set[str]:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    return {ln.strip() for ln in out.splitlines() if "::" in ln}


def _files(ids: set[str]) -> set[str]:
    return {i.split("::", 1)[0] for i in ids}


def test_every_test_is_in_one_stream_and_the_engine_files_in_the_engine_stream():
    # the fast stream as the fast tier runs it, in two shards: their union is the fast stream
    runs = {"all": _collect(None), "engines": _collect("engines"),
            "fast1": _collect("fast", shard="1/2"), "fast2": _collect("fast", shard="2/2"),
            "marked": _collect(None, "-m", "(e2e and not fast_stream) or host_wide"),
            "moved": _collect(None, "-m", "fast_stream"), "bad": _collect("both"),
            "bad_shard": _collect("fast", shard="3/2")}
    bad_out, _ = runs.pop("bad").communicate(timeout=300)
    bad_shard_out, _ = runs.pop("bad_shard").communicate(timeout=300)
    ids = {name: _ids(p) for name, p in runs.items()}
    assert all(ids.values())
    fast = ids["fast1"] | ids["fast2"]
    assert ids["engines"] | fast == ids["all"]
    assert not _files(ids["engines"]) & _files(fast)
    assert not _files(ids["fast1"]) & _files(ids["fast2"])
    assert _files(ids["marked"]) <= _files(ids["engines"])
    assert "tests/test_fault_matrix.py" in _files(ids["moved"])
    assert _files(ids["moved"]) <= _files(fast)
    assert "tests/test_streams.py" in _files(fast)
    assert "WARMCTL_TEST_STREAM='both'" in bad_out and "engines, fast" in bad_out, bad_out
    assert "WARMCTL_TEST_SHARD='3/2'" in bad_shard_out and "1 <= K <= N" in bad_shard_out, bad_shard_out
