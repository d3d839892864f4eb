"""The shipped workloads of deploy/kubernetes run as Kubernetes runs them: kube-controller-manager
(Job, DaemonSet, Deployment controllers) and kube-scheduler beside the real kubelet of
tests/kubenode.py, the objects from ``kubectl kustomize deploy/kubernetes``. Opt-in like every pod
test (``bash scripts/test.sh --kubernetes``, or ``WARMCTL_TEST_KUBERNETES=1``).

What the test changes in the rendered objects is what this one-node loopback cluster needs, no
more (an overlay a platform team would write): the image (the project's image from
deploy/image/build.sh in the loopback registry), ``hostNetwork`` with the test's ports on
127.0.0.1 (the node has no pod network and no kube-proxy: ``KUBERNETES_SERVICE_HOST`` is the
apiserver on loopback), the node store's hostPath (a directory of the test), a hostPath for the
profile file, the S3 endpoint (``WARMCTL_S3_ENDPOINT``: a moto S3 server on 127.0.0.1, which
the pods reach on the host's loopback), and the ConfigMap's ``remote_store`` (a fresh bucket)
and ``image_digest``. The Secrets are made from files as docs/kubernetes.md says: the signing
key, the trusted public key, and the remote's credentials (an AWS shared-credentials file,
``warmctl-remote-credentials``: the pods' only S3 credentials).

1. The snapshot Job (snapshot-job.yaml): the job controller makes its pod, the scheduler binds
   it; ``warmctl snapshot tiny --push`` cold-starts, dumps, signs with the key from the
   ``warmctl-signing-key`` Secret and pushes to the S3 remote; the Job completes.
2. A ``WarmSnapshot`` naming ``tiny`` on the bucket and the node DaemonSet (agent-daemonset.yaml: ``warmctl
   agent --prewarm``): its pod is Ready (the agent's ``/readyz``), pulls the snapshot from S3
   into the node store and labels the Node with its digest; the object's status names the node.
3. The engine Deployment (engine-deployment.yaml): its pod restores on the pre-warmed node store
   (0 bytes from the remote), Ready, "Paris.", the Deployment available; scaled to 0: drained,
   the engine gone. Everything deleted: nothing left on the node.
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
from kubenode import OPT_IN
from test_kube_pods import _chat, _engine_pids, _restored, _share, _wait_no_leftovers, engine_image  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "kubernetes"
NS = "warmctl"

pytestmark = OPT_IN


def _rendered(cluster) -> list[dict]:
    """``kubectl kustomize deploy/kubernetes``: every object, parsed."""
    import yaml

    out = cluster.kubectl("kustomize", str(DEPLOY), check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _on_loopback(spec: dict, image: str, share: Path, store: Path, api_port: int, env: dict[str, str]) -> None:
    """Patch a pod template's ``spec`` for this node: the image, hostNetwork, the apiserver on
    loopback, ``env`` added (overriding same-named entries), the test directory ``share``
    mounted at its own path, the node store's hostPath at ``store``."""
    spec["hostNetwork"] = True
    c = spec["containers"][0]
    c["image"] = image
    add = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api_port),
           "WARMCTL_CONFIG": str(share / "config.toml"), "PYTHONUNBUFFERED": "1", **env}
    c["env"] = [e for e in c.get("env", []) if e["name"] not in add] + [{"name": k, "value": v} for k, v in add.items()]
    c.setdefault("volumeMounts", []).append({"name": "test-share", "mountPath": str(share)})
    spec.setdefault("volumes", []).append({"name": "test-share", "hostPath": {"path": str(share), "type": "Directory"}})
    for v in spec["volumes"]:
        if v["name"] == "store":
            v["hostPath"]["path"] = str(store)


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


@pytest.mark.e2e
def test_shipped_job_daemonset_and_deployment_run_by_the_controllers(kube_node, engine_image, engine_ports,
                                                                      moto_endpoint):
    cluster = kube_node.cluster
    cluster.start_scheduler()
    engine_port, gate_port, agent_port = engine_ports[0] + 16, engine_ports[1] + 16, engine_ports[0] + 18
    name = f"wl-{uuid.uuid4().hex[:6]}"
    share = _share(kube_node, name, engine_port, gate_port)  # config.toml and profiles/tiny.toml
    # the home comes from WARMCTL_HOME (the manifests' /var/lib/warmctl): the config file names
    # only the profiles
    (share / "config.toml").write_text(f'profile_dirs = ["{share / "profiles"}"]\n')
    job_home, node_store = share / "job", share / "node"
    for d in (job_home, node_store):
        d.mkdir()
    import boto3

    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = f"warmctl-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    (share / "aws-credentials").write_text("[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    s3env = {"WARMCTL_S3_ENDPOINT": moto_endpoint}
    r = subprocess.run([sys.executable, "-m", "warmctl", "keygen", str(share / "signing")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tails = kube_node.tails

    objs = _rendered(cluster)
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    cm = by_kind[("ConfigMap", "warmctl-config")]
    cm["data"].update(remote_store=f"s3://{bucket}/snaps", image_digest=engine_image[1])
    job = by_kind[("Job", "warmctl-snapshot-tiny")]
    _on_loopback(job["spec"]["template"]["spec"], engine_image[0], share, node_store, cluster.port, s3env)
    # the Job's work directory: a hostPath here, so that the model files the snapshot maps can be
    # put at the same path on the node (what the image or a model volume gives a real node)
    for v in job["spec"]["template"]["spec"]["volumes"]:
        if v["name"] == "work":
            v.clear()
            v.update(name="work", hostPath={"path": str(job_home), "type": "Directory"})
    ds = by_kind[("DaemonSet", "warmctl-agent")]
    spec = ds["spec"]["template"]["spec"]
    _on_loopback(spec, engine_image[0], share, node_store, cluster.port, {"WARMCTL_AGENT_PORT": str(agent_port), **s3env})
    probe = spec["containers"][0]["readinessProbe"]
    probe["exec"]["command"][-1] = probe["exec"]["command"][-1].replace(":7420/", f":{agent_port}/")
    probe["periodSeconds"] = 2
    dep = by_kind[("Deployment", "warmctl-engine-tiny")]
    spec = dep["spec"]["template"]["spec"]
    _on_loopback(spec, engine_image[0], share, node_store, cluster.port, s3env)
    c = spec["containers"][0]
    c["args"] = ["warmctl", "up", "tiny", "--foreground", "--host", "127.0.0.1", "--port", str(gate_port)]
    c["ports"] = [{"name": "http", "containerPort": gate_port}]
    dep["spec"]["replicas"] = 0  # scaled up once the node is warm

    ws = f"tiny-{uuid.uuid4().hex[:6]}"
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

        # 1. the snapshot Job: the job controller's pod, bound by the scheduler, runs to completion
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
        job_s = time.monotonic() - t0
        [jpod] = _pods(cluster, "app.kubernetes.io/name%3Dwarmctl-snapshot")
        assert jpod["spec"]["nodeName"] == kube_node.name and jpod["metadata"]["ownerReferences"][0]["kind"] == "Job"
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="snaps/catalog/tiny/latest/").get("Contents", [])]
        entries = [json.loads(s3.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in keys if k.endswith(".json")]
        assert [e["host"].get("image_digest") for e in entries] == [engine_image[1]], entries
        digest = entries[0]["manifest"]
        # the model files the snapshot's engine maps, at the same path on the node
        shutil.copytree(job_home / "models", node_store / "models")

        # 2. the WarmSnapshot and the node DaemonSet: its pod pulls and labels the node
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(
            {"apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot", "metadata": {"name": ws},
             "spec": {"ref": "tiny:latest", "remote": f"s3://{bucket}/snaps"}}))
        t0 = time.monotonic()
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(ds))
        label = f"snapshot.warmctl.io/{ws}"

        def labelled() -> bool:
            node = cluster.request("GET", f"/api/v1/nodes/{kube_node.name}")[1]
            return node["metadata"].get("labels", {}).get(label) == "sha256-" + digest[7:47]
        _wait("the node's pre-warm label", labelled, 300, tails)
        prewarm_s = time.monotonic() - t0

        def ds_ready() -> bool:
            st, d = cluster.request("GET", f"/apis/apps/v1/namespaces/{NS}/daemonsets/warmctl-agent")
            return d.get("status", {}).get("numberReady") == 1
        _wait("the DaemonSet's pod Ready", ds_ready, 120, tails)
        st, obj = cluster.request("GET", f"/apis/warmctl.io/v1alpha1/warmsnapshots/{ws}")
        assert [(n["node"], n.get("digest")) for n in obj["status"]["nodes"]] == [(kube_node.name, digest)], obj

        # 3. the engine Deployment, scaled to 1: restores on the warm node store, nothing remote
        cluster.kubectl("apply", "-f", "-", check=True, input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": [o for o in objs if o["kind"] == "Service"] + [dep]}))
        t0 = time.monotonic()
        cluster.kubectl("-n", NS, "scale", "deployment/warmctl-engine-tiny", "--replicas=1", check=True)

        def available() -> bool:
            st, d = cluster.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/warmctl-engine-tiny")
            return d.get("status", {}).get("availableReplicas") == 1
        _wait("the engine Deployment available", available, 600, tails)
        ready_s = time.monotonic() - t0
        [epod] = _pods(cluster, "app.kubernetes.io/name%3Dwarmctl-engine")
        assert _ready(epod) and epod["spec"]["nodeName"] == kube_node.name
        cond = _restored(epod)
        assert cond.get("reason") == "Serving" and digest in cond["message"], cond
        assert "read 0.0 MiB from the remote store" in cond["message"], cond  # all from the node store
        assert _chat(gate_port).strip() == "Paris."

        cluster.kubectl("-n", NS, "scale", "deployment/warmctl-engine-tiny", "--replicas=0", check=True)
        _wait("the engine pod gone", lambda: not _pods(cluster, "app.kubernetes.io/name%3Dwarmctl-engine"), 120, tails)
        assert _vllm_pids() == []  # the engine is gone (the DaemonSet's agent still runs)
        print(f"\nshipped workloads: snapshot Job created -> complete {job_s:.1f} s; DaemonSet created -> node "
              f"labelled {prewarm_s:.1f} s; Deployment scaled to 1 -> available {ready_s:.1f} s")
    finally:
        for kind in ("deployment/warmctl-engine-tiny", "service/warmctl-engine-tiny", "daemonset/warmctl-agent",
                     "job/warmctl-snapshot-tiny"):
            cluster.kubectl("-n", NS, "delete", kind, "--ignore-not-found", "--cascade=foreground", "--wait=true",
                            timeout=180)
        cluster.kubectl("delete", "warmsnapshot", ws, "--ignore-not-found")
        cluster.kubectl("label", "node", kube_node.name, f"snapshot.warmctl.io/{ws}-")
        cluster.kubectl("-n", NS, "delete", "secret", "warmctl-signing-key", "warmctl-trust-keys",
                        "warmctl-remote-credentials", "--ignore-not-found")
    _wait("no pod of the workloads left", lambda: not _pods(cluster, "app.kubernetes.io/part-of%3Dwarmctl"), 120, tails)
    assert _engine_pids() == []
    assert _wait_no_leftovers(kube_node) == []
