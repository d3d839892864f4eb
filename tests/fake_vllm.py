"""A stand-in for ``vllm serve`` that warmctl can launch, warm up, canary, dump with real CRIU
and restore in about a second: for tests of warmctl's own orchestration (kill points,
teardown, locks, recovery, agent jobs, restart policy), which need a real process tree but
not a real model.

Run by warmctl in place of ``vllm`` when ``WARMCTL_TEST_ENGINE_CMD`` names it
(:data:`warmctl.engine.vllm.TEST_ENGINE_ENV`; the ``fake`` profile and ``fake_env`` fixture
of ``tests/conftest.py``)::

    python tests/fake_vllm.py serve MODEL --served-model-name NAME --host HOST --port PORT [--seed N] ...

The tree is shaped like vLLM's at tensor parallel 1: the root (the API server, an HTTP/1.1
server on HOST:PORT) and one child titled ``VLLM::EngineCore`` (the rank warmctl's layout
checks find), joined by a UNIX socket pair: every completion is computed by the engine core,
so a restore must bring back both processes and the connection between them. When the engine
core dies the API server exits (as vLLM's does). The engine core maps a 1 MiB file in
``/dev/shm`` (``fake_vllm_<hex>``, written with a pattern of the seed), as vLLM's shared memory is: it is
stored with the snapshot and restored, and teardown must remove it; it listens on a UNIX socket
in ``$VLLM_RPC_BASE_PATH``, as vLLM's ZMQ IPC sockets do.

Endpoints: ``GET /health`` (200 while the engine core lives), ``GET /v1/models``, ``GET
/version``, ``GET /openapi.json`` (the route table the gate reads) and ``POST
/v1/completions``: deterministic greedy "completions" -- ``max_tokens`` token ids, their
logprobs and the top-``logprobs`` alternatives (keyed ``token_id:N``, as vLLM's
``return_tokens_as_token_ids`` does), all a function of the prompt, ``--seed`` and the
``/dev/shm`` file's bytes, so the canary compares equal after a faithful restore and not
after a different seed.

Test hooks, from the engine's environment (a profile's ``[engine.env]``): ``FAKE_VLLM_STARTUP_S``
(seconds, default 0) delays ``/health``, as a slow cold start does; while the file
``FAKE_VLLM_HOLD`` names exists (at most 120 s), a completion that asks for logprobs (the
canary's) waits: a test holds an ``up`` or ``snapshot`` in its canary phase for as long as it
needs, with no race against a fast restore. ``FAKE_VLLM_PAD_MIB`` (default 0): the engine core
holds that many MiB of random bytes (incompressible: a benchmark's snapshot of a chosen size).
``SIGUSR2`` to the engine core makes it hang: alive, sleeping, using no CPU time, answering
nothing (a rank that stops answering; ``WARMCTL_TEST_KILL_RANK=warmup:EngineCore:USR2``).
Standard library and ``setproctitle`` only (no
vLLM import).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import secrets
import signal
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import setproctitle

SHM_BYTES = 1 << 20
ROUTES = ["/health", "/version", "/v1/models", "/v1/completions", "/v1/chat/completions", "/openapi.json"]


def log(msg: str) -> None:
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [fake_vllm] {msg}", flush=True)


def completion(prompt, max_tokens: int, n_top: int, seed: int, shm: bytes) -> dict:
    """Token ids, logprobs and top-k for ``prompt`` (a string or a list of token ids)."""
    h = hashlib.sha256(json.dumps([prompt, seed]).encode() + shm[:4096]).digest()
    ids, lps, tops = [], [], []
    for pos in range(max_tokens):
        d = hashlib.sha256(h + struct.pack("<I", pos)).digest()
        tok = 100 + int.from_bytes(d[:4], "little") % 900
        lp = -(int.from_bytes(d[4:8], "little") % 10_000) / 4096.0
        ids.append(tok)
        lps.append(lp)
        alts = {f"token_id:{tok}": lp}
        for k in range(1, n_top):
            alts[f"token_id:{100 + (tok + 37 * k) % 900}"] = lp - k * 0.5
        tops.append(alts)
    return {"token_ids": ids, "logprobs": lps, "top_logprobs": tops}


def engine_core(sock: socket.socket, seed: int) -> None:
    """The child: answers one JSON request line per line on ``sock`` until it closes."""
    setproctitle.setproctitle("VLLM::EngineCore")

    def hang(signum, frame):  # alive, not stopped, silent: a deadlocked rank
        log("engine core: SIGUSR2, hanging")
        while True:
            time.sleep(3600)

    signal.signal(signal.SIGUSR2, hang)
    path = f"/dev/shm/fake_vllm_{secrets.token_hex(6)}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    os.ftruncate(fd, SHM_BYTES)
    shm = mmap.mmap(fd, SHM_BYTES)
    os.close(fd)
    pattern = hashlib.sha256(f"seed {seed}".encode()).digest()
    shm[:] = pattern * (SHM_BYTES // len(pattern))
    pad = os.urandom(int(os.environ.get("FAKE_VLLM_PAD_MIB", "0")) << 20)  # noqa: F841 - held for the dump
    rpc = None
    if base := os.environ.get("VLLM_RPC_BASE_PATH"):  # where vLLM binds its ZMQ IPC sockets
        rpc = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        rpc.bind(os.path.join(base, secrets.token_hex(8)))
        rpc.listen(1)
    log(f"engine core up (shared memory {path}, IPC socket {rpc.getsockname() if rpc else None})")
    f = sock.makefile("rwb")
    for line in f:
        req = json.loads(line)
        out = completion(req["prompt"], req["max_tokens"], req["logprobs"], seed, bytes(shm[:4096]))
        f.write(json.dumps(out).encode() + b"\n")
        f.flush()
    os._exit(0)


class Engine:
    def __init__(self, args):
        self.args = args
        self.ready_at = time.monotonic() + float(os.environ.get("FAKE_VLLM_STARTUP_S", "0"))
        parent, child = socket.socketpair()
        self.core_pid = os.fork()
        if self.core_pid == 0:
            parent.close()
            try:
                engine_core(child, args.seed)
            finally:
                os._exit(1)
        child.close()
        self.core = parent.makefile("rwb")
        self.lock = threading.Lock()

    def core_alive(self) -> bool:
        try:
            return os.waitpid(self.core_pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def ask(self, req: dict) -> dict:
        with self.lock:
            self.core.write(json.dumps(req).encode() + b"\n")
            self.core.flush()
            line = self.core.readline()
        if not line:
            log("engine core died; shutting down")
            os._exit(1)
        return json.loads(line)


def handler(engine: Engine):
    a = engine.args

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            pass

        def send_json(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                ok = time.monotonic() >= engine.ready_at and engine.core_alive()
                self.send_json(200 if ok else 503, {})
            elif self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": a.served_model_name, "object": "model"}]})
            elif self.path == "/version":
                self.send_json(200, {"version": "fake"})
            elif self.path == "/openapi.json":
                self.send_json(200, {"openapi": "3.1.0", "paths": {p: {} for p in ROUTES}})
            else:
                self.send_json(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            if self.path != "/v1/completions":
                return self.send_json(404, {"detail": "Not Found"})
            if body.get("model") != a.served_model_name:
                return self.send_json(404, {"error": {"message": f"model {body.get('model')!r} does not exist"}})
            n_top = int(body.get("logprobs") or 0)
            hold = os.environ.get("FAKE_VLLM_HOLD")
            deadline = time.monotonic() + 120
            while n_top and hold and os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.02)  # a test holds the canary here (see the module doc)
            out = engine.ask({"prompt": body.get("prompt"), "max_tokens": int(body.get("max_tokens") or 16),
                              "logprobs": n_top})
            choice = {"index": 0, "text": " ".join(f"t{t}" for t in out["token_ids"]),
                      "token_ids": out["token_ids"], "finish_reason": "length",
                      "logprobs": ({"token_logprobs": out["logprobs"], "top_logprobs": out["top_logprobs"]}
                                   if n_top else None)}
            self.send_json(200, {"id": "cmpl-fake", "object": "text_completion", "model": a.served_model_name,
                                 "choices": [choice]})

    return H


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="fake_vllm")
    p.add_argument("command", choices=["serve"])
    p.add_argument("model")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args, rest = p.parse_known_args(argv)
    log(f"non-default args: model={args.model} port={args.port} seed={args.seed} ignored={rest}")
    engine = Engine(args)

    def stop(signum, frame):  # as vLLM's API server: SIGTERM ends the engine core, then itself
        try:
            os.kill(engine.core_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)  # the namespace's PID 1 ignores a signal it has no handler for
    server = ThreadingHTTPServer((args.host, args.port), handler(engine))
    server.daemon_threads = True
    log(f"Starting vLLM API server on http://{args.host}:{args.port}")
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
