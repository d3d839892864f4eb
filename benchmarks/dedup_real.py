"""Dedup between two real snapshots in a local store, per file role and per chunker.

For two snapshots (e.g. two ``warmctl snapshot`` runs of one profile), materializes the CRIU
``pages-*.img`` files of each (concatenated in name order) and reports which share of the
second's non-zero bytes is new to a store holding the first, for: the store's own chunks as
stored (fixed 4 MiB), fixed 1 MiB, page-aligned content-defined chunking (avg 1 and 4 MiB, the
chunker of ``store_params.py``), and single 4 KiB pages (the upper bound of any chunker). Also
the store's own answer for every role (image, shm, weights, file).

    python benchmarks/dedup_real.py STORE NAME:TAG NAME:TAG
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_params import PAGE, cdc_chunks, fixed_chunks, new_bytes  # noqa: E402

from warmctl.store import chunks as ck  # noqa: E402
from warmctl.store import open_store  # noqa: E402


def pages_of(store, manifest, work: Path) -> bytes:
    out = bytearray()
    for f in sorted((f for f in manifest.files if f.role == "image" and f.path.startswith("pages-")), key=lambda f: f.path):
        dest = work / f.path
        store.read_file(f.chunks, dest)
        out += dest.read_bytes()
        dest.unlink()
    return bytes(out)


def page_chunks(data: bytes) -> list[bytes]:
    return fixed_chunks(data, PAGE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("first")
    ap.add_argument("second")
    a = ap.parse_args()
    st = open_store(a.store)
    ms = []
    for ref in (a.first, a.second):
        name, _, tag = ref.partition(":")
        ms.append(st.get_manifest(st.resolve(name, tag or "latest")))

    print("as stored (fixed 4 MiB chunks), share of the second's non-zero bytes already in the first:")
    for role in ("image", "shm", "weights", "file"):
        have = {c.digest for f in ms[0].files if f.role == role for c in f.chunks}
        refs = [c for f in ms[1].files if f.role == role for c in f.chunks if not ck.is_zero_chunk(c.digest, c.size)]
        tot = sum(c.size for c in refs)
        shared = sum(c.size for c in refs if c.digest in have)
        if tot:
            print(f"  {role:8} {tot / 2**20:9.1f} MiB non-zero, {shared / tot:6.1%} shared")

    with tempfile.TemporaryDirectory(prefix="warmctl-dedup-") as tmp:
        base, other = (pages_of(st, m, Path(tmp)) for m in ms)
    print(f"CRIU pages images: {len(base) / 2**20:.0f} MiB and {len(other) / 2**20:.0f} MiB")
    chunkers = [("fixed 4 MiB", lambda d: fixed_chunks(d, 4 << 20)), ("fixed 1 MiB", lambda d: fixed_chunks(d, 1 << 20)),
                ("CDC avg 4 MiB", lambda d: cdc_chunks(d, 4 << 20)), ("CDC avg 1 MiB", lambda d: cdc_chunks(d, 1 << 20)),
                ("4 KiB pages (bound)", page_chunks)]
    for label, fn in chunkers:
        new, tot = new_bytes(base, other, fn)
        print(f"  {label:20} new {new / 2**20:8.1f} of {tot / 2**20:8.1f} MiB non-zero = {new / max(tot, 1):6.1%} new")
    print("pages identical at the same offset:", f"{sum(base[i:i + PAGE] == other[i:i + PAGE] for i in range(0, min(len(base), len(other)), PAGE)) * PAGE / max(len(other), 1):.1%}")


if __name__ == "__main__":
    main()
