"""``warmctl up`` on a fleet node: from an empty local store through a remote, vs from a local store.

Node A (this script's home) holds the ``tiny`` snapshot and pushes it to a directory remote,
(unless ``--no-rgw``) to a one-node Ceph RGW on loopback (``tests/rgw_server.py``) and (unless
``--no-oci``) to an OCI registry on loopback (Distribution 2.8, TLS from a CA made here, htpasswd;
``tests/registry_server.py``). Then, in
each round, interleaved (this machine is shared and noisy: the ratios of medians are the
result, not the absolute seconds):

- **local**: ``warmctl up tiny`` on a node whose local store already holds the snapshot;
- **dir**: ``up`` on a fresh node (empty local store) with ``remote_store`` = the directory;
- **rgw**: ``up`` on a fresh node with ``remote_store`` = ``s3://`` on the RGW;
- **oci**: ``up`` on a fresh node with ``remote_store`` = ``oci://`` on the registry;

each measured from the command's start to the first *correct* token on the public port (the
canary's first token id), then ``down`` and the fresh node's home removed.

Fetch throughput (once, after the rounds): warmctl's streaming fetch from RGW (``pull`` of the
snapshot into an empty store: parallel ranged GETs, every chunk verified and written) against
boto3's ``download_file`` of the same chunk objects to files with as many threads; and from the
registry: ``pull`` against a plain parallel download (httpx, one stream per blob, as many threads)
of the layers of the snapshot's artifact.

Usage::

    python benchmarks/fleet_up.py [--rounds 3] [--no-rgw] [--no-oci] [--keep-home DIR]

Cleans up: every engine down, every node home and the RGW removed (``--keep-home`` keeps node
A's home and its snapshot for the next run).
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
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from oci_client import download_layers  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from restore_vs_cold import first_token  # noqa: E402

ENGINE_PORT = int(os.environ.get("WARMCTL_TEST_ENGINE_PORT") or 18700)
GATE_PORT = int(os.environ.get("WARMCTL_TEST_GATE_PORT") or 18780)


def wc(env, *args, check=True):
    r = subprocess.run([sys.executable, "-m", "warmctl", *args], env=env, capture_output=True, text=True)
    if check and r.returncode:
        sys.exit(f"warmctl {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def node_env(root: Path, a_pub: Path, **extra: str) -> dict[str, str]:
    """A fresh node: isolated home under ``root``, trusting node A's key."""
    from tests.conftest import isolated_env

    env = isolated_env(root, ENGINE_PORT, GATE_PORT)
    (root / "keys").mkdir(exist_ok=True)
    shutil.copy(a_pub, root / "keys" / "node-a.pub")
    env.update(extra)
    return env


def timed_up(env, prompt: str, expected: int) -> tuple[float, dict]:
    t0 = time.monotonic()
    r = wc(env, "up", "tiny", "--json", "--cold-start", "never")
    tok, t1 = first_token(GATE_PORT, prompt)
    assert tok == expected, f"first token {tok} != canary {expected}"
    res = json.loads(r.stdout)
    assert res["path"] == "restore", res
    wc(env, "down", "tiny")
    return t1 - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-rgw", action="store_true", help="skip the Ceph RGW remote")
    ap.add_argument("--no-oci", action="store_true", help="skip the OCI registry remote")
    ap.add_argument("--keep-home", type=Path, default=None, help="reuse/keep node A's home (its snapshot)")
    a = ap.parse_args()

    from tests.conftest import isolated_env

    root_a = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-fleet-a-"))
    work = Path(tempfile.mkdtemp(prefix="warmctl-fleet-"))
    env_a = isolated_env(root_a, ENGINE_PORT, GATE_PORT)
    os.environ["WARMCTL_CONFIG"] = env_a["WARMCTL_CONFIG"]
    from warmctl.catalog import Catalog
    from warmctl.config import load_settings
    from warmctl.store import open_store

    store_a = open_store(load_settings().store_dir)
    if not Catalog(store_a).entries("tiny"):
        print("making the snapshot once (warmctl snapshot tiny) ...", flush=True)
        wc(env_a, "snapshot", "tiny", "--quiet", "--no-push")
    (entry,) = Catalog(store_a).entries("tiny")
    manifest = store_a.get_manifest(entry.manifest)
    prompt, expected = manifest.canary.completions[0].prompt, manifest.canary.completions[0].token_ids[0]
    a_pub = next((root_a / "keys").glob("local-*.pub"))

    with ExitStack() as stack:
        remotes = {"dir": (str(work / "remote"), {})}
        if not a.no_rgw:
            import boto3
            from rgw_server import free_port, start_rgw

            ep, ak, sk = stack.enter_context(start_rgw(work / "ceph", free_port(), free_port()))
            s3env = {"WARMCTL_S3_ENDPOINT": ep, "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk,
                     "AWS_DEFAULT_REGION": "us-east-1"}
            bucket = f"fleet-{uuid.uuid4().hex[:8]}"
            s3 = boto3.client("s3", endpoint_url=ep, aws_access_key_id=ak, aws_secret_access_key=sk, region_name="us-east-1")
            s3.create_bucket(Bucket=bucket)
            remotes["rgw"] = (f"s3://{bucket}/warmctl", s3env)
        if not a.no_oci:
            from registry_server import Registry, docker_config, make_ca
            from registry_server import free_port as reg_port

            ca = make_ca(work / "oci-ca")
            reg = stack.enter_context(Registry(work / "oci", reg_port(), ca=ca, users={"fleet": "fleet-pw"}))
            ocienv = {"WARMCTL_OCI_CA_BUNDLE": str(ca.ca_cert),
                      "REGISTRY_AUTH_FILE": str(docker_config(work / "oci-auth.json", reg.host, "fleet", "fleet-pw"))}
            remotes["oci"] = (f"oci://{reg.host}/fleet/warmctl", ocienv)
        for kind, (url, extra) in remotes.items():
            t0 = time.monotonic()
            wc(dict(env_a, **extra), "push", "tiny", "--to", url)
            print(f"push to {kind}: {time.monotonic() - t0:.1f} s", flush=True)

        local = node_env(work / "local", a_pub)
        wc(local, "pull", "tiny", "--from", remotes["dir"][0])
        times: dict[str, list[float]] = {"local": [], **{k: [] for k in remotes}}
        fetched: dict[str, dict] = {}
        try:
            for i in range(a.rounds):
                dt, _ = timed_up(local, prompt, expected)
                times["local"].append(dt)
                line = [f"local {dt:6.2f} s"]
                for kind, (url, extra) in remotes.items():
                    fresh = work / f"{kind}-{i}"
                    env = node_env(fresh, a_pub, WARMCTL_REMOTE_STORE=url, **extra)
                    dt, res = timed_up(env, prompt, expected)
                    times[kind].append(dt)
                    fetched[kind] = res.get("fetched", {})
                    shutil.rmtree(fresh, ignore_errors=True)
                    line.append(f"{kind} {dt:6.2f} s")
                print(f"round {i}: up -> first correct token: " + ", ".join(line), flush=True)
        finally:
            for env in (local, env_a):
                wc(env, "down", "tiny", check=False)

        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nmedians over {a.rounds} rounds (snapshot {manifest.total_size() / 2**30:.2f} GiB logical):")
        for k, v in med.items():
            print(f"  {k:6s} {v:6.2f} s   ({v / med['local']:.2f}x local)   fetched: {fetched.get(k, '-')}")

        if "rgw" in remotes:
            url, extra = remotes["rgw"]
            os.environ.update(extra)
            dst = open_store(work / "pull-dst")
            from warmctl.catalog import Ref
            from warmctl.fleet import entries_to_copy, transfer

            src = open_store(url)
            t0 = time.monotonic()
            (c,) = transfer(src, dst, entries_to_copy(src, Ref.parse("tiny")))
            ours = c.report.bytes_copied / (time.monotonic() - t0)
            keys = [o.key for o in src.backend.list("chunks/")]
            prefix = url.split("/", 3)[3] + "/"
            out = work / "boto3"
            out.mkdir()
            t0 = time.monotonic()
            with ThreadPoolExecutor(src.workers) as ex:
                list(ex.map(lambda k: s3.download_file(bucket, prefix + k, str(out / k.replace("/", "_"))), keys))
            dt = time.monotonic() - t0
            total = sum((out / k.replace("/", "_")).stat().st_size for k in keys)
            theirs = total / dt
            print(f"\nfetch from RGW: warmctl {ours / 2**20:,.0f} MiB/s (verified, written) vs boto3 download_file "
                  f"{theirs / 2**20:,.0f} MiB/s ({src.workers} threads, {len(keys)} objects, {total / 2**20:,.0f} MiB): "
                  f"ratio {ours / theirs:.2f}")
        if "oci" in remotes:
            oci_fetch(remotes["oci"], work, entry.manifest)
    shutil.rmtree(work, ignore_errors=True)
    if a.keep_home is None:
        shutil.rmtree(root_a, ignore_errors=True)


def oci_fetch(remote: tuple[str, dict], work: Path, digest: str) -> None:
    """warmctl's pull from the registry against a plain parallel download of the artifact's layers."""
    url, extra = remote
    os.environ.update(extra)
    from warmctl.catalog import Ref
    from warmctl.fleet import entries_to_copy, transfer
    from warmctl.store import open_store
    from warmctl.store.oci import OCIBackend, parse_url

    src, dst = open_store(url), open_store(work / "oci-pull-dst")
    t0 = time.monotonic()
    (c,) = transfer(src, dst, entries_to_copy(src, Ref.parse("tiny")))
    dt_ours = time.monotonic() - t0
    b = OCIBackend(*parse_url(url))
    layers = b._get_manifest(f"manifest-{digest[7:]}", "artifact")[1]["layers"]
    out = work / "oci-blobs"
    out.mkdir()

    t0 = time.monotonic()
    total = download_layers(b, layers, out, src.workers)
    dt = time.monotonic() - t0
    ours = c.report.bytes_copied / dt_ours
    print(f"\nfetch from the registry: warmctl {ours / 2**20:,.0f} MiB/s (ranged reads of packs, verified, written; "
          f"{c.report.bytes_copied / 2**20:,.0f} MiB) vs a plain download of the artifact's {len(layers)} layers "
          f"{total / dt / 2**20:,.0f} MiB/s ({src.workers} threads, {total / 2**20:,.0f} MiB): ratio {ours / (total / dt):.2f}")


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
