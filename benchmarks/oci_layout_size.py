"""Sizes of the OCI layout (docs/store-format.md, section 8) for a snapshot of a given size, from
the functions the backend writes them with (warmctl.store.oci.snapshot_artifact, pack_index).

    .venv/bin/python benchmarks/oci_layout_size.py --gib 647 --pack-gib 1

Assumes the worst case for the count of packs: every 4 MiB chunk non-zero and incompressible
(each stored chunk ~4 MiB), so ``gib`` GiB fill ``gib / pack-gib`` packs. Prints the chunk and pack
counts, the OCI manifest's bytes (against the 4 MiB limit registries apply) and one pack index's.
"""

from __future__ import annotations

import argparse
import hashlib
import json

from warmctl.store.oci import pack_index, snapshot_artifact


def fake(i: int, algo: str = "sha256") -> str:
    return f"{algo}:" + hashlib.sha256(str(i).encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=647.0)
    ap.add_argument("--pack-gib", type=float, default=1.0)
    a = ap.parse_args()
    chunk = 4 << 20
    chunks = int(a.gib * (1 << 30) // chunk)
    per_pack = int(a.pack_gib * (1 << 30) // (chunk + 64))  # a zstd frame of random data: ~4 MiB + header
    packs = -(-chunks // per_pack)
    idx = pack_index(fake(0), "2026-12-01T00:00:00.000000Z", {fake(i, "blake3"): (i * (chunk + 64), chunk + 64) for i in range(per_pack)})
    doc = snapshot_artifact(fake(1), 15 << 20, "seed-000", "2026-12-01T00:00:00.000000Z",
                            [(fake(10 + i), per_pack * (chunk + 64), fake(10_000_000 + i), len(idx)) for i in range(packs)])
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    print(f"{a.gib:g} GiB: {chunks:,} chunks of 4 MiB in {packs:,} packs of {per_pack} chunks (<= {a.pack_gib:g} GiB)")
    print(f"OCI manifest: {len(doc['layers']):,} layers, {len(body):,} bytes ({len(body) / (4 << 20):.1%} of the 4 MiB limit)")
    print(f"pack index: {len(idx):,} bytes per pack, {len(idx) * packs:,} bytes in all")


if __name__ == "__main__":
    main()
