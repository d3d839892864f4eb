"""Page-cache helpers shared by the benchmarks that measure cold reads (``fincore`` from
util-linux, ``posix_fadvise``): how much of some files is cached, and evicting exactly them
(``drop_caches`` would empty the whole host's cache, which other users of a shared machine
share)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def resident(files: list[Path]) -> int:
    """Bytes of ``files`` in the page cache (``fincore``, 500 files per call). Raises
    FileNotFoundError without ``fincore``, CalledProcessError when it fails."""
    total = 0
    for i in range(0, len(files), 500):
        r = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *map(str, files[i:i + 500])],
                           capture_output=True, text=True, check=True)
        total += sum(int(x) for x in r.stdout.split() if x.isdigit())
    return total


def dontneed(files: list[Path]) -> None:
    """``posix_fadvise(DONTNEED)`` on each of ``files``: their clean pages leave the page cache
    (dirty ones stay: ``sync`` first to evict those too)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evict(files: list[Path]) -> None:
    """``sync``, then drop exactly ``files`` from the page cache; exits (SystemExit) naming the
    numbers if more than 1% (+1 MiB) of them stays cached."""
    subprocess.run(["sync"], check=True)
    dontneed(files)
    size = sum(f.stat().st_size for f in files)
    left = resident(files)
    if left > size // 100 + (1 << 20):
        raise SystemExit(f"could not evict: {left >> 20} MiB of {size >> 20} MiB still cached")
