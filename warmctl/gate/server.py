"""The gate's server: one listening socket, and the path of every request through it.

A client connection, top-down (:meth:`ClientConnection.run`):

1. **read**: the client's bytes go to llhttp (:class:`warmctl.gate.http.RequestReader`), under
   the :class:`Limits` that apply where the stream is: a head must arrive within
   ``head_timeout_s``, a body at ``body_min_rate`` bytes/s after ``body_timeout_s`` of grace, and
   an idle keep-alive connection closes after ``keep_alive_s``; each limit past gets 408 (or,
   idle, a close).
2. **check**: each parsed head against the :class:`warmctl.gate.routes.Policy`: an allowed path
   (404, or 403 for control routes), then the API key (401).
3. **forward**: the head as the gate re-wrote it (:meth:`warmctl.gate.http.Head.serialise`),
   then the body as parsed (re-chunked when chunked), over this client's engine connection
   (:class:`warmctl.gate.relay.EngineSide`, opened at the first request, reopened if the
   engine closed it between responses).
4. **relay**: the engine's responses go back from its read callback, unparsed
   (:mod:`warmctl.gate.relay`).

A refused request is answered after the responses to the requests before it (pipelining keeps
its order), and the connection is closed after it. ``Connection: close`` from the client (or
HTTP/1.0 without keep-alive) closes the connection after that request's response; one from
the engine, after the response that carried it. A client that half-closes after its request
still gets the answer. Every error ends as an answer (400/404/405/408/431/501/502/505) or a
clean close, logged in one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from warmctl.gate.config import Limits
from warmctl.gate.files import GateConfigError, read_keys, tls_context
from warmctl.gate.http import END, LAST_CHUNK, Head, Refused, RequestReader, chunk, timeout
from warmctl.gate.lazy import LazyWatch
from warmctl.gate.relay import EngineSide, ResponseTracker, end
from warmctl.gate.routes import Policy, engine_routes, route_report

BUF = 256 * 1024


class _Closed(Exception):
    """The connection ends without a response from the gate (the client was told, or left)."""


async def _received(reader: asyncio.StreamReader) -> bytes | None:
    """Up to :data:`BUF` bytes that have reached ``reader``'s socket (``b""`` at its EOF), without
    waiting for more; None if none has. Asked when a limit has passed: a gate the host left
    without CPU past its deadline (a loaded node) wakes to its timer before it reads its sockets
    (uvloop runs timers first), and the bytes that came in time must count as in time. One pass
    of the event loop (``sleep(0)``) moves them from the socket into ``reader``; the read under a
    zero timeout then takes them, since it does not suspend when bytes are buffered."""
    await asyncio.sleep(0)
    try:
        async with asyncio.timeout(0):
            return await reader.read(BUF)
    except TimeoutError:
        return None


class Gate:
    """One listening gate: its policy (reloadable), limits, TLS context, live connections."""

    def __init__(self, upstream: tuple[str, int], policy: Policy, key_file: Path | None = None,
                 tls: tuple[Path, Path] | None = None, limits: Limits | None = None):
        self.upstream, self.policy, self.key_file, self.tls = upstream, policy, key_file, tls
        self.limits = limits or Limits()
        self.ssl = tls_context(*tls) if tls else None
        #: live connections: handler task -> (tracker, client writer)
        self.conns: dict[asyncio.Task, tuple[ResponseTracker, asyncio.StreamWriter]] = {}
        self._stamps = self._file_stamps()

    def _file_stamps(self) -> tuple:
        out = []
        for p in [self.key_file, *(self.tls or ())]:
            try:
                st = os.stat(p) if p else None  # mode and owner too: a chmod 600 is a reason to retry
                out.append((st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode, st.st_uid) if st else None)
            except OSError:
                out.append(None)
        return tuple(out)

    def reload(self, why: str) -> None:
        """Re-read the key file and the certificate pair; on an error (including a key file or
        private key that group/others may read) keep what was loaded and log why, so a
        half-written or exposed file never opens or closes the door by accident."""
        self._stamps = self._file_stamps()
        if self.key_file is not None:
            try:
                keys = read_keys(self.key_file)
                self.policy.keys = keys
                print(f"gate: {why}: {len(keys)} API key(s) loaded from {self.key_file}", flush=True)
            except GateConfigError as e:
                print(f"gate: {why}: keeping the previous keys: {e}", flush=True)
        if self.tls and self.ssl is not None:
            try:
                tls_context(*self.tls, into=self.ssl)
                print(f"gate: {why}: TLS certificate reloaded from {self.tls[0]}", flush=True)
            except GateConfigError as e:
                print(f"gate: {why}: keeping the previous certificate: {e}", flush=True)

    def check_files(self) -> None:
        if self._file_stamps() != self._stamps:
            self.reload("file changed")

    async def handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        """``asyncio.start_server``'s callback: serve one client connection."""
        conn = ClientConnection(self, c_reader, c_writer)
        task = asyncio.current_task()
        self.conns[task] = (conn.tracker, c_writer)  # type: ignore[index]
        try:
            await conn.run()
        finally:
            self.conns.pop(task, None)  # type: ignore[arg-type]

    def authorize(self, head: Head) -> None:
        """Raise :class:`Refused` unless ``head``'s path is served and its key is good."""
        p = self.policy
        if not p.allowed(head.path):
            if p.denied(head.path):
                raise Refused(403, "Forbidden", f"{head.path} is not served on the public port", "forbidden_route")
            raise Refused(404, "Not Found", f"{head.path} is not served on the public port", "route_not_served")
        if p.needs_key(head.path) and not p.key_ok(head.authorization):
            raise Refused(401, "Unauthorized", "missing or invalid API key: send 'Authorization: Bearer <key>'"
                          if head.authorization is None else "invalid API key", "invalid_api_key",
                          b'WWW-Authenticate: Bearer realm="warmctl"\r\n')


class ClientConnection:
    """One client connection through the gate (see the module's docstring for its path)."""

    def __init__(self, gate: Gate, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter):
        self.gate, self.c_reader, self.c_writer = gate, c_reader, c_writer
        self.reader = RequestReader()
        self.tracker = ResponseTracker()
        self.engine: EngineSide | None = None
        self.head: Head | None = None  # the request being forwarded
        self.in_body = False  # its head is forwarded, its body not yet whole

    async def run(self) -> None:
        try:
            sock = self.c_writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self._requests()
        except Refused as r:
            await self._refuse(r)
        except (_Closed, ConnectionError, ssl.SSLError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - a bug must cost one connection and one log line, not the gate
            print(f"gate: connection from {self._peer()} closed on an internal error: {type(e).__name__}: {e}",
                  flush=True)
        finally:
            if self.engine is not None:
                self.engine.stop()
                self.engine.close()
            self.c_writer.close()

    async def _requests(self) -> None:
        """Read, check and forward request after request until the connection ends."""
        while True:
            events = await self._read()
            if events is None:  # the client closed its side: its answers still go back
                if self.reader.phase == "idle":
                    await self._answered()
                return
            for ev in events:
                if isinstance(ev, Refused):
                    raise ev
                if isinstance(ev, Head):
                    self.gate.authorize(ev)
                    await self._forward_head(ev)
                elif ev is END:
                    await self._end_body()
                    if not self.head.keep_alive:  # type: ignore[union-attr]
                        await self._answered()
                        return
                else:
                    await self._forward_body(ev)

    async def _read(self) -> list | None:
        """The events of the client's next bytes (None at its EOF), within :class:`Limits`."""
        lim, r = self.gate.limits, self.reader
        while True:
            if r.phase == "head":
                left = r.started + lim.head_timeout_s - time.monotonic()
            elif r.phase == "body":
                left = r.started + lim.body_timeout_s + r.body_bytes / lim.body_min_rate - time.monotonic()
            elif self.tracker.idle:  # the idle time counts from the end of the last response
                left = self.tracker.idle_since + lim.keep_alive_s - time.monotonic()
            else:  # a response is still streaming: look again after keep_alive_s at the latest
                left = lim.keep_alive_s
            data: bytes | None
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    data = await self.c_reader.read(BUF)
            except TimeoutError:
                data = await _received(self.c_reader)
            if data is None:  # the limit passed and nothing came
                if r.phase == "head":
                    raise timeout(f"request head not received within {lim.head_timeout_s:g} s") from None
                if r.phase == "body":
                    raise timeout(f"request body slower than {lim.body_min_rate:g} bytes/s") from None
                if self.tracker.idle and time.monotonic() >= self.tracker.idle_since + lim.keep_alive_s:
                    raise _Closed from None  # idle for keep_alive_s
                continue  # a response still streaming, or one that ended less than keep_alive_s ago
            if not data:
                return None
            if events := r.feed(data):
                return events

    async def _forward_head(self, head: Head) -> None:
        engine = await self._engine()
        self.tracker.methods.append(head.method)
        self.head, self.in_body = head, True
        engine.write(head.serialise())

    async def _forward_body(self, data: bytes) -> None:
        assert self.engine is not None and self.head is not None
        self.engine.write(chunk(data) if self.head.chunked else data)
        await self.engine.drain()

    async def _end_body(self) -> None:
        assert self.engine is not None and self.head is not None
        if self.head.chunked:
            self.engine.write(LAST_CHUNK)
        await self.engine.drain()
        self.in_body = False

    async def _engine(self) -> EngineSide:
        """This connection's engine connection: the open one, or a new one if there is none
        or the engine closed it between responses."""
        if self.engine is not None and not self.engine.closed.done():
            return self.engine
        if self.engine is not None and not self.engine.closed.result():
            raise _Closed  # the engine closed mid-response; the client was told
        loop = asyncio.get_running_loop()
        try:
            _, self.engine = await loop.create_connection(lambda: EngineSide(self.c_writer, self.tracker),
                                                          *self.gate.upstream)
        except OSError:
            raise Refused(502, "Bad Gateway", "the engine is not answering", "bad_gateway") from None
        return self.engine

    async def _answered(self) -> None:
        """Wait until every forwarded request has its whole response, or the engine closed."""
        if self.engine is not None and not self.engine.closed.done():
            await asyncio.wait({self.engine.closed, self.tracker.answered(0)}, return_when=asyncio.FIRST_COMPLETED)

    async def _refuse(self, r: Refused) -> None:
        """Send ``r``'s response and close: half-close, then read and drop what the client
        still sends for up to 2 s (at most 1 MiB), so closing does not reset the connection
        before the client has read the response.

        Responses come in request order (HTTP/1.1 pipelining): if requests forwarded before the
        refused one are still being answered, their responses are relayed whole first, however
        long they stream (a drain's deadline still applies). If the refused request's head was
        forwarded already (its body then broke a limit), the engine's answer to it is not
        waited for, only the earlier ones. The refusal is not sent if the engine closed first,
        or the client's stream is not at a response boundary."""
        engine, tracker, c_writer = self.engine, self.tracker, self.c_writer
        pending = 1 if self.in_body else 0
        if engine is not None and not engine.closed.done():
            await asyncio.wait({engine.closed, tracker.answered(pending)}, return_when=asyncio.FIRST_COMPLETED)
        if engine is not None:
            if engine.closed.done() and not engine.closed.result():
                return  # the engine closed mid-response: the client's side is closed already
            engine.stop()
        if tracker.state != tracker.HEAD or tracker.buf or len(tracker.methods) > pending:
            return  # cut mid-response, or an earlier request unanswered: a refusal now would be misread
        try:
            c_writer.write(r.response())
            await c_writer.drain()
            end(c_writer)
            deadline = time.monotonic() + 2.0
            dropped = 0
            while dropped < (1 << 20) and (left := deadline - time.monotonic()) > 0:
                data = await asyncio.wait_for(self.c_reader.read(65536), left)
                if not data:
                    break
                dropped += len(data)
        except (ConnectionError, asyncio.TimeoutError, ssl.SSLError, OSError, RuntimeError):
            pass

    def _peer(self) -> str:
        peer = self.c_writer.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"


def _log_exception(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The event loop's handler for errors outside a connection's task: one line, no traceback."""
    e = context.get("exception")
    print(f"gate: {context.get('message', 'error')}" + (f": {type(e).__name__}: {e}" if e else ""), flush=True)


async def _report_routes(gate: Gate) -> None:
    """Log, once, which routes the engine serves stay closed on the public port."""
    try:
        served = await engine_routes(*gate.upstream)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a report, never a reason to stop serving
        print(f"gate: could not read the engine's route table (GET /openapi.json): {type(e).__name__}: {e}; "
              f"the allow list applies as configured", flush=True)
        return
    print(route_report(gate.policy, served), flush=True)


async def serve(listen: tuple[str, int], gate: Gate, engine_pid: int | None, ready_fd: int | None = None,
                drain_s: float = 30.0, lazy: LazyWatch | None = None,
                since_start: Callable[[], float] | None = None) -> None:
    """Listen on ``listen`` for ``gate`` until SIGTERM/SIGINT (then drain for up to ``drain_s``),
    until ``engine_pid`` is gone, or until ``lazy``'s daemon exits before its copy ended. Says
    ``ready`` on stdout (and ``ready_fd``) once listening; with ``since_start`` (seconds since
    the process started) it logs when that was, after telling ``ready_fd``."""
    from warmctl.gate.drain import drain_connections
    from warmctl.base.proc import start_ticks

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_log_exception)
    pidfd = None
    if lazy is not None:
        pidfd, why = lazy.attach()
        if why is not None:  # the daemon died during the restore, health or canary: never listen
            print(f"gate: not opening: the lazy-pages daemon (pid {lazy.daemon.pid}) exited before it had copied "
                  f"every page: {why}", flush=True)
            if ready_fd is not None:
                os.write(ready_fd, f"refused lazy-pages {why}\n".encode())
                os.close(ready_fd)
            return
        if pidfd is None:
            print(f"gate: the lazy-pages daemon (pid {lazy.daemon.pid}) had finished its copy before the port opened",
                  flush=True)
    server = await asyncio.start_server(gate.handle, listen[0], listen[1], reuse_address=True, backlog=1024,
                                        ssl=gate.ssl)
    print("ready", flush=True)
    if ready_fd is not None:  # the parent waits on this pipe (no polling of the log)
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    if since_start is not None:
        print(f"gate: listening on {listen[0]}:{listen[1]} at {since_start():.3f} s", flush=True)
    report = asyncio.create_task(_report_routes(gate))
    stop = asyncio.Event()
    now = asyncio.Event()

    def on_term() -> None:
        (now if stop.is_set() else stop).set()  # a second SIGTERM/SIGINT: no more waiting
        stop.set()

    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_term)
    loop.add_signal_handler(signal.SIGHUP, gate.reload, "SIGHUP")

    engine_started = start_ticks(engine_pid) if engine_pid else None

    async def watch() -> None:
        # engine gone, or its PID reused by another process (start ticks differ): close;
        # key/certificate files changed: reload
        while not stop.is_set():
            if engine_pid and start_ticks(engine_pid) != engine_started:
                print(f"engine pid {engine_pid} is gone; closing the gate", flush=True)
                now.set()
                stop.set()
            gate.check_files()
            await asyncio.sleep(1.0)

    def on_daemon_exit() -> None:
        # the kernel made the pidfd readable: the lazy-pages daemon exited (no polling)
        assert lazy is not None and pidfd is not None
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if lazy.take_down(server, [w for _, w in gate.conns.values()]):
            now.set()
            stop.set()

    if pidfd is not None:
        loop.add_reader(pidfd, on_daemon_exit)
    watcher = asyncio.create_task(watch())
    await stop.wait()
    watcher.cancel()
    report.cancel()
    server.close()  # the listener first: no new connections from here on
    await drain_connections(gate, drain_s, now)
    print("gate: closed", flush=True)
