"""Snapshot-like benchmark payloads made of *real* CRIU page images (docs/benchmarks.md#store).

Three sources of real ``pages-*.img`` files, in order of preference for a run:

- an existing CRIU image directory (``--criu-image DIR``, e.g. a materialized snapshot);
- a snapshot in a local warmctl store (``--from-store DIR``): its CRIU image files are
  materialized with ``Store.read_file``;
- by default, a fresh dump: :func:`dump_sample_process` starts a Python process that imports
  torch and numpy, fills ``weights_mib`` of bf16 "model" tensors (normal values with a
  per-tensor scale, like trained weights) and ``heap_mib`` of Python objects (dicts, strings,
  ints, lists, like a scheduler's and tokenizer's state), and CRIU-dumps it.

:func:`build_payload` then writes a file of ``size`` bytes that alternates runs of those real
pages (cut at random page-multiple lengths, read in order and wrapped around) with zero regions
(cleared KV cache / arenas), so that ``zero_share`` of the file is zero regions. Written out in
full (not sparse): it is the file a user would otherwise copy.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096

_CHILD = r"""
import gc, os, random, sys, time
import numpy as np
import torch
weights_mib, heap_mib, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
params = []
left = weights_mib << 20
i = 0
while left > 0:  # layers of a few shapes, bf16, scaled like trained weights
    rows, cols = [(4096, 1024), (1024, 1024), (2816, 1024), (1024, 2816)][i % 4]
    n = min(left // 2, rows * cols)
    params.append((torch.randn(n, dtype=torch.float32) * (0.02 + 0.01 * (i % 5))).to(torch.bfloat16))
    left -= 2 * n
    i += 1
norms = [torch.ones(1024, dtype=torch.float32) + torch.randn(1024) * 0.05 for _ in range(64)]
rng = random.Random(0)
words = ("the of and to in is was for on that with as by at from his her it an were are which "
         "this be or has had but not their have one all new first two after who also they more "
         "request prompt token block cache seq_id sampling logprob attention").split()
heap = []
size = 0
while size < heap_mib << 20:  # request/tokenizer-like objects
    d = {"request_id": "cmpl-%016x" % rng.getrandbits(64), "prompt": " ".join(rng.choices(words, k=rng.randint(8, 64))),
         "token_ids": [rng.randint(0, 151935) for _ in range(rng.randint(16, 256))],
         "logprobs": [rng.random() for _ in range(8)], "block_table": list(range(rng.randint(1, 32)))}
    heap.append(d)
    size += 64 + len(d["prompt"]) + 36 * len(d["token_ids"]) + 32 * 8 + 36 * len(d["block_table"])
vocab = {("tok%d" % k) + rng.choice(words): k for k in range(150000)}
arr = np.cumsum(np.ones(4 << 20, dtype=np.int64))  # index arrays, position ids
gc.collect()
open(ready, "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""


def dump_sample_process(workdir: Path, weights_mib: int = 768, heap_mib: int = 96, timeout: float = 600) -> Path:
    """Start the sample process, CRIU-dump it (it is killed by the dump) into
    ``workdir/criu-img``; returns that directory."""
    from warmctl.checkpoint import criu

    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "child.ready"
    ready.unlink(missing_ok=True)
    script = workdir / "child.py"
    script.write_text(_CHILD)
    log = open(workdir / "child.log", "ab")
    p = subprocess.Popen([sys.executable, str(script), str(weights_mib), str(heap_mib), str(ready)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        t0 = time.monotonic()
        while not ready.exists():
            if p.poll() is not None:
                raise RuntimeError(f"sample process exited ({p.returncode}); see {workdir / 'child.log'}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError("sample process did not get ready in time")
            time.sleep(0.2)
        img = workdir / "criu-img"
        with criu.host_lock():
            criu.dump(p.pid, img)
        p.wait(30)
        return img
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()


def pages_in(image_dir: Path) -> list[Path]:
    """The ``pages-*.img`` files of a CRIU image directory (largest first)."""
    files = sorted(Path(image_dir).glob("pages-*.img"), key=lambda p: -p.stat().st_size)
    if not files:
        raise SystemExit(f"no pages-*.img in {image_dir}")
    return files


def pages_from_store(store_dir: Path, out: Path, ref: str | None = None) -> Path:
    """Materialize the ``pages-*.img`` files of a snapshot in the local store ``store_dir``
    (``ref`` ``NAME[:TAG]``, default: the first ``*:latest``) into ``out``; returns ``out``."""
    from warmctl.naming.catalog import Catalog
    from warmctl.store import open_store

    s = open_store(store_dir)
    cat = Catalog(s)
    if ref:
        name, _, tag = ref.partition(":")
        digest = cat.newest(name, tag or "latest")
    else:
        digest = next((e.manifest for e in cat.all_entries() if e.tag == "latest"), None)
    if digest is None:
        raise SystemExit(f"no snapshot {ref or 'NAME:latest'} in the catalog of {store_dir}")
    m = s.get_manifest(digest)
    files = [f for f in m.files if Path(f.path).name.startswith("pages-") and f.path.endswith(".img")]
    if not files:
        raise SystemExit(f"snapshot {digest} in {store_dir} lists no pages-*.img")
    for f in files:
        s.read_file(f.chunks, out / Path(f.path).name)
    return out


@dataclass
class PayloadInfo:
    size: int
    real_bytes: int  # bytes copied from CRIU page images
    zero_bytes: int  # zero regions inserted
    source_bytes: int  # size of the real page images
    passes: float  # how many times the source pages were used (real_bytes / source_bytes)
    zero_pages_in_source: float  # share of all-zero 4 KiB pages inside the CRIU images


def build_payload(sources: list[Path], dest: Path, size: int, zero_share: float = 0.45, seed: int = 1) -> PayloadInfo:
    """Write ``size`` bytes to ``dest``: runs of real CRIU pages from ``sources`` (64 KiB to 32
    MiB, page multiples, taken in order, wrapping around) alternating with zero regions so
    that about ``zero_share`` of the bytes are zero regions. Not sparse."""
    import numpy as np

    r = random.Random(seed)
    src_size = sum(p.stat().st_size for p in sources)
    if src_size < PAGE:
        raise SystemExit("CRIU images hold no pages")
    fds = [os.open(p, os.O_RDONLY) for p in sources]
    sizes = [p.stat().st_size for p in sources]
    zero_pages = 0
    pages = 0
    for fd, n in zip(fds, sizes):  # how much of the real image is itself zero pages
        for off in range(0, n, 64 << 20):
            a = np.frombuffer(os.pread(fd, min(64 << 20, n - off), off), dtype=np.uint64)
            a = a[: len(a) // 512 * 512].reshape(-1, 512)
            zero_pages += int((~a.any(axis=1)).sum())
            pages += a.shape[0]
    src_i, src_off = 0, 0
    real = zero = 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    zbuf = bytes(32 << 20)
    with open(dest, "wb") as f:
        while real + zero < size:
            left = size - real - zero
            want_zero = zero < zero_share * (real + zero)
            n = min(left, PAGE * r.randint(16, 8192))
            if want_zero:
                f.write(zbuf[:n])
                zero += n
                continue
            # n bytes of real pages, in order across the sources
            done = 0
            while done < n:
                fd, fsz = fds[src_i], sizes[src_i]
                k = min(n - done, fsz - src_off)
                data = os.pread(fd, k, src_off)
                f.write(data)
                done += len(data)
                src_off += len(data)
                if src_off >= fsz:
                    src_i = (src_i + 1) % len(fds)
                    src_off = 0
            real += n
    for fd in fds:
        os.close(fd)
    return PayloadInfo(size, real, zero, src_size, real / src_size, zero_pages / max(1, pages))
