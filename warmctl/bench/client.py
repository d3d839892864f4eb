"""One streamed request against an OpenAI-compatible ``/v1/completions`` endpoint, timed.

Every number here is measured by the client (``time.perf_counter``, seconds) except
``usage_*``, which are the server's own ``usage`` fields (sent in the final chunk when
``stream_options.include_usage`` is honoured). ``output_tokens`` counts the token ids the
server streamed (``return_token_ids``, a vLLM extension) or, where a server sends none, one
token per non-empty text chunk.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from importlib import resources

import httpx

#: Token ids for random prompts are drawn from ``[100, 1000)``: valid for any vocabulary of at
#: least 1,000 tokens (the tiny model has 1,024), and away from the special ids at the start.
TOKEN_LOW, TOKEN_HIGH = 100, 1000


def random_prompt(n_tokens: int, seed: int, salt: int | str) -> list[int]:
    """``n_tokens`` token ids from a generator seeded by (``seed``, ``n_tokens``, ``salt``)."""
    rng = random.Random(f"{seed}:{n_tokens}:{salt}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n_tokens)]


def corpus_text() -> str:
    """The text the package ships (``warmctl/data/corpus.txt``), used for text prompts."""
    return resources.files("warmctl").joinpath("data/corpus.txt").read_text()


@dataclass
class RequestResult:
    """Timings of one streamed request. Times are seconds from the request's start.

    - ``ttft``: time to the first chunk carrying output (None if none arrived).
    - ``token_times``: arrival time of each output token (a chunk of k tokens adds k entries
      with the chunk's time), so ``len(token_times) == output_tokens``.
    - ``total``: until the stream ended or was cut at the deadline.
    - ``usage_prompt_tokens``/``usage_completion_tokens``: the server's ``usage`` (None when it
      sent none, e.g. a stream cut at the deadline).
    - ``completed``: the server finished the request (``finish_reason`` set); ``cut``: the
      client stopped reading at the deadline; ``error``: why it failed (None if it did not).
    """

    start: float  # perf_counter at send, absolute
    ttft: float | None = None
    total: float = 0.0
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    completed: bool = False
    cut: bool = False
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def decode_rate(self) -> float | None:
        """Tokens/s after the first token: ``(n - 1) / (t_last - t_first)``; None under 2 tokens."""
        if len(self.token_times) < 2 or self.token_times[-1] <= self.token_times[0]:
            return None
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])

    def mean_tbt(self) -> float | None:
        """Mean time between tokens (s) after the first: ``(t_last - t_first) / (n - 1)``."""
        r = self.decode_rate()
        return None if r is None else 1.0 / r

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("token_times")
        d.pop("start")
        return d


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int] | str, max_tokens: int,
                            *, deadline: float | None = None, ignore_eos: bool = True,
                            temperature: float = 0.0, keep_text: bool = False,
                            extra: dict | None = None) -> RequestResult:
    """POST a streamed completion and time it (see :class:`RequestResult`).

    ``deadline`` is an absolute ``time.perf_counter()`` value: reading stops there and the
    request is marked ``cut`` (its tokens so far still count). Never raises for a failed
    request: HTTP errors, bad JSON and broken streams are recorded in ``error``.
    """
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "ignore_eos": ignore_eos, **(extra or {})}
    res = RequestResult(start=time.perf_counter())
    text_parts: list[str] = []
    async def read() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {r.status_code}: {detail}"
                return
            async for line in r.aiter_lines():
                now = time.perf_counter() - res.start
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"server error in stream: {msg['error']}"
                    return
                for ch in msg.get("choices") or []:
                    ids = ch.get("token_ids")
                    txt = ch.get("text") or ""
                    n = len(ids) if ids is not None else (1 if txt else 0)
                    if n:
                        if res.ttft is None:
                            res.ttft = now
                        res.token_times.extend([now] * n)
                        res.output_tokens += n
                    if keep_text and txt:
                        text_parts.append(txt)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                        res.completed = True
                u = msg.get("usage")
                if u:
                    res.usage_prompt_tokens = u.get("prompt_tokens")
                    res.usage_completion_tokens = u.get("completion_tokens")

    try:
        if deadline is None:
            await read()
        else:
            async with asyncio.timeout(max(0.0, deadline - time.perf_counter())):
                await read()
    except TimeoutError:
        if res.completed:
            pass
        else:
            res.cut = True
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.total = time.perf_counter() - res.start
        res.text = "".join(text_parts)
    if res.error is None and not res.completed and not res.cut:
        res.error = "stream ended without a finish_reason"
    return res
