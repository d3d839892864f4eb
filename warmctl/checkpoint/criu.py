"""CRIU: dump a whole process tree to an image directory and restore it.

Flags (verified with CRIU 4.2.1 on kernel 6.18 against a running ``vllm serve`` tree, see
``docs/design.md``, "Making a vLLM tree checkpointable"):

- dump: ``--tcp-established --ext-unix-sk --file-locks --link-remap --manage-cgroups=ignore``
- restore: the same minus ``--link-remap``, plus ``--restore-detached --pidfile``.

CRIU's plugins are kept out of the way: every dump and restore runs with ``--libdir`` set to
a fresh directory (:func:`_plugin_libdir`), empty unless the caller names plugins, so a host's
CRIU plugins (``/usr/lib/criu``, ``$CRIU_LIBS_DIR``) are never loaded unasked. An AMD profile
names ``amdgpu_plugin.so`` (the plan's ``criu_plugins``): the directory then holds a link to
that one plugin in the host's plugin directory (:func:`warmctl.host.criu_plugin_dir`), and
nothing else. Why: CRIU 4.x's ``cuda_plugin`` records itself in the
image and, at restore, restores and unlocks every CUDA process inside ``criu restore``, before
warmctl's free-GPU-memory check and GPU remapping (:mod:`warmctl.checkpoint.ranks`); warmctl
would then meet RUNNING ranks. warmctl does the CUDA checkpoint itself, around CRIU. An image
dumped with a plugin also needs that plugin at restore (CRIU checks the image's inventory), so
warmctl's images record none.

``--link-remap`` makes CRIU keep open-but-unlinked files reachable through ``link_remap.*``
hard links next to them (for vLLM: multiprocessing semaphores in ``/dev/shm``); those files
must exist again at restore.

The CRIU binary is the ``criu`` setting (config file or ``$WARMCTL_CRIU``), else ``criu`` on
``PATH``, else ``/usr/local/sbin/criu`` (where ``scripts/install.sh`` puts a source build).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from warmctl.errors import CheckpointError, HostError

SHM = Path("/dev/shm")
#: Prefix of the hard links the post-dump script makes to CRIU's link_remap files.
KEPT_PREFIX = ".warmctl-kept-"
#: CRIU action script for dumps with --leave-running (see :func:`dump`). CRIU runs it with
#: CRTOOLS_SCRIPT_ACTION set; a non-zero exit at post-dump makes the dump fail and the tree resume.
KEEP_REMAPS_SCRIPT = f"""#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0
for f in {SHM}/link_remap.*; do
  [ -e "$f" ] || continue
  ln -f "$f" "{SHM}/{KEPT_PREFIX}${{f##*/}}" || exit 1
done
exit 0
"""

DUMP_FLAGS = ["--tcp-established", "--ext-unix-sk", "--file-locks", "--link-remap",
              "--manage-cgroups=ignore"]
RESTORE_FLAGS = ["--tcp-established", "--ext-unix-sk", "--file-locks", "--manage-cgroups=ignore"]
#: Oldest CRIU known to dump a vLLM tree on kernels >= 6.16 (4.1 fails on TCP sockets there).
MIN_VERSION = (4, 2)


def criu_binary(configured: str | None = None) -> str:
    """Path of the CRIU binary: ``configured`` (the ``criu`` setting: a path, or a name looked
    up in ``PATH``), else ``$WARMCTL_CRIU``, else ``criu`` on ``PATH``, else
    ``/usr/local/sbin/criu``. Raises :class:`HostError` if none is found."""
    wanted = configured if configured and configured != "criu" else os.environ.get("WARMCTL_CRIU")
    if wanted:
        found = shutil.which(wanted)
        if not found:
            raise HostError(f"CRIU binary {wanted!r} (from the criu setting / WARMCTL_CRIU) is not an executable")
        return found
    found = shutil.which("criu") or ("/usr/local/sbin/criu" if os.access("/usr/local/sbin/criu", os.X_OK) else None)
    if not found:
        raise HostError("criu not found (PATH, /usr/local/sbin/criu); run scripts/install.sh or set WARMCTL_CRIU")
    return found


def criu_version(binary: str | None = None) -> tuple[int, ...] | None:
    """CRIU's version as a tuple, e.g. (4, 2, 1); None if criu is missing or unparsable."""
    try:
        out = subprocess.run([binary or criu_binary(), "--version"], capture_output=True,
                             text=True, timeout=10).stdout
    except (HostError, OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*([\d.]+)", out)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def check(configured: str | None = None) -> str:
    """Verify CRIU is usable: version >= :data:`MIN_VERSION` and root privileges.

    ``configured``: see :func:`criu_binary`. Returns the binary path. Raises
    :class:`HostError` saying what is wrong and how to fix it.
    """
    binary = criu_binary(configured)
    ver = criu_version(binary)
    if ver is None:
        raise HostError(f"{binary}: cannot read its version")
    if ver < MIN_VERSION:
        raise HostError(f"{binary} is CRIU {'.'.join(map(str, ver))}; warmctl needs >= "
                        f"{'.'.join(map(str, MIN_VERSION))} (scripts/install.sh builds it)")
    if os.geteuid() != 0:
        raise HostError("CRIU needs root (or CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN)")
    return binary


#: Host-wide lock serializing CRIU dumps and restores (see :func:`host_lock`).
LOCK_PATH = Path(os.environ.get("WARMCTL_CRIU_LOCK", "/run/lock/warmctl-criu.lock"))


@contextmanager
def host_lock(timeout_s: float = 900.0, on_wait=None) -> Iterator[None]:
    """Hold the host-wide CRIU lock (``flock`` on :data:`LOCK_PATH`) for a dump or restore.

    Why: CRIU names the hard links it makes for unlinked files by file id (``link_remap.246``
    in ``/dev/shm`` for every vLLM ``tiny`` snapshot), so a dump or restore running while
    another one has such a file in place can delete or overwrite the other's (observed: a
    restore failing with "Couldn't unlink remap /dev/shm/link_remap.246"). ``on_wait()`` is
    called once if the lock is busy. Raises :class:`CheckpointError` after ``timeout_s``.
    """
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_PATH, "a+") as f:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited and on_wait:
                    on_wait()
                waited = True
                if time.monotonic() > deadline:
                    raise CheckpointError(f"another CRIU dump/restore held {LOCK_PATH} for {timeout_s:.0f} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _plugin_libdir(plugins: Sequence[str] = (), binary: str | None = None) -> Iterator[list[str]]:
    """CRIU options that load exactly ``plugins`` (file names such as ``amdgpu_plugin.so``):
    ``["--libdir", <fresh directory>]`` holding a symbolic link to each, in the host's CRIU
    plugin directory (:func:`warmctl.host.criu_plugin_dir`); no plugins: an empty directory, so
    none loads. The directory is removed afterwards. Raises :class:`HostError` naming the
    plugin directory when a plugin is not there."""
    d = tempfile.mkdtemp(prefix="warmctl-criu-plugins-" if plugins else "warmctl-criu-noplugins-")
    try:
        if plugins:
            from warmctl.host import criu_plugin_dir

            src = criu_plugin_dir(binary or "criu")
            for name in plugins:
                if not (src / name).is_file():
                    raise HostError(f"CRIU plugin {name} not found in {src} (CRIU's plugin directory; "
                                    "install CRIU's plugin or set CRIU_LIBS_DIR)")
                os.symlink(src / name, os.path.join(d, name))
        yield ["--libdir", d]
    finally:
        shutil.rmtree(d, ignore_errors=True)



def _log_tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return "\n".join((errs or lines)[-n:])


def _run(cmd: list[str], what: str, log: Path, timeout_s: float, plugins: Sequence[str] = ()) -> float:
    """Run a CRIU command (with :func:`_plugin_libdir` of ``plugins`` appended); seconds it took.
    Raises :class:`CheckpointError` naming ``what`` with the relevant lines of ``log`` on failure
    or after ``timeout_s``."""
    t0 = time.monotonic()
    try:
        with _plugin_libdir(plugins, cmd[0]) as libdir:
            r = subprocess.run([*cmd, *libdir], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{what} did not finish in {timeout_s:.0f} s") from None
    if r.returncode != 0:
        raise CheckpointError(f"{what} failed (exit {r.returncode}); {log}:\n{_log_tail(log)}")
    return time.monotonic() - t0


def dump(root_pid: int, images_dir: Path, *, leave_running: bool = False, timeout_s: float = 600,
         binary: str | None = None, plugins: Sequence[str] = ()) -> float:
    """Dump the tree rooted at ``root_pid`` into ``images_dir`` (created if needed).

    Returns the seconds it took. The tree is killed after a successful dump unless
    ``leave_running``. Either way the ``link_remap.N`` files CRIU made in ``/dev/shm`` for
    deleted-but-open files are left there for the caller to store (a restore needs them):
    with ``--leave-running`` CRIU deletes them once the dump is done (``cr-dump.c``,
    ``delete_link_remaps`` after the post-dump action script), so a post-dump action script
    hard-links them aside first and they are put back under their names here. Raises
    :class:`CheckpointError` with the relevant lines of CRIU's log (``images_dir/dump.log``) on
    failure; the tree then keeps running (CRIU resumes it). ``plugins``: CRIU plugins to load
    (:func:`_plugin_libdir`; ``amdgpu_plugin.so`` for AMD GPU state), none by default.
    """
    images_dir = Path(images_dir)
    images_dir.mkdir(parents=True, exist_ok=True)
    cmd = [check(binary), "dump", "-t", str(root_pid), "-D", str(images_dir), "-o", "dump.log", "-v2",
           *DUMP_FLAGS]
    if not leave_running:
        return _run(cmd, f"criu dump of pid {root_pid}", images_dir / "dump.log", timeout_s, plugins)
    script = images_dir.parent / f".warmctl-post-dump-{os.getpid()}.sh"
    script.write_text(KEEP_REMAPS_SCRIPT)
    script.chmod(0o700)
    try:
        return _run([*cmd, "--leave-running", "--action-script", str(script)], f"criu dump of pid {root_pid}",
                    images_dir / "dump.log", timeout_s, plugins)
    finally:
        script.unlink(missing_ok=True)
        for kept in SHM.glob(KEPT_PREFIX + "link_remap.*"):
            name = SHM / kept.name[len(KEPT_PREFIX):]
            if name.exists():  # CRIU kept it (dump failed before the clean-up): one name is enough
                kept.unlink()
            else:
                kept.rename(name)


def restore(images_dir: Path, pidfile: Path, *, log_file: Path | None = None, timeout_s: float = 600,
            binary: str | None = None, work_dir: Path | None = None,
            plugins: Sequence[str] = ()) -> tuple[int, float]:
    """Restore the tree in ``images_dir``, detached. Returns (host PID of its root, seconds).

    ``log_file`` defaults to ``images_dir/restore.log``. ``work_dir``: where CRIU writes what
    else it writes (its ``stats-restore`` file; CRIU's default is the image directory), so a
    read-only, reused image directory stays unchanged. Raises :class:`CheckpointError` with
    the relevant lines of CRIU's log on failure (CRIU kills what it partly restored).
    ``plugins``: as for :func:`dump` (an image dumped with a plugin needs it at restore).
    """
    images_dir = Path(images_dir)
    log_file = Path(log_file or images_dir / "restore.log")
    pidfile = Path(pidfile)
    pidfile.unlink(missing_ok=True)
    cmd = [check(binary), "restore", "-D", str(images_dir), "-o", str(log_file), "-v2",
           "--restore-detached", "--pidfile", str(pidfile), *RESTORE_FLAGS]
    if work_dir is not None:
        cmd += ["-W", str(work_dir)]
    secs = _run(cmd, f"criu restore from {images_dir}", log_file, timeout_s, plugins)
    return int(pidfile.read_text().strip()), secs
