"""The node pre-warm controller (warmctl/kube/prewarm.py) against a real API server.

A real etcd + kube-apiserver v1.20.2 (``kube_api``) serves the ``WarmSnapshot`` CRD and the
RBAC of deploy/kubernetes/ (what that RBAC allows and refuses is test_kube_api.py's); two Node objects are created through the API (no kubelet: the
controller only reads a Node's labels and patches them). Nodes A and B are warmctl homes on this
machine, each acting as the node's DaemonSet does: the node service account's token
(``system:serviceaccount:warmctl:warmctl-node``), ``WARMCTL_NODE_NAME``, its own store and keys
trusting the publisher's. The publisher is the session's fake-engine home (``fake_snapshot``:
real CRIU, tests/fake_vllm.py), pushed to a directory remote. ``warmctl prewarm --once`` is run
as a subprocess, as an operator would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, WARMCTL, fake_env, session_tmp, warmctl

NODE_SA = "system:serviceaccount:warmctl:warmctl-node"
NODE_A, NODE_B = "kwarm-node-a", "kwarm-node-b"
LABELS = {NODE_A: {"warmctl.io/pool": "warm", "kubernetes.io/hostname": NODE_A},
          NODE_B: {"warmctl.io/pool": "cold", "kubernetes.io/hostname": NODE_B}}


@pytest.fixture(scope="module")
def cluster(kube_api, tmp_path_factory):
    """``kube_api`` with deploy/kubernetes applied (``kubectl apply -k``: the CRD, the node
    service account's RBAC) and the two Node objects created; yields
    (cluster, {node: kubeconfig of the node service account})."""
    d = tmp_path_factory.mktemp("kwarm-kube")
    kube_api.kubectl("apply", "-k", str(REPO / "deploy" / "kubernetes"), check=True)
    kube_api.kubectl("wait", "--for=condition=established", "--timeout=60s", "crd/warmsnapshots.warmctl.io", check=True)
    for node, labels in LABELS.items():
        kube_api.kubectl("delete", "node", node, "--ignore-not-found", check=True)
        kube_api.kubectl("apply", "-f", "-", check=True, input=json.dumps(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}}))
    yield kube_api, kube_api.kubeconfig(d / "node-sa.yaml", NODE_SA)
    for node in LABELS:
        kube_api.kubectl("delete", "node", node, "--ignore-not-found")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, fk_env, fake_snapshot, engine_ports, cluster):
    """The publisher's snapshot ``fake`` pushed to a directory remote, and node homes A and B
    (fake-engine homes trusting the publisher's key, the node SA's kubeconfig, their node
    names). Yields {"remote", "digest", NODE_A: env, NODE_B: env}."""
    _, kubeconfig = cluster
    root = session_tmp(tmp_path_factory, "kwarm-fleet")
    remote = root / "remote"
    warmctl("push", "fake", "--to", str(remote), env=fk_env)
    pub_root = Path(fk_env["WARMCTL_CONFIG"]).parent
    out = {"remote": str(remote), "digest": fake_snapshot["digest"]}
    for node in (NODE_A, NODE_B):
        env = fake_env(root / node, *engine_ports, hold=pub_root / "hold")  # the publisher's profile
        keys = root / node / "keys"
        keys.mkdir(exist_ok=True)
        for pub in (pub_root / "keys").glob("*.pub"):
            shutil.copy(pub, keys / pub.name)
        out[node] = dict(env, WARMCTL_KUBECONFIG=str(kubeconfig), WARMCTL_NODE_NAME=node,
                         WARMCTL_REMOTE_STORE=str(remote))
    yield out
    for node in (NODE_A, NODE_B):
        warmctl("down", "fake", env=out[node], check=False)


def _ws(kube, name: str, ref: str, remote: str, selector: dict | None = None) -> None:
    spec: dict = {"ref": ref, "remote": remote}
    if selector is not None:
        spec["nodeSelector"] = selector
    kube.kubectl("apply", "-f", "-", check=True, input=json.dumps(
        {"apiVersion": "warmctl.io/v1alpha1", "kind": "WarmSnapshot", "metadata": {"name": name}, "spec": spec}))


def _get(kube, kind: str, name: str) -> dict:
    return json.loads(kube.kubectl("get", kind, name, "-o", "json", check=True).stdout)


def _labels(kube, node: str) -> dict:
    return {k: v for k, v in (_get(kube, "node", node)["metadata"].get("labels") or {}).items()
            if k.startswith("snapshot.warmctl.io/")}


def _entries(kube, name: str) -> dict[str, dict]:
    return {e["node"]: e for e in (_get(kube, "warmsnapshot", name).get("status") or {}).get("nodes") or []}


def _prewarm(env: dict) -> list[dict]:
    r = warmctl("prewarm", "--once", "--json", env=env)
    return json.loads(r.stdout)


def _local_names(env: dict) -> set[str]:
    return {row["name"] for row in json.loads(warmctl("ls", "--json", env=env).stdout)}


def _value(digest: str) -> str:
    return "sha256-" + digest.split(":")[1][:40]


def test_selected_node_pulls_labels_and_reports_then_restores_with_nothing_remote(cluster, fleet):
    kube, _ = cluster
    a, b, digest = fleet[NODE_A], fleet[NODE_B], fleet["digest"]
    _ws(kube, "fake-warm", "fake:latest", fleet["remote"], {"warmctl.io/pool": "warm"})
    try:
        [o] = _prewarm(a)
        assert o["action"] == "cached" and o["digest"] == digest and o["chunks_copied"] > 0 and o["bytes_copied"] > 0, o
        # the files the snapshot maps were hashed into the node's digest cache, for up to find
        assert o["files_hashed"] > 0 and o["hash_seconds"] > 0, o
        hashed = o["files_hashed"]
        assert _labels(kube, NODE_A) == {"snapshot.warmctl.io/fake-warm": _value(digest)}
        entries = _entries(kube, "fake-warm")
        assert set(entries) == {NODE_A} and entries[NODE_A]["digest"] == digest and "error" not in entries[NODE_A]
        cached_at = entries[NODE_A]["cachedAt"]
        assert time.strptime(cached_at, "%Y-%m-%dT%H:%M:%SZ")
        assert "fake" in _local_names(a)

        assert _prewarm(b) == []  # not selected: nothing pulled, nothing labelled
        assert _labels(kube, NODE_B) == {} and "fake" not in _local_names(b)
        assert set(_entries(kube, "fake-warm")) == {NODE_A}

        [o] = _prewarm(a)  # a second pass: already whole, nothing moves, the entry is as it was
        assert o["action"] == "cached" and o["chunks_copied"] == 0 and o["bytes_copied"] == 0, o
        assert o["files_hashed"] == 0, o
        assert _entries(kube, "fake-warm")[NODE_A]["cachedAt"] == cached_at

        r = warmctl("up", "fake", "--json", "--cold-start", "never", env=a)  # the remote is still configured
        res = json.loads(r.stdout)
        assert res["path"] == "restore" and res["snapshot"] == digest, r.stderr
        assert res["fetched"]["remote"] == 0 and res["fetched"]["local"] > 0, res["fetched"]
        assert "required files:" not in r.stderr, r.stderr  # none hashed: the pre-warm did it
        warmctl("down", "fake", env=a)
        (Path(a["WARMCTL_TEST_HOME"]) / "cache" / "file-digests.json").unlink()
        r = warmctl("up", "fake", "--cold-start", "never", env=a)  # without it, up hashes them itself
        assert f"required files: {hashed} of {hashed} hashed" in r.stderr, r.stderr
    finally:
        warmctl("down", "fake", env=a, check=False)
        kube.kubectl("delete", "warmsnapshot", "fake-warm", "--ignore-not-found")


def test_a_failed_pull_writes_the_error_and_takes_the_label_away(cluster, fleet):
    kube, _ = cluster
    a = fleet[NODE_A]
    _ws(kube, "fake-moving", "fake:latest", fleet["remote"], {"warmctl.io/pool": "warm"})
    _ws(kube, "nothing-there", "nosuch:v1", fleet["remote"])
    _ws(kube, "bad-remote", "fake:latest", "/nonexistent/kwarm-remote")
    try:
        out = {o["name"]: o for o in _prewarm(a)}
        assert out["fake-moving"]["action"] == "cached"
        assert _labels(kube, NODE_A) == {"snapshot.warmctl.io/fake-moving": _value(fleet["digest"])}
        for name, says in (("nothing-there", "nosuch:v1"), ("bad-remote", "/nonexistent/kwarm-remote")):
            assert out[name]["action"] == "failed" and says in out[name]["error"], out[name]
            [entry] = _entries(kube, name).values()
            assert entry["node"] == NODE_A and "digest" not in entry and says in entry["error"], entry
            assert "\n" not in entry["error"]

        _ws(kube, "fake-moving", "fake:gone", fleet["remote"], {"warmctl.io/pool": "warm"})  # the held one now fails
        out = {o["name"]: o for o in _prewarm(a)}
        assert out["fake-moving"]["action"] == "failed" and "fake:gone" in out["fake-moving"]["error"]
        assert _labels(kube, NODE_A) == {}, "a label still claims a snapshot whose pull failed"
        assert "error" in _entries(kube, "fake-moving")[NODE_A]
    finally:
        for name in ("fake-moving", "nothing-there", "bad-remote"):
            kube.kubectl("delete", "warmsnapshot", name, "--ignore-not-found")


def test_deleted_or_unselecting_warmsnapshot_loses_its_label_and_the_store_keeps_the_snapshot(cluster, fleet):
    kube, _ = cluster
    a = fleet[NODE_A]
    _ws(kube, "fake-one", "fake:latest", fleet["remote"])  # every node
    _ws(kube, "fake-two", "fake:latest", fleet["remote"], {"warmctl.io/pool": "warm"})
    try:
        _prewarm(a)
        assert set(_labels(kube, NODE_A)) == {"snapshot.warmctl.io/fake-one", "snapshot.warmctl.io/fake-two"}
        kube.kubectl("delete", "warmsnapshot", "fake-one", check=True)
        _ws(kube, "fake-two", "fake:latest", fleet["remote"], {"warmctl.io/pool": "elsewhere"})
        out = _prewarm(a)
        assert [(o["name"], o["action"]) for o in out] == [("fake-two", "unselected")], out
        assert _labels(kube, NODE_A) == {}
        assert NODE_A not in _entries(kube, "fake-two")
        assert "fake" in _local_names(a)  # the store's gc decides, not the controller
        assert _prewarm(a) == []  # nothing left to do
    finally:
        for name in ("fake-one", "fake-two"):
            kube.kubectl("delete", "warmsnapshot", name, "--ignore-not-found")


def test_nodes_writing_status_at_once_all_end_in_status(cluster, fleet, tmp_path):
    kube, kubeconfig = cluster
    _ws(kube, "fake-all", "fake:latest", fleet["remote"])
    try:
        procs = [subprocess.Popen([*WARMCTL, "prewarm", "--once"], env=fleet[n], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for n in (NODE_A, NODE_B)]
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
        entries = _entries(kube, "fake-all")
        assert set(entries) == {NODE_A, NODE_B} and {e["digest"] for e in entries.values()} == {fleet["digest"]}

        # Many writers on one object, in-process: every read-modify-write meets 409s and retries.
        from warmctl.records.config import Settings
        from warmctl.kube.prewarm import Prewarmer

        writers = [Prewarmer(Settings(home=tmp_path / f"n{i}", kube_config=kubeconfig, node_name=f"kwarm-writer-{i}"))
                   for i in range(8)]
        barrier, errors = threading.Barrier(len(writers)), []

        def write(pw: Prewarmer) -> None:
            barrier.wait()
            try:
                pw._write_entry("fake-all", {"node": pw.node, "digest": fleet["digest"], "cachedAt": "2026-12-03T00:00:00Z"})
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=write, args=(pw,)) for pw in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        entries = _entries(kube, "fake-all")
        assert set(entries) == {NODE_A, NODE_B, *(pw.node for pw in writers)}, sorted(entries)
    finally:
        kube.kubectl("delete", "warmsnapshot", "fake-all", "--ignore-not-found")


def test_prewarm_refuses_without_a_node_name_or_an_api_server(fleet, tmp_path):
    env = {k: v for k, v in fleet[NODE_A].items() if k != "WARMCTL_NODE_NAME"}
    r = warmctl("prewarm", "--once", env=env, check=False)
    assert r.returncode == 41 and "node_name" in r.stderr and "Traceback" not in r.stderr, r.stderr

    cfg = json.loads(Path(fleet[NODE_A]["WARMCTL_KUBECONFIG"]).read_text())
    cfg["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"  # nothing listens there
    (tmp_path / "kubeconfig").write_text(json.dumps(cfg))
    r = warmctl("prewarm", "--once", env=dict(fleet[NODE_A], WARMCTL_KUBECONFIG=str(tmp_path / "kubeconfig")), check=False)
    assert r.returncode == 41 and f"read node {NODE_A}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_agent_prewarm_reacts_to_new_changed_and_deleted_warmsnapshots_at_once(cluster, fleet, tmp_path):
    """``warmctl agent --prewarm`` (the DaemonSet's command), its period an hour: the watch
    alone makes it pull and label a new WarmSnapshot, follow its spec's changes, and unlabel it
    once deleted; the status writes that come back through the watch start no pass."""
    import httpx
    from ports import free_port

    from tests.conftest import wait_agent_ready

    kube, _ = cluster
    port, log = free_port(), tmp_path / "agent.log"
    env = dict(fleet[NODE_A], WARMCTL_PREWARM_INTERVAL_S="3600")
    key = "snapshot.warmctl.io/fake-watched"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*WARMCTL, "agent", "--prewarm", "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_agent_ready(f"http://127.0.0.1:{port}", proc, log.read_text)
        time.sleep(1.0)  # the first pass (nothing selects the node) and the watch opening
        _ws(kube, "fake-watched", "fake:latest", fleet["remote"], {"warmctl.io/pool": "warm"})
        deadline = time.monotonic() + 60
        while _labels(kube, NODE_A).get(key) != _value(fleet["digest"]):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.3)
        assert _entries(kube, "fake-watched")[NODE_A]["digest"] == fleet["digest"]
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200  # the API serves beside it
        passes = log.read_text().count("prewarm: pass done")
        time.sleep(3.0)  # its own status write comes back through the watch: no pass for it
        assert log.read_text().count("prewarm: pass done") == passes, log.read_text()

        _ws(kube, "fake-watched", "fake:latest", fleet["remote"], {"warmctl.io/pool": "elsewhere"})  # a spec change
        deadline = time.monotonic() + 60
        while key in _labels(kube, NODE_A):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.3)
        _ws(kube, "fake-watched", "fake:latest", fleet["remote"])  # every node again
        deadline = time.monotonic() + 60
        while key not in _labels(kube, NODE_A):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.3)

        kube.kubectl("delete", "warmsnapshot", "fake-watched", check=True)
        deadline = time.monotonic() + 60
        while key in _labels(kube, NODE_A):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.3)
        text = log.read_text()
        assert "prewarm fake-watched: fake:latest from" in text and "cached on node" in text, text
    finally:
        proc.terminate()
        proc.wait(30)
        kube.kubectl("delete", "warmsnapshot", "fake-watched", "--ignore-not-found")


def test_label_keys_values_and_selectors():
    """The label contract, without a cluster: a name of up to 63 characters is its own key; a
    longer one maps to 52 characters, '-' and 10 hex digits (a valid name part, stable,
    distinct); the value is the digest's first 40 hex digits; a selector needs every label."""
    import re

    from warmctl.kube.prewarm import label_key, label_value, one_line, selector_matches

    part = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
    assert label_key("tiny") == "snapshot.warmctl.io/tiny"
    assert label_key("a" * 63) == "snapshot.warmctl.io/" + "a" * 63
    long1, long2 = "llama-3.1-70b-instruct." + "x" * 60, "llama-3.1-70b-instruct." + "x" * 59 + "y"
    k1, k2 = label_key(long1).split("/", 1)[1], label_key(long2).split("/", 1)[1]
    assert len(k1) == 63 and part.fullmatch(k1) and k1.startswith("llama-3.1-70b-instruct.xxx") and k1 != k2
    assert label_key(long1) == label_key(long1)
    assert len(label_key("." * 70).split("/", 1)[1]) == 10  # nothing valid to keep: the hash alone
    digest = "sha256:" + "0123456789abcdef" * 4
    assert label_value(digest) == "sha256-" + ("0123456789abcdef" * 4)[:40] and len(label_value(digest)) == 47
    with pytest.raises(ValueError):
        label_value("md5:abc")
    assert selector_matches(None, {}) and selector_matches({}, {"a": "1"})
    assert selector_matches({"a": "1"}, {"a": "1", "b": "2"}) and not selector_matches({"a": "1", "b": "3"}, {"a": "1", "b": "2"})
    assert one_line(OSError("first\nsecond")) == "OSError: first" and len(one_line(RuntimeError("x" * 2000))) == 480
