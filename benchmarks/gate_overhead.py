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

and the ratios side/direct (1.000 = no cost). Then ``--clients`` (256) concurrent streaming
clients through the gate: how many got every token and ``[DONE]``, and every error.

Usage::

    python benchmarks/gate_overhead.py [--concurrency 8,64] [--rounds 8] [--max-tokens 32]
        [--clients 256] [--tls] [--keep-home DIR]

Ports: $WARMCTL_TEST_ENGINE_PORT / $WARMCTL_TEST_GATE_PORT when set (else 18600/18680);
the TLS gate listens on the gate port + 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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


async def stream_once(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, mean time between token chunks s, chunks) of one streaming completion."""
    t0 = time.perf_counter()
    ttft, first, last, n = None, 0.0, 0.0, 0
    async with client.stream("POST", url, json={**BODY, "max_tokens": max_tokens}) as r:
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


async def one_round(client: httpx.AsyncClient, url: str, conc: int, max_tokens: int):
    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*(stream_once(client, url, max_tokens) for _ in range(conc)))
    except Exception as e:
        raise RuntimeError(f"{client.base_url}: {type(e).__name__}: {e}") from e
    wall = time.perf_counter() - t0
    return res, sum(r[2] for r in res) / wall


async def measure(sides: dict[str, tuple[str, ssl.SSLContext | bool]], levels: list[int], rounds: int,
                  max_tokens: int) -> dict:
    out = {}
    headers = {"Authorization": f"Bearer {KEY}"}
    for conc in levels:
        clients = {k: httpx.AsyncClient(base_url=u, verify=v, headers=headers, timeout=300,
                                        limits=httpx.Limits(max_connections=conc, max_keepalive_connections=conc))
                   for k, (u, v) in sides.items()}
        ttft = {k: [] for k in sides}
        itl = {k: [] for k in sides}
        tput = {k: [] for k in sides}
        try:
            for k in sides:  # warm each path (connections, engine)
                await one_round(clients[k], "/v1/completions", conc, max_tokens)
            order = list(sides)
            for r in range(rounds):
                for k in (order if r % 2 == 0 else order[::-1]):
                    res, tps = await one_round(clients[k], "/v1/completions", conc, max_tokens)
                    ttft[k] += [x[0] for x in res]
                    itl[k] += [x[1] for x in res]
                    tput[k].append(tps)
        finally:
            for c in clients.values():
                await c.aclose()
        out[conc] = {k: {"ttft_ms": 1e3 * statistics.median(ttft[k]), "itl_ms": 1e3 * statistics.median(itl[k]),
                         "tok_s": statistics.median(tput[k])} for k in sides}
    return out


async def many_clients(url: str, verify, n: int, max_tokens: int) -> tuple[int, list[str]]:
    """``n`` streaming clients at once, each on its own connection: (streams that ended with
    ``[DONE]``, errors)."""
    async def one(i: int):
        async with httpx.AsyncClient(base_url=url, verify=verify, timeout=600,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await stream_once(c, "/v1/completions", max_tokens)

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
    ap.add_argument("--keep-home", type=Path, default=None)
    a = ap.parse_args()
    from tests.conftest import isolated_env

    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-gate-"))
    root.mkdir(parents=True, exist_ok=True)
    env = isolated_env(root, ENGINE_PORT, GATE_PORT)
    key_file = root / "api-keys"
    key_file.write_text(f"{KEY}\n")
    key_file.chmod(0o600)
    env["WARMCTL_GATE_API_KEY_FILE"] = str(key_file)
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    from warmctl.catalog import Catalog
    from warmctl.config import load_settings
    from warmctl.store import open_store

    if Catalog(open_store(load_settings().store_dir)).newest("tiny") is None:
        print("making the snapshot once (warmctl snapshot tiny) ...", flush=True)
        wc(env, "snapshot", "tiny", "--quiet")
    wc(env, "up", "tiny")
    tls_gate = None
    try:
        r = httpx.get(f"http://127.0.0.1:{GATE_PORT}/v1/models")
        assert r.status_code == 401, f"the gate did not enforce the key: {r.status_code}"
        sides: dict = {"direct": (f"http://127.0.0.1:{ENGINE_PORT}", False),
                       "gate+key": (f"http://127.0.0.1:{GATE_PORT}", False)}
        if a.tls:
            from tests.test_gate_policy import _make_ca_and_cert
            from warmctl import gate
            from warmctl.state import load as load_state

            ca, cert, tkey, _ = _make_ca_and_cert(root)
            st = load_state(load_settings().run_dir, "tiny")
            tls_gate = gate.start("127.0.0.1", GATE_PORT + 1, ENGINE_PORT, st.root_pid, root / "tls-gate.log",
                                  args=gate.policy_args(key_file, cert, tkey))
            sides["gate+key+TLS"] = (f"https://127.0.0.1:{GATE_PORT + 1}", ssl.create_default_context(cafile=str(ca)))
        levels = [int(x) for x in a.concurrency.split(",")]
        res = asyncio.run(measure(sides, levels, a.rounds, a.max_tokens))
        many = asyncio.run(many_clients(*sides["gate+key"], a.clients, 8)) if a.clients else None
    finally:
        if tls_gate is not None:
            subprocess.run(["kill", str(tls_gate)], check=False)
        wc(env, "down", "tiny", "--now", check=False)
        if a.keep_home is None:
            shutil.rmtree(root, ignore_errors=True)
    for conc, by in res.items():
        d = by["direct"]
        print(f"{conc} concurrent streams, {a.rounds} rounds x {conc} requests per side, {a.max_tokens} tokens each:")
        for k, v in by.items():
            ratio = "" if k == "direct" else (f"   x{v['ttft_ms'] / d['ttft_ms']:.3f} TTFT, x{v['itl_ms'] / d['itl_ms']:.3f} ITL,"
                                              f" x{v['tok_s'] / d['tok_s']:.3f} tok/s")
            print(f"  {k:>13}: TTFT {v['ttft_ms']:8.2f} ms  ITL {v['itl_ms']:7.2f} ms  {v['tok_s']:8.1f} tok/s{ratio}")
    if many is not None:
        ok, errors = many
        print(f"{a.clients} concurrent streaming clients through the gate: {ok} complete ([DONE]), {len(errors)} errors")
        for e in errors[:5]:
            print(f"  {e}")
    print(json.dumps({"levels": {str(k): v for k, v in res.items()},
                      "clients": {"n": a.clients, "complete": many[0], "errors": len(many[1])} if many else None}))


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
