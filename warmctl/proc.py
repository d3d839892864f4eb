"""Process identity and the one way warmctl signals a process (tree).

A PID alone never identifies a process: PIDs are reused quickly (``pid_max`` can be 32768 and
an engine uses ~70 of them; after a reboot every recorded PID may name anything), so warmctl
records a process as :class:`ProcessId` -- PID, the creation time psutil reports (Unix
seconds) and the executable (``/proc/PID/exe``) and command line it had when recorded -- and
signals it only while the PID still has that creation time and executable.

Every signal warmctl sends to a process goes through :func:`signal_process`,
:func:`kill_tree` or :func:`kill_child` (issue 14, item 1); each checks the identity first and
refuses otherwise (returns False, sends nothing). A bare PID is refused (``TypeError``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

import psutil

#: Two creation times closer than this (seconds) are the same process (psutil derives it from
#: the boot time and clock ticks, so it wobbles by a few milliseconds between reads).
CTIME_TOLERANCE_S = 0.5


def create_time(pid: int) -> float | None:
    """Creation time of ``pid`` (Unix seconds, psutil), or None if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


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
    """One process: host ``pid``, its ``ctime`` (creation time, Unix seconds), and the ``exe``
    (absolute path) and ``cmdline`` (argv) it had when recorded. ``exe`` None: not checked (a
    record written before warmctl recorded it, or a child of ours, see :meth:`child`);
    ``cmdline`` is kept for reports (a process may rewrite its argv, e.g. setproctitle)."""

    pid: int
    ctime: float
    exe: str | None = None
    cmdline: tuple[str, ...] = ()

    @classmethod
    def of(cls, pid: int) -> "ProcessId | None":
        """The identity of the process ``pid`` is now, or None if it does not exist."""
        try:
            p = psutil.Process(pid)
            ctime = p.create_time()
        except psutil.Error:
            return None
        try:
            cmd = tuple(p.cmdline())
        except psutil.Error:
            cmd = ()
        return cls(pid, ctime, _exe(p), cmd)

    @classmethod
    def child(cls, proc: "subprocess.Popen") -> "ProcessId | None":
        """The identity of our own child ``proc`` (PID and creation time, no executable: it may
        still exec another program). Its PID cannot be reused before we reap it."""
        ctime = create_time(proc.pid) if proc.returncode is None else None
        return None if ctime is None else cls(proc.pid, ctime)

    @classmethod
    def recorded(cls, pid: int | None, ctime: float | None, exe: str | None = None,
                 cmdline: list[str] | tuple[str, ...] | None = None) -> "ProcessId | None":
        """From a record's fields; None if pid or ctime is missing."""
        return cls(pid, ctime, exe, tuple(cmdline or ())) if pid and ctime is not None else None

    def mismatch(self) -> str | None:
        """Why the PID is not (or no longer) this process: ``"gone"``, ``"created at ..."``,
        ``"runs ..."``; None while it is."""
        try:
            p = psutil.Process(self.pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return "gone"
            now = p.create_time()
        except psutil.Error:
            return "gone"
        if abs(now - self.ctime) >= CTIME_TOLERANCE_S:
            return f"pid {self.pid} is another process now (created at {now:.2f}, recorded {self.ctime:.2f})"
        if self.exe is not None:
            exe = _exe(p)
            if exe != self.exe:
                return f"pid {self.pid} runs {exe or '(unreadable)'}, recorded {self.exe}"
        return None

    def alive(self) -> bool:
        """True while ``pid`` is alive and still has the recorded creation time and executable."""
        return self.mismatch() is None

    def as_record(self) -> dict:
        """JSON-friendly fields (``pid``, ``ctime``, ``exe``, ``cmdline``)."""
        return {"pid": self.pid, "ctime": self.ctime, "exe": self.exe, "cmdline": list(self.cmdline)}


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
    """Send ``sig`` to the one process ``ident`` if it still is that process (creation time,
    executable). Returns True if it was signalled; False (nothing sent) otherwise."""
    if ident is None:
        return False
    _require(ident)
    if not ident.alive():
        return False
    try:
        # psutil checks the creation time once more right before the kill(2)
        psutil.Process(ident.pid).send_signal(sig)
    except psutil.Error:
        return False
    return True


def kill_tree(root: ProcessId | None, timeout_s: float = 10.0) -> bool:
    """SIGTERM ``root`` and all its descendants, SIGKILL what is left after ``timeout_s``
    seconds; waits up to 5 s more for the killed ones. Returns True if a tree was signalled.

    ``root`` is acted on only while it still is the recorded process (:meth:`ProcessId.alive`:
    same creation time and executable); a reused PID is left alone. Its descendants are found
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
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
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
