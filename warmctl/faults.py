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


#: The environment variable naming a rank to kill and where: ``POINT:ROLE`` (``ranks:Worker_TP1``).
RANK_ENV = "WARMCTL_TEST_KILL_RANK"


def kill_rank(name: str, root_pid: int) -> None:
    """If ``WARMCTL_TEST_KILL_RANK`` is ``NAME:ROLE``: SIGKILL the rank ``ROLE`` (its process
    title ``VLLM::ROLE``, :mod:`warmctl.checkpoint.layout`) of ``root_pid``'s tree at this point
    and wait until it is dead, as a ``kill -9`` of one rank would (points: ``before_dump``,
    after the warm-up and canary; ``ranks``, after a restore, before its ranks are checked).
    Unset: one dictionary lookup."""
    want = os.environ.get(RANK_ENV, "")
    point_, _, role = want.partition(":")
    if point_ != name or not role:
        return
    import time

    from warmctl.checkpoint.layout import live_ranks
    from warmctl.proc import ProcessId, pid_alive, signal_process

    r = live_ranks(root_pid).get(role)
    if r is None:
        return
    signal_process(ProcessId.of(r.pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(r.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
