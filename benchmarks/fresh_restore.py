"""Why a fresh node's CRIU restore is slower than a warm node's: a raw ``criu restore`` of an
image materialized seconds before, against the same restore after ``sync``, after the image's
files were dropped from the page cache, and of a warm node's kept image, interleaved.

Node A's home (``--keep-home``; the ``tiny`` snapshot is made there once if missing, under the
caller's engine lock) pushes the snapshot to a directory remote. A warm node materializes it
once into its kept image (then ``sync``: its pages are clean and in the page cache). Each round
runs every variant, the order rotated by one per round (the host is shared: the ratios of medians
are the result):

- ``now``: a fresh node (empty local store) materializes the image from the remote as ``up`` does
  (:meth:`warmctl.checkpoint.imagecache.ImageCache.get` with the local store as the read cache),
  and the restore starts right after, as ``up``'s does;
- ``deferred``: the same, but the local store's commit (the fsyncs of the fetched chunk objects)
  is left pending across the restore and committed after it (only with a checkout whose
  ``ImageCache.get`` takes ``fill=``);
- ``sync``: the same as ``now``, then ``sync`` (timed apart), then the restore;
- ``drop``: ``sync``, then every image file dropped from the page cache
  (``posix_fadvise(DONTNEED)``, checked with ``fincore``): the restore reads it from the disk;
- ``preread``: the same as ``now``, then every image file read once (timed apart; a hole's pages
  are then in the page cache too, as after an earlier restore);
- ``warm``: the warm node's kept image.

Each restore is a raw ``criu restore`` of the image directory with warmctl's flags (as
``benchmarks/up_vs_raw.py`` does: ``/dev/shm`` files put back first, the tree killed after),
measured: wall seconds, the restored tree's CPU seconds right after (user + system of every
task, which CRIU's restorer ran in) plus ``criu``'s own (its rusage), ``/proc/meminfo`` Dirty and
Writeback at the restore's start and their peaks during it (sampled every 20 ms), the host's
I/O-wait seconds over the restore (``/proc/stat``, all CPUs), the pages written back meanwhile
(``/proc/vmstat`` ``nr_written``) and the first correct token on the engine port after it.
After each variant its node is removed and ``sync`` run, so each variant starts clean.

Usage (under the engine lock, with the caller's ports)::

    flock /tmp/warmctl-engine.lock env WARMCTL_TEST_ENGINE_PORT=E WARMCTL_TEST_GATE_PORT=G \\
        python benchmarks/fresh_restore.py --keep-home DIR [--rounds 3] [--variants now,sync,drop,warm] [--json F]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _pagecache import dontneed as drop  # noqa: E402
from _pagecache import resident  # noqa: E402
from up_vs_raw import first_token, kill_raw  # noqa: E402

ENGINE_PORT = int(os.environ.get("WARMCTL_TEST_ENGINE_PORT") or 18700)
GATE_PORT = int(os.environ.get("WARMCTL_TEST_GATE_PORT") or 18780)
PAGE = os.sysconf("SC_PAGE_SIZE")


def meminfo() -> dict[str, int]:
    """Dirty and Writeback of /proc/meminfo, in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("Dirty", "Writeback"):
            out[k] = int(v.split()[0]) * 1024
    return out


def vmstat(key: str) -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, v = line.split()
        if k == key:
            return int(v)
    return 0


def iowait_s() -> float:
    """Seconds of I/O wait summed over all CPUs since boot (/proc/stat)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(f[5]) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    """Peaks of Dirty and Writeback (bytes) every 20 ms until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"Dirty": 0, "Writeback": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for k, v in meminfo().items():
                self.peak[k] = max(self.peak[k], v)
            self.stop.wait(0.02)


def tree_cpu(root_pid: int) -> tuple[float, float]:
    """(user, system) seconds of every task of ``root_pid``'s tree (counted since CRIU forked them)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return float("nan"), float("nan")
    user = system = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            user, system = user + t.user, system + t.system
        except psutil.Error:
            pass
    return user, system


#: /proc/vmstat counters whose change over each restore is reported (memory reclaim, compaction,
#: huge pages, faults, refaults)
VMSTAT = ("pgfault", "pgmajfault", "pgscan_direct", "compact_stall", "thp_fault_alloc", "thp_fault_fallback",
          "workingset_refault_file", "pgactivate", "pgdeactivate", "nr_written")


def vmstats() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, v = line.split()
        if k in VMSTAT:
            out[k] = int(v)
    return out


def materialize(remote_url: str, node: Path, m, digest: str, defer: bool):
    """A fresh node's materialize (as ``up``'s): (image, seconds, pending fill or None)."""
    from warmctl.checkpoint.imagecache import ImageCache
    from warmctl.store import Fetched, open_store

    remote, local = open_store(remote_url), open_store(node / "store")
    images = ImageCache(node / "cache" / "images")
    t0 = time.monotonic()
    fill = None
    if defer:
        from warmctl.store import CacheFill

        fill = CacheFill(local)
        img = images.get(remote, m, digest, cache=local, fetched=Fetched(), fill=fill)
    else:
        img = images.get(remote, m, digest, cache=local, fetched=Fetched())
    dt = time.monotonic() - t0
    return img, dt, (fill, local)


def restore_once(img, m, settings, prompt: str, model: str, expected: int, perf: Path | None = None) -> dict:
    """A raw ``criu restore`` of ``img`` (see module doc); its figures."""
    from warmctl.checkpoint import capture, criu
    from warmctl.checkpoint.imagecache import ImageCache
    from warmctl.engine.run import EngineRun

    run = EngineRun(settings.run_dir, "tiny", 0, log_path=m.restore.log_path, cwd=m.restore.cwd).prepare()
    run.log_path.touch()
    work = Path(tempfile.mkdtemp(prefix="fresh-restore-"))
    root_pid, inodes = None, []
    out: dict = {}
    try:
        with criu.host_lock():
            shm = ImageCache(img.path.parent).put_back_shm(img, m, capture.SHM)
            inodes = [(s.st_dev, s.st_ino) for s in map(os.stat, shm)]
            if m.restore.tmp_dir:
                Path(m.restore.tmp_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            mi, wr0, io0 = meminfo(), vmstat("nr_written"), iowait_s()
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            vs0 = vmstats()
            rec = None
            if perf is not None:  # system-wide: the restored tasks are CRIU's forks
                rec = subprocess.Popen(["perf", "record", "-a", "-g", "-q", "-o", str(perf)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
            s = Sampler()
            s.start()
            t0 = time.monotonic()
            root_pid, secs = criu.restore(img.images, work / "engine.pid", log_file=work / "restore.log",
                                          binary=settings.criu, work_dir=work)
            t1 = time.monotonic()
            cpu_u, cpu_s = tree_cpu(root_pid)
            vs1 = vmstats()
            if rec is not None:
                rec.send_signal(2)
                rec.wait()
            s.stop.set()
            s.join()
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            out = {"restore_s": t1 - t0, "tree_cpu_s": cpu_u + cpu_s, "tree_user_s": cpu_u, "tree_sys_s": cpu_s,
                   "vmstat": {k: vs1[k] - vs0.get(k, 0) for k in vs1},
                   "criu_cpu_s": ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime,
                   "dirty_at_start": mi["Dirty"], "writeback_at_start": mi["Writeback"],
                   "dirty_peak": s.peak["Dirty"], "writeback_peak": s.peak["Writeback"],
                   "written_during": (vmstat("nr_written") - wr0) * PAGE, "iowait_s": iowait_s() - io0}
        tok, t2 = first_token(m.restore.internal_port or ENGINE_PORT, prompt, model)
        assert tok == expected, f"first token {tok} != canary {expected}"
        out["token_s"] = t2 - t0
    finally:
        kill_raw(root_pid, inodes)
        if m.restore.tmp_dir:
            shutil.rmtree(m.restore.tmp_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep-home", type=Path, required=True, help="node A's home (made, with its snapshot, if missing)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="now,sync,drop,warm", help="comma-separated: now,deferred,sync,drop,preread,warm")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds of pause after each variant's cleanup")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--perf", type=Path, default=None, help="a directory: `perf record -a -g` of each restore into it")
    a = ap.parse_args()
    variants = a.variants.split(",")
    from tests.conftest import isolated_env

    env_a = isolated_env(a.keep_home, ENGINE_PORT, GATE_PORT)
    os.environ["WARMCTL_CONFIG"] = env_a["WARMCTL_CONFIG"]
    from warmctl.naming.catalog import Catalog, Ref
    from warmctl.checkpoint.imagecache import ImageCache
    from warmctl.records.config import load_settings
    from warmctl.naming.fleet import entries_to_copy, transfer
    from warmctl.store import open_store

    if "deferred" in variants and "fill" not in inspect.signature(ImageCache.get).parameters:
        sys.exit("--variants deferred needs a checkout whose ImageCache.get takes fill=")
    settings = load_settings()
    store_a = open_store(settings.store_dir)
    if not Catalog(store_a).entries("tiny"):
        print("making the snapshot once (warmctl snapshot tiny) ...", flush=True)
        subprocess.run([sys.executable, "-m", "warmctl", "snapshot", "tiny", "--quiet", "--no-push"], env=env_a,
                       check=True, cwd=REPO)
    (entry,) = Catalog(store_a).entries("tiny")
    digest = entry.manifest
    m = store_a.get_manifest(digest)
    c = m.canary.completions[0]
    prompt, expected, model = c.prompt, c.token_ids[0], m.profile["engine"]["served_model_name"]

    work = Path(tempfile.mkdtemp(prefix="warmctl-fresh-restore-"))
    try:
        remote = str(work / "remote")
        transfer(store_a, open_store(remote), entries_to_copy(store_a, Ref.parse("tiny")))
        warm, _, (_, wl) = materialize(remote, work / "warm", m, digest, False)
        wl.close()
        os.sync()
        files = [p for p in warm.images.iterdir() if p.is_file()]
        print(f"image: {len(files)} files, {sum(p.stat().st_size for p in files) / 2**30:.2f} GiB apparent, "
              f"{sum(p.stat().st_blocks * 512 for p in files) / 2**30:.2f} GiB allocated; "
              f"warm node's image resident: {resident(files) / 2**30:.2f} GiB", flush=True)
        res: dict[str, list[dict]] = {v: [] for v in variants}
        for i in range(a.rounds):
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            for v in order:
                x: dict = {}
                node = work / f"node-{v}-{i}"
                fill = local = None
                if v == "warm":
                    img = warm
                else:
                    img, x["materialize_s"], (fill, local) = materialize(remote, node, m, digest, v == "deferred")
                    if v in ("sync", "drop"):
                        t0 = time.monotonic()
                        os.sync()
                        x["sync_s"] = time.monotonic() - t0
                    if v == "preread":  # every byte read once, holes included (their page cache filled)
                        t0 = time.monotonic()
                        for p in img.images.iterdir():
                            if p.is_file():
                                with open(p, "rb", buffering=0) as fh:
                                    while fh.read(1 << 20):
                                        pass
                        x["preread_s"] = time.monotonic() - t0
                    if v == "drop":
                        imgs = [p for p in img.images.iterdir() if p.is_file()]
                        drop(imgs)
                        x["resident_after_drop"] = resident(imgs)
                x["resident_at_start"] = resident([p for p in img.images.iterdir() if p.is_file()])
                try:
                    x.update(restore_once(img, m, settings, prompt, model, expected,
                                          None if a.perf is None else a.perf / f"{v}-{i}.data"))
                finally:
                    if fill is not None:
                        t0 = time.monotonic()
                        x["commit_after_s"] = time.monotonic() - t0 if fill.commit() >= 0 else 0.0
                    if local is not None:
                        local.close()
                res[v].append(x)
                extra = "".join(f", {k} {x[k]:.2f} s" for k in ("materialize_s", "sync_s", "preread_s", "commit_after_s") if k in x)
                extra += f", image resident at start {x['resident_at_start'] / 2**30:.2f} GiB"
                print(f"round {i} {v:8s}: restore {x['restore_s']:5.2f} s (tree CPU {x['tree_user_s']:.2f} user + {x['tree_sys_s']:.2f} sys, criu "
                      f"{x['criu_cpu_s']:.2f} s), token {x['token_s']:5.2f} s; at start Dirty "
                      f"{x['dirty_at_start'] / 2**20:,.0f} MiB Writeback {x['writeback_at_start'] / 2**20:,.0f} MiB, "
                      f"peaks {x['dirty_peak'] / 2**20:,.0f} / {x['writeback_peak'] / 2**20:,.0f} MiB, written back "
                      f"{x['written_during'] / 2**20:,.0f} MiB, iowait {x['iowait_s']:.2f} s{extra}; vmstat "
                      + " ".join(f"{k} {n}" for k, n in x["vmstat"].items() if n), flush=True)
                if v != "warm":
                    shutil.rmtree(node, ignore_errors=True)
                os.sync()
                time.sleep(a.gap)
        print(f"\nmedians over {a.rounds} rounds (load {os.getloadavg()[0]:.2f}):")
        keys = ["restore_s", "tree_cpu_s", "criu_cpu_s", "token_s", "dirty_at_start", "writeback_at_start",
                "writeback_peak", "written_during", "iowait_s", "materialize_s", "sync_s", "preread_s", "commit_after_s", "resident_at_start"]
        print("  " + " " * 9 + "".join(f"{k[:14]:>15s}" for k in keys))
        for v, xs in res.items():
            row = []
            for k in keys:
                vals = [x[k] for x in xs if k in x]
                if not vals:
                    row.append(f"{'-':>15s}")
                    continue
                med = statistics.median(vals)
                row.append(f"{med / 2**20:>11,.0f} MiB" if k in ("dirty_at_start", "writeback_at_start", "writeback_peak",
                                                                  "written_during", "resident_at_start") else f"{med:>13.2f} s")
            print(f"  {v:9s}" + "".join(row))
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):
        main()
