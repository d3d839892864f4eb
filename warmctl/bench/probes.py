"""Probes from seed 000: needle recall (section 08), agent turns with a shared prefix
(section 06), speculative-decoding acceptance (section 07).

Each probe returns a plain dict (JSON-ready) with ``probe``, its numbers and a one-line
``verdict`` that states what was (or could not be) measured. A model that fails a probe (the
tiny random-weight model recalls nothing) still gets a full, honest report.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import httpx

from warmctl.bench import metrics as _metrics
from warmctl.bench.client import random_prompt, stream_completion

FILLER = ("Sentence {n}: the archive keeps ledger entry {n} beside the copper lamp, and the clerk "
          "notes that nothing unusual happened on that day.")
NEEDLE = "Remember this: the vault code is {code}."
QUESTION = "\nQuestion: what is the vault code? Answer: the vault code is"


async def _count_tokens(client: httpx.AsyncClient, model: str, text: str) -> int | None:
    """Prompt tokens of ``text`` per the server's ``/tokenize`` (None if it has none)."""
    try:
        r = await client.post("/tokenize", json={"model": model, "prompt": text})
        if r.status_code == 200:
            return int(r.json()["count"])
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    return None


async def _document(client: httpx.AsyncClient, model: str, n_tokens: int, depth: float, code: str) -> str:
    """Numbered filler sentences with the needle at ``depth`` (0..1 of the sentences), sized so
    that document + question is about ``n_tokens`` tokens (by ``/tokenize``, else ~4 chars/token)."""
    sample = " ".join(FILLER.format(n=i) for i in range(1, 21))
    per = await _count_tokens(client, model, sample)
    per_sentence = (per / 20) if per else len(sample) / 20 / 4
    fixed = await _count_tokens(client, model, NEEDLE.format(code=code) + QUESTION) or 30
    n = max(1, int((n_tokens - fixed) / per_sentence))
    sentences = [FILLER.format(n=i + 1) for i in range(n)]
    sentences.insert(round(depth * n), NEEDLE.format(code=code))
    return " ".join(sentences) + QUESTION


async def needle(client: httpx.AsyncClient, model: str, doc_tokens: list[int], depths: list[float],
                 seed: int = 0, max_tokens: int = 8) -> dict:
    """Hide a random 4-digit vault code at each depth of each document length (tokens) and ask
    for it (greedy). ``found``: the code appears in the answer. Returns per-trial prompt
    tokens (server ``usage``), TTFT and total seconds, the answer, and ``recalled``/``trials``."""
    rng = random.Random(seed)
    trials = []
    for n in doc_tokens:
        for d in depths:
            code = f"{rng.randrange(1000, 10000)}"
            doc = await _document(client, model, n, d, code)
            r = await stream_completion(client, model, doc, max_tokens, ignore_eos=False, keep_text=True)
            trials.append({"doc_tokens": n, "depth": d, "code": code, "prompt_tokens": r.usage_prompt_tokens,
                           "ttft_s": r.ttft, "total_s": r.total, "answer": r.text.strip(),
                           "found": r.ok and code in r.text, "error": r.error})
    ok = [t for t in trials if not t["error"]]
    found = sum(t["found"] for t in trials)
    failed = len(trials) - len(ok)
    verdict = f"recalled {found} of {len(trials)}" + (f"; {failed} requests failed" if failed else "")
    return {"probe": "needle", "trials": trials, "recalled": found, "failed": failed, "total": len(trials),
            "verdict": verdict}


async def agent_turns(client: httpx.AsyncClient, model: str, prefix_tokens: int, new_tokens: int,
                      turns: int = 6, seed: int | None = None) -> dict:
    """``turns`` requests sharing one ``prefix_tokens`` prefix, each with ``new_tokens`` new ones,
    against ``turns`` unseen prompts of the same total length (seeded random ids, 1 output token).

    ``shared_ttft_s``: median TTFT of turns 2..n (turn 1 computes the prefix, reported as
    ``first_turn_ttft_s``); ``unseen_ttft_s``: median TTFT of the unseen prompts; ``speedup`` =
    unseen / shared. ``prefix_cache_hit_tokens``/``queries``: the increase of vLLM's
    ``vllm:prefix_cache_hits``/``queries`` counters over the shared turns (None without them).
    """
    seed = seed if seed is not None else random.randrange(2**31)
    prefix = random_prompt(prefix_tokens, seed, "agent-prefix")
    before = await _metrics.fetch_metrics(client)
    shared = []
    for i in range(turns):
        shared.append(await stream_completion(client, model, prefix + random_prompt(new_tokens, seed, f"turn{i}"), 1))
    after = await _metrics.fetch_metrics(client)
    unseen = []
    for i in range(turns):
        unseen.append(await stream_completion(client, model, random_prompt(prefix_tokens + new_tokens, seed, f"unseen{i}"), 1))

    def delta(name: str) -> float | None:
        if before is None or after is None:
            return None
        a, b = _metrics.counter(after, name), _metrics.counter(before, name)
        return None if a is None or b is None else a - b

    later = [r.ttft for r in shared[1:] if r.ok and r.ttft is not None]
    un = [r.ttft for r in unseen if r.ok and r.ttft is not None]
    s_med = statistics.median(later) if later else None
    u_med = statistics.median(un) if un else None
    failed = sum(not r.ok for r in shared + unseen)
    speedup = (u_med / s_med) if s_med and u_med else None
    verdict = (f"shared-prefix TTFT {s_med * 1000:,.1f} ms vs unseen {u_med * 1000:,.1f} ms ({speedup:.2f}x)"
               if speedup else "could not measure (requests failed)")
    return {"probe": "agent_turns", "prefix_tokens": prefix_tokens, "new_tokens": new_tokens, "turns": turns,
            "first_turn_ttft_s": shared[0].ttft, "shared_ttft_s": s_med, "unseen_ttft_s": u_med,
            "speedup": speedup, "shared_ttfts_s": [r.ttft for r in shared], "unseen_ttfts_s": [r.ttft for r in unseen],
            "prompt_tokens": shared[0].usage_prompt_tokens,
            "prefix_cache_hit_tokens": delta("vllm:prefix_cache_hits"),
            "prefix_cache_query_tokens": delta("vllm:prefix_cache_queries"),
            "failed": failed, "verdict": verdict + (f"; {failed} requests failed" if failed and speedup else "")}


SPEC_TEXTS = {
    "prose": "Write a long, detailed essay about the history of lighthouses and the people who kept them.",
    "code": "Write a long Python module implementing a binary search tree with insert, delete, search and "
            "in-order traversal, with docstrings.",
}
_SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


async def spec_decode(client: httpx.AsyncClient, model: str, max_tokens: int = 256) -> dict:
    """Draft acceptance of speculative decoding, from vLLM's counters, on one prose and one
    code request (sequential, greedy). Per text: ``acceptance`` = accepted / draft tokens,
    ``tokens_per_step`` = 1 + accepted / drafts, ``tok_s`` = output tokens / total seconds (TTFT
    included). ``available`` False (and no request sent) when the engine has no such counters."""
    m0 = await _metrics.fetch_metrics(client)
    if m0 is None:
        return {"probe": "spec_decode", "available": False, "verdict": "not available: the endpoint has no /metrics (behind warmctl's gate: gate_allow_paths = [\"/metrics\"] opens it)"}
    if all(_metrics.counter(m0, n) is None for n in _SPEC):
        return {"probe": "spec_decode", "available": False,
                "verdict": "not available: the engine reports no speculative-decoding counters "
                           "(vllm:spec_decode_*); it does not run speculative decoding"}
    rows = {}
    for kind, text in SPEC_TEXTS.items():
        before = await _metrics.fetch_metrics(client) or []
        r = await stream_completion(client, model, text, max_tokens, ignore_eos=False)
        after = await _metrics.fetch_metrics(client) or []
        d = {n.split("num_")[1]: (_metrics.counter(after, n) or 0) - (_metrics.counter(before, n) or 0) for n in _SPEC}
        rows[kind] = {"output_tokens": r.output_tokens, "total_s": r.total, "error": r.error,
                      "tok_s": r.output_tokens / r.total if r.ok and r.total else None,
                      "drafts": d["drafts"], "draft_tokens": d["draft_tokens"], "accepted_tokens": d["accepted_tokens"],
                      "acceptance": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None,
                      "tokens_per_step": 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None}
    verdict = "; ".join(f"{k}: " + (f"{v['acceptance']:.0%} accepted, {v['tokens_per_step']:.2f} tokens/step, "
                                    f"{v['tok_s']:.1f} tok/s" if v["acceptance"] is not None else
                                    f"no drafts counted ({v['error'] or 'engine drafted nothing'})")
                        for k, v in rows.items())
    return {"probe": "spec_decode", "available": True, "texts": rows, "verdict": verdict}


def run(coro_factory, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
    """Run ``coro_factory(client)`` with a client on ``base_url``; returns its result."""

    async def main():
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=10)) as c:
            return await coro_factory(c)

    return asyncio.run(main())


def markdown(results: list[dict], model: str) -> str:
    """A short Markdown report of probe results."""
    lines = [f"# Probes: {model}", ""]
    for r in results:
        lines += [f"## {r['probe']}", "", r["verdict"], ""]
        if r["probe"] == "needle":
            lines += ["| Document tokens | Depth | Prompt tokens | TTFT | Found | Answer |", "|---:|---:|---:|---:|---|---|"]
            for t in r["trials"]:
                ttft = f"{t['ttft_s'] * 1000:,.0f} ms" if t["ttft_s"] else "—"
                ans = (t["answer"] or t["error"] or "").replace("|", "\\|").replace("\n", " ")[:60]
                lines.append(f"| {t['doc_tokens']:,} | {t['depth']:.0%} | {t['prompt_tokens'] or '—'} | {ttft} "
                             f"| {'yes' if t['found'] else 'no'} | {ans} |")
            lines.append("")
        elif r["probe"] == "agent_turns":
            def f(s: float | None) -> str:
                return "—" if s is None else f"{s * 1000:,.1f} ms"

            sp = "—" if not r["speedup"] else f"{r['speedup']:.2f}x"
            hits = "—" if r["prefix_cache_hit_tokens"] is None else f"{r['prefix_cache_hit_tokens']:,.0f}"
            lines += ["| Prefix tokens | New tokens | Turns | First turn TTFT | Later turns TTFT (median) "
                      "| Unseen prompt TTFT (median) | Speedup | Prefix-cache hit tokens |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|",
                      f"| {r['prefix_tokens']:,} | {r['new_tokens']:,} | {r['turns']} | {f(r['first_turn_ttft_s'])} "
                      f"| {f(r['shared_ttft_s'])} | {f(r['unseen_ttft_s'])} | {sp} | {hits} |", ""]
        elif r["probe"] == "spec_decode" and r.get("available"):
            lines += ["| Text | Acceptance | Tokens per step | Output tok/s | Drafts | Draft tokens | Accepted |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for k, v in r["texts"].items():
                acc = "—" if v["acceptance"] is None else f"{v['acceptance']:.0%}"
                tps = "—" if v["tokens_per_step"] is None else f"{v['tokens_per_step']:.2f}"
                rate = "—" if v["tok_s"] is None else f"{v['tok_s']:.1f}"
                lines.append(f"| {k} | {acc} | {tps} | {rate} | {v['drafts']:,.0f} | {v['draft_tokens']:,.0f} "
                             f"| {v['accepted_tokens']:,.0f} |")
            lines.append("")
    return "\n".join(lines)
