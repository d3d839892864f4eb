"""The node pre-warm controller's pre-pull against a plain ``warmctl pull``, side by side.

One run: a real API server on loopback (tests/kubecluster.py: etcd + kube-apiserver v1.20.2,
deploy/kubernetes applied with ``kubectl apply -k``), a publisher home that snapshots
``--profile`` (``fake``: tests/fake_vllm.py holding ``--pad-mib`` MiB of random bytes, so the
snapshot stores about that much, in seconds; ``tiny``: the real vLLM engine, minutes) and pushes it to a directory remote, and a ``WarmSnapshot`` naming it for every node.
Then ``--rounds`` times, in an order that alternates each round, into fresh node homes (empty
stores, trusting the publisher's key):

- ``pull``: ``warmctl pull NAME --from REMOTE --json``;
- ``prewarm``: ``warmctl prewarm --once --json`` as a new Node (created for the round) with the
  node service account's token: the same pull (``warmctl.naming.fleet.pull``) plus reading the Node,
  listing the WarmSnapshots, the label patch and the status write;
- ``prewarm again``: a second ``prewarm --once`` on that node (all chunks there: the steady-state
  cost of one pass).

Each is a separate process; reported: wall seconds (process start to exit) and the copy's own
seconds (from the JSON), the medians, and each variant's median over ``pull``'s. ``sync`` runs
before each; the remote's files stay in the page cache after the first round (what is compared
is the controller's cost over the copy, not the disk). Prints ``uptime`` before and after (the
host is shared). Everything it made (cluster, homes, remote) is removed at the end unless
``--keep``.

Usage::

    python benchmarks/prewarm.py [--profile fake|tiny] [--pad-mib 256] [--rounds 5] [--work DIR] [--keep] [--json OUT]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

NODE_SA = "system:serviceaccount:warmctl:warmctl-node"
WARMCTL = [sys.executable, "-m", "warmctl"]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Run ``warmctl ARGS``; (wall seconds, stdout). Raises with the output on failure."""
    subprocess.run(["sync"], check=True)
    t0 = time.monotonic()
    r = subprocess.run([*WARMCTL, *args], env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"warmctl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return wall, r.stdout


def pad(env: dict[str, str], mib: int) -> dict[str, str]:
    """``env`` (a ``fake_env``) with its ``fake`` profile's engine holding ``mib`` MiB of random
    bytes (``FAKE_VLLM_PAD_MIB``, tests/fake_vllm.py)."""
    f = Path(env["WARMCTL_CONFIG"]).parent / "profiles" / "fake.toml"
    f.write_text(f.read_text().replace("[engine.env]\n", f'[engine.env]\nFAKE_VLLM_PAD_MIB = "{mib}"\n', 1))
    assert "FAKE_VLLM_PAD_MIB" in f.read_text()
    return env


def node_home(root: Path, publisher: dict[str, str], profile: str, pad_mib: int) -> dict[str, str]:
    """A fresh home under ``root`` trusting the publisher's keys (same profile files)."""
    from conftest import fake_env, isolated_env

    ports = int(os.environ.get("WARMCTL_TEST_ENGINE_PORT", "18000")), int(os.environ.get("WARMCTL_TEST_GATE_PORT", "18080"))
    pub_root = Path(publisher["WARMCTL_CONFIG"]).parent
    env = pad(fake_env(root, *ports, hold=pub_root / "hold"), pad_mib) if profile == "fake" else isolated_env(root, *ports)
    (root / "keys").mkdir(exist_ok=True)
    for pub in (pub_root / "keys").glob("*.pub"):
        shutil.copy(pub, root / "keys" / pub.name)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--profile", choices=("fake", "tiny"), default="fake")
    ap.add_argument("--pad-mib", type=int, default=256, help="fake: MiB of random bytes the engine holds.")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, help="Working directory (default: a new temporary one).")
    ap.add_argument("--keep", action="store_true", help="Keep the working directory.")
    ap.add_argument("--json", type=Path, help="Also write the results as JSON here.")
    a = ap.parse_args()

    from conftest import fake_env, isolated_env
    from kubecluster import KubeCluster, missing

    if (why := missing()) is not None:
        raise SystemExit(f"no Kubernetes binaries: {why}")
    work = a.work or Path(tempfile.mkdtemp(prefix="warmctl-bench-prewarm-"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"profile": a.profile, "pad_mib": a.pad_mib if a.profile == "fake" else None, "rounds": a.rounds, "uptime_start": uptime(), "runs": []}
    print(res["uptime_start"], flush=True)
    try:
        ports = int(os.environ.get("WARMCTL_TEST_ENGINE_PORT", "18000")), int(os.environ.get("WARMCTL_TEST_GATE_PORT", "18080"))
        if a.profile == "fake":
            publisher = pad(fake_env(work / "publisher", *ports), a.pad_mib)
        else:
            publisher = isolated_env(work / "publisher", *ports)
        remote = work / "remote"
        t0 = time.monotonic()
        run(["snapshot", a.profile], publisher)
        run(["push", a.profile, "--to", str(remote)], publisher)
        stored = sum(p.stat().st_size for p in (remote / "chunks").rglob("*") if p.is_file())
        res["stored_bytes"] = stored
        print(f"snapshot {a.profile} made and pushed in {time.monotonic() - t0:.1f} s: {stored / 2**20:.1f} MiB "
              f"of chunks in {remote}", flush=True)
        with KubeCluster(work / "kube") as kube:
            kube.kubectl("apply", "-k", str(ROOT / "deploy" / "kubernetes"), check=True)
            kube.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/warmsnapshots.warmctl.io", check=True)
            kube.kubectl("apply", "-f", "-", check=True, input=json.dumps({
                "apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot", "metadata": {"name": "bench"},
                "spec": {"ref": f"{a.profile}:latest", "remote": str(remote)}}))
            kubeconfig = kube.kubeconfig(work / "node-sa.yaml", NODE_SA)
            for i in range(a.rounds):
                node = f"bench-node-{i}"
                kube.kubectl("apply", "-f", "-", check=True, input=json.dumps(
                    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}))
                p_env = node_home(work / f"pull-{i}", publisher, a.profile, a.pad_mib)
                w_env = dict(node_home(work / f"prewarm-{i}", publisher, a.profile, a.pad_mib), WARMCTL_KUBECONFIG=str(kubeconfig),
                             WARMCTL_NODE_NAME=node)
                row: dict = {"round": i}
                order = ["pull", "prewarm"] if i % 2 == 0 else ["prewarm", "pull"]
                for v in order:
                    if v == "pull":
                        wall, out = run(["pull", a.profile, "--from", str(remote), "--json"], p_env)
                        [c] = json.loads(out)
                        row["pull"] = {"wall_s": wall, "copy_s": c["seconds"], "bytes": c["bytes_copied"]}
                    else:
                        wall, out = run(["prewarm", "--once", "--json"], w_env)
                        [o] = json.loads(out)
                        assert o["action"] == "cached", o
                        row["prewarm"] = {"wall_s": wall, "copy_s": o["copy_seconds"], "pull_s": o["seconds"],
                                          "bytes": o["bytes_copied"]}
                wall, out = run(["prewarm", "--once", "--json"], w_env)
                [o] = json.loads(out)
                row["prewarm again"] = {"wall_s": wall, "copy_s": o["copy_seconds"], "pull_s": o["seconds"],
                                        "bytes": o["bytes_copied"]}
                labels = json.loads(kube.kubectl("get", "node", node, "-o", "json", check=True).stdout)["metadata"]["labels"]
                assert labels.get("snapshot.warmctl.io/bench", "").startswith("sha256-"), labels
                res["runs"].append(row)
                print(f"round {i}: " + ", ".join(f"{v} {row[v]['wall_s']:.2f} s wall / {row[v]['copy_s']:.2f} s copy "
                                                 f"({row[v]['bytes'] / 2**20:.1f} MiB)" for v in ("pull", "prewarm", "prewarm again")),
                      flush=True)
                shutil.rmtree(work / f"pull-{i}", ignore_errors=True)
                shutil.rmtree(work / f"prewarm-{i}", ignore_errors=True)
    finally:
        res["uptime_end"] = uptime()
        print(res["uptime_end"])
        if not a.keep and a.work is None:
            shutil.rmtree(work, ignore_errors=True)

    med = {v: {k: statistics.median(r[v][k] for r in res["runs"]) for k in ("wall_s", "copy_s", "pull_s") if k in res["runs"][0][v]}
           for v in ("pull", "prewarm", "prewarm again")}
    res["median"] = med
    print(f"\n{a.profile}: {res['stored_bytes'] / 2**20:.1f} MiB stored, {a.rounds} rounds, medians "
          "(wall: the process; copy: the chunk copy alone; pull: prewarm's whole pull, fingerprint and checks included)")
    print("variant\twall s\tcopy s\tpull s\twall / pull's\tcopy / pull's")
    for v, m in med.items():
        print(f"{v}\t{m['wall_s']:.2f}\t{m['copy_s']:.2f}\t{m['pull_s']:.2f}\t" if "pull_s" in m else
              f"{v}\t{m['wall_s']:.2f}\t{m['copy_s']:.2f}\t-\t", end="")
        print(f"{m['wall_s'] / med['pull']['wall_s']:.2f}\t{m['copy_s'] / med['pull']['copy_s']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
