"""Taking an exclusive ``flock(2)`` on an open file: :func:`lock_exclusive`, the one helper
for warmctl's host-wide locks (one ``up``/``down`` per engine name: :mod:`warmctl.records.enginelock`;
one CRIU dump or restore at a time: :func:`warmctl.checkpoint.criu.host_lock`).

The lock belongs to the open file description: closing the file (or the process ending, however
it ends) releases it, so a crashed holder never leaves a stale lock behind."""

from __future__ import annotations

import fcntl
import time
from typing import IO, Callable

#: seconds between tries while waiting with a timeout
POLL_S = 0.2


def lock_exclusive(f: int | IO, on_wait: Callable[[], None] | None = None, timeout_s: float | None = None) -> bool:
    """Take an exclusive ``flock`` on ``f`` (a file descriptor or an open file).

    When another holder has it, ``on_wait()`` is called once, then this waits: without
    ``timeout_s`` until the lock is free (blocking in the kernel), with it for at most
    ``timeout_s`` seconds (trying every :data:`POLL_S`). Returns whether it had to wait.
    Raises :class:`TimeoutError` when ``timeout_s`` passed first."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        pass
    if on_wait is not None:
        on_wait()
    if timeout_s is None:
        fcntl.flock(f, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(POLL_S)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the lock was held for {timeout_s:.0f} s") from None
