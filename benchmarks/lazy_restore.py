"""Lazy (on-demand) CRIU restore vs the eager raw restore: first correct token, and how much of
the image the first token needs ("then beat the raw restore").

Eager: ``criu restore`` reads every page of the image into the new processes before any of them
runs (what ``warmctl up`` and ``benchmarks/up_vs_raw.py`` do). Lazy: ``criu lazy-pages -D IMG``
is started first; ``criu restore --lazy-pages`` then maps private anonymous memory empty,
registered with userfaultfd, and returns; each page is copied from the image when the process
first touches it (a fault served by the lazy-pages daemon), and the daemon copies the rest in
the background while no fault is pending, then exits. Both sides restore the same image, written
once from the store (not timed); the snapshot's ``/dev/shm`` files are put back before each run
(not timed). Timed: from the start of the CRIU command(s) to the first correct token on the
engine port. Runs alternate eager and lazy.

With ``--cold``, the page cache is dropped before every run (``sync; echo 3 >
/proc/sys/vm/drop_caches``, root) and the physical floor is printed beside it: the bytes each
side must read before the first token divided by a plain ``dd`` read rate of the image files
(also cold).

A last *traced* lazy run (daemon at ``-v4``, slower: one log line per page) counts what was
copied before the first token: pages faulted on demand (``#PF`` lines) and pages copied in the
background, against all pages the daemon transferred.

Usage::

    python benchmarks/lazy_restore.py [--runs 5] [--cold] [--keep-home DIR]

Leaves nothing behind: each tree is killed and its /dev/shm files removed by inode, the daemon
is waited for (or killed), the work directory is removed unless ``--keep-home`` names one.
"""

from __future__ import annotations

import argparse
import os
import re
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


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def dd_rate(images: Path) -> float:
    """Bytes/s of a plain cold read of the image files (``dd bs=4M`` of each to /dev/null)."""
    drop_caches()
    t0 = time.monotonic()
    total = 0
    for p in sorted(images.iterdir()):
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=4M", "status=none"], check=True)
        total += p.stat().st_size
    return total / (time.monotonic() - t0)


def restore(criu_bin: str, images: Path, work: Path, lazy: bool, verbose: int = 2):
    """Start CRIU (and the lazy-pages daemon); returns (root pid, daemon Popen or None, seconds)."""
    for f in work.iterdir():
        if f.is_file() or f.is_socket():
            f.unlink()
    daemon = None
    t0 = time.monotonic()
    if lazy:
        daemon = subprocess.Popen([criu_bin, "lazy-pages", "-D", str(images), "-W", str(work), "-o", "lazy.log",
                                   f"-v{verbose}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not (work / "lazy-pages.socket").exists():
            if daemon.poll() is not None:
                raise RuntimeError(f"criu lazy-pages exited {daemon.returncode}: {(work / 'lazy.log').read_text()[-2000:]}")
            time.sleep(0.001)
    from warmctl.checkpoint import criu

    cmd = [criu_bin, "restore", "-D", str(images), "-W", str(work), "-o", "restore.log", "-v2",
           "--restore-detached", "--pidfile", str(work / "pid"), *criu.RESTORE_FLAGS]
    if lazy:
        cmd.append("--lazy-pages")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        if daemon:
            daemon.kill()
            daemon.wait()
        raise RuntimeError(f"criu restore failed: {(work / 'restore.log').read_text()[-2000:]}")
    return int((work / "pid").read_text()), daemon, time.monotonic() - t0, t0


def trace_counts(log_text: str) -> dict[str, int]:
    """From a -v4 lazy-pages log: pages faulted on demand, bytes copied, pages transferred."""
    faults = len(re.findall(r"#PF at ", log_text))
    copied = sum(int(x) for x in re.findall(r"uffd_copy: 0x[0-9a-f]+/(\d+)", log_text))
    done = {}
    for pid, n, tot in re.findall(r"uffd: (\d+)-\d+: UFFD transferred pages: \((\d+)/(\d+)\)", log_text):
        done[pid] = int(tot)
    return {"faults": faults, "copied_bytes": copied, "pages_total": sum(done.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run")
    ap.add_argument("--keep-home", type=Path, default=None)
    ap.add_argument("--engine-port", type=int, default=18600)
    ap.add_argument("--gate-port", type=int, default=18680)
    a = ap.parse_args()
    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-lazy-"))
    try:
        run_all(a, root)
    finally:
        if a.keep_home is None:
            shutil.rmtree(root, ignore_errors=True)


def run_all(a, root: Path) -> None:
    from tests.conftest import isolated_env

    env = isolated_env(root, a.engine_port, a.gate_port)
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    from warmctl.checkpoint import criu
    from warmctl.records.config import load_settings
    from warmctl.naming.catalog import Catalog
    from warmctl.engine.run import EngineRun
    from warmctl.store import open_store

    settings = load_settings()
    store = open_store(settings.store_dir)
    if Catalog(store).newest("tiny") is None:
        print("making the snapshot once (warmctl snapshot tiny) ...", flush=True)
        wc(env, "snapshot", "tiny", "--quiet")
    manifest = store.get_manifest(Catalog(store).newest("tiny"))
    prompt, expected = manifest.canary.completions[0].prompt, manifest.canary.completions[0].token_ids[0]
    model = manifest.profile["engine"]["served_model_name"]
    criu_bin = criu.check(settings.criu)

    work_root = root / "lazy"
    shutil.rmtree(work_root, ignore_errors=True)
    images, work = work_root / "images", work_root / "work"
    images.mkdir(parents=True)
    work.mkdir()
    for f in manifest.files:
        if f.role == "image":
            store.read_file(f.chunks, images / f.path)
    run = EngineRun(settings.run_dir, "tiny", 0, log_path=manifest.restore.log_path,
                    cwd=manifest.restore.cwd).prepare()  # CRIU reopens the recorded log and cwd
    run.log_path.touch()
    pages_bytes = sum(p.stat().st_size for p in images.glob("pages-*.img"))
    allocated = sum(p.stat().st_blocks * 512 for p in images.iterdir())
    rate = dd_rate(images) if a.cold else None
    wc(env, "down", "tiny", check=False)

    res: dict[str, list[float]] = {"eager": [], "lazy": [], "lazy_criu": [], "eager_criu": [], "lazy_rest": []}

    def one(lazy: bool, verbose: int = 2):
        root_pid, daemon, inodes = None, None, []
        try:
            with criu.host_lock():
                inodes = put_back_shm(store, manifest)
                if a.cold:
                    drop_caches()
                root_pid, daemon, secs, t0 = restore(criu_bin, images, work, lazy, verbose)
            tok, t1 = first_token(a.engine_port, prompt, model)
            at_token = (work / "lazy.log").stat().st_size if lazy else 0
            rest = None
            if daemon:
                daemon.wait(timeout=300)
                rest = time.monotonic() - t1
            assert tok == expected, f"first token {tok} != canary {expected}"
            return t1 - t0, secs, rest, at_token
        finally:
            if daemon and daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            kill_raw(root_pid, inodes)

    try:
        for i in range(a.runs):
            for lazy in (False, True):
                t, secs, rest, _ = one(lazy)
                side = "lazy" if lazy else "eager"
                res[side].append(t)
                res[side + "_criu"].append(secs)
                if lazy:
                    res["lazy_rest"].append(rest)
                print(f"run {i}: {side:5s} restore -> first correct token {t:6.2f} s (criu command(s) {secs:.2f} s"
                      + (f", background copy done {rest:.2f} s after the token)" if lazy else ")"), flush=True)
                time.sleep(1)
        t, secs, rest, at_token = one(True, verbose=4)
        text = (work / "lazy.log").read_text(errors="replace")
        before, total = trace_counts(text[:at_token]), trace_counts(text)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)

    me, ml = statistics.median(res["eager"]), statistics.median(res["lazy"])
    print(f"\nmedian over {a.runs} runs{' (cold page cache)' if a.cold else ''}: eager {me:.2f} s "
          f"(criu {statistics.median(res['eager_criu']):.2f} s), lazy {ml:.2f} s (criu commands "
          f"{statistics.median(res['lazy_criu']):.2f} s); lazy/eager = {ml / me:.2f}x; the lazy daemon finished "
          f"its background copy {statistics.median(res['lazy_rest']):.2f} s after the first token")
    print(f"image: pages-*.img {pages_bytes / 2**20:,.0f} MiB apparent, {allocated / 2**20:,.0f} MiB allocated on disk")
    print(f"traced lazy run ({t:.2f} s to the token at -v4): before the first token {before['faults']:,} pages "
          f"faulted on demand ({before['faults'] * 4096 / 2**20:,.1f} MiB, "
          f"{100 * before['faults'] / max(1, total['pages_total']):.1f}% of the {total['pages_total']:,} pages the daemon "
          f"transferred), {before['copied_bytes'] / 2**20:,.0f} MiB copied in all "
          f"({100 * before['copied_bytes'] / max(1, total['copied_bytes']):.0f}% of {total['copied_bytes'] / 2**20:,.0f} MiB)")
    if rate:
        print(f"cold floor: dd reads the image at {rate / 2**20:,.0f} MiB/s: all {allocated / 2**20:,.0f} MiB allocated "
              f"= {allocated / rate:.2f} s; the demand-faulted pages alone = {before['faults'] * 4096 / rate:.3f} s")


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
