"""The engine's side of one client connection, and the engine-to-client relay.

Responses (and SSE streams) go from the engine to the client as bytes, from the event loop's
read callback (:class:`EngineSide`), never parsed into objects or held back: the only reading of
them is :class:`ResponseTracker`'s, which finds where each response ends (for pipelining order,
``Connection: close`` and drain). The engine is the trusted side; the client side is read once,
strictly (:mod:`warmctl.gate.http`).
"""

from __future__ import annotations

import asyncio
import socket
import time

from warmctl.gate.http import MAX_HEAD


def end(writer) -> None:
    """Half-close ``writer`` where the transport can (plain TCP), else close it (TLS)."""
    try:
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (OSError, RuntimeError):
        pass


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
    refusal follows on it).

    A response with ``Connection: close`` ends the client's connection too, once it has been
    relayed whole (the engine will not answer on this connection again; the client was told)."""

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
        if self.tracker.ended:  # a "Connection: close" response is whole
            self.stopped = True
            self.c_transport.close()  # after what is queued is sent
            self.transport.close()
            return
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
            end(self.c_writer)
        self.closed.set_result(between)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def stop(self) -> None:
        """Relay nothing more to the client from now on."""
        self.stopped = True

    # the StreamWriter calls the request relay uses
    def write(self, data: bytes) -> None:
        """Queue ``data`` for the engine; ConnectionResetError once its connection is closing."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the engine closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        await self._can_write.wait()
        if self.transport.is_closing():
            raise ConnectionResetError("the engine closed the connection")

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def write_eof(self) -> None:
        if not self.transport.is_closing():
            self.transport.write_eof()

    def close(self) -> None:
        self.transport.close()


class ResponseTracker:
    """Where the engine's responses on one connection end, read from the bytes as they are
    relayed (never held back): each response's head, then its body by ``Content-Length``,
    chunked framing, or until close. ``methods``: the methods of the requests forwarded and
    not yet answered in full (responses to HEAD, and 204/304, have no body). :attr:`idle`:
    every forwarded request has had its whole response -- a draining gate may close then;
    :attr:`idle_since`: when it last became so (``time.monotonic()`` seconds: the connection's
    start, or the end of its last response). :attr:`closing`: a response so far carried
    ``Connection: close`` (the engine ends the connection after it)."""

    HEAD, LENGTH, CHUNK_LINE, CHUNK_DATA, CHUNK_CRLF, TRAILER, CLOSE = range(7)

    def __init__(self) -> None:
        self.methods: list[bytes] = []
        self.state = self.HEAD
        self.left = 0
        self.buf = b""
        self.closing = False
        self.idle_since = time.monotonic()
        #: (n, future): the future is set (result None) once at most n forwarded requests are
        #: still unanswered (their responses not relayed whole); see :meth:`answered`
        self.waiter: tuple[int, asyncio.Future] | None = None

    @property
    def idle(self) -> bool:
        return not self.methods and self.state == self.HEAD and not self.buf

    @property
    def ended(self) -> bool:
        """A ``Connection: close`` response has been relayed whole: nothing more comes."""
        return self.closing and self.state == self.HEAD and not self.buf

    def _done(self) -> None:
        if self.methods:
            self.methods.pop(0)
        self.state = self.HEAD
        self.idle_since = time.monotonic()
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
        length, chunked = None, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"connection" and b"close" in value.lower():
                self.closing = True
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length" and value.strip().isdigit():
                length = int(value.strip())
        if (self.methods[0] if self.methods else b"") == b"HEAD" or status in (204, 304):
            self._done()
        elif chunked:
            self.state = self.CHUNK_LINE
        elif length is not None:
            if length:
                self.state, self.left = self.LENGTH, length
            else:
                self._done()
        else:
            self.state = self.CLOSE
