"""``warmctl up NAME --foreground`` told it is a pod (the downward API's variables) keeps that
pod's ``warmctl.io/Restored`` condition, against a real API server (tests/kubecluster.py: etcd
+ kube-apiserver v1.20.2, Node+RBAC; no kubelet: the Pod object stays Pending, its status is
patched all the same).

The supervisor acts as the engine's service account (its kubeconfig: the static token of
``system:serviceaccount:warmctl:warmctl-engine``, under deploy/kubernetes/rbac.yaml's Role);
every change of the condition is recorded by a watch on the pod (admin), in order, with the
moment it arrived. The engine is the fake one (tests/fake_vllm.py, restored by the real CRIU in
about a second): what is tested is the condition, the termination message, the exit codes and
what the readiness probe asks (the gate's ``/health``), not the engine.

- a restore walks Resolving -> Pulling -> Restoring -> CanaryRunning -> Serving (True); the
  public port is shut (so ``/health`` does not answer) while the canary is held, and open when
  Serving arrives; the supervisor's readiness endpoint (``--ready-port``, warmctl.kube.readiness)
  answers 503 while the canary is held and holds a probe with ``?wait=`` until the public port
  opens, then answers 200 within 0.5 s of the opening; SIGTERM: Draining, during which the
  public port refuses new connections while the engine still runs (a request in flight is
  drained) and the readiness endpoint answers 503, then Stopped, exit 0;
- SIGTERM while ``up`` runs: Stopped, exit 143, nothing left; the engine killed while served:
  EngineDied, the termination message, exit 7;
- a corrupt chunk: Refused with the chunk named, the one-line error in the termination message
  file, exit 20, nothing left behind;
- a snapshot made outside a container image, restored in a pod whose image digest is set:
  Refused, ImageMismatch (exit 42) naming both digests;
- without the API server: a snapshot made with ``image_digest`` set restores only where the same
  digest is set; the failure reasons follow the error classes; the termination message's shape;
- the engine's service account cannot patch a pod of another namespace: the supervisor says so
  once and serves all the same (the condition is never what makes or fails ``up``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import fake_env, listening, shm_names, snapshot_once, wait_until, warmctl
from tests.ports import free_port
from tests.test_agent_e2e import _engine_procs

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "kubernetes"
COND = "warmctl.io/Restored"
NS = "warmctl"
ENGINE = "system:serviceaccount:warmctl:warmctl-engine"


@pytest.fixture(scope="module")
def kube(kube_api):
    """The namespace, service accounts and RBAC of deploy/kubernetes applied (as admin)."""
    kube_api.kubectl("apply", *(f"-f={DEPLOY / f}" for f in ("namespace.yaml", "serviceaccounts.yaml", "rbac.yaml")),
                     check=True)
    return kube_api


class Pod:
    """A Pod object (never run: no kubelet) and a watch recording every change of its
    ``warmctl.io/Restored`` condition: ``changes`` holds (monotonic time, status, reason,
    message, whether the public port ``gate`` listened when the change arrived)."""

    def __init__(self, k, ns: str, sa: str, gate: int):
        self.k, self.ns, self.gate = k, ns, gate
        self.name = f"engine-{uuid.uuid4().hex[:8]}"
        self.changes: list[tuple[float, str, str, str, bool]] = []
        self._stop = threading.Event()
        # no token mounted: no controller-manager runs to make the service account's token secret
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": self.name, "namespace": ns},
               "spec": {"serviceAccountName": sa, "automountServiceAccountToken": False,
                        "containers": [{"name": "engine", "image": "warmctl:dev"}]}}
        st, body = k.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
        assert st == 201, body
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        url = (f"{self.k.server}/api/v1/namespaces/{self.ns}/pods?watch=1"
               f"&fieldSelector=metadata.name%3D{self.name}")
        last = None
        with httpx.Client(verify=ssl.create_default_context(cafile=str(self.k.ca_file)), timeout=httpx.Timeout(10, read=None),
                          headers={"Authorization": f"Bearer {self.k.token('admin')}"}) as h, \
                h.stream("GET", url) as r:
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                obj = json.loads(line)["object"]
                c = next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == COND), None)
                if c is None:
                    continue
                cur = (c["status"], c.get("reason", ""), c.get("message", ""))
                if cur != last:
                    self.changes.append((time.monotonic(), *cur, listening(self.gate, 0.2)))
                    last = cur

    def reasons(self) -> list[str]:
        """The reasons in the order they came, each once per run of it."""
        out: list[str] = []
        for _, _, reason, _, _ in self.changes:
            if not out or out[-1] != reason:
                out.append(reason)
        return out

    def wait_reason(self, reason: str, timeout_s: float = 60) -> tuple:
        assert wait_until(lambda: any(c[2] == reason for c in self.changes), timeout_s), self.changes
        return next(c for c in self.changes if c[2] == reason)

    def conditions(self) -> list[dict]:
        st, body = self.k.request("GET", f"/api/v1/namespaces/{self.ns}/pods/{self.name}")
        assert st == 200, body
        return body["status"].get("conditions") or []

    def delete(self) -> None:
        self._stop.set()
        self.k.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{self.name}")


def _pod_env(env: dict[str, str], k, pod: Pod, tmp_path: Path, **extra: str) -> dict[str, str]:
    """``env`` plus what the manifests' downward API sets, a kubeconfig of the engine's service
    account, and a termination message file under ``tmp_path``."""
    return {**env, "WARMCTL_POD_NAME": pod.name, "WARMCTL_POD_NAMESPACE": pod.ns,
            "WARMCTL_KUBECONFIG": str(k.kubeconfig(tmp_path / "engine.kubeconfig", user=ENGINE)),
            "WARMCTL_TERMINATION_MESSAGE_PATH": str(tmp_path / "termination-log"), **extra}


def _foreground(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "warmctl", "up", "fake", "--foreground", *args], env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT)


def _public_health(port: int) -> int | None:
    """HTTP status of the gate's ``/health`` (what the readiness probe asks), None when the
    port refuses the connection."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def _ready(port: int, wait_s: float) -> tuple[int, str]:
    """(status, body) of the supervisor's ``GET /ready?wait=wait_s`` (``--ready-port``)."""
    r = httpx.get(f"http://127.0.0.1:{port}/ready?wait={wait_s}", timeout=wait_s + 10)
    return r.status_code, r.text.strip()


def _watch_open(port: int) -> Future:
    """A future of the moment (``time.monotonic()``) 127.0.0.1:``port`` first accepts a
    connection, looked for every 10 ms."""
    fut: Future = Future()

    def look() -> None:
        while not listening(port, 0.05):
            time.sleep(0.01)
        fut.set_result(time.monotonic())

    threading.Thread(target=look, daemon=True).start()
    return fut


def test_restore_walks_the_condition_and_sigterm_drains(kube, fk_env, fake_snapshot, fake_ports, fake_clean, tmp_path):
    gate = fake_ports[1]
    hold = Path(fk_env["WARMCTL_TEST_HOME"]).parent / "hold"  # fake_env's: holds the canary's answers
    pod = Pod(kube, NS, "warmctl-engine", gate)
    env = _pod_env(fk_env, kube, pod, tmp_path)
    log = tmp_path / "fg.log"
    ready_port = free_port()
    hold.touch()
    p = _foreground(env, log, "--ready-port", str(ready_port))
    req = None
    try:
        canary = pod.wait_reason("CanaryRunning", 120)
        # the canary is held: the public port is not open, the readiness probe gets no answer,
        # and the readiness endpoint answers 503 (at once without ?wait)
        time.sleep(0.5)
        assert not canary[4] and _public_health(gate) is None, (pod.changes, log.read_text())
        assert pod.changes[-1][2] == "CanaryRunning"
        assert _ready(ready_port, 0) == (503, "not ready: up has not opened the public port yet")
        # a probe held with ?wait=30 is answered 200 as the public port opens, not a period later
        held: dict = {}
        prober = threading.Thread(target=lambda: held.update(answer=_ready(ready_port, 30), t=time.monotonic()))
        prober.start()
        time.sleep(0.3)
        assert prober.is_alive(), held  # held while the canary is
        opened = _watch_open(gate)
        hold.unlink()
        prober.join(60)
        assert held["answer"] == (200, "serving"), held
        assert abs(held["t"] - opened.result(60)) < 0.5, (held, opened.result())
        serving = pod.wait_reason("Serving", 60)
        assert serving[1] == "True" and serving[4], pod.changes  # the port was open when Serving came
        assert _public_health(gate) == 200
        assert pod.reasons()[:5] == ["Resolving", "Pulling", "Restoring", "CanaryRunning", "Serving"], pod.changes
        assert all(c[1] == "False" for c in pod.changes if c[2] != "Serving"), pod.changes
        assert wait_until(lambda: fake_snapshot["digest"] in pod.changes[-1][3], 10), pod.changes
        last = pod.changes[-1][3]
        assert "restored" in last and "from the remote store" in last and "canary" in last, last
        # the kubelet's own conditions would be kept: the patch merged by type
        assert [c["type"] for c in pod.conditions()].count(COND) == 1
        # the patches come from a child process in a session of its own (lightkube is imported there)
        senders = [c for c in psutil.Process(p.pid).children() if "warmctl.kube.conditions" in c.cmdline()]
        assert len(senders) == 1 and os.getsid(senders[0].pid) != os.getsid(p.pid), senders
        print("\ncondition walk:\n" + "\n".join(f"  {c[0] - pod.changes[0][0]:.2f} s {c[1]} {c[2]}: {c[3]}" for c in pod.changes))

        # SIGTERM with a request in flight: the gate drains it and shuts the port for new ones
        # while the engine still runs, so the readiness probe fails before the engine goes
        hold.touch()
        body = {"model": "fake", "prompt": "The capital of France is", "max_tokens": 4, "logprobs": 1}
        result: dict = {}

        def call() -> None:
            r = httpx.post(f"http://127.0.0.1:{gate}/v1/completions", json=body, timeout=60)
            result["status"] = r.status_code
        req = threading.Thread(target=call)
        req.start()
        time.sleep(0.5)  # the request is in the engine, held
        root = json.loads(warmctl("status", "--json", env=fk_env).stdout)[0]["root_pid"]
        p.send_signal(signal.SIGTERM)
        pod.wait_reason("Draining", 30)
        assert wait_until(lambda: _public_health(gate) is None, 10)
        assert _ready(ready_port, 0)[0] == 503  # what the gate's /health says: not ready while draining
        assert Path(f"/proc/{root}").exists(), "the engine went before the port shut"
        hold.unlink()
        req.join(60)
        assert result.get("status") == 200, result  # the request in flight was answered
        assert p.wait(120) == 0, log.read_text()
        stopped = pod.wait_reason("Stopped", 10)
        assert stopped[1] == "False" and "drained" in stopped[3], pod.changes
        assert pod.reasons()[-2:] == ["Draining", "Stopped"]
        assert not senders[0].is_running()  # it ended with the supervisor, its last patch sent
        assert json.loads(warmctl("status", "--json", env=fk_env).stdout) == []
        assert not (tmp_path / "termination-log").exists()  # only a failure writes one
    finally:
        hold.unlink(missing_ok=True)
        if p.poll() is None:
            p.kill()
            p.wait()
        if req is not None:
            req.join(60)
        pod.delete()



def test_stop_during_up_and_a_dead_engine_set_final_reasons(kube, fk_env, fake_snapshot, fake_ports, fake_clean, tmp_path):
    gate = fake_ports[1]
    hold = Path(fk_env["WARMCTL_TEST_HOME"]).parent / "hold"
    home = Path(fk_env["WARMCTL_TEST_HOME"])
    pod = Pod(kube, NS, "warmctl-engine", gate)
    env = _pod_env(fk_env, kube, pod, tmp_path)
    log = tmp_path / "fg.log"
    term = tmp_path / "termination-log"
    procs = []
    try:
        # SIGTERM while up runs (the canary held): what it started is torn down, Stopped, 128+15
        hold.touch()
        procs.append(p := _foreground(env, log))
        pod.wait_reason("CanaryRunning", 120)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 128 + signal.SIGTERM, log.read_text()
        stopped = pod.wait_reason("Stopped", 10)
        assert "while bringing fake up" in stopped[3], pod.changes
        assert json.loads(warmctl("status", "--json", env=fk_env).stdout) == [] and not _engine_procs(home)
        assert not term.exists()
        hold.unlink()

        # the engine killed while served: torn down, EngineDied, the termination message, exit 7
        n = len(pod.changes)
        procs.append(p := _foreground(env, log))
        assert wait_until(lambda: any(c[2] == "Serving" for c in pod.changes[n:]), 120), (pod.changes, log.read_text())
        root = json.loads(warmctl("status", "--json", env=fk_env).stdout)[0]["root_pid"]
        os.kill(root, signal.SIGKILL)
        assert p.wait(60) == 7, log.read_text()
        assert wait_until(lambda: pod.changes[-1][2] == "EngineDied", 10), pod.changes
        assert pod.changes[-1][1] == "False" and "its process tree died" in pod.changes[-1][3]
        text = term.read_text()
        assert text.startswith("engine fake died: its process tree died") and text.endswith("(exit 7)\n"), text
        assert json.loads(warmctl("status", "--json", env=fk_env).stdout) == []
    finally:
        hold.unlink(missing_ok=True)
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
        pod.delete()


@pytest.fixture
def corrupt_env(tmp_path, engine_ports, fake_ports):
    """A home of its own with a fresh ``fake`` snapshot whose images are not cached (every
    ``up`` reads the chunks)."""
    env = fake_env(tmp_path / "corrupt", *engine_ports)
    env["WARMCTL_IMAGE_CACHE_BYTES"] = "0"
    snap = snapshot_once(env, "fake")
    shutil.rmtree(Path(env["WARMCTL_TEST_HOME"]) / "cache" / "images", ignore_errors=True)
    yield env, snap
    warmctl("down", "fake", env=env, check=False)


def test_corrupt_chunk_ends_refused_naming_it(kube, corrupt_env, fake_ports, tmp_path):
    env, snap = corrupt_env
    home = Path(env["WARMCTL_TEST_HOME"])
    chunks = sorted((p for p in (home / "store" / "chunks").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    assert chunks, list(home.rglob("*"))[:20]
    victim = chunks[-1]  # the largest: surely read by the restore
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.chmod(0o644)
    victim.write_bytes(bytes(data))
    pod = Pod(kube, NS, "warmctl-engine", fake_ports[1])
    penv = _pod_env(env, kube, pod, tmp_path)
    log = tmp_path / "fg.log"
    shm = shm_names()
    try:
        p = _foreground(penv, log, "--cold-start", "never")
        assert p.wait(120) == 20, log.read_text()
        refused = pod.wait_reason("Refused", 10)
        assert refused[1] == "False" and victim.name in refused[3] and "ChunkCorrupt (exit 20)" in refused[3], pod.changes
        assert "Serving" not in pod.reasons()
        term = (tmp_path / "termination-log").read_text()
        assert term.count("\n") == 1 and term.startswith("ChunkCorrupt (exit 20): ") and victim.name in term, term
        # nothing left: no engine, no record, no shared memory
        assert json.loads(warmctl("status", "--json", env=env).stdout) == []
        assert not _engine_procs(home)
        assert not {n for n in shm_names() - shm if n.startswith("fake_vllm")}
        assert not listening(fake_ports[1])
    finally:
        pod.delete()


def test_snapshot_of_another_image_is_refused(kube, fk_env, fake_snapshot, fake_ports, fake_clean, tmp_path):
    pod = Pod(kube, NS, "warmctl-engine", fake_ports[1])
    digest = "sha256:" + "bb" * 32
    env = _pod_env(fk_env, kube, pod, tmp_path, WARMCTL_IMAGE_DIGEST=digest)
    log = tmp_path / "fg.log"
    try:
        p = _foreground(env, log, "--cold-start", "never")
        assert p.wait(120) == 42, log.read_text()
        refused = pod.wait_reason("Refused", 10)
        assert "ImageMismatch (exit 42)" in refused[3] and digest in refused[3], refused
        term = (tmp_path / "termination-log").read_text()
        assert "made outside a container image" in term and digest in term, term
        assert pod.reasons() == ["Resolving", "Refused"], pod.changes
    finally:
        pod.delete()


def test_engine_account_cannot_patch_another_namespace(kube, fk_env, fake_snapshot, fake_ports, fake_clean, tmp_path):
    sa = f"other-{uuid.uuid4().hex[:8]}"
    st, body = kube.request("POST", "/api/v1/namespaces/default/serviceaccounts",
                            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
    assert st == 201, body
    pod = Pod(kube, "default", sa, fake_ports[1])
    env = _pod_env(fk_env, kube, pod, tmp_path)
    log = tmp_path / "fg.log"
    p = _foreground(env, log)
    try:
        assert wait_until(lambda: _public_health(fake_ports[1]) == 200, 120), log.read_text()
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0, log.read_text()
        text = log.read_text()
        assert text.count(f"cannot set the pod condition {COND}") == 1, text
        assert "forbidden" in text.lower(), text
        assert not any(c["type"] == COND for c in pod.conditions())
        assert pod.changes == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        pod.delete()
        kube.request("DELETE", f"/api/v1/namespaces/default/serviceaccounts/{sa}")


def test_without_a_pod_name_nothing_of_kubernetes_is_imported(fk_env, tmp_path):
    """Outside a pod the supervisor imports neither lightkube nor warmctl.kube."""
    code = ("import sys, warmctl.cli.foreground as fg\n"
            "from warmctl.records.config import load_settings\n"
            "assert fg.pod_condition(load_settings(None, {}), print) is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(('lightkube', 'warmctl.kube'))))\n")
    r = subprocess.run([sys.executable, "-c", code], env={k: v for k, v in fk_env.items()}, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_sender_coalesces_one_reasons_updates_keeps_order_and_reports_one_failure():
    """The sender's loop (:func:`warmctl.kube.conditions.send`) over a queue filled ahead, as when
    the API server is slower than ``up``: updates of one reason and status in a row reach the
    pod as the last of them, the others in order; the first failure is reported, later ones not."""
    import queue

    from warmctl.kube.conditions import send

    def c(reason: str, msg: str, status: str = "False") -> dict:
        return {"type": COND, "status": status, "reason": reason, "message": msg}

    q: queue.Queue = queue.Queue()
    for item in (c("Resolving", "a"), c("Pulling", "1%"), c("Pulling", "50%"), c("Pulling", "99%"),
                 c("Restoring", "r"), c("Serving", "s", "True"), None):
        q.put(item)
    sent, failures = [], []
    assert send(q, lambda cond: sent.append((cond["reason"], cond["message"])), failures.append) == 4
    assert sent == [("Resolving", "a"), ("Pulling", "99%"), ("Restoring", "r"), ("Serving", "s")] and not failures

    def refuse(cond: dict) -> None:
        raise PermissionError(f"forbidden: {cond['reason']}")

    for item in (c("Resolving", "a"), c("Pulling", "p"), None):
        q.put(item)
    assert send(q, refuse, failures.append) == 0
    assert [str(e) for e in failures] == ["forbidden: Resolving"]


def test_the_sender_patches_the_pod_and_ends_with_its_input(kube, tmp_path):
    """``python -m warmctl.kube.conditions`` against the API server, as the engine's service
    account: what it is given reaches the pod's status, and it exits 0 when its stdin ends (the
    supervisor closed it, or died), having sent what it had."""
    pod = Pod(kube, NS, "warmctl-engine", 0)
    try:
        target = {"pod": pod.name, "namespace": NS,
                  "kube_config": str(kube.kubeconfig(tmp_path / "engine.kubeconfig", user=ENGINE))}
        lines = [target, {"type": COND, "status": "False", "reason": "Pulling", "message": "m1"},
                 {"type": COND, "status": "True", "reason": "Serving", "message": "m2"}]
        r = subprocess.run([sys.executable, "-m", "warmctl.kube.conditions"], cwd=REPO, timeout=60,
                           input="".join(json.dumps(x) + "\n" for x in lines), capture_output=True, text=True)
        assert r.returncode == 0 and not r.stderr, r.stderr
        cond = next(c for c in pod.conditions() if c["type"] == COND)
        assert (cond["status"], cond["reason"], cond["message"]) == ("True", "Serving", "m2"), cond
    finally:
        pod.delete()


def test_failure_reasons_follow_the_error_class():
    from warmctl.naming.catalog import CatalogError
    from warmctl.base.errors import CanaryMismatch, EngineError, ImageMismatch, SnapshotNotFound
    from warmctl.kube.conditions import failure_reason
    from warmctl.store.chunkio import ChunkCorrupt, ChunkMissing
    from warmctl.store.sealed import SealKeyError
    from warmctl.naming.trust import TrustError

    assert failure_reason(CanaryMismatch("x")) == "CanaryFailed"
    for e in (TrustError("x"), ChunkCorrupt("x", "d", "l", "r"), ChunkMissing("x", "d", "l"), SealKeyError("x"),
              ImageMismatch("x")):
        assert failure_reason(e) == "Refused", e
    assert failure_reason(SnapshotNotFound("x")) == "SnapshotNotFound"
    assert failure_reason(EngineError("x")) == "EngineError"
    assert failure_reason(CatalogError("x")) == "CatalogError"
    assert failure_reason(RuntimeError("x")) == "Failed"


def test_image_rule_compares_the_image_digests():
    from warmctl.naming.catalog import check, compat_key
    from warmctl.host import fingerprint

    fp = fingerprint()
    a, b = "sha256:" + "aa" * 32, "sha256:" + "bb" * 32
    img_a, img_b = fp.model_copy(update={"image_digest": a}), fp.model_copy(update={"image_digest": b})
    assert check(fp, fp) is None and check(img_a, img_a) is None
    rule, why = check(img_a, img_b)
    assert rule == "image" and a in why and b in why
    assert check(fp, img_a)[0] == "image" and check(img_a, fp)[0] == "image"
    # outside a cluster nothing changes: no key in the JSON, the same compat key as before
    assert "image_digest" not in fp.model_dump(mode="json")
    assert img_a.model_dump(mode="json")["image_digest"] == a
    assert compat_key(fp.model_dump(mode="json")) != compat_key(img_a.model_dump(mode="json"))
    doc = fp.model_dump(mode="json")
    assert compat_key(doc) == compat_key({**doc, "image_digest": None})


def test_termination_message_is_one_line_within_the_kubelets_limit(tmp_path):
    from warmctl.records.config import load_settings
    from warmctl.cli.foreground import TERMINATION_MESSAGE_MAX, termination_message_path, write_termination_message

    said: list[str] = []
    s = load_settings(None, {"termination_message_path": tmp_path / "t"})
    write_termination_message(s, "ChunkCorrupt (exit 20): line one\n\n  line two\n" + "x" * 5000, said.append)
    data = (tmp_path / "t").read_bytes()
    assert len(data) == TERMINATION_MESSAGE_MAX and data.count(b"\n") == 1 and data.endswith("\u2026\n".encode())
    assert data.startswith(b"ChunkCorrupt (exit 20): line one; line two; xxx") and not said
    assert termination_message_path(load_settings(None, {"pod_name": "p"})) == Path("/dev/termination-log")
    assert termination_message_path(load_settings(None, {})) is None
    write_termination_message(load_settings(None, {"termination_message_path": tmp_path / "no" / "t"}), "x", said.append)
    assert len(said) == 1 and "cannot write the termination message" in said[0]


def test_snapshot_made_in_an_image_restores_only_in_that_image(tmp_path, engine_ports, fake_ports):
    """``warmctl snapshot`` with ``image_digest`` set records it (manifest and catalog entry);
    ``up`` restores it where the same digest is set, and refuses it, naming both digests, in
    another image and outside any (ImageMismatch, exit 42, with ``--cold-start never``)."""
    a, b = "sha256:" + "a1" * 32, "sha256:" + "b2" * 32
    env = fake_env(tmp_path / "img", *engine_ports)
    snap = snapshot_once({**env, "WARMCTL_IMAGE_DIGEST": a}, "fake")
    entry = json.loads(warmctl("catalog", "show", "fake", "--json", env=env).stdout)
    assert a in json.dumps(entry), entry
    try:
        for where, extra in (("another image", {"WARMCTL_IMAGE_DIGEST": b}), ("no image", {})):
            r = warmctl("up", "fake", "--cold-start", "never", env={**env, **extra}, check=False)
            assert r.returncode == 42, (where, r.stdout, r.stderr)
            assert "ImageMismatch" not in r.stderr and a in r.stderr, r.stderr  # the message, not the class
            assert (b in r.stderr) if extra else ("runs in no container image" in r.stderr), r.stderr
        r = warmctl("up", "fake", "--json", "--cold-start", "never", env={**env, "WARMCTL_IMAGE_DIGEST": a})
        res = json.loads(r.stdout)
        assert res["source"] == "restore" and res["snapshot"] == snap["digest"], res
    finally:
        warmctl("down", "fake", env=env, check=False)


def test_pull_takes_the_entry_made_in_the_image_it_runs_in(tmp_path, engine_ports, fake_ports, monkeypatch):
    """``warmctl pull`` and the node agent's pre-warm pull (:func:`warmctl.naming.fleet.pull`)
    pick by the same rules as ``up``, the image rule included: a node running image A pulls the
    snapshot made in A; a node in no image finds nothing it would restore, and says why (naming A)."""
    from warmctl.base.errors import WarmctlError
    from warmctl.naming import fleet
    from warmctl.naming.catalog import Ref
    from warmctl.records.config import load_settings
    from warmctl.store import open_store

    a = "sha256:" + "a1" * 32
    env = fake_env(tmp_path / "img", *engine_ports)
    snap = snapshot_once({**env, "WARMCTL_IMAGE_DIGEST": a}, "fake")
    remote = tmp_path / "remote"
    warmctl("push", "fake", "--to", str(remote), env=env)
    node = fake_env(tmp_path / "node", *engine_ports, hold=tmp_path / "img" / "hold")
    keys = Path(node["WARMCTL_CONFIG"]).parent / "keys"
    keys.mkdir(exist_ok=True)
    for pub in (Path(env["WARMCTL_CONFIG"]).parent / "keys").glob("*.pub"):
        shutil.copy(pub, keys / pub.name)
    r = warmctl("pull", "fake", "--from", str(remote), env=node, check=False)
    assert r.returncode != 0 and a in r.stderr, (r.stdout, r.stderr)
    for k in [k for k in os.environ if k.startswith("WARMCTL_")]:
        monkeypatch.delenv(k)
    for digest in (None, a):  # the library call the pre-warm controller makes
        settings = load_settings(Path(node["WARMCTL_CONFIG"]), {"image_digest": digest})
        src, dst = open_store(str(remote), settings=settings), open_store(settings.store_dir, settings=settings)
        try:
            if digest is None:
                with pytest.raises(WarmctlError, match=a):
                    fleet.pull(settings, src, dst, Ref.parse("fake"))
            else:
                [copied] = fleet.pull(settings, src, dst, Ref.parse("fake"))
                assert copied.report.digest == snap["digest"]
        finally:
            src.close()
            dst.close()
    r = warmctl("pull", "fake", "--from", str(remote), "--json", env={**node, "WARMCTL_IMAGE_DIGEST": a})
    assert snap["digest"] in r.stdout, r.stdout
