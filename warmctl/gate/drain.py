"""Draining: how a gate stops without cutting answers in flight.

``warmctl down`` calls :func:`drain` (SIGTERM to the gate process); the gate closes its
listener at once and runs :func:`drain_connections`: connections idle between requests close
at once, the others may finish for up to ``--drain-s``; a second SIGTERM ends the wait.
"""

from __future__ import annotations

import signal
import time


def drain(gate_proc, timeout_s: float) -> bool:
    """Ask the gate ``gate_proc`` (a :class:`warmctl.base.proc.ProcessId`, or None) to drain:
    SIGTERM closes its listener at once, open connections may finish for up to its own
    ``--drain-s``; wait up to ``timeout_s`` + 2 s for it to exit. True if it is gone."""
    from warmctl.base.proc import signal_process

    if gate_proc is None or not gate_proc.alive():
        return True
    if not signal_process(gate_proc, signal.SIGTERM):  # gone, or its PID is another process now
        return not gate_proc.alive()
    deadline = time.monotonic() + timeout_s + 2
    while time.monotonic() < deadline:
        if not gate_proc.alive():
            return True
        time.sleep(0.05)
    return not gate_proc.alive()


async def drain_connections(gate, drain_s: float, now) -> None:
    """In the gate, once its listener is closed: wait up to ``drain_s`` seconds for the open
    connections of ``gate`` (:class:`warmctl.gate.server.Gate`) to finish, closing each as
    soon as it is idle between requests (keep-alive: nothing in flight to wait for); stop
    waiting when ``now`` (an ``asyncio.Event``) is set. Then cancel what is left."""
    import asyncio

    if gate.conns and not now.is_set():
        print(f"gate: draining {len(gate.conns)} connection(s) for up to {drain_s:g} s", flush=True)
        deadline = time.monotonic() + drain_s
        while gate.conns and time.monotonic() < deadline and not now.is_set():
            for tracker, c_writer in list(gate.conns.values()):
                if tracker.idle:
                    c_writer.close()
            await asyncio.sleep(0.05)
    for t in list(gate.conns):
        t.cancel()
