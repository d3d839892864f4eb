"""Whether a TCP port is free here, and who holds it when not.

Checked before anything listens: the gate's public port and the engine's internal one (``up``,
``snapshot``), the agent's address, and every port a snapshot's tree listened on (CRIU restores
those sockets bound to the same address and port).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from pathlib import Path

from warmctl.base.errors import HostError

#: The ports the kernel gives to no ``bind`` to port 0 and no ``connect`` (a comma-separated list
#: of ports and ranges), while an explicit bind, as CRIU's restore of a listening socket, still
#: gets them (Documentation/networking/ip-sysctl.rst; checked on kernel 6.18).
RESERVED_PORTS = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")


def port_free(host: str, port: int) -> bool:
    """True if a TCP listener could bind ``host:port`` now (SO_REUSEADDR, like uvicorn)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def require_port_free(host: str, port: int, what: str) -> None:
    """Raise :class:`HostError` naming ``what`` and the holder's PID if ``host:port`` is taken."""
    if port_free(host, port):
        return
    raise HostError(f"{what} {host}:{port} is already in use{port_holder(port)}; free it or choose another port")


def reserve_command(ports: Iterable[int]) -> str:
    """The ``sysctl`` command that adds ``ports`` to the host's reserved ports
    (:data:`RESERVED_PORTS`), keeping those already reserved: the list is replaced as a whole."""
    try:
        have = RESERVED_PORTS.read_text().strip()
    except OSError:
        have = ""
    new = ",".join(str(p) for p in sorted(set(ports)))
    return f"sysctl -w net.ipv4.ip_local_reserved_ports={have + ',' if have else ''}{new}"


def port_holder(port: int) -> str:
    """`` (by pid PID, NAME)`` of the process listening on TCP ``port``, or "" when none is
    found (best effort: for an error message)."""
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f" (by pid {c.pid}, {psutil.Process(c.pid).name()})"
    except Exception:  # noqa: BLE001 - best effort decoration of an error message
        pass
    return ""
