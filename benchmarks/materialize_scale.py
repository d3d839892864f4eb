"""Materialize from the local store at several sizes, cold page cache, beside its floors, no engine
(docs/benchmarks.md, "Scale": materialize per GiB grew 3x between 6.75 and 18 GiB).

One synthetic local store is built for the largest size (``--sizes``, logical GiB): 4 MiB chunks
of random bfloat16-like bytes (the top 16 bits of normal float32 values of std 0.02, as random
bf16 weights are; zstd -1 stores those at x1.00) with an eighth of each chunk heap-like (stored
x0.88 per non-zero chunk and x0.68 of the logical size; the 18 GiB engine snapshot's: x0.90,
x0.69) and ``--zero-share`` of the chunks all-zero, in runs of 8 (as unused KV cache is). Each size's snapshot is the first chunks of that
one file, so a smaller size reads a prefix of the same store.

For each size, ``--rounds`` times, these run one after the other (the checkouts' order
alternating by round), every one from a cold page cache (``sync``, then
``posix_fadvise(DONTNEED)`` on exactly the files involved, checked with ``fincore``; never
``drop_caches``, which would empty other tenants' cache too):

  materialize NAME   a child process of checkout NAME (this one: ``new``; ``--old DIR``: ``old``)
                     runs ``Store.read_files`` of the snapshot into a new directory (what
                     ``ImageCache.get`` runs in ``up``: every chunk verified, a temporary file
                     renamed), then ``sync`` is timed apart ("then sync"); its seconds and
                     CPU are those of ``read_files`` itself, measured inside the child (as
                     ``up``'s materialize phase; the whole process's are in ``--json``)
  dd read image      ``dd if=IMAGE of=/dev/null bs=4M`` of the image just written (the aim's
                     denominator: materialize / dd of the image, cold, >= 0.9)
  dd write           ``dd if=/dev/zero of=X bs=4M count=N`` of the image's non-zero bytes
                     (the write floor, into the page cache as materialize writes), then ``sync``
  read chunks        ``cat`` of the snapshot's chunk files (the read floor)

Per step: wall seconds, user and system CPU seconds of the child (all its threads: ``wait4``),
the host's /proc/vmstat deltas (pgscan, pgsteal, allocstall, compact_*, thp_*, pgfault,
workingset refaults, ...), the peak of Dirty + Writeback in /proc/meminfo (sampled every 0.1 s)
the GiB of freed memory this host's free page reporting handed back to the hypervisor
(/sys/module/page_reporting/parameters/reported_kib, where there is one: each such page costs a
hypervisor fault when it is used again, which the guest sees as system time of whoever
touches it) and, after a materialize, how much of the chunk files and the image are left in the
page cache.
Everything is also given per non-zero GiB, so what grows faster than the data shows as a
per-GiB figure that rises with size. The summary prints materialize / dd-read ratios side by
side, old and new.

The host is shared (2 vCPUs): the load average is printed at each step. Disk: the store (about
0.8 x the non-zero bytes of the largest size) plus one image or floor file at a time; the run
refuses to start a write that would leave less than ``--min-free-gib`` free. Everything it
wrote (``--dir``) is deleted at the end, also on error or Ctrl-C, unless ``--keep-store``
(then the store stays for a later ``--dir`` run and the image files are still deleted).

Usage::

    python benchmarks/materialize_scale.py --sizes 2 8 16 [--old /path/to/old/checkout]
        [--rounds 1] [--dir /var/tmp/matscale] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _pagecache import evict, resident  # noqa: E402

GiB = 1 << 30
CH = 4 << 20
VMSTAT_KEYS = ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "allocstall",
               "compact_stall", "compact_fail", "compact_success", "compact_migrate_scanned",
               "compact_free_scanned", "thp_fault_alloc", "thp_file_alloc", "thp_collapse_alloc",
               "pgfault", "pgmajfault", "pgactivate", "pgdeactivate", "pgrefill",
               "workingset_refault_file", "workingset_activate_file", "nr_dirtied", "nr_written",
               "pgpgin", "pgpgout")

#: the last HEAPISH bytes of each non-zero chunk are heap-like (a repeated record with some
#: varying words): with zstd -1 (no Huffman literals at negative levels) random bf16 bytes store
#: at x1.00, so this eighth gives the non-zero chunks about the x0.90 of the 18 GiB snapshot
HEAPISH = 512 << 10
HEAP = (b"{'layer': 17, 'op': 'matmul', 'shape': (4096, 4096), 'ptr': 0x7f3a" * 8200)[:HEAPISH]

CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
from warmctl.records.manifest import ChunkRef
from warmctl.store import open_store
store_dir, refs_file, dest = sys.argv[1:4]
refs = [ChunkRef(**r) for r in json.loads(Path(refs_file).read_text())]
s = open_store(store_dir)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
s.read_files([(refs, Path(dest))])
wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
import warmctl
print(json.dumps({"wall": wall, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                  "warmctl": os.path.dirname(warmctl.__file__)}))
"""


# ----------------------------------------------------------------------------- the host


def vmstat() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, v = line.split()
        key = "allocstall" if k.startswith("allocstall") else k
        if key in VMSTAT_KEYS:
            out[key] = out.get(key, 0) + int(v)
    return out


#: this host's free page reporting (virtio-balloon): KiB of freed guest memory handed back to the
#: hypervisor so far; a page handed back costs a hypervisor fault when the guest uses it again
REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int:
    try:
        return int(REPORTED.read_text())
    except (OSError, ValueError):
        return 0


def meminfo_kib(*keys: str) -> int:
    total = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, rest = line.split(":", 1)
        if k in keys:
            total += int(rest.split()[0])
    return total


class DirtySampler:
    """Peak of Dirty + Writeback (bytes) while running, sampled every 0.1 s."""

    def __enter__(self) -> "DirtySampler":
        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, meminfo_kib("Dirty", "Writeback") << 10)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def files_of(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            out.append(p)
    return out


def need_free(where: Path, nbytes: int, floor_gib: float) -> None:
    free = shutil.disk_usage(where).free
    if free - nbytes < floor_gib * GiB:
        raise SystemExit(f"refusing to write {nbytes / GiB:.1f} GiB in {where}: {free / GiB:.1f} GiB free, "
                         f"and at least {floor_gib} GiB must stay free for the host's other users")


def measured(argv: list[str], env: dict | None = None, stdout=subprocess.PIPE, cwd: Path | None = None) -> dict:
    """Run ``argv``; wall, user, sys (the child's, all threads), vmstat deltas, peak dirty."""
    v0, rep0 = vmstat(), reported_kib()
    with DirtySampler() as ds:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=cwd)
        try:
            out, err = p.communicate()
        except BaseException:  # Ctrl-C: the child goes too, before the work directory does
            p.kill()
            p.wait()
            raise
        wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{argv[:3]} failed ({p.returncode}): {err[-2000:]}")
    v1 = vmstat()
    vm = {k: v1.get(k, 0) - v0.get(k, 0) for k in VMSTAT_KEYS}
    vm["reported_kib"] = reported_kib() - rep0
    return {"wall": wall, "out": out, "vm": vm,
            "dirty_peak": ds.peak, "load": os.getloadavg()[0]}


class ChildCPU:
    """User and system seconds of children reaped while inside (RUSAGE_CHILDREN delta)."""

    def __enter__(self) -> "ChildCPU":
        self.r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        return self

    def __exit__(self, *exc) -> None:
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.user, self.sys = r1.ru_utime - self.r0.ru_utime, r1.ru_stime - self.r0.ru_stime


def step(argv: list[str], env: dict | None = None, stdout=subprocess.PIPE, cwd: Path | None = None) -> dict:
    with ChildCPU() as c:
        r = measured(argv, env, stdout, cwd)
    r["user"], r["sys"] = c.user, c.sys
    return r


def timed_sync() -> float:
    t0 = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the store


def build_store(store_dir: Path, nchunks: int, zero_share: float, seed: int = 27) -> list[dict]:
    """A local store holding one file of ``nchunks`` chunks; returns its refs (as dicts)."""
    import numpy as np

    from warmctl.store import open_store
    from warmctl.store.chunkio import ordered_map

    s = open_store(store_dir)
    s.lock_for_write("materialize_scale build")
    period = 8 / zero_share if zero_share > 0 else 0  # zero runs of 8 chunks, zero_share of all

    def is_zero(i: int) -> bool:
        return bool(period) and (i % int(round(period))) < 8

    def make(i: int):
        if is_zero(i):
            data = bytes(CH)
        else:
            rng = np.random.default_rng((seed, i))
            f = rng.standard_normal(CH // 2, dtype=np.float32) * np.float32(0.02)
            w = (f.view(np.uint32) >> 16).astype(np.uint16)
            w[-HEAPISH // 2:] = np.frombuffer(HEAP, dtype=np.uint16)  # an eighth that compresses
            w[-HEAPISH // 2::997] = w[:len(w[-HEAPISH // 2::997])]
            data = w.tobytes()
        return s._put_chunk(data)

    refs, stored, t0 = [], 0, time.perf_counter()
    for i, (ref, n) in enumerate(ordered_map(make, range(nchunks), 2)):
        refs.append({"digest": ref.digest, "size": ref.size})
        stored += n
        if i % 256 == 255:
            print(f"  built {(i + 1) * CH / GiB:5.1f} GiB ({time.perf_counter() - t0:.0f} s)", flush=True)
    nz = sum(1 for i in range(nchunks) if not is_zero(i))
    print(f"store: {nchunks * CH / GiB:.2f} GiB logical, {nz * CH / GiB:.2f} GiB non-zero, "
          f"{stored / GiB:.2f} GiB stored (x{stored / max(nz * CH, 1):.2f}), {time.perf_counter() - t0:.0f} s", flush=True)
    return refs


def chunk_files(store_dir: Path, refs: list[dict]) -> list[Path]:
    from warmctl.store import chunks as ck
    from warmctl.store.layout import chunk_key

    keys = {chunk_key(r["digest"]) for r in refs if not ck.is_zero_chunk(r["digest"], r["size"])}
    return sorted(store_dir / k for k in keys)


# ----------------------------------------------------------------------------- the run


def per_gib(r: dict, gib: float) -> dict:
    return {"wall": r["wall"] / gib, "user": r["user"] / gib, "sys": r["sys"] / gib,
            **{k: v / gib for k, v in r["vm"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[2, 8, 16], help="logical GiB of each snapshot (default 2 8 16)")
    ap.add_argument("--zero-share", type=float, default=0.22, help="share of all-zero chunks (default 0.22, as the 18 GiB snapshot: 13.76 of 17.95 GiB non-zero)")
    ap.add_argument("--old", type=Path, help="another checkout (e.g. a git worktree of main) measured beside this one")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per size; the checkouts' order alternates (default 1)")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/matscale"), help="work directory (deleted at the end)")
    ap.add_argument("--keep-store", action="store_true", help="keep the store in --dir (reused when it is there)")
    ap.add_argument("--skip-floors", action="store_true", help="materialize only (no dd write / chunk read floors)")
    ap.add_argument("--min-free-gib", type=float, default=25, help="never leave less free disk than this (default 25)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    a = ap.parse_args()
    from warmctl.store.chunks import is_zero_chunk
    if not shutil.which("fincore"):
        raise SystemExit("fincore (util-linux) is needed to check the page cache")
    sides = [("new", REPO)] + ([("old", a.old.resolve())] if a.old else [])
    nmax = int(max(a.sizes) * GiB // CH)
    a.dir = a.dir.resolve()
    store_dir, refs_path = a.dir / "store", a.dir / "refs.json"
    created = not a.dir.exists()
    a.dir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    try:
        if refs_path.exists() and len(json.loads(refs_path.read_text())) >= nmax:
            all_refs = json.loads(refs_path.read_text())
            print(f"reusing the store in {store_dir}")
        else:
            need_free(a.dir, int(nmax * CH * (1 - a.zero_share) * 0.85), a.min_free_gib)
            all_refs = build_store(store_dir, nmax, a.zero_share)
            refs_path.write_text(json.dumps(all_refs))
        print(f"host: {os.cpu_count()} CPUs, {meminfo_kib('MemTotal') / 2**20:.1f} GiB RAM, "
              f"load {os.getloadavg()}", flush=True)
        for size in a.sizes:
            n = int(size * GiB // CH)
            refs = all_refs[:n]
            sub = a.dir / f"refs-{n}.json"
            sub.write_text(json.dumps(refs))
            chunks = chunk_files(store_dir, refs)
            nz = sum(r["size"] for r in refs if not is_zero_chunk(r["digest"], r["size"]))
            nz_gib = nz / GiB
            stored = sum(f.stat().st_size for f in chunks)
            print(f"\n== {n * CH / GiB:.2f} GiB logical, {nz_gib:.2f} GiB non-zero, {len(chunks)} chunk files, "
                  f"{stored / GiB:.2f} GiB stored", flush=True)
            for rnd in range(a.rounds):
                order = sides if rnd % 2 == 0 else sides[::-1]
                for name, root in order:
                    out = a.dir / f"out-{name}"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    img = out / "pages-1.img"
                    need_free(a.dir, nz, a.min_free_gib)
                    evict(chunks)
                    env = dict(os.environ, PYTHONPATH=str(root))
                    # run in the checkout: ``python -c`` puts the working directory first on
                    # sys.path, so a child started from another checkout would import that one
                    r = step([sys.executable, "-c", CHILD, str(store_dir), str(sub), str(img)], env, cwd=root)
                    assert json.loads(r["out"].strip().splitlines()[-1])["warmctl"] == str(root / "warmctl"), r["out"]
                    inner = json.loads(r.pop("out").strip().splitlines()[-1])
                    # the process's figures (Python start-up and imports included) kept apart
                    r["process_wall"], r["process_user"], r["process_sys"] = r["wall"], r["user"], r["sys"]
                    r["wall"], r["user"], r["sys"] = inner["wall"], inner["user"], inner["sys"]
                    r["chunks_left_cached"] = resident(chunks)
                    r["image_cached"] = resident([img])
                    r["then_sync"] = timed_sync()
                    results.append({"size": size, "round": rnd, "step": f"materialize {name}", "nz_gib": nz_gib, **r})
                    report(results[-1])
                    if name == order[0][0]:  # the image's cold read, once per round
                        evict([img])
                        r = step(["dd", f"if={img}", "of=/dev/null", "bs=4M", "status=none"])
                        r.pop("out")
                        results.append({"size": size, "round": rnd, "step": "dd read image", "nz_gib": nz_gib, **r})
                        report(results[-1])
                    shutil.rmtree(out)
                    subprocess.run(["sync"], check=True)
                if a.skip_floors:
                    continue
                floor = a.dir / "floor"
                need_free(a.dir, nz, a.min_free_gib)
                r = step(["dd", "if=/dev/zero", f"of={floor}", "bs=4M", f"count={nz // CH}", "status=none"])
                r.pop("out")
                r["then_sync"] = timed_sync()
                results.append({"size": size, "round": rnd, "step": "dd write", "nz_gib": nz_gib, **r})
                report(results[-1])
                floor.unlink()
                subprocess.run(["sync"], check=True)
                evict(chunks)
                listing = a.dir / "chunks.txt"
                listing.write_text("".join(f"{c}\n" for c in chunks))
                r = step(["sh", "-c", f"xargs -a {listing} cat > /dev/null"])
                r.pop("out")
                results.append({"size": size, "round": rnd, "step": "read chunks", "nz_gib": nz_gib, **r})
                report(results[-1])
        summary(results, [s for s, _ in sides])
        if a.json:
            a.json.write_text(json.dumps(results, indent=1))
    finally:
        for p in a.dir.glob("out-*"):
            shutil.rmtree(p, ignore_errors=True)
        (a.dir / "floor").unlink(missing_ok=True)
        if a.keep_store:
            print(f"(store kept in {store_dir})")
        elif created or store_dir.exists():
            shutil.rmtree(a.dir, ignore_errors=True)
            print(f"(deleted {a.dir})")


SHOW = ("reported_kib", "pgscan_kswapd", "pgscan_direct", "pgsteal_direct", "allocstall", "compact_stall", "thp_fault_alloc",
        "pgfault", "pgmajfault", "workingset_refault_file")


def report(r: dict) -> None:
    g = r["nz_gib"]
    extra = f" then sync {r['then_sync']:.2f}" if "then_sync" in r else ""
    left = (f" | chunks left cached {r['chunks_left_cached'] / GiB:.2f} GiB, image cached {r['image_cached'] / GiB:.2f} GiB"
            if "chunks_left_cached" in r else "")
    vm = " ".join(f"{k}={r['vm'][k] / g / 1000:.1f}k" if k != "reported_kib" else f"reported={r['vm'][k] / 2**20 / g:.2f}GiB"
                  for k in SHOW if r["vm"].get(k))
    print(f"  [{r['size']:g} GiB r{r['round']}] {r['step']:16s} {r['wall']:7.2f} s ({r['wall'] / g:.2f} s/GiB) "
          f"user {r['user']:.2f} sys {r['sys']:.2f}{extra}, dirty peak {r['dirty_peak'] / GiB:.2f} GiB, "
          f"load {r['load']:.1f}{left}\n      per non-zero GiB: {vm}", flush=True)


def summary(results: list[dict], names: list[str]) -> None:
    print("\nsummary (medians over rounds; s and CPU-s per non-zero GiB; ratio = dd read image s / materialize s)")
    sizes = sorted({r["size"] for r in results})
    print(f"{'GiB':>5} {'step':18} {'s/GiB':>6} {'user/GiB':>8} {'sys/GiB':>8} {'ratio':>6} "
          f"{'pgscan_k/GiB':>12} {'pgscan_d/GiB':>12} {'pgfault/GiB':>11} {'reported':>8} {'chunks left':>11}")
    for size in sizes:
        rows = [r for r in results if r["size"] == size]
        dd = sorted(r["wall"] for r in rows if r["step"] == "dd read image")
        ddm = dd[len(dd) // 2] if dd else float("nan")
        for st in [f"materialize {n}" for n in names] + ["dd read image", "dd write", "read chunks"]:
            rr = sorted((r for r in rows if r["step"] == st), key=lambda r: r["wall"])
            if not rr:
                continue
            m = rr[len(rr) // 2]
            g = m["nz_gib"]
            ratio = f"{ddm / m['wall']:6.2f}" if st.startswith("materialize") else ""
            left = f"{m['chunks_left_cached'] / GiB:9.2f}Gi" if "chunks_left_cached" in m else ""
            print(f"{size:5g} {st:18} {m['wall'] / g:6.2f} {m['user'] / g:8.2f} {m['sys'] / g:8.2f} {ratio:>6} "
                  f"{m['vm']['pgscan_kswapd'] / g:12.0f} {m['vm']['pgscan_direct'] / g:12.0f} "
                  f"{m['vm']['pgfault'] / g:11.0f} {m['vm'].get('reported_kib', 0) / 2**20 / g:8.2f} {left:>11}")


if __name__ == "__main__":
    main()
