"""GPU throughput benchmark: checkpoint and restore a CUDA process holding 8, 32 and 64 GiB of GPU
memory with warmctl's CUDA checkpoint and CRIU pieces, against the pinned copy floor. Run by
``scripts/gpu-check.sh --bench`` (root, one NVIDIA GPU, driver 570+, CRIU 4.2+, no network).

1. floor: host->device and device->host copy rates through a pinned buffer
   (``gpu_bench_holder.py floor``, its own process, so the holders below start on a clean GPU).
2. per size, smallest first, one holder process (``gpu_bench_holder.py serve``: half random
   bytes like weights, half zeros like a fresh KV cache) started like an engine, in its own PID
   namespace under warmctl's launcher:
   - weights reload: the random half (up to ``--weights-max-gib``) saved with warmctl's worker
     extension, zeroed in place, loaded back in place (timed by the extension), digest checked;
     the file is deleted before the checkpoint;
   - ``full``: lock and checkpoint (:func:`warmctl.checkpoint.ranks.checkpoint_ranks`), CRIU
     dump (:func:`warmctl.checkpoint.criu.dump`), CRIU restore, free-memory check, CUDA restore
     and unlock (:func:`warmctl.checkpoint.ranks.restore_ranks`), digest checked again;
   - ``cuda-only``, when host RAM or the image directory cannot take a CRIU image of this size
     (:func:`plan_size`): lock, checkpoint, restore, unlock in place, without CRIU;
   - ``skip`` when even that does not fit, or the time left is less than the size would take
     (:func:`estimate_s`, scaled from the sizes already run).

Figures per phase: seconds, GB/s (tensor bytes held / seconds, GB = 1e9) and the ratio to the
floor of the phase's direction: device->host for lock, checkpoint and dump, host->device for
CRIU restore, CUDA restore, unlock and the weights reload. Printed as ``[gpu-bench]`` lines, one
JSON line (also written to ``WORK/bench.json``), then ``[gpu-bench] PASS ...`` or
``[gpu-bench] FAIL ...`` last. Exit 0 on PASS: every size that ran kept its bytes intact,
nothing failed, at least one size ran.

Time and clean-up, as scripts/gpu_check.py (whose :class:`Budget`, :class:`Cleanup` and
SIGTERM handling this reuses): every wait is bounded by ``--limit`` less 40 s; SIGTERM (the
``timeout`` of gpu-check.sh) becomes an exception; after each size, and on any exit, the
holder's ranks are brought back to RUNNING, its PID namespace and launcher are SIGKILLed and
the size's images and weights files are removed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from warmctl.checkpoint import criu, cuda, nvml, ranks  # noqa: E402


class _Knobs:
    """The host paths this script passes down to warmctl's checkpoint modules, read here, at its
    edge, from the variables ``warmctl config show`` documents (``criu``, ``xtile_perm_lib``,
    ``libcuda``, ``cuda_checkpoint``, ``libnvml``). Not warmctl's config loader: the GPU
    machine's venv holds only what the checkpoint modules import (no pydantic)."""

    def __init__(self, env: dict[str, str] | None = None):
        e = os.environ if env is None else env
        self.criu = e.get("WARMCTL_CRIU") or None
        self.xtile_perm_lib = e.get("WARMCTL_XTILE_PERM_LIB") or None
        self.libcuda = e.get("WARMCTL_LIBCUDA") or None
        self.cuda_checkpoint = e.get("WARMCTL_CUDA_CHECKPOINT") or None
        self.libnvml = e.get("WARMCTL_LIBNVML") or None


def _load(name: str):
    """``scripts/<name>.py`` as a module (the scripts directory is no package)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gc = _load("gpu_check")

GiB = 1 << 30
#: Host RAM and image space kept free beyond what a size needs: the holder's own memory (torch,
#: the CUDA libraries), which is in its image too, and room for everything else on the machine.
MARGIN = 8 * GiB
#: The phases, in order, and which floor each is compared with.
PHASES = {"lock": "d2h", "checkpoint": "d2h", "criu_dump": "d2h",
          "criu_restore": "h2d", "cuda_restore": "h2d", "unlock": "h2d"}
#: Sums of phases: snapshot = lock + checkpoint + dump; restore = CRIU restore + free-memory
#: check + CUDA restore + unlock.
TOTALS = {"snapshot": ("d2h", ("lock", "checkpoint", "criu_dump")),
          "restore": ("h2d", ("criu_restore", "precheck", "cuda_restore", "unlock"))}
DEFAULT_SIZES_GIB = (8.0, 32.0, 64.0)
DEFAULT_LIMIT_S = 240.0


def parse_sizes(text: str) -> list[float]:
    """``"8,32,64"`` -> ``[8.0, 32.0, 64.0]`` (GiB, sorted, each > 0 and at most 1024)."""
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GiB, e.g. 8,32,64") from None
    if not sizes or any(not 0 < s <= 1024 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be > 0 and <= 1024 GiB")
    return sorted(sizes)


def in_ram(path: Path) -> bool:
    """True when ``path`` lies on a tmpfs or ramfs (/proc/self/mounts, longest mount point)."""
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        return False
    return fstype in ("tmpfs", "ramfs")


def image_dirs(paths: list[Path]) -> list[tuple[Path, int, bool]]:
    """``(path, free bytes, in RAM)`` of each candidate that exists or can be created."""
    out = []
    for p in paths:
        try:
            p.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(p)
        except OSError:
            continue
        out.append((p, st.f_bavail * st.f_frsize, in_ram(p)))
    return out


def _first_fit(need: int, mem_available: int, dirs: list[tuple[Path, int, bool]], margin: int) -> Path | None:
    """The first of ``dirs`` with ``need + margin`` bytes free (and host RAM for them, if in RAM)."""
    return next((p for p, free, ram in dirs if free >= need + margin and (not ram or mem_available >= need + margin)), None)


def plan_size(nbytes: int, weights_bytes: int, mem_available: int, dirs: list[tuple[Path, int, bool]],
              margin: int = MARGIN) -> tuple[str, Path | None, str]:
    """How to measure a holder of ``nbytes`` of GPU memory whose reload saves ``weights_bytes``:
    ``("full", dir, "")``, ``("cuda-only", dir, why)`` or ``("skip", None, why)``; ``dir``
    holds the CRIU image and the weights file (deleted before the checkpoint).

    The CUDA checkpoint stages all ``nbytes`` in host RAM; CRIU then writes them into the image
    (about ``nbytes`` more, in RAM too when the directory is a tmpfs). ``full`` takes the first
    of ``dirs`` (``(path, free bytes, in RAM)``) with room for the image and host RAM for both;
    ``cuda-only`` needs host RAM for the staging and a directory for the weights file. Every
    need is counted with ``margin`` on top (the holder's own memory is in its image too)."""
    staging = nbytes + margin
    gib = lambda b: f"{b / GiB:.3g} GiB"  # noqa: E731
    if mem_available < staging:
        return "skip", None, f"the driver stages {gib(nbytes)} in host RAM: {gib(mem_available)} available, {gib(staging)} needed"
    for path, free, ram in dirs:
        if free >= nbytes + margin and (not ram or mem_available >= staging + nbytes):
            return "full", path, ""
    wdir = _first_fit(weights_bytes, mem_available, dirs, margin)
    where = ", ".join(f"{p} ({gib(f)} free{', RAM' if r else ''})" for p, f, r in dirs) or "none usable"
    if wdir is None:
        return "skip", None, f"no directory takes the {gib(weights_bytes)} weights file: {where}"
    return "cuda-only", wdir, (f"a CRIU image of {gib(nbytes)} needs {gib(nbytes + margin)} free and host RAM "
                               f"for it (in RAM dirs) besides the driver's {gib(staging)}; host RAM available "
                               f"{gib(mem_available)}, image dirs: {where}; CRIU phases not measured at this size")


def estimate_s(done: list[dict], nbytes: int, mode: str) -> float | None:
    """Seconds a size of ``nbytes`` measured in ``mode`` would take, from the sizes run
    (``done``: their result dicts: ``bytes``, ``seconds`` in all, ``start_s`` of the holder,
    ``phases``): the slowest start, plus the slowest seconds per byte of the rest, less the CRIU
    phases, plus (``full`` only) the slowest CRIU seconds per byte. None before any has run."""
    if not done:
        return None

    def criu_s(r: dict) -> float:
        return sum(r["phases"][k]["s"] for k in ("criu_dump", "criu_restore") if k in r["phases"])

    rest = max((r["seconds"] - r["start_s"] - criu_s(r)) / r["bytes"] for r in done)
    criu_rate = max((criu_s(r) / r["bytes"] for r in done if r["mode"] == "full"), default=0.0)
    return max(r["start_s"] for r in done) + nbytes * (rest + (criu_rate if mode == "full" else 0.0))


def rates(nbytes: int, seconds: dict[str, float], floor: dict) -> dict[str, dict]:
    """``{name: {"s", "gb_per_s", "ratio_to_floor"}}``: each of :data:`PHASES` in ``seconds``,
    then each of :data:`TOTALS` (the sum of its phases), GB/s as ``nbytes`` / 1e9 / seconds
    (None for 0 s) and the ratio to ``floor``'s rate in the phase's direction."""
    picked = {ph: (d, seconds[ph]) for ph, d in PHASES.items() if ph in seconds}
    picked |= {t: (d, sum(seconds.get(p, 0.0) for p in parts)) for t, (d, parts) in TOTALS.items()}
    out = {}
    for ph, (direction, s) in picked.items():
        fl = floor.get(f"{direction}_gb_per_s")
        gbs = nbytes / 1e9 / s if s > 0 else None
        out[ph] = {"s": round(s, 4), "gb_per_s": None if gbs is None else round(gbs, 2),
                   "ratio_to_floor": None if gbs is None or not fl else round(gbs / fl, 3)}
    return out


class Bench:
    """One run: the floor, then the sizes. ``res`` is the JSON printed at the end."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.st = st = _Knobs()
        self.budget = gc.Budget(a.limit)
        self.api: cuda.CheckpointAPI | None = cuda.load(st.libcuda, st.cuda_checkpoint) if a.device == "cuda" else None
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.res: dict = {"driver": nvml.driver_version(st.libnvml), "gpus": [g.uuid for g in nvml.gpus(st.libnvml)],
                          "api": self.api.kind if self.api else None, "device": a.device, "limit_s": a.limit,
                          "sizes_gib": a.sizes, "runs": []}
        self.done: list[dict] = []

    def holder_cmd(self, *args: str) -> list[str]:
        return [sys.executable, str(HERE / "gpu_bench_holder.py"), *args, "--device", self.a.device]

    def floor(self) -> dict:
        out = subprocess.run(self.holder_cmd("floor", str(int(self.a.floor_gib * GiB))), env=self.env,
                             capture_output=True, text=True, timeout=self.budget.left(90, "the copy floor"))
        if out.returncode != 0:
            raise RuntimeError(f"copy floor failed (rc {out.returncode}): " + " | ".join(out.stderr.strip().splitlines()[-3:]))
        return json.loads(out.stdout.strip().splitlines()[-1])

    def run(self) -> bool:
        try:
            self.res["floor"] = fl = self.floor()
            say(f"floor: {fl['h2d_gb_per_s']} GB/s host->device, {fl['d2h_gb_per_s']} GB/s device->host "
                f"({fl['bytes'] / GiB:g} GiB, {'pinned' if fl['pinned'] else 'host memcpy, no GPU'})")
        except Exception as e:  # the sizes still run (their ratios are then None)
            self.res["floor"] = {"error": f"{type(e).__name__}: {e}"}
            say(f"floor: FAILED: {self.res['floor']['error']}")
        for gib in self.a.sizes:
            r: dict = {}
            self.res["runs"].append(r)  # before it runs: an interrupted size is reported too
            self.size(int(gib * GiB) >> 20 << 20, r)  # after a failure the next sizes still run
        ran = [r for r in self.res["runs"] if r.get("intact")]
        return "error" not in self.res["floor"] and bool(ran) and all(r.get("intact") or r.get("skipped") for r in self.res["runs"])

    def size(self, nbytes: int, r: dict) -> None:
        a = self.a
        r.update(size_gib=nbytes / GiB, bytes=nbytes)
        dirs = image_dirs(a.image_dirs)
        reload = min(nbytes // 2, int(a.weights_max_gib * GiB))
        mode, base, why = plan_size(nbytes, reload, ranks.host_available_bytes() or 0, dirs)
        if mode == "full" and a.cuda_only:
            mode, why = "cuda-only", "--cuda-only"
        est = estimate_s(self.done, nbytes, mode)
        left = self.budget.end - time.monotonic()
        if mode != "skip" and est is not None and est > left:
            mode, why = "skip", f"would take ~{est:.0f} s (scaled from the sizes run), {left:.0f} s left"
        r["mode"] = mode
        if why:
            r["why"] = why
        if mode == "skip":
            r["skipped"] = True
            say(f"{nbytes / GiB:g} GiB: skipped: {why}")
            return
        work = base / f"warmctl-gpu-bench-{os.getpid()}-{nbytes >> 20}M"
        r["dir"] = str(work)
        say(f"{nbytes / GiB:g} GiB: {mode} in {work}" + (f" ({why})" if why else ""))
        t_start = time.monotonic()
        clean = gc.Cleanup(self.api)
        clean.paths.append(work)
        log = open(a.work / f"holder-{nbytes >> 20}M.log", "a")
        try:
            self.measure(nbytes, mode, work, clean, log, r)
        except BaseException as e:  # reported, then cleaned up; SIGTERM (Terminated) goes on up
            r["error"] = f"{type(e).__name__}: {e} (holder log: {log.name})"
            if isinstance(e, (gc.Terminated, KeyboardInterrupt)):  # not SystemExit: gpu_check's waits raise it
                raise
            for f in (work / "img").glob("*.log"):  # a failed size's CRIU logs outlive its image
                shutil.copy(f, a.work / f"{nbytes >> 20}M-{f.name}")
        finally:
            r["cleanup"] = clean.run(final=False)
            log.close()
            r["seconds"] = round(time.monotonic() - t_start, 2)
            report(r)
        if r.get("intact"):
            self.done.append(r)

    def measure(self, nbytes: int, mode: str, work: Path, clean, log, r: dict) -> None:
        a, b = self.a, self.budget
        port = a.port
        launcher, root = gc.start_in_pid_namespace(
            self.holder_cmd("serve", str(port), str(nbytes), "--weights-max", str(int(a.weights_max_gib * GiB))),
            log, self.env, b, clean)
        r["start_s"] = round(gc.wait_health(port, b.left(120, "the holder's start"), launcher), 3)
        info = gc.post(port, [], path="/info", body={}, timeout=b.left(30, "the holder's info"))
        want = info["digest"]
        r.update(fill_s=info["fill_s"], weights_bytes=info["weights_bytes"], kv_bytes=info["kv_bytes"])
        if want["kv_nonzero"] != 0:
            raise RuntimeError(f"the zero half has {want['kv_nonzero']} non-zero bytes after the fill")

        def call(path: str, body: dict | None = None, what: str = "", want_s: float = 60) -> dict:
            out = gc.post(port, [], path=path, body=body or {}, timeout=b.left(want_s, what or path))
            if "error" in out:
                raise RuntimeError(f"holder {path} {body}: {out['error']}")
            return out

        def digest(when: str) -> None:
            got = call("/digest", what=f"the digest {when}")["digest"]
            if got != want:
                raise RuntimeError(f"bytes changed {when}: digest {got}, wanted {want}")

        wdir = work / "weights"
        wbytes = info["reload_bytes"]
        io_s = max(60.0, wbytes / 1e9)  # >= 1 GB/s
        r["weights_save_s"] = round(call("/weights", {"op": "save", "dir": str(wdir)}, "weights save", io_s)["seconds"], 3)
        call("/weights", {"op": "zero"}, "weights zero")
        if wbytes and call("/digest", what="the digest after zeroing")["digest"] == want:
            raise RuntimeError("zeroing the weights did not change the digest")
        loaded = call("/weights", {"op": "load", "dir": str(wdir)}, "weights load", io_s)
        digest("after the weights reload")
        shutil.rmtree(wdir, ignore_errors=True)
        fl = self.res["floor"]
        r["weights_reload"] = {"bytes": loaded["bytes"], "s": round(loaded["seconds"], 4),
                               "gb_per_s": round(loaded["bytes"] / 1e9 / max(loaded["seconds"], 1e-9), 2)}
        r["weights_reload"]["ratio_to_floor"] = round(r["weights_reload"]["gb_per_s"] / fl["h2d_gb_per_s"], 3) if "h2d_gb_per_s" in fl else None

        st = self.st
        pids = ranks.gpu_rank_pids(root, nvml_path=st.libnvml)
        r["ranks"] = pids
        clean.ranks += pids
        if a.device == "cuda" and not pids:
            raise RuntimeError(f"no GPU process found in the holder's tree (root {root})")
        if pids and self.api is None:
            self.api = clean.api = cuda.load(st.libcuda, st.cuda_checkpoint)
        copy_s = max(60.0, nbytes / 2e9)  # a driver copy slower than 2 GB/s counts as stuck
        seconds: dict[str, float] = r.setdefault("phase_s", {})  # filled as it goes: a failure keeps what was timed

        def timed(report: ranks.RankReport, **names: str) -> None:  # {our phase: the report's phase}
            seconds.update({k: report.phases[v] for k, v in names.items() if v in report.phases})

        try:
            with ranks.checkpoint_ranks(pids, lock_timeout_s=b.left(30, "the CUDA lock"), api=self.api,
                                        checkpoint_timeout_s=b.left(copy_s, "the CUDA checkpoint"),
                                        resume_timeout_s=min(20.0, gc.CLEANUP_TIMEOUT_S), resume=False,
                                        nvml_path=st.libnvml) as snap:
                timed(snap, lock="lock", checkpoint="checkpoint")
                if mode == "full":
                    seconds["criu_dump"] = criu.dump(root, work / "img", timeout_s=b.left(max(120.0, nbytes / 0.5e9), "criu dump"),
                                                     binary=st.criu)
        except ranks.RankCheckpointError as e:
            timed(e.report, lock="lock", checkpoint="checkpoint")
            raise
        r["gpu_bytes"] = snap.gpu_bytes
        targets = pids
        if mode == "full":
            launcher.wait(timeout=b.left(30, "the dumped tree's exit"))
            r["image_bytes"] = sum(f.stat().st_size for f in (work / "img").rglob("*") if f.is_file())
            new_root, seconds["criu_restore"] = criu.restore(work / "img", work / "restore.pid",
                                                             timeout_s=b.left(max(120.0, nbytes / 0.5e9), "criu restore"),
                                                             binary=st.criu, xtile_lib=st.xtile_perm_lib)
            clean.roots.append(new_root)
            targets = ranks.restored_ranks(new_root, snap.nspids) if pids else []
            clean.ranks += targets
        after = {"precheck": "precheck", "cuda_restore": "restore", "unlock": "unlock"}
        try:
            timed(ranks.restore_ranks(targets, required_free_bytes=snap.gpu_bytes or None, api=self.api, nvml_path=st.libnvml,
                                      restore_timeout_s=b.left(copy_s, "the CUDA restore"),
                                      unlock_timeout_s=b.left(30, "the CUDA unlock")), **after)
        except ranks.RankCheckpointError as e:
            timed(e.report, **after)
            raise
        if mode == "full":
            shutil.rmtree(work / "img", ignore_errors=True)  # frees its RAM before the digest
        digest("after the checkpoint and restore")
        r["intact"] = True
        r["phases"] = rates(nbytes, seconds, fl)
        r["precheck_s"] = round(seconds.get("precheck", 0.0), 4)


def say(msg: str) -> None:
    print(f"[gpu-bench] {msg}", flush=True)


def report(r: dict) -> None:
    """The human lines of one size: one per phase, the weights reload, the error if any."""
    head = f"{r['size_gib']:g} GiB {r['mode']}"
    rows = dict(r.get("phases", {}))
    if "weights_reload" in r:
        rows["weights load"] = r["weights_reload"]
    for name, ph in rows.items():
        gbs, x = ph["gb_per_s"], ph["ratio_to_floor"]
        say(f"{head:>18} {name:>13}: {ph['s']:8.3f} s " + ("    (none)" if gbs is None else
            f"{gbs:8.2f} GB/s = " + ("?" if x is None else f"{x:.3f}") + " x floor") + (f" ({ph['bytes'] / GiB:g} GiB)" if "bytes" in ph else ""))
    if r.get("error"):
        say(f"{head:>18} error: {r['error']}")
    say(f"{head:>18} took {r['seconds']:.1f} s; clean-up: {r['cleanup']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="directory for logs and bench.json (required unless --imports-only)")
    ap.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES_GIB),
                    help="GiB of GPU memory per holder, comma-separated (default 8,32,64)")
    ap.add_argument("--limit", type=float, default=float(os.environ.get("GPU_BENCH_TIMEOUT_S", DEFAULT_LIMIT_S)),
                    help=f"seconds the caller allows (gpu-check.sh's timeout); every wait ends {gc.CLEANUP_RESERVE_S:g} s before it")
    ap.add_argument("--floor-gib", type=float, default=4.0, help="bytes copied each way for the floor (GiB)")
    ap.add_argument("--weights-max-gib", type=float, default=16.0, help="most GiB saved and reloaded as weights per size")
    ap.add_argument("--image-dirs", type=lambda s: [Path(p) for p in s.split(",") if p], default=None,
                    help="where CRIU images and weights files go, first that fits (default /dev/shm, then --work)")
    ap.add_argument("--cuda-only", action="store_true", help="no CRIU at any size: lock, checkpoint, restore, unlock in place")
    ap.add_argument("--port", type=int, default=18778)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the holders keep host memory (for tests on a machine without a GPU)")
    ap.add_argument("--imports-only", action="store_true", help="exit 0 once the imports succeeded")
    a = ap.parse_args(argv)
    if a.imports_only:
        _load("gpu_bench_holder")  # torch and warmctl.engine.worker_ext, as the holders import them
        say("imports ok: warmctl.checkpoint.{criu,cuda,nvml,ranks}, scripts/gpu_check.py, scripts/gpu_bench_holder.py")
        return 0
    if a.work is None:
        ap.error("--work is required")
    if a.limit <= gc.CLEANUP_RESERVE_S:
        ap.error(f"--limit {a.limit:g}: must exceed the {gc.CLEANUP_RESERVE_S:g} s kept for the clean-up")
    a.work = a.work.resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.image_dirs is None:
        a.image_dirs = [Path("/dev/shm"), a.work]
    gc.install_sigterm()
    bench = None
    ok = False
    res: dict = {}
    try:
        bench = Bench(a)
        res = bench.res
        ok = bench.run()
    except BaseException as e:  # SIGTERM arrives as Terminated; every size cleaned up after itself
        res["error"] = f"{type(e).__name__}: {e}"
    res["ok"] = ok
    line = json.dumps(res)
    (a.work / "bench.json").write_text(line + "\n")
    print(line, flush=True)
    runs = res.get("runs", [])
    summary = ", ".join(f"{r['size_gib']:g} GiB {'skipped' if r.get('skipped') else r['mode']}" for r in runs)
    errors = ([f"floor: {res['floor']['error']}"] if "error" in res.get("floor", {}) else []) + \
        [r["error"] for r in runs if r.get("error")] + ([res["error"]] if res.get("error") else [])
    say(("PASS" if ok else "FAIL") + f": {summary or 'no size run'}" + (f"; {errors[0]}".replace("\n", " | ") if errors else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
