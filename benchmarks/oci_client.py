"""Parallel ranged blob reads from a real registry on loopback: httpx (what warmctl's OCI backend
uses) against requests (what oras-py is built on), and warmctl's own chunk reads.

    .venv/bin/python benchmarks/oci_client.py --mib 256 --threads 16 --runs 3
    .venv/bin/python benchmarks/oci_client.py --pull --mib 256 --pack-mib 64 --runs 3

Starts a Distribution 2.8 (``docker-registry``; TLS from a CA made here, htpasswd auth) with
``tests/registry_server.py``, uploads one blob of ``--mib`` MiB, then reads it as 4 MiB ranges
(``Range: bytes=a-b``) from ``--threads`` threads, each client with one shared connection pool:
``httpx.Client`` and ``requests.Session`` (urllib3 pool of ``--threads``). Each run reads every
range once; runs alternate between the clients. Prints MiB/s per run and the median.

With ``--pull``: a synthetic snapshot of ``--mib`` MiB of random data (4 MiB chunks, packs of
``--pack-mib``) is pushed with warmctl, then, alternating, warmctl's ``pull`` of it into an empty
local store (ranged reads of the packs, every chunk decompressed, hashed and written) against a
plain parallel download of the artifact's layers (one GET per blob, ``--threads`` threads, to
files). MiB/s of stored bytes.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))  # tests/registry_server.py, tests/ports.py
rs = importlib.import_module("registry_server")
free_port = importlib.import_module("ports").free_port

USER, PW = "bench", "bench-pw"
CH = 4 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pull", action="store_true", help="warmctl pull vs a plain download of the layers")
    ap.add_argument("--pack-mib", type=int, default=1024)
    a = ap.parse_args()
    if a.pull:
        return pull_bench(a)
    import httpx
    import requests
    import requests.adapters

    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        ca = rs.make_ca(d / "ca")
        with rs.Registry(d / "reg", free_port(), ca=ca, users={USER: PW}) as reg:
            blob = os.urandom(a.mib << 20)
            digest = "sha256:" + hashlib.sha256(blob).hexdigest()
            auth = "Basic " + base64.b64encode(f"{USER}:{PW}".encode()).decode()
            base = f"{reg.url}/v2/bench/blob"
            hx = httpx.Client(verify=str(ca.ca_cert), headers={"Authorization": auth},
                              limits=httpx.Limits(max_connections=a.threads, max_keepalive_connections=a.threads), timeout=60)
            r = hx.post(f"{base}/blobs/uploads/")
            loc = httpx.URL(reg.url).join(r.headers["location"])
            hx.put(str(loc) + ("&" if "?" in str(loc) else "?") + f"digest={digest}", content=blob,
                   headers={"Content-Type": "application/octet-stream"}).raise_for_status()
            rq = requests.Session()
            rq.headers["Authorization"] = auth
            rq.verify = str(ca.ca_cert)
            rq.mount("https://", requests.adapters.HTTPAdapter(pool_connections=a.threads, pool_maxsize=a.threads))
            ranges = [(o, min(o + CH, len(blob)) - 1) for o in range(0, len(blob), CH)]

            def via_httpx(rg):
                r = hx.get(f"{base}/blobs/{digest}", headers={"Range": f"bytes={rg[0]}-{rg[1]}"})
                assert r.status_code == 206 and len(r.content) == rg[1] - rg[0] + 1
                return len(r.content)

            def via_requests(rg):
                r = rq.get(f"{base}/blobs/{digest}", headers={"Range": f"bytes={rg[0]}-{rg[1]}"}, verify=str(ca.ca_cert))
                assert r.status_code == 206 and len(r.content) == rg[1] - rg[0] + 1
                return len(r.content)

            res: dict[str, list[float]] = {"httpx": [], "requests": []}
            with ThreadPoolExecutor(a.threads) as ex:
                list(ex.map(via_httpx, ranges[: a.threads]))  # warm both pools
                list(ex.map(via_requests, ranges[: a.threads]))
                for _ in range(a.runs):
                    for name, fn in (("httpx", via_httpx), ("requests", via_requests)):
                        t0 = time.perf_counter()
                        n = sum(ex.map(fn, ranges))
                        res[name].append(n / (1 << 20) / (time.perf_counter() - t0))
            print(f"{a.mib} MiB blob, {len(ranges)} ranges of 4 MiB, {a.threads} threads, TLS, {a.runs} runs (MiB/s):")
            for name, v in res.items():
                print(f"  {name:9s} " + "  ".join(f"{x:7.1f}" for x in v) + f"   median {statistics.median(v):7.1f}")


def download_layers(b, layers: list[dict], out: Path, threads: int) -> int:
    """The plain parallel download a pull is measured against: every blob of ``layers`` (OCI
    descriptors) GET in full from backend ``b``'s registry by ``threads`` threads into files
    under ``out``, nothing verified or decompressed. Returns the bytes written."""

    def get(layer: dict) -> int:
        r = b.api.send("GET", b.api.url(f"blobs/{layer['digest']}"), "blob", stream=True)
        n = 0
        with open(out / layer["digest"].replace(":", "_"), "wb") as f:
            for chunk in r.iter_bytes(1 << 20):
                f.write(chunk)
                n += len(chunk)
        r.close()
        return n

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(get, layers))


def pull_bench(a) -> None:
    from test_store_fixtures import push, snapshot, write_payload

    from warmctl.naming.catalog import Ref
    from warmctl.naming.fleet import entries_to_copy, transfer
    from warmctl.store import open_store
    from warmctl.store import oci as ocimod
    from warmctl.store.oci import OCIBackend, parse_url

    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        ca = rs.make_ca(d / "ca")
        with rs.Registry(d / "reg", free_port(), ca=ca, users={USER: PW}) as reg:
            from warmctl.records.config import Settings

            st = Settings(oci_ca_bundle=ca.ca_cert, oci_pack_bytes=a.pack_mib << 20)
            os.environ["REGISTRY_AUTH_FILE"] = str(rs.docker_config(d / "auth.json", reg.host, USER, PW))
            url = f"oci://{reg.host}/bench/pull"
            local = open_store(d / "a")
            digest = snapshot(local, "bench", {"p.img": write_payload(d / "p.img", [("random", 16 << 20)] * (a.mib // 16))})
            push(local, open_store(url, settings=st), "bench")
            b = OCIBackend(*parse_url(url), ca_bundle=ca.ca_cert)
            layers = b._get_manifest(f"manifest-{digest[7:]}", "artifact")[1]["layers"]
            packs = sum(1 for x in layers if x["mediaType"] == ocimod.PACK_LAYER)

            res: dict[str, list[float]] = {"warmctl pull": [], "plain layers": []}
            for i in range(a.runs):
                dst = open_store(d / f"b{i}")
                src = open_store(url, settings=st)
                t0 = time.perf_counter()
                (c,) = transfer(src, dst, entries_to_copy(src, Ref.parse("bench")))
                res["warmctl pull"].append(c.report.bytes_copied / (1 << 20) / (time.perf_counter() - t0))
                out = d / f"plain{i}"
                out.mkdir()
                t0 = time.perf_counter()
                n = download_layers(b, layers, out, a.threads)
                res["plain layers"].append(n / (1 << 20) / (time.perf_counter() - t0))
                shutil.rmtree(out)
                shutil.rmtree(d / f"b{i}")
            print(f"{a.mib} MiB snapshot in {packs} pack(s) of <= {a.pack_mib} MiB ({len(layers)} layers), "
                  f"{a.threads} threads, TLS, {a.runs} runs (MiB/s of stored bytes):")
            for name, v in res.items():
                print(f"  {name:13s} " + "  ".join(f"{x:7.1f}" for x in v) + f"   median {statistics.median(v):7.1f}")


if __name__ == "__main__":
    main()
