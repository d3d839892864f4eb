"""/dev/shm bookkeeping on real processes: which files a tree holds, found by inode."""

from __future__ import annotations

import os
import subprocess
import time

from warmctl.checkpoint import capture
from warmctl.base.proc import ProcessId, kill_tree


def test_semaphore_mapped_under_a_removed_name_is_found_and_removed_by_inode():
    """glibc's sem_open: create under a temporary name, link to sem.NAME, remove the temporary
    name, keep the mapping. The tree never names sem.NAME, yet ``down`` must remove it."""
    tag = f"warmctl-test-{os.getpid()}"
    tmp, named, other = f"/dev/shm/{tag}.tmp", f"/dev/shm/sem.{tag}", f"/dev/shm/{tag}.other"
    code = (f"import mmap, os, time\n"
            f"fd = os.open('{tmp}', os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, 32)\n"
            f"m = mmap.mmap(fd, 32); os.close(fd)\n"
            f"os.link('{tmp}', '{named}'); os.unlink('{tmp}')\n"
            f"print('ready', flush=True); time.sleep(60)\n")
    open(other, "w").close()  # a file of somebody else: must survive
    p = subprocess.Popen(["python3", "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        found = capture.shm_inodes_of(p.pid)
        st = os.stat(named)
        assert found == {(st.st_dev, st.st_ino)}
        assert not [x for x in capture.referenced_files(p.pid).shm if str(x) == named]  # not by name
        kill_tree(ProcessId.of(p.pid))
        p.wait(10)
        assert capture.remove_by_inode(found) == [capture.SHM / f"sem.{tag}"]
        assert not os.path.exists(named) and os.path.exists(other)
    finally:
        if p.poll() is None:
            p.kill()
        for f in (tmp, named, other):
            if os.path.exists(f):
                os.unlink(f)


def test_gone_tree_holds_nothing():
    p = subprocess.Popen(["true"])
    p.wait()
    time.sleep(0.05)
    assert capture.shm_inodes_of(p.pid) == set()
