"""Store throughput vs this machine's limits, on real CRIU pages (docs/benchmarks.md#store).

The payload (``--size-gib``, default 4) is built from a real CRIU image (``criu_payload.py``):
by default the benchmark starts a Python process holding torch/numpy "model" tensors and heap
objects and CRIU-dumps it; ``--criu-image DIR`` uses an existing image directory and
``--from-store DIR`` the CRIU pages of a snapshot in a local store. Its pages alternate with zero
regions (``--zero-share``); the file is written out in full (not sparse).

Measured in one run, the sides interleaved, ``--rounds`` times, medians reported:

  memcpy             numpy copy of a 1 GiB buffer (one core)
  plain read         ``dd bs=4M`` of the payload file to /dev/null, page cache cold and warm
  read_file local    ``Store.read_file`` local store -> file (materialize, every chunk verified), cold and warm
  pull local         ``copy_manifest`` local store -> new local store (fsync'ed objects), cold and warm
  add_file           local store ingest (read, zero check, hash, compress, write), once
  push / pull S3     local <-> S3 (``--s3 moto`` by default, ``rgw`` for a throwaway Ceph RGW
                     from tests/rgw_server.py, or an endpoint URL); ``--s3-size-gib`` payload
  read_file S3       straight from S3 to a file, filling a local cache (what ``up`` does)
  boto3 download     ``download_file`` of the same bytes as one object, TransferConfig defaults
                     and with the store's concurrency and part size
  hash / zstd        one core's BLAKE3, zstd -1 compress and decompress rates on the real chunks

"Cold" = ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root) before the step, checked with
``fincore``; when that is not allowed, ``posix_fadvise(DONTNEED)`` on every file involved.

Usage: ``python benchmarks/store_throughput.py [--size-gib 4] [--s3-size-gib 1] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _pagecache import dontneed, resident  # noqa: E402
from criu_payload import build_payload, dump_sample_process, pages_from_store, pages_in  # noqa: E402

from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest  # noqa: E402
from warmctl.store import CHUNK_SIZE, DIGEST_ALGORITHM, ZSTD_LEVEL, copy_manifest, open_store  # noqa: E402
from warmctl.store import chunks as ck  # noqa: E402

GiB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- page cache


def _files(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        if p.is_dir():
            out += [q for q in p.rglob("*") if q.is_file()]
        elif p.exists():
            out.append(p)
    return out


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of ``paths`` (files or trees) in the page cache (``fincore``), -1 if unknown."""
    files = _files(paths)
    if not files or not shutil.which("fincore"):
        return -1
    try:
        return resident(files)
    except subprocess.CalledProcessError:
        return -1


_drop_method: list[str] = []


def drop_caches(paths: list[Path]) -> None:
    """Empty the page cache of ``paths`` (drop_caches as root; else fadvise DONTNEED)."""
    subprocess.run(["sync"], check=True)
    if not _drop_method or _drop_method[0] == "drop_caches":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            if not _drop_method:
                left = resident_bytes(paths)
                _drop_method.append("drop_caches" if left < 64 << 20 else "fadvise")
                print(f"(cold cache via {_drop_method[0]}: {max(left, 0) >> 20} MiB still cached after drop_caches)")
            if _drop_method[0] == "drop_caches":
                return
        except OSError:
            _drop_method[:] = ["fadvise"]
            print("(cold cache via posix_fadvise(DONTNEED): drop_caches not allowed)")
    dontneed(_files(paths))


def warm_up(paths: list[Path]) -> None:
    """Read ``paths`` once so that they are in the page cache."""
    for f in _files(paths):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass


# ----------------------------------------------------------------------------- measuring


class Results:
    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}  # label -> MB/s per round
        self.cpu: dict[str, list[float]] = {}  # label -> process CPU seconds per round
        self.load: list[float] = []

    def add(self, label: str, nbytes: int, secs: float, cpu: float | None = None) -> float:
        r = nbytes / secs / 1e6
        self.samples.setdefault(label, []).append(r)
        if cpu is not None:
            self.cpu.setdefault(label, []).append(cpu)
        self.load.append(os.getloadavg()[0])
        extra = f"  cpu {cpu:5.2f} s" if cpu is not None else ""
        print(f"  {label:44s} {secs:7.2f} s {r:8.0f} MB/s{extra}   (load {self.load[-1]:.1f})", flush=True)
        return r

    def med(self, label: str) -> float:
        return statistics.median(self.samples[label]) if label in self.samples else float("nan")


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result)."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return dt, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), out


def plain_read(path: Path) -> None:
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "status=none"], check=True)


def memcpy_rate() -> float:
    buf = np.ones(GiB, dtype=np.uint8)
    dst = np.empty_like(buf)
    np.copyto(dst, buf)
    t0 = time.perf_counter()
    np.copyto(dst, buf)
    return GiB / (time.perf_counter() - t0) / 1e6


def core_rates(store, refs, n: int = 48) -> dict[str, float]:
    """One core's MB/s for blake3, zstd -1 compress and decompress over up to ``n`` real
    (non-zero) chunks of the payload, in memory."""
    sample = [c for c in refs if not ck.is_zero_chunk(c.digest, c.size)][:: max(1, len(refs) // n)][:n]
    data = [store.load_chunk(c) for c in sample]
    nbytes = sum(len(d) for d in data)
    out = {}
    t0 = time.thread_time()
    for d in data:
        ck.hash_bytes(d)
    out["blake3"] = nbytes / (time.thread_time() - t0) / 1e6
    t0 = time.thread_time()
    blobs = [ck.compress(d) for d in data]
    out["zstd -1 compress"] = nbytes / (time.thread_time() - t0) / 1e6
    buf = bytearray(CHUNK_SIZE)
    t0 = time.thread_time()
    for b, d in zip(blobs, data):
        ck.decompress_into(b, buf, len(d))
    out["zstd decompress"] = nbytes / (time.thread_time() - t0) / 1e6
    out["compression ratio (non-zero chunks)"] = nbytes / sum(len(b) for b in blobs)
    return out


def make_manifest(name: str, size: int, refs) -> Manifest:
    return Manifest(
        name=name,
        profile_digest="sha256:" + "0" * 64,
        profile={},
        host={},
        canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
        files=[FileEntry(path="pages-1.img", size=size, chunks=refs)],
    )


# ----------------------------------------------------------------------------- S3 servers


def _load_rgw_module():
    import importlib.util

    path = ROOT / "tests" / "rgw_server.py"
    if not path.exists():
        raise SystemExit(f"--s3 rgw needs {path} (start_rgw); it is not in this checkout")
    spec = importlib.util.spec_from_file_location("rgw_server", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class S3Server:
    """``moto`` (in-process ThreadedMotoServer), ``rgw`` (throwaway Ceph RGW, memstore sized
    for the payload) or an endpoint URL (credentials from AWS_* variables)."""

    def __init__(self, kind: str, workdir: Path, need_bytes: int):
        self.kind, self.workdir, self.need = kind, workdir, need_bytes
        self._stop = None

    def __enter__(self) -> str:
        if self.kind == "moto":
            import logging

            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            srv.start()
            self._stop = srv.stop
            host, port = srv.get_host_and_port()
            return f"http://{host}:{port}"
        if self.kind == "rgw":
            mod = _load_rgw_module()
            want = max(1 << 30, int(self.need * 1.3))  # memstore holds every object in RAM
            mod.CONF = mod.CONF.replace("memstore device bytes = 1073741824", f"memstore device bytes = {want}")
            sys.path.insert(0, str(ROOT / "tests"))
            from ports import free_port

            cm = mod.start_rgw(self.workdir / "rgw", free_port(), free_port())
            ep, key, secret = cm.__enter__()
            self._stop = lambda: cm.__exit__(None, None, None)
            os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = key, secret
            return ep
        return self.kind  # an endpoint URL

    def __exit__(self, *exc) -> None:
        if self._stop:
            self._stop()


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0, help="local payload size in GiB (default 4)")
    ap.add_argument("--s3-size-gib", type=float, default=1.0, help="payload size for the S3 part (default 1; 0: skip S3)")
    ap.add_argument("--s3", default="moto", help="moto (default), rgw (tests/rgw_server.py), or an endpoint URL")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement (default 3)")
    ap.add_argument("--s3-rounds", type=int, default=2, help="rounds for the S3 measurements (default 2)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"), help="where payload and stores go (a real disk, not tmpfs)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--criu-image", type=Path, help="use the pages-*.img of this CRIU image directory")
    src.add_argument("--from-store", type=Path, help="use the CRIU pages of a snapshot in this local store")
    ap.add_argument("--from-store-ref", help="NAME[:TAG] for --from-store (default: the first *:latest)")
    ap.add_argument("--weights-mib", type=int, default=768, help="bf16 tensors in the dumped process (default 768)")
    ap.add_argument("--heap-mib", type=int, default=96, help="Python heap objects in the dumped process (default 96)")
    ap.add_argument("--zero-share", type=float, default=0.45, help="share of the payload in zero regions (default 0.45)")
    ap.add_argument("--workers", type=int, help="Store worker threads (default: the Store's own)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", type=Path, help="write every sample here")
    a = ap.parse_args()
    size = int(a.size_gib * GiB) // 4096 * 4096
    s3_size = int(a.s3_size_gib * GiB) // 4096 * 4096
    res = Results()
    load0 = os.getloadavg()
    d = a.workdir / f"warmctl-bench-{os.getpid()}"
    d.mkdir(parents=True)
    info: dict = {"argv": sys.argv, "cpus": os.cpu_count(), "load_start": load0}
    print(f"payload {size / GiB:.2f} GiB, chunk {CHUNK_SIZE >> 20} MiB, {DIGEST_ALGORITHM}, zstd {ZSTD_LEVEL}, "
          f"{os.cpu_count()} CPUs, load {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}", flush=True)
    try:
        # -- the payload: real CRIU pages + zero regions
        t0 = time.perf_counter()
        if a.criu_image:
            img, how = a.criu_image, f"CRIU image {a.criu_image}"
        elif a.from_store:
            img, how = pages_from_store(a.from_store, d / "criu-img", a.from_store_ref), f"snapshot pages from store {a.from_store}"
        else:
            img = dump_sample_process(d / "dump", a.weights_mib, a.heap_mib)
            how = f"CRIU dump of a torch/numpy process ({a.weights_mib} MiB bf16 tensors, {a.heap_mib} MiB heap objects)"
        sources = pages_in(img)
        payload = d / "payload" / "pages.img"
        pi = build_payload(sources, payload, size, a.zero_share)
        info["payload"] = {"source": how, **pi.__dict__}
        print(f"(payload from {how}: {pi.source_bytes / GiB:.2f} GiB of pages-*.img ({pi.zero_pages_in_source:.1%} of their "
              f"pages all-zero), used {pi.passes:.2f}x; {pi.real_bytes / size:.1%} real pages, {pi.zero_bytes / size:.1%} "
              f"zero regions; built in {time.perf_counter() - t0:.0f} s)", flush=True)

        # -- ingest (once)
        local = open_store(d / "local", workers=a.workers)
        dt, cpu, refs = timed(lambda: local.add_file(payload))
        res.add("add_file -> local store (payload cached)", size, dt, cpu)
        digest = local.put_manifest(make_manifest("bench", size, refs))
        local.close()
        zero_chunk_bytes = sum(c.size for c in refs if ck.is_zero_chunk(c.digest, c.size))
        stored = sum(p.stat().st_size for p in (d / "local" / "chunks").rglob("*") if p.is_file())
        info["zero_chunk_share"] = zero_chunk_bytes / size
        info["stored_bytes"] = stored
        print(f"(all-zero chunks: {zero_chunk_bytes / size:.1%} of the payload; stored {stored / GiB:.2f} GiB "
              f"for {size / GiB:.2f} GiB; workers {local.workers})", flush=True)
        rates = core_rates(local, refs)
        info["core_rates"] = rates
        print("(one core on the real chunks: " + ", ".join(f"{k} {v:.0f} MB/s" if "ratio" not in k else f"{k} {v:.2f}" for k, v in rates.items()) + ")")

        out = d / "out" / "pages.img"
        dst_root = d / "pulled"
        everything = [payload, d / "local"]

        def run_plain(cache: str) -> None:
            if cache == "cold":
                drop_caches(everything)
            else:
                warm_up([payload])
            dt, _, _ = timed(lambda: plain_read(payload))
            res.add(f"plain read (dd bs=4M), {cache}", size, dt)

        def run_read_file(cache: str) -> None:
            out.unlink(missing_ok=True)
            if cache == "cold":
                drop_caches(everything)
            else:
                warm_up([d / "local"])
            dt, cpu, _ = timed(lambda: local.read_file(refs, out))
            res.add(f"read_file local -> file, {cache}", size, dt, cpu)
            out.unlink()

        def run_pull(cache: str) -> None:
            shutil.rmtree(dst_root, ignore_errors=True)
            if cache == "cold":
                drop_caches(everything)
            else:
                warm_up([d / "local"])
            dst = open_store(dst_root, workers=a.workers)
            dt, cpu, _ = timed(lambda: copy_manifest(open_store(d / "local", workers=a.workers), dst, digest))
            dst.close()
            res.add(f"pull local store -> local store, {cache}", size, dt, cpu)
            shutil.rmtree(dst_root)

        for r in range(a.rounds):
            print(f"round {r + 1}/{a.rounds}", flush=True)
            res.add("memcpy (numpy, 1 GiB)", GiB, GiB / (memcpy_rate() * 1e6))
            steps = [run_plain, run_read_file, run_pull]
            if r % 2:
                steps.reverse()  # alternate which side goes first
            for cache in ("cold", "warm"):
                for step in steps:
                    step(cache)

        # -- S3
        if s3_size > 0 and a.s3 != "none":
            import boto3
            from boto3.s3.transfer import TransferConfig

            s3_payload = payload
            s3_local = local
            s3_refs = refs
            s3_digest = digest
            if s3_size != size:
                s3_payload = d / "payload" / "pages-s3.img"
                with open(payload, "rb") as fi, open(s3_payload, "wb") as fo:
                    left = s3_size
                    while left:
                        b = fi.read(min(left, 64 << 20))
                        fo.write(b)
                        left -= len(b)
                s3_local = open_store(d / "local-s3", workers=a.workers)
                s3_refs = s3_local.add_file(s3_payload)
                s3_digest = s3_local.put_manifest(make_manifest("bench", s3_size, s3_refs))
                s3_local.close()
            print(f"S3 ({a.s3}), payload {s3_size / GiB:.2f} GiB (the first {s3_size / GiB:.2f} GiB of the local payload)", flush=True)
            with S3Server(a.s3, d, s3_size * 2) as ep:
                from warmctl.records.config import Settings

                s3s = Settings(s3_endpoint=ep)  # this benchmark is an edge: the endpoint passed down
                c = boto3.client("s3", endpoint_url=ep, region_name="us-east-1")
                bucket = f"bench-{os.getpid()}"
                c.create_bucket(Bucket=bucket)
                remote = open_store(f"s3://{bucket}/store", settings=s3s)
                dt, cpu, _ = timed(lambda: copy_manifest(s3_local, remote, s3_digest))
                res.add("push local -> S3", s3_size, dt, cpu)
                dt, cpu, _ = timed(lambda: c.upload_file(str(s3_payload), bucket, "raw/pages.img"))
                res.add("boto3 upload_file (one object, defaults)", s3_size, dt, cpu)
                s3_workers = remote.workers
                matched = TransferConfig(max_concurrency=s3_workers, multipart_chunksize=CHUNK_SIZE, multipart_threshold=CHUNK_SIZE)
                raw = d / "raw.img"
                s3out = d / "out" / "pages-s3.img"

                def s3_pull() -> None:
                    shutil.rmtree(dst_root, ignore_errors=True)
                    dst = open_store(dst_root)
                    dt, cpu, _ = timed(lambda: copy_manifest(open_store(f"s3://{bucket}/store", settings=s3s), dst, s3_digest))
                    dst.close()
                    res.add("pull S3 -> local store", s3_size, dt, cpu)
                    shutil.rmtree(dst_root)

                def s3_stream() -> None:
                    shutil.rmtree(d / "cache", ignore_errors=True)
                    s3out.unlink(missing_ok=True)
                    cache = open_store(d / "cache")
                    dt, cpu, _ = timed(lambda: open_store(f"s3://{bucket}/store", settings=s3s).read_file(s3_refs, s3out, cache=cache))
                    cache.close()
                    res.add("read_file S3 -> file (+ local cache)", s3_size, dt, cpu)
                    s3out.unlink()
                    shutil.rmtree(d / "cache")

                def boto(label: str, cfg) -> None:
                    raw.unlink(missing_ok=True)
                    dt, cpu, _ = timed(lambda: c.download_file(bucket, "raw/pages.img", str(raw), Config=cfg))
                    res.add(label, s3_size, dt, cpu)
                    raw.unlink()

                steps = [s3_pull, s3_stream, lambda: boto("boto3 download_file, TransferConfig defaults", TransferConfig()),
                         lambda: boto(f"boto3 download_file, {s3_workers} threads x 4 MiB", matched)]
                for r in range(a.s3_rounds):
                    print(f"S3 round {r + 1}/{a.s3_rounds}", flush=True)
                    for step in steps if r % 2 == 0 else list(reversed(steps)):
                        step()
                info["s3_workers"] = s3_workers
            info["s3"] = {"kind": a.s3, "size": s3_size}
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)

    # -- summary
    info["load_end"] = os.getloadavg()
    print(f"\nload average during the run (1-min, sampled at each step): min {min(res.load):.1f}, "
          f"median {statistics.median(res.load):.1f}, max {max(res.load):.1f}; cold cache via {_drop_method[0] if _drop_method else '-'}")
    print("\nmedians (MB/s = payload bytes / wall seconds)")
    for label, v in res.samples.items():
        cpu = f"  cpu {statistics.median(res.cpu[label]):.2f} s" if label in res.cpu else ""
        print(f"  {label:48s} {statistics.median(v):8.0f}   ({', '.join(f'{x:.0f}' for x in v)}){cpu}")
    m = res.med
    ratios = {
        "read_file local / plain read, cold (aim >= 0.80)": m("read_file local -> file, cold") / m("plain read (dd bs=4M), cold"),
        "read_file local / plain read, warm (aim >= 0.80)": m("read_file local -> file, warm") / m("plain read (dd bs=4M), warm"),
        "pull local->local / plain read, cold": m("pull local store -> local store, cold") / m("plain read (dd bs=4M), cold"),
        "pull local->local / plain read, warm": m("pull local store -> local store, warm") / m("plain read (dd bs=4M), warm"),
        "plain read warm / memcpy": m("plain read (dd bs=4M), warm") / m("memcpy (numpy, 1 GiB)"),
    }
    if "pull S3 -> local store" in res.samples:
        w = info["s3_workers"]
        ratios["pull S3 / boto3 download_file defaults (aim >= 1)"] = m("pull S3 -> local store") / m("boto3 download_file, TransferConfig defaults")
        ratios["pull S3 / boto3 download_file matched (aim >= 1)"] = m("pull S3 -> local store") / m(f"boto3 download_file, {w} threads x 4 MiB")
        ratios["read_file S3 / boto3 download_file defaults"] = m("read_file S3 -> file (+ local cache)") / m("boto3 download_file, TransferConfig defaults")
    # share of read_file's CPU that is hashing + decompression (one core's rates on the real chunks)
    real = size - info["zero_chunk_share"] * size
    for cache in ("cold", "warm"):
        lab = f"read_file local -> file, {cache}"
        if lab in res.cpu:
            need = real / (info["core_rates"]["blake3"] * 1e6) + real / (info["core_rates"]["zstd decompress"] * 1e6)
            ratios[f"hash+decompress share of read_file CPU, {cache}"] = need / statistics.median(res.cpu[lab])
    lab = "add_file -> local store (payload cached)"
    need = real / (info["core_rates"]["blake3"] * 1e6) + real / (info["core_rates"]["zstd -1 compress"] * 1e6)
    ratios["hash+compress share of add_file CPU"] = need / statistics.median(res.cpu[lab])
    print("\nratios (of medians)")
    for k, v in ratios.items():
        print(f"  {k:56s} {v:6.2f}")
    if a.json:
        a.json.write_text(json.dumps({"info": info, "samples": res.samples, "cpu": res.cpu, "load": res.load, "ratios": ratios,
                                      "cold_method": _drop_method[:1]}, indent=1))


if __name__ == "__main__":
    main()
