"""The speed-test matrix (seed 003): prefill by context length, sustained decode by context x
concurrency, against any OpenAI-compatible ``/v1/completions`` endpoint.

**Prefill** (per context length, in tokens): ``1 + prefill_repeats`` requests, each with a
prompt the engine has not seen (seeded random token ids) and ``max_tokens=1``; the first is
discarded (it may compile kernels for a new shape, seed 000 section 04) and kept in the JSON as
``first_ttft_s``. ``ttft_s`` is the median TTFT (client clock, seconds) of the rest, and
``tok_s`` = prompt tokens (the server's ``usage.prompt_tokens``) / that TTFT.

**Sustained decode** (per context x concurrency cell): each of ``concurrency`` workers owns one
prompt of ``context`` tokens (the same prompt per worker slot in every cell of that context) and
sends it over and over, streaming, ``max_tokens = min(max_output, max_model_len - context)``,
``ignore_eos``, until ``duration_s`` has passed; a request still running at the deadline is cut
and its tokens so far count. Before the clock starts each slot's prompt is sent once with
``max_tokens=1`` to warm the engine's prefix cache, so TTFT mostly excludes prefill (as in
seed 003). Per cell:

- ``total_tok_s``: output tokens received before the deadline / ``duration_s``;
- ``per_request_tok_s``: median over requests of (tokens - 1) / (last token - first token);
- ``ttft_s``, ``tbt_s``: medians over requests of TTFT and of the mean time between tokens;
- ``avg_active``: time-average of requests in flight over the window;
- ``completed``: requests the server finished inside the window; ``output_tokens``;
- ``failed``: requests that returned an error (always reported, with ``errors`` samples);
- ``usage_mismatches``: completed requests whose streamed token count differs from the
  server's ``usage.completion_tokens`` (should be 0).

**Over capacity**: a cell is not run when ``context x concurrency > capacity_tokens``, the
KV-cache capacity the engine reports (:mod:`warmctl.bench.metrics`), or ``--capacity-tokens``.
A context whose prompt does not fit ``max_model_len`` is marked ``Too long``.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

from warmctl.bench import metrics as _metrics
from warmctl.bench.client import RequestResult, corpus_text, random_prompt, stream_completion

VALID, OVER_CAPACITY, TOO_LONG, ERRORS, FAILED = "Valid", "Over capacity", "Too long", "Errors", "Failed"


def over_capacity(context: int, concurrency: int, capacity_tokens: int | None) -> bool:
    """True when ``concurrency`` requests of ``context`` tokens each exceed the KV cache:
    ``context * concurrency > capacity_tokens``. Unknown capacity (None) never excludes a cell."""
    return capacity_tokens is not None and context * concurrency > capacity_tokens


@dataclass
class MatrixOptions:
    """What to measure. Token counts are tokens; times are seconds.

    ``prompt``: ``"random"`` (seeded token ids, needs a vocabulary of >= 1,000 tokens) or
    ``"corpus"`` (the repository's ``warmctl/data/corpus.txt``, repeated and trimmed to length
    through the server's ``/tokenize``). ``seed`` None draws a fresh one (recorded in the
    result), so a second run does not hit the prefix cache of the first.
    """

    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    duration_s: float = 10.0
    max_output: int = 4096
    prefill_repeats: int = 1
    prompt: str = "random"
    seed: int | None = None
    capacity_tokens: int | None = None
    model: str | None = None
    api_key: str | None = None
    request_timeout_s: float = 600.0
    run_prefill: bool = True
    run_decode: bool = True


@dataclass
class PrefillRow:
    """One context length's prefill: tokens, seconds, tokens/s (see module doc)."""

    context: int
    status: str
    prompt_tokens: int | None = None
    ttft_s: float | None = None
    tok_s: float | None = None
    first_ttft_s: float | None = None
    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class DecodeCell:
    """One context x concurrency cell of sustained decode (see module doc for each field)."""

    context: int
    concurrency: int
    status: str
    max_tokens: int | None = None
    total_tok_s: float | None = None
    per_request_tok_s: float | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None
    avg_active: float | None = None
    requests: int = 0
    completed: int | None = None
    output_tokens: int | None = None
    failed: int = 0
    usage_mismatches: int = 0
    measured_s: float | None = None
    errors: list[str] = field(default_factory=list)
    #: per request: ``start_s`` (from the window's start), ``ttft_s``, ``total_s``,
    #: ``output_tokens`` (streamed), ``usage_prompt_tokens``, ``usage_completion_tokens``
    #: (server), ``completed``, ``cut``, ``error``
    request_log: list[dict] = field(default_factory=list)


@dataclass
class MatrixResult:
    """Everything one ``bench matrix`` run measured, plus what it ran against.

    ``meta``: url, model, engine version, max_model_len, options, seed, capacity and its
    source, start time (UTC ISO 8601), host facts when the endpoint is on this host.
    """

    meta: dict
    prefill: list[PrefillRow]
    decode: list[DecodeCell]

    def to_json(self) -> dict:
        return {"kind": "warmctl-bench-matrix", "format": 1, "meta": self.meta,
                "prefill": [asdict(r) for r in self.prefill], "decode": [asdict(c) for c in self.decode]}

    @classmethod
    def from_json(cls, d: dict) -> "MatrixResult":
        return cls(d["meta"], [PrefillRow(**r) for r in d["prefill"]], [DecodeCell(**c) for c in d["decode"]])

    def failed_requests(self) -> int:
        """Failed requests over the whole run (prefill and decode)."""
        return sum(r.failed for r in self.prefill) + sum(c.failed for c in self.decode)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _errors(results: list[RequestResult], keep: int = 3) -> list[str]:
    seen: list[str] = []
    for r in results:
        if r.error and r.error not in seen:
            seen.append(r.error)
        if len(seen) >= keep:
            break
    return seen


def summarize_cell(cell: DecodeCell, results: list[RequestResult], t0: float, duration_s: float) -> DecodeCell:
    """Fill ``cell``'s numbers from the requests of one window ``[t0, t0 + duration_s]``
    (``t0`` absolute ``perf_counter``). Pure function of its inputs; see module doc."""
    end = t0 + duration_s
    ok = [r for r in results if r.ok]
    tokens = sum(1 for r in ok for t in r.token_times if r.start + t <= end + 1e-3)
    busy = sum(max(0.0, min(r.start + r.total, end) - max(r.start, t0)) for r in results)
    cell.requests = len(results)
    cell.failed = len(results) - len(ok)
    cell.errors = _errors(results)
    cell.output_tokens = tokens
    cell.total_tok_s = tokens / duration_s
    cell.per_request_tok_s = _median([x for r in ok if (x := r.decode_rate()) is not None])
    cell.ttft_s = _median([r.ttft for r in ok if r.ttft is not None])
    cell.tbt_s = _median([x for r in ok if (x := r.mean_tbt()) is not None])
    cell.avg_active = busy / duration_s
    done = [r for r in ok if r.completed and r.start + r.total <= end + 1e-3]
    cell.completed = len(done)
    cell.usage_mismatches = sum(1 for r in done if r.usage_completion_tokens is not None
                                and r.usage_completion_tokens != r.output_tokens)
    cell.status = VALID if not cell.failed else (FAILED if not ok else ERRORS)
    cell.request_log = [{"start_s": round(r.start - t0, 4), "ttft_s": r.ttft, "total_s": r.total,
                         "output_tokens": r.output_tokens, "usage_prompt_tokens": r.usage_prompt_tokens,
                         "usage_completion_tokens": r.usage_completion_tokens, "completed": r.completed,
                         "cut": r.cut, "error": r.error} for r in sorted(results, key=lambda r: r.start)]
    return cell


class _Prompts:
    """Prompt source: seeded token ids, or the shipped corpus tokenized by the server."""

    def __init__(self, kind: str, seed: int, client: httpx.AsyncClient, model: str):
        if kind not in ("random", "corpus"):
            raise ValueError(f"prompt must be 'random' or 'corpus', not {kind!r}")
        self.kind, self.seed, self.client, self.model = kind, seed, client, model
        self._corpus_ids: list[int] | None = None

    async def get(self, n_tokens: int, salt: str) -> list[int]:
        if self.kind == "random":
            return random_prompt(n_tokens, self.seed, salt)
        if self._corpus_ids is None:
            r = await self.client.post("/tokenize", json={"model": self.model, "prompt": corpus_text(),
                                                          "add_special_tokens": False})
            r.raise_for_status()
            self._corpus_ids = r.json()["tokens"]
        ids = self._corpus_ids
        # a different starting offset per salt keeps prompts distinct (no prefix-cache hits)
        off = random.Random(f"{self.seed}:{salt}").randrange(len(ids))
        out: list[int] = []
        while len(out) < n_tokens:
            out.extend(ids[off:] if not out else ids)
        return out[:n_tokens]


def _tool_version() -> str:
    import warmctl

    return warmctl.__version__


def host_facts(url: str) -> dict | None:
    """Facts about this host (:func:`warmctl.host.fingerprint`) when ``url`` points at it
    (loopback or this host's name), else None: a remote endpoint's hardware is unknown here."""
    import socket
    from urllib.parse import urlparse

    h = (urlparse(url).hostname or "").lower()
    if h not in ("127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname().lower()):
        return None
    import platform

    from warmctl.host import fingerprint

    fp = fingerprint()
    gpu = fp.gpus[0].name if fp.gpus else None
    return {"summary": f"{fp.cpu.model or platform.machine()} ×{fp.cpu.count}" + (f", {len(fp.gpus)}× {gpu}" if gpu else ""),
            "cpu": fp.cpu.model, "cpu_count": fp.cpu.count, "gpu": gpu, "gpu_count": len(fp.gpus),
            "kernel": fp.kernel, "os": platform.system().lower(), "hostname": fp.hostname}


Progress = Callable[[str, int, int], None]


async def run_matrix_async(base_url: str, opts: MatrixOptions, progress: Progress | None = None) -> MatrixResult:
    """Run the matrix (see module doc). ``progress(desc, done, total)`` is called as each
    measurement starts and ends. Raises :class:`httpx.HTTPError` only if the endpoint cannot
    even list its models; failed benchmark requests are counted in the result instead."""
    seed = opts.seed if opts.seed is not None else random.randrange(2**31)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=max(opts.concurrency + [1]) + 4, max_keepalive_connections=None)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=10)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        info = await _metrics.engine_info(client)
        model = opts.model or info["model"]
        samples = await _metrics.fetch_metrics(client)
        if opts.capacity_tokens is not None:
            capacity, cap_src = opts.capacity_tokens, "--capacity-tokens option"
        elif samples is None:
            capacity, cap_src = None, "the endpoint has no /metrics (behind warmctl's gate: gate_allow_paths = [\"/metrics\"] opens it)"
        else:
            capacity, cap_src = _metrics.capacity_from_samples(samples)
        max_len = info.get("max_model_len")
        meta = {"url": base_url, "model": model, "engine": "vllm" if samples is not None and any(
                    x.name.startswith("vllm:") for x in samples) else "unknown",
                "engine_version": info.get("version"), "max_model_len": max_len,
                "host": host_facts(base_url), "tool_version": _tool_version(),
                "capacity_tokens": capacity, "capacity_source": cap_src, "seed": seed,
                "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "options": {k: v for k, v in asdict(opts).items() if k != "api_key"}}
        prompts = _Prompts(opts.prompt, seed, client, model)

        def fits(ctx: int, out: int = 1) -> bool:
            return max_len is None or ctx + out <= max_len

        n_pre = len(opts.contexts) if opts.run_prefill else 0
        n_dec = len(opts.contexts) * len(opts.concurrency) if opts.run_decode else 0
        total, done = n_pre + n_dec, 0
        prefill: list[PrefillRow] = []
        for ctx in opts.contexts if opts.run_prefill else []:
            if progress:
                progress(f"prefill {ctx:,} tokens", done, total)
            row = PrefillRow(ctx, TOO_LONG)
            if fits(ctx):
                results = []
                for i in range(1 + opts.prefill_repeats):
                    p = await prompts.get(ctx, f"prefill:{ctx}:{i}")
                    results.append(await stream_completion(client, model, p, 1))
                row.requests = len(results)
                row.failed = sum(1 for r in results if not r.ok)
                row.errors = _errors(results)
                first, rest = results[0], [r for r in results[1:] if r.ok and r.ttft]
                row.first_ttft_s = first.ttft if first.ok else None
                if not rest and first.ok and first.ttft:  # no repeats requested: use the first
                    rest = [first]
                row.ttft_s = _median([r.ttft for r in rest])  # type: ignore[misc]
                ptoks = [r.usage_prompt_tokens for r in rest if r.usage_prompt_tokens]
                row.prompt_tokens = ptoks[0] if ptoks else None
                if row.ttft_s and row.prompt_tokens:
                    row.tok_s = row.prompt_tokens / row.ttft_s
                row.status = VALID if not row.failed else (FAILED if row.ttft_s is None else ERRORS)
            prefill.append(row)
            done += 1
            if progress:
                progress(f"prefill {ctx:,}: " + (f"{row.tok_s:,.0f} tok/s, TTFT {row.ttft_s * 1000:,.0f} ms"
                                                 if row.tok_s else row.status), done, total)

        decode: list[DecodeCell] = []
        for ctx in opts.contexts if opts.run_decode else []:
            for conc in opts.concurrency:
                cell = DecodeCell(ctx, conc, VALID)
                if progress:
                    progress(f"decode {ctx:,} x {conc}", done, total)
                if not fits(ctx):
                    cell.status = TOO_LONG
                elif over_capacity(ctx, conc, capacity):
                    cell.status = OVER_CAPACITY
                else:
                    cell.max_tokens = opts.max_output if max_len is None else min(opts.max_output, max_len - ctx)
                    await _decode_cell(client, model, prompts, cell, opts.duration_s)
                decode.append(cell)
                done += 1
                if progress:
                    progress(f"decode {ctx:,} x {conc}: " + (
                        f"{cell.total_tok_s:,.1f} tok/s, {cell.failed} failed" if cell.total_tok_s is not None
                        else cell.status), done, total)
        return MatrixResult(meta, prefill, decode)


async def _decode_cell(client: httpx.AsyncClient, model: str, prompts: _Prompts, cell: DecodeCell,
                       duration_s: float) -> None:
    slot_prompts = [await prompts.get(cell.context, f"slot:{cell.context}:{i}") for i in range(cell.concurrency)]
    await asyncio.gather(*(stream_completion(client, model, p, 1) for p in slot_prompts))  # warm the prefix cache
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def worker(prompt: list[int]) -> None:
        while time.perf_counter() < deadline:
            r = await stream_completion(client, model, prompt, cell.max_tokens or 1, deadline=deadline)
            results.append(r)
            if not r.ok:
                await asyncio.sleep(0.2)  # a failing endpoint must not be hammered; still counted

    await asyncio.gather(*(worker(p) for p in slot_prompts))
    cell.measured_s = time.perf_counter() - t0
    summarize_cell(cell, results, t0, duration_s)


def run_matrix(base_url: str, opts: MatrixOptions, progress: Progress | None = None) -> MatrixResult:
    """Synchronous wrapper of :func:`run_matrix_async`."""
    return asyncio.run(run_matrix_async(base_url, opts, progress))
