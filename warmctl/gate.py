"""The gate: the public port, opened only after the canary passed.

The engine listens on an internal loopback port. ``warmctl up`` starts the gate only once the
restored (or cold-started) engine has reproduced its canary; the gate then accepts on the
public address and relays bytes both ways between each client and the engine (a TCP relay:
HTTP, streaming and keep-alive pass through unchanged, so the gate adds no parsing cost).
It exits when the engine's root process is gone, so the public port never stays open in front
of a dead engine.

Run as ``python -m warmctl.gate --listen HOST:PORT --upstream HOST:PORT --engine-pid PID``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from warmctl.errors import HostError
from warmctl.proc import create_time

BUF = 256 * 1024


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


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(BUF):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            pass


async def _serve(listen: tuple[str, int], upstream: tuple[str, int], engine_pid: int | None,
                 ready_fd: int | None = None) -> None:
    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(*upstream)
        except OSError:
            c_writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            c_writer.close()
            return
        for w in (c_writer, u_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(c_reader, u_writer), _pipe(u_reader, c_writer))
        for w in (c_writer, u_writer):
            w.close()

    server = await asyncio.start_server(handle, listen[0], listen[1], reuse_address=True, backlog=1024)
    print("ready", flush=True)
    if ready_fd is not None:  # the parent waits on this pipe (no polling of the log)
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    engine_started = create_time(engine_pid) if engine_pid else None

    async def watch_engine() -> None:
        # gone, or its PID reused by another process (creation time differs): close
        while engine_pid and not stop.is_set():
            if create_time(engine_pid) != engine_started:
                print(f"engine pid {engine_pid} is gone; closing the gate", flush=True)
                stop.set()
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch_engine())
    async with server:
        await stop.wait()
    watcher.cancel()


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m warmctl.gate", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="public HOST:PORT")
    ap.add_argument("--upstream", required=True, help="engine HOST:PORT")
    ap.add_argument("--engine-pid", type=int, default=None, help="exit when this PID is gone")
    ap.add_argument("--wait-open", action="store_true",
                    help="start, but listen only once stdin says 'open PID' (PID: the engine); exit at EOF")
    ap.add_argument("--ready-fd", type=int, default=None, help="also write 'ready' to this inherited pipe")
    a = ap.parse_args(argv)
    engine_pid = a.engine_pid
    if a.wait_open:
        line = sys.stdin.readline().split()
        if len(line) != 2 or line[0] != "open":  # the caller gave up (EOF): never listen
            sys.exit(0)
        engine_pid = int(line[1])
    try:
        asyncio.run(_serve(_hostport(a.listen), _hostport(a.upstream), engine_pid, a.ready_fd))
    except OSError as e:
        print(f"gate: cannot listen on {a.listen}: {e.strerror}", file=sys.stderr, flush=True)
        sys.exit(2 if e.errno == errno.EADDRINUSE else 1)


def start(listen_host: str, listen_port: int, upstream_port: int, engine_pid: int, log_path: Path,
          timeout_s: float = 15.0) -> int:
    """Start the gate as a detached process; return its PID once it accepts connections.

    Raises :class:`HostError` (with the gate's own message) if it cannot listen.
    """
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
             "--upstream", f"127.0.0.1:{upstream_port}", "--engine-pid", str(engine_pid)],
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
    proc.kill()
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

    def open(self, engine_pid: int, timeout_s: float = 15.0) -> int:
        """Tell the gate to listen in front of ``engine_pid``; return its PID once it accepts
        connections. Raises :class:`HostError` (with the gate's own message) if it cannot."""
        import select

        try:
            self.proc.stdin.write(f"open {engine_pid}\n".encode())
            self.proc.stdin.close()
        except OSError:
            pass  # it died already: reported below
        try:
            ready, _, _ = select.select([self._ready_r], [], [], timeout_s)
            data = os.read(self._ready_r, 64) if ready else b""
        finally:
            self._close_pipe()
        if b"ready" in data:
            return self.proc.pid
        self.proc.kill()
        self.proc.wait()
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
            self.proc.kill()
            self.proc.wait()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self._ready_r is not None:  # once: the number may be reused by another file later
            os.close(self._ready_r)
            self._ready_r = None


def prestart(listen_host: str, listen_port: int, upstream_port: int, log_path: Path) -> PendingGate:
    """Start a gate for ``listen_host:listen_port`` -> ``127.0.0.1:upstream_port`` that waits,
    not listening, for :meth:`PendingGate.open` (see :class:`PendingGate`)."""
    log_path = Path(log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    ready_r, ready_w = os.pipe()
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "warmctl.gate", "--listen", f"{listen_host}:{listen_port}",
                 "--upstream", f"127.0.0.1:{upstream_port}", "--wait-open", "--ready-fd", str(ready_w)],
                stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True, pass_fds=(ready_w,))
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return PendingGate(proc, ready_r, f"{listen_host}:{listen_port}", log_path, offset)


if __name__ == "__main__":
    main()
