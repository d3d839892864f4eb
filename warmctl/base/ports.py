"""Whether a TCP port is free here, and who holds it when not.

Checked before anything listens: the gate's public port and the engine's internal one (``up``,
``snapshot``), the agent's address, and every port a snapshot's tree listened on (CRIU restores
those sockets bound to the same address and port).
"""

from __future__ import annotations

import socket

from warmctl.base.errors import HostError


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
    holder = _port_holder(port)
    raise HostError(f"{what} {host}:{port} is already in use{holder}; free it or choose another port")


def _port_holder(port: int) -> str:
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f" (by pid {c.pid}, {psutil.Process(c.pid).name()})"
    except Exception:  # noqa: BLE001 - best effort decoration of an error message
        pass
    return ""
