"""Two real kubelets on one host (tests/kubenode.py: node ``127.0.0.1`` and node ``127.0.0.2``),
each with its own containerd, kubelet root and ports, node credentials, cgroup root, and, for the
second, a mount namespace in which the host paths a kubelet writes whatever its flags say
(``/var/log/pods``, ``/var/log/containers``, ``/var/lib/kubelet``, ``/run/containerd``) are its
own. Opt-in: ``bash scripts/test.sh --kubernetes tests/test_kube_pods_nodes.py``.

- Both nodes Ready, each with its own name as InternalIP, each kubelet authenticated as its own
  ``system:node:<name>``.
- A pod on each node at once: each on its own address, its processes in its own node's pod
  cgroups; after more than a minute side by side (each kubelet's container GC runs every minute
  and removes the log directories of pods it does not know: with shared host paths the second
  kubelet would take the first's) ``kubectl logs`` still reads both, each pod's log directory
  is on its own node only; deleted: nothing left on either node.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from kubenode import NODE2_NAME, NODE_NAME, OPT_IN
from test_kube_pods import _create, _delete, _wait_no_leftovers

pytestmark = OPT_IN

#: kubelet 1.20's ``ContainerGCPeriod`` (pkg/kubelet/kubelet.go): how often it removes dead pods' log dirs.
CONTAINER_GC_PERIOD_S = 60


def _ticker(name: str, node: str, image: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node, "hostNetwork": True, "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 2, "restartPolicy": "Never",
            "containers": [{"name": "c", "image": image,
                            "command": ["/bin/sh", "-c", f"while true; do echo tick {name}; sleep 1; done"]}],
        },
    }


def _task_pids(node) -> list[int]:
    """The PIDs of the tasks (sandboxes and containers) in ``node``'s containerd."""
    lines = node.ctr("tasks", "ls").stdout.splitlines()[1:]
    return [int(ln.split()[1]) for ln in lines if ln.split() and ln.split()[1].isdigit()]


def test_two_kubelets_on_one_host_run_pods_side_by_side_each_with_its_own_logs_and_cgroups(
        kube_node, kube_node2, kube_images):
    cluster = kube_node.cluster
    nodes = {n["metadata"]["name"]: n for n in cluster.request("GET", "/api/v1/nodes")[1]["items"]}
    for node in (kube_node, kube_node2):
        n = nodes[node.name]
        assert {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"] == "True"
        assert [a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"] == [node.name]
    assert (kube_node.name, kube_node2.name) == (NODE_NAME, NODE2_NAME)
    assert kube_node2.own_host_paths and not kube_node.own_host_paths
    print(f"\nnode start (containerd spawned -> node Ready): node 1 {kube_node.start_s:.1f} s, "
          f"node 2 {kube_node2.start_s:.1f} s")

    image = kube_images.busybox()
    pods = {kube_node: f"tick1-{uuid.uuid4().hex[:6]}", kube_node2: f"tick2-{uuid.uuid4().hex[:6]}"}
    t0 = time.monotonic()
    for node, name in pods.items():
        _create(node, _ticker(name, node.name, image))
    for node, name in pods.items():
        pod = node.wait_pod("default", name, lambda p: (p or {}).get("status", {}).get("phase") == "Running",
                            timeout=180, what="Running")
        assert pod["status"]["hostIP"] == node.name and pod["status"]["podIP"] == node.name, pod["status"]
    print(f"both ticker pods Running in {time.monotonic() - t0:.1f} s")

    # each node's pod processes are in that node's pod cgroups only
    for node in pods:
        own = node.cgroup_root.rstrip("/") + "/kubepods/"
        pids = _task_pids(node)
        assert pids, f"no task in node {node.name}'s containerd"
        for pid in pids:
            paths = [ln.split(":", 2)[2] for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines()]
            mem = [p for p in paths if "kubepods" in p]
            assert mem and all(p.startswith(own) for p in mem), (node.name, pid, paths)

    # side by side for longer than a container GC period of both kubelets
    time.sleep(CONTAINER_GC_PERIOD_S + 10)
    host_logs = Path("/var/log/pods")
    own_logs = kube_node2.workdir / "host" / "var-log-pods"
    for node, name in pods.items():
        pod = node.pod("default", name)
        assert pod["status"]["phase"] == "Running", pod["status"]
        logs = cluster.kubectl("logs", "-n", "default", name)
        assert logs.returncode == 0 and f"tick {name}" in logs.stdout, (node.name, logs.stderr)
        uid = pod["metadata"]["uid"]
        here, there = (host_logs, own_logs) if node is kube_node else (own_logs, host_logs)
        assert [d.name for d in here.iterdir() if d.name.endswith(uid)], f"{name}'s log dir not in {here}"
        assert not there.is_dir() or not [d for d in there.iterdir() if d.name.endswith(uid)], \
            f"{name}'s log dir also in {there}"
    print(json.dumps({n.name: n.cgroup_root for n in pods}))

    for node, name in pods.items():
        _delete(node, "default", name, grace=2)
    for node, name in pods.items():
        node.wait_pod("default", name, lambda p: p is None, timeout=60, what="deleted")
        assert _wait_no_leftovers(node) == []
