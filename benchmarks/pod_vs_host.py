"""A restore pod on a warm node against the same ``warmctl up`` on the host, side by side, for an
engine of a chosen size (docs/kubernetes.md's aim: within 1.2x).

One run, on a real Kubernetes on loopback (tests/kubecluster.py: etcd, kube-apiserver and the
controller-manager v1.20.2; tests/kubenode.py: one node, containerd + runc + kubelet; the
project's image from deploy/image/build.sh pushed to a loopback registry):

1. a node store (a host directory every pod mounts at ``/var/lib/warmctl``, as the shipped
   workloads mount the node's) with ``--profile``'s profile on this run's ports; for ``8g`` the
   random-weight model built into it first (warmctl/models/randmodel.py, 6 GiB);
2. ``warmctl snapshot NAME`` in a pod on the node (the snapshot Job's command): the node holds
   the snapshot, made in the image, and the digests of the image's files the engine maps;
3. a host home with the same profile and model (hard links), and ``warmctl snapshot NAME`` on the
   host (a snapshot made in the image restores only in pods of that image, and the host's in
   none);
4. ``--rounds`` times, the two sides in an order that alternates each round (each side
   ``--repeat`` times in a row, the last run its figure: a run right after the other side's
   finds the page cache holding the other side's store and image, which on a real node do not
   exist), each with its kept image removed first (so both write the image from the store, as the first restore on a
   pre-warmed node does) and ``sync`` run: a restore pod (``up NAME --foreground --cold-start
   never`` as the ``warmctl-engine`` service account, readiness on the gate's ``/health`` every
   second, as deploy/kubernetes/engine-deployment.yaml had it before ``--ready-port``), timed from its creation to Ready, then
   deleted; and ``warmctl up NAME --json --cold-start never`` on the host, timed from the
   command's start to its exit (the port open, the canary passed), then ``down``. With
   ``--ready-probe``, a third side: the same restore pod probed as deploy/kubernetes ships it,
   on the supervisor's ``/ready?wait=8`` (``--ready-port``: held until the port opens).

Prints each round, the medians, the pod/host ratio of the medians, and where a pod's seconds
went (to its first log line, ``up``'s own phases, the rest: the probe's period and the status
write). Everything it made (cluster, node, homes) is removed at the end unless ``--keep``; the
built model stays in ``--models`` when given (a later run reuses it).

Usage::

    python benchmarks/pod_vs_host.py [--profile tiny|8g] [--rounds 3] [--repeat 1] [--ready-probe] [--models DIR] [--work DIR] [--keep] [--json OUT]

Needs root, ``WARMCTL_KUBE_WITH_KUBELET=1 scripts/install-kubernetes.sh`` and the engine image's
base (``deploy/image/build.sh``, about 10 minutes the first time). Nothing else may use the
engine ports (``--engine-port``, ``--gate-port``) meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

WARMCTL = [sys.executable, "-m", "warmctl"]
#: --profile -> the profile file under benchmarks/profiles (None: tests/conftest.py's tiny)
PROFILES = {"tiny": None, "8g": "scale-8g"}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def profile(size: str, engine_port: int, gate_port: int) -> tuple[str, str]:
    """(profile name, its TOML on the given ports)."""
    from conftest import tiny_profile

    if PROFILES[size] is None:
        return "tiny", tiny_profile(engine_port, gate_port)
    name = PROFILES[size]
    text = (ROOT / "benchmarks" / "profiles" / f"{name}.toml").read_text()
    text = re.sub(r"(?m)^port = 18000", f"port = {engine_port}", text)
    return name, re.sub(r"(?m)^port = 8000", f"port = {gate_port}", text)


def home(d: Path, name: str, text: str, home_dir: Path) -> Path:
    """A warmctl config in ``d`` (profile ``name`` = ``text``, home ``home_dir``, keys in
    ``d/keys``); returns the config file."""
    (d / "profiles").mkdir(parents=True, exist_ok=True)
    (d / "profiles" / f"{name}.toml").write_text(text)
    (d / "keys").mkdir(exist_ok=True)
    (d / "config.toml").write_text(f'home = "{home_dir}"\nprofile_dirs = ["{home_dir.parent / "profiles"}"]\n'
                                   f'keys_dir = "{home_dir.parent / "keys"}"\n')
    return d / "config.toml"


def build_model(size: str, models: Path) -> None:
    """The profile's built-in model built into ``models`` (kept there: a later run reuses it)."""
    if PROFILES[size] is None:
        return
    import tomllib

    from warmctl.models.builtinmodels import build_builtin

    model = tomllib.loads((ROOT / "benchmarks" / "profiles" / f"{PROFILES[size]}.toml").read_text())["engine"]["model"]
    t0 = time.monotonic()
    build_builtin(model, models)
    print(f"model {model} in {models} ({time.monotonic() - t0:.1f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each side in a row per round; the last is the figure (default 1)")
    ap.add_argument("--models", type=Path, help="where the built model is kept between runs (default: in --work)")
    ap.add_argument("--work", type=Path, help="working directory (default: a new one under /var/tmp)")
    ap.add_argument("--engine-port", type=int, default=18700)
    ap.add_argument("--gate-port", type=int, default=18780)
    ap.add_argument("--ready-probe", action="store_true",
                    help="a third side: the restore pod probed on the supervisor's held /ready (--ready-port, as "
                         "deploy/kubernetes ships it) instead of the gate's /health")
    ap.add_argument("--keep", action="store_true", help="leave the working directory")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (CRIU, the kubelet)")
    work = a.work or Path(tempfile.mkdtemp(prefix="warmctl-podbench-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"start: {uptime()}; work {work}", flush=True)
    try:
        res = run(a, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"end: {uptime()}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


def run(a, work: Path) -> dict:
    from kubecluster import KubeCluster
    from kubenode import ImageStore, KubeNode
    from test_kube_pods import _create, _delete, _engine_pids
    from test_kube_pods_fleet import STORE, _fleet_pod, _finished, _restore_pod, _terminated, _wait_token

    name, text = profile(a.profile, a.engine_port, a.gate_port)
    models = a.models or work / "models"
    with KubeCluster() as cluster, ImageStore() as images:
        cluster.start_controllers()
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(ROOT / "deploy" / "image" / "build.sh")], capture_output=True, text=True,
                           timeout=3600)
        if r.returncode != 0:
            sys.exit(f"deploy/image/build.sh exited {r.returncode}:\n{r.stderr[-4000:]}")
        layout, tag = r.stdout.split()[-2:]
        ref = images.push(Path(layout), tag, "warmctl/engine")
        image = (ref, images.digest(ref))
        print(f"engine image {ref}@{image[1]} in {time.monotonic() - t0:.1f} s", flush=True)
        for f in ("namespace.yaml", "serviceaccounts.yaml", "rbac.yaml"):
            cluster.kubectl("apply", "-f", str(ROOT / "deploy" / "kubernetes" / f), check=True)
        _wait_token(cluster, "warmctl-engine")
        with KubeNode(cluster, work / "node", images) as node:
            # 1. the node store, the model in it
            store = node.workdir / "share" / "bench"
            home(store, name, text, STORE / "home")
            build_model(a.profile, models)
            if PROFILES[a.profile] is not None:
                (store / "home").mkdir(parents=True, exist_ok=True)
                subprocess.run(["cp", "-al", str(models), str(store / "home" / "models")], check=True)
            # 2. the snapshot, made in a pod on the node
            snap = f"snap-{uuid.uuid4().hex[:6]}"
            t0 = time.monotonic()
            pod = _fleet_pod(snap, image, work, store, node.name, a.gate_port, ["snapshot", name], {})
            del pod["spec"]["containers"][0]["readinessProbe"]
            _create(node, pod)
            pod = node.wait_pod("default", snap, _finished, timeout=3600, what="finished")
            logs = cluster.kubectl("logs", "-n", "default", snap).stdout
            if pod["status"]["phase"] != "Succeeded":
                sys.exit(f"snapshot pod {_terminated(pod)}\n{logs[-4000:]}")
            snap_s = time.monotonic() - t0
            print(f"snapshot pod: {snap_s:.1f} s", flush=True)
            _delete(node, "default", snap, grace=30)
            node.wait_pod("default", snap, lambda p: p is None, timeout=90, what="deleted")
            # 3. the host's home and snapshot
            hroot = work / "host"
            cfg = home(hroot, name, text, hroot / "home")
            if PROFILES[a.profile] is not None:
                (hroot / "home").mkdir(parents=True, exist_ok=True)
                subprocess.run(["cp", "-al", str(models), str(hroot / "home" / "models")], check=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
            env["WARMCTL_CONFIG"] = str(cfg)

            def warmctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
                r = subprocess.run([*WARMCTL, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
                if check and r.returncode != 0:
                    sys.exit(f"warmctl {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}")
                return r
            t0 = time.monotonic()
            warmctl("snapshot", name)
            print(f"host snapshot: {time.monotonic() - t0:.1f} s", flush=True)
            warmctl("down", name, check=False)

            def pod_side(ready_port: int | None = None) -> dict:
                shutil.rmtree(store / "home" / "cache" / "images", ignore_errors=True)
                subprocess.run(["sync"], check=True)
                up = f"up-{uuid.uuid4().hex[:6]}"
                ready_s, cond, split, _, logs = _restore_pod(node, up, image, work, store, a.gate_port, None,
                                                             profile=name, ready_port=ready_port)
                _delete(node, "warmctl", up, grace=60)
                node.wait_pod("warmctl", up, lambda p: p is None, timeout=120, what="deleted")
                return {"seconds": ready_s, "split": split, "hashed": "required files:" in logs}

            def host_side() -> dict:
                shutil.rmtree(hroot / "home" / "cache" / "images", ignore_errors=True)
                subprocess.run(["sync"], check=True)
                t0 = time.monotonic()
                r = warmctl("up", name, "--json", "--cold-start", "never")
                s = time.monotonic() - t0
                warmctl("down", name)
                t = json.loads(r.stdout).get("timings", {})
                return {"seconds": s, "split": ", ".join(f"{k} {v:.2f}" for k, v in t.items())}

            rounds = []
            try:
                for i in range(a.rounds):
                    sides = [("pod", pod_side), ("host", host_side)]
                    if a.ready_probe:
                        sides.insert(1, ("pod-ready", lambda: pod_side(a.gate_port + 10)))
                    row: dict = {}
                    k0 = i % len(sides)  # each side first in turn
                    for k, fn in sides[k0:] + sides[:k0]:
                        runs = [fn() for _ in range(a.repeat)]
                        row[k] = runs[-1]
                        row[k]["after_switch_s"] = runs[0]["seconds"]
                    row["ratio"] = row["pod"]["seconds"] / row["host"]["seconds"]
                    if a.ready_probe:
                        row["ratio_ready"] = row["pod-ready"]["seconds"] / row["host"]["seconds"]
                    rounds.append(row)
                    pods = [k for k, _ in sides if k != "host"]
                    first = "" if a.repeat == 1 else (f" (the first of {a.repeat} in a row: " + ", ".join(
                        f"{k} {row[k]['after_switch_s']:.2f} s" for k, _ in sides) + ")")
                    print(f"round {i}: " + ", ".join(f"{k} {row[k]['seconds']:.2f} s" for k, _ in sides)
                          + ", " + ", ".join(f"{k}/host {row[k]['seconds'] / row['host']['seconds']:.2f}x" for k in pods)
                          + first + "".join(f"\n  {k}: {row[k]['split']}"
                                            f"{' (hashed required files)' if row[k]['hashed'] else ''}" for k in pods)
                          + f"\n  host: {row['host']['split']}", flush=True)
            finally:
                warmctl("down", name, check=False)  # the host's engine, if a round stopped half-way
            assert _engine_pids() == [], "an engine process left in a pod cgroup"
    pod_m = statistics.median(r["pod"]["seconds"] for r in rounds)
    host_m = statistics.median(r["host"]["seconds"] for r in rounds)
    print(f"\n{name}: restore pod on the warm node, created -> Ready, median {pod_m:.2f} s; host `up` median "
          f"{host_m:.2f} s; pod/host {pod_m / host_m:.2f}x (rounds: "
          + ", ".join(f"{r['ratio']:.2f}x" for r in rounds) + ")")
    out = {"profile": name, "snapshot_pod_s": snap_s, "rounds": rounds, "pod_median_s": pod_m,
           "host_median_s": host_m, "ratio": pod_m / host_m}
    if a.ready_probe:
        ready_m = statistics.median(r["pod-ready"]["seconds"] for r in rounds)
        print(f"{name}: the same pod probed on the supervisor's /ready (--ready-port), median {ready_m:.2f} s; "
              f"pod/host {ready_m / host_m:.2f}x (rounds: " + ", ".join(f"{r['ratio_ready']:.2f}x" for r in rounds) + ")")
        out.update(pod_ready_median_s=ready_m, ratio_ready=ready_m / host_m)
    return out


if __name__ == "__main__":
    main()
