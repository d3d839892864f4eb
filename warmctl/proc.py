"""Process identity and the one way warmctl kills a process tree.

A PID alone never identifies a process: PIDs are reused quickly (``pid_max`` can be 32768 and
an engine uses ~70 of them), so warmctl records a process as :class:`ProcessId` (PID plus the
creation time psutil reports, Unix seconds) and acts on it only while both still match.
"""

from __future__ import annotations

import signal
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


@dataclass(frozen=True)
class ProcessId:
    """One process: host ``pid`` and its ``ctime`` (creation time, Unix seconds)."""

    pid: int
    ctime: float

    @classmethod
    def of(cls, pid: int) -> "ProcessId | None":
        """The identity of the process ``pid`` is now, or None if it does not exist."""
        ctime = create_time(pid)
        return None if ctime is None else cls(pid, ctime)

    @classmethod
    def recorded(cls, pid: int | None, ctime: float | None) -> "ProcessId | None":
        """From a record's (pid, ctime) fields; None if either is missing."""
        return cls(pid, ctime) if pid and ctime is not None else None

    def alive(self) -> bool:
        """True while ``pid`` is alive and still has the recorded creation time."""
        if not pid_alive(self.pid):
            return False
        now = create_time(self.pid)
        return now is not None and abs(now - self.ctime) < CTIME_TOLERANCE_S


def tree_pids(root_pid: int) -> list[int]:
    """``root_pid`` and all its descendants (host PIDs, from their parent links), sorted;
    [] if the root is gone."""
    try:
        root = psutil.Process(root_pid)
        return sorted([root.pid] + [c.pid for c in root.children(recursive=True)])
    except psutil.Error:
        return []


def kill_tree(root: int | ProcessId | None, timeout_s: float = 10.0) -> bool:
    """SIGTERM ``root`` and all its descendants, SIGKILL what is left after ``timeout_s``
    seconds; waits up to 5 s more for the killed ones. Returns True if a tree was signalled.

    ``root`` as a :class:`ProcessId` is acted on only while it is still that process (a reused
    PID is left alone); as a bare PID, whatever process has it now. Killing a PID namespace's
    PID 1 also kills every process inside it (kernel rule).
    """
    if root is None or (isinstance(root, ProcessId) and not root.alive()):
        return False
    pid = root.pid if isinstance(root, ProcessId) else root
    try:
        top = psutil.Process(pid)
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
