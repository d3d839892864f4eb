"""CRIU: dump a whole process tree to an image directory and restore it.

Flags (verified with CRIU 4.2.1 on kernel 6.18 against a running ``vllm serve`` tree, see
``docs/design.md``, "Making a vLLM tree checkpointable"):

- dump: ``--tcp-established --ext-unix-sk --file-locks --link-remap --manage-cgroups=ignore``
- restore: the same minus ``--link-remap``, plus ``--restore-detached --pidfile``.

CRIU's plugins are kept out of the way: every dump and restore runs with ``--libdir`` set to
a fresh directory (:func:`_plugin_libdir`), empty unless the caller names plugins, so a host's
CRIU plugins (``/usr/lib/criu``, ``$CRIU_LIBS_DIR``) are never loaded unasked. An AMD profile
names ``amdgpu_plugin.so`` (the plan's ``criu_plugins``): the directory then holds a link to
that one plugin in the host's plugin directory (:func:`criu_plugin_dir`), and
nothing else. Why: CRIU 4.x's ``cuda_plugin`` records itself in the
image and, at restore, restores and unlocks every CUDA process inside ``criu restore``, before
warmctl's free-GPU-memory check and GPU remapping (:mod:`warmctl.checkpoint.ranks`); warmctl
would then meet RUNNING ranks. warmctl does the CUDA checkpoint itself, around CRIU. An image
dumped with a plugin also needs that plugin at restore (CRIU checks the image's inventory), so
warmctl's images record none.

``--link-remap`` makes CRIU keep open-but-unlinked files reachable through ``link_remap.*``
hard links next to them (for vLLM: multiprocessing semaphores in ``/dev/shm``); those files
must exist again at restore.

On a CPU with AMX, a restored process would have lost the kernel's permission to use the tile
registers (CRIU 4.2 does not dump it) and die with SIGILL at its next AMX instruction: every
``criu restore`` there runs with ``criu-xtile-perm.so`` preloaded (``xtile_perm.c`` beside this
file, built by ``scripts/install.sh``), which asks for the permission in CRIU before it forks
the restored tasks; they inherit it (:func:`restore_env`).

The CRIU binary is the ``criu`` setting (config file or ``$WARMCTL_CRIU``) the caller passes
as ``binary``/``configured``, else ``criu`` on ``PATH``, else ``/usr/local/sbin/criu`` (where
``scripts/install.sh`` puts a source build). Nothing here reads the environment or the config
file: the library path (``xtile_lib``, the ``xtile_perm_lib`` setting) and the host lock's
file (``path``, the ``criu_lock`` setting) are passed in the same way, with the defaults
:data:`XTILE_PERM_LIB` and :data:`LOCK_PATH`.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from warmctl.base.errors import CheckpointError, HostError
from warmctl.base.flock import lock_exclusive
from warmctl.base.proc import ProcessId, kill_child
from warmctl.checkpoint import criuimage

log = logging.getLogger(__name__)

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


def _unescape(field: str) -> str:
    """A ``/proc/PID/mountinfo`` path field decoded (the kernel writes space, tab, newline and
    backslash as ``\\NNN`` octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points(pid: int | str = "self") -> list[str]:
    """The mount points of ``pid``'s mount namespace (``/proc/PID/mountinfo``, field 5), in
    order, each once. Raises OSError if the process is gone."""
    seen: dict[str, None] = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if len(fields) > 4:
            seen.setdefault(_unescape(fields[4]), None)
    return list(seen)


def mount_flags(pid: int | str = "self") -> list[str]:
    """CRIU's ``--external mnt[P]:P`` for every mount point ``P`` that ``pid`` sees but ``/``
    and ``/proc``: how a tree in a mount namespace of its own (:mod:`warmctl.engine.launch`)
    is dumped. A mount keyed ``P`` at the dump is bind-mounted from the path given for ``P`` at
    the restore (CRIU 4.2, ``criu/mount.c``; :func:`restore_mount_flags`); keys the image
    lacks are ignored, and for an image of a tree that had no mount namespace of its own the
    flags change nothing (both seen with CRIU 4.2.1). The tree's own ``/proc`` is dumped and
    mounted anew for its PID namespace. Mount points whose path holds ``]`` or ``:`` cannot be
    named in this syntax and are left out (CRIU then names them if the dump needs them)."""
    return [f for p in mount_points(pid) if p not in ("/", "/proc") and not set(p) & set("]:")
            for f in ("--external", f"mnt[{p}]:{p}")]


def restore_mount_flags(keys: Sequence[str]) -> list[str]:
    """CRIU's ``--external mnt[K]:K`` for each external mount key ``K`` of an image
    (:func:`warmctl.checkpoint.criuimage.external_mounts`): the tree's mount at ``K`` is bound
    from this host's path ``K``, a mount point or not, so the tree sees what a fresh start here
    would. The keys are the dump host's mount points, and another host (or the same one later)
    may lack some: a login's ``/run/user/N``, a removed disk, another pod's secrets. CRIU needs the path under the root
    and fails without it (``Can't stat mountpoint``), so a missing one is made here, an empty
    directory (mode 0755, left in place): a mount the tree never used then costs nothing, and
    one it holds a file open on fails the restore with CRIU naming the file. Raises
    :class:`CheckpointError` naming the path if a missing one cannot be made."""
    flags = []
    for k in keys:
        if not os.path.lexists(k):
            log.info("criu restore: the image's mount point %s is missing here; made as an empty directory", k)
            try:
                os.makedirs(k, mode=0o755, exist_ok=True)
            except OSError as e:
                raise CheckpointError(f"the snapshot's process tree had a mount at {k}, which this host lacks, "
                                      f"and its mount point cannot be made: {e.strerror or e}") from e
        flags += ["--external", f"mnt[{k}]:{k}"]
    return flags


def own_mount_ns(pid: int) -> bool:
    """True if ``pid`` lives in another mount namespace than this process. Raises OSError if
    it is gone."""
    return os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")


def criu_binary(configured: str | None = None) -> str:
    """Path of the CRIU binary: ``configured`` (the ``criu`` setting, ``$WARMCTL_CRIU``: a
    path, or a name looked up in ``PATH``), else ``criu`` on ``PATH``, else
    ``/usr/local/sbin/criu``. Raises :class:`HostError` if none is found."""
    wanted = configured if configured and configured != "criu" else None
    if wanted:
        found = shutil.which(wanted)
        if not found:
            raise HostError(f"CRIU binary {wanted!r} (from the criu setting / WARMCTL_CRIU) is not an executable")
        return found
    found = shutil.which("criu") or ("/usr/local/sbin/criu" if os.access("/usr/local/sbin/criu", os.X_OK) else None)
    if not found:
        raise HostError("criu not found (PATH, /usr/local/sbin/criu); run scripts/install.sh or set WARMCTL_CRIU")
    return found


def version_string(binary: str) -> str | None:
    """What ``binary --version`` says after ``Version:`` (``4.2.1``): the one CRIU version
    probe. None when it cannot run, fails, or prints no ``Version:`` line (10 s at most)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*(\S+)", out.stdout + out.stderr)
    return m.group(1) if m and out.returncode == 0 else None


def criu_version(binary: str | None = None) -> tuple[int, ...] | None:
    """CRIU's version as a tuple, e.g. (4, 2, 1) (:func:`version_string` of ``binary``, by
    default :func:`criu_binary`); None if criu is missing or unparsable."""
    try:
        text = version_string(binary or criu_binary())
    except HostError:
        return None
    m = re.match(r"\d+(?:\.\d+)*", text or "")
    return tuple(int(x) for x in m.group(0).split(".")) if m else None


def check(configured: str | None = None, xtile_lib: Path | None = None) -> str:
    """Verify CRIU is usable: version >= :data:`MIN_VERSION`, root privileges, and on a CPU
    with AMX the library that keeps restored engines' AMX permission (:func:`restore_env`;
    ``xtile_lib``: its path, the ``xtile_perm_lib`` setting, default :data:`XTILE_PERM_LIB`).

    ``configured``: see :func:`criu_binary`. Returns the binary path. Raises
    :class:`HostError` saying what is wrong and how to fix it.
    """
    binary = _usable(configured)
    restore_env(xtile_lib)  # an AMX host without criu-xtile-perm.so: refused before any engine starts
    return binary


def _usable(configured: str | None) -> str:
    """:func:`check` less the restore library (what a dump needs): the binary's path."""
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


#: The library ``scripts/install.sh`` builds from ``xtile_perm.c`` (the ``xtile_perm_lib``
#: setting, ``$WARMCTL_XTILE_PERM_LIB``, names another).
XTILE_PERM_LIB = Path("/usr/local/lib/warmctl/criu-xtile-perm.so")
#: ``arch_prctl`` on x86-64 (``arch/x86/entry/syscalls/syscall_64.tbl``), its query for the
#: dynamically enabled state components the kernel supports (``ARCH_GET_XCOMP_SUPP``,
#: ``arch/x86/include/uapi/asm/prctl.h``) and AMX tile data's component number.
_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_SUPP, _XFEATURE_XTILEDATA = 158, 0x1021, 18


def xtile_offered() -> bool:
    """True if this kernel lets processes use AMX tile data (``ARCH_GET_XCOMP_SUPP`` has bit
    18): the CPU has AMX and the kernel enables it on request. False elsewhere (no AMX, an older
    kernel, not x86-64)."""
    if platform.machine() != "x86_64":
        return False
    mask = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def xtile_perm_lib(path: str | Path | None = None) -> Path:
    """Path of ``criu-xtile-perm.so``: ``path`` (the ``xtile_perm_lib`` setting) or
    :data:`XTILE_PERM_LIB`."""
    return Path(path or XTILE_PERM_LIB)


def restore_env(xtile_lib: str | Path | None = None) -> dict[str, str] | None:
    """Environment for ``criu restore`` on this host: None (CRIU's own) where the kernel offers
    no AMX (:func:`xtile_offered`); else the current environment with the library
    (:func:`xtile_perm_lib` of ``xtile_lib``) first in ``LD_PRELOAD``, so the restored tasks
    keep the AMX permission their originals had (module doc). Raises :class:`HostError` naming
    the library and the fix if it is missing."""
    if not xtile_offered():
        return None
    lib = xtile_perm_lib(xtile_lib)
    if not lib.is_file():
        raise HostError(f"this CPU has AMX, and CRIU does not restore a process's AMX permission: a restored engine "
                        f"would die with SIGILL; {lib} (built from warmctl/checkpoint/xtile_perm.c) gives it back "
                        "but is missing: run scripts/install.sh (or set xtile_perm_lib / WARMCTL_XTILE_PERM_LIB)")
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(x for x in (str(lib), env.get("LD_PRELOAD", "")) if x)
    return env


#: Host-wide lock serializing CRIU dumps and restores, by default (see :func:`host_lock`; the
#: ``criu_lock`` setting, ``$WARMCTL_CRIU_LOCK``, names another).
LOCK_PATH = Path("/run/lock/warmctl-criu.lock")


@contextmanager
def host_lock(timeout_s: float = 900.0, on_wait=None, path: str | Path | None = None) -> Iterator[None]:
    """Hold the host-wide CRIU lock (``flock`` on ``path``, the ``criu_lock`` setting, default
    :data:`LOCK_PATH`) for a dump or restore.

    Why: CRIU names the hard links it makes for unlinked files by file id (``link_remap.246``
    in ``/dev/shm`` for every vLLM ``tiny`` snapshot), so a dump or restore running while
    another one has such a file in place can delete or overwrite the other's (observed: a
    restore failing with "Couldn't unlink remap /dev/shm/link_remap.246"). ``on_wait()`` is
    called once if the lock is busy. Raises :class:`CheckpointError` after ``timeout_s``.
    """
    lock_path = Path(path or LOCK_PATH)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        try:
            lock_exclusive(f, on_wait, timeout_s)
        except TimeoutError:
            raise CheckpointError(f"another CRIU dump/restore held {lock_path} for {timeout_s:.0f} s") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


#: Where CRIU looks for plugins when neither ``--libdir`` nor ``$CRIU_LIBS_DIR`` names a
#: directory: its build-time ``CR_PLUGIN_DEFAULT`` (``criu/include/plugin.h``), which
#: ``criu --help`` prints; this is the fallback when the help text does not say.
CRIU_PLUGIN_DEFAULT = "/usr/lib/criu/"
_CRIU_LIBDIR_HELP = re.compile(r"--libdir\s+path to a plugin directory \(by default ([^)\s]+)\)")


def criu_plugin_dir(criu: str = "criu") -> Path:
    """CRIU's plugin directory, as CRIU itself picks it (``criu/plugin.c``): ``$CRIU_LIBS_DIR``,
    else the default its ``--help`` prints for ``--libdir``, else :data:`CRIU_PLUGIN_DEFAULT`."""
    env = os.environ.get("CRIU_LIBS_DIR")
    if env:
        return Path(env)
    exe = shutil.which(criu) or shutil.which(criu, path=os.pathsep.join(["/usr/local/sbin", "/usr/sbin", "/sbin"]))
    if exe:
        try:
            out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10)
            m = _CRIU_LIBDIR_HELP.search(out.stdout + out.stderr)
            if m:
                return Path(m.group(1))
        except (OSError, subprocess.SubprocessError):
            pass
    return Path(CRIU_PLUGIN_DEFAULT)


@contextmanager
def _plugin_libdir(plugins: Sequence[str] = (), binary: str | None = None) -> Iterator[list[str]]:
    """CRIU options that load exactly ``plugins`` (file names such as ``amdgpu_plugin.so``):
    ``["--libdir", <fresh directory>]`` holding a symbolic link to each, in the host's CRIU
    plugin directory (:func:`criu_plugin_dir`); no plugins: an empty directory, so
    none loads. The directory is removed afterwards. Raises :class:`HostError` naming the
    plugin directory when a plugin is not there."""
    d = tempfile.mkdtemp(prefix="warmctl-criu-plugins-" if plugins else "warmctl-criu-noplugins-")
    try:
        if plugins:
            src = criu_plugin_dir(binary or "criu")
            for name in plugins:
                if not (src / name).is_file():
                    raise HostError(f"CRIU plugin {name} not found in {src} (CRIU's plugin directory; "
                                    "install CRIU's plugin or set CRIU_LIBS_DIR)")
                os.symlink(src / name, os.path.join(d, name))
        yield ["--libdir", d]
    finally:
        shutil.rmtree(d, ignore_errors=True)



def _log_tail(path: Path, n: int = 15, errors_first: bool = True) -> str:
    """The last ``n`` lines of CRIU's log ``path``: its error lines when it has some and
    ``errors_first``, else its last lines (what it was doing)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errs = [ln for ln in lines if "Error" in ln or "error" in ln] if errors_first else []
    return "\n".join((errs or lines)[-n:])


def _run(cmd: list[str], what: str, log: Path, timeout_s: float, plugins: Sequence[str] = (),
         env: dict[str, str] | None = None, timeout_error: type[CheckpointError] = CheckpointError,
         shielded: bool = False) -> float:
    """Run a CRIU command (with :func:`_plugin_libdir` of ``plugins`` appended, in ``env``,
    default ours); seconds it took.
    Raises :class:`CheckpointError` naming ``what`` with the relevant lines of ``log`` on failure
    or after ``timeout_s`` (then CRIU has been killed and reaped; ``timeout_error``: the class
    raised, the last lines of ``log`` in its message).

    CRIU runs as the leader of a session of its own, and a CRIU that is killed (past its bound,
    or on an exception) is killed with its whole process group: what it forked dies with it.
    Measured (a ``criu dump`` SIGKILLed 25-40 ms in, 6 times in 80): CRIU's own CPU probe, a
    child it had stopped under ptrace, outlived it, orphaned and stopped for good, holding
    CRIU's stdout and stderr, so reaping CRIU by its pipes never returned (a CI run's ``snapshot``
    hung 300 s in it, holding the host's CRIU lock). Reaping waits at most
    :data:`REAP_TIMEOUT_S` for the pipes.

    ``shielded`` (a restore): CRIU ignores SIGINT, SIGTERM and SIGHUP, so a signal meant for
    warmctl (``systemctl stop`` reaches the whole cgroup) does not stop it in the middle; and an
    exception here while it runs (KeyboardInterrupt) waits for it to end, within ``timeout_s``,
    before it propagates. A restore stopped in the middle can leave the tree resumed with no
    pidfile naming it: measured, Ctrl-C 0.2 s into ``warmctl up``'s restore left the engine
    serving, recorded nowhere, and a CRIU ghost file in ``/dev/shm``. A restore that ends names
    its root in the pidfile, where the caller's teardown finds it."""
    t0 = time.monotonic()
    with _plugin_libdir(plugins, cmd[0]) as libdir:
        proc = subprocess.Popen([*cmd, *libdir], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True, preexec_fn=_ignore_stop_signals if shielded else None)
        try:
            proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise timeout_error(f"{what} did not finish within its bound of {timeout_s:g} s: killed after "
                                f"{time.monotonic() - t0:.1f} s; the last lines of its log:\n{_log_tail(log, 5, errors_first=False)}") from None
        except BaseException:
            try:
                if shielded:
                    proc.wait(timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
            raise
    if proc.returncode != 0:
        raise CheckpointError(f"{what} failed (exit {proc.returncode}); {log}:\n{_log_tail(log)}")
    return time.monotonic() - t0


#: :func:`_kill_group`: seconds to wait for a killed CRIU's pipes to close before it is reaped
#: without them (a process that left CRIU's group, and so outlived the kill, may hold them).
REAP_TIMEOUT_S = 10.0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (a CRIU :func:`_run` started, not yet reaped, so its pid still names its
    group) and every process of its group, then reap it: its pipes read within
    :data:`REAP_TIMEOUT_S`, else closed unread."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()


def _ignore_stop_signals() -> None:
    """In a shielded CRIU's child, before it executes CRIU (:func:`_run`): ignore SIGINT, SIGTERM
    and SIGHUP. The restored tasks get their own signal actions back from the image. It imports
    nothing: in the forked child, an import lock another thread held at the fork stays held."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


class DumpTimeout(CheckpointError):
    """``criu dump`` ran past its bound (the ``dump_timeout_s`` setting, else
    :func:`dump_timeout` of the tree): warmctl killed it and removed what it had written (the
    partial image, CRIU's ``link_remap`` files in ``/dev/shm``). The message names the phase,
    the bound and the seconds waited, with the last lines of CRIU's log."""


#: :func:`dump_timeout`: seconds any dump may take, and the slowest rate (bytes/s) at which
#: CRIU must write the tree's memory (32 MiB/s: a disk, or a tmpfs under memory pressure, far
#: slower than this host's dumps, docs/benchmarks.md).
DUMP_FLOOR_S = 120.0
DUMP_MIN_RATE = 32 << 20


def dump_timeout(root_pid: int) -> float:
    """The default bound of a dump of ``root_pid``'s tree: :data:`DUMP_FLOOR_S` + the resident
    memory of its processes (shared pages counted in each: an overestimate, which only
    lengthens the bound) at :data:`DUMP_MIN_RATE`, in seconds."""
    import psutil

    from warmctl.base.proc import tree_pids

    rss = 0
    for pid in tree_pids(root_pid):
        try:
            rss += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return DUMP_FLOOR_S + rss / DUMP_MIN_RATE


def dumped_dead(images_dir: Path, nspids: Sequence[int]) -> list[int]:
    """Those of ``nspids`` (PIDs inside the dumped tree's PID namespace, as CRIU names its
    images) that a successful dump in ``images_dir`` holds as dead processes. A process that
    dies after CRIU has seized it but before CRIU has collected the whole tree stays a zombie
    (its frozen parent cannot reap it), and CRIU dumps a zombie without error: a
    ``core-PID.img`` and no memory. Every live process gets its memory map, ``mm-PID.img``
    (``cr-dump.c``: ``dump_one_task`` for a live task, ``dump_zombies`` for a dead one)."""
    return [n for n in nspids if (images_dir / f"core-{n}.img").exists()
            and not (images_dir / f"mm-{n}.img").exists()]


def dump(root_pid: int, images_dir: Path, *, leave_running: bool = False, timeout_s: float | None = None,
         binary: str | None = None, plugins: Sequence[str] = (), network_lock: str | None = "auto") -> float:
    """Dump the tree rooted at ``root_pid`` into ``images_dir`` (created if needed).

    Returns the seconds it took. The tree is killed after a successful dump unless
    ``leave_running``. Either way the ``link_remap.N`` files CRIU made in ``/dev/shm`` for
    deleted-but-open files are left there for the caller to store (a restore needs them):
    with ``--leave-running`` CRIU deletes them once the dump is done (``cr-dump.c``,
    ``delete_link_remaps`` after the post-dump action script), so a post-dump action script
    hard-links them aside first and they are put back under their names here; one of them gone
    by then fails the dump (:func:`check_link_remaps`). Raises :class:`CheckpointError` with the
    relevant lines of CRIU's log (``images_dir/dump.log``) on failure; the tree then keeps
    running (CRIU resumes it). ``plugins``: CRIU plugins to load
    (:func:`_plugin_libdir`; ``amdgpu_plugin.so`` for AMD GPU state), none by default.
    ``network_lock``: CRIU's ``--network-lock`` method for the tree's established TCP
    connections (``"auto"``: the host's, :func:`network_lock_method`; None: CRIU's default).
    ``timeout_s``: the dump's bound (None: :func:`dump_timeout` of the tree); past it CRIU is
    killed, ``images_dir`` and the ``link_remap`` files it made in ``/dev/shm`` are removed and
    :class:`DumpTimeout` is raised (the tree is no longer traced; a tree CRIU had injected its
    parasite code into may not survive: the caller tears it down or checks it).
    """
    images_dir = Path(images_dir)
    images_dir.mkdir(parents=True, exist_ok=True)
    bin_ = _usable(binary)  # the restore library is the restore's concern (and the pipelines' pre-flight)
    if timeout_s is None:
        timeout_s = dump_timeout(root_pid)
    try:
        mounts = mount_flags(root_pid) if own_mount_ns(root_pid) else []
    except OSError:  # gone: CRIU says so, with its log
        mounts = []
    cmd = [bin_, "dump", "-t", str(root_pid), "-D", str(images_dir), "-o", "dump.log", "-v2",
           *DUMP_FLAGS, *mounts, *_network_lock_flags(bin_, network_lock)]
    what = f"criu dump of pid {root_pid}"
    remaps_before = {p.name for p in SHM.glob("link_remap.*")}
    script = images_dir.parent / f".warmctl-post-dump-{os.getpid()}.sh"
    try:
        if not leave_running:
            seconds = _run(cmd, what, images_dir / "dump.log", timeout_s, plugins, timeout_error=DumpTimeout)
        else:
            script.write_text(KEEP_REMAPS_SCRIPT)
            script.chmod(0o700)
            seconds = _run([*cmd, "--leave-running", "--action-script", str(script)], what,
                           images_dir / "dump.log", timeout_s, plugins, timeout_error=DumpTimeout)
    except DumpTimeout as e:  # CRIU killed mid-dump: nothing of it stays
        shutil.rmtree(images_dir, ignore_errors=True)
        for p in SHM.glob(KEPT_PREFIX + "link_remap.*"):
            p.unlink(missing_ok=True)
        for p in SHM.glob("link_remap.*"):
            if p.name not in remaps_before:
                p.unlink(missing_ok=True)
        raise DumpTimeout(f"the criu_dump phase stalled: {e}\n(the dump_timeout_s setting is the bound; unset: "
                          f"{DUMP_FLOOR_S:g} s + the tree's resident memory at {DUMP_MIN_RATE >> 20} MiB/s; its "
                          f"partial image {images_dir} was removed)") from None
    finally:
        script.unlink(missing_ok=True)
        for kept in SHM.glob(KEPT_PREFIX + "link_remap.*"):
            name = SHM / kept.name[len(KEPT_PREFIX):]
            if name.exists():  # CRIU kept it (dump failed before the clean-up): one name is enough
                kept.unlink()
            else:
                kept.rename(name)
    check_link_remaps(images_dir, what)
    return seconds


def check_link_remaps(images_dir: Path, what: str = "criu dump") -> None:
    """Raise :class:`CheckpointError` when a ``link_remap.N`` file in ``/dev/shm`` that the image
    in ``images_dir`` needs (:func:`criuimage.linked_remaps`) is gone: a restore of that image
    would fail (CRIU: "Can't link dev/shm/link_remap.N -> ..."), on every host it reached. The
    image's other link_remap files in ``/dev/shm`` are removed then (the dump's own, under the
    host lock), so nothing of it stays. Seen when a killed dump's clean-up ran beside this one
    outside the host lock (:func:`host_lock`). Links elsewhere are not checked: a tree in a
    mount namespace of its own may see them under other paths. An image this version cannot
    read the remaps of is logged, not failed (the check guards; the dump itself succeeded)."""
    try:
        remaps = criuimage.linked_remaps(images_dir)
    except (CheckpointError, OSError) as e:
        log.warning("%s: the image's link remaps were not checked: %s", what, e)
        return
    linked = [(link, orig) for link, orig in remaps if link.startswith(f"{SHM}/")]
    gone = [(link, orig) for link, orig in linked if not os.path.lexists(link)]
    if not gone:
        return
    for link, _ in linked:
        Path(link).unlink(missing_ok=True)
    raise CheckpointError(f"{what}: the image needs {len(gone)} file(s) CRIU linked in {SHM} for the restore, and "
                          "they were removed while it ran (another dump's clean-up outside the host's CRIU lock?): "
                          "a restore of it would fail; dump again\n  "
                          + "\n  ".join(f"{link} (the removed {orig})" for link, orig in gone))


#: :func:`restore`'s and :func:`lazy_restore`'s default bound, in seconds.
RESTORE_TIMEOUT_S = 600.0


def await_restore_into(pidfile: Path, timeout_s: float = RESTORE_TIMEOUT_S) -> list[int]:
    """Wait for the ``criu restore`` processes running now whose ``--pidfile`` is ``pidfile`` to
    end, each at most until ``timeout_s`` after it started (its bound, :func:`restore`); one
    still running then is killed with its process group (:func:`_run`'s rule). Returns their
    PIDs (empty: none ran).

    Why: a restore's CRIU is shielded from the signals that stop ``up`` (:func:`_run`) and is not
    killed with it, so after ``kill -9`` of ``up`` (or of the agent) it runs on, and names the
    tree it restored in ``pidfile`` only when it ends: a teardown that reads ``pidfile`` before
    then misses the tree (seen with CRIU held stopped: ``down`` said the engine was down, and the
    tree CRIU then resumed ran on, recorded nowhere). Costs one scan of the host's processes
    (8-13 ms for 75 processes on a 2-core VM)."""
    import psutil

    path = str(pidfile)
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            cmd = p.cmdline() if p.info["name"] == "criu" else []
        except psutil.Error:
            continue
        if "restore" in cmd and any(b == "--pidfile" and a == path for b, a in zip(cmd, cmd[1:])):
            found.append(p)
    # CRIU itself, not the tasks it forks to become the restored ones: named and shown as CRIU
    # until restored, those then run on as the engine
    pids = {p.pid for p in found}
    found = [p for p in found if p.ppid() not in pids]
    for p in found:
        try:
            deadline = p.create_time() + timeout_s
            while p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # (psutil's wait() waits out a zombie)
                if time.time() > deadline:
                    os.killpg(p.pid, signal.SIGKILL)
                    break
                time.sleep(0.02)
        except (psutil.Error, ProcessLookupError):
            pass  # ended meanwhile
    return [p.pid for p in found]


def restore(images_dir: Path, pidfile: Path, *, log_file: Path | None = None, timeout_s: float = RESTORE_TIMEOUT_S,
            binary: str | None = None, work_dir: Path | None = None,
            plugins: Sequence[str] = (), lazy_pages: bool = False,
            network_lock: str | None = "auto", stream: bool = False,
            xtile_lib: str | Path | None = None, mounts: Sequence[str] | None = None) -> tuple[int, float]:
    """Restore the tree in ``images_dir``, detached. Returns (host PID of its root, seconds).

    ``stream``: ``--stream``: ``images_dir`` holds only the socket of an image streamer
    (:class:`warmctl.checkpoint.stream.ImageStreamer`) that serves every image file.

    ``log_file`` defaults to ``images_dir/restore.log``. ``work_dir``: where CRIU writes what
    else it writes (its ``stats-restore`` file; CRIU's default is the image directory), so a
    read-only, reused image directory stays unchanged. Raises :class:`CheckpointError` with
    the relevant lines of CRIU's log on failure (CRIU kills what it partly restored).
    ``plugins``: as for :func:`dump` (an image dumped with a plugin needs it at restore).
    ``lazy_pages``: ``--lazy-pages``, served by a ``criu lazy-pages`` daemon already listening
    in ``work_dir`` (use :func:`lazy_restore`, which starts it). ``network_lock``: as for
    :func:`dump` (the restored TCP connections are locked until the tree resumes).
    ``xtile_lib``: the AMX permission library (:func:`restore_env`). ``mounts``: the image's
    external mount keys (:func:`restore_mount_flags`); default: read from ``images_dir``, none
    for ``stream`` (the streamer's caller reads them: :func:`warmctl.checkpoint.criuimage.mount_keys`).
    """
    images_dir = Path(images_dir)
    if mounts is None:
        mounts = [] if stream else criuimage.external_mounts(images_dir)
    log_file = Path(log_file or images_dir / "restore.log")
    pidfile = Path(pidfile)
    pidfile.unlink(missing_ok=True)
    bin_ = check(binary, xtile_lib)
    cmd = [bin_, "restore", "-D", str(images_dir), "-o", str(log_file), "-v2",
           "--restore-detached", "--pidfile", str(pidfile), *RESTORE_FLAGS,
           "--root", "/", *restore_mount_flags(mounts), *_network_lock_flags(bin_, network_lock)]
    if work_dir is not None:
        cmd += ["-W", str(work_dir)]
    if lazy_pages:
        cmd.append("--lazy-pages")
    if stream:
        cmd.append("--stream")
    how = " --lazy-pages" if lazy_pages else " --stream" if stream else ""
    secs = _run(cmd, f"criu restore{how} from {images_dir}", log_file, timeout_s,
                plugins, env=restore_env(xtile_lib), shielded=True)
    return int(pidfile.read_text().strip()), secs


# --- lazy restore (userfaultfd: pages copied on first touch, the rest in the background) --------

#: Name of the UNIX socket ``criu lazy-pages`` listens on in its work directory (CRIU 4.2,
#: ``criu/uffd.c``: ``LAZY_PAGES_SOCK_NAME``); ``criu restore --lazy-pages -W DIR`` connects to it.
LAZY_SOCKET = "lazy-pages.socket"
#: The daemon's log level: its per-process summary (``UFFD transferred pages: (N/M)``) and the
#: ``Found N pages to be handled by UFFD`` line are debug messages (``lp_debug``), printed at -v4.
LAZY_LOG_LEVEL = "-v4"


class LazyPagesError(CheckpointError):
    """The lazy-pages daemon of a lazy restore failed to start, or exited before it had copied
    every page into the restored processes (those pages would read as zeros)."""


@dataclass
class LazyPages:
    """The ``criu lazy-pages`` daemon of one lazy restore: ``proc`` (our child while we run),
    ``ident`` (its identity, :class:`warmctl.base.proc.ProcessId`, for anyone else who watches or
    stops it) and ``log`` (its log file, parsed by :func:`lazy_log_status`)."""

    proc: subprocess.Popen
    ident: ProcessId
    log: Path
    #: why its ``oom_score_adj`` could not be set to -1000 (empty when it was)
    oom_note: str = ""

    def finished(self) -> "LazyLogStatus | None":
        """None while the daemon runs; once it has exited, what its log says."""
        if self.proc.poll() is None and self.ident.alive():
            return None
        return lazy_log_status(self.log)

    def check(self, when: str) -> None:
        """Raise :class:`LazyPagesError` (``when``: what was going on, for the message) if the
        daemon has exited without having transferred every page."""
        done = self.finished()
        if done is not None and not done.complete:
            raise LazyPagesError(f"the lazy-pages daemon (pid {self.ident.pid}) exited {when} before it had copied "
                                 f"every page (exit {self.proc.returncode}): {done.reason}; its log: {self.log}")

    def stop(self) -> None:
        """Kill the daemon (if it still runs) and reap it."""
        kill_child(self.proc, timeout_s=2)


@dataclass
class LazyLogStatus:
    """What a lazy-pages daemon's log says about its copy: ``complete`` (every process it
    served had all its pages copied, or discarded them itself), ``processes`` (PIDs it
    served), ``pages`` (pages copied / pages it was to copy, summed over the processes that
    finished) and ``reason`` (why not complete; empty when complete)."""

    complete: bool
    processes: list[int]
    copied: int
    total: int
    reason: str = ""


_LP_FOUND = re.compile(r"\b(\d+)-\d+: Found (\d+) pages to be handled by UFFD")
_LP_FORK = re.compile(r"\b(\d+)-\d+: FORK: child")
_LP_DONE = re.compile(r"\b(\d+)-\d+: UFFD transferred pages: \((\d+)/(\d+)\)")
_LP_DROP = re.compile(r"\b(\d+)-\d+: (?:EXIT|REMOVE:|UNMAP:)")


def parse_lazy_log(text: str) -> LazyLogStatus:
    """Decide from a ``criu lazy-pages`` log (CRIU 4.2 at ``-v4``) whether it transferred every page.

    The messages (``criu/uffd.c``): ``PID-FD: Found N pages to be handled by UFFD`` once per
    process served (``FORK: child`` adds one more, same PID); ``PID-FD: UFFD transferred pages:
    (COPIED/TOTAL)`` once per process, printed only when the daemon has nothing left to copy or
    queued for that process, so a daemon that was killed or crashed lacks it for some process.
    Complete: at least one process was served, each has its summary line(s), and each summary
    shows COPIED == TOTAL -- or less where the process itself discarded memory or exited
    (``REMOVE:``/``UNMAP:``/``EXIT`` lines: CRIU drops those ranges from its copy list but not
    from TOTAL). Pure function of the text; see :func:`lazy_log_status` for a file.
    """
    served: dict[int, int] = {}
    for m in _LP_FOUND.finditer(text):
        served[int(m.group(1))] = served.get(int(m.group(1)), 0) + 1
    for m in _LP_FORK.finditer(text):
        served[int(m.group(1))] = served.get(int(m.group(1)), 0) + 1
    done: dict[int, list[tuple[int, int]]] = {}
    for m in _LP_DONE.finditer(text):
        done.setdefault(int(m.group(1)), []).append((int(m.group(2)), int(m.group(3))))
    dropped = {int(m.group(1)) for m in _LP_DROP.finditer(text)}
    copied = sum(c for v in done.values() for c, _ in v)
    total = sum(t for v in done.values() for _, t in v)
    procs = sorted(served)
    if not served:
        return LazyLogStatus(False, procs, copied, total, "it served no process (no 'Found N pages to be handled by "
                             "UFFD' line: it died before the restore connected, or it did not log at -v4)")
    unfinished = [p for p in procs if len(done.get(p, ())) < served[p]]
    if unfinished:
        return LazyLogStatus(False, procs, copied, total, f"no 'UFFD transferred pages' summary for process(es) "
                             f"{', '.join(map(str, unfinished))}: their copy did not end")
    short = [f"{p} ({c}/{t})" for p in procs for c, t in done[p] if c < t and p not in dropped]
    if short:
        return LazyLogStatus(False, procs, copied, total, f"pages missing for process(es) {', '.join(short)}")
    return LazyLogStatus(True, procs, copied, total)


def lazy_log_status(log: Path) -> LazyLogStatus:
    """:func:`parse_lazy_log` of the file ``log`` (an unreadable file: not complete)."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError as e:
        return LazyLogStatus(False, [], 0, 0, f"cannot read its log {log}: {e.strerror}")
    return parse_lazy_log(text)


def _cached_probe(binary: str, cache_dir: Path | None, file_name: str, field: str, probe):
    """``probe()`` (JSON-able), cached as ``field`` in ``cache_dir/file_name`` per CRIU binary
    (path, size, mtime) and kernel release (``uname -r``); without ``cache_dir``: once per
    process. None when ``binary`` cannot be stat'ed."""
    import json

    try:
        st = os.stat(binary)
    except OSError:
        return None
    key = f"{os.path.realpath(binary)}|{st.st_size}|{st.st_mtime_ns}|{os.uname().release}"
    cache = Path(cache_dir) / file_name if cache_dir is not None else None
    if cache is None and (file_name, key) in _PROBED:
        return _PROBED[(file_name, key)]
    if cache is not None:
        try:
            d = json.loads(cache.read_text())
            if d.get("key") == key and field in d:
                _PROBED[(file_name, key)] = d[field]
                return d[field]
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            pass
    value = probe()
    _PROBED[(file_name, key)] = value
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, field: value}))
            os.replace(tmp, cache)
        except OSError:
            pass
    return value


#: answers of :func:`_cached_probe` in this process: {(file name, binary key): value}
_PROBED: dict[tuple[str, str], object] = {}


def uffd_supported(binary: str, cache_dir: Path | None = None) -> bool:
    """True if ``criu check --feature uffd-noncoop`` passes (what a lazy restore of a
    multi-process tree needs: the fork/remove/unmap events of non-cooperative userfaultfd).

    The answer is cached in ``cache_dir/criu-uffd.json`` per CRIU binary (path, size, mtime)
    and kernel release (``uname -r``), so ``up`` pays the check (~10-50 ms) once per host and
    CRIU/kernel upgrade, then one small file read. Without ``cache_dir``: once per process.
    """

    def probe() -> bool:
        try:
            return subprocess.run([binary, "check", "--feature", "uffd-noncoop"], capture_output=True,
                                  timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    return bool(_cached_probe(binary, cache_dir, "criu-uffd.json", "uffd_noncoop", probe))


# --- network lock (established TCP connections: tensor-parallel ranks' gloo group) -----------

#: CRIU's ``--network-lock`` methods, in the order warmctl prefers them.
NETWORK_LOCKS = ("nftables", "iptables")


def network_lock_method(binary: str, cache_dir: Path | None = None) -> str | None:
    """The ``--network-lock`` method this host supports for CRIU ``binary``: ``"nftables"``
    when ``criu check --feature network_lock_nftables`` passes (CRIU built with libnftables,
    ``libnftables1`` installed, kernel nf_tables with set concatenations), else ``"iptables"``
    when ``iptables-restore`` is on ``PATH`` (CRIU's default method runs it), else None.
    Cached like :func:`uffd_supported` (``cache_dir/criu-netlock.json``).

    Why it matters: CRIU dumps an established TCP connection (``--tcp-established``; a
    tensor-parallel vLLM's ranks hold several on loopback) only after locking it with the
    network lock, and restores it under the same lock; without a usable method the dump fails
    late ("Iptables configuration failed", "Failed to lock TCP connection")."""

    def probe() -> str | None:
        try:
            if subprocess.run([binary, "check", "--feature", "network_lock_nftables"], capture_output=True,
                              timeout=30).returncode == 0:
                return "nftables"
        except (OSError, subprocess.TimeoutExpired):
            pass
        return "iptables" if shutil.which("iptables-restore") else None

    found = _cached_probe(binary, cache_dir, "criu-netlock.json", "network_lock", probe)
    return found if found in NETWORK_LOCKS else None


def require_network_lock(binary: str, cache_dir: Path | None = None, why: str = "") -> str:
    """:func:`network_lock_method`, or :class:`HostError` saying what to install (``why``:
    what needs it, for the message): call it in pre-flight, before any engine starts."""
    method = network_lock_method(binary, cache_dir)
    if method is None:
        raise HostError(f"{why or 'this engine'} holds established TCP connections, which CRIU dumps and restores "
                        f"only under a network lock, and this host has no method for one: `{binary} check --feature "
                        "network_lock_nftables` fails and iptables-restore is not on PATH; install libnftables1 "
                        "(with a CRIU built against libnftables-dev, as scripts/install.sh builds it) or iptables")
    return method


def _network_lock_flags(binary: str, network_lock: str | None) -> list[str]:
    """``["--network-lock", METHOD]``: ``network_lock`` (``"auto"``: :func:`network_lock_method`,
    nothing when the host has none: CRIU's default then fails only on a tree that holds
    established TCP connections), None: nothing."""
    if network_lock == "auto":
        network_lock = network_lock_method(binary)
    if network_lock is None:
        return []
    if network_lock not in NETWORK_LOCKS:
        raise HostError(f"network lock {network_lock!r} is not one of {', '.join(NETWORK_LOCKS)}")
    return ["--network-lock", network_lock]


def _start_lazy_daemon(binary: str, images_dir: Path, work_dir: Path, log_file: Path, libdir: list[str],
                       timeout_s: float) -> LazyPages:
    """Start ``criu lazy-pages`` serving ``images_dir``, its socket in ``work_dir``; return once
    the socket exists. The daemon gets ``oom_score_adj`` -1000 (the OOM killer takes the engine
    before it: the engine's memory depends on it); where that is not permitted (no
    CAP_SYS_RESOURCE, e.g. in a container) it keeps its default and :attr:`LazyPages.oom_note`
    says so: its few MiB still rank far below the engine's GiBs in the OOM killer's choice.
    Raises :class:`LazyPagesError` with its log."""
    sock = work_dir / LAZY_SOCKET
    sock.unlink(missing_ok=True)
    log_file.unlink(missing_ok=True)
    with open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen([binary, "lazy-pages", "-D", str(images_dir), "-W", str(work_dir), "-o", str(log_file),
                                 LAZY_LOG_LEVEL, *libdir], stdin=devnull, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ident = ProcessId.child(proc)
        oom_note = ""
        try:
            Path(f"/proc/{proc.pid}/oom_score_adj").write_text("-1000\n")
        except OSError as e:  # lowering it needs CAP_SYS_RESOURCE
            oom_note = f"oom_score_adj of the lazy-pages daemon (pid {proc.pid}) left as it was: {e.strerror}"
        deadline = time.monotonic() + timeout_s
        while not sock.exists():
            if proc.poll() is not None or ident is None:
                raise LazyPagesError(f"criu lazy-pages exited {proc.returncode} before listening; "
                                     f"{log_file}:\n{_log_tail(log_file)}")
            if time.monotonic() > deadline:
                raise LazyPagesError(f"criu lazy-pages did not listen on {sock} within {timeout_s:.0f} s")
            time.sleep(0.002)
    except BaseException:
        kill_child(proc, timeout_s=2)
        raise
    return LazyPages(proc, ProcessId.of(proc.pid) or ident, log_file, oom_note)


def lazy_restore(images_dir: Path, pidfile: Path, work_dir: Path, *, log_file: Path | None = None,
                 daemon_log: Path | None = None, timeout_s: float = RESTORE_TIMEOUT_S, binary: str | None = None,
                 on_daemon=None, network_lock: str | None = "auto",
                 xtile_lib: str | Path | None = None) -> tuple[int, LazyPages, float]:
    """Restore the tree in ``images_dir`` detached, its memory on demand: start ``criu
    lazy-pages`` (its socket and ``stats`` in ``work_dir``, its log ``daemon_log``, default
    ``work_dir/lazy-pages.log``), then ``criu restore --lazy-pages``. Private anonymous memory
    comes back empty, registered with userfaultfd: a page is copied from the image when a
    process first touches it, the daemon copies the rest in the background and exits when done.

    Returns (host PID of the root, the daemon's :class:`LazyPages`, seconds). ``on_daemon(lp)``
    is called as soon as the daemon runs (to record its identity before anything else can
    fail). Until the daemon's copy has ended, the restored memory depends on it: see
    :func:`parse_lazy_log` for how to tell whether it ended complete. No CRIU plugins (a plan
    that needs them restores eagerly). Raises :class:`LazyPagesError` if the daemon cannot
    start, :class:`CheckpointError` if the restore fails (the daemon is then stopped).
    ``network_lock``, ``xtile_lib``: as for :func:`restore`.
    """
    images_dir, work_dir = Path(images_dir), Path(work_dir)
    daemon_log = Path(daemon_log or work_dir / "lazy-pages.log")
    bin_ = check(binary, xtile_lib)
    t0 = time.monotonic()
    with _plugin_libdir((), bin_) as libdir:
        lp = _start_lazy_daemon(bin_, images_dir, work_dir, daemon_log, libdir, min(timeout_s, 30))
    try:
        if on_daemon is not None:
            on_daemon(lp)
        pid, _ = restore(images_dir, pidfile, log_file=log_file, timeout_s=timeout_s, binary=bin_, work_dir=work_dir,
                         lazy_pages=True, network_lock=network_lock, xtile_lib=xtile_lib)
    except BaseException:
        lp.stop()
        raise
    return pid, lp, time.monotonic() - t0
