"""A test hook that kills warmctl at a named point, to try what a crash there leaves.

With ``WARMCTL_TEST_KILL_AT_PHASE=NAME`` in its environment, warmctl sends itself SIGKILL when
it reaches the point ``NAME``: the start of every timed phase of ``snapshot`` and ``up``
(:meth:`warmctl.progress.Reporter.phase`: ``cold_start``, ``warmup``, ``canary_record``,
``criu_dump``, ``store``, ``publish``, ``push``; ``materialize``, ``restore``, ``health``,
``canary``, ``gate``...) and the steps of the store commands that have no timed phase:
``transfer_chunks``, ``transfer_manifest``, ``transfer_catalog`` (``push``/``pull``, after the
chunks, manifest and signatures respectively are written: :func:`warmctl.fleet.transfer`),
``gc_manifests`` and ``gc_chunks`` (``gc``, after its first removal of each kind). Nothing
runs after the signal: no ``finally``, no ``atexit``, as with ``kill -9`` or a power loss of
the process. Unset (always, outside tests), :func:`point` costs one dictionary lookup.
Processes warmctl starts (the engine, the gate) inherit the variable and never read it.
"""

from __future__ import annotations

import os
import signal

#: The environment variable naming the point to die at.
ENV = "WARMCTL_TEST_KILL_AT_PHASE"


def point(name: str) -> None:
    """SIGKILL this process if ``WARMCTL_TEST_KILL_AT_PHASE`` is ``name`` (see module doc)."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


#: The environment variable naming ranks to kill and where: ``POINT:ROLE[:SIGNAL]``, several
#: separated by commas (``ranks:Worker_TP1``, ``before_dump:Worker_TP0,before_dump:Worker_TP1:STOP``).
RANK_ENV = "WARMCTL_TEST_KILL_RANK"


def kill_rank(name: str, root_pid: int) -> list[int]:
    """For each ``POINT:ROLE[:SIGNAL]`` of ``WARMCTL_TEST_KILL_RANK`` whose point is ``name``:
    send the rank ``ROLE`` (its process title ``VLLM::ROLE``, :mod:`warmctl.checkpoint.layout`)
    of ``root_pid``'s tree ``SIGNAL`` (``KILL``, the default: then wait until it is dead, as a
    ``kill -9`` of one rank would; ``STOP``: then wait until it is stopped, as a rank stuck would be, its peers
    waiting on it in their collectives). Points: ``warmup``, while the warm-up grid runs (after
    its first cell, :func:`warmctl.engine.cold.warm_and_record`); ``before_dump``, after the
    warm-up and canary; ``ranks``, after a restore, before its ranks are checked. The hook
    only chooses the moment: the signal is real. Returns the PIDs signalled. Unset: one
    dictionary lookup."""
    want = os.environ.get(RANK_ENV, "")
    if not want:
        return []
    import time

    from warmctl.checkpoint.layout import live_ranks, stopped
    from warmctl.proc import ProcessId, pid_alive, signal_process

    done: list[int] = []
    for item in want.split(","):
        point_, _, rest = item.strip().partition(":")
        role, _, sig_name = rest.partition(":")
        if point_ != name or not role:
            continue
        sig = signal.SIGSTOP if sig_name.upper() in ("STOP", "SIGSTOP") else signal.SIGKILL
        r = live_ranks(root_pid).get(role)
        if r is None:
            continue
        signal_process(ProcessId.of(r.pid), sig)
        done.append(r.pid)
        deadline = time.monotonic() + 10
        while (pid_alive(r.pid) if sig == signal.SIGKILL else not stopped(r.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
    return done
