"""What keeping no image costs: ``warmctl up`` with the verified image
this node keeps vs ``up`` on a node that keeps none (``image_cache_bytes = 0``), time to the first
*correct* token, interleaved in one run on one snapshot of ``tiny``.

- **kept**: ``warmctl up tiny --json`` on the home that made the snapshot; after the first
  round's up (not counted when its image had to be written: run 0 is a warm-up) it restores
  from the kept image.
- **none**: the same ``up`` with ``WARMCTL_IMAGE_CACHE_BYTES=0`` on a second home that shares the
  first one's store (``WARMCTL_STORE``), so the kept image of the first side is never touched:
  every ``up`` writes the image from the store (every chunk decompressed and verified) into its
  run directory, restores from it and removes it.

Then the first prompt of the canary on the public port, polled until a token comes back, checked
against the canary record. Each side's ``--json`` phase timings are kept; the result is the ratio
of the medians, side by side (the host is shared).

Usage::

    python benchmarks/keep_none.py [--runs 5] [--keep-home DIR] [--gap 2] [--engine-port 18600 --gate-port 18680]
        [--json FILE]

``--keep-home DIR``: a root made by :func:`tests.conftest.isolated_env` (its ``home`` holds the
snapshot; made once when missing). Leaves every engine down; removes the second home.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from up_vs_raw import first_token, wc  # noqa: E402


def side(env: dict, name: str, gate_port: int, prompt: str, model: str, expected: int) -> tuple[float, dict]:
    """One ``up`` + first correct token on ``env``: (seconds, up's phase timings)."""
    t0 = time.monotonic()
    try:
        r = wc(env, "up", name, "--json")
        tok, t1 = first_token(gate_port, prompt, model)
    finally:
        wc(env, "down", name, check=False)
    res = json.loads(r.stdout)
    if res["path"] != "restore":
        raise RuntimeError(f"up took the {res['path']} path, not a restore: {res['reason']}")
    assert tok == expected, f"restored engine's first token {tok} != canary {expected}"
    return t1 - t0, {k: v for k, v in res["timings_s"].items() if k != "total"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="rounds of both sides (default 5), after one warm-up round")
    ap.add_argument("--keep-home", type=Path, default=None, help="reuse/keep this work dir (its snapshot)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds of pause after each engine is down")
    ap.add_argument("--engine-port", type=int, default=18600)
    ap.add_argument("--gate-port", type=int, default=18680)
    ap.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    a = ap.parse_args()
    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-keepnone-"))
    try:
        run_all(a, root)
    finally:
        shutil.rmtree(root / "home-none", ignore_errors=True)
        if a.keep_home is None:
            shutil.rmtree(root, ignore_errors=True)


def run_all(a, root: Path) -> None:
    from tests.conftest import isolated_env

    env = isolated_env(root, a.engine_port, a.gate_port)
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    settings = load_settings()
    store = open_store(settings.store_dir)
    if Catalog(store).newest("tiny") is None:
        print("making the snapshot once (warmctl snapshot tiny) ...", flush=True)
        wc(env, "snapshot", "tiny", "--quiet")
    digest = Catalog(store).newest("tiny")
    m = store.get_manifest(digest)
    store.close()
    prompt, expected = m.canary.completions[0].prompt, m.canary.completions[0].token_ids[0]
    model = m.profile["engine"]["served_model_name"]
    none_env = {**env, "WARMCTL_HOME": str(root / "home-none"), "WARMCTL_STORE": str(settings.store_dir),
                "WARMCTL_IMAGE_CACHE_BYTES": "0"}
    kept, none, kept_ph, none_ph = [], [], [], []
    wc(env, "down", "tiny", check=False)
    for i in range(a.runs + 1):
        t, ph = side(env, "tiny", a.gate_port, prompt, model, expected)
        time.sleep(a.gap)
        tn, phn = side(none_env, "tiny", a.gate_port, prompt, model, expected)
        time.sleep(a.gap)
        left = list((root / "home-none" / "cache" / "images").glob("sha*"))
        assert not left, f"the node keeping no image kept {left}"
        tag = "warm-up" if i == 0 else f"run {i}"
        print(f"{tag}: kept image {t:6.2f} s (materialize {ph.get('materialize', 0):.2f}, restore "
              f"{ph.get('restore', 0):.2f}) | no kept image {tn:6.2f} s (materialize {phn.get('materialize', 0):.2f}, "
              f"restore {phn.get('restore', 0):.2f})", flush=True)
        if i:
            kept.append(t), none.append(tn), kept_ph.append(ph), none_ph.append(phn)
    mk, mn = statistics.median(kept), statistics.median(none)

    def med(phs, k):
        return statistics.median([p.get(k, 0.0) for p in phs])

    print(f"\nmedian over {a.runs} rounds: up with the kept image {mk:.2f} s, keeping no image {mn:.2f} s: "
          f"ratio {mn / mk:.2f}x (+{mn - mk:.2f} s)")
    for k in dict.fromkeys([*kept_ph[0], *none_ph[0]]):
        print(f"  {k:<12} kept {med(kept_ph, k):6.2f} s   none {med(none_ph, k):6.2f} s")
    from warmctl.checkpoint.imagecache import image_bytes

    print(f"snapshot {m.total_size() / 2**30:.2f} GiB logical; the image written per up without a kept one: "
          f"{image_bytes(m) / 2**30:.2f} GiB of non-zero chunks")
    if a.json:
        a.json.write_text(json.dumps({"kept_s": kept, "none_s": none, "kept_phases_s": kept_ph, "none_phases_s": none_ph,
                                      "ratio": mn / mk}, indent=1))


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
