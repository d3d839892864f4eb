"""What the engine says about itself: ``/metrics`` (Prometheus text), ``/v1/models``, ``/version``.

- KV-cache capacity in tokens, from vLLM's ``vllm:cache_config_info`` labels:
  ``kv_cache_size_tokens`` when present (group-aware, the number vLLM logs as
  "KV cache size: N tokens"), else ``num_gpu_blocks x block_size``.
- Counters (``vllm:prefix_cache_hits``, ``vllm:spec_decode_num_accepted_tokens``, ...) summed
  over label sets; a counter's ``_total`` suffix is accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Sample:
    """One Prometheus sample: metric name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        out.append(Sample(m.group(1), labels, value))
    return out


def counter(samples: list[Sample], name: str) -> float | None:
    """Sum of ``name`` (or ``name_total``) over all label sets; None if the engine has none."""
    vals = [s.value for s in samples if s.name in (name, name + "_total")]
    return sum(vals) if vals else None


def capacity_from_samples(samples: list[Sample]) -> tuple[int | None, str]:
    """KV-cache capacity in tokens and where it came from (see module doc).

    Returns ``(None, reason)`` when the engine does not report it.
    """
    infos = [s.labels for s in samples if s.name == "vllm:cache_config_info"]
    if not infos:
        return None, "the engine's /metrics has no vllm:cache_config_info"
    total, srcs = 0, set()
    for lab in infos:  # one per data-parallel engine; each holds its own requests
        kv = lab.get("kv_cache_size_tokens", "None")
        if kv not in ("", "None"):
            total += int(float(kv))
            srcs.add("vllm:cache_config_info kv_cache_size_tokens")
            continue
        blocks, bs = lab.get("num_gpu_blocks", "None"), lab.get("block_size", "None")
        if blocks in ("", "None") or bs in ("", "None"):
            return None, "vllm:cache_config_info has neither kv_cache_size_tokens nor num_gpu_blocks"
        total += int(float(blocks)) * int(float(bs))
        srcs.add("vllm:cache_config_info num_gpu_blocks x block_size")
    return total, " + ".join(sorted(srcs))


async def fetch_metrics(client: httpx.AsyncClient) -> list[Sample] | None:
    """``GET /metrics`` parsed, or None if the endpoint has none (not every server exposes it)."""
    try:
        r = await client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse_prometheus(r.text)


async def engine_info(client: httpx.AsyncClient) -> dict:
    """``{"model", "max_model_len", "version"}`` from ``/v1/models`` and ``/version``.

    ``model`` is the first served model id; ``max_model_len`` (tokens) and ``version`` are None
    when the server does not say. Raises :class:`httpx.HTTPError` if ``/v1/models`` fails: an
    endpoint that cannot list its models is not benchmarkable.
    """
    r = await client.get("/v1/models", timeout=10)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise httpx.HTTPStatusError("/v1/models lists no model", request=r.request, response=r)
    info = {"model": data[0]["id"], "max_model_len": data[0].get("max_model_len"), "version": None}
    try:
        v = await client.get("/version", timeout=5)
        if v.status_code == 200:
            info["version"] = v.json().get("version")
    except (httpx.HTTPError, ValueError):
        pass
    return info
