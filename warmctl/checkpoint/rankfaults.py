"""A test hook that kills or stops one rank of an engine at a named point.

With ``WARMCTL_TEST_KILL_RANK`` in its environment (see :data:`RANK_ENV`), warmctl sends a rank
of the engine it runs a real signal at the point named: the hook only chooses the moment. Found
through the rank model (:func:`warmctl.checkpoint.layout.live_ranks`); the hook that kills
warmctl itself at a phase is :mod:`warmctl.base.faults`. Unset (always, outside tests), each hook
costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

#: The environment variable naming ranks to kill and where: ``POINT:ROLE[:SIGNAL]``, several
#: separated by commas (``ranks:Worker_TP1``, ``before_dump:Worker_TP0,before_dump:Worker_TP1:STOP``,
#: ``dump:Worker_TP1``: :func:`kill_rank` and :func:`kill_rank_during_dump`).
RANK_ENV = "WARMCTL_TEST_KILL_RANK"


def kill_rank(name: str, root_pid: int) -> list[int]:
    """For each ``POINT:ROLE[:SIGNAL]`` of ``WARMCTL_TEST_KILL_RANK`` whose point is ``name``:
    send the rank ``ROLE`` (its process title ``VLLM::ROLE``, :mod:`warmctl.checkpoint.layout`)
    of ``root_pid``'s tree ``SIGNAL`` (``KILL``, the default: then wait until it is dead, as a
    ``kill -9`` of one rank would; ``STOP``: then wait until it is stopped, as a rank stuck would be, its peers
    waiting on it in their collectives; any other name, e.g. ``USR2``: sent, not waited on; the
    test engine's rank hangs on it, alive and silent, tests/fake_vllm.py). Points: ``warmup``, while the warm-up grid runs (after
    its first cell, :func:`warmctl.engine.cold.warm_and_record`); ``before_dump``, after the
    warm-up and canary; ``ranks``, after a restore, before its ranks are checked (``dump``,
    while ``criu dump`` runs, is :func:`kill_rank_during_dump`'s). The hook
    only chooses the moment: the signal is real. Returns the PIDs signalled. Unset: one
    dictionary lookup."""
    want = os.environ.get(RANK_ENV, "")
    if not want:
        return []
    import time

    from warmctl.checkpoint.layout import live_ranks, stopped
    from warmctl.base.proc import ProcessId, pid_alive, signal_process

    done: list[int] = []
    for item in want.split(","):
        point_, _, rest = item.strip().partition(":")
        role, _, sig_name = rest.partition(":")
        if point_ != name or not role:
            continue
        name_ = sig_name.upper().removeprefix("SIG") or "KILL"
        sig = signal.Signals["SIG" + name_]
        r = live_ranks(root_pid).get(role)
        if r is None:
            continue
        signal_process(ProcessId.of(r.pid), sig)
        done.append(r.pid)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            continue
        deadline = time.monotonic() + 10
        while (pid_alive(r.pid) if sig == signal.SIGKILL else not stopped(r.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
    return done


def _tracer(pid: int) -> int | None:
    """``TracerPid`` of ``pid`` (``/proc/PID/status``: 0 when nothing ptraces it); None when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@contextmanager
def kill_rank_during_dump(root_pid: int, poll_s: float = 0.002) -> Iterator[list[int]]:
    """Around a ``criu dump`` of ``root_pid``'s tree: for each ``dump:ROLE`` of
    ``WARMCTL_TEST_KILL_RANK``, a thread that waits until CRIU has seized the whole tree (every
    process of it, as found on entry, has a ``criu`` process as its ``TracerPid`` in
    ``/proc/PID/status``: the tree is frozen and CRIU's dump of it under way, its images not
    yet complete), then sends the rank ``ROLE`` a real SIGKILL (a signal sent to a ptraced,
    stopped process still kills it) and waits up to 10 s until it is dead. CRIU dumps the tree's
    processes one by one after the seize; a kill that lands after CRIU has written the rank's
    images cannot fail the dump, so the thread runs at real-time priority (``SCHED_FIFO``,
    where the host allows it: a loaded host cannot delay its next look) and holds CRIU with
    ``SIGSTOP`` from the moment it sees the seize until the rank is dead. Why not a line of
    CRIU's ``dump.log``: warmctl runs CRIU at ``-v2`` (errors and warnings), which logs nothing
    when a dump begins; the tracer is what CRIU's seize itself sets. CRIU is only paused
    (SIGSTOP, then SIGCONT) around the kill, never changed.
    ``poll_s``: seconds between two looks. Yields the list of PIDs killed (filled in by the
    thread; read it after the block); the thread is stopped and joined when the block ends,
    before the caller handles the dump's outcome, so a rank killed is dead by then. A dump
    that ends before the tree was seized kills nothing. Unset (outside tests) or naming no
    ``dump`` point: one dictionary lookup, no thread."""
    want = os.environ.get(RANK_ENV, "")
    roles = [rest.partition(":")[0] for item in want.split(",") if want
             for point_, _, rest in [item.strip().partition(":")] if point_ == "dump" and rest]
    killed: list[int] = []
    if not roles:
        yield killed
        return
    import time

    from warmctl.checkpoint.layout import live_ranks
    from warmctl.base.proc import ProcessId, pid_alive, signal_process, tree_pids

    live = live_ranks(root_pid)
    targets = [(r.pid, ProcessId.of(r.pid)) for role in roles if (r := live.get(role)) is not None]
    tree = tree_pids(root_pid)
    done = threading.Event()

    def seized() -> bool:
        tracers = [_tracer(p) for p in tree]
        return all(tracers) and all(_comm(t) == "criu" for t in set(tracers) if t)

    def body() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))  # 0: this thread
        except (OSError, AttributeError):
            pass  # no real-time priority here: the looks may come late on a loaded host
        while not done.is_set():
            if seized():
                criu_ = ProcessId.of(_tracer(root_pid) or 0)
                held = signal_process(criu_, signal.SIGSTOP)
                try:
                    for pid, ident in targets:
                        if signal_process(ident, signal.SIGKILL):
                            killed.append(pid)
                    deadline = time.monotonic() + 10
                    while any(pid_alive(p) for p in killed) and time.monotonic() < deadline:
                        time.sleep(0.01)
                finally:
                    if held:
                        signal_process(criu_, signal.SIGCONT)
                return
            if not tree or _tracer(root_pid) is None:
                return  # the tree is gone
            time.sleep(poll_s)

    t = threading.Thread(target=body, name="warmctl-test-kill-rank-during-dump", daemon=True)
    t.start()
    try:
        yield killed
    finally:
        done.set()
        t.join()
