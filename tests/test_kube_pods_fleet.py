"""A snapshot made in a pod on one node, pushed to a remote, then restored by pods on a second
node, cold and pre-warmed, on two real kubelets (tests/kubenode.py: node ``127.0.0.1`` and node
``127.0.0.2``, each with its own containerd, kubelet, cgroup root and mount namespace for the
host paths a kubelet writes), with the figures side by side (``-s`` prints them;
docs/benchmarks.md, "Engine pods: warm node, cold node, host").

A node's store is a directory of that node's (under its working directory): a pod mounts the
store of the node it runs on, at ``/var/lib/warmctl`` in every pod as the shipped workloads do
(CRIU restores at the paths of the dump: the engine's working and run directories are in the
home, and a different path on the restoring node fails with ``Can't open cwd``), with the
snapshot's model files copied in (what the image or a model volume gives a real node). The remote is a directory outside both nodes, on a hostPath every
pod mounts (what a shared volume or an S3 bucket is to a fleet). A "fresh" node store is an
empty directory on a node, exactly what a node that never saw the snapshot has.

- ``warmctl snapshot tiny --push`` in a pod on node 1 (the snapshot Job's command,
  deploy/kubernetes/snapshot-job.yaml), signed with a key mounted as a file, pushed to the
  remote; its image digest recorded.
- Node 2 pulls the engine image from the loopback registry (a pod running ``warmctl version``,
  timed apart from the restores).
- Node 2, cold: ``up tiny --foreground --cold-start never`` in a pod bound to node 2 as the
  ``warmctl-engine`` service account, nothing in its store: Ready, "Paris.", its
  ``warmctl.io/Restored`` condition's final message says how much it read from the remote (> 0).
- Node 2, pre-warmed: ``warmctl prewarm --once --json`` in a pod on node 2 as the
  ``warmctl-node`` service account (the DaemonSet's controller, one pass; its node from the
  downward API) for a ``WarmSnapshot`` naming ``tiny`` on the remote, into a fresh store of node
  2: node 2 is labelled with the digest (node 1 is not), the object's status names node 2; then
  an engine pod with **no node name** and a required node affinity on that label (as the engine
  Deployment prefers warm nodes) is bound to node 2 by kube-scheduler, restores with the remote
  still configured and reads 0 bytes from it, Ready, "Paris.".
- A second round on node 1 in the other order (pre-warm a fresh store, its pod, then a cold
  store's pod: on this host a restore that follows another one has been the slower one
  whichever store it read, docs/benchmarks.md), and a plain ``warmctl pull`` pod beside the
  pre-warm's pull; nothing left on either node.
- The host's own ``warmctl up`` of the same profile's snapshot (made on the host: a snapshot
  made in the image restores only in a pod of that image), twice, its image cache emptied
  before each as a restore pod's is: the faster is the ratios' reference (one host ``up`` has
  been both 7.7 and 15.6 s on this host; CRIU's restore phase alone 3.6 and 9.1 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from kubenode import OPT_IN
from test_kube_pods import (
    _chat,
    _create,
    _delete,
    _engine_pids,
    _engine_pod,
    _finished,
    _ready,
    _restored,
    _served,
    _terminated,
    _wait_no_leftovers,
)

REPO = Path(__file__).resolve().parent.parent
#: Where every pod mounts the node store it uses, whichever node it runs on and whichever host
#: directory that store is (as deploy/kubernetes's workloads mount ``/var/lib/warmctl``): a
#: snapshot's paths (the engine's working directory, its run directory, the model files it
#: maps) are the same in every pod, which CRIU needs.
STORE = Path("/var/lib/warmctl")

pytestmark = OPT_IN


def _fleet_pod(name: str, image: tuple[str, str], root: Path, store: Path, node: str | None, gate_port: int,
               args: list[str], env: dict[str, str], namespace: str = "default", api_port: int = 0,
               service_account: str = "warmctl-engine", ready_port: int | None = None) -> dict:
    """:func:`test_kube_pods._engine_pod` on node store ``store`` (a host directory of node
    ``node``: its config.toml, profiles, keys and home; None: no ``nodeName``, the scheduler
    binds the pod), mounted at :data:`STORE`, with the fleet directory ``root`` also mounted (the
    remote, the signing key), ``env`` added, and ``service_account`` when ``api_port`` is given."""
    pod = _engine_pod(name, image, store, gate_port, args, namespace=namespace, api_port=api_port, node=node,
                      ready_port=ready_port)
    spec = pod["spec"]
    if api_port:
        spec["serviceAccountName"] = service_account
    c = spec["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "WARMCTL_CONFIG"]
    c["env"] += [{"name": "WARMCTL_CONFIG", "value": str(STORE / "config.toml")},
                 *({"name": k, "value": v} for k, v in env.items())]
    for m in c["volumeMounts"]:
        if m["name"] == "share":
            m["mountPath"] = str(STORE)
    spec["containers"][0]["volumeMounts"].append({"name": "fleet", "mountPath": str(root)})
    spec["volumes"].append({"name": "fleet", "hostPath": {"path": str(root), "type": "Directory"}})
    return pod


def _wait_token(cluster, account: str) -> None:
    deadline = time.monotonic() + 60
    while not cluster.request("GET", f"/api/v1/namespaces/warmctl/serviceaccounts/{account}")[1].get("secrets"):
        assert time.monotonic() < deadline, f"the {account} service account got no token within 60 s"
        time.sleep(0.2)


def _restore_pod(node, name: str, image, root: Path, store: Path, gate_port: int, remote: Path | None,
                 affinity: dict | None = None, profile: str = "tiny",
                 ready_port: int | None = None) -> tuple[float, dict, str, dict, str]:
    """An engine pod restoring ``profile`` from node store ``store`` (``remote`` configured
    unless None, no cold start) as the ``warmctl-engine`` service account, bound to ``node`` (a KubeNode), or,
    with ``affinity``, given that instead of a node name for the scheduler to place it; its
    readiness probe the gate's ``/health``, or with ``ready_port`` the supervisor's ``/ready``:
    (created -> Ready seconds, its final ``warmctl.io/Restored`` condition, where the seconds
    went, the pod, its log). Leaves the pod serving."""
    cluster = node.cluster
    t0, wall0 = time.monotonic(), time.time()
    pod = _fleet_pod(name, image, root, store, None if affinity else node.name, gate_port,
                     ["up", profile, "--foreground", "--cold-start", "never"],
                     {"WARMCTL_REMOTE_STORE": str(remote)} if remote else {}, namespace="warmctl", api_port=cluster.port,
                     ready_port=ready_port)
    if affinity:
        pod["spec"]["affinity"] = affinity
    _create(node, pod)
    pod = node.wait_pod("warmctl", name, lambda p: _ready(p) is True or _finished(p), timeout=900, what="Ready")
    ready_s = time.monotonic() - t0
    logs = cluster.kubectl("logs", "-n", "warmctl", name).stdout
    assert _ready(pod), f"restore pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
    pod = node.wait_pod("warmctl", name, _served, timeout=30,
                        what="warmctl.io/Restored=Serving")
    phases = " ".join(ln.strip() for ln in logs.splitlines() if ln.startswith("ok "))
    # where the seconds went: created -> the container's first line (sandbox, container start,
    # Python and warmctl's imports), up's own total (the Serving message), the rest (the probe's
    # period, the kubelet's status write, this poll)
    first = cluster.kubectl("logs", "--timestamps", "-n", "warmctl", name).stdout.split(" ", 1)[0]
    started_s = _rfc3339(first) - wall0
    total = re.search(r"; ([0-9.]+) s( \(|$)", _restored(pod)["message"])
    up_s = float(total.group(1)) if total else float("nan")
    split = (f"created -> first log line {started_s:.1f} s, up's total {up_s:.2f} s, "
             f"the rest {ready_s - started_s - up_s:.1f} s; phases: {phases}")
    return ready_s, _restored(pod), split, pod, logs


def _json_tail(logs: str) -> list:
    """The JSON list a ``--json`` command printed in ``logs`` (the container's stdout and stderr
    together: log lines come before it and may come after it)."""
    lines = logs.splitlines()
    for i in range(len(lines)):
        if lines[i].startswith("["):
            try:
                return json.JSONDecoder().raw_decode("\n".join(lines[i:]))[0]
            except ValueError:
                continue
    raise AssertionError(f"no JSON list in the logs:\n{logs[-3000:]}")


def _rfc3339(ts: str) -> float:
    """Seconds since the epoch of an RFC 3339 UTC time with up to nanoseconds (kubectl's
    ``--timestamps``)."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z", ts)
    assert m, f"not an RFC 3339 UTC time: {ts!r}"
    whole = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return whole + float("0." + (m.group(2) or "0"))


def _gone(node, namespace: str, name: str) -> None:
    _delete(node, namespace, name, grace=30)
    node.wait_pod(namespace, name, lambda p: p is None, timeout=90, what="deleted")


def _host_up(root: Path, engine_port: int, gate_port: int) -> list[tuple[float, str]]:
    """``warmctl snapshot tiny`` then ``warmctl up tiny --json`` on the host (its own home under
    ``root``), twice: the first right after the snapshot, the second after ``down`` and with the
    home's image cache removed, so that it writes the image from the store again as every restore
    pod does. [(seconds of each up, its timings)]. Stops the engine after."""
    from conftest import tiny_profile

    (root / "profiles").mkdir(parents=True)
    (root / "profiles" / "tiny.toml").write_text(tiny_profile(engine_port, gate_port))
    (root / "config.toml").write_text(f'home = "{root / "home"}"\nprofile_dirs = ["{root / "profiles"}"]\n'
                                      f'keys_dir = "{root / "keys"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
    env["WARMCTL_CONFIG"] = str(root / "config.toml")

    def run(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "warmctl", *args], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=1500)
        assert r.returncode == 0, f"warmctl {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}"
        return r

    def down() -> None:
        subprocess.run([sys.executable, "-m", "warmctl", "down", "tiny"], env=env, cwd=REPO, capture_output=True,
                       timeout=300)
    ups = []
    try:
        run("snapshot", "tiny")
        for _ in range(2):
            down()
            shutil.rmtree(root / "home" / "cache" / "images", ignore_errors=True)
            t0 = time.monotonic()
            res = json.loads(run("up", "tiny", "--json", "--cold-start", "never").stdout)
            up_s = time.monotonic() - t0
            assert res["path"] == "restore", res
            t = res.get("timings", {})
            ups.append((up_s, ", ".join(f"{k} {v:.2f}" for k, v in t.items() if isinstance(v, (int, float)))))
        return ups
    finally:
        down()


def _label(cluster, node: str, key: str) -> str | None:
    """Node ``node``'s label ``key`` (None when it has none)."""
    obj = json.loads(cluster.kubectl("get", "node", node, "-o", "json", check=True).stdout)
    return obj["metadata"].get("labels", {}).get(key)


@pytest.mark.e2e
def test_snapshot_pushed_from_a_pod_on_one_node_restored_on_a_second_node_cold_and_prewarmed(
        kube_node, kube_node2, engine_image, engine_ports, tmp_path):
    engine_port, gate_port = engine_ports[0] + 14, engine_ports[1] + 14
    cluster = kube_node.cluster
    cluster.start_scheduler()  # binds the pod that names no node (the warm node's, by affinity)
    node1, node2 = kube_node, kube_node2
    fleet = f"fleet-{uuid.uuid4().hex[:6]}"
    root = tmp_path / fleet  # outside both nodes: the remote and the publisher's key
    remote = root / "remote"
    remote.mkdir(parents=True)
    # the publisher's signing key (a Secret mounted as a file, in a cluster); every node trusts its .pub
    r = subprocess.run([sys.executable, "-m", "warmctl", "keygen", str(root / "signing")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    models: list[Path] = []  # the model files the snapshot's engine maps, once it is made

    def store(node, name: str) -> Path:
        """A fresh node store on ``node`` (a directory of its own; :data:`STORE` in its pods):
        the tiny profile, trusting the publisher, no snapshot; once the snapshot is made, its
        model files at the same path (what the image or a model volume gives a real node:
        ``up`` refuses a snapshot whose mapped files are missing)."""
        from conftest import tiny_profile

        s = node.workdir / "share" / fleet / name
        (s / "profiles").mkdir(parents=True)
        (s / "profiles" / "tiny.toml").write_text(tiny_profile(engine_port, gate_port))
        (s / "config.toml").write_text(f'home = "{STORE / "home"}"\nprofile_dirs = ["{STORE / "profiles"}"]\n'
                                       f'keys_dir = "{STORE / "keys"}"\n')
        (s / "keys").mkdir()
        shutil.copy(root / "signing" / "warmctl.pub", s / "keys" / "warmctl.pub")
        for m in models:
            shutil.copytree(m, s / "home" / "models")
        return s

    pub = store(node1, "pub")
    for f in ("namespace.yaml", "serviceaccounts.yaml", "rbac.yaml", "crd-warmsnapshot.yaml"):
        cluster.kubectl("apply", "-f", str(REPO / "deploy" / "kubernetes" / f), check=True)
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/warmsnapshots.warmctl.io",
                    check=True)
    for account in ("warmctl-engine", "warmctl-node"):
        _wait_token(cluster, account)
    figures: dict[str, float] = {}
    splits: list[str] = []

    # 1. the snapshot Job's command in a pod on node 1: snapshot, sign, push to the remote
    snap = f"snapjob-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    _create(node1, _fleet_pod(snap, engine_image, root, pub, node1.name, gate_port, ["snapshot", "tiny", "--push"],
                              {"WARMCTL_REMOTE_STORE": str(remote),
                               "WARMCTL_SIGNING_KEY": str(root / "signing" / "warmctl.key")}))
    pod = node1.wait_pod("default", snap, _finished, timeout=1500, what="finished")
    figures["snapshot pod, node 1 (cold start + dump + push)"] = time.monotonic() - t0
    logs = cluster.kubectl("logs", "-n", "default", snap).stdout
    assert pod["status"]["phase"] == "Succeeded", f"snapshot pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
    _gone(node1, "default", snap)
    entries = [json.loads(p.read_text()) for p in (remote / "catalog" / "tiny" / "latest").glob("*.json")]
    assert [e["host"].get("image_digest") for e in entries] == [engine_image[1]], entries
    digest = entries[0]["manifest"]
    models.append(pub / "home" / "models")
    assert models[0].is_dir(), sorted(p.name for p in (pub / "home").iterdir())

    # 2. node 2 pulls the engine's image from the registry (timed apart from the restores)
    img = f"image-{uuid.uuid4().hex[:6]}"
    ipod = _fleet_pod(img, engine_image, root, store(node2, "image"), node2.name, gate_port, ["version"], {})
    del ipod["spec"]["containers"][0]["readinessProbe"]
    t0 = time.monotonic()
    _create(node2, ipod)
    pod = node2.wait_pod("default", img, _finished, timeout=900, what="finished")
    figures["image pull on node 2 (a pod running `warmctl version`)"] = time.monotonic() - t0
    assert pod["status"]["phase"] == "Succeeded" and pod["spec"]["nodeName"] == node2.name, pod["status"]
    assert pod["status"]["hostIP"] == node2.name and pod["status"]["podIP"] == node2.name, pod["status"]
    assert pod["status"]["containerStatuses"][0]["imageID"].endswith("@" + engine_image[1])
    _gone(node2, "default", img)

    ws = f"tiny-{uuid.uuid4().hex[:6]}"  # the WarmSnapshot (its name: the node label's key)
    key = f"snapshot.warmctl.io/{ws}"
    want_label = "sha256-" + digest[7:47]

    def restore(node, s: Path, what: str, remote_bytes: bool, affinity: dict | None = None) -> None:
        """One engine pod restoring on node store ``s`` of ``node`` (bound there by name, or by
        the scheduler through ``affinity``): on that node, Ready, its condition naming the
        digest and what it read from the remote (> 0 for a cold store, 0 for a pre-warmed one),
        "Paris."; the files the engine maps hashed by the pod on a cold store only (on a
        pre-warmed one the pre-warm pod put their digests in the node's cache); deleted; its
        figures kept under ``what``."""
        up = f"up-{uuid.uuid4().hex[:6]}"
        ready_s, cond, split, pod, logs = _restore_pod(node, up, engine_image, root, s, gate_port, remote, affinity,
                                                       ready_port=gate_port + 10)  # the shipped probe: /ready
        assert pod["spec"]["nodeName"] == node.name and pod["status"]["hostIP"] == node.name, pod["spec"]
        # the image's files the engine maps: hashed by a cold node's pod, by the pre-warm on a warm one
        assert ("required files:" in logs) == remote_bytes, logs[-3000:]
        assert cond["status"] == "True" and digest in cond["message"], cond
        if remote_bytes:
            assert "read 0.0 MiB from the remote store" not in cond["message"] and "from the remote store" in cond["message"], cond
        else:
            assert "read 0.0 MiB from the remote store" in cond["message"], cond
        assert _chat(gate_port).strip() == "Paris."
        _gone(node, "warmctl", up)
        figures[what] = ready_s
        splits.append(f"{what}: {split}")

    def prewarm(node, s: Path, what: str) -> None:
        """The node agent's controller, one pass, in a pod on ``node`` with node store ``s``:
        the store holds the snapshot, that node (and only it, of those not pre-warmed before) is
        labelled with its digest, the WarmSnapshot's status names it."""
        pw = f"prewarm-{uuid.uuid4().hex[:6]}"
        t0 = time.monotonic()
        pwpod = _fleet_pod(pw, engine_image, root, s, node.name, gate_port, ["prewarm", "--once", "--json"], {},
                           namespace="warmctl", api_port=cluster.port, service_account="warmctl-node")
        del pwpod["spec"]["containers"][0]["readinessProbe"]
        _create(node, pwpod)
        pod = node.wait_pod("warmctl", pw, _finished, timeout=600, what="finished")
        figures[what] = time.monotonic() - t0
        logs = cluster.kubectl("logs", "-n", "warmctl", pw).stdout
        assert pod["status"]["phase"] == "Succeeded", f"prewarm pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
        out = _json_tail(logs)
        assert [(o["action"], o.get("digest")) for o in out] == [("cached", digest)], json.dumps(out)
        splits.append(f"{what}: the pull {out[0]['seconds']:.2f} s (its copy {out[0]['copy_seconds']:.2f} s), "
                      f"{out[0]['chunks_copied']} chunks, {out[0]['bytes_copied'] / 2**20:.1f} MiB; "
                      f"{out[0]['files_hashed']} required files hashed in {out[0]['hash_seconds']:.2f} s")
        assert out[0]["files_hashed"] > 0, out
        assert _label(cluster, node.name, key) == want_label
        obj = json.loads(cluster.kubectl("get", "warmsnapshot", ws, "-o", "json", check=True).stdout)
        assert node.name in [n["node"] for n in obj["status"]["nodes"] if n.get("digest") == digest], obj["status"]
        _gone(node, "warmctl", pw)
        os.sync()  # a node is pre-warmed ahead of its pods: what the pull wrote is on disk first

    try:
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(
            {"apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot", "metadata": {"name": ws},
             "spec": {"ref": "tiny:latest", "remote": str(remote)}}))
        # round 1, node 2 (the second kubelet): a cold store (everything from the remote), then a
        # pre-warmed one, whose pod names no node: the scheduler binds it to the labelled node
        restore(node2, store(node2, "cold"), "restore pod, node 2, cold store (1st)", remote_bytes=True)
        warm = store(node2, "warm")
        prewarm(node2, warm, "pre-warm pod, node 2 (prewarm --once: pull + verify + label)")
        assert _label(cluster, node1.name, key) is None, "node 1 labelled by node 2's pre-warm"
        warm_node = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": key, "operator": "In", "values": [want_label]}]}]}}}
        restore(node2, warm, "restore pod, node 2, pre-warmed store, placed by affinity (2nd)", remote_bytes=False,
                affinity=warm_node)
        # round 2, node 1, in the other order
        warm2, cold2, plain = store(node1, "warm2"), store(node1, "cold2"), store(node1, "plain")
        prewarm(node1, warm2, "pre-warm pod, node 1, round 2")
        restore(node1, warm2, "restore pod, node 1, pre-warmed store (1st, round 2)", remote_bytes=False)
        restore(node1, cold2, "restore pod, node 1, cold store (2nd, round 2)", remote_bytes=True)

        # the pre-warm's pull against a plain `warmctl pull` in a pod of the same image (a fresh store)
        pl = f"pull-{uuid.uuid4().hex[:6]}"
        t0 = time.monotonic()
        plpod = _fleet_pod(pl, engine_image, root, plain, node1.name, gate_port, ["pull", "tiny", "--json"],
                           {"WARMCTL_REMOTE_STORE": str(remote)})
        del plpod["spec"]["containers"][0]["readinessProbe"]
        _create(node1, plpod)
        pod = node1.wait_pod("default", pl, _finished, timeout=600, what="finished")
        figures["plain `warmctl pull` pod, node 1 (fresh store)"] = time.monotonic() - t0
        logs = cluster.kubectl("logs", "-n", "default", pl).stdout
        assert pod["status"]["phase"] == "Succeeded", f"pull pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
        [out] = _json_tail(logs)
        assert out["digest"] == digest and out["files_hashed"] > 0, out  # hashed ahead, as the pre-warm does
        splits.append(f"plain pull pod: the pull {out['seconds']:.2f} s, {out['chunks_copied']} chunks, "
                      f"{out['bytes_copied'] / 2**20:.1f} MiB; {out['files_hashed']} required files hashed in "
                      f"{out['hash_seconds']:.2f} s")
        _gone(node1, "default", pl)
        assert _engine_pids() == []
        assert _wait_no_leftovers(node1) == [] and _wait_no_leftovers(node2) == []
    finally:
        cluster.kubectl("delete", "warmsnapshot", "--all", "--ignore-not-found")
        for n in (node1, node2):
            cluster.kubectl("label", "node", n.name, f"{key}-")

    # 5. the host's own up of the same profile's snapshot, twice; the faster is the reference
    ups = _host_up(root / "host", engine_port, gate_port)
    for i, (up_s, _) in enumerate(ups, 1):
        figures[f"warmctl up on the host (own store, {i}{'st' if i == 1 else 'nd'})"] = up_s
    host_s = min(s for s, _ in ups)
    width = max(map(len, figures))
    print("\npod-ready-seconds, one run (created -> Ready for pods; finished for the others):")
    for k, v in figures.items():
        print(f"  {k:<{width}}  {v:6.1f} s")
    for k, v in figures.items():
        if k.startswith("restore pod"):
            print(f"  {k} / host up (the faster): {v / host_s:.2f}x")
    print("  " + "\n  ".join(splits) + "".join(f"\n  host up {i}'s timings: {t}" for i, (_, t) in enumerate(ups, 1)))
