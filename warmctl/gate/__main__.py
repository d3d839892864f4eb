"""``python -m warmctl.gate``: the gate process (started by :mod:`warmctl.gate.process`).

Its own options say where it listens and what it fronts; the rest is a
:class:`~warmctl.gate.config.GateConfig`, parsed back from what :meth:`~warmctl.gate.config.GateConfig.to_argv` wrote."""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import sys
import time

from warmctl.gate.config import GateConfig
from warmctl.gate.files import GateConfigError, read_keys
from warmctl.gate.lazy import LazyWatch
from warmctl.gate.routes import DEFAULT_ALLOW_PATHS, Policy, Routes
from warmctl.gate.server import Gate, serve
from warmctl.base.proc import start_ticks

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
    GateConfig.add_arguments(ap)
    a = ap.parse_args(argv)
    config = GateConfig.from_args(a)
    try:
        try:
            allow = Routes(DEFAULT_ALLOW_PATHS + config.allow_paths)
        except ValueError as e:
            raise GateConfigError(str(e)) from None
        policy = Policy(read_keys(config.api_key_file) if config.api_key_file else None, allow,
                        frozenset(config.public), config.deny_paths)
        if (config.tls_cert is None) != (config.tls_key is None):
            raise GateConfigError("--tls-cert and --tls-key go together")
        tls = (config.tls_cert, config.tls_key) if config.tls_cert else None
        g = Gate(_hostport(a.upstream), policy, config.api_key_file, tls, config.limits)  # type: ignore[arg-type]
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
        run(serve(_hostport(a.listen), g, engine_pid, a.ready_fd, config.drain_s, lazy, since_start=_since_start))
    except OSError as e:
        print(f"gate: cannot listen on {a.listen}: {e.strerror}", file=sys.stderr, flush=True)
        sys.exit(2 if e.errno == errno.EADDRINUSE else 1)


if __name__ == "__main__":
    main()
