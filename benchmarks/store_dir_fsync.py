"""What the directory fsync of the local store costs (docs/benchmarks.md).

Side by side in one run, interleaved (which goes first alternates), after one warm-up run,
``--rounds`` times (medians printed): the store's own write
paths on a fresh local store with the directory fsync after each rename (what the product does)
and without it (``fsync_dir`` replaced by a no-op; each object's own fsync kept, as before):

  add_file   ingest of a ``--size-mib`` file (random, text and zero regions: read, hash,
             compress, write), 4 MiB chunks
  copy       ``copy_manifest`` of that snapshot into another fresh local store (pull/push)

Usage: ``python benchmarks/store_dir_fsync.py [--size-mib 256] [--rounds 3] [--dir /var/tmp]``
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_store_fixtures import make_manifest, write_payload  # noqa: E402

from warmctl.store import copy_manifest, local, open_store  # noqa: E402


def one(base: Path, payload: Path, dirsync: bool) -> tuple[float, float]:
    real = local.fsync_dir
    if not dirsync:
        local.fsync_dir = lambda p: None
    try:
        src, dst = base / "src", base / "dst"
        t0 = time.perf_counter()
        with open_store(src) as s:
            d = s.put_manifest(make_manifest(s, "bench", {"p.img": payload}))
        t1 = time.perf_counter()
        with open_store(src) as s, open_store(dst) as t:
            copy_manifest(s, t, d)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1
    finally:
        local.fsync_dir = real
        shutil.rmtree(base / "src", ignore_errors=True)
        shutil.rmtree(base / "dst", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="warmctl-dirsync-", dir=a.dir))
    try:
        mib = 1 << 20
        third = a.size_mib // 3 * mib
        payload = write_payload(base / "payload.img", [("random", third), ("text", third), ("zero", a.size_mib * mib - 2 * third)])
        res: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        one(base, payload, True)  # warm-up (page cache of the payload, first allocations), not counted
        for r in range(a.rounds):
            for ds in ((False, True) if r % 2 == 0 else (True, False)):  # alternate which goes first
                res[ds].append(one(base, payload, ds))
        print(f"{a.size_mib} MiB payload, {a.rounds} rounds, medians (s):")
        for i, what in enumerate(("add_file", "copy")):
            off = statistics.median(r[i] for r in res[False])
            on = statistics.median(r[i] for r in res[True])
            print(f"  {what:9s} file fsync only {off:6.2f}   + dir fsync {on:6.2f}   ratio {on / off:.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
