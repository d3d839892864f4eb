"""The cost curve: snapshot, push, pull and ``up`` of one engine size beside its floors.

One size per invocation (``--size tiny`` = the shipped 2.7 GiB ``tiny`` profile; ``8g`` / ``16g``
= ``benchmarks/profiles/scale-8g.toml`` / ``scale-16g.toml``, random-weight Llamas of
``warmctl/models/randmodel.py``), so a shared host can interleave other engine work between sizes.
Everything runs through the real ``warmctl`` CLI (a fresh process per command) and is timed
from outside, beside the floors measured in the same run on the same bytes:

- ``snapshot`` on node A (``--json``: its phases);
- ``up`` on node A: ``cold-store`` (no kept image, page cache dropped: the image materialized
  from the local store, written whole first with ``restore_stream = never`` so that
  materialize is timed alone; then again streamed to CRIU as it is written, the default), ``warm`` (kept image, page cache warm; ``--rounds`` times) and
  ``cold`` (kept image, page cache dropped), each to the first *correct* token on the public
  port; beside them the **raw** ``criu restore`` of the same kept image directory (with
  ``benchmarks/up_vs_raw.py``'s helpers; warm and cold, interleaved with ``warm``)
  and **dd** of the image files to /dev/null (warm and cold);
- ``push`` to a directory remote and to Ceph RGW on loopback (``tests/rgw_server.py``: a memstore
  OSD when the snapshot and the engine fit in RAM, else bluestore on a file), then ``up`` on a
  **fresh node** (empty home) from each (image written first, then, on another fresh node,
  streamed: the default), and ``pull``
  into an empty store from each; beside them boto3 ``download_file`` of the same chunk objects
  (``benchmarks/fleet_up.py``'s :func:`boto3_download`) and a ``dd`` read of the directory
  remote's chunk files (cold).

For every warmctl command: wall seconds, GiB/s over the snapshot's logical size (or the bytes
the phase moves), warmctl's own CPU seconds (user+sys of the warmctl process, sampled from
/proc/PID/stat; children such as CRIU counted apart from ``wait4``), its peak RSS (VmHWM) and
the host's I/O-wait seconds (/proc/stat delta, all CPUs: the host is shared). Where the CPU goes
is estimated from per-byte rates measured in this run on this snapshot's own chunks (BLAKE3,
zstd level -1 compress and decompress, a memory copy), times the bytes each command handles.
The scaling aims (per-GiB costs flat across sizes, and the rest below) are printed with their ratios and whether each is met; ``--json``
writes every figure.

Usage (as root: drop_caches and CRIU)::

    flock /tmp/warmctl-engine.lock env WARMCTL_TEST_ENGINE_PORT=18500 WARMCTL_TEST_GATE_PORT=18580 \\
        python benchmarks/scale.py --size 8g --keep-models /var/tmp/warmctl-scale-models --json out.json
    python benchmarks/scale.py --compare tiny.json 8g.json 16g.json      # the curve across sizes

Cleans up everything it creates (homes, remotes, RGW, the engines and their /dev/shm files; the
models only when it built them into its own temporary directory: ``--keep-models DIR`` keeps
and reuses them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from fleet_up import boto3_download  # noqa: E402
from up_vs_raw import drop_caches, first_token, kill_raw, put_back_shm  # noqa: E402

ENGINE_PORT = int(os.environ.get("WARMCTL_TEST_ENGINE_PORT") or 18500)
GATE_PORT = int(os.environ.get("WARMCTL_TEST_GATE_PORT") or 18580)
GiB = 2**30
SIZES = {"tiny": None, "8g": "scale-8g", "16g": "scale-16g"}
TICK = os.sysconf("SC_CLK_TCK")


# -- measuring a command ---------------------------------------------------------------------

def raw_restore(settings, store, manifest, name: str, images: Path, raw_dir: Path, port: int, prompt: str, model: str,
                cold: bool = False) -> tuple[int, float, float]:
    """One raw ``criu restore`` of the image directory ``images`` with warmctl's flags, as
    ``benchmarks/up_vs_raw.py`` does it (its :func:`put_back_shm` and :func:`kill_raw`): under
    the host's CRIU lock, the snapshot's ``/dev/shm`` files and the engine's run and scratch
    directories put back first, untimed (with ``cold`` the page cache dropped after that); then
    the first token of ``prompt`` on the engine's ``port``; then the tree killed, its
    ``/dev/shm`` files and scratch directory removed. Returns (token id, seconds from ``criu
    restore``'s start to the token, ``criu restore``'s own seconds); CRIU logs to ``raw_dir``."""
    from warmctl.checkpoint import criu
    from warmctl.engine.run import EngineRun

    run = EngineRun(settings.run_dir, name, 0, log_path=manifest.restore.log_path, cwd=manifest.restore.cwd).prepare()
    run.log_path.touch()  # CRIU reopens the recorded log and cwd
    tmp = getattr(manifest.restore, "tmp_dir", None)
    root_pid, inodes = None, []
    try:
        with criu.host_lock():
            inodes = put_back_shm(store, manifest)
            if tmp:  # the engine's scratch dir: its UNIX sockets are bound there again
                Path(tmp).mkdir(mode=0o700, parents=True, exist_ok=True)
            if cold:
                drop_caches()
            t0 = time.monotonic()
            root_pid, secs = criu.restore(images, raw_dir / "engine.pid", log_file=raw_dir / "restore.log",
                                          binary=settings.criu)
        tok, t1 = first_token(port, prompt, model)
    finally:
        kill_raw(root_pid, inodes)
        if tmp:  # its sockets, so that up binds them afresh
            shutil.rmtree(tmp, ignore_errors=True)
    return tok, t1 - t0, secs


def host_cpu() -> dict[str, float]:
    """Seconds of all CPUs from /proc/stat: busy (user+nice+system+irq+softirq) and iowait."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return {"busy": (f[0] + f[1] + f[2] + f[5] + f[6]) / TICK, "iowait": f[4] / TICK}


def proc_sample(pid: int) -> tuple[float, float, float] | None:
    """(user s, sys s, VmHWM MiB) of ``pid``, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    f = stat.rsplit(")", 1)[1].split()
    m = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(f[11]) / TICK, int(f[12]) / TICK, (int(m[1]) / 1024 if m else 0.0)


def run_measured(env: dict, *args: str, check: bool = True, timeout: float = 3600) -> dict:
    """Run ``warmctl ARGS``; returns wall_s, own_cpu_s (the warmctl process, all threads),
    tree_cpu_s (wait4: it and every child it reaped), peak_rss_mib, host_iowait_s,
    host_busy_s, rc, stdout, stderr and ``json`` (stdout parsed, when it is JSON)."""
    h0 = host_cpu()
    t0 = time.monotonic()
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    p = subprocess.Popen([sys.executable, "-m", "warmctl", *args], env=env, stdout=out, stderr=err)
    last: list = [(0.0, 0.0, 0.0)]
    stop = threading.Event()

    def sample():  # the largest value of each: a zombie's last sample has no VmHWM
        while not stop.is_set():
            s = proc_sample(p.pid)
            if s is not None:
                last[0] = tuple(max(x, y) for x, y in zip(last[0], s))
            stop.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    deadline = t0 + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            pid, status, ru = os.wait4(p.pid, 0)
            break
        time.sleep(0.02)
    wall = time.monotonic() - t0
    stop.set()
    th.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    h1 = host_cpu()
    out.seek(0), err.seek(0)
    r = {"args": list(args), "rc": p.returncode, "wall_s": wall, "own_cpu_s": last[0][0] + last[0][1],
         "own_user_s": last[0][0], "own_sys_s": last[0][1], "tree_cpu_s": ru.ru_utime + ru.ru_stime,
         "peak_rss_mib": max(last[0][2], 0.0), "tree_maxrss_mib": ru.ru_maxrss / 1024,
         "host_iowait_s": h1["iowait"] - h0["iowait"], "host_busy_s": h1["busy"] - h0["busy"],
         "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}
    try:
        r["json"] = json.loads(r["stdout"])
    except ValueError:
        r["json"] = None
    if check and r["rc"]:
        raise RuntimeError(f"warmctl {' '.join(args)} failed (rc {r['rc']}):\n{r['stdout'][-3000:]}\n{r['stderr'][-3000:]}")
    return r


def dd_read(files: list[Path], cold: bool) -> tuple[int, float]:
    """``dd`` of ``files`` to /dev/null (bs 16 MiB), after dropping the page cache when ``cold``:
    (bytes, seconds)."""
    if cold:
        drop_caches()
    total = 0
    t0 = time.monotonic()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "status=none"], check=True)
        total += f.stat().st_size
    return total, time.monotonic() - t0


def rates(store, manifest, sample_bytes: int = 256 * 2**20) -> dict[str, float]:
    """Single-core seconds per GiB of BLAKE3, zstd level -1 compression and decompression and a
    memory copy, measured on the snapshot's own non-zero chunks (chunks read back from the local store,
    spread over its image files, up to ``sample_bytes``)."""
    import blake3
    import zstandard

    from warmctl.store.chunks import ZSTD_LEVEL

    from warmctl.store.chunks import is_zero_chunk

    refs = [c for f in manifest.files if f.role == "image" and f.hardlink_to is None for c in f.chunks
            if not is_zero_chunk(c.digest, c.size)]
    step = max(1, len(refs) // max(1, sample_bytes // (4 * 2**20)))
    datas = [store.load_chunk(c) for c in refs[::step][: sample_bytes // (4 * 2**20)]]
    n = sum(len(d) for d in datas)
    cctx, dctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()

    def per_gib(fn):
        t0 = time.thread_time()
        out = [fn(d) for d in datas]
        return (time.thread_time() - t0) / (n / GiB), out

    hash_s, _ = per_gib(lambda d: blake3.blake3(d).digest())
    comp_s, comp = per_gib(cctx.compress)
    t0 = time.thread_time()
    for c in comp:
        dctx.decompress(c)
    decomp_s = (time.thread_time() - t0) / (n / GiB)
    copy_s, _ = per_gib(lambda d: bytearray(d))
    return {"blake3_s_per_gib": hash_s, "zstd_compress_s_per_gib": comp_s, "zstd_decompress_s_per_gib": decomp_s,
            "copy_s_per_gib": copy_s, "compress_ratio": sum(map(len, comp)) / n, "sample_gib": n / GiB}


# -- the nodes ---------------------------------------------------------------------------------

def profile_text(size: str, outside: bool = False) -> tuple[str, str]:
    """(profile name, TOML on this run's ports); ``outside``: the weights-outside-image variant."""
    from tests.conftest import tiny_profile

    if SIZES[size] is None:
        extra = "\n[checkpoint]\nweights_outside_image = true\n" if outside else ""
        return ("tiny-wout" if outside else "tiny"), tiny_profile(ENGINE_PORT, GATE_PORT, name="tiny-wout" if outside else "tiny",
                                                                   extra=extra)
    name = SIZES[size] + ("-wout" if outside else "")
    text = (REPO / "benchmarks" / "profiles" / f"{name}.toml").read_text()
    text = re.sub(r"(?m)^port = 18000", f"port = {ENGINE_PORT}", text)
    return name, re.sub(r"(?m)^port = 8000", f"port = {GATE_PORT}", text)


def node(root: Path, size: str, models: Path, trust: Path | None = None, outside: bool = False, **extra: str) -> dict:
    """An isolated node home under ``root`` with this size's profile and ``models`` as its models
    directory; trusting the public key ``trust`` (node A's)."""
    from tests.conftest import isolated_env

    env = isolated_env(root, ENGINE_PORT, GATE_PORT)
    name, text = profile_text(size, outside)
    (root / "profiles" / f"{name}.toml").write_text(text)
    (root / "home").mkdir(parents=True, exist_ok=True)
    if not (root / "home" / "models").exists():
        (root / "home" / "models").symlink_to(models)
    if trust is not None:
        (root / "keys").mkdir(exist_ok=True)
        shutil.copy(trust, root / "keys" / "node-a.pub")
    env.update(extra)
    return env


def mem_available() -> int:
    """MemAvailable in bytes."""
    return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())[1]) * 1024


def gib_s(nbytes: float, secs: float) -> float:
    return nbytes / GiB / secs if secs > 0 else float("nan")


def compare(files: list[Path]) -> None:
    """The curve across sizes from ``--json`` files of earlier runs: seconds per GiB of each
    command, and the spread (max / min - 1) that the flatness aim bounds at 20%."""
    runs = sorted((json.loads(Path(f).read_text()) for f in files), key=lambda r: r.get("logical_bytes", 0))
    runs = [r for r in runs if "s_per_gib" in r]
    labels = list(dict.fromkeys(k for r in runs for k in r["s_per_gib"]))
    say("seconds per GiB of the snapshot's logical size (" + ", ".join(
        f"{r['size']} {r['logical_bytes'] / GiB:.2f} GiB @ {r['commit']}" for r in runs) + "):")
    for k in labels:
        v = [r["s_per_gib"].get(k) for r in runs]
        got = [x for x in v if x]
        spread = (max(got) / min(got) - 1) if len(got) > 1 else float("nan")
        say(f"  {k:28s} " + "  ".join(f"{x:7.2f}" if x else "      -" for x in v)
            + f"   spread {spread * 100:5.0f}%  {'flat (<= 20%)' if spread <= 0.2 else 'NOT flat'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", type=Path, nargs="+", default=None, metavar="JSON",
                    help="print the per-GiB curve across earlier runs' --json files and exit")
    ap.add_argument("--report", type=Path, default=None, metavar="JSON",
                    help="print the summary and aims of an earlier run's --json file again (adding them to it) and exit")
    ap.add_argument("--size", choices=tuple(SIZES))
    ap.add_argument("--rounds", type=int, default=3, help="warm up/raw pairs (medians; default 3)")
    ap.add_argument("--keep-models", type=Path, default=None, help="build/reuse the models here (kept)")
    ap.add_argument("--work", type=Path, default=None, help="parent of the work directory (default /var/tmp)")
    ap.add_argument("--no-rgw", action="store_true", help="skip Ceph RGW (push, fresh node, pull, boto3)")
    ap.add_argument("--weights-outside", action="store_true",
                    help="the profile's variant with weights outside the image (scale-8g-wout, ...); refused on "
                         "AVX-512 CPU hosts (docs/gpu.md), which the run then reports")
    ap.add_argument("--rgw-store", choices=("auto", "memstore", "bluestore"), default="auto",
                    help="the RGW's OSD: memstore (RAM; faster) or bluestore on a file; auto: memstore when the "
                         "snapshot and the engine fit in available memory")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    a = ap.parse_args()
    if a.compare:
        return compare(a.compare)
    if a.report:
        res = json.loads(a.report.read_text())
        report(res)
        a.report.write_text(json.dumps(res, indent=1, default=str))
        return
    if a.size is None:
        ap.error("--size is required")
    if os.geteuid() != 0:
        sys.exit("scale.py needs root (CRIU, drop_caches)")
    work = Path(tempfile.mkdtemp(prefix=f"warmctl-scale-{a.size}-", dir=a.work or "/var/tmp"))
    models = a.keep_models or (work / "models")
    models.mkdir(parents=True, exist_ok=True)
    res: dict = {"size": a.size, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "load_start": os.getloadavg(), "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                                          capture_output=True, text=True).stdout.strip()}
    try:
        run(a, work, models, res)
    finally:
        res["load_end"] = os.getloadavg()
        shutil.rmtree(work, ignore_errors=True)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1, default=str))
        print(f"load average (1 min): start {res['load_start'][0]:.2f}, end {res['load_end'][0]:.2f}; "
              f"commit {res['commit']}", flush=True)


def say(*parts) -> None:
    print(*parts, flush=True)


def cmd_line(label: str, r: dict, nbytes: float) -> str:
    return (f"  {label:34s} {r['wall_s']:8.2f} s  {gib_s(nbytes, r['wall_s']):6.2f} GiB/s  "
            f"warmctl CPU {r['own_cpu_s']:7.2f} s  (tree {r['tree_cpu_s']:7.2f} s)  peak RSS {r['peak_rss_mib']:6.0f} MiB  "
            f"host iowait {r['host_iowait_s']:6.1f} s")


def strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("stdout", "stderr")}


def run(a, work: Path, models: Path, res: dict) -> None:
    name, _ = profile_text(a.size, a.weights_outside)
    res["profile"] = name
    root_a = work / "a"
    env_a = node(root_a, a.size, models, outside=a.weights_outside)
    os.environ["WARMCTL_CONFIG"] = env_a["WARMCTL_CONFIG"]
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    du = shutil.disk_usage(work)
    res["disk_free_gib_start"] = du.free / GiB
    say(f"{name}: work {work}, {du.free / GiB:.1f} GiB free, load {os.getloadavg()[0]:.2f}, "
        f"mem available {mem_available() / GiB:.1f} GiB")

    # -- the model (built by the CLI's first cold start if missing; timed here when built)
    from warmctl.models import builtinmodels
    from warmctl.records.profile import load_profile

    settings = load_settings()
    prof = load_profile(name, settings.profile_dirs)
    mdir = builtinmodels.builtin_dir(prof.engine.model, settings.models_dir)
    if mdir is not None and not (mdir / "config.json").exists():
        t0 = time.monotonic()
        builtinmodels.build_builtin(prof.engine.model, settings.models_dir)
        dt = time.monotonic() - t0
        wb = sum(p.stat().st_size for p in mdir.glob("*.safetensors"))
        res["model_build"] = {"s": dt, "bytes": wb}
        say(f"built {prof.engine.model}: {wb / GiB:.2f} GiB of weights in {dt:.1f} s ({gib_s(wb, dt):.2f} GiB/s)")

    # -- snapshot
    snap = run_measured(env_a, "snapshot", name, "--json", "--no-push", check=not a.weights_outside)
    if snap["rc"]:
        msg = " ".join(snap["stderr"].split())
        res["snapshot"] = strip(snap)
        res["refused"] = msg[-1500:]
        say(f"snapshot of {name} failed (rc {snap['rc']}) after {snap['wall_s']:.1f} s: the weights-outside-image "
            f"variant cannot be measured on this host:\n  {msg[-1500:]}")
        return
    res["snapshot"] = strip(snap)
    store = open_store(load_settings().store_dir)
    digest = Catalog(store).newest(name)
    m = store.get_manifest(digest)
    logical = m.total_size()
    img_files = [f for f in m.files if f.role == "image"]
    img_bytes = sum(f.size for f in img_files if f.hardlink_to is None)
    from warmctl.store.chunks import is_zero_chunk

    nonzero = sum(c.size for f in m.files if f.hardlink_to is None for c in f.chunks if not is_zero_chunk(c.digest, c.size))
    res["nonzero_bytes"] = nonzero
    stored = sum(p.stat().st_size for p in (Path(load_settings().store_dir) / "chunks").rglob("*") if p.is_file())
    res.update(logical_bytes=logical, image_bytes=img_bytes, stored_bytes=stored, digest=digest)
    say(f"\nsnapshot {digest[:19]}: {logical / GiB:.2f} GiB logical, image {img_bytes / GiB:.2f} GiB, "
        f"non-zero {nonzero / GiB:.2f} GiB, stored {stored / GiB:.2f} GiB (x{stored / logical:.2f})")
    say(cmd_line("snapshot", snap, logical))
    say("  phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in snap["json"]["timings_s"].items()))
    prompt = m.canary.completions[0].prompt
    expected = m.canary.completions[0].token_ids[0]
    model = m.profile["engine"]["served_model_name"]

    res["rates"] = rates(store, m)
    say("  per-core rates on this snapshot's bytes (s/GiB): " + ", ".join(f"{k} {v:.3f}" for k, v in res["rates"].items()))

    def timed_up(env, label: str, nbytes: float, cold: bool = False, stream: bool = True) -> dict:
        env = dict(env, WARMCTL_RESTORE_STREAM="auto" if stream else "never")
        if cold:
            drop_caches()
        t0 = time.monotonic()
        r = run_measured(env, "up", name, "--json", "--cold-start", "never")
        try:
            tok, t1 = first_token(GATE_PORT, prompt, model)
        finally:
            run_measured(env, "down", name, check=False)
        assert tok == expected, f"{label}: first token {tok} != canary {expected}"
        assert r["json"]["path"] == "restore", r["json"]
        r["to_token_s"] = t1 - t0
        r["phases"] = {k: v for k, v in r["json"]["timings_s"].items() if k != "total"}
        r["outside_phases_s"] = r["wall_s"] - sum(r["phases"].values())
        say(cmd_line(label, r, nbytes) + f"  -> token {r['to_token_s']:.2f} s")
        say("      phases: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
            + f", outside phases {r['outside_phases_s']:.2f}" + (f"; fetched {r['json'].get('fetched')}" if r["json"].get("fetched") else ""))
        return strip(r)

    # -- node A: up from the local store (cold), then warm/raw pairs, then cold kept image
    say("\nnode A (local store):")
    images_root = Path(load_settings().home) / "cache" / "images"
    shutil.rmtree(images_root, ignore_errors=True)
    # the image written whole first (restore_stream = never: materialize alone, for its aim), then streamed
    res["up_cold_store"] = timed_up(env_a, "up, no kept image, cold cache, image written first", logical, cold=True,
                                    stream=False)
    shutil.rmtree(images_root, ignore_errors=True)
    res["up_cold_store_streamed"] = timed_up(env_a, "up, no kept image, cold cache, streamed", logical, cold=True)
    kept = [p for p in images_root.rglob("*") if p.is_file() and p.parent.name == "images"]
    img_dirs = sorted({p.parent for p in kept})
    assert len(img_dirs) == 1, f"expected one kept image directory, found {img_dirs}"
    img_dir = img_dirs[0]
    kept_bytes = sum(p.stat().st_size for p in kept)
    raw_dir = work / "raw"
    raw_dir.mkdir()
    port = m.restore.internal_port or ENGINE_PORT
    warm, raw = [], []
    for i in range(a.rounds):
        tok, dt, secs = raw_restore(load_settings(), store, m, name, img_dir, raw_dir, port, prompt, model)
        assert tok == expected, f"raw restore: token {tok} != {expected}"
        raw.append({"to_token_s": dt, "criu_restore_s": secs})
        say(f"  raw criu restore, warm cache            {dt:8.2f} s  {gib_s(kept_bytes, dt):6.2f} GiB/s  (criu restore {secs:.2f} s)")
        warm.append(timed_up(env_a, "up, kept image, warm cache", logical))
    res["raw_warm"], res["up_warm"] = raw, warm
    tok, dt, secs = raw_restore(load_settings(), store, m, name, img_dir, raw_dir, port, prompt, model, cold=True)
    res["raw_cold"] = {"to_token_s": dt, "criu_restore_s": secs}
    say(f"  raw criu restore, cold cache            {dt:8.2f} s  {gib_s(kept_bytes, dt):6.2f} GiB/s  (criu restore {secs:.2f} s)")
    res["up_cold"] = timed_up(env_a, "up, kept image, cold cache", logical, cold=True)
    for cold in (False, True):
        n, dt = dd_read(sorted(kept), cold)
        res[f"dd_image_{'cold' if cold else 'warm'}"] = {"bytes": n, "s": dt}
        say(f"  dd of the kept image, {'cold' if cold else 'warm'} cache          {dt:8.2f} s  {gib_s(n, dt):6.2f} GiB/s  ({n / GiB:.2f} GiB)")
    res["kept_image_bytes"] = kept_bytes
    a_pub = next((root_a / "keys").glob("local-*.pub"))
    shutil.rmtree(images_root, ignore_errors=True)  # node A is measured: its kept image goes, to bound the disk
    shutil.rmtree(raw_dir, ignore_errors=True)
    free = shutil.disk_usage(work).free
    need = 2 * stored + kept_bytes + GiB  # the remote, then a fresh node's store and kept image
    res["disk_free_gib_before_remotes"], res["disk_needed_gib_remotes"] = free / GiB, need / GiB
    if need > free:
        res["remotes_skipped"] = (f"the remote phases need about {need / GiB:.1f} GiB of disk (remote {stored / GiB:.1f}, "
                                  f"fresh node's store {stored / GiB:.1f} and kept image {kept_bytes / GiB:.1f} GiB): "
                                  f"{free / GiB:.1f} GiB free")
        say(f"\nremote phases skipped: {res['remotes_skipped']}")
        run_measured(env_a, "down", name, check=False)
        return report(res)

    # -- remotes: directory, then RGW (each removed before the next, to bound the disk)
    remotes = [("dir", str(work / "remote"), {})]
    for kind, url, extra in remotes + ([("rgw", None, None)] if not a.no_rgw else []):
        if kind == "rgw":
            from contextlib import ExitStack

            import boto3
            from ports import free_port
            from rgw_server import start_rgw

            mem = int(stored * 1.3 + GiB)  # the OSD's capacity (memstore allocates as objects arrive)
            avail = mem_available()
            need = int(stored * 1.1) + logical + GiB  # what a memstore holds, the restored engine, headroom
            objectstore = a.rgw_store
            if objectstore == "auto":
                objectstore = "memstore" if need <= avail else "bluestore"
            res["rgw_objectstore"] = objectstore
            if objectstore != "memstore" or need > avail:
                res["rgw_objectstore_why"] = (f"a memstore RGW would hold about {stored * 1.1 / GiB:.1f} GiB of RAM for "
                                              f"{stored / GiB:.1f} GiB stored, plus {logical / GiB:.1f} GiB for the restored "
                                              f"engine: {need / GiB:.1f} GiB > {avail / GiB:.1f} GiB available")
                say(f"\nRGW on bluestore (a file under the work dir): {res['rgw_objectstore_why']}")
            stack = ExitStack()
            ep, ak, sk = stack.enter_context(start_rgw(work / "ceph", free_port(), free_port(), capacity_bytes=mem,
                                                                objectstore=objectstore, timeout=120))
            extra = {"WARMCTL_S3_ENDPOINT": ep, "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk,
                     "AWS_DEFAULT_REGION": "us-east-1"}
            bucket = f"scale-{uuid.uuid4().hex[:8]}"
            s3 = boto3.client("s3", endpoint_url=ep, aws_access_key_id=ak, aws_secret_access_key=sk, region_name="us-east-1")
            s3.create_bucket(Bucket=bucket)
            url = f"s3://{bucket}/warmctl"
        else:
            stack = None
        try:
            say(f"\n{kind} remote ({url}), disk free {shutil.disk_usage(work).free / GiB:.1f} GiB:")
            r = run_measured(dict(env_a, **extra), "push", name, "--to", url)
            res[f"push_{kind}"] = strip(r)
            say(cmd_line(f"push to {kind}", r, logical))
            fresh = work / f"fresh-{kind}"
            env_b = node(fresh, a.size, models, trust=a_pub, outside=a.weights_outside, WARMCTL_REMOTE_STORE=url, **extra)
            res[f"up_fresh_{kind}_written_first"] = timed_up(env_b, f"up, fresh node from {kind}, image written first",
                                                             logical, stream=False)
            shutil.rmtree(fresh, ignore_errors=True)
            env_b = node(fresh, a.size, models, trust=a_pub, outside=a.weights_outside, WARMCTL_REMOTE_STORE=url, **extra)
            res[f"up_fresh_{kind}"] = timed_up(env_b, f"up, fresh node from {kind}, streamed", logical)
            shutil.rmtree(fresh, ignore_errors=True)
            pull_root = work / f"pull-{kind}"
            env_p = node(pull_root, a.size, models, trust=a_pub, outside=a.weights_outside, **extra)
            r = run_measured(env_p, "pull", name, "--from", url)
            res[f"pull_{kind}"] = strip(r)
            say(cmd_line(f"pull from {kind} (empty store)", r, logical))
            shutil.rmtree(pull_root, ignore_errors=True)
            if kind == "dir":
                files = sorted(p for p in (work / "remote" / "chunks").rglob("*") if p.is_file())
                n, dt = dd_read(files, cold=True)
                res["dd_remote_dir_cold"] = {"bytes": n, "s": dt}
                say(f"  dd of the remote's chunk files, cold    {dt:8.2f} s  {gib_s(n, dt):6.2f} GiB/s  ({n / GiB:.2f} GiB stored)")
                shutil.rmtree(work / "remote", ignore_errors=True)
            else:
                prefix = "warmctl/"
                keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "chunks/")
                        for o in page.get("Contents", [])]
                from warmctl.records.config import load_settings
                from warmctl.store import open_store as _open

                os.environ.update(extra)  # the S3 endpoint and credentials, for this process's store
                workers = _open(url, settings=load_settings()).workers
                n, dt = boto3_download(s3, bucket, keys, work / "boto3", workers)
                res["boto3_download"] = {"bytes": n, "s": dt, "objects": len(keys), "threads": workers}
                say(f"  boto3 download_file of the chunks       {dt:8.2f} s  {gib_s(n, dt):6.2f} GiB/s  "
                    f"({len(keys)} objects, {n / GiB:.2f} GiB, {workers} threads)")
                shutil.rmtree(work / "boto3", ignore_errors=True)
        finally:
            if stack is not None:
                stack.close()
    run_measured(env_a, "down", name, check=False)
    report(res)


def report(res: dict) -> None:
    """The summary: per-GiB costs, where the CPU goes, and the scaling aims."""
    L, rt = res["logical_bytes"], res["rates"]
    gl = L / GiB
    say(f"\nsummary ({res['size']}, {gl:.2f} GiB logical, stored {res['stored_bytes'] / GiB:.2f} GiB):")
    rows = [("snapshot", res["snapshot"]), ("up cold, from local store", res["up_cold_store"]),
            *([("up cold, local store, streamed", res["up_cold_store_streamed"])] if "up_cold_store_streamed" in res else []),
            ("up warm (median)", min(res["up_warm"], key=lambda r: abs(r["to_token_s"] - statistics.median(x["to_token_s"] for x in res["up_warm"])))),
            ("up cold, kept image", res["up_cold"])]
    rows += [(f"{k.replace('_', ' ')}", res[k]) for k in ("push_dir", "up_fresh_dir_written_first", "up_fresh_dir", "pull_dir", "push_rgw",
                                                         "up_fresh_rgw_written_first", "up_fresh_rgw", "pull_rgw") if k in res]
    per_gib = {}
    for label, r in rows:
        per_gib[label] = r["wall_s"] / gl
        say(f"  {label:28s} {r['wall_s']:8.2f} s  {r['wall_s'] / gl:6.2f} s/GiB  warmctl CPU {r['own_cpu_s'] / gl:6.2f} s/GiB  "
            f"peak RSS {r['peak_rss_mib']:5.0f} MiB")
    res["s_per_gib"] = per_gib
    # the CPU the data work needs at the rates measured here, per GiB (one core)
    est = {"snapshot: hash + compress": rt["blake3_s_per_gib"] + rt["zstd_compress_s_per_gib"],
           "materialize: decompress + hash + copy": rt["zstd_decompress_s_per_gib"] + rt["blake3_s_per_gib"] + rt["copy_s_per_gib"],
           "push/pull: hash (verify) + copy": rt["blake3_s_per_gib"] + rt["copy_s_per_gib"]}
    res["cpu_needed_s_per_gib"] = est
    say("  CPU the data work needs at this run's per-core rates, per GiB of non-zero data: "
        + ", ".join(f"{k} {v:.2f} s/GiB" for k, v in est.items()))
    nz = res["nonzero_bytes"] / GiB
    mat = res["up_cold_store"]["phases"].get("materialize")
    if mat:
        say(f"  up from the local store, cold: materialize {mat:.2f} s for {gl:.2f} GiB ({gl / mat:.2f} GiB/s); "
            f"CPU estimate {est['materialize: decompress + hash + copy'] * nz:.2f} s for {nz:.2f} GiB non-zero; warmctl CPU {res['up_cold_store']['own_cpu_s']:.2f} s; "
            f"host iowait {res['up_cold_store']['host_iowait_s']:.1f} s")

    aims = []
    wu = statistics.median(r["to_token_s"] for r in res["up_warm"])
    rw = statistics.median(r["to_token_s"] for r in res["raw_warm"])
    aims.append(("up warm / raw CRIU restore (to first token)", wu / rw, 1.1, "<="))
    for kind, label, bound in (("dir", "dir", 1.3), ("rgw", "RGW", 1.5)):
        if f"up_fresh_{kind}" in res:
            aims.append((f"fresh node from {label} / up warm", res[f"up_fresh_{kind}"]["to_token_s"] / wu, bound, "<="))
        if f"up_fresh_{kind}_written_first" in res:  # the same, restore_stream = never: what streaming saved
            aims.append(("  (image written first, not streamed)", res[f"up_fresh_{kind}_written_first"]["to_token_s"] / wu,
                         None, "<="))
    if mat:
        dd = res["dd_image_cold"]
        aims.append(("materialize from store / dd of image, cold (GiB/s)", (L / mat) / (dd["bytes"] / dd["s"]), 0.9, ">="))
    if "boto3_download" in res and "pull_rgw" in res:
        b = res["boto3_download"]
        aims.append(("pull from RGW / boto3 download_file (throughput)",
                     (res["stored_bytes"] / res["pull_rgw"]["wall_s"]) / (b["bytes"] / b["s"]), None, ">="))
    peak = max(r["peak_rss_mib"] for r in [res["snapshot"], res["up_cold_store"], *res["up_warm"], res["up_cold"]]
               + [res[k] for k in ("push_dir", "pull_dir", "push_rgw", "pull_rgw", "up_fresh_dir", "up_fresh_rgw",
                                   "up_cold_store_streamed", "up_fresh_dir_written_first", "up_fresh_rgw_written_first")
                  if k in res])
    aims.append(("peak RSS of any warmctl command (MiB)", peak, 512, "<="))
    res["aims"] = []
    say("\naims (per-GiB flatness: compare s/GiB above across sizes):")
    for label, v, bound, op in aims:
        ok = None if bound is None else (v <= bound if op == "<=" else v >= bound)
        res["aims"].append({"aim": label, "value": v, "bound": bound, "op": op, "met": ok})
        say(f"  {label:52s} {v:8.2f}  aim {op} {bound if bound is not None else '-'}  "
            f"{'-' if ok is None else ('met' if ok else 'NOT met')}")
    overlap_floors(res, wu)


def overlap_floors(res: dict, warm_s: float) -> None:
    """The fresh-node aims' floor under a perfect overlap, from this run's own rows: a fresh
    node must at least fetch and verify what the warm node already has (``pull`` into an empty
    store, the same bytes) and restore (the warm ``up``), so with fetching fully overlapped with
    the restore its first token comes no sooner than max(pull, warm up). Where that floor over
    the warm ``up`` is above the aim, the fetch itself bounds it, whatever warmctl overlaps."""
    res["overlap_floor"] = {}
    for kind, aim in (("dir", 1.3), ("rgw", 1.5)):
        if f"pull_{kind}" not in res or f"up_fresh_{kind}" not in res:
            continue
        pull_s, fresh_s = res[f"pull_{kind}"]["wall_s"], res[f"up_fresh_{kind}"]["to_token_s"]
        floor = max(pull_s, warm_s) / warm_s
        res["overlap_floor"][kind] = {"pull_s": pull_s, "floor_x_warm": floor, "fresh_x_warm": fresh_s / warm_s, "aim": aim}
        say(f"  fresh node from {kind}: pull alone {pull_s:.2f} s = {pull_s / warm_s:.2f}x up warm; perfect-overlap floor "
            f"{floor:.2f}x (aim {aim}): {'the fetch itself bounds the aim' if floor > aim else 'reachable by overlap'}; "
            f"measured {fresh_s / warm_s:.2f}x, of which {max(0.0, fresh_s - max(pull_s, warm_s)):.2f} s above the floor")


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
