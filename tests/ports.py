"""Free loopback ports for the suite's servers, taken below the kernel's ephemeral range.

A restored engine binds again every port its tree listened on, and a multi-rank engine's ranks
listen on dozens that the kernel picked from its ephemeral range (``net.ipv4.ip_local_port_range``:
docs/operations.md, "Ports"). A server of the suite on a port picked the same way (``bind`` to
port 0) can take one of them between a snapshot and its restore, and the restore is refused: it
stopped a restore of ``tiny-moe-tp2`` in CI ("port 127.0.0.1:44509 is already in use (by pid
23878, ceph-mon)", the session's Ceph RGW). So the suite's servers take their ports from
:data:`LOW` up to the start of that range, above the fixed engine ports (``WARMCTL_TEST_ENGINE_PORT``
and ``WARMCTL_TEST_GATE_PORT``, 18000 and 18080, plus their offsets). Imported as ``ports``
(``tests/`` is on ``sys.path`` under pytest) and as ``tests.ports``: it keeps no state.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The lowest port handed out: above the fixed engine and gate ports of tests/conftest.py.
LOW = 20000
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 by default; that default when the
    file cannot be read)."""
    try:
        return int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, from :data:`LOW` up to the ephemeral
    range's start (at random; the caller binds it soon after, as with a port the kernel picks).
    Where that range starts within 1,000 ports of :data:`LOW`, the kernel's choice (port 0).
    Raises RuntimeError when 200 tries find no free port."""
    high = ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(LOW, high) if high > LOW + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port on {host} in {LOW}-{high - 1} after 200 tries")
