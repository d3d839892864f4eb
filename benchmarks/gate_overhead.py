"""What the gate costs: the same streaming requests straight to the engine and through the
public port, with an API key enforced (and, with ``--tls``, through a second gate that also
speaks TLS).

With ``tiny`` up (this script snapshots it if needed and brings it up in its own work dir, the
gate reading a key file it writes), for each concurrency level C (``--concurrency 8,64``) it
runs ``--rounds`` rounds; a round sends C streaming completions (``stream: true``,
``--max-tokens`` tokens, ``ignore_eos``) at once to each side in turn, the side that goes first
alternating, so every side sees the same machine load. Every request carries the same
``Authorization`` header (the engine ignores it). Per side it reports:

- TTFT: median over requests of the time to the first token chunk;
- ITL: median over requests of (last chunk - first chunk) / (chunks - 1);
- throughput: median over rounds of output tokens / wall seconds of the round;
- chunks: median over requests of the SSE token events a stream arrived in (fewer than
  ``--max-tokens``: vLLM merged tokens a slow reader had not taken yet, and ITL then counts
  the gaps between those merged events);

- relay CPU: CPU microseconds the side's relay process(es) used per SSE chunk relayed
  (request heads, connections and TLS included), read from ``/proc/PID/task/*/schedstat``;
  unlike the latency ratios it does not depend on how the host schedules the other processes,
  and on a host where the relay has a core of its own it bounds what the relay adds to each
  chunk's delivery;

and the ratios side/direct (1.000 = no cost). Then ``--clients`` (256) concurrent streaming
clients through the gate: how many got every token and ``[DONE]``, and every error.

``--upstream`` chooses what stands behind the relays:

- ``vllm`` (default): the real ``tiny`` engine (CPU build), restored by ``warmctl up``. On a
  small host the engine's CPU work shares the cores with the relay and the client, so every
  relay's CPU is taken from the engine: this measures that contention as much as the relay.
- ``paced``: ``benchmarks/paced_engine.py``, a stand-in for a GPU engine's HTTP front that
  spends no CPU on tokens, serving each level at seed 003's measured H200 decode timing
  (:data:`SEED003_DECODE`: TTFT and time between tokens at that many concurrent requests) with
  one decode step per interval for all streams at once. The gate is then started by this script
  in front of it with the same key file (no snapshot, no ``up``).

``--alt haproxy,nginx`` adds the alternatives the issue asked to measure, as further sides of
the same interleaved rounds, each started and configured here (config files in the work dir,
one process/worker thread each like the gate, stopped at the end) with the same key:

- ``haproxy+key``: HAProxy in HTTP mode, ``http-request deny deny_status 401`` unless the
  Authorization header equals ``Bearer KEY`` (ACL ``req.hdr(authorization) -m str``, exact and
  case-sensitive; ``http-request return`` with ``WWW-Authenticate``), 403 for paths under
  :data:`warmctl.gate.routes.CONTROL_PATHS` (``path_beg -i``), keep-alive to the engine
  (``http-reuse always``; ``retry-on empty-response``: see :data:`ENGINE_KEEP_ALIVE_S`),
  ``option http-no-delay`` (without it HAProxy sends with ``MSG_MORE``
  and SSE chunks arrive in pairs: seen here, first chunk 0.26 s late with 0.2 s between chunks).
- ``nginx+key``: nginx, ``map $http_authorization`` (a case-sensitive regex ``^Bearer KEY$``:
  plain map strings ignore case) -> ``return 401`` otherwise, a regex ``location`` returning 403
  for the control paths, ``proxy_buffering off`` and ``proxy_request_buffering off`` (SSE passes
  unbuffered), HTTP/1.1 upstream with ``keepalive`` (idle ones closed before the engine does).

These configs check the same key and deny the same route prefixes; they do not reproduce every
rule of :class:`warmctl.gate.Policy` (e.g. the gate's case folding and ``%``-decoding of paths):
they measure what such a proxy costs, not that it is as strict. Not installed by
scripts/install*.sh (no test uses them); on Debian/Ubuntu: ``apt-get install -y haproxy nginx-light``
(a distribution's nginx service, if it starts one, is not used: this script runs its own nginx
with ``-p WORKDIR``).

Usage::

    python benchmarks/gate_overhead.py [--upstream vllm|paced] [--concurrency 8,64] [--rounds 8]
        [--max-tokens 32] [--clients 256] [--tls] [--alt haproxy,nginx] [--keep-home DIR]

Ports: $WARMCTL_TEST_ENGINE_PORT / $WARMCTL_TEST_GATE_PORT when set (else 18600/18680);
the TLS gate listens on the gate port + 1, HAProxy on the engine port + 1, nginx on the
engine port + 2; the paced engine on the engine port. Every process the script starts (engine, gates, HAProxy, nginx) is stopped
when it ends, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from restore_vs_cold import wc  # noqa: E402

ENGINE_PORT = int(os.environ.get("WARMCTL_TEST_ENGINE_PORT") or 18600)
GATE_PORT = int(os.environ.get("WARMCTL_TEST_GATE_PORT") or 18680)
KEY = "sk-gate-overhead-benchmark-key"
BODY = {"model": "tiny", "prompt": "The train leaves the station at", "temperature": 0, "ignore_eos": True,
        "stream": True}


async def stream_once(client: httpx.AsyncClient, url: str, max_tokens: int,
                      extra: dict | None = None) -> tuple[float, float, int]:
    """(TTFT s, mean time between token chunks s, chunks) of one streaming completion;
    ``extra``: further body fields."""
    t0 = time.perf_counter()
    ttft, first, last, n = None, 0.0, 0.0, 0
    async with client.stream("POST", url, json={**BODY, "max_tokens": max_tokens, **(extra or {})}) as r:
        r.raise_for_status()
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                last = time.perf_counter()
                if ttft is None:
                    ttft, first = last - t0, last
                n += 1
    if not done or ttft is None:
        raise RuntimeError(f"stream ended after {n} chunks without [DONE]")
    return ttft, (last - first) / (n - 1) if n > 1 else 0.0, n


async def one_round(client: httpx.AsyncClient, url: str, conc: int, max_tokens: int, extra: dict | None = None):
    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*(stream_once(client, url, max_tokens, extra) for _ in range(conc)))
    except Exception as e:
        raise RuntimeError(f"{client.base_url}: {type(e).__name__}: {e}") from e
    wall = time.perf_counter() - t0
    return res, conc * max_tokens / wall  # ignore_eos: every stream carries max_tokens tokens


def cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by ``pids`` and their descendants, every thread: the sum of
    ``/proc/PID/task/TID/schedstat``'s first field (nanoseconds on a CPU; ``cpu_times`` counts
    in 10 ms ticks, too coarse for a relay's share of one round)."""
    import psutil

    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                tids = os.listdir(f"/proc/{p.pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
    return total / 1e9


async def measure(sides: dict[str, tuple[str, ssl.SSLContext | bool]], levels: list[int], rounds: int,
                  max_tokens: int, relays: dict[str, list[int]] | None = None, extra=lambda conc: None) -> dict:
    """Per level and side: TTFT/ITL medians (ms), tok/s and chunks medians, and
    ``relay_us_per_chunk``: CPU microseconds the side's relay processes (``relays[side]``:
    PIDs, their children counted) used per SSE chunk they relayed in the measured rounds
    (their CPU use while another side's round runs, e.g. idle timers, is not counted).
    ``extra(conc)``: further request body fields for that level."""
    relays = relays or {}
    out = {}
    headers = {"Authorization": f"Bearer {KEY}"}
    for conc in levels:
        clients = {k: httpx.AsyncClient(base_url=u, verify=v, headers=headers, timeout=300,
                                        limits=httpx.Limits(max_connections=conc, max_keepalive_connections=conc))
                   for k, (u, v) in sides.items()}
        ttft = {k: [] for k in sides}
        itl = {k: [] for k in sides}
        tput = {k: [] for k in sides}
        chunks = {k: [] for k in sides}
        relay_cpu = {k: 0.0 for k in sides}
        body = extra(conc)
        try:
            for k in sides:  # warm each path (connections, engine)
                await one_round(clients[k], "/v1/completions", conc, max_tokens, body)
            order = list(sides)
            for r in range(rounds):
                for k in (order if r % 2 == 0 else order[::-1]):
                    c0 = cpu_s(relays.get(k, []))
                    res, tps = await one_round(clients[k], "/v1/completions", conc, max_tokens, body)
                    relay_cpu[k] += cpu_s(relays.get(k, [])) - c0
                    ttft[k] += [x[0] for x in res]
                    itl[k] += [x[1] for x in res]
                    tput[k].append(tps)
                    chunks[k] += [x[2] for x in res]
        finally:
            for c in clients.values():
                await c.aclose()
        out[conc] = {k: {"ttft_ms": 1e3 * statistics.median(ttft[k]), "itl_ms": 1e3 * statistics.median(itl[k]),
                         "tok_s": statistics.median(tput[k]), "chunks": statistics.median(chunks[k]),
                         "relay_us_per_chunk": 1e6 * relay_cpu[k] / sum(chunks[k])} for k in sides}
    return out


ALTS = ("haproxy", "nginx")
UPSTREAMS = ("vllm", "paced")
#: Seed 003 (Ling 3.0 Flash FP4 on 2x H200, "Sustained decode", 8K context): concurrent requests
#: -> (median TTFT ms, median time between tokens ms), the timings ``--upstream paced`` serves
SEED003_DECODE = {1: (62, 6.1), 2: (85, 7.0), 4: (102, 7.5), 8: (166, 8.5), 16: (207, 9.8), 32: (360, 12.3),
                  64: (529, 15.9), 128: (845, 21.6)}


def paced_body(conc: int) -> dict:
    """The body field that sets ``benchmarks/paced_engine.py``'s timing to seed 003's at ``conc``."""
    ttft, itl = SEED003_DECODE[conc]
    return {"paced": {"ttft_ms": ttft, "itl_ms": itl}}
#: Seconds vLLM's server keeps an idle connection (its VLLM_HTTP_TIMEOUT_KEEP_ALIVE default). A
#: proxy reusing an upstream connection the engine is closing gets no response: HAProxy retries
#: such a request (``retry-on empty-response``), nginx cannot retry an unbuffered POST, so its
#: idle upstream connections are dropped 1 s before the engine's.
ENGINE_KEEP_ALIVE_S = 5


def haproxy_config(port: int, engine_port: int, key: str, control_paths) -> str:
    """HAProxy 2.x configuration (one thread) for :data:`ALTS` ``haproxy`` (module docstring)."""
    paths = " ".join(control_paths)
    return f"""global
    maxconn 8192
    nbthread 1

defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout http-keep-alive 75s
    option http-no-delay
    retries 3
    retry-on conn-failure empty-response

frontend public
    bind 127.0.0.1:{port}
    acl key_ok req.hdr(authorization) -m str "Bearer {key}"
    acl control path_beg -i {paths}
    http-request deny deny_status 403 if control
    http-request return status 401 content-type application/json string '{{"error":{{"code":"invalid_api_key"}}}}' hdr www-authenticate 'Bearer realm="warmctl"' if !key_ok !{{ path /health }}
    default_backend engine

backend engine
    http-reuse always
    server engine 127.0.0.1:{engine_port}
"""


def nginx_config(port: int, engine_port: int, key: str, control_paths, workdir: Path) -> str:
    """nginx configuration (one worker) for :data:`ALTS` ``nginx`` (module docstring); every
    file it writes (pid, error log, temp dirs) is under ``workdir``."""
    alternation = "|".join(p.lstrip("/").replace(".", r"\.") for p in control_paths)
    tmp = workdir / "nginx-tmp"
    return f"""daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    map $http_authorization $warmctl_key_ok {{
        default 0;
        "~^Bearer {key}$" 1;
    }}
    upstream engine {{
        server 127.0.0.1:{engine_port};
        keepalive 256;
        keepalive_timeout {max(1, ENGINE_KEEP_ALIVE_S - 1)}s;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        keepalive_timeout 75s;
        keepalive_requests 1000000;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
        proxy_request_buffering off;
        proxy_read_timeout 600s;
        proxy_send_timeout 600s;
        location ~* ^/({alternation})(/|$) {{ return 403; }}
        location = /health {{ proxy_pass http://engine; }}
        location / {{
            if ($warmctl_key_ok = 0) {{
                add_header WWW-Authenticate 'Bearer realm="warmctl"' always;
                return 401;
            }}
            proxy_pass http://engine;
        }}
    }}
}}
"""


class Processes:
    """Processes this script started (each in its own session): :meth:`stop_all` ends each
    one's process group (SIGTERM, then SIGKILL after 5 s) and reaps it."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as f:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)
        self.procs.append((name, p))
        return p

    def stop_all(self) -> None:
        for _, p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for name, p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                print(f"{name} (pid {p.pid}) ignored SIGTERM: killing it", flush=True)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()


def wait_listening(port: int, proc: subprocess.Popen, name: str, log: Path, timeout_s: float = 15) -> None:
    """Return once ``127.0.0.1:port`` accepts; exit naming ``name`` and its log if ``proc``
    exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited ({proc.returncode}) before listening:\n{log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{name} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s:\n{log.read_text()[-2000:]}")


def start_alt(name: str, port: int, root: Path, procs: Processes) -> str:
    """Start the alternative ``name`` (:data:`ALTS`) on ``127.0.0.1:port`` in front of the
    engine; return its base URL once it listens and enforces the key."""
    from warmctl.gate.routes import CONTROL_PATHS

    exe = shutil.which(name)
    if exe is None:
        raise SystemExit(f"--alt {name}: {name} is not installed (apt-get install -y haproxy nginx-light)")
    log = root / f"{name}.log"
    if name == "haproxy":
        cfg = root / "haproxy.cfg"
        cfg.write_text(haproxy_config(port, ENGINE_PORT, KEY, CONTROL_PATHS))
        argv = [exe, "-db", "-f", str(cfg)]
    else:
        cfg = root / "nginx.conf"
        for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (root / "nginx-tmp" / d).mkdir(parents=True, exist_ok=True)
        cfg.write_text(nginx_config(port, ENGINE_PORT, KEY, CONTROL_PATHS, root))
        argv = [exe, "-p", str(root), "-e", str(root / "nginx-error.log"), "-c", str(cfg)]
    check = subprocess.run([*argv, "-c" if name == "haproxy" else "-t"],
                           capture_output=True, text=True)
    if check.returncode:
        raise SystemExit(f"{name} refused its configuration {cfg}:\n{check.stdout}{check.stderr}")
    p = procs.start(name, argv, log)
    wait_listening(port, p, name, log)
    url = f"http://127.0.0.1:{port}"
    codes = (httpx.get(f"{url}/v1/models").status_code,
             httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code,
             httpx.post(f"{url}/sleep", headers={"Authorization": f"Bearer {KEY}"}).status_code)
    if codes != (401, 200, 403):
        raise SystemExit(f"{name} on {url}: no key / key / /sleep answered {codes}, not (401, 200, 403)")
    return url


async def many_clients(url: str, verify, n: int, max_tokens: int, extra: dict | None = None) -> tuple[int, list[str]]:
    """``n`` streaming clients at once, each on its own connection: (streams that ended with
    ``[DONE]``, errors). ``extra``: further body fields."""
    async def one(i: int):
        async with httpx.AsyncClient(base_url=url, verify=verify, timeout=600,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await stream_once(c, "/v1/completions", max_tokens, extra)

    res = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    errors = [f"{type(r).__name__}: {r}" for r in res if isinstance(r, BaseException)]
    return sum(1 for r in res if not isinstance(r, BaseException)), errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="8,64", help="concurrent streams per round, comma-separated levels")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side and level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=256, help="concurrent streaming clients through the gate (0: skip)")
    ap.add_argument("--tls", action="store_true", help="also measure a second gate with TLS (CA made here)")
    ap.add_argument("--alt", default="", help=f"also measure these alternatives, comma-separated: {','.join(ALTS)}")
    ap.add_argument("--upstream", choices=UPSTREAMS, default="vllm",
                    help="vllm: the real tiny engine (CPU build); paced: benchmarks/paced_engine.py, a stand-in "
                         "with seed 003's H200 TTFT and time between tokens that spends no CPU on tokens")
    ap.add_argument("--keep-home", type=Path, default=None)
    a = ap.parse_args()
    alts = [x for x in a.alt.split(",") if x]
    if bad := [x for x in alts if x not in ALTS]:
        ap.error(f"--alt: unknown {','.join(bad)} (choose from {','.join(ALTS)})")
    from tests.conftest import isolated_env

    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-gate-"))
    root.mkdir(parents=True, exist_ok=True)
    env = isolated_env(root, ENGINE_PORT, GATE_PORT)
    key_file = root / "api-keys"
    key_file.write_text(f"{KEY}\n")
    key_file.chmod(0o600)
    env["WARMCTL_GATE_API_KEY_FILE"] = str(key_file)
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    from warmctl import gate
    from warmctl.records.state import load as load_state

    levels = [int(x) for x in a.concurrency.split(",")]
    paced = a.upstream == "paced"
    if paced and (missing := [c for c in levels if c not in SEED003_DECODE]):
        ap.error(f"--upstream paced: no seed 003 figures for {missing} concurrent requests "
                 f"(choose from {','.join(map(str, SEED003_DECODE))})")
    procs = Processes()
    gates: list[int] = []
    try:
        if paced:
            log = root / "paced-engine.log"
            engine = procs.start("paced engine", [sys.executable, str(Path(__file__).with_name("paced_engine.py")),
                                                  "--port", str(ENGINE_PORT)], log)
            wait_listening(ENGINE_PORT, engine, "the paced engine", log)
            gates.append(gate.start("127.0.0.1", GATE_PORT, ENGINE_PORT, engine.pid, root / "gate.log",
                                    args=gate.policy_args(key_file)))
            engine_pid, gate_pid = engine.pid, gates[0]
        else:
            if Catalog(open_store(load_settings().store_dir)).newest("tiny") is None:
                print("making the snapshot once (warmctl snapshot tiny) ...", flush=True)
                wc(env, "snapshot", "tiny", "--quiet")
            wc(env, "up", "tiny")
            st = load_state(load_settings().run_dir, "tiny")
            engine_pid, gate_pid = st.root_pid, st.gate_pid
        r = httpx.get(f"http://127.0.0.1:{GATE_PORT}/v1/models")
        assert r.status_code == 401, f"the gate did not enforce the key: {r.status_code}"
        sides: dict = {"direct": (f"http://127.0.0.1:{ENGINE_PORT}", False),
                       "gate+key": (f"http://127.0.0.1:{GATE_PORT}", False)}
        relays = {"gate+key": [gate_pid]}
        if a.tls:
            from tests.test_gate_policy import _make_ca_and_cert

            ca, cert, tkey, _ = _make_ca_and_cert(root)
            gates.append(gate.start("127.0.0.1", GATE_PORT + 1, ENGINE_PORT, engine_pid, root / "tls-gate.log",
                                    args=gate.policy_args(key_file, cert, tkey)))
            sides["gate+key+TLS"] = (f"https://127.0.0.1:{GATE_PORT + 1}", ssl.create_default_context(cafile=str(ca)))
            relays["gate+key+TLS"] = [gates[-1]]
        for i, name in enumerate(alts, 1):
            sides[f"{name}+key"] = (start_alt(name, ENGINE_PORT + i, root, procs), False)
            relays[f"{name}+key"] = [procs.procs[-1][1].pid]
        body = paced_body if paced else (lambda conc: None)
        res = asyncio.run(measure(sides, levels, a.rounds, a.max_tokens, relays, extra=body))
        many = asyncio.run(many_clients(*sides["gate+key"], a.clients, 8, body(64))) if a.clients else None
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        procs.stop_all()
        for pid in gates:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if not paced:  # always: an interrupted snapshot or up may have left an engine; down cleans up after both
            wc(env, "down", "tiny", "--now", check=False)
        if a.keep_home is None:
            shutil.rmtree(root, ignore_errors=True)
    for conc, by in res.items():
        d = by["direct"]
        print(f"{conc} concurrent streams, {a.rounds} rounds x {conc} requests per side, {a.max_tokens} tokens each:")
        for k, v in by.items():
            ratio = "" if k == "direct" else (f"   x{v['ttft_ms'] / d['ttft_ms']:.3f} TTFT, x{v['itl_ms'] / d['itl_ms']:.3f} ITL,"
                                              f" x{v['tok_s'] / d['tok_s']:.3f} tok/s")
            cpu = "" if k == "direct" else f"  relay CPU {v['relay_us_per_chunk']:6.1f} us/chunk"
            print(f"  {k:>14}: TTFT {v['ttft_ms']:8.2f} ms  ITL {v['itl_ms']:7.2f} ms  {v['tok_s']:8.1f} tok/s"
                  f"  {v['chunks']:4.0f} chunks{cpu}{ratio}")
    if many is not None:
        ok, errors = many
        print(f"{a.clients} concurrent streaming clients through the gate: {ok} complete ([DONE]), {len(errors)} errors")
        for e in errors[:5]:
            print(f"  {e}")
    print(json.dumps({"levels": {str(k): v for k, v in res.items()},
                      "clients": {"n": a.clients, "complete": many[0], "errors": len(many[1])} if many else None}))


if __name__ == "__main__":
    from warmctl.bench.shm import run

    run(main, Path(__file__).stem)  # /dev/shm left as found; SIGTERM cleans up like Ctrl-C (main's finally)
