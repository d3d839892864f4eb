"""Does the engine hold a streamed response whole when a request follows the last one at once?

vLLM 0.32's OpenAI server (CPU build, measured on ``tiny``) sends a streamed completion's
headers and tokens only when the generation ends if the request comes within milliseconds of
the previous stream's end (docs/bench.md, "Sustained decode"; upstream: vllm-project/vllm#28134).
This script measures it against any OpenAI-compatible URL (the engine's internal port or the
gate's public one): ``--rounds`` rounds, each sending ``--per-gap`` streamed completions of
``--tokens`` tokens (greedy, ``ignore_eos``) with each gap of ``--gaps`` between the end of one
and the start of the next, the gaps interleaved round by round. A response counts as *held*
when its headers arrive after ``--held-fraction`` (0.9) of its total time. Prints, per gap, the
responses held of those sent and the median time to the headers and to the first token.

Usage::

    python benchmarks/held_streams.py --url http://127.0.0.1:8000 [--model tiny] [--rounds 2]
        [--per-gap 8] [--gaps 0,0.05,0.2,1] [--tokens 900]

It starts nothing: bring the engine up first (``warmctl up tiny``), and down after.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx


def one(url: str, model: str, tokens: int, seed: int) -> tuple[float, float, float]:
    """One streamed completion on a new connection, as ``warmctl bench``'s clients open them:
    (seconds to the response headers, to the first token, in all)."""
    body = {"model": model, "prompt": [1 + (seed * 7 + k) % 500 for k in range(64)], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        head = time.perf_counter() - t0
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and line != "data: [DONE]":
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return head, first if first is not None else total, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the engine's (or the gate's) base URL")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-gap", type=int, default=8, help="requests per gap and round, one after another")
    ap.add_argument("--gaps", default="0,0.05,0.2,1", help="seconds between one response's end and the next request")
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--held-fraction", type=float, default=0.9)
    a = ap.parse_args()
    gaps = [float(g) for g in a.gaps.split(",")]
    res: dict[float, list[tuple[float, float, float]]] = {g: [] for g in gaps}
    seed = 0
    url = a.url.rstrip("/")
    for rnd in range(a.rounds):
        for gap in (gaps if rnd % 2 == 0 else gaps[::-1]):  # each gap goes first in turn
            time.sleep(1.0)  # the previous gap's last stream well over
            for _ in range(a.per_gap):
                seed += 1
                res[gap].append(one(url, a.model, a.tokens, seed))
                time.sleep(gap)
    print(f"{a.url}: {a.rounds} rounds x {a.per_gap} streamed completions of {a.tokens} tokens per gap")
    print(f"{'gap s':>6} {'held':>8} {'headers s (median)':>19} {'first token s':>14} {'total s':>8}")
    for gap, rows in res.items():
        held = sum(1 for h, _, t in rows if h >= a.held_fraction * t)
        print(f"{gap:6.2f} {held:>3} of {len(rows):<2} {statistics.median(h for h, _, _ in rows):19.3f} "
              f"{statistics.median(f for _, f, _ in rows):14.3f} {statistics.median(t for _, _, t in rows):8.3f}")


if __name__ == "__main__":
    main()
