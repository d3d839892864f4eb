"""The gate: the public port, opened only after the canary passed.

The engine listens on an internal loopback port. ``warmctl up`` starts the gate only once the
restored (or cold-started) engine has reproduced its canary; the gate then accepts on the
public address (plain TCP, or TLS from certificate/key files) and relays each connection to
the engine. It exits when the engine's root process is gone, so the public port never stays
open in front of a dead engine.

What it parses, and what it does not: every HTTP/1.x request head a client sends (including
the second and later requests of a keep-alive connection) is read whole and checked against
the :class:`Policy` (API key, control routes) *before* a byte of it reaches the engine; the
request body is relayed as bytes, following its framing (``Content-Length`` or chunked) only
to find where the next request head starts. The engine-to-client direction (responses,
SSE streams) is relayed as bytes, unparsed and unbuffered. A refused request gets an
OpenAI-style JSON error (401 + ``WWW-Authenticate: Bearer`` for a missing/wrong key, 403 for
a control route, 400/431 for a malformed head), after the responses to the requests before it
on the connection (pipelining keeps its order), and the connection is closed after it, so a
client pipelining behind a refused request never receives another request's response.

Run as ``python -m warmctl.gate --listen HOST:PORT --upstream HOST:PORT --engine-pid PID
[--api-key-file F] [--tls-cert F --tls-key F] [--public-path P ...] [--deny-path P ...]``.
SIGHUP (and any change of the key, certificate or private-key file, seen within 1 s) reloads
the keys and the certificate; open connections keep going.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import json
import os
import posixpath
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from warmctl.errors import HostError
from warmctl.proc import ProcessId, kill_child, kill_tree, signal_process, start_ticks

BUF = 256 * 1024
#: Longest request head (request line + headers) accepted, bytes; longer gets 431.
MAX_HEAD = 64 * 1024
#: Seconds a client's keep-alive connection may stay idle (no request, nothing in flight).
KEEP_ALIVE_S = 75.0

#: vLLM's development and control routes (vLLM 0.32, ``vllm/entrypoints``: dev mode,
#: profiler, sleep, weight transfer, LoRA loading, elastic EP, pause/resume); a path equal
#: to one of these or below it is refused (403) through the public port, key or not.
CONTROL_PATHS = (
    "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
    "/reset_mm_cache", "/reset_encoder_cache", "/pause", "/resume", "/is_paused",
    "/abort_requests", "/release_kv_cache_memory", "/start_profile", "/stop_profile",
    "/server_info", "/get_world_size", "/kv_event_sources", "/fault_tolerance",
    "/scale_elastic_ep", "/is_scaling_elastic_ep", "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine", "/update_weights", "/start_weight_update",
    "/start_draft_weight_update", "/finish_weight_update", "/update_weight_version",
    "/weight_info", "/weight_checker", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
)
#: Paths answered without a key by default (exact match of the decoded path).
DEFAULT_PUBLIC_PATHS = ("/health",)


class GateConfigError(HostError):
    """A key, certificate or private-key file the gate was given is missing, unreadable or
    invalid (the message names the file)."""


def private_file_problem(st: os.stat_result) -> str | None:
    """Why a file with status ``st`` may not hold a secret (API keys, a TLS private key), or
    None: like OpenSSH for private keys, it must not be readable, writable or executable by
    group or others (``mode & 0o077``), and must belong to root or to this process's user."""
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o} is open to group or others (0600 or tighter needed)"
    if st.st_uid not in (0, os.geteuid()):
        return f"it belongs to uid {st.st_uid}, not to root or to this user (uid {os.geteuid()})"
    return None


def _check_private(path: Path, what: str, st: os.stat_result | None = None) -> None:
    """Raise :class:`GateConfigError` naming ``what``, ``path``, the problem and its fix if
    ``path`` (status ``st``, else stat'ed here) is not private (:func:`private_file_problem`).
    A file that cannot be stat'ed is left to its reader to report."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            return
    if (why := private_file_problem(st)) is not None:
        fix = f"chmod 600 {path}" if st.st_mode & 0o077 else f"chown {os.geteuid()} {path}"
        raise GateConfigError(f"{what} {path}: {why}; run: {fix}")


def read_keys(path: Path) -> list[bytes]:
    """API keys from ``path``: one per line, surrounding whitespace stripped, blank lines and
    lines starting with ``#`` skipped. Raises :class:`GateConfigError` naming the file if it
    cannot be read, is not private (group/others may read it, or another user owns it:
    :func:`private_file_problem`, checked on the open file), holds no key, or a key contains
    whitespace."""
    try:
        with open(path, "rb") as f:
            _check_private(path, "API key file", os.fstat(f.fileno()))
            text = f.read().decode()
    except OSError as e:
        raise GateConfigError(f"API key file {path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise GateConfigError(f"API key file {path}: not UTF-8 text") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        k = line.strip()
        if not k or k.startswith("#"):
            continue
        if any(c.isspace() for c in k):
            raise GateConfigError(f"API key file {path}, line {n}: a key must not contain whitespace")
        keys.append(k.encode())
    if not keys:
        raise GateConfigError(f"API key file {path}: no key in it (one key per line)")
    return keys


def tls_context(cert: Path, key: Path, into: ssl.SSLContext | None = None) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2+, ALPN ``http/1.1``) holding ``cert`` (PEM chain) and
    ``key`` (PEM). With ``into``, the pair is first checked in a throwaway context and then
    loaded into ``into`` (new handshakes use it, established ones keep theirs). Raises
    :class:`GateConfigError` naming the files if they cannot be read or do not match, or
    naming ``key`` if group/others may read it or another user owns it (:func:`private_file_problem`)."""
    _check_private(key, "TLS private key")

    def load(ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as e:
            raise GateConfigError(f"TLS certificate {cert} / key {key}: {getattr(e, 'strerror', None) or e}") from None

    fresh = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    fresh.minimum_version = ssl.TLSVersion.TLSv1_2
    fresh.set_alpn_protocols(["http/1.1"])
    load(fresh)
    if into is None:
        return fresh
    load(into)
    return into


def _norm(path: str) -> str:
    p = posixpath.normpath("/" + path.lstrip("/")) if path else "/"
    return p.lower()


@dataclass
class Policy:
    """What the gate lets through. ``keys``: accepted API keys (None: no key needed);
    ``public_paths``: decoded paths answered without a key; ``deny_paths``: paths refused
    (403) with or without a key, themselves and everything below them."""

    keys: list[bytes] | None = None
    public_paths: frozenset[str] = frozenset(DEFAULT_PUBLIC_PATHS)
    deny_paths: tuple[str, ...] = CONTROL_PATHS
    _deny: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._deny = tuple(_norm(p).rstrip("/") for p in self.deny_paths)

    def denied(self, path: str) -> bool:
        """True if the decoded ``path`` (or its normalized form: ``//``, ``.``/``..`` and
        case folded) is a control route or below one."""
        for p in {path.lower(), _norm(path)}:
            for d in self._deny:
                if p == d or p.startswith(d + "/"):
                    return True
        return False

    def key_ok(self, authorization: bytes | None) -> bool:
        """True if ``authorization`` (the header's value) is ``Bearer <one of the keys>``;
        compared with :func:`hmac.compare_digest` against every key (no early exit)."""
        if self.keys is None:
            return True
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for k in self.keys:
            ok |= hmac.compare_digest(token, k)
        return ok


class Refused(Exception):
    def __init__(self, status: int, reason: str, message: str, code: str, extra: bytes = b""):
        super().__init__(message)
        self.status, self.reason, self.code, self.extra = status, reason, code, extra

    def response(self) -> bytes:
        body = json.dumps({"error": {"message": str(self), "type": "invalid_request_error" if self.status != 401
                                     else "authentication_error", "param": None, "code": self.code}}).encode()
        return (f"HTTP/1.1 {self.status} {self.reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + self.extra + b"\r\n" + body


def _bad(msg: str) -> Refused:
    return Refused(400, "Bad Request", msg, "bad_request")


@dataclass
class Request:
    """What the gate reads of one request head."""

    method: bytes
    path: str
    content_length: int
    chunked: bool
    upgrade: bool


def parse_head(head: bytes, policy: Policy) -> Request:
    """Parse one request head (ending in a blank line) and apply ``policy``. Returns the
    request's framing; raises :class:`Refused` with the response to send."""
    if head.count(b"\n") != head.count(b"\r\n") or head.count(b"\r") != head.count(b"\r\n"):
        raise _bad("bare CR or LF in the request head")
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise _bad("malformed request line")
    method, target = parts[0], parts[1].decode("latin-1")
    if method == b"CONNECT" or not method.isalpha():
        raise Refused(405, "Method Not Allowed", f"method {method.decode('latin-1')!r} is not allowed", "method_not_allowed")
    if target == "*":
        path = "*"
    else:
        if not target.startswith("/"):
            target = urlsplit(target).path or "/"
        path = unquote(target.split("?", 1)[0].split("#", 1)[0])
    auth = None
    cl: bytes | None = None
    te: bytes | None = None
    upgrade = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise _bad("malformed header line")
        n = name.lower()
        value = value.strip()
        if n == b"authorization":
            if auth is not None:
                raise _bad("more than one Authorization header")
            auth = value
        elif n == b"content-length":
            if cl is not None and cl != value:
                raise _bad("conflicting Content-Length headers")
            cl = value
        elif n == b"transfer-encoding":
            te = value if te is None else te + b"," + value
        elif n == b"upgrade":
            upgrade = True
    chunked = False
    if te is not None:
        if cl is not None:
            raise _bad("both Content-Length and Transfer-Encoding")
        codings = [c.strip().lower() for c in te.split(b",")]
        if codings != [b"chunked"]:
            raise Refused(501, "Not Implemented", "only 'Transfer-Encoding: chunked' is accepted", "not_implemented")
        chunked = True
    length = 0
    if cl is not None:
        if not cl.isdigit():
            raise _bad("bad Content-Length")
        length = int(cl)
    if policy.denied(path):
        raise Refused(403, "Forbidden", f"{path} is not served on the public port", "forbidden_route")
    if path not in policy.public_paths and not policy.key_ok(auth):
        raise Refused(401, "Unauthorized", "missing or invalid API key: send 'Authorization: Bearer <key>'"
                      if auth is None else "invalid API key", "invalid_api_key",
                      b'WWW-Authenticate: Bearer realm="warmctl"\r\n')
    return Request(method, path, length, chunked, upgrade)


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


def _end(writer: asyncio.StreamWriter) -> None:
    """Half-close ``writer`` where the transport can (plain TCP), else close it (TLS)."""
    try:
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (OSError, RuntimeError):
        pass


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Relay bytes from ``reader`` to ``writer`` until EOF, then half-close ``writer``."""
    try:
        while data := await reader.read(BUF):
            writer.write(data)
            await writer.drain()
    except OSError:  # ConnectionError included; a cancellation leaves ``writer`` as it is
        pass
    _end(writer)


#: Bytes queued towards a client above which the engine connection stops being read until
#: they are sent (the relay's whole buffering per connection; asyncio's own default high mark).
CLIENT_HIGH_WATER = 64 * 1024


class EngineSide(asyncio.Protocol):
    """The engine connection of one client connection.

    Engine to client: every block the engine sends is written to the client's transport from
    the event loop's read callback (no stream buffer, no task switch per SSE chunk), then shown
    to ``tracker`` (a :class:`ResponseTracker`). While more than :data:`CLIENT_HIGH_WATER`
    bytes wait for a slow client, the engine connection is not read.

    Client to engine: :meth:`write` / :meth:`drain` / :meth:`write_eof` like a
    ``StreamWriter`` (``drain`` waits while the engine's socket buffer is full, and raises
    ConnectionResetError once the engine connection is gone).

    :attr:`closed` is set when the engine connection closes: True if it closed between
    responses (its keep-alive timeout; the client's connection stays open and its next
    request goes over a new engine connection); False otherwise, after the client's side was
    half-closed (closed under TLS) too. :meth:`stop`: relay nothing more to the client (a
    refusal follows on it)."""

    def __init__(self, c_writer: asyncio.StreamWriter, tracker: "ResponseTracker"):
        loop = asyncio.get_running_loop()
        self.c_writer, self.c_transport, self.tracker = c_writer, c_writer.transport, tracker
        self.closed: asyncio.Future = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.stopped = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._waiting_client = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.stopped:
            return
        if self.c_transport.is_closing():  # the client is gone: nobody to relay to
            self.stop()
            self.transport.close()
            return
        self.c_transport.write(data)
        self.tracker.feed(data)
        if not self._waiting_client and self.c_transport.get_write_buffer_size() > CLIENT_HIGH_WATER:
            self._waiting_client = True
            self.transport.pause_reading()
            asyncio.ensure_future(self._resume_when_sent())

    async def _resume_when_sent(self) -> None:
        try:
            await self.c_writer.drain()
        except (OSError, RuntimeError):
            pass  # the client is gone; data_received closes the engine side on the next block
        self._waiting_client = False
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # the engine is done with this connection: close it

    def connection_lost(self, exc) -> None:
        self._can_write.set()  # a waiting drain() wakes up and raises
        if self.closed.done():
            return
        between = self.tracker.idle
        if not between and not self.stopped:
            _end(self.c_writer)
        self.closed.set_result(between)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def stop(self) -> None:
        """Relay nothing more to the client from now on."""
        self.stopped = True

    # the StreamWriter calls the request relays (_copy, _copy_chunked, _pipe, _end) use
    def write(self, data: bytes) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        await self._can_write.wait()
        if self.transport.is_closing():
            raise ConnectionResetError("the engine closed the connection")

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def write_eof(self) -> None:
        self.transport.write_eof()

    def close(self) -> None:
        self.transport.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, BUF))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        writer.write(data)
        n -= len(data)
        await writer.drain()


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Relay one chunked body (chunks, last chunk, trailers) as it arrives."""
    while True:
        line = await reader.readuntil(b"\r\n")
        size_s = line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_s, 16)
        except ValueError:
            raise _bad("bad chunk size") from None
        writer.write(line)
        if size == 0:
            while (t := await reader.readuntil(b"\r\n")) != b"\r\n":
                writer.write(t)
            writer.write(b"\r\n")
            await writer.drain()
            return
        await _copy(reader, writer, size)
        crlf = await reader.readexactly(2)
        if crlf != b"\r\n":
            raise _bad("chunk not followed by CRLF")
        writer.write(crlf)


class ResponseTracker:
    """Where the engine's responses on one connection end, read from the bytes as they are
    relayed (never held back): each response's head, then its body by ``Content-Length``,
    chunked framing, or until close. ``methods``: the methods of the requests forwarded and
    not yet answered in full (responses to HEAD, and 204/304, have no body). :attr:`idle`:
    every forwarded request has had its whole response -- a draining gate may close then."""

    HEAD, LENGTH, CHUNK_LINE, CHUNK_DATA, CHUNK_CRLF, TRAILER, CLOSE = range(7)

    def __init__(self) -> None:
        self.methods: list[bytes] = []
        self.state = self.HEAD
        self.left = 0
        self.buf = b""
        #: (n, future): the future is set (result None) once at most n forwarded requests are
        #: still unanswered (their responses not relayed whole); see :meth:`answered`
        self.waiter: tuple[int, asyncio.Future] | None = None

    @property
    def idle(self) -> bool:
        return not self.methods and self.state == self.HEAD and not self.buf

    def _done(self) -> None:
        if self.methods:
            self.methods.pop(0)
        self.state = self.HEAD
        if self.waiter is not None and len(self.methods) <= self.waiter[0] and not self.waiter[1].done():
            self.waiter[1].set_result(None)

    def answered(self, pending: int = 0) -> asyncio.Future:
        """A future set once at most ``pending`` forwarded requests await (the rest of) their
        response, the others' responses relayed whole (at once if that is so already)."""
        fut = asyncio.get_running_loop().create_future()
        if len(self.methods) <= pending and self.state == self.HEAD and not self.buf:
            fut.set_result(None)
        else:
            self.waiter = (pending, fut)
        return fut

    def feed(self, data: bytes) -> None:
        """Account for ``data``, the next bytes the engine sent on this connection."""
        i, n = 0, len(data)
        while i < n:
            st = self.state
            if st in (self.LENGTH, self.CHUNK_DATA, self.CHUNK_CRLF):
                take = min(self.left, n - i)
                self.left -= take
                i += take
                if self.left == 0:
                    if st == self.LENGTH:
                        self._done()
                    elif st == self.CHUNK_DATA:
                        self.state, self.left = self.CHUNK_CRLF, 2
                    else:
                        self.state = self.CHUNK_LINE
                continue
            if st == self.CLOSE:  # until the engine closes (or framing not understood)
                return
            sep = b"\r\n\r\n" if st == self.HEAD else b"\r\n"
            if self.buf:
                joined = self.buf + data[i:]
                j = joined.find(sep)
                if j < 0:
                    self.buf = joined
                    if len(joined) > MAX_HEAD:
                        self.state, self.buf = self.CLOSE, b""
                    return
                i += j + len(sep) - len(self.buf)
                line, self.buf = joined[:j], b""
            else:
                j = data.find(sep, i)
                if j < 0:
                    self.buf = data[i:]
                    return
                line, i = data[i:j], j + len(sep)
            if st == self.HEAD:
                self._head(line)
            elif st == self.CHUNK_LINE:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    self.state = self.CLOSE
                    return
                self.state, self.left = (self.TRAILER, 0) if size == 0 else (self.CHUNK_DATA, size)
            elif not line:  # TRAILER: the blank line ends the response
                self._done()

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            self.state = self.CLOSE
            return
        if status == 101:
            self.state = self.CLOSE  # the connection is no longer HTTP
            return
        if 100 <= status < 200:
            return  # an interim response; the final one follows
        if (self.methods[0] if self.methods else b"") == b"HEAD" or status in (204, 304):
            self._done()
            return
        length, chunked = None, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length" and value.strip().isdigit():
                length = int(value.strip())
        if chunked:
            self.state = self.CHUNK_LINE
        elif length is not None:
            if length:
                self.state, self.left = self.LENGTH, length
            else:
                self._done()
        else:
            self.state = self.CLOSE


class Gate:
    """One listening gate: its policy (reloadable), TLS context, live connections."""

    def __init__(self, upstream: tuple[str, int], policy: Policy, key_file: Path | None = None,
                 tls: tuple[Path, Path] | None = None):
        self.upstream, self.policy, self.key_file, self.tls = upstream, policy, key_file, tls
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
        task = asyncio.current_task()
        tracker = ResponseTracker()
        self.conns[task] = (tracker, c_writer)  # type: ignore[index]
        engine: EngineSide | None = None
        in_body = False  # relaying a request body: the engine has this request's head
        try:
            sock = c_writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    head = await asyncio.wait_for(c_reader.readuntil(b"\r\n\r\n"), KEEP_ALIVE_S)
                except asyncio.IncompleteReadError:
                    break  # the client closed (between requests, or mid-head)
                except asyncio.TimeoutError:
                    if tracker.idle:
                        break  # idle for KEEP_ALIVE_S: close
                    continue  # a response is still streaming
                except asyncio.LimitOverrunError:
                    raise Refused(431, "Request Header Fields Too Large",
                                  f"request head longer than {MAX_HEAD} bytes", "header_too_large") from None
                req = parse_head(head, self.policy)
                if engine is None or engine.closed.done():
                    if engine is not None and not engine.closed.result():
                        break  # the engine closed mid-response; the client was told
                    # (none yet, or it closed between responses: open a new one)
                    loop = asyncio.get_running_loop()
                    try:
                        _, engine = await loop.create_connection(lambda: EngineSide(c_writer, tracker),
                                                                 *self.upstream)
                    except OSError:
                        raise Refused(502, "Bad Gateway", "the engine is not answering", "bad_gateway") from None
                tracker.methods.append(req.method)
                engine.write(head)
                in_body = True
                if req.chunked:
                    await _copy_chunked(c_reader, engine)
                elif req.content_length:
                    await _copy(c_reader, engine, req.content_length)
                else:
                    await engine.drain()
                in_body = False
                if req.upgrade:  # e.g. a WebSocket: the rest of the connection is opaque
                    await _pipe(c_reader, engine)
                    break
        except Refused as r:
            await self._refuse(r, c_reader, c_writer, engine, tracker, in_body)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError):
            pass
        finally:
            if engine is not None:
                _end(engine)
                if not engine.stopped:  # responses still coming are relayed for up to 5 s
                    await asyncio.wait({engine.closed}, timeout=5)
                engine.stop()
                engine.close()
            c_writer.close()
            self.conns.pop(task, None)  # type: ignore[arg-type]

    async def _refuse(self, r: Refused, c_reader, c_writer, engine: EngineSide | None, tracker: ResponseTracker,
                      in_body: bool) -> None:
        """Send ``r``'s response and close: half-close, then read and drop what the client
        still sends for up to 2 s (at most 1 MiB), so closing does not reset the connection
        before the client has read the response.

        Responses come in request order (HTTP/1.1 pipelining): if requests forwarded before the
        refused one are still being answered, their responses are relayed whole first, however
        long they stream (a drain's deadline still applies). ``in_body``: the refused request's
        head was forwarded already (its chunked body turned out malformed); the engine's answer
        to it is not waited for, only the earlier ones. The refusal is not sent if the engine
        closed first, or the client's stream is not at a response boundary."""
        pending = 1 if in_body else 0
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
            _end(c_writer)
            deadline = time.monotonic() + 2.0
            dropped = 0
            while dropped < (1 << 20) and (left := deadline - time.monotonic()) > 0:
                data = await asyncio.wait_for(c_reader.read(65536), left)
                if not data:
                    break
                dropped += len(data)
        except (ConnectionError, asyncio.TimeoutError, ssl.SSLError, OSError):
            pass


@dataclass
class LazyWatch:
    """What the gate watches of a lazy restore (:func:`warmctl.checkpoint.criu.lazy_restore`):
    the ``criu lazy-pages`` daemon (``daemon``: its recorded identity), its ``log``, the
    engine's root (``engine``: recorded identity, killed with its tree if the daemon exits
    before its copy ended) and ``failed``: the file the gate writes the reason to then (read
    by ``warmctl status``). Sent by ``up`` as JSON after ``open PID`` (:meth:`PendingGate.open`)."""

    daemon: "ProcessId"
    log: Path
    engine: "ProcessId"
    failed: Path

    def to_json(self) -> str:
        return json.dumps({"daemon": self.daemon.as_record(), "log": str(self.log),
                           "engine": self.engine.as_record(), "failed": str(self.failed)})

    @classmethod
    def from_json(cls, text: str) -> "LazyWatch":
        d = json.loads(text)
        ids = [ProcessId.from_record(x) for x in (d["daemon"], d["engine"])]
        if None in ids:
            raise ValueError("a process record without pid and start/ctime")
        return cls(ids[0], Path(d["log"]), ids[1], Path(d["failed"]))  # type: ignore[arg-type]

    def attach(self) -> tuple[int | None, str | None]:
        """Open a pidfd on the daemon (:func:`os.pidfd_open`). Returns (pidfd, None) while it
        runs; (None, None) when it has already exited with its copy complete; (None, reason)
        when it exited before the copy ended (the gate must not open)."""
        from warmctl.checkpoint.criu import lazy_log_status

        try:
            fd = os.pidfd_open(self.daemon.pid)
        except ProcessLookupError:
            fd = None
        if fd is not None and self.daemon.alive():  # the pidfd names *that* process, not a reuse of its PID
            return fd, None
        if fd is not None:
            os.close(fd)
        st = lazy_log_status(self.log)
        return None, (None if st.complete else st.reason)

    def incomplete(self) -> str | None:
        """Once the daemon has exited: None if its log shows the copy complete, else why not."""
        from warmctl.checkpoint.criu import lazy_log_status

        st = lazy_log_status(self.log)
        if st.complete:
            print(f"gate: the lazy-pages daemon (pid {self.daemon.pid}) finished: {st.copied:,} pages copied into "
                  f"{len(st.processes)} processes", flush=True)
            return None
        return st.reason


async def _serve(listen: tuple[str, int], gate: Gate, engine_pid: int | None, ready_fd: int | None = None,
                 drain_s: float = 30.0, lazy: LazyWatch | None = None) -> None:
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
                                        limit=MAX_HEAD, ssl=gate.ssl)
    print("ready", flush=True)
    if ready_fd is not None:  # the parent waits on this pipe (no polling of the log)
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    stop = asyncio.Event()
    now = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_term() -> None:
        (now if stop.is_set() else stop).set()  # a second SIGTERM/SIGINT: no more waiting
        stop.set()

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
        why = lazy.incomplete()
        if why is None:
            return
        msg = (f"the lazy-pages daemon (pid {lazy.daemon.pid}) exited before it had copied every page into the "
               f"engine ({why}): pages never copied read as zeros")
        print(f"gate: {msg}; closing the public port, aborting {len(gate.conns)} connection(s), killing the engine "
              f"(pid {lazy.engine.pid})", flush=True)
        server.close()  # no new connection from here on
        for _, c_writer in list(gate.conns.values()):
            c_writer.transport.abort()  # in-flight answers may come from wrong memory: cut them
        try:
            lazy.failed.write_text(msg + "\n")
        except OSError as e:
            print(f"gate: cannot write {lazy.failed}: {e.strerror}", flush=True)
        kill_tree(lazy.engine, timeout_s=5)
        now.set()
        stop.set()

    if pidfd is not None:
        loop.add_reader(pidfd, on_daemon_exit)
    watcher = asyncio.create_task(watch())
    await stop.wait()
    watcher.cancel()
    server.close()  # the listener first: no new connections from here on
    if gate.conns and not now.is_set():
        print(f"gate: draining {len(gate.conns)} connection(s) for up to {drain_s:g} s", flush=True)
        deadline = time.monotonic() + drain_s
        while gate.conns and time.monotonic() < deadline and not now.is_set():
            for tracker, c_writer in list(gate.conns.values()):
                if tracker.idle:  # between requests (keep-alive): nothing in flight to wait for
                    c_writer.close()
            await asyncio.sleep(0.05)
    for t in list(gate.conns):
        t.cancel()
    print("gate: closed", flush=True)


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def policy_args(api_key_file: Path | None = None, tls_cert: Path | None = None, tls_key: Path | None = None,
                public_paths: list[str] | None = None, deny_paths: list[str] | None = None,
                drain_s: float | None = None) -> list[str]:
    """The gate's command-line options for these settings (file paths only: a key never
    appears on a command line). Raises :class:`GateConfigError` naming the file if the key
    file or the certificate pair cannot be loaded, so ``up`` fails before it restores."""
    args: list[str] = []
    if api_key_file is not None:
        read_keys(api_key_file)
        args += ["--api-key-file", str(Path(api_key_file).absolute())]
    if (tls_cert is None) != (tls_key is None):
        raise GateConfigError("TLS needs both a certificate file and a private-key file (gate_tls_cert, gate_tls_key)")
    if tls_cert is not None:
        tls_context(tls_cert, tls_key)  # type: ignore[arg-type]
        args += ["--tls-cert", str(Path(tls_cert).absolute()), "--tls-key", str(Path(tls_key).absolute())]  # type: ignore[arg-type]
    for p in public_paths if public_paths is not None else ():
        args += ["--public-path", p]
    if public_paths is not None and not public_paths:
        args += ["--no-public-paths"]
    for p in deny_paths or ():
        args += ["--deny-path", p]
    if drain_s is not None:
        args += ["--drain-s", f"{drain_s:g}"]
    return args


def settings_args(settings) -> list[str]:
    """:func:`policy_args` of a :class:`warmctl.config.Settings` (``gate_*`` fields)."""
    return policy_args(settings.gate_api_key_file, settings.gate_tls_cert, settings.gate_tls_key,
                       list(settings.gate_public_paths), list(settings.gate_deny_paths), settings.gate_drain_s)


def gate_enforces(args: list[str]) -> dict[str, bool]:
    """What a gate started with ``args`` (:func:`policy_args`) enforces, as
    :class:`warmctl.state.EngineState` fields: ``gate_api_key``, ``gate_tls``."""
    return {"gate_api_key": "--api-key-file" in args, "gate_tls": "--tls-cert" in args}


def drain(gate_proc, timeout_s: float) -> bool:
    """Ask the gate ``gate_proc`` (a :class:`warmctl.proc.ProcessId`, or None) to drain:
    SIGTERM closes its listener at once, open connections may finish for up to its own
    ``--drain-s``; wait up to ``timeout_s`` + 2 s for it to exit. True if it is gone."""
    if gate_proc is None or not gate_proc.alive():
        return True
    if not signal_process(gate_proc, signal.SIGTERM):  # gone, or its PID is another process now
        return not gate_proc.alive()
    deadline = time.monotonic() + timeout_s + 2
    while time.monotonic() < deadline:
        if not gate_proc.alive():
            return True
        time.sleep(0.05)
    return not gate_proc.alive()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m warmctl.gate", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="public HOST:PORT")
    ap.add_argument("--upstream", required=True, help="engine HOST:PORT")
    ap.add_argument("--engine-pid", type=int, default=None, help="exit when this PID is gone")
    ap.add_argument("--wait-open", action="store_true",
                    help="start, but listen only once stdin says 'open PID' (PID: the engine); exit at EOF")
    ap.add_argument("--ready-fd", type=int, default=None, help="also write 'ready' to this inherited pipe")
    ap.add_argument("--api-key-file", type=Path, default=None, help="API keys, one per line (none: no key needed)")
    ap.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain (TLS on the public port)")
    ap.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    ap.add_argument("--public-path", action="append", default=None,
                    help=f"path answered without a key (repeatable; default {' '.join(DEFAULT_PUBLIC_PATHS)})")
    ap.add_argument("--no-public-paths", action="store_true", help="every path needs a key")
    ap.add_argument("--deny-path", action="append", default=[], help="refuse this path too (repeatable)")
    ap.add_argument("--drain-s", type=float, default=30.0,
                    help="on SIGTERM: seconds open connections may take to finish (a second SIGTERM: none)")
    a = ap.parse_args(argv)
    try:
        public = () if a.no_public_paths else (a.public_path if a.public_path is not None else DEFAULT_PUBLIC_PATHS)
        policy = Policy(read_keys(a.api_key_file) if a.api_key_file else None, frozenset(public),
                        CONTROL_PATHS + tuple(a.deny_path))
        if (a.tls_cert is None) != (a.tls_key is None):
            raise GateConfigError("--tls-cert and --tls-key go together")
        g = Gate(_hostport(a.upstream), policy, a.api_key_file, (a.tls_cert, a.tls_key) if a.tls_cert else None)
    except GateConfigError as e:
        print(f"gate: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    engine_pid = a.engine_pid
    lazy = None
    if a.wait_open:
        line = sys.stdin.readline().split(maxsplit=2)
        if len(line) < 2 or line[0] != "open":  # the caller gave up (EOF): never listen
            sys.exit(0)
        engine_pid = int(line[1])
        if len(line) == 3:
            lazy = LazyWatch.from_json(line[2])
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] ships it
        uvloop = None
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        run(_serve(_hostport(a.listen), g, engine_pid, a.ready_fd, a.drain_s, lazy))
    except OSError as e:
        print(f"gate: cannot listen on {a.listen}: {e.strerror}", file=sys.stderr, flush=True)
        sys.exit(2 if e.errno == errno.EADDRINUSE else 1)


def start(listen_host: str, listen_port: int, upstream_port: int, engine_pid: int, log_path: Path,
          timeout_s: float = 15.0, args: list[str] | tuple[str, ...] = ()) -> int:
    """Start the gate as a detached process; return its PID once it accepts connections.
    ``args``: further gate options (:func:`policy_args`).

    Raises :class:`HostError` (with the gate's own message) if it cannot listen.
    """
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
             "--upstream", f"127.0.0.1:{upstream_port}", "--engine-pid", str(engine_pid), *args],
            stdin=devnull, stdout=log, stderr=log, start_new_session=True)

    def output() -> str:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "ready" in output().split():  # printed by the gate once its socket is listening
            return proc.pid
        if proc.poll() is not None:
            msg = output().strip().splitlines()[-1:] or ["(no output)"]
            raise HostError(f"the gate could not open {listen_host}:{listen_port}: {msg[0]}")
        time.sleep(0.05)
    kill_child(proc)
    raise HostError(f"the gate did not open {listen_host}:{listen_port} within {timeout_s:.0f} s")


class PendingGate:
    """A gate process started ahead of time (:func:`prestart`) that does not listen until
    :meth:`open`: its interpreter start-up and imports (~0.2-0.9 s on a loaded 2-core host)
    overlap the restore instead of delaying the public port after the canary (issue 12).
    It holds no socket before :meth:`open`, and exits without ever listening if the process
    that started it closes its stdin (exits, or calls :meth:`cancel`)."""

    def __init__(self, proc: subprocess.Popen, ready_r: int, listen: str, log_path: Path, offset: int):
        self.proc, self.listen, self.log_path, self._offset = proc, listen, log_path, offset
        self._ready_r: int | None = ready_r

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _output(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def open(self, engine_pid: int, timeout_s: float = 15.0, lazy: LazyWatch | None = None) -> int:
        """Tell the gate to listen in front of ``engine_pid``; return its PID once it accepts
        connections. ``lazy``: the engine was restored with lazy pages; the gate watches the
        daemon from now on (see :class:`LazyWatch`). Raises :class:`HostError` (with the
        gate's own message) if it cannot listen, :class:`warmctl.checkpoint.criu.LazyPagesError`
        if it refused because the daemon had already exited before its copy ended."""
        import select

        try:
            extra = f" {lazy.to_json()}" if lazy is not None else ""
            self.proc.stdin.write(f"open {engine_pid}{extra}\n".encode())
            self.proc.stdin.close()
        except OSError:
            pass  # it died already: reported below
        try:
            ready, _, _ = select.select([self._ready_r], [], [], timeout_s)
            data = os.read(self._ready_r, 4096) if ready else b""
        finally:
            self._close_pipe()
        if b"ready" in data:
            return self.proc.pid
        kill_child(self.proc)
        if data.startswith(b"refused lazy-pages "):
            from warmctl.checkpoint.criu import LazyPagesError

            raise LazyPagesError(f"the lazy-pages daemon exited before it had copied every page into the engine: "
                                 f"{data[len(b'refused lazy-pages '):].decode(errors='replace').strip()}; "
                                 "the public port was not opened")
        msg = self._output().strip().splitlines()[-1:] or [f"no answer within {timeout_s:.0f} s"]
        raise HostError(f"the gate could not open {self.listen}: {msg[0]}")

    def cancel(self) -> None:
        """Stop the gate before it ever listened (``up`` failed)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()  # EOF: it exits on its own
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill_child(self.proc)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self._ready_r is not None:  # once: the number may be reused by another file later
            os.close(self._ready_r)
            self._ready_r = None


def prestart(listen_host: str, listen_port: int, upstream_port: int, log_path: Path,
             args: list[str] | tuple[str, ...] = ()) -> PendingGate:
    """Start a gate for ``listen_host:listen_port`` -> ``127.0.0.1:upstream_port`` that waits,
    not listening, for :meth:`PendingGate.open` (see :class:`PendingGate`). ``args``: further
    gate options (:func:`policy_args`)."""
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    ready_r, ready_w = os.pipe()
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
                 "--upstream", f"127.0.0.1:{upstream_port}", "--wait-open", "--ready-fd", str(ready_w), *args],
                stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True, pass_fds=(ready_w,))
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return PendingGate(proc, ready_r, f"{listen_host}:{listen_port}", log_path, offset)


if __name__ == "__main__":
    main()
