"""A snapshot made in a pod, pushed to a remote, then restored by pods on a cold and on a
pre-warmed node store, on the real kubelet of tests/kubenode.py, with the figures side by side
(``-s`` prints them; docs/benchmarks.md, "Engine pods: warm node, cold node, host").

One kubelet runs here (named ``127.0.0.1``): a second kubelet on the same host would need its
own name, address, ports and containerd. The "second node" is therefore a second **node store**:
a pod on the same kubelet whose ``WARMCTL_HOME`` is a fresh, empty directory, exactly what a
node that never saw the snapshot has. The remote is a directory on a hostPath every pod mounts
(what a shared volume or an S3 bucket is to a fleet).

- ``warmctl snapshot tiny --push`` in a pod (the snapshot Job's command,
  deploy/kubernetes/snapshot-job.yaml), signed with a key mounted as a file, pushed to the
  remote; its image digest recorded.
- The cold node store: ``up tiny --foreground --cold-start never`` in a pod as the
  ``warmctl-engine`` service account, nothing in its store: Ready, "Paris.", its
  ``warmctl.io/Restored`` condition's final message says how much it read from the remote (> 0).
- The pre-warmed node store: ``warmctl prewarm --once --json`` in a pod of the same image as
  the ``warmctl-node`` service account (the DaemonSet's controller, one pass) for a
  ``WarmSnapshot`` naming ``tiny`` on the remote: the node store holds it, the Node is labelled
  with its digest; then the engine pod on that store restores with the remote still configured
  and reads 0 bytes from it (the condition's final message), Ready, "Paris.".
- A second round on two more fresh node stores in the other order (pre-warm, the pre-warmed
  store's pod, then the cold store's pod): on this host a restore that follows another one has
  been the slower one whichever store it read (docs/benchmarks.md), so each kind of store is
  timed both first and second.
- The host's own ``warmctl up`` of the same profile's snapshot (made on the host: a snapshot
  made in the image restores only in a pod of that image), for the ratio.
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
    _share,
    _terminated,
    _wait_no_leftovers,
    engine_image,  # noqa: F401 - the fixture
)

REPO = Path(__file__).resolve().parent.parent

pytestmark = OPT_IN


def _fleet_pod(name: str, image: tuple[str, str], root: Path, store: Path, gate_port: int, args: list[str],
               env: dict[str, str], namespace: str = "default", api_port: int = 0,
               service_account: str = "warmctl-engine") -> dict:
    """:func:`test_kube_pods._engine_pod` with the whole fleet directory ``root`` mounted (the
    remote and every node store under it), the node store ``store`` (its config.toml) chosen,
    ``env`` added, and ``service_account`` when ``api_port`` is given."""
    pod = _engine_pod(name, image, root, gate_port, args, namespace=namespace, api_port=api_port)
    spec = pod["spec"]
    if api_port:
        spec["serviceAccountName"] = service_account
    c = spec["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "WARMCTL_CONFIG"]
    c["env"] += [{"name": "WARMCTL_CONFIG", "value": str(store / "config.toml")},
                 *({"name": k, "value": v} for k, v in env.items())]
    return pod


def _wait_token(cluster, account: str) -> None:
    deadline = time.monotonic() + 60
    while not cluster.request("GET", f"/api/v1/namespaces/warmctl/serviceaccounts/{account}")[1].get("secrets"):
        assert time.monotonic() < deadline, f"the {account} service account got no token within 60 s"
        time.sleep(0.2)


def _restore_pod(node, name: str, image, root: Path, store: Path, gate_port: int, remote: Path) -> tuple[float, dict, str]:
    """An engine pod restoring ``tiny`` from node store ``store`` (the remote configured, no
    cold start) as the ``warmctl-engine`` service account: (created -> Ready seconds, its final
    ``warmctl.io/Restored`` condition, ``up``'s phase lines). Leaves the pod serving."""
    cluster = node.cluster
    t0, wall0 = time.monotonic(), time.time()
    _create(node, _fleet_pod(name, image, root, store, gate_port,
                             ["up", "tiny", "--foreground", "--cold-start", "never"],
                             {"WARMCTL_REMOTE_STORE": str(remote)}, namespace="warmctl", api_port=cluster.port))
    pod = node.wait_pod("warmctl", name, lambda p: _ready(p) is True or _finished(p), timeout=900, what="Ready")
    ready_s = time.monotonic() - t0
    logs = cluster.kubectl("logs", "-n", "warmctl", name).stdout
    assert _ready(pod), f"restore pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
    pod = node.wait_pod("warmctl", name, lambda p: _restored(p).get("reason") == "Serving", timeout=30,
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
    return ready_s, _restored(pod), split


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


def _host_up(root: Path, engine_port: int, gate_port: int) -> tuple[float, str]:
    """``warmctl snapshot tiny`` then ``warmctl up tiny --json`` on the host (its own home under
    ``root``): (seconds of the up, its timings). Stops the engine after."""
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
    try:
        run("snapshot", "tiny")
        subprocess.run([sys.executable, "-m", "warmctl", "down", "tiny"], env=env, cwd=REPO, capture_output=True,
                       timeout=300)
        t0 = time.monotonic()
        res = json.loads(run("up", "tiny", "--json", "--cold-start", "never").stdout)
        up_s = time.monotonic() - t0
        assert res["path"] == "restore", res
        t = res.get("timings", {})
        return up_s, ", ".join(f"{k} {v:.2f}" for k, v in t.items() if isinstance(v, (int, float)))
    finally:
        subprocess.run([sys.executable, "-m", "warmctl", "down", "tiny"], env=env, cwd=REPO, capture_output=True,
                       timeout=300)


@pytest.mark.e2e
def test_snapshot_pushed_from_a_pod_restored_on_a_cold_and_on_a_prewarmed_node_store(kube_node, engine_image,
                                                                                    engine_ports):
    engine_port, gate_port = engine_ports[0] + 14, engine_ports[1] + 14
    cluster = kube_node.cluster
    fleet = f"fleet-{uuid.uuid4().hex[:6]}"
    root = kube_node.workdir / "share" / fleet
    pub, cold, warm = (_share(kube_node, f"{fleet}/{n}", engine_port, gate_port) for n in ("pub", "cold", "warm"))
    remote = root / "remote"
    remote.mkdir()
    # the publisher's signing key (a Secret mounted as a file, in a cluster); every node trusts its .pub
    r = subprocess.run([sys.executable, "-m", "warmctl", "keygen", str(root / "signing")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for store in (pub, cold, warm):
        (store / "keys").mkdir()
        shutil.copy(root / "signing" / "warmctl.pub", store / "keys" / "warmctl.pub")
    for f in ("namespace.yaml", "serviceaccounts.yaml", "rbac.yaml", "crd-warmsnapshot.yaml"):
        cluster.kubectl("apply", "-f", str(REPO / "deploy" / "kubernetes" / f), check=True)
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/warmsnapshots.warmctl.io",
                    check=True)
    for account in ("warmctl-engine", "warmctl-node"):
        _wait_token(cluster, account)
    figures: dict[str, float] = {}

    # 1. the snapshot Job's command in a pod: snapshot, sign, push to the remote
    snap = f"snapjob-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    _create(kube_node, _fleet_pod(snap, engine_image, root, pub, gate_port, ["snapshot", "tiny", "--push"],
                                  {"WARMCTL_REMOTE_STORE": str(remote),
                                   "WARMCTL_SIGNING_KEY": str(root / "signing" / "warmctl.key")}))
    pod = kube_node.wait_pod("default", snap, _finished, timeout=1500, what="finished")
    figures["snapshot pod (cold start + dump + push)"] = time.monotonic() - t0
    logs = cluster.kubectl("logs", "-n", "default", snap).stdout
    assert pod["status"]["phase"] == "Succeeded", f"snapshot pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
    _gone(kube_node, "default", snap)
    entries = [json.loads(p.read_text()) for p in (remote / "catalog" / "tiny" / "latest").glob("*.json")]
    assert [e["host"].get("image_digest") for e in entries] == [engine_image[1]], entries
    digest = entries[0]["manifest"]

    ws = f"tiny-{uuid.uuid4().hex[:6]}"  # the WarmSnapshot (its name: the node label's key)
    cold2, warm2, plain = (_share(kube_node, f"{fleet}/{n}", engine_port, gate_port) for n in ("cold2", "warm2", "plain"))
    for store in (cold2, warm2, plain):
        (store / "keys").mkdir()
        shutil.copy(root / "signing" / "warmctl.pub", store / "keys" / "warmctl.pub")
    splits: list[str] = []

    def restore(store: Path, what: str, remote_bytes: bool) -> None:
        """One engine pod restoring on ``store``: Ready, its condition naming the digest and
        what it read from the remote (> 0 for a cold store, 0 for a pre-warmed one), "Paris.";
        deleted; its figures kept under ``what``."""
        up = f"up-{uuid.uuid4().hex[:6]}"
        ready_s, cond, split = _restore_pod(kube_node, up, engine_image, root, store, gate_port, remote)
        assert cond["status"] == "True" and digest in cond["message"], cond
        if remote_bytes:
            assert "read 0.0 MiB from the remote store" not in cond["message"] and "from the remote store" in cond["message"], cond
        else:
            assert "read 0.0 MiB from the remote store" in cond["message"], cond
        assert _chat(gate_port).strip() == "Paris."
        _gone(kube_node, "warmctl", up)
        figures[what] = ready_s
        splits.append(f"{what}: {split}")

    def prewarm(store: Path, what: str) -> None:
        """The node agent's controller, one pass, in a pod on ``store``: the store holds the
        snapshot, the Node is labelled with its digest."""
        pw = f"prewarm-{uuid.uuid4().hex[:6]}"
        t0 = time.monotonic()
        pwpod = _fleet_pod(pw, engine_image, root, store, gate_port, ["prewarm", "--once", "--json"], {},
                           namespace="warmctl", api_port=cluster.port, service_account="warmctl-node")
        del pwpod["spec"]["containers"][0]["readinessProbe"]
        _create(kube_node, pwpod)
        pod = kube_node.wait_pod("warmctl", pw, _finished, timeout=600, what="finished")
        figures[what] = time.monotonic() - t0
        logs = cluster.kubectl("logs", "-n", "warmctl", pw).stdout
        assert pod["status"]["phase"] == "Succeeded", f"prewarm pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
        out = _json_tail(logs)
        assert [(o["action"], o.get("digest")) for o in out] == [("cached", digest)], json.dumps(out)
        splits.append(f"{what}: the pull {out[0]['seconds']:.2f} s (its copy {out[0]['copy_seconds']:.2f} s), "
                      f"{out[0]['chunks_copied']} chunks, {out[0]['bytes_copied'] / 2**20:.1f} MiB")
        labels = json.loads(cluster.kubectl("get", "node", kube_node.name, "-o", "json", check=True).stdout)
        assert labels["metadata"]["labels"].get(f"snapshot.warmctl.io/{ws}") == "sha256-" + digest[7:47], labels
        _gone(kube_node, "warmctl", pw)
        os.sync()  # a node is pre-warmed ahead of its pods: what the pull wrote is on disk first

    try:
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(
            {"apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot", "metadata": {"name": ws},
             "spec": {"ref": "tiny:latest", "remote": str(remote)}}))
        # round 1: a cold node store (everything from the remote), then a pre-warmed one (the
        # remote still configured: nothing read from it); round 2 on fresh stores in the other
        # order, so that neither kind of store is always the one restored second
        restore(cold, "restore pod, cold node store (1st)", remote_bytes=True)
        prewarm(warm, "pre-warm pod (prewarm --once: pull + verify + label)")
        restore(warm, "restore pod, pre-warmed node store (2nd)", remote_bytes=False)
        prewarm(warm2, "pre-warm pod, round 2")
        restore(warm2, "restore pod, pre-warmed node store (1st, round 2)", remote_bytes=False)
        restore(cold2, "restore pod, cold node store (2nd, round 2)", remote_bytes=True)

        # the pre-warm's pull against a plain `warmctl pull` in a pod of the same image (a fresh store)
        pl = f"pull-{uuid.uuid4().hex[:6]}"
        t0 = time.monotonic()
        plpod = _fleet_pod(pl, engine_image, root, plain, gate_port, ["pull", "tiny", "--json"],
                           {"WARMCTL_REMOTE_STORE": str(remote)})
        del plpod["spec"]["containers"][0]["readinessProbe"]
        _create(kube_node, plpod)
        pod = kube_node.wait_pod("default", pl, _finished, timeout=600, what="finished")
        figures["plain `warmctl pull` pod (fresh store)"] = time.monotonic() - t0
        logs = cluster.kubectl("logs", "-n", "default", pl).stdout
        assert pod["status"]["phase"] == "Succeeded", f"pull pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
        [out] = _json_tail(logs)
        assert out["digest"] == digest, out
        splits.append(f"plain pull pod: the pull {out['seconds']:.2f} s, {out['chunks_copied']} chunks, "
                      f"{out['bytes_copied'] / 2**20:.1f} MiB")
        _gone(kube_node, "default", pl)
        assert _engine_pids() == []
        assert _wait_no_leftovers(kube_node) == []
    finally:
        cluster.kubectl("delete", "warmsnapshot", "--all", "--ignore-not-found")
        cluster.kubectl("label", "node", kube_node.name, f"snapshot.warmctl.io/{ws}-")

    # 5. the host's own up of the same profile's snapshot
    host_s, host_t = _host_up(root / "host", engine_port, gate_port)
    figures["warmctl up on the host (own store)"] = host_s
    width = max(map(len, figures))
    print("\npod-ready-seconds, one run (created -> Ready for pods):")
    for k, v in figures.items():
        print(f"  {k:<{width}}  {v:6.1f} s")
    for k, v in figures.items():
        if k.startswith("restore pod"):
            print(f"  {k} / host up: {v / host_s:.2f}x")
    print("  " + "\n  ".join(splits) + f"\n  host up's timings: {host_t}")
