"""Running the agent: :class:`AgentConfig` (filled by the CLI), :func:`run` (uvicorn), the
bearer token file, and systemd's readiness notification.

``run`` serves the app on ``host:port`` (127.0.0.1:7420 by default), with TLS when a
certificate and key are given; an address beyond loopback without TLS is refused unless
``insecure_no_tls`` (``--insecure-no-tls``) says so. Against hostile or broken clients
 every connection must send its request headers within ``agent_header_timeout_s`` (10 s)
(uvicorn has no such timeout: its keep-alive timer only runs *between* requests, measured:
50 connections sending a header byte every few seconds stayed open for 60 s), at most
:data:`MAX_CONNECTIONS` connections are open at once (more are closed on arrival), at most
:data:`LIMIT_CONCURRENCY` requests run at once (uvicorn answers more with 503), and an idle
keep-alive connection is closed after ``agent_keep_alive_s`` (5 s). It tells systemd ``READY=1`` over ``$NOTIFY_SOCKET`` only
after start-up recovery finished and the socket listens (``Type=notify`` units), and
``STOPPING=1`` when it shuts down. The datagram is written by hand (no libsystemd needed).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from warmctl.records.config import Settings
from warmctl.base.errors import HostError
from warmctl.base.private import read_token as private_read_token
from warmctl.base.sdnotify import notify

#: open connections at most; one more is closed as soon as it is accepted
MAX_CONNECTIONS = 256
#: requests (or connections) in progress at most before uvicorn answers 503
LIMIT_CONCURRENCY = 128

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
    #: listen beyond loopback without TLS anyway (the bearer token then crosses the network
    #: in clear text): only behind a TLS-terminating proxy or on an isolated network
    insecure_no_tls: bool = False

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
    """The agent's bearer token in ``path`` (:func:`warmctl.base.private.read_token`, private: a
    file readable by group or others is refused). With ``create``, a missing file is created
    with a fresh random token, mode 0600 (and logged). Raises :class:`HostError`."""
    path = Path(path)
    created = create and not path.exists()
    token = private_read_token(path, create=create)
    if created:
        log.warning("created a new agent token in %s", path)
    return token


def sd_notify(message: str, env: dict[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to systemd over ``$NOTIFY_SOCKET`` (see
    :func:`warmctl.base.sdnotify.notify`). Returns False when there is no socket or the send failed;
    a failed send is logged, never raised."""
    sent = notify(message, env=env)
    if not sent and (env if env is not None else os.environ).get("NOTIFY_SOCKET"):
        log.warning("sd_notify(%r) failed", message)
    return sent


def is_loopback(host: str) -> bool:
    """True if ``host`` (an address or ``localhost``) reaches only this host."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def guarded_protocol(header_timeout_s: float, max_connections: int = MAX_CONNECTIONS):
    """uvicorn's httptools HTTP protocol with a header timeout (seconds a connection may take to
    send a request's line and headers, counted from the connection for its first request or from
    a later request's first byte; then it is closed) and a connection limit (see the module
    doc); passed as ``uvicorn.Config(http=...)``. Raises :class:`HostError` without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as e:  # pragma: no cover - a dependency (pyproject.toml)
        raise HostError(f"the agent needs httptools (pip install httptools): {e}") from None

    class GuardedHttpProtocol(HttpToolsProtocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.logger.warning("closing a connection from %s: %d connections are open (the limit)",
                                    self.client, max_connections)
                transport.close()
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.logger.warning("closing a connection from %s: no complete request headers within %.0f s",
                                    self.client, header_timeout_s)
                self.transport.close()

    return GuardedHttpProtocol


def run(config: AgentConfig) -> None:
    """Serve the agent until SIGINT/SIGTERM. Raises :class:`HostError` for a bad token file,
    half a TLS pair, an address beyond loopback without TLS (unless ``insecure_no_tls``), or
    an address already in use."""
    import uvicorn

    from warmctl.gate import require_port_free

    from .app import create_app

    if bool(config.tls_cert) != bool(config.tls_key):
        raise HostError("TLS needs both --tls-cert and --tls-key")
    if not config.tls_cert and not is_loopback(config.host):
        if not config.insecure_no_tls:
            raise HostError(f"agent address {config.host} is beyond loopback and the agent has no TLS: the bearer "
                            "token would cross the network in clear text; give --tls-cert/--tls-key, or "
                            "--insecure-no-tls behind a TLS-terminating proxy (see docs/operations.md)")
        log.warning("INSECURE: listening on %s without TLS (--insecure-no-tls)", config.host)
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
                           timeout_graceful_shutdown=5, lifespan="on", http=guarded_protocol(config.settings.agent_header_timeout_s),
                           ws="none",  # no WebSocket: an Upgrade is answered as plain HTTP (guarded)
                           limit_concurrency=LIMIT_CONCURRENCY, timeout_keep_alive=config.settings.agent_keep_alive_s)

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
