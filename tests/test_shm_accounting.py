"""``/dev/shm`` accounting with real files and processes, no engine:
``status --orphans`` names a file no live engine holds, with its size, memory, age and the
processes using it; :func:`warmctl.checkpoint.capture.shm_of` counts what a tree maps or holds
and what its run recorded; benchmarks exit 1 naming what they leave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import WARMCTL, isolated_env
from warmctl.bench.shm import as_found
from warmctl.checkpoint import capture

REPO = Path(__file__).resolve().parent.parent

HOLDER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 20)
m = mmap.mmap(fd, 1 << 20)
m[:8192] = b"x" * 8192          # two pages written: 8 KiB in memory of a 1 MiB file
os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def shm_files():
    names = [f"warmctl-test-{os.getpid()}-{i}" for i in range(2)]
    yield [Path("/dev/shm") / n for n in names]
    for n in names:
        (Path("/dev/shm") / n).unlink(missing_ok=True)


def test_shm_of_counts_what_a_tree_maps_and_what_its_run_recorded(shm_files):
    mapped, recorded = shm_files
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(mapped)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        recorded.write_bytes(b"y" * 5000)
        st = recorded.stat()
        files = capture.shm_of(p.pid, [(st.st_dev, st.st_ino)])
        assert len(files) == 2
        assert capture.shm_bytes(files) == 8192 + st.st_blocks * 512  # memory taken, not file sizes
        assert capture.shm_of(None, [], [str(recorded)]).keys() == {(st.st_dev, st.st_ino)}
    finally:
        p.kill()
        p.wait()


def test_status_orphans_names_size_age_and_users(tmp_path, shm_files):
    used, left = shm_files
    env = {**isolated_env(tmp_path, 18400, 18480), "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(used)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        left.write_bytes(b"z" * 10_000)
        os.utime(left, (time.time() - 7200, time.time() - 7200))  # last written two hours ago
        r = subprocess.run([*WARMCTL, "status", "--orphans", "--json"], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        rows = {Path(x["path"]).name: x for x in json.loads(r.stdout)}
        assert rows[left.name]["size"] == 10_000 and rows[left.name]["users"] == []
        assert 7100 < rows[left.name]["age_s"] < 7300 and rows[left.name]["allocated"] >= 10_000
        assert rows[used.name]["users"] == [p.pid] and rows[used.name]["allocated"] == 8192
        text = subprocess.run([*WARMCTL, "status", "--orphans"], env=env, capture_output=True, text=True).stdout
        assert left.name in text and "none" in text
    finally:
        p.kill()
        p.wait()


def test_a_benchmark_that_leaves_a_file_exits_1_naming_it(shm_files, capsys):
    leak = shm_files[0]
    with pytest.raises(SystemExit) as e:
        with as_found("bench-x"):
            leak.write_bytes(b"q" * 100)
    assert e.value.code == 1 and f"bench-x: left {leak} (100 bytes" in capsys.readouterr().err
    leak.unlink()
    with as_found("bench-y"):  # nothing left: no exit
        pass
