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

import psutil

from warmctl.errors import HostError

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


async def _serve(listen: tuple[str, int], upstream: tuple[str, int], engine_pid: int | None) -> None:
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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def started(pid: int) -> float | None:
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return None

    engine_started = started(engine_pid) if engine_pid else None

    async def watch_engine() -> None:
        # gone, or its PID reused by another process (creation time differs): close
        while engine_pid and not stop.is_set():
            if started(engine_pid) != engine_started:
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
    a = ap.parse_args(argv)
    try:
        asyncio.run(_serve(_hostport(a.listen), _hostport(a.upstream), a.engine_pid))
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


if __name__ == "__main__":
    main()
