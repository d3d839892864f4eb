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
core dies the API server exits (as vLLM's does).

With ``--tensor-parallel-size N`` (N > 1) the engine core starts N worker ranks, as vLLM's
multiprocessing executor does: children titled ``VLLM::Worker_TP0`` .. ``_TP<N-1>``, each
bound to its own CPU list of ``VLLM_CPU_OMP_THREADS_BIND`` (``0|1``: what warmctl sets), its
log lines prefixed ``(Worker_TPi pid=P)``, each joined to the engine core by a UNIX socket
pair, and the ranks joined to each other by loopback TCP connections to rank 0 (the "group",
as gloo's; the listener is closed once every rank has joined). Every completion is an
"all-reduce": each rank sends its share to rank 0, which combines them and sends the result
back, and the tokens depend on it; so a rank killed makes the request fail (rank 0 sees the
connection end, the engine core answers 500), and a rank stopped (SIGSTOP) makes it wait for
ever, as a collective does. A dead worker shuts the engine down as vLLM's executor does
("Worker proc ... died unexpectedly"), after ``FAKE_VLLM_SHUTDOWN_DELAY_S`` seconds (default
3: for that long the killed rank is the only one gone, a margin for warmctl's look at the ranks
on a loaded host).

The engine core maps a 1 MiB file in ``/dev/shm`` (``fake_vllm_<served model name>_<hex>``, written with a pattern
of the seed), as vLLM's shared memory is: it is stored with the snapshot and restored, and
teardown must remove it; it listens on a UNIX socket in ``$VLLM_RPC_BASE_PATH``, as vLLM's ZMQ
IPC sockets do.

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
holds that many MiB of random bytes (incompressible: a benchmark's snapshot of a chosen size);
``FAKE_VLLM_RANK_PAD_MIB`` (default 0): each worker rank does (its dump then takes a while).
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
#: the line an engine core (and each worker rank, to its engine core) sends once it is set up
READY = b'{"ready": true}\n'
ROUTES = ["/health", "/version", "/v1/models", "/v1/completions", "/v1/chat/completions", "/openapi.json"]


def log(msg: str, level: str = "INFO") -> None:
    print(f"{level} {time.strftime('%m-%d %H:%M:%S')} [fake_vllm] {msg}", flush=True)


def completion(prompt, max_tokens: int, n_top: int, seed: int, shm: bytes, reduced: str = "") -> dict:
    """Token ids, logprobs and top-k for ``prompt`` (a string or a list of token ids);
    ``reduced``: the ranks' all-reduce result (hex; ``""`` at tensor parallel 1)."""
    h = hashlib.sha256(json.dumps([prompt, seed, reduced] if reduced else [prompt, seed]).encode() + shm[:4096]).digest()
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


def parse_cpus(text: str) -> set[int]:
    """The CPUs of a kernel CPU list (``"0"``, ``"0-3,8"``)."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def worker_main(rank: int, tp: int, seed: int, core: socket.socket, group_port: int,
                listener: socket.socket | None) -> None:
    """Rank ``rank`` of ``tp`` ranks: joins the group (rank 0 accepts on ``listener``; the
    others connect to 127.0.0.1:``group_port``), then answers each request line of the engine
    core on ``core`` with the all-reduce of every rank's share: ``{"reduced": hex}``, or
    ``{"error": ...}`` once a peer is gone."""
    role = f"Worker_TP{rank}"
    setproctitle.setproctitle(f"VLLM::{role}")

    def wlog(msg: str, level: str = "INFO") -> None:
        print(f"({role} pid={os.getpid()}) {level} {time.strftime('%m-%d %H:%M:%S')} [fake_vllm] {msg}", flush=True)

    pad = os.urandom(int(os.environ.get("FAKE_VLLM_RANK_PAD_MIB", "0")) << 20)  # noqa: F841 - held for the dump
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind not in ("", "auto", "nobind") and len(bind.split("|")) == tp:
        os.sched_setaffinity(0, parse_cpus(bind.split("|")[rank]))
    peers: list[socket.socket] = []
    if listener is not None:
        while len(peers) < tp - 1:
            peers.append(listener.accept()[0])
        listener.close()  # every rank has joined
    else:
        peers.append(socket.create_connection(("127.0.0.1", group_port)))
    pf = [p.makefile("rwb") for p in peers]
    wlog(f"rank {rank} of {tp} up, CPUs {sorted(os.sched_getaffinity(0))}, group {[p.getsockname() for p in peers]}")
    core.sendall(READY)  # titled and joined: the engine core may report itself ready
    f = core.makefile("rwb")
    lost = ""
    for line in f:
        req = json.loads(line)
        share = hashlib.sha256(json.dumps([req["prompt"], seed, rank]).encode()).hexdigest()
        try:
            if lost:
                raise ConnectionError(lost)
            if rank == 0:  # gather every share, send the sum back
                shares = [share]
                for p in pf:
                    got = p.readline()
                    if not got:
                        raise ConnectionError("a peer rank closed its group connection")
                    shares.append(got.decode().strip())
                reduced = hashlib.sha256("".join(shares).encode()).hexdigest()
                for p in pf:
                    p.write(reduced.encode() + b"\n")
                    p.flush()
            else:
                pf[0].write(share.encode() + b"\n")
                pf[0].flush()
                reduced = pf[0].readline().decode().strip()
                if not reduced:
                    raise ConnectionError("rank 0 closed its group connection")
            out: dict = {"reduced": reduced}
        except OSError as e:
            lost = str(e)
            wlog(f"all-reduce failed: {e}", "ERROR")
            out = {"error": f"all-reduce failed on {role}: {e}"}
        f.write(json.dumps(out).encode() + b"\n")
        f.flush()
    os._exit(0)


def start_workers(tp: int, seed: int, api: socket.socket) -> list[tuple[int, object]]:
    """Fork ``tp`` worker ranks (:func:`worker_main`): [(pid, request/answer file)] in rank
    order. ``api``: the engine core's end of the API server's socket pair (closed in the
    workers: the API server sees it end when the engine core dies)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    out, fds = [], []
    for rank in range(tp):
        parent, child = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            parent.close()
            api.close()
            for fd in fds:  # the engine core's ends of the earlier ranks' pairs
                os.close(fd)
            try:
                if rank:
                    listener.close()
                worker_main(rank, tp, seed, child, port, listener if rank == 0 else None)
            finally:
                os._exit(1)
        child.close()
        out.append((pid, parent.makefile("rwb")))
        fds.append(parent.fileno())
    listener.close()
    return out


def watch_workers(workers: list[tuple[int, object]]) -> None:
    """In a thread of the engine core: once a worker is gone, say so and, after
    ``FAKE_VLLM_SHUTDOWN_DELAY_S`` seconds, end the others and the engine core (vLLM's executor
    shuts down on a dead worker)."""
    roles = {pid: f"Worker_TP{i}" for i, (pid, _) in enumerate(workers)}
    while True:
        for pid, role in roles.items():
            try:
                done = os.waitpid(pid, os.WNOHANG)[0] == pid
            except ChildProcessError:
                done = True
            if done:
                log(f"Worker proc {role} died unexpectedly, shutting down executor", "ERROR")
                time.sleep(float(os.environ.get("FAKE_VLLM_SHUTDOWN_DELAY_S", "3")))
                for other in roles:
                    if other != pid:
                        try:
                            os.kill(other, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
                os._exit(1)
        time.sleep(0.05)


def engine_core(sock: socket.socket, seed: int, tp: int = 1, name: str = "fake") -> None:
    """The child: answers one JSON request line per line on ``sock`` until it closes; with
    ``tp`` > 1 through its worker ranks (:func:`start_workers`). ``name``: the served model
    name, in its ``/dev/shm`` file's name."""
    setproctitle.setproctitle("VLLM::EngineCore")

    def hang(signum, frame):  # alive, not stopped, silent: a deadlocked rank
        log("engine core: SIGUSR2, hanging")
        while True:
            time.sleep(3600)

    signal.signal(signal.SIGUSR2, hang)
    path = f"/dev/shm/fake_vllm_{name}_{secrets.token_hex(6)}"
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
    workers = start_workers(tp, seed, sock) if tp > 1 else []
    if workers:
        def stop(signum, frame):  # SIGTERM: the workers first, as vLLM's executor shutdown
            for pid, _ in workers:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        threading.Thread(target=watch_workers, args=(workers,), daemon=True).start()
    for _, wf in workers:  # each rank titled and in its group (a rank gone: watch_workers says so)
        wf.readline()
    log(f"engine core up (shared memory {path}, IPC socket {rpc.getsockname() if rpc else None}, {tp} rank(s))")
    sock.sendall(READY)
    f = sock.makefile("rwb")
    for line in f:
        req = json.loads(line)
        reduced, err = "", None
        sent = []
        for i, (_, wf) in enumerate(workers):  # every rank gets the request ...
            try:
                wf.write(line)
                wf.flush()
                sent.append(wf)
            except OSError:
                err = err or f"Worker_TP{i} is gone"
        for i, wf in enumerate(sent):  # ... and answers with the all-reduce (waits on a stopped rank)
            try:
                got = wf.readline()
            except OSError:
                got = b""
            ans = json.loads(got) if got else {"error": f"Worker_TP{i} is gone"}
            err = err or ans.get("error")
            reduced = ans.get("reduced", reduced)
        if err:
            out = {"error": err}
        else:
            out = completion(req["prompt"], req["max_tokens"], req["logprobs"], seed, bytes(shm[:4096]), reduced)
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
                engine_core(child, args.seed, args.tensor_parallel_size, args.served_model_name)
            finally:
                os._exit(1)
        child.close()
        self.core = parent.makefile("rwb")
        # the API server starts once the engine core and its ranks are titled and set up, as
        # vLLM's waits for its engine core's handshake: /health never answers 200 before the
        # ranks warmctl looks for exist (an engine core gone before: /health answers 503)
        self.core.readline()
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
            if "error" in out:  # a rank is gone (vLLM: EngineDeadError)
                return self.send_json(500, {"error": {"message": out["error"]}})
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
    p.add_argument("--tensor-parallel-size", type=int, default=1)
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
