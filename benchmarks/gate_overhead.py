"""What the gate costs: the same requests straight to the engine and through the public port.

With ``tiny`` up (``warmctl up tiny``; this script brings it up in its own work dir), it sends,
alternating direct/gated request by request so both sides see the same machine load:

- streaming completions (``stream: true``): time to first token (TTFT) and mean time
  between tokens per request (ITL), medians over requests;
- bulk: ``--concurrency`` non-streaming completions at once, output tokens per second.

Prints medians per side and the ratio gated/direct (1.00 = no cost). Usage::

    python benchmarks/gate_overhead.py [--requests 40] [--concurrency 8] [--keep-home DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restore_vs_cold import ENGINE_PORT, GATE_PORT, setup, wc  # noqa: E402

BODY = {"model": "tiny", "prompt": "The train leaves the station at", "max_tokens": 32,
        "temperature": 0, "ignore_eos": True}


def stream_once(client: httpx.Client, port: int) -> tuple[float, float]:
    """(TTFT, mean time between tokens) of one streaming completion, in seconds. The mean is
    (last chunk - first chunk) / (chunks - 1): vLLM may send several tokens in one burst, so a
    median of single gaps would mostly measure the bursts."""
    t0 = time.perf_counter()
    ttft, last, gaps = None, None, []
    with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**BODY, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    return ttft, (sum(gaps) / len(gaps)) if gaps else 0.0


def bulk(port: int, n: int) -> float:
    """Output tokens per second of ``n`` concurrent non-streaming completions."""
    def one(_):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, timeout=120)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        toks = sum(pool.map(one, range(n)))
    return toks / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40, help="streaming requests per side")
    ap.add_argument("--concurrency", type=int, default=8, help="requests per bulk round")
    ap.add_argument("--rounds", type=int, default=5, help="bulk rounds per side")
    ap.add_argument("--keep-home", type=Path, default=None)
    a = ap.parse_args()
    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-gate-"))
    env = setup(root)
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    from warmctl.catalog import Catalog
    from warmctl.config import load_settings
    from warmctl.store import open_store

    if Catalog(open_store(load_settings().store_dir)).newest("tiny") is None:
        wc(env, "snapshot", "tiny", "--quiet")
    wc(env, "up", "tiny")
    try:
        sides = {"direct": ENGINE_PORT, "gated": GATE_PORT}
        ttft = {k: [] for k in sides}
        itl = {k: [] for k in sides}
        tput = {k: [] for k in sides}
        with httpx.Client(timeout=120) as c:
            for k, p in sides.items():  # warm both paths
                stream_once(c, p)
            for _ in range(a.requests):
                for k, p in sides.items():
                    t, g = stream_once(c, p)
                    ttft[k].append(t)
                    itl[k].append(g)
        for _ in range(a.rounds):
            for k, p in sides.items():
                tput[k].append(bulk(p, a.concurrency))
    finally:
        wc(env, "down", "tiny")
    res = {k: {"ttft_ms": 1e3 * statistics.median(ttft[k]), "itl_ms": 1e3 * statistics.median(itl[k]),
               "bulk_tok_s": statistics.median(tput[k])} for k in sides}
    for k, v in res.items():
        print(f"{k:>6}: TTFT {v['ttft_ms']:7.2f} ms  ITL {v['itl_ms']:6.2f} ms  bulk {v['bulk_tok_s']:8.1f} tok/s")
    d, g = res["direct"], res["gated"]
    print(f"gated/direct: TTFT x{g['ttft_ms'] / d['ttft_ms']:.3f}, ITL x{g['itl_ms'] / d['itl_ms']:.3f}, "
          f"bulk throughput x{g['bulk_tok_s'] / d['bulk_tok_s']:.3f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
