"""Synthetic CRIU-like page images for the store benchmarks.

A CRIU ``pages-N.img`` is the concatenation of the dumped pages (4 KiB) of each VMA in address
order. A warmed vLLM engine's image is mostly: zero pages (KV cache and arenas that were
allocated and cleared, ~60%), weight-like float pages (high entropy mantissas, clustered
exponents: compress ~10-20%), and heap pages (Python objects, strings, pointers: compress 3-5x).
:func:`generate` writes such a file with regions of random page-multiple lengths, deterministic
for a seed; :func:`mutate` derives a "second dump of the same profile" (a few % of pages
rewritten in place) and :func:`reshape` a "second profile of the same model" (same weights,
different KV cache size: everything after it shifts by whole pages).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np

PAGE = 4096
#: (kind, share of bytes)
MIX = (("zero", 0.60), ("weights", 0.25), ("heap", 0.15))
_WORDS = np.frombuffer(
    b"torch.Tensor cuda kv_cache block_table req_id prompt_token_ids sampling_params "
    b"__dict__ <module> PyObject* 0x7f3a2c000000 llama attention rotary_emb model.layers.",
    dtype=np.uint8,
)


def _weights(rng: np.random.Generator, n: int) -> bytes:
    """bf16-like values: random mantissa, exponent bits from a narrow range."""
    v = rng.integers(0, 2**16, size=n // 2, dtype=np.uint16)
    v = (v & 0x807F) | (rng.integers(0x3C, 0x40, size=n // 2, dtype=np.uint16) << 7)
    return v.tobytes()


def _heap(rng: np.random.Generator, n: int) -> bytes:
    """Heap-like: text fragments, small ints and 8-byte pointers into a few arenas."""
    out = np.empty(n, dtype=np.uint8)
    idx = rng.integers(0, len(_WORDS) - 64, size=n // 64)
    lines = _WORDS[idx[:, None] + np.arange(48)]
    ptr = (0x7F3A2C000000 + rng.integers(0, 1 << 20, size=(n // 64, 2)) * 16).astype("<u8").view(np.uint8)
    out[: (n // 64) * 64] = np.concatenate([lines, ptr], axis=1).reshape(-1)
    return out.tobytes()


def region(kind: str, n: int, rng: np.random.Generator) -> bytes:
    if kind == "zero":
        return bytes(n)
    if kind == "weights":
        return _weights(rng, n)
    if kind == "heap":
        return _heap(rng, n)
    if kind == "random":
        return rng.bytes(n)
    raise ValueError(kind)


def plan(size: int, seed: int) -> list[tuple[str, int]]:
    """Regions (kind, bytes, page multiples) adding up to ``size`` with shares from :data:`MIX`."""
    r = random.Random(seed)
    out = []
    left = size
    while left > 0:
        kind = r.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
        n = min(left, PAGE * r.randint(16, 8192))  # 64 KiB .. 32 MiB
        out.append((kind, n))
        left -= n
    return out


def generate(path: Path, size: int, seed: int = 1, regions: list[tuple[str, int]] | None = None) -> list[tuple[str, int]]:
    """Write ``size`` bytes of CRIU-like pages to ``path``; returns the region plan used."""
    rng = np.random.default_rng(seed)
    regions = regions or plan(size, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for kind, n in regions:
            for off in range(0, n, 64 << 20):
                f.write(region(kind, min(64 << 20, n - off), rng))
    return regions


def mutate(src: Path, dst: Path, fraction: float = 0.03, seed: int = 2) -> None:
    """Copy ``src`` to ``dst`` rewriting ``fraction`` of its pages in place (heap churn)."""
    rng = np.random.default_rng(seed)
    data = bytearray(src.read_bytes())
    pages = len(data) // PAGE
    # dirty pages come in runs (an object graph, a few KV blocks): runs of 1..64 pages
    dirty = 0
    while dirty < fraction * pages:
        start = int(rng.integers(0, pages))
        run = int(rng.integers(1, 65))
        end = min(pages, start + run)
        data[start * PAGE : end * PAGE] = _heap(rng, (end - start) * PAGE)
        dirty += end - start
    dst.write_bytes(bytes(data))


def reshape(src_regions: list[tuple[str, int]], dst: Path, seed: int = 1, kv_delta_pages: int = 12345) -> None:
    """Same seed and regions as the source but the first zero region grows by
    ``kv_delta_pages`` pages: every byte after it shifts (a different KV cache size)."""
    regions = list(src_regions)
    for i, (k, n) in enumerate(regions):
        if k == "zero":
            regions[i] = (k, n + kv_delta_pages * PAGE)
            break
    generate(dst, sum(n for _, n in regions), seed=seed, regions=regions)


if __name__ == "__main__":  # pragma: no cover
    import sys

    p = Path(sys.argv[1])
    generate(p, int(float(sys.argv[2]) * 2**20))
    print(p, os.path.getsize(p))
