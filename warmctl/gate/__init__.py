"""The gate: the public port, opened only after the canary passed.

The engine listens on an internal loopback port. ``warmctl up`` starts the gate only once the
restored (or cold-started) engine has reproduced its canary; the gate then accepts on the
public address (plain TCP, or TLS from certificate/key files), reads each request once with a
strict parser, lets through only the inference API's routes with a valid API key, and
forwards what it read, re-written, to the engine. It exits when the engine's root process is
gone, so the public port never stays open in front of a dead engine.

One concern per module; a request's whole path reads top-down in :mod:`warmctl.gate.server`:

========================  ================================================================
:mod:`~.config`           what a gate enforces (:class:`GateConfig`), to and from its command line
:mod:`~.files`            API key file and TLS certificate pair (private-file rules)
:mod:`~.routes`           the allow list, control routes, the key check, the engine's table
:mod:`~.http`             reading requests (llhttp via httptools), writing them canonically
:mod:`~.relay`            the engine connection, the engine-to-client relay, response ends
:mod:`~.server`           the listener and each connection: read, check, forward, relay
:mod:`~.drain`            stopping without cutting answers in flight
:mod:`~.lazy`             watching a lazy restore's page daemon
:mod:`~.process`          starting the gate process
========================  ================================================================

SIGHUP (and any change of the key, certificate or private-key file, seen within 1 s) reloads
the keys and the certificate; open connections keep going.

Importing this package (what ``warmctl up`` does) loads only what starting and stopping the
gate needs: no asyncio, no HTTP parser.
"""

from warmctl.gate.config import GateConfig, Limits
from warmctl.gate.drain import drain
from warmctl.gate.files import GateConfigError, private_file_problem, read_keys, tls_context
from warmctl.gate.lazy import LazyWatch
from warmctl.gate.process import PendingGate, prestart, start
from warmctl.base.ports import port_free, require_port_free

__all__ = ["GateConfig", "GateConfigError", "Limits", "LazyWatch", "PendingGate", "drain", "port_free", "prestart",
           "private_file_problem", "read_keys", "require_port_free", "start", "tls_context"]
