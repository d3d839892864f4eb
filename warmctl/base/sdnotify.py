"""systemd's service notification protocol (``sd_notify(3)``), without libsystemd.

A message is one datagram of ``KEY=VALUE`` lines sent to the unix socket named by
``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket); systemd sets it for
``Type=notify`` units. Keys warmctl sends: ``READY=1``, ``STOPPING=1``, ``STATUS=text``,
``EXTEND_TIMEOUT_USEC=N`` (the start timeout is extended to N microseconds from now),
``WATCHDOG=1`` (keep-alive; systemd expects one every ``$WATCHDOG_USEC`` microseconds when the
unit sets ``WatchdogSec=``).
"""

from __future__ import annotations

import os
import socket


def notify(*lines: str, env: dict[str, str] | None = None) -> bool:
    """Send ``lines`` (e.g. ``"READY=1"``, ``"STATUS=serving"``) as one datagram to
    ``$NOTIFY_SOCKET``. Returns False when there is no socket (not under systemd) or the send
    failed (never raises: a notification is advice to the service manager)."""
    addr = (env if env is not None else os.environ).get("NOTIFY_SOCKET")
    if not addr or not lines:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError:
        return False


def watchdog_interval_s(env: dict[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` keep-alives this process owes systemd: half of
    ``$WATCHDOG_USEC`` (as ``sd_watchdog_enabled(3)`` advises), or None when no watchdog is
    set for this process (unset, or ``$WATCHDOG_PID`` names another process)."""
    e = env if env is not None else os.environ
    usec, pid = e.get("WATCHDOG_USEC"), e.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
