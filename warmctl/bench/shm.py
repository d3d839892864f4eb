"""Benchmarks leave ``/dev/shm`` as they found it.

Every benchmark that starts an engine (``benchmarks/*.py``: agent_load, cpu_binding, fleet_up,
gate_overhead, lazy_restore, restore_vs_cold, up_vs_raw) runs its ``main()`` under
:func:`as_found` (:func:`run` adds the SIGTERM handling): files
that appeared in ``/dev/shm`` during the run and that no process maps or holds open at its end
are what it leaked; they are named on stderr (with their size) and the run exits 1, so a
recorded figure never comes from a run that left something behind. Files of engines still
running (another user's on a shared host) are not counted.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from warmctl.checkpoint import capture


def left_since(before: set[str]) -> list[capture.ShmFile]:
    """Files in ``/dev/shm`` whose names are not in ``before`` and that no process uses."""
    return [f for f in capture.shm_not_owned(set()) if f.path.name not in before and not f.users]


@contextmanager
def as_found(label: str = "benchmark") -> Iterator[None]:
    """Run the block; then raise ``SystemExit(1)`` naming what it left in ``/dev/shm`` (see the
    module doc). An exception of the block passes through unchanged (the leak is still named)."""
    before = capture.shm_names()
    ok = False
    try:
        yield
        ok = True
    finally:
        left = left_since(before)
        for f in left:
            print(f"{label}: left {f.path} ({f.size} bytes, {f.allocated} in memory) in /dev/shm", file=sys.stderr)
        if left and ok:
            raise SystemExit(1)


def run(main, label: str) -> None:
    """Run a benchmark's ``main()`` under :func:`as_found`, SIGTERM raising KeyboardInterrupt
    like Ctrl-C, so the ``finally`` clean-up of ``main`` runs for both."""
    import signal

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    with as_found(label):
        main()
