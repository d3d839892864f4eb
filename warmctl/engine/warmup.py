"""The warm-up grid: one round of requests per (prompt tokens, output tokens, concurrency) cell.

Prompts are lists of token ids (``/v1/completions`` accepts them), drawn from a fixed seed in
``[100, 1000)`` so they are valid for any vocabulary of at least 1000 tokens and every run of a
profile sends the same shapes. Every request uses ``ignore_eos`` so the engine really decodes
the requested number of tokens (each decode batch size is compiled, not skipped).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from warmctl.base.errors import EngineError
from warmctl.records.profile import WarmupSpec

SEED = 1234


def prompt_ids(n_tokens: int, salt: int) -> list[int]:
    """``n_tokens`` token ids from a seeded generator (``salt`` makes concurrent prompts differ)."""
    rng = random.Random(SEED * 1_000_003 + n_tokens * 131 + salt)
    return [rng.randrange(100, 1000) for _ in range(n_tokens)]


def run_grid(base_url: str, model: str, spec: WarmupSpec,
             progress: Callable[[int, int, tuple[int, int, int]], None] | None = None,
             timeout_s: float = 600.0) -> dict:
    """Run every cell of ``spec``, then build the engine's OpenAPI schema (``GET /openapi.json``,
    see below). Returns ``{"cells": n, "requests": n, "seconds": s, "openapi_s": s}``.

    ``progress(done, total, cell)`` is called after each cell. Raises :class:`EngineError`
    naming the cell if any request fails (a warm-up that fails would snapshot a cold shape).
    """
    import httpx  # here, not at the top: `up` imports this module (cold path) without warming up

    cells = spec.cells()
    t0 = time.monotonic()
    n_req = 0
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        def one(args: tuple[int, int, int]) -> None:
            p, o, salt = args
            r = client.post("/v1/completions", json={
                "model": model, "prompt": prompt_ids(p, salt), "max_tokens": o,
                "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()

        for i, (p, o, c) in enumerate(cells):
            try:
                with ThreadPoolExecutor(max_workers=c) as pool:
                    list(pool.map(one, [(p, o, s) for s in range(c)]))
            except httpx.HTTPError as e:
                raise EngineError(f"warm-up cell (prompt {p} tokens, output {o} tokens, "
                                  f"concurrency {c}) failed: {e}") from None
            n_req += c
            if progress:
                progress(i + 1, len(cells), (p, o, c))
        # vLLM's FastAPI app builds its OpenAPI schema on the first GET /openapi.json and keeps
        # it; the gate reads it once it has opened (its route report), and building it holds
        # the API server's event loop, so a restored engine's first client request waited
        # behind it (0.7-0.9 s after `up` returned, measured with benchmarks/up_vs_raw.py).
        # Built here, it is in the snapshot's memory and every restore answers it at once.
        t_schema = time.monotonic()
        try:
            client.get("/openapi.json").raise_for_status()
        except httpx.HTTPError as e:
            raise EngineError(f"warm-up: GET /openapi.json failed: {e}") from None
        schema_s = time.monotonic() - t_schema
    return {"cells": len(cells), "requests": n_req, "seconds": time.monotonic() - t0, "openapi_s": schema_s}
