"""Real CRIU on a small process tree (no engine): dump, restore with new host PIDs, errors."""

import os
import subprocess
import time

import psutil
import pytest

from warmctl.checkpoint import criu
from warmctl.engine.vllm import kill_tree
from warmctl.errors import CheckpointError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")


def _tree(tmp_path):
    log = open(tmp_path / "out.log", "ab")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "sh", "-c", "while :; do echo tick; sleep 0.1; done"],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    for _ in range(100):
        kids = psutil.Process(p.pid).children()
        if kids:
            return p, kids[0].pid
        time.sleep(0.05)
    raise AssertionError("namespace root did not appear")


def test_dump_then_restore_with_new_pids(tmp_path):
    launcher, root = _tree(tmp_path)
    secs = criu.dump(root, tmp_path / "img")
    assert secs > 0
    launcher.wait(10)  # CRIU killed the dumped tree, so the launcher exits
    assert not psutil.pid_exists(root)
    size = (tmp_path / "out.log").stat().st_size
    new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    try:
        assert psutil.Process(new_root).is_running()
        time.sleep(0.5)
        assert (tmp_path / "out.log").stat().st_size > size  # the restored loop keeps writing
    finally:
        kill_tree(new_root)


def test_dump_of_missing_pid_names_it_and_the_log(tmp_path):
    with pytest.raises(CheckpointError) as e:
        criu.dump(4_000_000, tmp_path / "img")
    assert "criu dump of pid 4000000 failed" in str(e.value) and "dump.log" in str(e.value)


def test_restore_of_empty_dir_fails_clearly(tmp_path):
    (tmp_path / "img").mkdir()
    with pytest.raises(CheckpointError, match="criu restore from .* failed"):
        criu.restore(tmp_path / "img", tmp_path / "pid")


def test_configured_binary_is_used_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("WARMCTL_CRIU", raising=False)
    real = criu.criu_binary()
    link = tmp_path / "my-criu"
    link.symlink_to(real)
    assert criu.criu_binary(str(link)) == str(link)
    assert criu.check(str(link)) == str(link)
    with pytest.raises(Exception, match="not an executable"):
        criu.criu_binary(str(tmp_path / "nope"))
