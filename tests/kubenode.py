"""A real Kubernetes node on loopback, for the pod tests: containerd 1.6 (CRI) with runc and a
kubelet v1.20.2 registered with a :class:`kubecluster.KubeCluster`, and the images it runs served
by a loopback registry (Debian's ``docker-registry``).

    from kubenode import KubeNode, ImageStore, missing         # tests/ is on sys.path under pytest
    with ImageStore(cache / "registry") as images:               # the registry, storage kept in the cache
        ref = images.busybox()                                   # "127.0.0.1:PORT/warmctl/busybox:<hash>"
        with KubeNode(cluster, tmp / "node", images) as node:    # ~10 s: containerd, kubelet, node Ready
            node.name                                            # "127.0.0.1" (also its InternalIP)
            node.wait_pod("default", "p", lambda pod: ...)
            with KubeNode(cluster, tmp / "node2", images, name=NODE2_NAME) as node2:  # a second kubelet
                ...                                              # pods with nodeName "127.0.0.2"

What is real: containerd with every root, state and socket directory under the node's working
directory (its CRI plugin with ``restrict_oom_score_adj``: root here lacks CAP_SYS_RESOURCE, and
runc fails every sandbox otherwise), runc (shim ``io.containerd.runc.v2``, its state under the
working directory too), a loopback-only CNI configuration (``hostNetwork`` pods only: the node
never gets a pod network), and the kubelet (cgroupfs driver, no iptables chains, API, healthz and
streaming on 127.0.0.1 only, anonymous access to its API allowed on that loopback port so the
apiserver can fetch logs) with its own root directory, authenticated to the apiserver as
``system:node:127.0.0.1`` (group ``system:nodes``: the Node authorizer's rules apply). The node
is named ``127.0.0.1``: kubelet 1.20 refuses a loopback ``--node-ip`` but takes an IP given as
the host name as the node's InternalIP, so the pods' ``hostIP`` / ``podIP`` are 127.0.0.1 (the
address a test reaches them at).

:meth:`KubeNode.stop` deletes every pod still bound to the node, stops the kubelet, kills and
removes every container and sandbox left in containerd, stops containerd and the shims it
started, unmounts everything mounted under the working directory (the kubelet's volume mounts,
containerd's overlay and shm mounts), removes the pods' cgroups and what the kubelet and the
shims wrote to the host paths they use whatever their flags say (:data:`HOST_PATHS`: pod logs
under /var/log/pods, /var/lib/kubelet/device-plugins, shim sockets under /run/containerd), and
removes the working directory; :meth:`KubeNode.leftovers` lists what of that remains (the pod tests assert it is
empty).

A second node on the same host (any name but :data:`NODE_NAME`, e.g. :data:`NODE2_NAME`) has all
of that of its own, plus a mount namespace in which those host paths are its own directories and
a cgroup root of its own (:class:`KubeNode` says why: a kubelet's container GC removes the log
directories of pods it does not know, i.e. the other node's).

Binaries: ``containerd``, ``containerd-shim-runc-v2``, ``runc``, ``ctr``, the CNI ``loopback``
plugin (/usr/lib/cni), ``docker-registry``, ``skopeo``, ``umoci`` and ``busybox`` (Debian
packages), and the kubelet in the Kubernetes cache: ``WARMCTL_KUBE_WITH_KUBELET=1
scripts/install-kubernetes.sh`` installs and builds all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import kubecluster
import pytest
from kubecluster import ADMIN, KubeCluster, KubeStartError, Processes, free_port
from registry_server import Registry

#: The first node's name, host name and InternalIP.
NODE_NAME = "127.0.0.1"
#: The second node's (the loopback interface answers every address of 127.0.0.0/8).
NODE2_NAME = "127.0.0.2"
#: The first kubelet's user (``system:node:<name>``, group ``system:nodes``), one of the
#: cluster's static tokens (kubecluster.USERS).
KUBELET_USER = kubecluster.KUBELET
assert KUBELET_USER == f"system:node:{NODE_NAME}"
assert kubecluster.KUBELET2 == f"system:node:{NODE2_NAME}"

#: What a pod test module sets as its ``pytestmark``: marker ``kubelet``, and skipped unless
#: ``WARMCTL_TEST_KUBERNETES=1`` (``bash scripts/test.sh --kubernetes``): pod tests are opt-in.
OPT_IN = [
    pytest.mark.kubelet,
    pytest.mark.skipif(os.environ.get("WARMCTL_TEST_KUBERNETES") != "1",
                       reason="pod tests on a real kubelet are opt-in: bash scripts/test.sh --kubernetes, "
                              "or WARMCTL_TEST_KUBERNETES=1"),
]

CNI_BIN = Path("/usr/lib/cni")
#: Host directories the kubelet (pod and container logs, device plugins) and containerd's shims
#: (their sockets) write to whatever their configuration says; a node removes what it added.
HOST_PATHS = (Path("/var/log/pods"), Path("/var/log/containers"), Path("/var/lib/kubelet"), Path("/run/containerd"))
IMAGE_CACHE = Path(os.environ.get("WARMCTL_IMAGE_CACHE") or "/var/cache/warmctl/image")
BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "docker-registry", "skopeo", "umoci", "busybox")


def kubelet_user(name: str) -> str:
    """The user a node's kubelet authenticates as: ``system:node:<name>``."""
    return f"system:node:{name}"


def missing() -> str | None:
    """What is missing to run a node (with how to get it), or None when all is there."""
    gone = [b for b in BINARIES if not shutil.which(b)]
    if not (CNI_BIN / "loopback").is_file():
        gone.append(str(CNI_BIN / "loopback"))
    kubelet = kubecluster.bin_dir() / "kubelet"
    if not os.access(kubelet, os.X_OK):
        gone.append(str(kubelet))
    cluster = kubecluster.missing(controllers=True)
    if not gone and not cluster:
        return None
    what = f"Kubernetes node binaries missing ({', '.join(gone)})" if gone else cluster
    return f"{what}: run WARMCTL_KUBE_WITH_KUBELET=1 scripts/install-kubernetes.sh as root"


def _run(argv: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode != 0:
        raise KubeStartError(f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


class ImageStore:
    """A loopback ``docker-registry`` whose storage lives in the image cache (pushes of an image
    already there copy nothing), and the images the pod tests run, pushed into it with
    ``skopeo copy`` from OCI layouts that umoci made.

    Attributes: ``host`` (``127.0.0.1:PORT``), ``registry``."""

    def __init__(self, storage: Path | None = None):
        self.storage = Path(storage or IMAGE_CACHE / "registry")
        self.registry: Registry | None = None
        self.host = ""
        self._tmp = Path(tempfile.mkdtemp(prefix="warmctl-images-"))
        (self._tmp / "policy.json").write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))

    def start(self) -> ImageStore:
        self.storage.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(self.storage, free_port())
        self.registry.start()
        self.host = self.registry.host
        return self

    def stop(self) -> None:
        if self.registry:
            self.registry.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> ImageStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def push(self, layout: Path, tag: str, name: str) -> str:
        """``skopeo copy oci:<layout>:<tag>`` to ``<host>/<name>:<tag>`` (plain HTTP); returns
        that reference."""
        ref = f"{self.host}/{name}:{tag}"
        _run(["skopeo", "--policy", str(self._tmp / "policy.json"), "copy", "--quiet", "--dest-tls-verify=false",
              f"oci:{layout}:{tag}", f"docker://{ref}"], timeout=1800)
        return ref

    def digest(self, ref: str) -> str:
        """The manifest digest (``sha256:<hex>``) the registry serves ``ref`` under: what a pod's
        ``status.containerStatuses[].imageID`` ends with once it runs."""
        r = _run(["skopeo", "--policy", str(self._tmp / "policy.json"), "inspect", "--tls-verify=false",
                  f"docker://{ref}"], timeout=120)
        return json.loads(r.stdout)["Digest"]

    def busybox(self) -> str:
        """A busybox image (Debian's busybox-static, one layer, ``sleep`` as its default
        command), made with umoci into the image cache once per busybox binary and pushed;
        returns its reference. It is also the node's sandbox (pause) image."""
        exe = Path(shutil.which("busybox") or "busybox").resolve()
        tag = hashlib.sha256(exe.read_bytes()).hexdigest()[:12]
        layout = IMAGE_CACHE / "busybox-oci"
        tags = subprocess.run(["umoci", "ls", "--layout", str(layout)], capture_output=True, text=True,
                              timeout=60).stdout.split() if (layout / "index.json").is_file() else []
        if tag not in tags:
            stage = self._tmp / "busybox"
            (stage / "bin").mkdir(parents=True)
            shutil.copy2(exe, stage / "bin" / "busybox")
            for applet in ("sh", "sleep", "cat", "ls", "wget", "nc", "echo", "true", "test", "ps", "kill", "mount"):
                (stage / "bin" / applet).symlink_to("busybox")
            for d in ("tmp", "proc", "sys", "dev", "etc"):
                (stage / d).mkdir()
            if not (layout / "index.json").is_file():
                _run(["umoci", "init", "--layout", str(layout)])
            _run(["umoci", "new", "--image", f"{layout}:{tag}"])
            _run(["umoci", "insert", "--image", f"{layout}:{tag}", str(stage), "/"])
            _run(["umoci", "config", "--image", f"{layout}:{tag}", "--config.cmd", "/bin/sleep",
                  "--config.cmd", "2147483647", "--config.env", "PATH=/bin"])
        return self.push(layout, tag, "warmctl/busybox")


class KubeNode(Processes):
    """containerd + kubelet registered as node ``name`` (an address of 127.0.0.0/8: also its
    InternalIP and where its kubelet listens) with ``cluster`` (which must serve the token of
    ``system:node:<name>``: :data:`NODE_NAME` and :data:`NODE2_NAME` are in every KubeCluster's
    static tokens), pulling from ``images``.

    The first node (:data:`NODE_NAME`) uses the host's file system as it is and puts its pods'
    cgroups under ``/kubepods``. Any other node is a second node on the same host: its own
    containerd (root, state, sockets) and kubelet (root directory, ports on its own address) as
    for the first, plus what a real second machine would have of its own and a second kubelet
    here would otherwise share with the first:

    - a **mount namespace** (held by a ``sleep`` process, child ``mntns``; containerd, the
      kubelet and the shims run in it) in which :data:`HOST_PATHS` are directories of the node's
      own (under ``workdir/host``), bind-mounted over the host's. Kubelet 1.20 writes those
      paths whatever its flags say, and two kubelets sharing them break each other: every
      minute a kubelet's container GC removes each ``/var/log/pods/<namespace>_<pod>_<uid>``
      whose pod it does not run (``evictPodLogsDirectories``: ``IsPodDeleted`` is true for a pod
      unknown to it), so the other node's running pods lose their logs (``kubectl logs`` fails);
      its device manager deletes everything in ``/var/lib/kubelet/device-plugins`` at start (the
      other kubelet's registration socket ``kubelet.sock`` and its allocation checkpoint) and
      listens on the same socket path. Propagation is ``slave``: the host's mounts are seen in
      the namespace, the node's mounts (volumes, overlays) never on the host, and they go with
      the namespace when the node stops.
    - a **cgroup root** of its own, ``/warmctl-node-<name>`` in every v1 hierarchy (the kubelet's
      ``cgroupRoot``), made before the kubelet starts (it refuses a root that does not exist):
      its pods under ``/warmctl-node-<name>/kubepods``, never in the first node's ``/kubepods``
      (with the cgroupfs driver two kubelets on one root would each manage, size and clean the
      other's QoS and pod cgroups).

    Attributes once started: ``name``, ``workdir``, ``sock`` (containerd's CRI socket),
    ``cgroup_root`` (``/`` or ``/warmctl-node-<name>``), ``own_host_paths`` (whether it has the
    mount namespace), ``start_s`` (seconds from spawning containerd to the node being Ready)."""

    def __init__(self, cluster: KubeCluster, workdir: Path, images: ImageStore, timeout: float = 120,
                 name: str = NODE_NAME):
        self.cluster, self.images, self.timeout = cluster, images, timeout
        self.workdir = Path(workdir)
        self.name = name
        self.own_host_paths = name != NODE_NAME
        self.cgroup_root = f"/warmctl-node-{name}" if self.own_host_paths else "/"
        self.procs: dict[str, subprocess.Popen] = {}
        self.sock = self.workdir / "containerd" / "containerd.sock"
        self.start_s = 0.0
        self._host_dirs: dict[Path, set[str] | None] = {}
        self._made_mountpoints: list[Path] = []
        self._made_cgroups: list[Path] = []

    # -- helpers -------------------------------------------------------------------------------
    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """``ctr --address <sock> --namespace k8s.io ARGS`` (the CRI's namespace)."""
        argv = ["ctr", "--address", str(self.sock), "--namespace", "k8s.io", *args]
        return _run(argv, timeout=timeout) if check else subprocess.run(argv, capture_output=True, text=True,
                                                                           timeout=timeout)

    def pod(self, namespace: str, name: str) -> dict | None:
        """The pod object, or None when it does not exist (any other error raises)."""
        st, body = self.cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        if st == 404:
            return None
        if st != 200:
            raise AssertionError(f"GET pod {namespace}/{name}: HTTP {st}: {body}")
        return body

    def wait_pod(self, namespace: str, name: str, cond: Callable[[dict | None], bool], timeout: float = 300,
                 what: str = "") -> dict | None:
        """Poll the pod (every 0.2 s) until ``cond(pod)`` is true (``pod`` None once deleted);
        returns that pod. AssertionError after ``timeout`` s with the pod's status and the
        kubelet's log tail."""
        deadline = time.monotonic() + timeout
        while True:
            pod = self.pod(namespace, name)
            if cond(pod):
                return pod
            if time.monotonic() > deadline:
                status = json.dumps((pod or {}).get("status"), indent=1)[-3000:]
                raise AssertionError(f"pod {namespace}/{name}: not {what or 'as expected'} within {timeout:.0f} s;"
                                     f" status: {status}{self.tails()}")
            time.sleep(0.2)

    def tails(self, lines: int = 25) -> str:
        """The last lines of containerd's and the kubelet's logs."""
        return super().tails(lines)

    def _spawn(self, name: str, argv: list[str], **popen: object) -> None:
        if self.own_host_paths and name != "mntns":
            argv = ["nsenter", f"--mount=/proc/{self.procs['mntns'].pid}/ns/mnt", "--", *argv]  # execs: same pid
        super()._spawn(name, argv, start_new_session=True, **popen)

    def _in_ns(self, *argv: str) -> list[str]:
        """``argv`` run in the node's mount namespace (as it is on the host for the first node)."""
        ns = self.procs.get("mntns")
        if not self.own_host_paths or ns is None or ns.poll() is not None:
            return list(argv)
        return ["nsenter", f"--mount=/proc/{ns.pid}/ns/mnt", "--", *argv]

    def _cgroup_dirs(self) -> list[Path]:
        """The node's cgroup root in every cgroup hierarchy mounted under /sys/fs/cgroup."""
        rel = self.cgroup_root.strip("/")
        return [ctrl / rel if rel else ctrl for ctrl in sorted(Path("/sys/fs/cgroup").iterdir())
                if (ctrl / "cgroup.procs").is_file()]

    def _own_filesystem(self, deadline: float) -> None:
        """A second node's mount namespace (its own :data:`HOST_PATHS`) and cgroup root."""
        binds = []
        for d in HOST_PATHS:
            mine = self.workdir / "host" / str(d).strip("/").replace("/", "-")
            mine.mkdir(parents=True, exist_ok=True)
            if not d.exists():  # a mount point on the host, removed again at stop when empty
                d.mkdir(parents=True)
                self._made_mountpoints.append(d)
            binds.append(f"mount --bind {mine} {d}")
        self._spawn("mntns", ["unshare", "--mount", "--propagation", "slave", "--", "/bin/sh", "-c",
                              "set -e; " + "; ".join(binds) + "; echo bound; exec sleep 2147483647"])
        self._wait("the node's mount namespace",
                   lambda: "bound" in (self.workdir / "log" / "mntns.log").read_text(), deadline, 0.05)
        for d in self._cgroup_dirs():
            if not d.is_dir():
                d.mkdir()
                self._made_cgroups.append(d)
                # a new cpuset cgroup has no CPUs nor memory nodes: give it its parent's
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if (d / f).is_file() and not (d / f).read_text().strip():
                        (d / f).write_text((d.parent / f).read_text())

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> KubeNode:
        """Start containerd and the kubelet; return once the node is Ready."""
        gone = missing()
        if gone:
            raise KubeStartError(gone)
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        w = self.workdir
        for d in ("log", "containerd", "cni", "kubelet", "runc"):
            (w / d).mkdir(parents=True, exist_ok=True)
        user = kubelet_user(self.name)
        if user not in kubecluster.USERS:
            raise KubeStartError(f"node {self.name}: the cluster has no token for {user} (kubecluster.USERS)")
        if self.own_host_paths:
            self._own_filesystem(deadline)
        else:
            # the host paths kubelet 1.20 and containerd's shims use whatever their flags say:
            # what is in them now, so that stop() removes only what this node added
            for d in HOST_PATHS:
                self._host_dirs[d] = set(os.listdir(d)) if d.is_dir() else None
        sandbox = self.images.busybox()
        (w / "cni" / "10-loopback.conflist").write_text(json.dumps(
            {"cniVersion": "0.4.0", "name": "warmctl-loopback", "plugins": [{"type": "loopback"}]}))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (w / "containerd" / "config.toml").write_text(f"""version = 2
root = "{w}/containerd/root"
state = "{w}/containerd/state"
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{w}/containerd/opt"
[{cri}]
  disable_tcp_service = true
  stream_server_address = "{self.name}"
  stream_server_port = "0"
  restrict_oom_score_adj = true
  sandbox_image = "{sandbox}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{w}/cni"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
  [{cri}.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [{cri}.containerd.runtimes.runc.options]
    Root = "{w}/runc"
    SystemdCgroup = false
  [{cri}.registry.mirrors."{self.images.host}"]
    endpoint = ["http://{self.images.host}"]
""")
        self._spawn("containerd", ["containerd", "--config", str(w / "containerd" / "config.toml"), "--log-level", "warn"])
        self._wait("containerd", lambda: self.ctr("version", check=False, timeout=5).returncode == 0, deadline, 0.2)

        port, healthz = free_port(self.name), free_port(self.name)
        kubeconfig = self.cluster.kubeconfig(w / "kubelet.kubeconfig", user)
        (w / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.name, "port": port, "readOnlyPort": 0,
            "healthzBindAddress": self.name, "healthzPort": healthz,
            **({"cgroupRoot": self.cgroup_root} if self.own_host_paths else {}),
            "cgroupDriver": "cgroupfs", "makeIPTablesUtilChains": False, "failSwapOn": False,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "syncFrequency": "5s", "nodeStatusUpdateFrequency": "5s",
            "fileCheckFrequency": "5s", "runtimeRequestTimeout": "15m",
        }))
        self._spawn("kubelet", [
            str(kubecluster.bin_dir() / "kubelet"), f"--config={w / 'kubelet.yaml'}", f"--kubeconfig={kubeconfig}",
            "--container-runtime=remote", f"--container-runtime-endpoint=unix://{self.sock}",
            f"--root-dir={w / 'kubelet'}", f"--cert-dir={w / 'kubelet' / 'pki'}",
            f"--hostname-override={self.name}", "--register-node=true", "--v=1",
        ])

        def ready() -> bool:
            st, node = self.cluster.request("GET", f"/api/v1/nodes/{self.name}", timeout=5)
            if st != 200:
                return False
            conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            return conds.get("Ready") == "True"
        self._wait(f"node {self.name} Ready", ready, deadline, 0.2)
        st, node = self.cluster.request("GET", f"/api/v1/nodes/{self.name}")
        addrs = {a["type"]: a["address"] for a in node["status"].get("addresses", [])}
        if addrs.get("InternalIP") != self.name:
            raise KubeStartError(f"node {self.name}: InternalIP is {addrs.get('InternalIP')!r}, not {self.name}"
                                 f"{self.tails()}")
        # the node lifecycle controller's part (the test cluster runs none: its API-only nodes have
        # no kubelet): a Ready node loses the not-ready taint it registered with, so that the
        # scheduler binds pods to it
        taints = [t for t in node["spec"].get("taints", []) if t.get("key") != "node.kubernetes.io/not-ready"]
        if taints != node["spec"].get("taints", []):
            st, body = self.cluster.request("PATCH", f"/api/v1/nodes/{self.name}", {"spec": {"taints": taints or None}},
                                            content_type="application/merge-patch+json")
            if st != 200:
                raise KubeStartError(f"node {self.name}: removing its not-ready taint: HTTP {st}: {body}")
        self.start_s = time.monotonic() - t0
        return self

    def leftovers(self) -> list[str]:
        """What of this node's pods remains: containerd tasks and sandboxes (while containerd
        runs), mounts under the working directory (in the node's mount namespace, for a second
        node), and processes in this node's pod cgroups (under ``<cgroup_root>/kubepods``: the
        other node's pods are not this node's leftovers)."""
        out = []
        if "containerd" in self.procs and self.procs["containerd"].poll() is None:
            r = self.ctr("tasks", "ls", "-q", check=False)
            out += [f"containerd task {t}" for t in r.stdout.split()]
        # the kubelet bind-mounts its root directory onto itself (a shared mount): the node's, not a pod's
        own = str((self.workdir / "kubelet").resolve())
        out += [f"mount {m}" for m in self._mounts() if m != own]
        pods = self.cgroup_root.rstrip("/") + "/kubepods"
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    paths = [ln.split(":", 2)[2] for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines()]
                    if any(p == pods or p.startswith(pods + "/") for p in paths):
                        out.append(f"process {pid} ({Path(f'/proc/{pid}/comm').read_text().strip()}) in a pod "
                                   f"cgroup of node {self.name}")
                except (OSError, IndexError):
                    pass
        return out

    def _mounts(self) -> list[str]:
        """Mount points under the working directory, as the node's processes see them."""
        w = str(self.workdir.resolve())
        ns = self.procs.get("mntns")
        info = Path(f"/proc/{ns.pid}/mountinfo") if ns is not None and ns.poll() is None else Path("/proc/self/mountinfo")
        mounts = []
        try:
            text = info.read_text()
        except OSError:
            return []
        for line in text.splitlines():
            mp = line.split()[4].replace("\\040", " ")
            if mp == w or mp.startswith(w + "/"):
                mounts.append(mp)
        return mounts

    def _remove_host_paths(self) -> None:
        for d, before in self._host_dirs.items():
            if before is None:
                shutil.rmtree(d, ignore_errors=True)
            elif d.is_dir():
                for entry in set(os.listdir(d)) - before:
                    p = d / entry
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)

    def stop(self) -> None:
        """Delete the node's pods, stop the kubelet, kill every container left, stop containerd
        and its shims, unmount, remove the pods' cgroups and the working directory."""
        if self.procs.get("kubelet") and self.procs["kubelet"].poll() is None:
            st, pods = self.cluster.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.name}")
            for p in pods.get("items", []) if st == 200 else []:
                md = p["metadata"]
                self.cluster.request("DELETE", f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}",
                                     body={"gracePeriodSeconds": 5})
            end = time.monotonic() + 60
            while time.monotonic() < end:
                st, pods = self.cluster.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.name}")
                if st != 200 or not pods.get("items"):
                    break
                time.sleep(0.5)
        self._terminate("kubelet", 15)
        if self.procs.get("containerd") and self.procs["containerd"].poll() is None:
            for t in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                self.ctr("tasks", "kill", "--all", "--signal", "SIGKILL", t, check=False)
            time.sleep(0.5)
            for t in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                self.ctr("tasks", "delete", "--force", t, check=False)
            for c in self.ctr("containers", "ls", "-q", check=False).stdout.split():
                self.ctr("containers", "delete", c, check=False)
        self._terminate("containerd", 15)
        # the shims started for this containerd (their command line names its socket): they
        # outlive containerd by design
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and str(self.sock).encode() in cmd:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for mp in reversed(self._mounts()):
            subprocess.run(self._in_ns("umount", "--lazy", mp), capture_output=True)
        # a second node's namespace goes with its holder (its bind mounts with it)
        self._terminate("mntns", 5)
        for root in self._cgroup_dirs():
            base = root / "kubepods"
            if base.is_dir():
                for d in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    try:
                        d.rmdir()
                    except OSError:
                        pass
                try:
                    base.rmdir()
                except OSError:
                    pass
        for d in reversed(self._made_cgroups):
            try:
                d.rmdir()
            except OSError:
                pass
        for d in reversed(self._made_mountpoints):
            try:
                d.rmdir()  # only when empty: the first node may have written there since
            except OSError:
                pass
        self._remove_host_paths()
        if os.environ.get("WARMCTL_TEST_KEEP_TMP") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)


__all__ = ["ADMIN", "ImageStore", "KubeNode", "KUBELET_USER", "NODE2_NAME", "NODE_NAME", "OPT_IN", "kubelet_user",
           "missing"]
