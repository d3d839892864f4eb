"""A TCP proxy on loopback that can take an endpoint down and bring it back, for outage tests.

:class:`TcpProxy` forwards every connection made to ``127.0.0.1:<port>`` to ``upstream`` byte
for byte (HTTP keep-alive and all). :meth:`TcpProxy.down` does what a crashed or restarting
server does to its clients: the listener closes (new connections are refused) and every open
connection is cut mid-request or mid-answer. :meth:`TcpProxy.up` listens on the same port
again. With ``down_after`` set, the proxy goes down by itself once it has forwarded that many
bytes (both directions: a download or an upload; the bytes that cross the mark are not
delivered), so the outage lands mid-transfer whoever the client is, and comes back after
``down_for`` seconds when that is set. ``stall = True`` accepts connections but forwards
nothing (a server that hangs: the client's read timeout fires). With ``trickle`` set to
``(direction, after, every[, step])`` the proxy forwards, in ``direction`` (``"down"``:
answers, server to client; ``"up"``: requests, client to server), the first ``after`` bytes of
each connection at full speed and then ``step`` bytes (default 1) every ``every`` seconds: a
server that trickles its answer, or reads an upload slowly, never silent long enough for the
client's read timeout to fire. With ``cut`` set to ``(needle, after)`` the proxy cuts (RST) the
first connection whose request holds the bytes ``needle`` (a path) once ``after`` bytes of its
answer have been forwarded, calling ``on_cut`` first (a test deletes the object there: it
vanishes while its body is being read); later connections are forwarded whole.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from urllib.parse import urlparse


class TcpProxy:
    def __init__(self, upstream: str):
        u = urlparse(upstream)
        self.upstream = (u.hostname, u.port)
        self.port = 0
        self.bytes = 0  # bytes forwarded, both directions
        self.downs = 0  # times the proxy went down (stop() is not counted)
        self.down_after: int | None = None
        self.down_for: float | None = None
        self.on_down: Callable[[], None] | None = None
        self.stall = False
        self.trickle: tuple | None = None
        self.cut: tuple[bytes, int] | None = None
        self.on_cut: Callable[[], None] | None = None
        self.cuts = 0  # connections cut
        self._mu = threading.Lock()
        self._listener: socket.socket | None = None
        self._socks: set[socket.socket] = set()
        self._timers: list[threading.Timer] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def start(self) -> "TcpProxy":
        return self.up()

    def up(self) -> "TcpProxy":
        """Listen (again, on the same port once one was chosen)."""
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(128)
        ls.settimeout(0.05)  # the accept loop notices down() within this
        self.port = ls.getsockname()[1]
        with self._mu:
            self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return self

    def down(self, _count: bool = True) -> None:
        """Stop listening (connections refused) and reset every open connection."""
        with self._mu:
            ls, self._listener = self._listener, None
            socks, self._socks = self._socks, set()
            if ls is not None and _count:
                self.downs += 1
        if ls is not None:
            ls.close()
        for s in socks:
            try:  # linger 0: the last close sends RST; shutdown wakes a pump blocked in recv
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def reset(self) -> None:
        """Reset every open connection (RST), still listening."""
        with self._mu:
            socks, self._socks = self._socks, set()
        for s in socks:
            _rst(s)
            s.close()

    def stop(self) -> None:
        for t in self._timers:
            t.cancel()
        self.down_after = None
        self.down(_count=False)

    def _accept(self, ls: socket.socket) -> None:
        while self._listener is ls:
            try:
                client, _ = ls.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            if self.stall:
                self._track(client)
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            if not (self._track(client) and self._track(server)):
                continue
            conn = {"armed": False}  # the two directions' shared state: a request to cut was seen
            threading.Thread(target=self._pump, args=(client, server, "up", conn), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down", conn), daemon=True).start()

    def _track(self, s: socket.socket) -> bool:
        with self._mu:
            if self._listener is None:  # went down meanwhile
                s.close()
                return False
            self._socks.add(s)
            return True

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str = "", conn: dict | None = None) -> None:
        sent = 0
        try:
            while True:
                if conn is not None and direction == "down" and conn["armed"] and self._cut_now(sent, conn, (src, dst)):
                    return
                tr = self.trickle if self.trickle and self.trickle[0] == direction else None
                slow = tr is not None and sent >= tr[1]
                step = int(tr[3]) if tr is not None and len(tr) > 3 else 1
                if conn is not None and direction == "down":
                    conn["down"] = sent
                data = src.recv(step if slow else 65536)
                if not data:
                    break
                if conn is not None and direction == "down" and conn["armed"] and sent + len(data) >= conn["mark"]:
                    dst.sendall(data[: max(0, conn["mark"] - sent)])  # up to the mark, then the cut
                    self._cut_now(conn["mark"], conn, (src, dst))
                    return
                cut = self.cut
                if cut is not None and conn is not None and direction == "up" and cut[0] in data:
                    with self._mu:
                        if self.cut is cut:  # this connection is the one cut
                            self.cut, conn["mark"] = None, conn.get("down", 0) + cut[1]
                            conn["armed"] = True
                if self._count(len(data)):
                    self._went_down()  # these bytes are never delivered
                    break
                if tr is not None and not slow and sent + len(data) > tr[1]:  # the fast part ends here
                    dst.sendall(data[: tr[1] - sent])
                    data, sent = data[tr[1] - sent:], tr[1]
                    slow = True
                if slow:
                    for i in range(0, len(data), step):
                        time.sleep(tr[2])  # type: ignore[index]
                        dst.sendall(data[i:i + step])
                else:
                    dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the other direction's recv
            except OSError:
                pass
        with self._mu:
            self._socks.discard(src)
        src.close()

    def _cut_now(self, sent: int, conn: dict, socks: tuple[socket.socket, socket.socket]) -> bool:
        """Cut the armed connection (both sockets reset) once ``sent`` passed its mark."""
        if sent < conn["mark"]:
            return False
        conn["armed"] = False
        if self.on_cut:
            self.on_cut()
        self.cuts += 1
        for s in socks:
            _rst(s)
            with self._mu:
                self._socks.discard(s)
            s.close()
        return True

    def _count(self, n: int) -> bool:
        """Count ``n`` forwarded bytes; True when they cross ``down_after``."""
        with self._mu:
            self.bytes += n
            trigger = self.down_after is not None and self.bytes >= self.down_after
            if trigger:
                self.down_after = None
        return trigger

    def _went_down(self) -> None:
        if self.on_down:
            self.on_down()
        self.down()
        if self.down_for is not None:
            t = threading.Timer(self.down_for, self.up)
            t.daemon = True
            self._timers.append(t)
            t.start()


def _rst(s: socket.socket) -> None:
    """End ``s`` with a reset (RST, linger 0) rather than an orderly close; an already dead
    socket is left as it is."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
