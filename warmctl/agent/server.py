"""Running the agent: :class:`AgentConfig` (filled by the CLI), :func:`run` (uvicorn), the
bearer token file, and systemd's readiness notification.

``run`` serves the app on ``host:port`` (127.0.0.1:7420 by default), with TLS when a
certificate and key are given. It tells systemd ``READY=1`` over ``$NOTIFY_SOCKET`` only
after start-up recovery finished and the socket listens (``Type=notify`` units), and
``STOPPING=1`` when it shuts down. The datagram is written by hand (no libsystemd needed).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from warmctl.config import Settings
from warmctl.errors import HostError

log = logging.getLogger("warmctl.agent")


@dataclass
class AgentConfig:
    """Where and how the agent listens. ``token_file`` holds the bearer token (one line);
    ``tls_cert``/``tls_key``: PEM files, both or neither."""

    settings: Settings
    host: str = "127.0.0.1"
    port: int = 7420
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def from_settings(cls, settings: Settings, **overrides) -> "AgentConfig":
        """Defaults from ``settings`` (``agent_host``, ``agent_port``, ``agent_token_file``,
        else ``<home>/agent/token``); ``None`` overrides are ignored."""
        c = cls(settings=settings, host=settings.agent_host, port=settings.agent_port,
                token_file=settings.agent_token_file or settings.home / "agent" / "token")
        for k, v in overrides.items():
            if v is not None:
                setattr(c, k, v)
        return c


def read_token(path: Path, create: bool = True) -> str:
    """The bearer token in ``path`` (first line, stripped). With ``create``, a missing file is
    created with a fresh random token (32 bytes, URL-safe base64), mode 0600.

    Raises :class:`HostError` when the file is unreadable, empty, or readable by others
    (mode & 0o077) -- a token anyone on the host can read protects nothing.
    """
    path = Path(path)
    if not path.exists() and create:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        log.warning("created a new agent token in %s", path)
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as e:
        raise HostError(f"agent token file {path}: {e.strerror}") from None
    if st.st_mode & 0o077:
        raise HostError(f"agent token file {path} is readable by group or others (mode {st.st_mode & 0o777:o}); "
                        f"chmod 600 {path}")
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise HostError(f"agent token file {path} is empty")
    return token


def sd_notify(message: str, env: dict[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to systemd over ``$NOTIFY_SOCKET`` (a path, or
    ``@name`` for an abstract socket). Returns False when there is no socket to tell;
    a send error is logged, never raised."""
    addr = (env if env is not None else os.environ).get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as e:
        log.warning("sd_notify(%r) to %s failed: %s", message, addr, e)
        return False


def run(config: AgentConfig) -> None:
    """Serve the agent until SIGINT/SIGTERM. Raises :class:`HostError` for a bad token file,
    half a TLS pair, or an address already in use."""
    import uvicorn

    from warmctl.gate import require_port_free

    from .app import create_app

    if bool(config.tls_cert) != bool(config.tls_key):
        raise HostError("TLS needs both --tls-cert and --tls-key")
    for p in (config.tls_cert, config.tls_key):
        if p and not Path(p).is_file():
            raise HostError(f"TLS file {p} does not exist")
    token = read_token(config.token_file or config.settings.home / "agent" / "token")
    require_port_free(config.host, config.port, "agent address")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config.settings, token, tls=bool(config.tls_cert))
    uconf = uvicorn.Config(app, host=config.host, port=config.port, log_level="info", access_log=False,
                           ssl_certfile=str(config.tls_cert) if config.tls_cert else None,
                           ssl_keyfile=str(config.tls_key) if config.tls_key else None,
                           timeout_graceful_shutdown=5, lifespan="on")

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                scheme = "https" if config.tls_cert else "http"
                log.info("warmctl agent ready on %s://%s:%d (home %s)", scheme, config.host, config.port,
                         config.settings.home)
                sd_notify(f"READY=1\nSTATUS=serving on {scheme}://{config.host}:{config.port}\nMAINPID={os.getpid()}")

        async def shutdown(self, sockets=None) -> None:
            sd_notify("STOPPING=1")
            await super().shutdown(sockets)

    Server(uconf).run()
