"""`push` and the pull `up` does, to and from a directory remote, sealed vs not, in one run:
the cost of sealing (AES-256-GCM per object, docs/store-format.md "Sealed stores").

Takes the newest snapshot of a local store (``--store``, e.g. the home of a ``warmctl snapshot
tiny``) and, per round and per mode (plain, sealed, alternating), pushes it to an empty remote
directory, then pulls it back into an empty local store (every chunk verified: what ``up`` does
before it writes the image)::

    python benchmarks/sealed_transfer.py --store /var/lib/warmctl/store --rounds 3

Prints one JSON document: the snapshot's stored bytes, and per mode the push and pull seconds
of each round with their median.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True, help="local store holding the snapshot")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sealed-bench-") as tmp:
        t = Path(tmp)
        key = t / "fleet.key"
        key.write_text(base64.b64encode(os.urandom(32)).decode())
        key.chmod(0o600)
        (t / "config.toml").write_text(f'seal_key = "{key}"\n')
        os.environ["WARMCTL_CONFIG"] = str(t / "config.toml")
        from warmctl.naming.catalog import Catalog, Ref
        from warmctl.naming.fleet import entries_to_copy, transfer
        from warmctl.records.config import load_settings
        from warmctl.store import open_backend, open_store
        from warmctl.store.sealed import load_key, seal_store

        st = load_settings()  # this benchmark is an edge: seal_key from the config file above
        src = open_store(a.store, settings=st)
        cat = Catalog(src)
        newest = max(((n, tg, e) for n in cat.names() for tg in cat.tags(n) for e in cat.entries(n, tg)),
                     key=lambda x: x[2].created)
        ref = Ref(name=newest[0], tag=newest[1])
        stored = sum(o.size for o in src.backend.list("chunks/"))
        out: dict = {"snapshot": f"{ref.name}:{ref.tag}", "local_store_chunk_bytes": stored, "rounds": a.rounds}
        times: dict[str, dict[str, list[float]]] = {m: {"push": [], "pull": []} for m in ("plain", "sealed")}
        for r in range(a.rounds):
            for mode in ("plain", "sealed") if r % 2 == 0 else ("sealed", "plain"):
                remote, back = t / f"remote-{mode}-{r}", t / f"back-{mode}-{r}"
                if mode == "sealed":
                    seal_store(open_backend(remote, unseal=False), load_key(key))
                dst = open_store(remote, settings=st)
                t0 = time.perf_counter()
                transfer(src, dst, entries_to_copy(src, ref))
                times[mode]["push"].append(time.perf_counter() - t0)
                dst.close()
                rem, loc = open_store(remote, settings=st), open_store(back, settings=st)
                t0 = time.perf_counter()
                transfer(rem, loc, entries_to_copy(rem, ref))
                times[mode]["pull"].append(time.perf_counter() - t0)
                rem.close()
                loc.close()
                shutil.rmtree(remote)
                shutil.rmtree(back)
        for mode, d in times.items():
            out[mode] = {k: {"seconds": [round(x, 3) for x in v], "median_s": round(statistics.median(v), 3)}
                         for k, v in d.items()}
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
