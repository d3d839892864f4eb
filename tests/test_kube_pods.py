"""Pods on a real kubelet (tests/kubenode.py: containerd 1.6 + runc + kubelet v1.20.2 on
loopback, registered with the test cluster of tests/kubecluster.py), images from a loopback
registry. Opt-in: ``bash scripts/test.sh --kubernetes tests/test_kube_pods.py`` (or
``WARMCTL_TEST_KUBERNETES=1``); the default run and ``--fast`` skip them, saying so.

- A busybox pod behind an HTTP readiness probe: not Ready while nothing answers, Ready once
  something does, NotReady again when it stops; deleted: its containers gone, nothing mounted or
  running left on the node.
- The ``tiny`` engine in a pod of the project's image (deploy/image/build.sh), cold-started by
  ``warmctl up tiny --foreground`` (privileged, hostNetwork on loopback, tini as PID 1) with the
  readiness probe on the gate's ``/health``: not Ready before its canary passed, Ready after; a
  chat request through the pod's address answered "Paris."; the pod deleted: drained, the engine
  gone, nothing left on the node.
- ``warmctl snapshot tiny`` in a pod (CRIU inside the privileged container) records the pod's
  image digest; a pod of another image refuses to restore it (exit 42, ``ImageMismatch``, both
  digests in its termination message); a fresh pod of the same image restores it from the
  node's store (``--cold-start never``), run as deploy/kubernetes's ``warmctl-engine`` service
  account with its own token: Ready, its ``warmctl.io/Restored`` condition walked to ``Serving``
  naming the snapshot, "Paris.", deleted without leftovers.
- ``tiny-tp2`` snapshotted and restored in pods, both ranks in one pod: Ready, "Paris.".
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import ENGINE_IMAGE_LAYOUT
from kubenode import OPT_IN

REPO = Path(__file__).resolve().parent.parent

pytestmark = OPT_IN


def _ready(pod: dict | None) -> bool | None:
    """The pod's Ready condition (None when it has none yet)."""
    for c in (pod or {}).get("status", {}).get("conditions", []):
        if c["type"] == "Ready":
            return c["status"] == "True"
    return None


def _restored(pod: dict | None) -> dict:
    """The pod's ``warmctl.io/Restored`` condition ({} when it has none)."""
    for c in (pod or {}).get("status", {}).get("conditions", []):
        if c["type"] == "warmctl.io/Restored":
            return c
    return {}


def _served(pod: dict | None) -> bool:
    """The pod's ``warmctl.io/Restored`` is ``up``'s last word: Serving with what it restored and
    read (the Serving that the open port set a moment before says less)."""
    c = _restored(pod)
    return c.get("reason") == "Serving" and c.get("message", "").startswith("serving on ")


def _create(node, pod: dict) -> None:
    st, body = node.cluster.request("POST", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods", body=pod)
    assert st == 201, f"create pod: HTTP {st}: {body}"


def _delete(node, namespace: str, name: str, grace: int) -> None:
    st, body = node.cluster.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                    body={"gracePeriodSeconds": grace})
    assert st in (200, 202), f"delete pod: HTTP {st}: {body}"


def _get(url: str, timeout: float = 2) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_busybox_pod_readiness_follows_its_probe_and_deletion_leaves_nothing(kube_node, kube_images):
    from ports import free_port

    image = kube_images.busybox()
    port = free_port()
    name = f"bb-{uuid.uuid4().hex[:6]}"
    # the container serves HTTP only while /tmp/serve exists (busybox nc answers one request per
    # connection); kubectl-less: the test flips it through the pod's own hostPath directory
    share = kube_node.workdir / "share" / name
    share.mkdir(parents=True)
    script = (f"while true; do if [ -e /share/serve ]; then "
              f"printf 'HTTP/1.0 200 OK\\r\\n\\r\\nok' | nc -l -p {port} >/dev/null; "
              f"else sleep 0.2; fi; done")
    _create(kube_node, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": kube_node.name, "hostNetwork": True, "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 2, "restartPolicy": "Never",
            "containers": [{
                "name": "c", "image": image, "command": ["/bin/sh", "-c", script],
                "readinessProbe": {"httpGet": {"host": "127.0.0.1", "port": port, "path": "/health"},
                                   "periodSeconds": 1, "failureThreshold": 1, "timeoutSeconds": 1},
                "volumeMounts": [{"name": "share", "mountPath": "/share"}],
            }],
            "volumes": [{"name": "share", "hostPath": {"path": str(share), "type": "Directory"}}],
        },
    })
    pod = kube_node.wait_pod("default", name, lambda p: (p or {}).get("status", {}).get("phase") == "Running",
                             timeout=120, what="Running")
    assert pod["status"]["podIP"] == "127.0.0.1" and pod["status"]["hostIP"] == "127.0.0.1"
    time.sleep(3)  # three probe periods with nothing listening
    assert _ready(kube_node.pod("default", name)) is False
    (share / "serve").touch()
    kube_node.wait_pod("default", name, lambda p: _ready(p) is True, timeout=30, what="Ready")
    (share / "serve").unlink()
    kube_node.wait_pod("default", name, lambda p: _ready(p) is False, timeout=30, what="NotReady again")
    _delete(kube_node, "default", name, grace=2)
    kube_node.wait_pod("default", name, lambda p: p is None, timeout=60, what="deleted")
    assert _wait_no_leftovers(kube_node) == []


def _wait_no_leftovers(node, timeout: float = 30) -> list[str]:
    """The node's leftovers once none remain, or those still there after ``timeout`` s (the
    kubelet removes a deleted pod's sandbox shortly after the API object is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = node.leftovers()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture(scope="session")
def other_engine_image(kube_images, engine_image, tmp_path_factory) -> tuple[str, str]:
    """:func:`engine_image` plus one small layer (a file ``/etc/warmctl-test-variant``): the same
    software under another digest. (reference, digest)."""
    import subprocess as sp

    layout, tag = ENGINE_IMAGE_LAYOUT[engine_image[0]]
    marker = tmp_path_factory.mktemp("variant") / "variant"
    marker.write_text("another image\n")
    other = f"{tag}-variant"
    if other not in sp.run(["umoci", "ls", "--layout", str(layout)], capture_output=True, text=True).stdout.split():
        sp.run(["umoci", "insert", "--image", f"{layout}:{tag}", "--tag", other, str(marker),
                "/etc/warmctl-test-variant"], check=True, capture_output=True)
    ref = kube_images.push(layout, other, "warmctl/engine")
    return ref, kube_images.digest(ref)


def _engine_pod(name: str, image: tuple[str, str], share: Path, gate_port: int, args: list[str],
                grace: int = 30, namespace: str = "default", api_port: int = 0,
                node: str | None = "127.0.0.1", ready_port: int | None = None) -> dict:
    """An engine pod as deploy/kubernetes/engine-deployment.yaml has it, on loopback: privileged,
    hostNetwork, the image's tini as PID 1 running ``warmctl ARGS`` with the node directory
    ``share`` (config, profiles, data dir) mounted at the same path, ``WARMCTL_IMAGE_DIGEST`` the
    image's digest (as the Deployment sets it from its ConfigMap), readiness on the gate's
    /health. ``image``: (reference, digest). With ``api_port`` (the apiserver's), the pod runs as
    deploy/kubernetes's ``warmctl-engine`` service account (namespace ``warmctl``, its token
    mounted) with the downward-API variables the Deployment sets, so ``up --foreground`` keeps
    the pod's ``warmctl.io/Restored`` condition; the in-cluster address is the apiserver's on
    loopback (no kube-proxy here). ``node``: the pod's ``spec.nodeName`` (None: none, the
    scheduler binds it). ``ready_port``: ``--ready-port`` added to ``up``'s arguments and the
    probe on its ``/ready?wait=8`` (a 10 s timeout), as the Deployment has it, instead of the
    gate's ``/health``."""
    kube = [] if not api_port else [
        {"name": "WARMCTL_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "WARMCTL_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "WARMCTL_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
    ]
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {
            **({"nodeName": node} if node else {}), "hostNetwork": True, "automountServiceAccountToken": bool(api_port),
            **({"serviceAccountName": "warmctl-engine"} if api_port else {}),
            "terminationGracePeriodSeconds": grace, "restartPolicy": "Never",
            "containers": [{
                "name": "engine", "image": image[0],
                "args": ["warmctl", *args, *(["--ready-port", str(ready_port)] if ready_port else [])],
                "env": [{"name": "WARMCTL_CONFIG", "value": str(share / "config.toml")},
                        {"name": "WARMCTL_IMAGE_DIGEST", "value": image[1]},
                        {"name": "WARMCTL_TERMINATION_MESSAGE_PATH", "value": "/dev/termination-log"},
                        {"name": "PYTHONUNBUFFERED", "value": "1"}, *kube],
                "securityContext": {"privileged": True},
                "resources": {"requests": {"cpu": "1", "memory": "3Gi"}},
                "readinessProbe": _probe(gate_port, ready_port),
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "volumeMounts": [{"name": "share", "mountPath": str(share)},
                                 {"name": "shm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "share", "hostPath": {"path": str(share), "type": "Directory"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory"}}],
        },
    }


def _probe(gate_port: int, ready_port: int | None) -> dict:
    """The engine container's readiness probe: the supervisor's held ``/ready`` on
    ``ready_port`` when given (deploy/kubernetes/engine-deployment.yaml's), else the gate's
    ``/health``, both every second."""
    if ready_port:
        return {"httpGet": {"host": "127.0.0.1", "port": ready_port, "path": "/ready?wait=8"},
                "periodSeconds": 1, "failureThreshold": 3, "timeoutSeconds": 10}
    return {"httpGet": {"host": "127.0.0.1", "port": gate_port, "path": "/health"},
            "periodSeconds": 1, "failureThreshold": 1, "timeoutSeconds": 1}


def _share(node, name: str, engine_port: int, gate_port: int, profile: str = "tiny") -> Path:
    """The node directory a pod mounts: config.toml, ``profile``'s file on the given ports
    (tests/conftest.py), the data dir and keys."""
    from conftest import tiny_profile, tp2_profile

    share = node.workdir / "share" / name
    (share / "profiles").mkdir(parents=True)
    text = {"tiny": tiny_profile, "tiny-tp2": tp2_profile}[profile](engine_port, gate_port)
    (share / "profiles" / f"{profile}.toml").write_text(text)
    (share / "config.toml").write_text(f'home = "{share / "home"}"\nprofile_dirs = ["{share / "profiles"}"]\n'
                                       f'keys_dir = "{share / "keys"}"\n')
    return share


def _chat(port: int, model: str = "tiny") -> str:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "temperature": 0, "max_tokens": 24, "messages": [
            {"role": "user", "content": "What is the capital of France? One word."}]}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - loopback
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _engine_pids() -> list[int]:
    """Processes in a pod cgroup whose command line names vLLM or warmctl."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if "/kubepods" not in Path(f"/proc/{pid}/cgroup").read_text():
                    continue
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"vllm" in cmd.lower() or b"warmctl" in cmd or b"VLLM" in Path(f"/proc/{pid}/comm").read_bytes():
                out.append(int(pid))
    return out


@pytest.mark.e2e
def test_tiny_engine_pod_ready_only_after_canary_answers_and_deletion_drains(kube_node, engine_image, engine_ports):
    engine_port, gate_port = engine_ports[0] + 11, engine_ports[1] + 11
    name = f"tiny-{uuid.uuid4().hex[:6]}"
    share = _share(kube_node, name, engine_port, gate_port)
    t0 = time.monotonic()
    # the probe the Deployment ships: the supervisor's /ready, held 8 s at a time through the cold start
    _create(kube_node, _engine_pod(name, engine_image, share, gate_port, ["up", "tiny", "--foreground"],
                                   ready_port=engine_ports[1] + 21))
    # until Ready: sample the pod and the gate; the gate must never answer before the pod is
    # Running, and the pod must never be Ready while the gate does not answer
    running_at = ready_at = None
    not_ready_while_running = 0
    deadline = t0 + 1500
    while ready_at is None:
        pod = kube_node.pod("default", name)
        phase = (pod or {}).get("status", {}).get("phase")
        assert phase in ("Pending", "Running"), f"pod {phase}: {json.dumps((pod or {}).get('status'))[-3000:]}"
        health = _get(f"http://127.0.0.1:{gate_port}/health")
        ready = _ready(pod)
        if phase == "Running" and running_at is None:
            running_at = time.monotonic()
        if ready:
            assert health == 200, "pod Ready while the gate's /health does not answer 200"
            ready_at = time.monotonic()
        elif phase == "Running":
            not_ready_while_running += 1
        assert time.monotonic() < deadline, f"pod not Ready within 1500 s{kube_node.tails()}"
        time.sleep(0.5)
    assert not_ready_while_running >= 3, "the pod was never seen Running and not Ready (canary not awaited?)"
    image_id = pod["status"]["containerStatuses"][0]["imageID"]
    assert image_id.endswith("@" + engine_image[1]), (image_id, engine_image)
    logs = kube_node.cluster.kubectl("logs", "-n", "default", name).stdout
    assert "canary" in logs.lower(), logs[-3000:]
    answer = _chat(gate_port)
    assert answer.strip() == "Paris.", answer
    print(f"\npod-ready-seconds cold start in a pod: created->Running {running_at - t0:.1f} s (image pull, "
          f"sandbox), created->Ready {ready_at - t0:.1f} s")
    assert _engine_pids(), "no engine process found in the pod's cgroup while it serves"
    # deleted: SIGTERM to tini -> warmctl drains and stops the engine; the pod goes away within
    # its grace period, without SIGKILL being needed
    td = time.monotonic()
    _delete(kube_node, "default", name, grace=30)
    kube_node.wait_pod("default", name, lambda p: p is None, timeout=90, what="deleted")
    gone_s = time.monotonic() - td
    assert gone_s < 30, f"pod took {gone_s:.1f} s to go: not drained within its grace period"
    assert _get(f"http://127.0.0.1:{gate_port}/health") == 0 and _get(f"http://127.0.0.1:{engine_port}/health") == 0
    assert _engine_pids() == []
    assert _wait_no_leftovers(kube_node) == []


def _finished(pod: dict | None) -> bool:
    return (pod or {}).get("status", {}).get("phase") in ("Succeeded", "Failed")


def _terminated(pod: dict) -> dict:
    """The engine container's ``state.terminated`` (exitCode, reason, message)."""
    return pod["status"]["containerStatuses"][0]["state"].get("terminated", {})


@pytest.mark.e2e
def test_tiny_snapshot_in_a_pod_then_restored_in_another_pod(kube_node, engine_image, other_engine_image, engine_ports):
    engine_port, gate_port = engine_ports[0] + 12, engine_ports[1] + 12
    name = f"snap-{uuid.uuid4().hex[:6]}"
    share = _share(kube_node, name, engine_port, gate_port)
    _create(kube_node, _engine_pod(name, engine_image, share, gate_port, ["snapshot", "tiny"]))
    pod = kube_node.wait_pod("default", name, _finished, timeout=1500, what="finished")
    term = _terminated(pod)
    logs = kube_node.cluster.kubectl("logs", "-n", "default", name).stdout
    assert pod["status"]["phase"] == "Succeeded", f"snapshot pod {term}\nlogs:\n{logs[-4000:]}"
    _delete(kube_node, "default", name, grace=5)
    kube_node.wait_pod("default", name, lambda p: p is None, timeout=60, what="deleted")
    # the snapshot records the image it was made in (the digest rule)
    entries = [json.loads(p.read_text()) for p in (share / "home" / "store" / "catalog" / "tiny" / "latest").glob("*.json")]
    assert [e["host"].get("image_digest") for e in entries] == [engine_image[1]], entries
    # a pod of another image refuses it: exit 42 (ImageMismatch), both digests in the message
    other = f"other-{uuid.uuid4().hex[:6]}"
    _create(kube_node, _engine_pod(other, other_engine_image, share, gate_port,
                                   ["up", "tiny", "--foreground", "--cold-start", "never"]))
    pod = kube_node.wait_pod("default", other, _finished, timeout=600, what="finished")
    term = _terminated(pod)
    assert pod["status"]["phase"] == "Failed" and _ready(pod) is not True, term
    assert term["exitCode"] == 42, term
    assert engine_image[1] in term.get("message", "") and other_engine_image[1] in term.get("message", ""), term
    _delete(kube_node, "default", other, grace=5)
    kube_node.wait_pod("default", other, lambda p: p is None, timeout=60, what="deleted")
    # the restore pod as the Deployment runs it: deploy/kubernetes's namespace, service accounts
    # and RBAC, its own token; its supervisor keeps the warmctl.io/Restored condition
    cluster = kube_node.cluster
    for f in ("namespace.yaml", "serviceaccounts.yaml", "rbac.yaml"):
        cluster.kubectl("apply", "-f", str(REPO / "deploy" / "kubernetes" / f), check=True)
    deadline = time.monotonic() + 60
    while not cluster.request("GET", "/api/v1/namespaces/warmctl/serviceaccounts/warmctl-engine")[1].get("secrets"):
        assert time.monotonic() < deadline, "the warmctl-engine service account got no token within 60 s"
        time.sleep(0.2)
    up = f"up-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    _create(kube_node, _engine_pod(up, engine_image, share, gate_port,
                                   ["up", "tiny", "--foreground", "--cold-start", "never"],
                                   namespace="warmctl", api_port=cluster.port))
    reasons: list[str] = []

    def ready_or_done(p: dict | None) -> bool:
        r = _restored(p).get("reason")
        if r and (not reasons or reasons[-1] != r):
            reasons.append(r)
        return _ready(p) is True or _finished(p)
    pod = kube_node.wait_pod("warmctl", up, ready_or_done, timeout=900, what="Ready")
    logs = cluster.kubectl("logs", "-n", "warmctl", up).stdout
    assert _ready(pod), f"restore pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
    ready_s = time.monotonic() - t0
    # the condition says Serving (status True) once the pod is Ready, naming the snapshot
    pod = kube_node.wait_pod("warmctl", up, lambda p: ready_or_done(p) and _served(p),
                             timeout=30, what="warmctl.io/Restored=Serving")
    cond = _restored(pod)
    assert cond["status"] == "True" and entries[0]["manifest"][:19] in cond["message"], cond
    assert reasons[-1] == "Serving" and set(reasons) <= {"Resolving", "Pulling", "Restoring", "CanaryRunning",
                                                         "Serving"}, reasons
    assert _chat(gate_port).strip() == "Paris."
    phases = " ".join(ln.strip() for ln in logs.splitlines() if ln.startswith("ok "))
    print(f"\npod-ready-seconds restore in a pod (local store on the node): created->Ready {ready_s:.1f} s; "
          f"up's phases in the pod: {phases}; warmctl.io/Restored reasons seen: {' -> '.join(reasons)}")
    _delete(kube_node, "warmctl", up, grace=30)
    kube_node.wait_pod("warmctl", up, lambda p: p is None, timeout=90, what="deleted")
    assert _engine_pids() == []
    assert _wait_no_leftovers(kube_node) == []


@pytest.mark.e2e
def test_tiny_tp2_both_ranks_snapshot_and_restore_in_one_pod(kube_node, engine_image, engine_ports):
    engine_port, gate_port = engine_ports[0] + 13, engine_ports[1] + 13
    name = f"tp2snap-{uuid.uuid4().hex[:6]}"
    share = _share(kube_node, name, engine_port, gate_port, profile="tiny-tp2")
    _create(kube_node, _engine_pod(name, engine_image, share, gate_port, ["snapshot", "tiny-tp2"]))
    pod = kube_node.wait_pod("default", name, _finished, timeout=1500, what="finished")
    logs = kube_node.cluster.kubectl("logs", "-n", "default", name).stdout
    assert pod["status"]["phase"] == "Succeeded", f"snapshot pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
    _delete(kube_node, "default", name, grace=5)
    kube_node.wait_pod("default", name, lambda p: p is None, timeout=60, what="deleted")
    up = f"tp2up-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    _create(kube_node, _engine_pod(up, engine_image, share, gate_port,
                                   ["up", "tiny-tp2", "--foreground", "--cold-start", "never"]))
    pod = kube_node.wait_pod("default", up, lambda p: _ready(p) is True or _finished(p), timeout=900, what="Ready")
    logs = kube_node.cluster.kubectl("logs", "-n", "default", up).stdout
    assert _ready(pod), f"restore pod {_terminated(pod)}\nlogs:\n{logs[-4000:]}"
    ready_s = time.monotonic() - t0
    ranks = [pid for pid in _engine_pids() if b"Worker_TP" in Path(f"/proc/{pid}/comm").read_bytes()]
    assert len(ranks) == 2, f"expected both ranks (VLLM::Worker_TP0/1) in the pod, found {len(ranks)}"
    assert "Paris" in _chat(gate_port, model="tiny-tp2")
    print(f"\npod-ready-seconds tiny-tp2 restore in a pod: created->Ready {ready_s:.1f} s")
    _delete(kube_node, "default", up, grace=30)
    kube_node.wait_pod("default", up, lambda p: p is None, timeout=90, what="deleted")
    assert _engine_pids() == []
    assert _wait_no_leftovers(kube_node) == []
