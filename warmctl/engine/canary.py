"""The canary: greedy completions recorded at snapshot time and replayed after restore.

Each canary prompt is sent to ``POST /v1/completions`` with ``temperature=0``, ``seed=0``,
``max_tokens`` and ``logprobs`` from the profile, ``return_tokens_as_token_ids`` (so top-k
alternatives are keyed by token id, not by text that may collide) and
``return_token_ids``. JSON numbers are parsed as Python floats (binary64), which round-trip
exactly through ``repr``, so a logprob compared "bit for bit" is compared as the engine sent it.
"""

from __future__ import annotations

from warmctl.engine.loopback import Connection, LoopbackError
from warmctl.base.errors import CanaryMismatch, EngineError
from warmctl.records.manifest import CanaryCompletion, CanaryRecord
from warmctl.records.profile import CanarySpec


def _request(spec: CanarySpec, model: str, prompt: str) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "seed": 0,
        "logprobs": spec.logprobs if spec.logprobs else None,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }


def run(base_url: str, spec: CanarySpec, model: str, timeout_s: float = 120.0) -> CanaryRecord:
    """Run every canary prompt once against ``base_url`` and return what the engine produced.

    Raises :class:`EngineError` on an HTTP error or a response without token ids. The requests
    go over one keep-alive connection (:mod:`warmctl.engine.loopback`); ``timeout_s`` bounds
    connecting and each read.
    """
    out = []
    with Connection(base_url, timeout_s) as client:
        for prompt in spec.prompts:
            try:
                answer = client.post_json("/v1/completions", _request(spec, model, prompt))
            except LoopbackError as e:
                raise EngineError(f"canary request to {base_url} failed: {e}") from None
            choice = answer["choices"][0]
            ids = choice.get("token_ids")
            if ids is None:
                raise EngineError("engine returned no token_ids (needs vLLM with return_token_ids)")
            lp = choice.get("logprobs") or {}
            out.append(CanaryCompletion(
                prompt=prompt,
                token_ids=list(ids),
                logprobs=[float(x) for x in lp.get("token_logprobs") or []],
                top_logprobs=[{k: float(v) for k, v in (d or {}).items()} for d in lp.get("top_logprobs") or []],
                text=choice.get("text", ""),
            ))
    return CanaryRecord(match=spec.match, max_tokens=spec.max_tokens, logprobs=spec.logprobs, completions=out)


def first_difference(expected: CanaryRecord, actual: CanaryRecord) -> str | None:
    """None if ``actual`` matches ``expected`` under ``expected.match``; else a sentence naming
    the prompt index, the first differing position, and expected vs actual token and logprob.
    """
    if len(expected.completions) != len(actual.completions):
        return f"expected {len(expected.completions)} canary completions, got {len(actual.completions)}"
    check_lp = expected.match == "tokens+logprobs"
    for i, (e, a) in enumerate(zip(expected.completions, actual.completions)):
        n = max(len(e.token_ids), len(a.token_ids))
        for pos in range(n):
            et = e.token_ids[pos] if pos < len(e.token_ids) else None
            at = a.token_ids[pos] if pos < len(a.token_ids) else None
            el = e.logprobs[pos] if pos < len(e.logprobs) else None
            al = a.logprobs[pos] if pos < len(a.logprobs) else None
            etop = e.top_logprobs[pos] if pos < len(e.top_logprobs) else None
            atop = a.top_logprobs[pos] if pos < len(a.top_logprobs) else None
            if et != at or (check_lp and (el != al or etop != atop)):
                what = "token" if et != at else ("logprob" if el != al else "top-k logprobs")
                return (f"prompt {i} ({e.prompt[:40]!r}), position {pos}: {what} differs: "
                        f"expected token {et} logprob {el!r}, got token {at} logprob {al!r}")
    return None


def verify(expected: CanaryRecord, base_url: str, spec: CanarySpec, model: str) -> CanaryRecord:
    """Replay the canary and compare. Returns the new record if it matches.

    Raises :class:`CanaryMismatch` with :func:`first_difference`'s sentence otherwise.
    """
    actual = run(base_url, spec, model)
    diff = first_difference(expected, actual)
    if diff:
        raise CanaryMismatch(f"canary mismatch: {diff}")
    return actual
