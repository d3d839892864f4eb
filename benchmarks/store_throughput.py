"""Store throughput vs this machine's limits, on a CRIU-like payload (docs/benchmarks.md).

Measures, on the same bytes:
  memcpy            numpy copy of a 1 GiB buffer (memory bandwidth, one core)
  plain read        ``cat FILE > /dev/null`` (page cache warm: the file was just written)
  add (local)       Store.add_file into a local store: read, zero-check, hash, compress, write
  materialize       Store.read_file from the local store to a new file (what ``up`` does)
  push (S3)         push local -> S3 (moto server on loopback)
  pull (S3)         pull S3 -> a fresh local store (the ``warmctl pull`` path)
  stream (S3)       read_file straight from S3 to a file, filling a local cache
  boto3 download    boto3 ``download_file`` of the same payload uploaded as one object
and prints MB/s (payload bytes / wall seconds) and ratios.

Usage: ``python benchmarks/store_throughput.py [--size-gib 4] [--workdir /tmp]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from store_payload import generate  # noqa: E402

from warmctl.manifest import CanaryRecord, FileEntry, Manifest  # noqa: E402
from warmctl.store import CHUNK_SIZE, DIGEST_ALGORITHM, ZSTD_LEVEL, open_store, pull, push  # noqa: E402

GiB = 1 << 30


def timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0, help="payload size in GiB (default 4)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"), help="where to put payload and stores")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) measurements")
    a = ap.parse_args()
    size = int(a.size_gib * GiB)
    rows: list[tuple[str, float]] = []

    def report(label: str, secs: float, nbytes: int = size) -> float:
        r = nbytes / secs / 1e6
        rows.append((label, r))
        print(f"{label:34s} {secs:7.2f} s  {r:8.0f} MB/s", flush=True)
        return r

    print(f"payload {size / GiB:.2f} GiB, chunk {CHUNK_SIZE >> 20} MiB, {DIGEST_ALGORITHM}, zstd {ZSTD_LEVEL}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(dir=a.workdir, prefix="warmctl-bench-") as td:
        d = Path(td)
        src = d / "img" / "pages-1.img"
        t, _ = timed(lambda: generate(src, size, seed=1))
        print(f"(generated payload in {t:.1f} s)")

        buf = np.ones(GiB, dtype=np.uint8)
        dst = np.empty_like(buf)
        np.copyto(dst, buf)
        t, _ = timed(lambda: np.copyto(dst, buf))
        memcpy = report("memcpy (1 GiB)", t, GiB)
        del buf, dst

        subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)  # warm
        t, _ = timed(lambda: subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True))
        plain = report("plain read (cat > /dev/null)", t)

        local = open_store(d / "local")
        t, refs = timed(lambda: local.add_file(src))
        add = report("add_file -> local store", t)
        m = Manifest(
            name="bench",
            profile_digest="sha256:" + "0" * 64,
            profile={},
            host={},
            canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
            files=[FileEntry(path="pages-1.img", size=size, chunks=refs)],
        )
        local.set_tag("bench", "latest", local.put_manifest(m))
        local.close()
        stored = sum(p.stat().st_size for p in (d / "local" / "chunks").rglob("*") if p.is_file())
        print(f"(stored {stored / GiB:.2f} GiB for {size / GiB:.2f} GiB: {size / stored:.2f}x incl. zero chunks)")

        out = d / "out" / "pages-1.img"
        t, _ = timed(lambda: local.read_file(refs, out))
        mat = report("read_file local -> file", t)
        out.unlink()

        if not a.no_s3:
            import boto3
            from moto.server import ThreadedMotoServer

            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            srv.start()
            host, port = srv.get_host_and_port()
            ep = f"http://{host}:{port}"
            os.environ["WARMCTL_S3_ENDPOINT"] = ep
            c = boto3.client("s3", endpoint_url=ep, region_name="us-east-1")
            c.create_bucket(Bucket="bench")
            try:
                remote = open_store("s3://bench/store")
                t, _ = timed(lambda: push(local, remote, "bench", "latest"))
                report("push local -> S3 (moto)", t)
                local2 = open_store(d / "local2")
                t, _ = timed(lambda: pull(open_store("s3://bench/store"), local2, "bench", "latest"))
                s3pull = report("pull S3 -> local store", t)
                shutil.rmtree(d / "local2")
                cache = open_store(d / "cache")
                t, _ = timed(lambda: open_store("s3://bench/store").read_file(refs, out, cache=cache))
                stream = report("read_file S3 -> file (+cache)", t)
                out.unlink()
                shutil.rmtree(d / "cache")
                c.upload_file(str(src), "bench", "raw/pages-1.img")
                t, _ = timed(lambda: c.download_file("bench", "raw/pages-1.img", str(d / "raw.img")))
                boto = report("boto3 download_file (raw)", t)
                (d / "raw.img").unlink()
            finally:
                srv.stop()

    print("\nratios")
    print(f"  read_file local / plain read     {mat / plain:6.2f}")
    print(f"  add_file local / plain read      {add / plain:6.2f}")
    print(f"  plain read / memcpy              {plain / memcpy:6.2f}")
    if not a.no_s3:
        print(f"  pull S3 / boto3 download_file    {s3pull / boto:6.2f}")
        print(f"  stream S3 / boto3 download_file  {stream / boto:6.2f}")


if __name__ == "__main__":
    main()
