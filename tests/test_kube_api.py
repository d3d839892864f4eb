"""deploy/kubernetes against a real Kubernetes API server (tests/kubecluster.py: etcd +
kube-apiserver v1.20.2 with Node+RBAC authorization; no kubelet, so pods are stored, never run).

- The WarmSnapshot CRD's schema refuses bad objects server-side (missing or malformed ``ref``,
  ``remote``, wrong types), prunes unknown fields, and keeps ``status`` behind its subresource.
- ``kubectl apply -k deploy/kubernetes`` stores every object (and a server-side dry run of it
  again succeeds); with the controller-manager, the Deployment's and the Job's pods pass
  admission (service accounts, privileged pods).
- RBAC is least privilege: each service account's own token can do what its role needs and is
  refused the rest (secrets, nodes, other namespaces, deleting pods)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from kubecluster import ADMIN, DEFAULT_SA, ENGINE, NODE, SNAPSHOT

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "kubernetes"
CRD = DEPLOY / "crd-warmsnapshot.yaml"
WS = "/apis/warmctl.io/v1alpha1/warmsnapshots"
DIGEST = "sha256:" + "ab" * 32


def _ws(name: str, spec: dict) -> dict:
    return {"apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot", "metadata": {"name": name}, "spec": spec}


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def crd(kube_api):
    """The WarmSnapshot CRD applied with kubectl and established."""
    kube_api.kubectl("apply", "-f", str(CRD), check=True)
    kube_api.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/warmsnapshots.warmctl.io", check=True)
    return kube_api


@pytest.fixture(scope="module")
def deployed(kube_api):
    """The whole of deploy/kubernetes applied with ``kubectl apply -k`` (as admin)."""
    t0 = time.monotonic()
    r = kube_api.kubectl("apply", "-k", str(DEPLOY), check=True)
    print(f"kubectl apply -k deploy/kubernetes: {time.monotonic() - t0:.1f} s")
    kube_api.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/warmsnapshots.warmctl.io", check=True)
    return r


def test_cluster_is_real_tls_and_rbac(kube_api):
    print(f"kube_api start: {kube_api.start_s:.1f} s")
    assert kube_api.server.startswith("https://127.0.0.1:")
    r = kube_api.kubectl("get", "namespaces", "-o", "name", check=True)
    assert "namespace/kube-system" in r.stdout.split()
    st, body = kube_api.request("GET", "/version")
    assert st == 200 and body["gitVersion"] == "v1.20.2", body
    # an authenticated user without a binding is refused; a wrong token is not even authenticated
    st, body = kube_api.request("GET", "/api/v1/nodes", user=DEFAULT_SA)
    assert st == 403 and DEFAULT_SA in body["message"], body
    assert kube_api.request("GET", "/api/v1/namespaces", token="not-a-token")[0] == 401


def test_kubeconfig_file_works_for_any_client(kube_api, tmp_path):
    cfg = kube_api.kubeconfig(tmp_path / "kc.yaml", user=NODE)
    doc = json.loads(cfg.read_text())
    assert doc["users"][0]["user"]["token"] == kube_api.token(NODE)
    assert doc["clusters"][0]["cluster"]["server"] == kube_api.server
    assert oct(cfg.stat().st_mode & 0o777) == "0o600"


def test_service_account_dir_is_what_an_in_cluster_client_reads(kube_api, tmp_path):
    d = kube_api.service_account_dir(tmp_path / "sa", ENGINE)
    assert (d / "namespace").read_text() == "warmctl"
    st, body = kube_api.request("GET", "/api/v1/namespaces/kube-system/secrets", token=(d / "token").read_text())
    assert st == 403 and f'User "{ENGINE}" cannot list' in body["message"], body  # authenticated as the engine
    with pytest.raises(ValueError, match="not a service account"):
        kube_api.service_account_dir(tmp_path / "x", ADMIN)


# -- the CRD ----------------------------------------------------------------------------------

GOOD = {"ref": "tiny:latest", "remote": "s3://fleet/warmctl", "nodeSelector": {"warmctl.io/gpu": "h100"}}


@pytest.mark.parametrize(("spec", "complaint"), [
    ({"remote": "s3://fleet/warmctl"}, "spec.ref: Required value"),
    ({"ref": "tiny"}, "spec.remote: Required value"),
    ({**GOOD, "ref": "../etc"}, "spec.ref in body should match"),
    ({**GOOD, "ref": "tiny:"}, "spec.ref in body should match"),
    ({**GOOD, "ref": "tiny:a:b"}, "spec.ref in body should match"),
    ({**GOOD, "ref": "-tiny"}, "spec.ref in body should match"),
    ({**GOOD, "ref": "t" * 129}, "spec.ref in body should match"),
    ({**GOOD, "ref": "tiny@sha256:" + "0" * 64}, "spec.ref in body should match"),
    ({**GOOD, "ref": 5}, "spec.ref in body must be of type string"),
    ({**GOOD, "remote": "relative/dir"}, "spec.remote in body should match"),
    ({**GOOD, "remote": "s3://"}, "spec.remote in body should match"),
    ({**GOOD, "remote": "http://host/x"}, "spec.remote in body should match"),
    ({**GOOD, "nodeSelector": {"zone": 1}}, "spec.nodeSelector.zone in body must be of type string"),
    ({**GOOD, "nodeSelector": ["zone=a"]}, "spec.nodeSelector in body must be of type object"),
])
def test_crd_refuses_a_bad_warmsnapshot(crd, spec, complaint):
    name = _uid("bad")
    st, body = crd.request("POST", WS, _ws(name, spec))
    assert st == 422, (st, body)
    assert complaint in body["message"], body["message"]
    assert crd.request("GET", f"{WS}/{name}")[0] == 404  # nothing stored


def test_crd_refuses_an_object_without_spec(crd):
    st, body = crd.request("POST", WS, {"apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot",
                                        "metadata": {"name": _uid("nospec")}})
    assert st == 422 and "spec: Required value" in body["message"], body


def test_crd_accepts_a_good_warmsnapshot_prunes_unknown_fields_and_prints_columns(crd):
    name = _uid("good")
    spec = {**GOOD, "extra": "dropped", "nodeSelector": {"a": "b"}}
    st, body = crd.request("POST", WS, _ws(name, spec))
    assert st == 201, body
    assert "extra" not in body["spec"] and body["spec"]["ref"] == "tiny:latest"
    # the other forms of ref and remote the schema documents
    for ref, remote in (("tiny", "oci://registry.example:5000/team/warmctl"), ("a.b_c-D:v1.2", "/srv/warmctl-remote")):
        n = _uid("form")
        assert crd.request("POST", WS, _ws(n, {"ref": ref, "remote": remote}))[0] == 201
        crd.kubectl("delete", "warmsnapshot", n, check=True)
    # kubectl, as a user would: apply from YAML, then the printer columns
    other = _uid("applied")
    crd.kubectl("apply", "-f", "-", input=json.dumps(_ws(other, GOOD)), check=True)
    table = crd.kubectl("get", "wsnap", other, check=True).stdout
    head, row = table.splitlines()[:2]
    assert head.split() == ["NAME", "REF", "REMOTE", "OBSERVED", "AGE"], table
    assert row.split()[:3] == [other, "tiny:latest", "s3://fleet/warmctl"], table
    crd.kubectl("delete", "warmsnapshot", name, other, check=True)


def test_status_is_a_subresource_with_its_own_schema(crd):
    name = _uid("status")
    st, body = crd.request("POST", WS, _ws(name, GOOD))
    assert st == 201, body
    gen = body["metadata"]["generation"]
    merge = "application/merge-patch+json"
    status = {"observedGeneration": gen,
              "nodes": [{"node": "n1", "digest": DIGEST, "cachedAt": "2026-12-03T06:00:00Z"},
                        {"node": "n2", "error": "remote unreachable"}]}
    # status written through the main resource is ignored
    st, body = crd.request("PATCH", f"{WS}/{name}", {"status": status}, content_type=merge)
    assert st == 200 and "status" not in body, body
    # through /status it is kept, without a new generation
    st, body = crd.request("PATCH", f"{WS}/{name}/status", {"status": status}, content_type=merge)
    assert st == 200, body
    assert body["status"]["nodes"][0]["digest"] == DIGEST and body["metadata"]["generation"] == gen
    for bad, complaint in (
        ({"nodes": [{"node": "n1", "digest": "md5:abc"}]}, "status.nodes.digest in body should match"),
        ({"nodes": [{"digest": DIGEST}]}, "status.nodes.node: Required value"),
        ({"nodes": [{"node": "n1", "cachedAt": "yesterday"}]}, "status.nodes.cachedAt in body must be of type date-time"),
        ({"observedGeneration": "1"}, "status.observedGeneration in body must be of type integer"),
    ):
        st, body = crd.request("PATCH", f"{WS}/{name}/status", {"status": bad}, content_type=merge)
        assert st == 422 and complaint in body["message"], (bad, body)
    # a spec change bumps the generation; the status stays as the node agents wrote it
    st, body = crd.request("PATCH", f"{WS}/{name}", {"spec": {"ref": "tiny:v2"}}, content_type=merge)
    assert st == 200 and body["metadata"]["generation"] == gen + 1 and body["status"]["observedGeneration"] == gen
    crd.kubectl("delete", "warmsnapshot", name, check=True)


# -- the manifests ----------------------------------------------------------------------------

def test_apply_k_stores_every_object(kube_api, deployed):
    out = deployed.stdout
    for obj in ("namespace/warmctl", "customresourcedefinition.apiextensions.k8s.io/warmsnapshots.warmctl.io",
                "serviceaccount/warmctl-node", "serviceaccount/warmctl-engine", "serviceaccount/warmctl-snapshot",
                "role.rbac.authorization.k8s.io/warmctl-engine", "clusterrole.rbac.authorization.k8s.io/warmctl-node",
                "configmap/warmctl-config", "daemonset.apps/warmctl-agent", "deployment.apps/warmctl-engine-tiny",
                "service/warmctl-engine-tiny", "job.batch/warmctl-snapshot-tiny"):
        assert obj in out, out
    # again, as a server-side dry run: every object is still valid and unchanged
    r = kube_api.kubectl("apply", "-k", str(DEPLOY), "--dry-run=server", check=True)
    assert "daemonset.apps/warmctl-agent" in r.stdout and "(server dry run)" in r.stdout, r.stdout

    ds = json.loads(kube_api.kubectl("get", "-n", "warmctl", "daemonset/warmctl-agent", "-o", "json", check=True).stdout)
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["hostPID"] is True and pod["serviceAccountName"] == "warmctl-node"
    assert c["securityContext"]["privileged"] is True and c["args"][:2] == ["warmctl", "agent"] and "command" not in c
    env = {e["name"]: e for e in c["env"]}
    assert env["WARMCTL_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["WARMCTL_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["WARMCTL_POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["store"]["hostPath"]["path"] == "/var/lib/warmctl"
    assert vols["trust-keys"]["secret"]["secretName"] == "warmctl-trust-keys"

    dep = json.loads(kube_api.kubectl("get", "-n", "warmctl", "deployment/warmctl-engine-tiny", "-o", "json",
                                      check=True).stdout)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["args"][:4] == ["warmctl", "up", "tiny", "--foreground"] and "command" not in c
    assert c["args"][-2:] == ["--ready-port", "8001"] and {"name": "ready", "containerPort": 8001, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready?wait=8", "port": "ready", "scheme": "HTTP"}
    assert c["readinessProbe"]["timeoutSeconds"] > 8  # longer than the probe is held
    assert c["terminationMessagePath"] == "/dev/termination-log"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    pref = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert pref["preference"]["matchExpressions"][0] == {"key": "snapshot.warmctl.io/tiny", "operator": "Exists"}

    job = json.loads(kube_api.kubectl("get", "-n", "warmctl", "job/warmctl-snapshot-tiny", "-o", "json",
                                      check=True).stdout)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["warmctl", "snapshot", "tiny", "--push"]
    assert "command" not in pod["containers"][0]
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "warmctl-snapshot"


# -- RBAC ---------------------------------------------------------------------------------------

def _can(k, user: str, *args: str) -> bool:
    """``kubectl auth can-i ARGS`` with ``user``'s own token (its real user name and groups)."""
    r = k.kubectl("auth", "can-i", *args, user=user)
    answer = r.stdout.strip()
    assert answer in ("yes", "no"), (args, r.stdout, r.stderr)
    return answer == "yes"


@pytest.mark.parametrize(("user", "args", "allowed"), [
    (ENGINE, ("patch", "pods", "--subresource=status", "-n", "warmctl"), True),
    (ENGINE, ("get", "pods", "-n", "warmctl"), True),
    (ENGINE, ("patch", "pods", "--subresource=status", "-n", "default"), False),
    (ENGINE, ("patch", "pods", "-n", "warmctl"), False),
    (ENGINE, ("list", "pods", "-n", "warmctl"), False),
    (ENGINE, ("get", "secrets", "-n", "warmctl"), False),
    (ENGINE, ("patch", "nodes"), False),
    (ENGINE, ("delete", "pods", "-n", "warmctl"), False),
    (NODE, ("patch", "nodes"), True),
    (NODE, ("get", "nodes"), True),
    (NODE, ("watch", "warmsnapshots.warmctl.io"), True),
    (NODE, ("list", "warmsnapshots.warmctl.io"), True),
    (NODE, ("patch", "warmsnapshots.warmctl.io", "--subresource=status"), True),
    (NODE, ("update", "warmsnapshots.warmctl.io", "--subresource=status"), True),
    (NODE, ("patch", "warmsnapshots.warmctl.io"), False),
    (NODE, ("create", "warmsnapshots.warmctl.io"), False),
    (NODE, ("delete", "nodes"), False),
    (NODE, ("get", "secrets", "-n", "warmctl"), False),
    (NODE, ("get", "secrets", "-n", "kube-system"), False),
    (NODE, ("delete", "pods", "-n", "warmctl"), False),
    (SNAPSHOT, ("patch", "nodes"), False),
    (SNAPSHOT, ("get", "pods", "-n", "warmctl"), False),
    (SNAPSHOT, ("get", "secrets", "-n", "warmctl"), False),
    (SNAPSHOT, ("get", "warmsnapshots.warmctl.io"), False),
])
def test_rbac_least_privilege(kube_api, deployed, user, args, allowed):
    assert _can(kube_api, user, *args) is allowed, (user, args)


def _pod(name: str, ns: str, sa: str) -> dict:
    # no token mounted: without the controller-manager no token secret exists for admission to mount
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"serviceAccountName": sa, "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "warmctl:dev"}]}}


def test_engine_token_patches_its_pods_condition_only_in_its_namespace(kube_api, deployed):
    name = _uid("engine")
    cond = {"status": {"conditions": [{"type": "warmctl.io/Restored", "status": "True", "reason": "Test"}]}}
    strategic = "application/strategic-merge-patch+json"
    # admission wants the pod's service account to exist: the engine's, and one made in default
    st, body = kube_api.request("POST", "/api/v1/namespaces/default/serviceaccounts",
                                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
    assert st == 201, body
    for ns, sa in (("warmctl", "warmctl-engine"), ("default", name)):
        st, body = kube_api.request("POST", f"/api/v1/namespaces/{ns}/pods", _pod(name, ns, sa))
        assert st == 201, body
    st, body = kube_api.request("PATCH", f"/api/v1/namespaces/warmctl/pods/{name}/status", cond, user=ENGINE,
                                content_type=strategic)
    assert st == 200, body
    assert any(c["type"] == "warmctl.io/Restored" and c["status"] == "True" for c in body["status"]["conditions"])
    st, body = kube_api.request("PATCH", f"/api/v1/namespaces/default/pods/{name}/status", cond, user=ENGINE,
                                content_type=strategic)
    assert st == 403, body
    # the pod's spec is not its to change, nor any secret to read
    st, _ = kube_api.request("PATCH", f"/api/v1/namespaces/warmctl/pods/{name}", {"metadata": {"labels": {"x": "y"}}},
                             user=ENGINE, content_type=strategic)
    assert st == 403
    assert kube_api.request("GET", "/api/v1/namespaces/warmctl/secrets", user=ENGINE)[0] == 403
    for ns in ("warmctl", "default"):
        kube_api.kubectl("delete", "pod", "-n", ns, name, "--wait=false", check=True)
    kube_api.kubectl("delete", "serviceaccount", "-n", "default", name, check=True)


def test_node_token_labels_nodes_and_writes_warmsnapshot_status_only(kube_api, deployed):
    node, ws = _uid("node"), _uid("ws")
    merge = "application/merge-patch+json"
    st, body = kube_api.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    assert st == 201, body
    assert kube_api.request("POST", WS, _ws(ws, GOOD))[0] == 201
    label = {"metadata": {"labels": {"snapshot.warmctl.io/tiny": "sha256-" + "ab" * 20}}}
    st, body = kube_api.request("PATCH", f"/api/v1/nodes/{node}", label, user=NODE, content_type=merge)
    assert st == 200 and body["metadata"]["labels"]["snapshot.warmctl.io/tiny"] == "sha256-" + "ab" * 20, body
    status = {"status": {"observedGeneration": 1, "nodes": [{"node": node, "digest": DIGEST}]}}
    st, body = kube_api.request("PATCH", f"{WS}/{ws}/status", status, user=NODE, content_type=merge)
    assert st == 200, body
    st, _ = kube_api.request("PATCH", f"{WS}/{ws}", {"spec": {"ref": "other"}}, user=NODE, content_type=merge)
    assert st == 403
    assert kube_api.request("DELETE", f"/api/v1/nodes/{node}", user=NODE)[0] == 403
    assert kube_api.request("GET", "/api/v1/secrets", user=NODE)[0] == 403
    assert kube_api.request("PATCH", f"/api/v1/nodes/{node}", label, user=SNAPSHOT, content_type=merge)[0] == 403
    kube_api.kubectl("delete", "warmsnapshot", ws, check=True)
    kube_api.kubectl("delete", "node", node, check=True)


def test_admin_is_the_only_identity_with_everything(kube_api):
    assert _can(kube_api, ADMIN, "*", "*")
    for user in (NODE, ENGINE, SNAPSHOT, DEFAULT_SA):
        assert not _can(kube_api, user, "*", "*"), user


# -- with the controller-manager: the pods the workloads make pass admission ------------------

def test_controllers_create_the_workloads_pods(kube_controllers, deployed):
    k = kube_controllers

    def pods(selector: str) -> list[dict]:
        r = k.kubectl("get", "pods", "-n", "warmctl", "-l", selector, "-o", "json", check=True)
        return json.loads(r.stdout)["items"]

    deadline = time.monotonic() + 90
    engine = job = []
    while time.monotonic() < deadline:
        engine = pods("app.kubernetes.io/name=warmctl-engine")
        job = pods("app.kubernetes.io/name=warmctl-snapshot")
        if engine and job:
            break
        time.sleep(0.5)
    events = k.kubectl("get", "events", "-n", "warmctl").stdout
    assert engine and job, f"no pods from the Deployment or the Job within 90 s; events:\n{events}"
    # the engine pod got its service account's token (for the condition reporter); the job none
    e = engine[0]["spec"]
    assert e["serviceAccountName"] == "warmctl-engine"
    assert any(m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" for m in e["containers"][0]["volumeMounts"])
    j = job[0]["spec"]
    assert not any(m["mountPath"].startswith("/var/run/secrets") for m in j["containers"][0]["volumeMounts"])
    # no kubelet: they wait to be scheduled, nothing runs
    assert engine[0]["status"]["phase"] == "Pending"
