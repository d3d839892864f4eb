"""The secret scan's speed against reading the same files: ``snapshot`` searches every
byte it is about to store for every secret value warmctl knows (:mod:`warmctl.records.credentials`);
this measures that search in GiB/s beside ``cat FILES > /dev/null`` of the same files, in one
run, both with the files in the page cache (each is read once first, so both sides read memory,
not the disk: the scan's own cost), and the ratio scan/cat of each round (the two timed back to
back, so a busy machine slows both).

The files: ``--dir DIR`` (e.g. a CRIU image directory), or the newest snapshot of a store
(``--store DIR``; its image, ``/dev/shm`` and bundled files are written to a temporary
directory first, as ``up`` would materialize them)::

    python benchmarks/secret_scan.py --store /var/lib/warmctl/store --secrets 1 8 64 --rounds 3

Each round times ``cat`` once and the scan once per ``--secrets`` count, ``--workers`` count
and ``--engines`` matcher (``hyperscan``: one pass for all the secrets, what ``snapshot`` uses
where the package is installed; ``bytes.find``: one pass per secret, the fallback and the scan
before it) on random values of 20 to 40 bytes, none present, so every byte is searched: the
worst case. Prints one JSON document: bytes, files, usable CPUs, and per count the best and
median GiB/s of ``cat`` and of each scan, and the median ratio scan/cat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from warmctl.records import credentials  # noqa: E402
from warmctl.records.credentials import Secret, scan_files, scan_workers  # noqa: E402


def materialize(store_dir: Path, out: Path) -> list[Path]:
    """The newest snapshot of ``store_dir``'s files, written under ``out``."""
    from warmctl.store import open_store

    store = open_store(store_dir)
    digests = store.list_manifests()
    if not digests:
        raise SystemExit(f"no snapshot in {store_dir}")
    m = max((store.get_manifest(d) for d in digests), key=lambda m: m.created)
    paths = []
    for f in m.files:
        if f.hardlink_to:
            continue
        dest = out / f.path.replace("/", "_")
        store.read_file(f.chunks, dest)
        paths.append(dest)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dir", type=Path, help="scan the files in this directory")
    src.add_argument("--store", type=Path, help="scan the newest snapshot of this store")
    ap.add_argument("--secrets", type=int, nargs="+", default=[1, 8, 64], help="secret counts to time")
    ap.add_argument("--engines", nargs="+", default=[credentials.scan_engine()], choices=["hyperscan", "bytes.find"],
                    help="matchers to time (default: the one snapshot uses here)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 0],
                    help="scan processes to time (0: one per usable CPU)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="secret-scan-") as tmp:
        files = (sorted(p for p in a.dir.iterdir() if p.is_file()) if a.dir else materialize(a.store, Path(tmp)))
        total = sum(p.stat().st_size for p in files)
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)  # into the page cache
        cpus = len(os.sched_getaffinity(0))
        workers = list(dict.fromkeys(w or cpus for w in a.workers))
        cols = [(e, w, f"{e}_{w}_workers") for e in a.engines for w in workers]
        rows: dict[str, dict[str, list[float]]] = {str(k): {"cat": [], **{c: [] for _, _, c in cols}} for k in a.secrets}
        ratios: dict[str, dict[str, list[float]]] = {str(k): {c: [] for _, _, c in cols} for k in a.secrets}
        real_engine = credentials.scan_engine
        for _ in range(a.rounds):
            for k in a.secrets:
                secrets = [Secret(f"s{i}", os.urandom(10 + i % 11).hex().encode()) for i in range(k)]
                for e, w, c in cols:
                    t0 = time.perf_counter()
                    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
                    cat_s = time.perf_counter() - t0
                    rows[str(k)]["cat"].append(cat_s)
                    credentials.scan_engine = (lambda e=e: e) if e == "bytes.find" else real_engine
                    t0 = time.perf_counter()
                    found, n = scan_files([(p, p.name) for p in files], secrets, workers=w)
                    scan_s = time.perf_counter() - t0
                    credentials.scan_engine = real_engine
                    rows[str(k)][c].append(scan_s)
                    ratios[str(k)][c].append(cat_s / scan_s)
                    assert n == total and not found
        gib = total / 2**30

        def rate(ts: list[float]) -> dict[str, float]:
            return {"best_gib_s": round(gib / min(ts), 2), "median_gib_s": round(gib / statistics.median(ts), 2)}

        print(json.dumps({"bytes": total, "files": len(files), "rounds": a.rounds, "cpus": cpus, "default_workers": scan_workers(),
                          "default_engine": real_engine(),
                          "by_secret_count": {k: {name: rate(ts) for name, ts in v.items()} for k, v in rows.items()},
                          "scan_over_cat_median": {k: {c: round(statistics.median(r), 3) for c, r in v.items()}
                                                   for k, v in ratios.items()}},
                         indent=2))


if __name__ == "__main__":
    main()
