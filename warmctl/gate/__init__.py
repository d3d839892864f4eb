"""The gate: the public port, opened only after the canary passed.

The engine listens on an internal loopback port. ``warmctl up`` starts the gate only once the
restored (or cold-started) engine has reproduced its canary; the gate then accepts on the
public address (plain TCP, or TLS from certificate/key files), reads each request once with a
strict parser, lets through only the inference API's routes with a valid API key, and
forwards what it read, re-written, to the engine. It exits when the engine's root process is
gone, so the public port never stays open in front of a dead engine.

One concern per module; a request's whole path reads top-down in :mod:`warmctl.gate.server`:

========================  ================================================================
:mod:`~.files`            API key file and TLS certificate pair (private-file rules)
:mod:`~.routes`           the allow list, control routes, the key check, the engine's table
:mod:`~.http`             reading requests (llhttp via httptools), writing them canonically
:mod:`~.relay`            the engine connection, the engine-to-client relay, response ends
:mod:`~.server`           the listener and each connection: read, check, forward, relay
:mod:`~.drain`            stopping without cutting answers in flight
:mod:`~.lazy`             watching a lazy restore's page daemon
:mod:`~.process`          starting the gate process and the options ``up`` gives it
========================  ================================================================

SIGHUP (and any change of the key, certificate or private-key file, seen within 1 s) reloads
the keys and the certificate; open connections keep going.

Importing this package (what ``warmctl up`` does) loads only what starting and stopping the
gate needs: no asyncio, no HTTP parser.
"""

from warmctl.gate.drain import drain
from warmctl.gate.files import GateConfigError, private_file_problem, read_keys, tls_context
from warmctl.gate.lazy import LazyWatch
from warmctl.gate.process import PendingGate, gate_enforces, policy_args, prestart, settings_args, start
from warmctl.ports import port_free, require_port_free

__all__ = ["GateConfigError", "LazyWatch", "PendingGate", "drain", "gate_enforces", "policy_args", "port_free",
           "prestart", "private_file_problem", "read_keys", "require_port_free", "settings_args", "start",
           "tls_context"]
