"""Real CRIU on a small process tree (no engine): dump, restore with new host PIDs, errors."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from warmctl.checkpoint import capture, criu, criuimage
from warmctl.base.errors import CheckpointError, HostError
from warmctl.base.proc import ProcessId, kill_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")


#: a shell that writes a line every 0.1 s and ends on SIGTERM (the init of a PID namespace, as
#: these trees' roots are, ignores a signal it has no handler for: kill_tree would wait out its
#: grace period before SIGKILL)
_LOOP = "trap 'exit 0' TERM; while :; do echo tick; sleep 0.1; done"


def _tree(tmp_path, before: str = ""):
    """A PID namespace whose root runs ``before`` then :data:`_LOOP`. Returns (launcher, root PID)."""
    log = open(tmp_path / "out.log", "ab")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "sh", "-c", before + _LOOP],
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
        kill_tree(ProcessId.of(new_root))


#: prints "<getpid()> <the PID /proc/self names> <counter>" every 0.1 s; TERM ends it
_PIDS = ("import os, signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
         "i = 0\n"
         "while True:\n"
         "    i += 1; print(os.getpid(), os.readlink('/proc/self'), i, flush=True); time.sleep(0.1)\n")


def _lines(log: Path) -> list[list[int]]:
    return [[int(x) for x in ln.split()] for ln in log.read_text().splitlines() if re.fullmatch(r"\d+ \d+ \d+", ln)]


def _start_like_a_cuda_engine(log: Path) -> tuple[subprocess.Popen, int]:
    """_PIDS started as warmctl starts a CUDA engine (its own PID and mount namespaces, output to
    ``log``), once it has printed; (launcher, host PID of the namespace's root)."""
    import sys

    from warmctl.engine import launch

    launcher = subprocess.Popen(launch.command([sys.executable, "-c", _PIDS], log, mount_proc=True),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + 20
    while not (log.exists() and _lines(log)):
        assert time.monotonic() < deadline and launcher.poll() is None, "the tree did not start"
        time.sleep(0.05)
    return launcher, min(k.pid for k in psutil.Process(launcher.pid).children())


def _wait_for_count(log: Path, count: int) -> None:
    deadline = time.monotonic() + 10
    while _lines(log)[-1][2] < count:
        assert time.monotonic() < deadline, "the restored tree does not run"
        time.sleep(0.05)


def test_a_tree_in_its_own_mount_namespace_keeps_its_own_proc_through_dump_and_restore(tmp_path):
    """How warmctl starts engines (warmctl.engine.launch.command): with a PID namespace alone,
    /proc is the host's and names another PID than getpid() (CUDA then fails with error 304 on
    an H200, docs/gpu.md); in its own mount namespace the two agree, CRIU dumps the namespace
    (every other mount external) and restores it, and they still agree."""
    import sys


    bare = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c",
                           "import os; print(os.getpid(), os.readlink('/proc/self'))"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert bare[0] == "1" and bare[1] != "1"  # the host's /proc: the mismatch CUDA refuses

    log = tmp_path / "engine.log"
    launcher, root = _start_like_a_cuda_engine(log)
    assert criu.own_mount_ns(root)
    assert {(a, b) for a, b, _ in _lines(log)} == {(1, 1)}
    assert os.readlink(f"/proc/{root}/fd/1") == str(log)  # opened inside, by the launcher
    criu.dump(root, tmp_path / "img")
    launcher.wait(10)
    assert list((tmp_path / "img").glob("mountpoints-*.img"))  # the namespace is in the image
    before = _lines(log)[-1][2]
    new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    try:
        assert criu.own_mount_ns(new_root)
        _wait_for_count(log, before + 3)
        after = [x for x in _lines(log) if x[2] > before]
        assert after[0][2] == before + 1 and {(a, b) for a, b, _ in after} == {(1, 1)}
    finally:
        kill_tree(ProcessId.of(new_root))


def test_a_mount_gone_before_the_restore_is_made_again_and_the_tree_restores(tmp_path):
    """The image names every mount the dump host had (here a tmpfs mounted for the test); a host
    that lacks one (another node, a login ended, a pod with other secrets) still restores the
    tree: the mount point is made, an empty directory, and bound (criu.restore_mount_flags).
    The restore reads the mounts from the image itself (a streamed one reads the same files
    through the streamer, criuimage.mount_keys)."""

    from warmctl.checkpoint import criuimage

    extra = tmp_path / "extra" / "mnt"
    extra.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "warmctl-test", str(extra)], check=True)
    try:
        log = tmp_path / "engine.log"
        launcher, root = _start_like_a_cuda_engine(log)
        criu.dump(root, tmp_path / "img")
        launcher.wait(10)
    finally:
        subprocess.run(["umount", str(extra)], check=True)
    keys = criuimage.external_mounts(tmp_path / "img")
    assert str(extra) in keys and "/" not in keys and "/proc" not in keys
    assert criuimage.mount_keys(sorted((tmp_path / "img").glob("mountpoints-*.img"))) == keys
    shutil.rmtree(tmp_path / "extra")
    flags = criu.restore_mount_flags(keys)
    assert extra.is_dir() and not any(extra.iterdir())  # made again, empty
    assert f"mnt[{extra}]:{extra}" in flags
    shutil.rmtree(tmp_path / "extra")
    before = _lines(log)[-1][2]
    new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    try:
        _wait_for_count(log, before + 3)
        assert extra.is_dir()
    finally:
        kill_tree(ProcessId.of(new_root))


def test_a_mount_point_that_cannot_be_made_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the mount point's parent would be
    with pytest.raises(CheckpointError, match=f"mount at {blocker}/mnt, which this host lacks"):
        criu.restore_mount_flags([str(blocker / "mnt")])


def test_mount_flags_name_every_mount_but_root_and_proc():
    flags = criu.mount_flags()
    keys = flags[1::2]
    assert flags[::2] == ["--external"] * len(keys) and keys
    points = criu.mount_points()
    assert {k[4:k.index("]")] for k in keys} == set(points) - {"/", "/proc"}
    assert all(k == f"mnt[{p}]:{p}" for k, p in zip(keys, [p for p in points if p not in ("/", "/proc")]))
    assert criu._unescape(r"/a\040b\134c") == "/a b\\c"


def test_a_zombie_in_the_tree_dumps_without_error_and_is_found_dead_in_the_images(tmp_path):
    """A child that has exited under a parent that never reaps it (``sleep`` exec'd over the
    shell that started it): CRIU dumps it without error, and :func:`criu.dumped_dead` finds it
    (namespace PID 2) dead in the images and its live parent (PID 1) not."""
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "sh", "-c", "true & exec sleep 600"],
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            kids = psutil.Process(p.pid).children()
            zombies = [c for k in kids for c in k.children() if c.status() == psutil.STATUS_ZOMBIE]
            if zombies:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("no zombie appeared under the namespace's root")
        criu.dump(kids[0].pid, tmp_path / "img")
        assert criu.dumped_dead(tmp_path / "img", [1, 2]) == [2]
    finally:
        p.kill()
        p.wait(10)


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


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def test_leave_running_dump_keeps_link_remaps_for_restore(tmp_path):
    """A file open under a name that no longer exists, while another name links it (what
    glibc's sem_open leaves: a temporary name linked to sem.NAME, then removed), needs CRIU's
    link_remap file at restore; with --leave-running CRIU deletes it after the dump, so
    criu.dump keeps it (post-dump action script)."""
    name = f"warmctl-test-{os.getpid()}"
    script = (f"exec 3<>/dev/shm/{name}.tmp; echo payload >&3; ln /dev/shm/{name}.tmp /dev/shm/{name}; "
              f"rm /dev/shm/{name}.tmp; {_LOOP}")
    log = open(tmp_path / "out.log", "ab")
    launcher = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "sh", "-c", script],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    root = None
    for _ in range(100):
        kids = psutil.Process(launcher.pid).children()
        # the script has linked its file and removed the first name (checked in that order)
        if kids and os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}.tmp"):
            root = kids[0].pid
            break
        time.sleep(0.05)
    assert root, "tree did not start"
    source = psutil.Process(root)  # is_running() compares creation times: safe against PID reuse
    # /dev/shm is shared with everything else on the host (other suites run side by side): this
    # test looks at and removes only the names of its own file's inode
    mine = os.stat(f"/dev/shm/{name}")
    ours = lambda names: sorted(n for n in names if _inode(f"/dev/shm/{n}") == (mine.st_dev, mine.st_ino))  # noqa: E731
    before = set(os.listdir("/dev/shm"))
    new_root = None
    try:
        with criu.host_lock():
            criu.dump(root, tmp_path / "img", leave_running=True)
            remaps = ours(set(os.listdir("/dev/shm")) - before)
            assert [r for r in remaps if r.startswith("link_remap.")] == remaps and len(remaps) == 1, remaps
            assert not [n for n in os.listdir("/dev/shm") if n.startswith(criu.KEPT_PREFIX)]
            # the image names it, and the file it stands for (what criu.dump checks is in place)
            assert criuimage.linked_remaps(tmp_path / "img") == [(f"/dev/shm/{remaps[0]}", f"/dev/shm/{name}.tmp")]
            assert psutil.Process(root).is_running()  # the source keeps running
            kill_tree(ProcessId.of(root))
            launcher.wait(10)
            new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
        sh = psutil.Process(new_root)
        fd3 = os.readlink(f"/proc/{sh.pid}/fd/3")
        assert f"{name}.tmp" in fd3 and "(deleted)" in fd3
        with open(f"/proc/{sh.pid}/fd/3", "rb") as f:
            assert f.read(7) == b"payload"
        # the restore consumed the link: the image, checked as a dump's end checks it, names what is gone
        with pytest.raises(CheckpointError) as e:
            criu.check_link_remaps(tmp_path / "img")
        assert f"/dev/shm/{remaps[0]} (the removed /dev/shm/{name}.tmp)" in str(e.value) and "dump again" in str(e.value)
    finally:
        if new_root:
            kill_tree(ProcessId.of(new_root))
        if source.is_running():  # should an assertion stop the test before it killed the source
            kill_tree(ProcessId.of(source.pid))
        launcher.kill()
        launcher.wait(10)
        capture.remove_by_inode([(mine.st_dev, mine.st_ino)])


# A CRIU plugin in the pre-descriptor form CRIU still loads (criu/plugin.c generates a
# descriptor when CR_PLUGIN_DESC is missing and calls cr_plugin_init): it only leaves a marker
# file "<$WARMCTL_TEST_PLUGIN_MARKER>.<PLUGIN_NAME>.<stage>" saying it was loaded, and in which stage.
MARKER_PLUGIN = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int cr_plugin_init(int stage)
{
    const char *m = getenv("WARMCTL_TEST_PLUGIN_MARKER");
    if (m) {
        char path[4096];
        snprintf(path, sizeof path, "%s.%s.%d", m, PLUGIN_NAME, stage);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) close(fd);
    }
    return 0;
}
void cr_plugin_fini(void) {}
"""


def marker_plugins(tmp_path: Path, monkeypatch, names: dict[str, str]) -> Path:
    """Compile :data:`MARKER_PLUGIN` once per ``{PLUGIN_NAME: file name}`` into
    ``tmp_path/plugins``, make that CRIU's plugin directory ($CRIU_LIBS_DIR) and point the
    markers at ``tmp_path/loaded``; returns the plugin directory. Skips without a C compiler."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (tmp_path / "marker.c").write_text(MARKER_PLUGIN)
    for name, file in names.items():
        subprocess.run([cc, "-shared", "-fPIC", f'-DPLUGIN_NAME="{name}"', "-o", plugins / file,
                        tmp_path / "marker.c"], check=True)
    monkeypatch.setenv("CRIU_LIBS_DIR", str(plugins))
    monkeypatch.setenv("WARMCTL_TEST_PLUGIN_MARKER", str(tmp_path / "loaded"))
    return plugins


def test_criu_runs_without_the_hosts_plugins(tmp_path, monkeypatch):
    """warmctl's dump and restore load no CRIU plugin (a host's cuda_plugin would restore and
    unlock the CUDA ranks inside `criu restore`, before warmctl's checks; docs/gpu.md). A marker
    plugin in $CRIU_LIBS_DIR (where CRIU looks when --libdir is not given) is loaded by a plain
    `criu dump` and by neither of warmctl's calls."""
    import tempfile

    marker_plugins(tmp_path, monkeypatch, {"marker": "marker.so"})
    # warmctl's plugin directories go to a temporary directory of this test's own (another
    # test session's CRIU calls share /tmp)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    before = set(os.listdir(tempfile.gettempdir()))

    # Control: CRIU itself loads the plugin from $CRIU_LIBS_DIR (so this test can fail).
    launcher, root = _tree(tmp_path)
    try:
        (tmp_path / "plain").mkdir()
        r = subprocess.run([criu.check(), "dump", "-t", str(root), "-D", str(tmp_path / "plain"), "--leave-running",
                            "-o", "dump.log", *criu.DUMP_FLAGS], capture_output=True, text=True)
        assert r.returncode == 0, (tmp_path / "plain" / "dump.log").read_text()[-2000:]
        assert list(tmp_path.glob("loaded.*")), "control: CRIU did not load the plugin"
        for m in tmp_path.glob("loaded.*"):
            m.unlink()
        criu.dump(root, tmp_path / "img")
        launcher.wait(10)
    finally:
        if launcher.poll() is None:  # a failure above: leave no tree behind
            kill_tree(ProcessId.of(root))
            launcher.kill()
            launcher.wait()
    new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    try:
        assert psutil.Process(new_root).is_running()
    finally:
        kill_tree(ProcessId.of(new_root))
    assert list(tmp_path.glob("loaded.*")) == []
    # The empty plugin directories were removed.
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("warmctl-criu-noplugins-")]


# --- network lock: established loopback TCP, as a tensor-parallel engine's ranks hold ---------

_TCP_PAIR = r"""
import os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # a PID namespace's init ignores it otherwise
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); peer, _ = srv.accept()
n = 0
while True:
    cli.sendall(b"x"); assert peer.recv(1) == b"x"; n += 1
    print(n, flush=True); time.sleep(0.05)
"""


def _tcp_tree(tmp_path):
    log = open(tmp_path / "out.log", "ab")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", os.sys.executable, "-c", _TCP_PAIR],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    for _ in range(100):
        kids = psutil.Process(p.pid).children()
        if kids and (tmp_path / "out.log").stat().st_size > 0:
            return p, kids[0].pid
        time.sleep(0.05)
    raise AssertionError("the TCP pair did not start")


def _counts(log: Path) -> list[int]:
    """The round trips the TCP pair logged (the launcher's own lines, e.g. unshare's complaint
    when CRIU killed its child, left out)."""
    return [int(x) for x in log.read_text().split() if x.isdigit()]


def test_network_lock_is_chosen_by_what_the_host_has(tmp_path):
    binary = criu.check()
    got = criu.network_lock_method(binary, tmp_path)
    nft = subprocess.run([binary, "check", "--feature", "network_lock_nftables"], capture_output=True).returncode == 0
    assert got == ("nftables" if nft else "iptables" if shutil.which("iptables-restore") else None)
    assert json.loads((tmp_path / "criu-netlock.json").read_text())["network_lock"] == got


def test_a_host_without_any_network_lock_is_refused_naming_both(tmp_path, monkeypatch):
    fake = tmp_path / "criu"  # a CRIU whose nftables check fails, on a PATH without iptables
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert criu.network_lock_method(str(fake)) is None
    with pytest.raises(HostError) as e:
        criu.require_network_lock(str(fake), why="profile tiny-tp2 (TP2)")
    msg = str(e.value)
    assert "profile tiny-tp2 (TP2)" in msg and "network_lock_nftables" in msg and "iptables" in msg


def test_established_tcp_dumps_and_restores_under_the_hosts_network_lock(tmp_path):
    binary = criu.check()
    if criu.network_lock_method(binary) is None:
        pytest.fail("this host has no CRIU network lock (nftables or iptables): scripts/install.sh installs one")
    launcher, root = _tcp_tree(tmp_path)
    criu.dump(root, tmp_path / "img")  # network_lock="auto": the host's method
    launcher.wait(10)
    lines = _counts(tmp_path / "out.log")
    new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    try:
        time.sleep(0.6)
        after = _counts(tmp_path / "out.log")
        assert after[-1] > lines[-1] + 3  # the restored connection still talks
    finally:
        kill_tree(ProcessId.of(new_root))


def test_established_tcp_without_a_usable_lock_fails_the_dump_and_the_tree_keeps_running(tmp_path):
    criu.check()
    if shutil.which("iptables-restore"):
        pytest.skip("iptables is installed here: CRIU's default lock works (this shows the failure without it)")
    launcher, root = _tcp_tree(tmp_path)
    try:
        with pytest.raises(CheckpointError, match="criu dump of pid .* failed"):
            criu.dump(root, tmp_path / "img", network_lock=None, leave_running=True)  # CRIU's default: iptables
        n = _counts(tmp_path / "out.log")[-1]
        time.sleep(0.4)
        assert _counts(tmp_path / "out.log")[-1] > n  # resumed: still talking
    finally:
        kill_tree(ProcessId.of(root))
        launcher.wait(10)


#: A process that asks for the AMX tile-data permission where the kernel offers it, then writes
#: its permitted-feature mask (ARCH_GET_XCOMP_PERM) to out.log every 50 ms.
_XCOMP_PERM_LOOP = """
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(158, 0x1023, 18)  # ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA (fails harmlessly without AMX)
while True:
    m = ctypes.c_uint64(0)
    libc.syscall(158, 0x1022, ctypes.byref(m))  # ARCH_GET_XCOMP_PERM
    print(hex(m.value), flush=True)
    time.sleep(0.05)
"""


def _perm_after_restore(tmp_path, restore_env=None) -> tuple[int, int]:
    """Dump and restore the permission loop (``restore_env``: replaces :func:`criu.restore_env`
    for the restore); the masks the process read before the dump and after the restore."""
    import sys

    out = tmp_path / "out.log"
    with open(out, "ab") as log:
        p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", _XCOMP_PERM_LOOP],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    for _ in range(200):
        kids = psutil.Process(p.pid).children()
        if kids and out.stat().st_size:
            break
        time.sleep(0.05)
    before = int(out.read_text().split()[-1], 16)
    criu.dump(kids[0].pid, tmp_path / "img")
    p.wait(10)
    if restore_env is not None:
        real = criu.restore_env
        criu.restore_env = restore_env
    try:
        new_root, _ = criu.restore(tmp_path / "img", tmp_path / "pid")
    finally:
        if restore_env is not None:
            criu.restore_env = real
    try:
        n = len(out.read_text().split())
        deadline = time.monotonic() + 10
        while len(out.read_text().split()) < n + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        after = int(out.read_text().split()[-1], 16)
    finally:
        kill_tree(ProcessId.of(new_root), timeout_s=0)  # Python as a namespace's PID 1 ignores SIGTERM
    return before, after


def test_a_restored_process_keeps_its_amx_permission(tmp_path):
    """On an AMX host the restored process still holds the tile-data permission it asked for
    (without it vLLM's CPU worker dies with SIGILL at the first request after a restore); on
    any other host no library is preloaded and the mask is what it was."""
    before, after = _perm_after_restore(tmp_path)
    if criu.xtile_offered():
        assert criu.restore_env()["LD_PRELOAD"].split(":")[0] == str(criu.xtile_perm_lib())
        assert before >> 18 & 1, hex(before)
        assert after >> 18 & 1, f"AMX permission lost in the restore: {before:#x} -> {after:#x}"
    else:
        assert criu.restore_env() is None
        assert after == before


def test_criu_alone_drops_the_amx_permission(tmp_path):
    """Why the library exists: restored by CRIU without it, the permission is gone (when a
    CRIU restores it itself, this fails and the preload can go). Skipped, saying so, on a host
    without AMX: there is no permission to drop, so nothing to show (that the same restore keeps
    the mask there is test_a_restored_process_keeps_its_amx_permission's)."""
    if not criu.xtile_offered():
        pytest.skip("this host's kernel offers no AMX tile data (XFEATURE_XTILEDATA): no permission for CRIU to drop")
    before, after = _perm_after_restore(tmp_path, restore_env=lambda xtile_lib=None: None)
    assert before >> 18 & 1 and not after >> 18 & 1, f"{before:#x} -> {after:#x}"


def test_an_amx_host_without_the_library_is_refused_before_any_restore():
    missing = Path("/nonexistent/criu-xtile-perm.so")  # the xtile_perm_lib setting, passed down
    if criu.xtile_offered():
        with pytest.raises(HostError, match=r"AMX.*SIGILL.*/nonexistent/criu-xtile-perm.so.*scripts/install.sh"):
            criu.check(xtile_lib=missing)
    else:
        assert criu.check(xtile_lib=missing)  # nothing to preload: the missing library does not matter


def test_the_host_lock_is_the_file_it_is_given(tmp_path):
    """The criu_lock setting's file serializes CRIU operations: a second holder of the same file
    waits and then fails naming it; another file is another lock."""
    lock = tmp_path / "locks" / "criu.lock"
    waited = []
    with criu.host_lock(path=lock):
        assert lock.is_file()
        with pytest.raises(CheckpointError, match=f"held {lock} for 0 s"):
            with criu.host_lock(timeout_s=0.3, path=lock, on_wait=lambda: waited.append(1)):
                pass
        with criu.host_lock(timeout_s=0.3, path=tmp_path / "other.lock"):
            pass
    assert waited == [1]



def test_a_dump_past_its_bound_is_killed_and_leaves_nothing(tmp_path):
    """A dump that stalls for real: its ``pstree.img`` is a FIFO nobody reads, so CRIU, having
    seized and frozen the tree and linked its open-but-removed file as ``link_remap.N``, blocks
    opening it for ever. Bounded at 1 s, warmctl kills CRIU, removes the partial image and that
    ``link_remap`` file, and raises DumpTimeout naming
    the phase, the bound and the seconds waited; the tree, released, runs on. The default bound
    grows with the tree's memory."""
    from warmctl.checkpoint.rankfaults import _tracer

    # a file open under a removed name that another name links: CRIU links it as link_remap.N
    held = criu.SHM / f"warmctl-test-{os.getpid()}"
    held.with_suffix(".tmp").write_bytes(b"x")
    os.link(held.with_suffix(".tmp"), held)
    inode = _inode(str(held))
    try:
        launcher, root = _tree(tmp_path, f"exec 3<{held}.tmp; rm {held}.tmp; ")
    except BaseException:
        held.unlink()
        held.with_suffix(".tmp").unlink(missing_ok=True)
        raise
    try:
        for _ in range(100):  # the tree has opened it and removed that name
            if not held.with_suffix(".tmp").exists():
                break
            time.sleep(0.05)
        assert not held.with_suffix(".tmp").exists(), "the tree did not open and remove its file"
        assert criu.DUMP_FLOOR_S <= criu.dump_timeout(root) < criu.DUMP_FLOOR_S + 1
        img = tmp_path / "img"
        img.mkdir()
        os.mkfifo(img / "pstree.img")
        # under the host's CRIU lock, as the pipelines dump: the clean-up of a killed dump removes
        # every link_remap file made since it began, and a dump of the session's snapshots built
        # ahead (seen in CI) lost its own link_remap to it and stored a snapshot CRIU could not
        # restore ("Can't link dev/shm/link_remap.244 -> dev/shm/sem.EamYHs")
        with criu.host_lock():
            t0 = time.monotonic()
            with pytest.raises(criu.DumpTimeout) as e:
                criu.dump(root, img, timeout_s=1.0)
            took = time.monotonic() - t0
        assert 1.0 <= took < 1.0 + 3, took
        msg = str(e.value)
        assert "criu_dump phase stalled" in msg and f"criu dump of pid {root}" in msg and "bound of 1 s" in msg, msg
        killed = re.search(r"killed after (\d+\.\d) s", msg)  # 1.x s, later on a loaded host (2.1 s seen)
        assert killed and 1.0 <= float(killed.group(1)) <= took + 0.05 and "dump_timeout_s" in msg, msg
        assert isinstance(e.value, CheckpointError) and e.value.exit_code == criu.DumpTimeout.exit_code > 12
        assert not img.exists()  # no partial image
        # none of its link_remap files: by inode, as the session's snapshots built ahead dump and
        # store their own engines' link_remap files meanwhile
        assert inode not in {_inode(str(x)) for x in criu.SHM.glob("link_remap.*")}
        assert not [c for c in psutil.Process().children(recursive=True) if "criu" in c.name()]  # CRIU reaped
        assert _tracer(root) == 0 and psutil.Process(root).status() != psutil.STATUS_STOPPED  # released
        size = (tmp_path / "out.log").stat().st_size
        time.sleep(0.5)
        assert (tmp_path / "out.log").stat().st_size > size  # and it runs on
    finally:
        os.kill(root, signal.SIGKILL)  # the namespace's init: SIGTERM it ignores
        launcher.wait(10)
        held.unlink(missing_ok=True)


def test_a_criu_killed_past_its_bound_takes_what_it_forked_with_it(tmp_path):
    """CRIU killed past its bound is killed with what it forked: here its pre-dump action script,
    which CRIU waits for (it runs before the tree is seized). Before, only CRIU was killed: the
    script ran on, orphaned. So did, in CI, the child CRIU stops under ptrace to probe the CPU
    (a ``criu dump`` killed 25-40 ms in, about 1 time in 15 here), stopped for good and holding
    CRIU's stdout and stderr: reaping CRIU by its pipes hung, and ``snapshot`` with it."""
    launcher, root = _tree(tmp_path)
    held = tmp_path / "script.pid"
    script = tmp_path / "hold.sh"
    script.write_text(f'#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] || exit 0\necho $$ > {held}\nexec sleep 600\n')
    script.chmod(0o700)
    img = tmp_path / "img"
    img.mkdir()
    try:
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match="did not finish within its bound of 2 s"):
            criu._run(["criu", "dump", "-t", str(root), "-D", str(img), "-o", "dump.log", "--action-script",
                       str(script)], "criu dump", img / "dump.log", 2.0)
        assert time.monotonic() - t0 < 2.0 + criu.REAP_TIMEOUT_S
        script_pid = int(held.read_text())  # it ran, and blocked CRIU
        assert not psutil.pid_exists(script_pid) or psutil.Process(script_pid).status() == psutil.STATUS_ZOMBIE
        assert not [c for c in psutil.Process().children(recursive=True) if "criu" in c.name()]  # CRIU reaped
        assert psutil.Process(root).status() != psutil.STATUS_STOPPED  # the tree, never seized, runs on
    finally:
        if held.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(held.read_text()), signal.SIGKILL)
        os.kill(root, signal.SIGKILL)
        launcher.wait(10)


def test_a_dump_whose_link_remap_file_is_removed_while_it_runs_fails_naming_it(tmp_path):
    """A file open under a removed name needs its ``link_remap.N`` at restore. Removed while the
    dump runs (as a killed dump's clean-up outside the host lock once did), the image could
    never be restored: criu.dump fails naming the link and the file it stands for, instead of
    handing on an image every restore of which fails in CRIU."""
    import threading

    name = f"warmctl-test-rm-{os.getpid()}"
    shm = Path("/dev/shm")
    # a tree with 256 MiB touched, so that its dump takes a while, holding its file open under a
    # name it removed (another name links it, as glibc's sem_open leaves a semaphore)
    code = (f"import os, time; f = open('/dev/shm/{name}.tmp', 'w+b'); f.write(b'x'); f.flush(); "
            f"os.link('/dev/shm/{name}.tmp', '/dev/shm/{name}'); os.unlink('/dev/shm/{name}.tmp'); "
            "m = bytearray(256 << 20); m[::4096] = b'y' * (len(m) // 4096)\n"
            "while True: time.sleep(0.1)")
    launcher, root = _tree(tmp_path, f"exec python3 -c \"{code}\"; ")
    mine = None
    try:
        for _ in range(200):  # the file linked, its first name removed, the memory touched
            if (shm / name).exists() and not (shm / f"{name}.tmp").exists() \
                    and psutil.Process(root).memory_info().rss > 200 << 20:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the tree did not start")
        st = os.stat(shm / name)
        mine = (st.st_dev, st.st_ino)
        removed: list[str] = []
        done = threading.Event()

        def remove_its_link_remap() -> None:  # as soon as CRIU links it
            while not done.is_set() and not removed:
                for p in shm.glob("link_remap.*"):
                    if _inode(str(p)) == mine:
                        p.unlink()
                        removed.append(p.name)
                time.sleep(0.001)

        t = threading.Thread(target=remove_its_link_remap)
        t.start()
        try:
            with criu.host_lock(), pytest.raises(CheckpointError) as e:
                criu.dump(root, tmp_path / "img")
        finally:
            done.set()
            t.join()
        assert removed, "the link_remap file was not seen during the dump"
        msg = str(e.value)
        assert f"/dev/shm/{removed[0]} (the removed /dev/shm/{name}.tmp)" in msg and "dump again" in msg, msg
        assert not [p for p in shm.iterdir() if _inode(str(p)) == mine and p.name != name]  # nothing of it left
    finally:
        launcher.kill()
        launcher.wait(10)
        if psutil.pid_exists(root):
            os.kill(root, signal.SIGKILL)
        if mine is not None:
            capture.remove_by_inode([mine])
        (shm / name).unlink(missing_ok=True)
