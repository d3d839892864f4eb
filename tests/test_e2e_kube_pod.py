"""The real ``tiny`` engine restored by ``warmctl up tiny --foreground`` told it is a pod: its
``warmctl.io/Restored`` condition walks Resolving -> Pulling -> Restoring -> CanaryRunning ->
Serving against the real API server (tests/kubecluster.py), Serving only once the public port
is open, the engine answers "Paris", and SIGTERM drains it and ends at Stopped, exit 0. The
fake engine's tests (tests/test_kube_pod.py) cover every other path; this one is the real
restore (the session's ``tiny_snapshot``: a real vLLM cold start and snapshot, minutes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from tests.conftest import warmctl
from tests.test_kube_pod import NS, Pod, _pod_env, kube  # noqa: F401 - kube: the module fixture

pytestmark = pytest.mark.e2e


def test_real_restore_walks_the_condition(kube, wc_env, tiny_snapshot, engine_ports, tmp_path):  # noqa: F811
    gate = engine_ports[1]
    warmctl("down", "tiny", env=wc_env, check=False)
    pod = Pod(kube, NS, "warmctl-engine", gate)
    log = tmp_path / "fg.log"
    p = subprocess.Popen([sys.executable, "-m", "warmctl", "up", "tiny", "--foreground", "--cold-start", "never"],
                         env=_pod_env(wc_env, kube, pod, tmp_path), stdout=open(log, "a"), stderr=subprocess.STDOUT)
    try:
        serving = pod.wait_reason("Serving", 600)
        assert serving[1] == "True" and serving[4], (pod.changes, log.read_text())
        assert pod.reasons()[:5] == ["Resolving", "Pulling", "Restoring", "CanaryRunning", "Serving"], pod.changes
        r = httpx.post(f"http://127.0.0.1:{gate}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France? One word."}],
            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        t0 = pod.changes[0][0]
        print("\nreal tiny restore, condition walk:\n" + "\n".join(
            f"  {c[0] - t0:6.2f} s {c[1]} {c[2]}: {c[3]}" for c in pod.changes))
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0, log.read_text()
        assert pod.wait_reason("Stopped", 10)[1] == "False"
        assert pod.reasons()[-2:] == ["Draining", "Stopped"]
        assert json.loads(warmctl("status", "--json", env=wc_env).stdout) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        warmctl("down", "tiny", env=wc_env, check=False)
        pod.delete()
