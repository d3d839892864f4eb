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

- **pulled**, **pulled-unhashed** (with ``--pulled``): ``up`` on a fresh node (no remote
  configured) right after its ``warmctl pull`` from the directory: as ``pull`` leaves it (the
  digests of the files the engine maps in the node's digest cache), and with that cache
  removed before ``up`` (what an ``up`` after a pull paid before ``pull`` hashed them: ``up``
  hashes them in its materialize phase); the two alternate which goes first;

each measured from the command's start to the first *correct* token on the public port (the
canary's first token id), asked once the command returned and, beside it, by a client polling
the port every 50 ms from the command's start (``polled``: the port opens before ``up``'s
"commit" and "keep" phases end), then ``down`` and the fresh node's home removed.

Fetch throughput (once, after the rounds): warmctl's streaming fetch from RGW (``pull`` of the
snapshot into an empty store: parallel ranged GETs, every chunk verified and written) against
boto3's ``download_file`` of the same chunk objects to files with as many threads; and from the
registry: ``pull`` against a plain parallel download (httpx, one stream per blob, as many threads)
of the layers of the snapshot's artifact.

Each ``up`` also prints its phases (``--json`` ``timings_s``: catalog, materialize, restore,
health, canary, gate, keep) and what lies outside them (interpreter start-up and imports,
pre-flight, the prestarted gate; the command's wall time minus the phases), and the medians end
with a per-phase table: where a fresh node's time goes beyond the warm node's.

``--old DIR``: a second warmctl checkout (e.g. ``git worktree add --detach /tmp/old <commit>``)
whose ``up`` runs beside this one's on the fresh nodes, in the same rounds (``old-dir``,
``old-rgw``...): before/after in one run. ``--profile-env NAME=VALUE`` (repeatable): added to
the ``tiny`` profile's ``[engine.env]`` on every node (e.g. ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``
on an AMX host when ``--old`` predates c20c503: before it, a restored engine that used AMX died
of SIGILL, CRIU 4.2 not giving the restored process its AMX permission back; an ``--old`` node
also gets ``criu-xtile-perm.so`` in ``LD_PRELOAD``, which its ``criu restore`` inherits).

Usage::

    python benchmarks/fleet_up.py [--rounds 3] [--no-rgw] [--no-oci] [--pulled] [--keep-home DIR]
        [--old DIR] [--profile-env NAME=VALUE] [--restore-stream auto|never]

``--restore-stream``: the fresh nodes' ``restore_stream`` (``WARMCTL_RESTORE_STREAM``), for both
checkouts (e.g. ``auto`` with ``--old`` at an earlier streamer: streamed against streamed).

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
    # run in the checkout's tree: ``-m`` puts the working directory first on sys.path
    r = subprocess.run([sys.executable, "-m", "warmctl", *args], env=env, capture_output=True, text=True,
                       cwd=env.get("PYTHONPATH") or None)
    if check and r.returncode:
        sys.exit(f"warmctl {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


PROFILE_ENV: dict[str, str] = {}  # --profile-env, added to every node's tiny profile
RESTORE_STREAM: list[str] = []  # --restore-stream: WARMCTL_RESTORE_STREAM of every fresh node (both checkouts)


def home_env(root: Path) -> dict[str, str]:
    """:func:`tests.conftest.isolated_env` with :data:`PROFILE_ENV` in its tiny profile."""
    from tests.conftest import isolated_env

    env = isolated_env(root, ENGINE_PORT, GATE_PORT)
    if PROFILE_ENV:
        p = root / "profiles" / "tiny.toml"
        add = "".join(f'\n{k} = "{v}"' for k, v in PROFILE_ENV.items())
        p.write_text(p.read_text().replace('HF_HUB_OFFLINE = "1"', 'HF_HUB_OFFLINE = "1"' + add, 1))
    return env


def node_env(root: Path, a_pub: Path, checkout: Path | None = None, **extra: str) -> dict[str, str]:
    """A fresh node: isolated home under ``root``, trusting node A's key; ``checkout``: run
    that warmctl source tree's ``up`` (PYTHONPATH) instead of this one's."""
    env = home_env(root)
    (root / "keys").mkdir(exist_ok=True)
    shutil.copy(a_pub, root / "keys" / "node-a.pub")
    env.update(extra)
    env["PYTHONPATH"] = str(checkout or REPO)
    if RESTORE_STREAM:
        env["WARMCTL_RESTORE_STREAM"] = RESTORE_STREAM[0]
    lib = Path("/usr/local/lib/warmctl/criu-xtile-perm.so")
    if checkout is not None and lib.is_file():  # an --old warmctl without the AMX fix: its criu inherits it
        env["LD_PRELOAD"] = ":".join(x for x in (str(lib), env.get("LD_PRELOAD", "")) if x)
    return env


#: the phases of a restore ``up`` in its order (``timings_s``), "commit" and "keep" after the port opened
PHASES = ("catalog", "materialize", "restore", "health", "canary", "gate", "commit", "keep")


def timed_up(env, prompt: str, expected: int) -> tuple[float, dict]:
    """(seconds from the command's start to the first correct token, asked once the command has
    returned; ``up --json``'s result with ``wall_s``: the command's own wall time, ``outside_s``:
    wall minus its phases, and ``polled_s``: seconds from the command's start to the first
    correct token of a client polling the public port meanwhile (every 50 ms from the start,
    as a load balancer's client would: what the port opening before "commit" and "keep" gives)."""
    with ThreadPoolExecutor(1) as ex:
        t0 = time.monotonic()
        poll = ex.submit(first_token, GATE_PORT, prompt)
        r = wc(env, "up", "tiny", "--json", "--cold-start", "never")
        wall = time.monotonic() - t0
        ptok, tp = poll.result()
    assert ptok == expected, f"first token (polling) {ptok} != canary {expected}"
    tok, t1 = first_token(GATE_PORT, prompt)
    assert tok == expected, f"first token {tok} != canary {expected}"
    res = json.loads(r.stdout)
    res["polled_s"] = tp - t0
    assert res["path"] == "restore", res
    t = res.get("timings_s", {})
    res["wall_s"] = wall
    res["outside_s"] = wall - sum(v for k, v in t.items() if k != "total")
    wc(env, "down", "tiny")
    return t1 - t0, res


def phase_line(res: dict) -> str:
    t = res.get("timings_s", {})
    parts = [f"{k} {t[k]:.2f}" for k in PHASES if k in t]
    return " ".join(parts) + f" outside {res['outside_s']:.2f}; token while polling {res['polled_s']:.2f}"


def boto3_download(s3, bucket: str, keys: list[str], out: Path, threads: int) -> tuple[int, float]:
    """boto3 ``download_file`` of every object ``keys`` of ``bucket`` into files under ``out``
    (created), ``threads`` at a time: the S3 floor. Returns (bytes, seconds)."""
    out.mkdir(parents=True)
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda k: s3.download_file(bucket, k, str(out / k.replace("/", "_"))), keys))
    dt = time.monotonic() - t0
    return sum(p.stat().st_size for p in out.iterdir()), dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-rgw", action="store_true", help="skip the Ceph RGW remote")
    ap.add_argument("--no-oci", action="store_true", help="skip the OCI registry remote")
    ap.add_argument("--pulled", action="store_true",
                    help="also up on fresh nodes right after their pull, with and without the digests pull hashed")
    ap.add_argument("--keep-home", type=Path, default=None, help="reuse/keep node A's home (its snapshot)")
    ap.add_argument("--old", type=Path, default=None, help="another warmctl checkout whose up runs beside this one's")
    ap.add_argument("--profile-env", action="append", default=[], metavar="NAME=VALUE",
                    help="added to every node's tiny profile [engine.env]")
    ap.add_argument("--restore-stream", choices=("auto", "never"), default=None,
                    help="every fresh node's restore_stream (both checkouts; default: the setting's own default)")
    a = ap.parse_args()
    PROFILE_ENV.update(x.split("=", 1) for x in a.profile_env)
    RESTORE_STREAM.extend([a.restore_stream] if a.restore_stream else [])

    root_a = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-fleet-a-"))
    work = Path(tempfile.mkdtemp(prefix="warmctl-fleet-"))
    env_a = home_env(root_a)
    os.environ["WARMCTL_CONFIG"] = env_a["WARMCTL_CONFIG"]
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
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
            from ports import free_port
            from rgw_server import start_rgw

            ep, ak, sk = stack.enter_context(start_rgw(work / "ceph", free_port(), free_port()))
            s3env = {"WARMCTL_S3_ENDPOINT": ep, "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk,
                     "AWS_DEFAULT_REGION": "us-east-1"}
            bucket = f"fleet-{uuid.uuid4().hex[:8]}"
            s3 = boto3.client("s3", endpoint_url=ep, aws_access_key_id=ak, aws_secret_access_key=sk, region_name="us-east-1")
            s3.create_bucket(Bucket=bucket)
            remotes["rgw"] = (f"s3://{bucket}/warmctl", s3env)
        if not a.no_oci:
            from registry_server import Registry, docker_config, make_ca
            from ports import free_port

            ca = make_ca(work / "oci-ca")
            reg = stack.enter_context(Registry(work / "oci", free_port(), ca=ca, users={"fleet": "fleet-pw"}))
            ocienv = {"WARMCTL_OCI_CA_BUNDLE": str(ca.ca_cert),
                      "REGISTRY_AUTH_FILE": str(docker_config(work / "oci-auth.json", reg.host, "fleet", "fleet-pw"))}
            remotes["oci"] = (f"oci://{reg.host}/fleet/warmctl", ocienv)
        for kind, (url, extra) in remotes.items():
            t0 = time.monotonic()
            wc(dict(env_a, **extra), "push", "tiny", "--to", url)
            print(f"push to {kind}: {time.monotonic() - t0:.1f} s", flush=True)

        local = node_env(work / "local", a_pub)
        wc(local, "pull", "tiny", "--from", remotes["dir"][0])
        checkouts = {"": None, **({"old-": a.old.resolve()} if a.old else {})}
        kinds = [p + k for p in checkouts for k in remotes] + (["pulled", "pulled-unhashed"] if a.pulled else [])
        times: dict[str, list[float]] = {"local": [], **{k: [] for k in kinds}}
        results: dict[str, list[dict]] = {k: [] for k in times}
        fetched: dict[str, dict] = {}
        try:
            for i in range(a.rounds):
                dt, res = timed_up(local, prompt, expected)
                times["local"].append(dt)
                results["local"].append(res)
                print(f"round {i} local: {dt:6.2f} s to the first correct token; {phase_line(res)}", flush=True)
                for kind, (url, extra) in remotes.items():
                    for pre, checkout in checkouts.items():
                        fresh = work / f"{pre}{kind}-{i}"
                        env = node_env(fresh, a_pub, checkout, WARMCTL_REMOTE_STORE=url, **extra)
                        dt, res = timed_up(env, prompt, expected)
                        times[pre + kind].append(dt)
                        results[pre + kind].append(res)
                        fetched[pre + kind] = res.get("fetched", {})
                        shutil.rmtree(fresh, ignore_errors=True)
                        print(f"round {i} {pre + kind}: {dt:6.2f} s to the first correct token; {phase_line(res)}",
                              flush=True)
                pulled_sides = ["pulled", "pulled-unhashed"] if a.pulled else []
                for kind in (pulled_sides[::-1] if i % 2 else pulled_sides):  # each goes first in turn
                    fresh = work / f"{kind}-{i}"
                    env = node_env(fresh, a_pub)
                    [pulled] = json.loads(wc(env, "pull", "tiny", "--from", remotes["dir"][0], "--json").stdout)
                    if kind == "pulled-unhashed":
                        (fresh / "home" / "cache" / "file-digests.json").unlink()
                    dt, res = timed_up(env, prompt, expected)
                    times[kind].append(dt)
                    results[kind].append(res)
                    shutil.rmtree(fresh, ignore_errors=True)
                    print(f"round {i} {kind}: {dt:6.2f} s to the first correct token; {phase_line(res)}; its pull "
                          f"{pulled['seconds']:.2f} s + {pulled['files_hashed']} files hashed in "
                          f"{pulled['hash_seconds']:.2f} s", flush=True)
        finally:
            for env in (local, env_a):
                wc(env, "down", "tiny", check=False)

        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nmedians over {a.rounds} rounds (snapshot {manifest.total_size() / 2**30:.2f} GiB logical):")
        for k, v in med.items():
            pk = statistics.median(r["polled_s"] for r in results[k])
            pl = statistics.median(r["polled_s"] for r in results["local"])
            print(f"  {k:16s} {v:6.2f} s   ({v / med['local']:.2f}x local; polling the port: {pk:.2f} s, "
                  f"{pk / pl:.2f}x local)   fetched: {fetched.get(k, '-')}")
        print("\nmedian seconds per phase (outside: the command's wall time minus its phases; "
              "to token: from the command's start to the first correct token asked after it returned; "
              "polled: the same for a client polling the port from the start):")
        cols = [*PHASES, "outside", "to token", "polled"]
        print("  " + " " * 16 + "".join(f"{c:>12s}" for c in cols))
        for k, rs in results.items():
            def med_of(c: str) -> float:
                if c == "outside":
                    return statistics.median(r["outside_s"] for r in rs)
                if c == "to token":
                    return med[k]
                if c == "polled":
                    return statistics.median(r["polled_s"] for r in rs)
                return statistics.median(r.get("timings_s", {}).get(c, 0.0) for r in rs)
            print(f"  {k:16s}" + "".join(f"{med_of(c):12.2f}" for c in cols))

        if "rgw" in remotes:
            url, extra = remotes["rgw"]
            os.environ.update(extra)
            dst = open_store(work / "pull-dst")
            from warmctl.naming.catalog import Ref
            from warmctl.records.config import load_settings
            from warmctl.naming.fleet import entries_to_copy, transfer

            src = open_store(url, settings=load_settings())  # the endpoint from $WARMCTL_S3_ENDPOINT (extra)
            t0 = time.monotonic()
            (c,) = transfer(src, dst, entries_to_copy(src, Ref.parse("tiny")))
            ours = c.report.bytes_copied / (time.monotonic() - t0)
            keys = [o.key for o in src.backend.list("chunks/")]
            prefix = url.split("/", 3)[3] + "/"
            total, dt = boto3_download(s3, bucket, [prefix + k for k in keys], work / "boto3", src.workers)
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
    from warmctl.naming.catalog import Ref
    from warmctl.records.config import load_settings
    from warmctl.naming.fleet import entries_to_copy, transfer
    from warmctl.store import open_store
    from warmctl.store.oci import OCIBackend, parse_url

    st = load_settings()  # the CA from $WARMCTL_OCI_CA_BUNDLE (extra)
    src, dst = open_store(url, settings=st), open_store(work / "oci-pull-dst", settings=st)
    t0 = time.monotonic()
    (c,) = transfer(src, dst, entries_to_copy(src, Ref.parse("tiny")))
    dt_ours = time.monotonic() - t0
    b = OCIBackend(*parse_url(url), ca_bundle=st.oci_ca_bundle)
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
