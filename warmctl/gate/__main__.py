"""``python -m warmctl.gate``: the gate process (started by :mod:`warmctl.gate.process`)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import sys
import time
from pathlib import Path

from warmctl.gate.files import GateConfigError, read_keys
from warmctl.gate.lazy import LazyWatch
from warmctl.gate.routes import DEFAULT_ALLOW_PATHS, DEFAULT_PUBLIC_PATHS, Policy, Routes
from warmctl.gate.server import Gate, Limits, serve
from warmctl.proc import start_ticks

try:
    import uvloop
except ImportError:  # pragma: no cover - uvicorn[standard] ships it
    uvloop = None


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def _since_start() -> float:
    """Seconds since this process started (its start in ``/proc/self/stat``, 10 ms steps)."""
    ticks = start_ticks(os.getpid())
    if ticks is None:  # pragma: no cover - /proc is there
        return 0.0
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m warmctl.gate",
                                 description="The gate: the public port in front of an engine.")
    ap.add_argument("--listen", required=True, help="public HOST:PORT")
    ap.add_argument("--upstream", required=True, help="engine HOST:PORT")
    ap.add_argument("--engine-pid", type=int, default=None, help="exit when this PID is gone")
    ap.add_argument("--wait-open", action="store_true",
                    help="start, but listen only once stdin says 'open PID' (PID: the engine); exit at EOF")
    ap.add_argument("--ready-fd", type=int, default=None, help="also write 'ready' to this inherited pipe")
    ap.add_argument("--api-key-file", type=Path, default=None, help="API keys, one per line (none: no key needed)")
    ap.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain (TLS on the public port)")
    ap.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    ap.add_argument("--allow-path", action="append", default=[],
                    help="serve this path too, beside the inference API (repeatable; '{name}' matches one segment)")
    ap.add_argument("--public-path", action="append", default=None,
                    help=f"path answered without a key (repeatable; default {' '.join(DEFAULT_PUBLIC_PATHS)})")
    ap.add_argument("--no-public-paths", action="store_true", help="every path needs a key")
    ap.add_argument("--deny-path", action="append", default=[], help="refuse this path too, 403 (repeatable)")
    ap.add_argument("--drain-s", type=float, default=30.0,
                    help="on SIGTERM: seconds open connections may take to finish (a second SIGTERM: none)")
    d = Limits()
    ap.add_argument("--head-timeout-s", type=float, default=d.head_timeout_s, help="a request head must arrive within")
    ap.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                    help="a request body may take this long plus its size over --body-min-rate")
    ap.add_argument("--body-min-rate", type=float, default=d.body_min_rate, help="bytes/s a request body must average")
    ap.add_argument("--keep-alive-s", type=float, default=d.keep_alive_s, help="an idle connection closes after")
    a = ap.parse_args(argv)
    try:
        public = () if a.no_public_paths else (a.public_path if a.public_path is not None else DEFAULT_PUBLIC_PATHS)
        try:
            allow = Routes(DEFAULT_ALLOW_PATHS + tuple(a.allow_path))
        except ValueError as e:
            raise GateConfigError(str(e)) from None
        policy = Policy(read_keys(a.api_key_file) if a.api_key_file else None, allow, frozenset(public),
                        tuple(a.deny_path))
        if (a.tls_cert is None) != (a.tls_key is None):
            raise GateConfigError("--tls-cert and --tls-key go together")
        limits = Limits(a.head_timeout_s, a.body_timeout_s, a.body_min_rate, a.keep_alive_s)
        g = Gate(_hostport(a.upstream), policy, a.api_key_file, (a.tls_cert, a.tls_key) if a.tls_cert else None,
                 limits)
    except GateConfigError as e:
        print(f"gate: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    engine_pid = a.engine_pid
    lazy = None
    # where an `up`'s "gate" phase goes: this process's start-up (imports, configuration) runs
    # beside the restore; from "opened" to "listening" is what the phase waits on
    print(f"gate: started in {_since_start():.2f} s" + ("; waiting to be opened" if a.wait_open else ""), flush=True)
    if a.wait_open:
        line = sys.stdin.readline().split(maxsplit=2)
        if len(line) < 2 or line[0] != "open":  # the caller gave up (EOF): never listen
            sys.exit(0)
        engine_pid = int(line[1])
        if len(line) == 3:
            lazy = LazyWatch.from_json(line[2])
        print(f"gate: opened for engine pid {engine_pid} at {_since_start():.3f} s", flush=True)
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        run(serve(_hostport(a.listen), g, engine_pid, a.ready_fd, a.drain_s, lazy, since_start=_since_start))
    except OSError as e:
        print(f"gate: cannot listen on {a.listen}: {e.strerror}", file=sys.stderr, flush=True)
        sys.exit(2 if e.errno == errno.EADDRINUSE else 1)


if __name__ == "__main__":
    main()
