"""Process identity and the one way warmctl signals a process (tree).

A PID alone never identifies a process: PIDs are reused quickly (``pid_max`` can be 32768 and
an engine uses ~70 of them; after a reboot every recorded PID may name anything), so warmctl
records a process as :class:`ProcessId` -- PID, its **start time in clock ticks since boot**
(``/proc/PID/stat`` field 22, ``starttime``), the boot it belongs to
(``/proc/sys/kernel/random/boot_id``) and the executable (``/proc/PID/exe``) and command line
it had when recorded -- and signals it only while the PID still has that start time and
executable.

**One clock**. The kernel stores a process's start once, as ``CLOCK_BOOTTIME``
truncated to clock ticks (1 tick = 1/``SC_CLK_TCK`` s, 10 ms on Linux); it never changes and no
wall-clock step moves it. Identity compares those integers exactly. "Created after a record
was written" compares them with a ``CLOCK_BOOTTIME`` reading taken when the record was written
(:class:`Stamp`), truncated the same way, so no tolerance is needed. What the rule never does:
compare psutil's ``create_time()`` (Unix seconds, derived from ``/proc/stat``'s boot time,
which the kernel gives in whole seconds and recomputes after every clock adjustment: off by
the boot time's lost fraction, anywhere in [0, 1) s, on a given host) with ``time.time()``.
Records written before warmctl kept start ticks (only a psutil ``ctime``) are still judged by
comparing psutil with psutil (:data:`LEGACY_CTIME_TOLERANCE_S`), where the lost fraction cancels.

The clocks are read only through :func:`start_ticks`, :func:`boot_clock`, :func:`wall_clock`
and :func:`boot_id` (the boundary the tests inject host quirks at).

Every signal warmctl sends to a process goes through :func:`signal_process`,
:func:`kill_tree` or :func:`kill_child`; each checks the identity first and
refuses otherwise (returns False, sends nothing). A bare PID is refused (``TypeError``).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass

import psutil

#: Clock ticks per second of ``/proc/PID/stat``'s ``starttime`` (``USER_HZ``: 100 on Linux).
CLK_TCK: int = os.sysconf("SC_CLK_TCK")

#: Only for records written before start ticks were kept (a psutil ``ctime`` alone): two psutil
#: creation times closer than this (seconds) are the same process. Both come from the same
#: whole-second boot time, so its lost fraction cancels; what is left is a boot time the kernel
#: recomputed by a second after a clock adjustment, which this cannot tell from another process.
LEGACY_CTIME_TOLERANCE_S = 0.5

#: A file's mtime comes from the kernel's coarse clock (up to one scheduler tick behind the
#: precise one); allowed on top when a file's mtime bounds a start (:func:`created_during`).
MTIME_SLACK_TICKS = 1


# --- the boundary: every clock the rule reads ------------------------------------------------

def start_ticks(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if
    there is no such process. Raises nothing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # field 2 (comm) is in parentheses and may hold spaces and ')': fields after the last ')'
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def boot_clock() -> float:
    """Seconds since boot, ``CLOCK_BOOTTIME``: the clock ``starttime`` is counted in."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def wall_clock() -> float:
    """Unix seconds (``time.time()``): only for reports and for mapping a file's mtime."""
    return time.time()


_BOOT_ID: list[str | None] = []


def boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``), None if unreadable. Start ticks
    count from boot: a record of an earlier boot names no process of this one."""
    if not _BOOT_ID:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT_ID.append(f.read().strip() or None)
        except OSError:
            _BOOT_ID.append(None)
    return _BOOT_ID[0]


def ticks(boot_s: float) -> int:
    """``boot_s`` (seconds since boot) in whole clock ticks, truncated as the kernel truncates
    ``starttime``: a process started at or after ``boot_s`` has ``starttime >= ticks(boot_s)``."""
    return math.floor(boot_s * CLK_TCK)


@dataclass(frozen=True)
class Stamp:
    """A moment read in both clocks at once: ``wall`` (Unix seconds, for reports and mtimes),
    ``boot`` (``CLOCK_BOOTTIME`` seconds; None in a record written before it was kept) and the
    ``boot_id`` it belongs to. Written into a record; "started after the record" is judged
    against ``boot``."""

    wall: float
    boot: float | None = None
    boot_id: str | None = None

    @classmethod
    def now(cls) -> "Stamp":
        return cls(wall_clock(), boot_clock(), boot_id())

    def boot_of(self, wall_t: float) -> float | None:
        """The boot-clock reading at wall time ``wall_t``, by this stamp's offset between the
        clocks (None without a boot reading). Wrong by any wall-clock step between the two."""
        return None if self.boot is None else wall_t - self.wall + self.boot


def wall_time_of(start: int) -> float:
    """A start in ticks since boot as Unix seconds, by the clocks' offset now (for reports)."""
    return wall_clock() - boot_clock() + start / CLK_TCK


def create_time(pid: int) -> float | None:
    """Creation time of ``pid`` in Unix seconds (from its start ticks and the clocks' offset
    now; for reports, never for identity), or None if there is no such process."""
    start = start_ticks(pid)
    return None if start is None else wall_time_of(start)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (whoever it belongs to now)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _exe(p: psutil.Process) -> str | None:
    """``p``'s executable path (``/proc/PID/exe``; a replaced binary's `` (deleted)`` suffix
    dropped), or None when it cannot be read (kernel thread, no permission)."""
    try:
        exe = p.exe()
    except (psutil.Error, OSError):
        return None
    return exe.removesuffix(" (deleted)") or None


@dataclass(frozen=True)
class ProcessId:
    """One process: host ``pid``; ``start``, its start in clock ticks since boot
    (``/proc/PID/stat`` ``starttime``) and ``boot``, the boot id it was recorded in; ``ctime``,
    its creation time in Unix seconds (for reports; the identity of records without ``start``);
    and the ``exe`` (absolute path) and ``cmdline`` (argv) it had when recorded. ``exe`` None:
    not checked (a record written before warmctl recorded it, or a child of ours, see
    :meth:`child`); ``cmdline`` is kept for reports (a process may rewrite its argv, e.g.
    setproctitle). ``start`` None: a record written before start ticks were kept."""

    pid: int
    ctime: float
    exe: str | None = None
    cmdline: tuple[str, ...] = ()
    start: int | None = None
    boot: str | None = None

    @classmethod
    def of(cls, pid: int) -> "ProcessId | None":
        """The identity of the process ``pid`` is now, or None if it does not exist."""
        start = start_ticks(pid)
        if start is None:
            return None
        try:
            p = psutil.Process(pid)
        except psutil.Error:
            return None
        try:
            cmd = tuple(p.cmdline())
        except psutil.Error:
            cmd = ()
        exe = _exe(p)
        if start_ticks(pid) != start:  # the PID was reused while we read it
            return None
        return cls(pid, wall_time_of(start), exe, cmd, start, boot_id())

    @classmethod
    def child(cls, proc: "subprocess.Popen") -> "ProcessId | None":
        """The identity of our own child ``proc`` (PID and start, no executable: it may still
        exec another program). Its PID cannot be reused before we reap it."""
        start = start_ticks(proc.pid) if proc.returncode is None else None
        return None if start is None else cls(proc.pid, wall_time_of(start), start=start, boot=boot_id())

    @classmethod
    def recorded(cls, pid: int | None, ctime: float | None, exe: str | None = None,
                 cmdline: list[str] | tuple[str, ...] | None = None, start: int | None = None,
                 boot: str | None = None) -> "ProcessId | None":
        """From a record's fields; None if pid is missing or both ctime and start are."""
        if not pid or (ctime is None and start is None):
            return None
        return cls(pid, ctime if ctime is not None else 0.0, exe, tuple(cmdline or ()), start, boot)

    @classmethod
    def from_record(cls, d: dict) -> "ProcessId | None":
        """From :meth:`as_record`'s dict (older records: ``pid`` and ``ctime`` only); None if
        it names no process."""
        return cls.recorded(d.get("pid"), d.get("ctime"), d.get("exe"), d.get("cmdline"), d.get("start"), d.get("boot"))

    def mismatch(self) -> str | None:
        """Why the PID is not (or no longer) this process: ``"gone"`` (no such process, a
        zombie, or recorded in an earlier boot), ``"pid N is another process now (...)"``,
        ``"pid N runs ..."``; None while it is."""
        try:
            p = psutil.Process(self.pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return "gone"
        except psutil.Error:
            return "gone"
        if self.start is not None:
            if self.boot is not None and boot_id() not in (None, self.boot):
                return "gone"  # its PID and ticks were counted in an earlier boot
            now = start_ticks(self.pid)
            if now is None:
                return "gone"
            if now != self.start:
                return (f"pid {self.pid} is another process now (started {now / CLK_TCK:.2f} s after boot, "
                        f"recorded {self.start / CLK_TCK:.2f} s)")
        else:  # a record from before start ticks were kept: psutil against psutil
            try:
                now_ct = p.create_time()
            except psutil.Error:
                return "gone"
            if abs(now_ct - self.ctime) >= LEGACY_CTIME_TOLERANCE_S:
                return f"pid {self.pid} is another process now (created at {now_ct:.2f}, recorded {self.ctime:.2f})"
        if self.exe is not None:
            exe = _exe(p)
            if exe != self.exe:
                return f"pid {self.pid} runs {exe or '(unreadable)'}, recorded {self.exe}"
        return None

    def alive(self) -> bool:
        """True while ``pid`` is alive and still has the recorded start time and executable."""
        return self.mismatch() is None

    def as_record(self) -> dict:
        """JSON-friendly fields (``pid``, ``ctime``, ``exe``, ``cmdline``, ``start``, ``boot``)."""
        return {"pid": self.pid, "ctime": self.ctime, "exe": self.exe, "cmdline": list(self.cmdline),
                "start": self.start, "boot": self.boot}


def created_during(pid: int, since: Stamp, until_wall: float) -> tuple[ProcessId | None, str | None]:
    """Was ``pid`` started at or after ``since`` (a record's :class:`Stamp`) and no later than
    wall time ``until_wall`` (a file's mtime: when what named it was written)?

    Returns (identity, None) when it was; (None, None) when there is no such process; (None,
    why) when it exists but was not. The lower bound is boot-clock ticks against ``since.boot``
    (exact, no tolerance). The upper bound maps ``until_wall`` to the boot clock twice, by the
    clocks' offset in ``since`` and by their offset now, and takes the later, so one wall-clock
    step anywhere (between the record and the file, or after the file) never refuses the
    process; then :data:`MTIME_SLACK_TICKS`. A record without a boot reading (older warmctl) is
    mapped by the offset now.
    """
    ident = ProcessId.of(pid)
    if ident is None:
        return None, None
    assert ident.start is not None
    if since.boot_id is not None and ident.boot not in (None, since.boot_id):
        return None, f"pid {pid}: the record was written in an earlier boot"
    now = Stamp.now()
    lo_s = since.boot if since.boot is not None else now.boot_of(since.wall)
    assert lo_s is not None and now.boot is not None
    hi_s = max(x for x in (since.boot_of(until_wall), now.boot_of(until_wall)) if x is not None)
    lo, hi = ticks(lo_s), ticks(hi_s) + MTIME_SLACK_TICKS
    if not lo <= ident.start <= hi:
        return None, (f"pid {pid} was started {ident.start / CLK_TCK:.2f} s after boot, not during the restore "
                      f"recorded at {lo / CLK_TCK:.2f}..{hi / CLK_TCK:.2f} s")
    return ident, None


def nspid(pid: int, tid: int | None = None) -> int | None:
    """``pid``'s PID (or its thread ``tid``'s ID) in its innermost PID namespace: the last
    ``NSpid`` field of ``/proc/PID/status`` (``/proc/PID/task/TID/status``); None if unreadable."""
    path = f"/proc/{pid}/status" if tid is None else f"/proc/{pid}/task/{tid}/status"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def tree_pids(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants (host PIDs, from their parent links), sorted;
    [] if the root is gone."""
    try:
        root = psutil.Process(root_pid)
        return sorted([root.pid] + [c.pid for c in root.children(recursive=True)])
    except psutil.Error:
        return []


def _require(ident: object) -> None:
    if not isinstance(ident, ProcessId):
        raise TypeError(f"warmctl signals only a recorded process identity (ProcessId), not {ident!r}")


def signal_process(ident: ProcessId | None, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig`` to the one process ``ident`` if it still is that process (start time,
    executable). Returns True if it was signalled; False (nothing sent) otherwise."""
    if ident is None:
        return False
    _require(ident)
    if not ident.alive():
        return False
    try:
        # psutil checks its own record of the process once more right before the kill(2)
        psutil.Process(ident.pid).send_signal(sig)
    except psutil.Error:
        return False
    return True


def kill_tree(root: ProcessId | None, timeout_s: float = 10.0) -> bool:
    """SIGTERM ``root`` and all its descendants, then SIGCONT (a stopped process, such as a rank
    stopped by SIGSTOP or a debugger, takes its SIGTERM only once continued: systemd's
    ``SendSIGCONT``), SIGKILL what is left after ``timeout_s`` seconds; waits up to 5 s more for
    the killed ones. ``timeout_s`` 0: SIGKILL at once, nothing else sent (a tree stopped by
    :func:`freeze_tree` dies without running again). Returns True if a tree was signalled.

    ``root`` is acted on only while it still is the recorded process (:meth:`ProcessId.alive`:
    same start time and executable); a reused PID is left alone. Its descendants are found
    from the verified root's parent links at that moment. Killing a PID namespace's PID 1 also
    kills every process inside it (kernel rule). A bare PID raises ``TypeError``.
    """
    if root is None:
        return False
    _require(root)
    if not root.alive():
        return False
    try:
        top = psutil.Process(root.pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return False
    alive = procs
    if timeout_s > 0:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return True


def freeze_tree(root: ProcessId | None, rounds: int = 5) -> list[int]:
    """SIGSTOP ``root`` and all its descendants, again until no new descendant appears (a
    process that forked while it was being stopped; at most ``rounds`` times); returns the
    PIDs stopped. A stopped tree makes no file and starts no process until it is continued
    or killed: what it holds can then be listed completely (:meth:`warmctl.engine.run.EngineRun.teardown`).
    Acts only while ``root`` still is the recorded process (as :func:`kill_tree`)."""
    if root is None:
        return []
    _require(root)
    if not root.alive():
        return []
    done: set[int] = set()
    for _ in range(rounds):
        try:
            top = psutil.Process(root.pid)
            procs = [top, *top.children(recursive=True)]
        except psutil.Error:
            break
        new = [p for p in procs if p.pid not in done]
        if not new:
            break
        for p in new:
            try:
                p.send_signal(signal.SIGSTOP)
                done.add(p.pid)
            except psutil.Error:
                pass
    return sorted(done)


def kill_child(proc: "subprocess.Popen", timeout_s: float = 5.0) -> bool:
    """Kill our own child ``proc`` and its descendants (:func:`kill_tree` on
    :meth:`ProcessId.child`) and reap it. Returns True if it was still running."""
    ident = ProcessId.child(proc)
    done = kill_tree(ident, timeout_s=timeout_s) if ident is not None else False
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    return done


def owned_by_me(st: os.stat_result) -> bool:
    """True if a file's ``lstat`` result says it belongs to this process's user."""
    return st.st_uid == os.getuid()
