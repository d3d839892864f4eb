"""Measure the store's format parameters: digest, zstd level, chunk size (docs/benchmarks.md).

Prints, for CRIU-like synthetic pages (benchmarks/store_payload.py) or real image files:

1. digest throughput per core (SHA-256 vs BLAKE3, one thread) on 4 MiB buffers;
2. zstd level vs ratio and per-core compress/decompress throughput on non-zero chunks;
3. chunk size vs dedup: bytes a second dump of the same profile (3% pages rewritten) and a
   second profile of the same model (KV cache of another size: later pages shift) must add to
   a store already holding the first; fixed-size chunks vs page-aligned content-defined chunks.

Usage: ``python benchmarks/store_params.py [--size-mib 256] [--real DIR]``
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import blake3
import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).parent))
from store_payload import PAGE, generate, mutate, reshape  # noqa: E402

MiB = 1 << 20


def rate(fn, data: bytes, min_s: float = 0.5) -> float:
    """bytes/s of ``fn(data)`` on one thread."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn(data)
        n += len(data)
    return n / (time.perf_counter() - t0)


def fixed_chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def cdc_chunks(data: bytes, avg: int) -> list[bytes]:
    """Page-aligned content-defined chunks: cut after a page whose hash % (avg/PAGE) == 0."""
    per = max(1, avg // PAGE)
    pages = np.frombuffer(data[: len(data) // PAGE * PAGE], dtype=np.uint64).reshape(-1, PAGE // 8)
    # a cheap page fingerprint: sum of a few words mixed (enough to place boundaries)
    fp = (pages[:, ::37].sum(axis=1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    fp = np.where(pages.any(axis=1), fp, np.uint64(1))  # never cut inside zero runs
    cuts = np.nonzero(fp % np.uint64(per) == 0)[0] + 1
    out, prev = [], 0
    for c in list(cuts) + [len(data) // PAGE]:
        c *= PAGE
        while c - prev > 4 * avg:  # cap chunk size at 4x average
            out.append(data[prev : prev + 4 * avg])
            prev += 4 * avg
        if c > prev:
            out.append(data[prev:c])
            prev = c
    if prev < len(data):
        out.append(data[prev:])
    return out


def new_bytes(base: bytes, other: bytes, chunker) -> tuple[int, int]:
    """(non-zero bytes of ``other`` not already in ``base``'s chunks, non-zero bytes of other)."""
    have = {hashlib.sha1(c).digest() for c in chunker(base)}
    new = total = 0
    for c in chunker(other):
        if c.count(0) == len(c):
            continue
        total += len(c)
        if hashlib.sha1(c).digest() not in have:
            new += len(c)
    return new, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256, help="synthetic image size (MiB)")
    ap.add_argument("--real", type=Path, help="also measure compression on these real image files (a directory)")
    a = ap.parse_args()

    buf = np.random.default_rng(0).bytes(4 * MiB)
    print("## digest throughput, one thread, 4 MiB buffers")
    for name, fn in [
        ("sha256", lambda b: hashlib.sha256(b).digest()),
        ("blake3", lambda b: blake3.blake3(b, max_threads=1).digest()),
    ]:
        print(f"{name:8s} {rate(fn, buf) / 1e9:6.2f} GB/s")

    with tempfile.TemporaryDirectory(dir="/tmp") as td:
        d = Path(td)
        regions = generate(d / "a.img", a.size_mib * MiB, seed=1)
        mutate(d / "a.img", d / "b.img", 0.03)
        reshape(regions, d / "c.img", seed=1)
        A, B, C = ((d / f).read_bytes() for f in ("a.img", "b.img", "c.img"))

        samples = [("synthetic", A)]
        if a.real:
            real = b"".join(p.read_bytes() for p in sorted(a.real.glob("pages-*.img")))
            samples.append((f"real {a.real}", real))
        for label, data in samples:
            nz = [c for c in fixed_chunks(data, 4 * MiB) if c.count(0) != len(c)]
            zero_share = 1 - sum(map(len, nz)) / len(data)
            print(f"\n## zstd on {label}: {len(data) / MiB:.0f} MiB, {zero_share:.0%} in all-zero 4 MiB chunks (not compressed)")
            print("level  ratio(non-zero)  compress MB/s/core  decompress MB/s/core")
            sample = b"".join(nz[: max(1, 64 * MiB // (4 * MiB))])
            for level in (-1, 1, 3, 6):
                cc = zstandard.ZstdCompressor(level=level)
                dc = zstandard.ZstdDecompressor()
                comp = [cc.compress(c) for c in fixed_chunks(sample, 4 * MiB)]
                ratio = len(sample) / sum(map(len, comp))
                crate = rate(lambda s: [cc.compress(c) for c in fixed_chunks(s, 4 * MiB)], sample, 0.3)
                drate = rate(lambda s: [dc.decompress(c) for c in comp], sample, 0.3)
                print(f"{level:5d}  {ratio:15.2f}  {crate / 1e6:18.0f}  {drate / 1e6:20.0f}")

        print(f"\n## chunking vs dedup ({a.size_mib} MiB image; share of the second image's non-zero bytes that are new)")
        print("chunker           same profile (3% pages dirty)   other profile (shifted)   chunks in A")
        for label, chunker in [
            ("fixed 1 MiB", lambda x: fixed_chunks(x, MiB)),
            ("fixed 4 MiB", lambda x: fixed_chunks(x, 4 * MiB)),
            ("fixed 16 MiB", lambda x: fixed_chunks(x, 16 * MiB)),
            ("page-CDC 1 MiB", lambda x: cdc_chunks(x, MiB)),
            ("page-CDC 4 MiB", lambda x: cdc_chunks(x, 4 * MiB)),
        ]:
            nb, tb = new_bytes(A, B, chunker)
            nc, tc = new_bytes(A, C, chunker)
            print(f"{label:16s}  {nb / tb:28.1%}   {nc / tc:23.1%}   {len(chunker(A)):10d}")


if __name__ == "__main__":
    main()
