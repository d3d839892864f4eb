"""A fresh node's "materialize" alone (no engine): the kept image written from a remote store
while every chunk is verified and kept in the node's empty local store, as ``up`` does, for
this checkout and (``--old DIR``) another one, interleaved round by round.

Node A's home (``--home``, e.g. fleet_up.py's ``--keep-home``) holds the ``tiny`` snapshot; it is
pushed once to a directory remote and (``--rgw``) to a one-node Ceph RGW on loopback
(``tests/rgw_server.py``). Each round, for each remote and each checkout, a child process runs
:meth:`warmctl.checkpoint.imagecache.ImageCache.get` into a new node directory and reports its
wall time, its CPU seconds and how many ``fsync`` calls it made (and their summed seconds over
threads). ``sync`` runs before each (so one run's dirty pages do not land on the next); the
remote's chunks are in the page cache (warm), as after a push on this host.

Usage::

    python benchmarks/fresh_materialize.py --home DIR [--old DIR] [--rgw] [--rounds 3]
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
import uuid
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

CHILD = r"""
import json, os, sys, time
from warmctl.naming.catalog import Catalog
from warmctl.checkpoint.imagecache import ImageCache
from warmctl.records.config import load_settings
from warmctl.store import Fetched, open_store
remote, node = sys.argv[1], sys.argv[2]
r = open_store(remote, settings=load_settings())  # an edge: the S3 endpoint from $WARMCTL_S3_ENDPOINT
(e,) = Catalog(r).entries("tiny")
m = r.get_manifest(e.manifest)
n, secs, real = [0], [0.0], os.fsync
def fsync(fd):
    t = time.monotonic(); real(fd); n[0] += 1; secs[0] += time.monotonic() - t
os.fsync = fsync
os.sync()
f = Fetched()
t0, c0 = time.monotonic(), os.times()
ImageCache(node + "/cache/images").get(r, m, e.manifest, cache=open_store(node + "/store"), fetched=f)
c1 = os.times()
print(json.dumps({"wall": time.monotonic() - t0, "cpu": c1.user - c0.user + c1.system - c0.system,
                  "fsyncs": n[0], "fsync_s": secs[0], "remote": f.as_dict()["remote"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True, help="node A's home (config.toml, home/store with tiny)")
    ap.add_argument("--old", type=Path, default=None, help="another warmctl checkout, run beside this one")
    ap.add_argument("--rgw", action="store_true", help="also from a Ceph RGW on loopback")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    os.environ["WARMCTL_CONFIG"] = str(a.home / "config.toml")
    from warmctl.naming.catalog import Ref
    from warmctl.naming.fleet import entries_to_copy, transfer
    from warmctl.store import open_store

    store_a = open_store(a.home / "home" / "store")
    work = Path(tempfile.mkdtemp(prefix="warmctl-fresh-mat-"))
    with ExitStack() as stack:
        remotes = {"dir": (str(work / "remote"), {})}
        if a.rgw:
            import boto3
            from rgw_server import free_port, start_rgw

            ep, ak, sk = stack.enter_context(start_rgw(work / "ceph", free_port(), free_port()))
            extra = {"WARMCTL_S3_ENDPOINT": ep, "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk,
                     "AWS_DEFAULT_REGION": "us-east-1"}
            bucket = f"mat-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=ep, aws_access_key_id=ak, aws_secret_access_key=sk,
                         region_name="us-east-1").create_bucket(Bucket=bucket)
            remotes["rgw"] = (f"s3://{bucket}/warmctl", extra)
        for url, extra in remotes.values():
            os.environ.update(extra)
            from warmctl.records.config import load_settings

            transfer(store_a, open_store(url, settings=load_settings()), entries_to_copy(store_a, Ref.parse("tiny")))
        checkouts = {"new": REPO, **({"old": a.old.resolve()} if a.old else {})}
        res: dict[str, list[dict]] = {}
        for i in range(a.rounds):
            for kind, (url, extra) in remotes.items():
                for label, tree in checkouts.items():
                    node = work / f"node-{label}-{kind}-{i}"
                    env = {**os.environ, **extra, "PYTHONPATH": str(tree)}
                    r = subprocess.run([sys.executable, "-c", CHILD, url, str(node)], env=env, capture_output=True,
                                       text=True, check=True, cwd=tree)  # -c puts the cwd first on sys.path
                    x = json.loads(r.stdout)
                    res.setdefault(f"{label} {kind}", []).append(x)
                    shutil.rmtree(node, ignore_errors=True)
                    print(f"round {i} {label:3s} {kind}: {x['wall']:.2f} s, cpu {x['cpu']:.2f} s, {x['fsyncs']} fsyncs "
                          f"({x['fsync_s']:.2f} s summed over threads), {x['remote'] / 2**20:.0f} MiB fetched", flush=True)
        print(f"\nmedians over {a.rounds} rounds:")
        for k, xs in res.items():
            print(f"  {k:10s} {statistics.median(x['wall'] for x in xs):6.2f} s  cpu {statistics.median(x['cpu'] for x in xs):.2f} s"
                  f"  fsyncs {statistics.median(x['fsyncs'] for x in xs):.0f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
