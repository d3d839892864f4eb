"""The shipped workloads of deploy/kubernetes run as Kubernetes runs them, on two real nodes:
kube-controller-manager (Job, DaemonSet, Deployment controllers) and kube-scheduler beside the two
kubelets of tests/kubenode.py (node ``127.0.0.1`` and node ``127.0.0.2``), the objects from
``kubectl kustomize deploy/kubernetes``. Opt-in like every pod test (``bash scripts/test.sh
--kubernetes``, or ``WARMCTL_TEST_KUBERNETES=1``).

What the test changes in the rendered objects is what two nodes on one host's loopback need, no
more (an overlay a platform team would write): the image (the project's image from
deploy/image/build.sh in the loopback registry), ``hostNetwork`` with the test's ports on
127.0.0.1 (no pod network, no kube-proxy: ``KUBERNETES_SERVICE_HOST`` is the apiserver on
loopback), the node store (one hostPath directory holding a store per node, mounted with
``subPathExpr: $(WARMCTL_NODE_NAME)``: both nodes are directories of one host), the node agent's
address (the node's own, ``status.hostIP``: both agents share the host's network), a hostPath for
the profile file, the S3 endpoint (``WARMCTL_S3_ENDPOINT``: a moto S3 server on 127.0.0.1), the
ConfigMap's ``remote_store`` (a fresh bucket) and ``image_digest``, and the engine Deployment's
strategy: ``Recreate`` (the shipped ``RollingUpdate`` starts the new pod while the old one
drains; two engines of one snapshot on one host's loopback would both need its ports). The
Secrets are made from files as docs/kubernetes.md says: the signing key, the trusted public key,
and the remote's credentials (an AWS shared-credentials file, ``warmctl-remote-credentials``: the
pods' only S3 credentials).

1. Node 2 cordoned (``kubectl cordon``), so what the scheduler places lands on node 1. The
   snapshot Job (snapshot-job.yaml): the job controller makes its pod, the scheduler binds it
   to node 1; ``warmctl snapshot tiny --push`` cold-starts, dumps, signs with the key from the
   ``warmctl-signing-key`` Secret and pushes to the S3 remote; the Job completes.
2. The engine Deployment (engine-deployment.yaml) scaled to 1: its pod on node 1 restores from
   a cold node store (every chunk from the remote), Ready, "Paris.".
3. A ``WarmSnapshot`` named ``tiny`` (the name the Deployment's preferred node affinity looks
   for) selecting node 2 alone, and the node DaemonSet (agent-daemonset.yaml: ``warmctl agent
   --prewarm``): a pod per node, both Ready (the agent's ``/readyz``; node 2's despite the
   cordon, as DaemonSets run); node 2's pulls the snapshot from S3 into node 2's store and
   labels node 2 with its digest; node 1 is not labelled; the object's status names node 2
   alone.
4. Node 2 uncordoned and the Deployment rolled out (``kubectl rollout restart``): the old pod
   on node 1 drains and goes, the scheduler binds the new pod to the warm node 2 (the shipped
   preferred affinity), which restores reading 0 bytes from the remote, Ready, "Paris.".
   Scaled to 0: the engine gone. Everything deleted: nothing left on either node.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kubenode import NODE2_NAME, OPT_IN
from test_kube_pods import _chat, _engine_pids, _restored, _served, _share, _wait_no_leftovers

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "kubernetes"
NS = "warmctl"

pytestmark = OPT_IN


def _rendered(cluster) -> list[dict]:
    """``kubectl kustomize deploy/kubernetes``: every object, parsed."""
    import yaml

    out = cluster.kubectl("kustomize", str(DEPLOY), check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _on_loopback(spec: dict, image: str, share: Path, stores: Path | None, api_port: int, env: dict[str, str]) -> None:
    """Patch a pod template's ``spec`` for the nodes on this host's loopback: the image,
    hostNetwork, the apiserver on loopback, ``env`` added (overriding same-named entries), the
    test directory ``share`` mounted at its own path; with ``stores``, the node store is the
    directory of ``stores`` named after the pod's node (``subPathExpr: $(WARMCTL_NODE_NAME)``)."""
    spec["hostNetwork"] = True
    c = spec["containers"][0]
    c["image"] = image
    add = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api_port),
           "WARMCTL_CONFIG": str(share / "config.toml"), "PYTHONUNBUFFERED": "1", **env}
    c["env"] = [e for e in c.get("env", []) if e["name"] not in add] + [{"name": k, "value": v} for k, v in add.items()]
    c.setdefault("volumeMounts", []).append({"name": "test-share", "mountPath": str(share)})
    spec.setdefault("volumes", []).append({"name": "test-share", "hostPath": {"path": str(share), "type": "Directory"}})
    if stores is not None:
        assert any(e["name"] == "WARMCTL_NODE_NAME" for e in c["env"]), c["env"]
        for v in spec["volumes"]:
            if v["name"] == "store":
                v["hostPath"] = {"path": str(stores), "type": "Directory"}
        for m in c["volumeMounts"]:
            if m["name"] == "store":
                m["subPathExpr"] = "$(WARMCTL_NODE_NAME)"


def _wait(what: str, fn, timeout: float, tails=lambda: "") -> object:
    """Poll ``fn()`` every 0.5 s until it returns something true; that value. AssertionError
    naming ``what`` (and ``tails()``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s{tails()}"
        time.sleep(0.5)


def _pods(cluster, selector: str) -> list[dict]:
    st, body = cluster.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}")
    assert st == 200, body
    return body["items"]


def _vllm_pids() -> list[int]:
    """The engine's processes still in a pod's cgroup (vLLM's, not warmctl's own)."""
    out = []
    for pid in _engine_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/comm").read_bytes()
        except OSError:
            continue
        if b"vllm" in cmd.lower():
            out.append(pid)
    return out


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def _node_of(pid: int) -> str:
    """The node whose pod cgroup holds process ``pid`` (node 2's cgroup root is
    ``/warmctl-node-127.0.0.2``, node 1's the host's ``/kubepods``): its name, or "" when gone."""
    try:
        cg = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    return NODE2_NAME if f"warmctl-node-{NODE2_NAME}/" in cg else "127.0.0.1"


@pytest.mark.e2e
def test_shipped_workloads_on_two_nodes_prewarm_one_and_an_update_moves_the_engine_onto_it(
        kube_node, kube_node2, engine_image, engine_ports, moto_endpoint, tmp_path):
    cluster = kube_node.cluster
    cluster.start_scheduler()
    node1, node2 = kube_node.name, kube_node2.name
    engine_port, gate_port, agent_port = engine_ports[0] + 16, engine_ports[1] + 16, engine_ports[0] + 18
    ready_port = engine_ports[1] + 18  # the supervisor's readiness endpoint (--ready-port)
    name = f"wl-{uuid.uuid4().hex[:6]}"
    share = _share(kube_node, name, engine_port, gate_port)  # config.toml and profiles/tiny.toml
    # the home comes from WARMCTL_HOME (the manifests' /var/lib/warmctl): the config file names
    # only the profiles
    (share / "config.toml").write_text(f'profile_dirs = ["{share / "profiles"}"]\n')
    # the Job's work directory, and a store per node (outside both nodes' own directories, as the
    # pods of both nodes mount them): what /var/lib/warmctl is on each of two machines
    job_home, stores = tmp_path / "job", tmp_path / "nodes"
    for d in (job_home, stores / node1, stores / node2):
        d.mkdir(parents=True)
    import boto3

    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = f"warmctl-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    (share / "aws-credentials").write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    s3env = {"WARMCTL_S3_ENDPOINT": moto_endpoint}
    r = subprocess.run([sys.executable, "-m", "warmctl", "keygen", str(share / "signing")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    def tails() -> str:
        return kube_node.tails() + kube_node2.tails()

    objs = _rendered(cluster)
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    cm = by_kind[("ConfigMap", "warmctl-config")]
    cm["data"].update(remote_store=f"s3://{bucket}/snaps", image_digest=engine_image[1])
    job = by_kind[("Job", "warmctl-snapshot-tiny")]
    _on_loopback(job["spec"]["template"]["spec"], engine_image[0], share, None, cluster.port, s3env)
    # the Job's work directory: a hostPath here, so that the model files the snapshot maps can be
    # put at the same path in the node stores (what the image or a model volume gives a real node)
    for v in job["spec"]["template"]["spec"]["volumes"]:
        if v["name"] == "work":
            v.clear()
            v.update(name="work", hostPath={"path": str(job_home), "type": "Directory"})
    ds = by_kind[("DaemonSet", "warmctl-agent")]
    spec = ds["spec"]["template"]["spec"]
    # each node's agent on the node's own address (both nodes share the host's network)
    _on_loopback(spec, engine_image[0], share, stores, cluster.port, {"WARMCTL_AGENT_PORT": str(agent_port), **s3env})
    c = spec["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "WARMCTL_AGENT_HOST"] + [
        {"name": "WARMCTL_AGENT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]
    probe = c["readinessProbe"]
    assert "'http://127.0.0.1:7420/readyz'" in probe["exec"]["command"][-1], probe
    probe["exec"]["command"][-1] = "import os; " + probe["exec"]["command"][-1].replace(
        "'http://127.0.0.1:7420/readyz'", f"'http://%s:{agent_port}/readyz' % os.environ['WARMCTL_AGENT_HOST']")
    probe["periodSeconds"] = 2
    dep = by_kind[("Deployment", "warmctl-engine-tiny")]
    spec = dep["spec"]["template"]["spec"]
    _on_loopback(spec, engine_image[0], share, stores, cluster.port, s3env)
    c = spec["containers"][0]
    assert c["args"][-2:] == ["--ready-port", "8001"], c["args"]
    c["args"] = ["warmctl", "up", "tiny", "--foreground", "--host", "127.0.0.1", "--port", str(gate_port),
                 "--ready-port", str(ready_port)]
    c["ports"] = [{"name": "http", "containerPort": gate_port}, {"name": "ready", "containerPort": ready_port}]
    c["readinessProbe"]["httpGet"]["host"] = "127.0.0.1"  # the supervisor's address on either node
    # the shipped preferred affinity stays as it is: nodes labelled for the WarmSnapshot `tiny`
    assert spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"][
        "matchExpressions"] == [{"key": "snapshot.warmctl.io/tiny", "operator": "Exists"}], spec["affinity"]
    dep["spec"]["strategy"] = {"type": "Recreate"}  # one host's loopback: see the module's docstring
    dep["spec"]["replicas"] = 0  # scaled up once the snapshot is pushed

    ws = "tiny"  # the WarmSnapshot (cluster-scoped): the name the Deployment's affinity looks for
    label = f"snapshot.warmctl.io/{ws}"
    figures: dict[str, float] = {}
    try:
        first = [o for o in objs if o["kind"] in ("Namespace", "CustomResourceDefinition", "ServiceAccount",
                                                  "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ConfigMap")]
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps({"apiVersion": "v1", "kind": "List", "items": first}))
        cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/warmsnapshots.warmctl.io", check=True)
        cluster.kubectl("-n", NS, "create", "secret", "generic", "warmctl-signing-key",
                        f"--from-file=signing.key={share / 'signing' / 'warmctl.key'}", check=True)
        cluster.kubectl("-n", NS, "create", "secret", "generic", "warmctl-trust-keys",
                        f"--from-file=warmctl.pub={share / 'signing' / 'warmctl.pub'}", check=True)
        cluster.kubectl("-n", NS, "create", "secret", "generic", "warmctl-remote-credentials",
                        f"--from-file=aws-credentials={share / 'aws-credentials'}", check=True)
        for account in ("warmctl-engine", "warmctl-node", "warmctl-snapshot"):
            _wait(f"the {account} service account's token", lambda a=account: cluster.request(
                "GET", f"/api/v1/namespaces/{NS}/serviceaccounts/{a}")[1].get("secrets"), 60)
        cluster.kubectl("cordon", node2, check=True)

        # 1. the snapshot Job: the job controller's pod, bound by the scheduler to node 1, runs to completion
        t0 = time.monotonic()
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(job))

        def job_done() -> dict | None:
            st, j = cluster.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs/warmctl-snapshot-tiny")
            assert st == 200, j
            s = j.get("status", {})
            assert not s.get("failed"), f"snapshot Job failed: {json.dumps(s)}\n" + cluster.kubectl(
                "-n", NS, "logs", "-l", "app.kubernetes.io/name=warmctl-snapshot", "--tail=60").stdout
            return j if s.get("succeeded") else None
        _wait("the snapshot Job's completion", job_done, 1800, tails)
        figures["snapshot Job created -> complete (node 1)"] = time.monotonic() - t0
        [jpod] = _pods(cluster, "app.kubernetes.io/name%3Dwarmctl-snapshot")
        assert jpod["spec"]["nodeName"] == node1 and jpod["metadata"]["ownerReferences"][0]["kind"] == "Job"
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="snaps/catalog/tiny/latest/").get("Contents", [])]
        entries = [json.loads(s3.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in keys if k.endswith(".json")]
        assert [e["host"].get("image_digest") for e in entries] == [engine_image[1]], entries
        digest = entries[0]["manifest"]
        want_label = "sha256-" + digest[7:47]
        # the model files the snapshot's engine maps, at the same path in each node store
        for n in (node1, node2):
            shutil.copytree(job_home / "models", stores / n / "models")

        # 2. the engine Deployment, scaled to 1: on node 1 (node 2 cordoned), a cold node store
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": [o for o in objs if o["kind"] == "Service"] + [dep]}))
        t0 = time.monotonic()
        cluster.kubectl("-n", NS, "scale", "deployment/warmctl-engine-tiny", "--replicas=1", check=True)

        def available() -> dict | None:
            st, d = cluster.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/warmctl-engine-tiny")
            s = d.get("status", {})
            done = (s.get("availableReplicas") == 1 and s.get("updatedReplicas") == 1 and s.get("replicas") == 1
                    and s.get("observedGeneration") == d["metadata"]["generation"])
            return d if done else None
        _wait("the engine Deployment available", available, 600, tails)
        figures["Deployment scaled to 1 -> available (node 1, cold store)"] = time.monotonic() - t0
        [old] = _wait("the engine pod's last Serving", lambda: [p for p in _pods(
            cluster, "app.kubernetes.io/name%3Dwarmctl-engine") if _served(p)], 30, tails)
        assert _ready(old) and old["spec"]["nodeName"] == node1, old["spec"]
        cond = _restored(old)
        assert cond.get("reason") == "Serving" and digest in cond["message"], cond
        assert "from the remote store" in cond["message"] and "read 0.0 MiB from" not in cond["message"], cond
        assert _chat(gate_port).strip() == "Paris."
        old_engine = _vllm_pids()
        assert old_engine and {_node_of(p) for p in old_engine} == {node1}, old_engine

        # 3. a WarmSnapshot for node 2 alone and the node DaemonSet: a pod per node, node 2 pre-warmed
        hostname2 = cluster.request("GET", f"/api/v1/nodes/{node2}")[1]["metadata"]["labels"]["kubernetes.io/hostname"]
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(
            {"apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot", "metadata": {"name": ws},
             "spec": {"ref": "tiny:latest", "remote": f"s3://{bucket}/snaps",
                      "nodeSelector": {"kubernetes.io/hostname": hostname2}}}))
        t0 = time.monotonic()
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(ds))

        def labels(node: str) -> dict:
            return cluster.request("GET", f"/api/v1/nodes/{node}")[1]["metadata"].get("labels", {})
        _wait("node 2's pre-warm label", lambda: labels(node2).get(label) == want_label, 600, tails)
        figures["DaemonSet created -> node 2 labelled (image pull on node 2 included)"] = time.monotonic() - t0

        def ds_ready() -> bool:
            st, d = cluster.request("GET", f"/apis/apps/v1/namespaces/{NS}/daemonsets/warmctl-agent")
            s = d.get("status", {})
            return s.get("desiredNumberScheduled") == 2 and s.get("numberReady") == 2
        _wait("the DaemonSet's two pods Ready", ds_ready, 300, tails)
        agents = _pods(cluster, "app.kubernetes.io/name%3Dwarmctl-agent")
        assert sorted(p["spec"]["nodeName"] for p in agents) == sorted([node1, node2]), [p["spec"] for p in agents]
        st, obj = cluster.request("GET", f"/apis/warmctl.io/v1alpha1/warmsnapshots/{ws}")
        assert [(n["node"], n.get("digest")) for n in obj["status"]["nodes"]] == [(node2, digest)], obj
        assert label not in labels(node1), labels(node1)

        # 4. node 2 back in service; the Deployment rolled out: its new pod goes to the warm node 2
        cluster.kubectl("uncordon", node2, check=True)
        t0 = time.monotonic()
        cluster.kubectl("-n", NS, "rollout", "restart", "deployment/warmctl-engine-tiny", check=True)
        cluster.kubectl("-n", NS, "rollout", "status", "deployment/warmctl-engine-tiny", "--timeout=600s",
                        check=True, timeout=630)
        _wait("the rolled-out Deployment available", available, 60, tails)
        figures["rollout restart -> available (node 1's pod drained, node 2's restored)"] = time.monotonic() - t0
        [new] = _wait("the new engine pod's last Serving", lambda: [p for p in _pods(
            cluster, "app.kubernetes.io/name%3Dwarmctl-engine") if _served(p)], 30, tails)
        assert new["metadata"]["name"] != old["metadata"]["name"]
        assert _ready(new) and new["spec"]["nodeName"] == node2, new["spec"]
        assert new["status"]["containerStatuses"][0]["restartCount"] == 0, new["status"]
        cond = _restored(new)
        assert cond.get("reason") == "Serving" and digest in cond["message"], cond
        assert "read 0.0 MiB from the remote store" in cond["message"], cond  # all from node 2's store
        assert _chat(gate_port).strip() == "Paris."
        engine = _vllm_pids()
        assert engine and {_node_of(p) for p in engine} == {node2} and not set(engine) & set(old_engine), engine

        cluster.kubectl("-n", NS, "scale", "deployment/warmctl-engine-tiny", "--replicas=0", check=True)
        _wait("the engine pod gone", lambda: not _pods(cluster, "app.kubernetes.io/name%3Dwarmctl-engine"), 120, tails)
        assert _vllm_pids() == []  # the engine is gone (the DaemonSet's agents still run)
        print("\nshipped workloads on two nodes, one run:")
        for k, v in figures.items():
            print(f"  {k}: {v:.1f} s")
    finally:
        cluster.kubectl("uncordon", node2)
        for kind in ("deployment/warmctl-engine-tiny", "service/warmctl-engine-tiny", "daemonset/warmctl-agent",
                     "job/warmctl-snapshot-tiny"):
            cluster.kubectl("-n", NS, "delete", kind, "--ignore-not-found", "--cascade=foreground", "--wait=true",
                            timeout=180)
        cluster.kubectl("delete", "warmsnapshot", ws, "--ignore-not-found")
        for n in (node1, node2):
            cluster.kubectl("label", "node", n, f"{label}-")
        cluster.kubectl("-n", NS, "delete", "secret", "warmctl-signing-key", "warmctl-trust-keys",
                        "warmctl-remote-credentials", "--ignore-not-found")
    _wait("no pod of the workloads left", lambda: not _pods(cluster, "app.kubernetes.io/part-of%3Dwarmctl"), 120, tails)
    assert _engine_pids() == []
    assert _wait_no_leftovers(kube_node) == [] and _wait_no_leftovers(kube_node2) == []
