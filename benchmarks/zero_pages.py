"""A raw ``criu restore`` of the ``tiny`` image as CRIU wrote it against the same image with its
all-zero anonymous pages left out (:mod:`warmctl.checkpoint.zeropages`, what ``snapshot`` does
under the default ``zero_pages = "drop"``): time to the first *correct* token.

The snapshot is made once with ``zero_pages = "keep"`` (a cold start; ``--keep-home`` keeps it
for later runs). Each round writes two fresh copies of its image from the store, as ``up`` writes
an image it does not keep: **keep** as stored, and **drop**, the same then compacted (timed
apart: what ``snapshot`` adds). Then, the order alternating per round (the host is shared: the
ratio of medians is the result): each copy restored once while fresh (the first restore of a
freshly written copy: on this project's VMs the slow one, docs/benchmarks.md, "Where a restore's
seconds go on this VM"), then each once more (a repeat of the same copy). Each restore is timed
from ``criu restore`` to the first token on the engine port, which must equal the canary's first
token (the restored engine computes right); ``/proc/vmstat``'s page faults and page allocations
during each restore are printed beside it.

Usage (under the engine lock, with the caller's ports)::

    flock /tmp/warmctl-engine.lock env WARMCTL_TEST_ENGINE_PORT=E WARMCTL_TEST_GATE_PORT=G \\
        python benchmarks/zero_pages.py [--rounds 3] [--keep-home DIR] [--json FILE]

Leaves nothing behind: each restored tree is killed and its ``/dev/shm`` files removed by inode,
the copies are removed, and the work directory unless ``--keep-home`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from up_vs_raw import first_token, kill_raw, put_back_shm, wc  # noqa: E402


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            out[k] = int(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep-home", type=Path, default=None, help="reuse/keep this work dir (its snapshot)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds of pause after each restore")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    a = ap.parse_args()
    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-zeropages-"))
    try:
        run(a, root)
    finally:
        if a.keep_home is None:
            shutil.rmtree(root, ignore_errors=True)


def run(a, root: Path) -> None:
    from tests.conftest import isolated_env

    eport = int(os.environ.get("WARMCTL_TEST_ENGINE_PORT", "18000"))
    gport = int(os.environ.get("WARMCTL_TEST_GATE_PORT", "8000"))
    env = {**isolated_env(root, eport, gport), "WARMCTL_ZERO_PAGES": "keep"}
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]

    from warmctl.checkpoint import criu, zeropages
    from warmctl.engine.run import EngineRun
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    settings = load_settings()
    store = open_store(settings.store_dir)
    if Catalog(store).newest("tiny") is None:
        print("making the snapshot once (warmctl snapshot tiny, zero_pages = keep) ...", flush=True)
        wc(env, "snapshot", "tiny", "--quiet")
    m = store.get_manifest(Catalog(store).newest("tiny"))
    if "zero_pages" in {p.name for p in m.phases}:
        raise SystemExit(f"{root}: its tiny snapshot was made with zero_pages = drop; use another --keep-home")
    prompt, expected = m.canary.completions[0].prompt, m.canary.completions[0].token_ids[0]
    model = m.profile["engine"]["served_model_name"]
    EngineRun(settings.run_dir, "tiny", 0, log_path=m.restore.log_path, cwd=m.restore.cwd).prepare().log_path.touch()

    def write_copy(dst: Path) -> None:
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for f in m.files:
            if f.role == "image":
                if f.hardlink_to is not None:
                    os.link(dst / f.hardlink_to, dst / f.path)
                else:
                    store.read_file(f.chunks, dst / f.path)
                    os.chmod(dst / f.path, f.mode)
        subprocess.run(["sync"], check=True)

    def restore(images: Path) -> dict:
        v0 = vmstat()
        root_pid, inodes = None, []
        try:
            with criu.host_lock():
                inodes = put_back_shm(store, m)
                if m.restore.tmp_dir:
                    Path(m.restore.tmp_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
                t0 = time.monotonic()
                root_pid, secs = criu.restore(images, root / "engine.pid", log_file=root / "restore.log",
                                              binary=settings.criu)
            v1 = vmstat()
            tok, t1 = first_token(m.restore.internal_port or eport, prompt, model)
        finally:
            kill_raw(root_pid, inodes)
            if m.restore.tmp_dir:
                shutil.rmtree(m.restore.tmp_dir, ignore_errors=True)
        assert tok == expected, f"restored engine's first token {tok} != the canary's {expected}"
        time.sleep(a.gap)
        return {"s": t1 - t0, "criu_s": secs, "pgfault": v1["pgfault"] - v0["pgfault"],
                "pgalloc": v1["pgalloc_normal"] - v0["pgalloc_normal"]}

    res: dict[str, list] = {k: [] for k in ("keep first", "drop first", "keep again", "drop again")}
    compact_s, dropped = [], None
    keep, drop = root / "copy-keep", root / "copy-drop"
    try:
        for r in range(a.rounds):
            write_copy(keep)
            write_copy(drop)
            t = time.monotonic()
            c = zeropages.compact(drop)
            compact_s.append(time.monotonic() - t)
            dropped = c
            order = [("keep", keep), ("drop", drop)] if r % 2 == 0 else [("drop", drop), ("keep", keep)]
            for when in ("first", "again"):
                for name, d in order:
                    x = restore(d)
                    res[f"{name} {when}"].append(x)
                    print(f"round {r}: {name:<4} {when:<5} first correct token {x['s']:6.2f} s (criu restore "
                          f"{x['criu_s']:.2f} s), page faults {x['pgfault']}, pages allocated {x['pgalloc']}", flush=True)
            print(f"round {r}: compacting the drop copy took {compact_s[-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(keep, ignore_errors=True)
        shutil.rmtree(drop, ignore_errors=True)

    assert dropped is not None
    med = {k: statistics.median(x["s"] for x in v) for k, v in res.items()}
    print(f"\n{dropped.dropped} of {dropped.pages} pages all zero, left out ({dropped.bytes_dropped / 2**30:.2f} GiB); "
          f"compaction median {statistics.median(compact_s):.2f} s")
    print("medians over %d rounds: " % a.rounds + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()))
    print(f"keep/drop: first restore of a fresh copy {med['keep first'] / med['drop first']:.2f}x, "
          f"a repeat {med['keep again'] / med['drop again']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"results": res, "compact_s": compact_s, "pages": dropped.pages,
                                      "dropped": dropped.dropped}, indent=1))


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
