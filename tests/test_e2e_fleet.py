"""Snapshots travel: node A publishes, node B restores, with the real vLLM engine (CPU build),
real CRIU, a directory remote and a real Ceph RGW on loopback, and the agent's REST API.

Nodes are homes on this machine (``isolated_env``), each with its own signing key; B trusts A's
public key through its ``keys_dir`` and nothing else. A is the session's snapshot home
(``wc_env``). Only one engine runs at a time, on the session's test ports.

The module's ``fleet`` pushes A's snapshot to a directory remote; each test only reads it (or
pushes the same snapshot again), so none depends on another having run: restore on B
(streamed, then from B's cache), a fresh node killed after its port opened, refusal without A's
key, the agent path, Ceph RGW and an OCI registry as remotes. A second publisher moving the tag,
``up NAME@digest``, ``rm`` and ``gc`` are naming and store work, tested with the fake engine in
test_e2e_fleet_tags.py (a second real snapshot here cost a cold start).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import isolated_env, listening, warmctl, with_signing
from tests.test_agent_e2e import Agent, _engine_procs

pytestmark = pytest.mark.e2e


def node(root: Path, engine_ports, *, trust: list[Path], signing_key: Path | None = None, **extra: str) -> dict[str, str]:
    """A node's environment: its own home under ``root``, its own signing key (generated, or
    ``signing_key``), and ``keys_dir`` holding its own public key plus the ``trust`` ones."""
    env = with_signing(isolated_env(root, *engine_ports), root, trust=trust, signing_key=signing_key)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, wc_env, tiny_snapshot, engine_ports):
    root = tmp_path_factory.mktemp("fleet")
    a_pub = next(Path(wc_env["WARMCTL_CONFIG"]).parent.joinpath("keys").glob("local-*.pub"))
    remote = root / "remote"
    f = {
        "root": root,
        "remote": remote,
        "a_pub": a_pub,
        "a": dict(wc_env, WARMCTL_REMOTE_STORE=str(remote)),
        "b": node(root / "b", engine_ports, trust=[a_pub], WARMCTL_REMOTE_STORE=str(remote)),
        "digest": tiny_snapshot["digest"],
        "gate": engine_ports[1],
    }
    f["push"] = warmctl("push", "tiny", "--to", str(remote), env=f["a"]).stderr
    yield f
    for n in ("a", "b"):
        warmctl("down", "tiny", env=f[n], check=False)


@pytest.fixture(autouse=True)
def _nothing_left(fleet):
    yield
    for n in ("a", "b"):
        warmctl("down", "tiny", env=fleet[n], check=False)
    left = _engine_procs(Path(fleet["b"]["WARMCTL_TEST_HOME"]))
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {left}"


def _up(env, *args: str, check: bool = True):
    r = warmctl("up", "tiny", "--json", *args, env=env, check=check)
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def _answers(port: int) -> str:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France? One word."}]})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def test_b_restores_what_a_pushed_then_from_its_own_cache(fleet):
    assert f"push tiny:latest ({fleet['digest'][:19]})" in fleet["push"]
    assert list((fleet["remote"] / "catalog" / "tiny" / "latest").glob("sha256-*.json"))

    r, res = _up({**fleet["b"], "WARMCTL_RESTORE_STREAM": "auto"})
    assert res["path"] == "restore" and res["snapshot"] == fleet["digest"], r.stderr
    # (a chunk that occurs twice in the snapshot is fetched once, then read from the local cache)
    assert res["fetched"]["remote"] > 100 * 2**20 and res["fetched"]["local"] < res["fetched"]["remote"] / 100, res
    # CRIU restored while the image was fetched and written (restore_stream = auto): it read every
    # non-empty image file through warmctl's streamer
    assert res["streamed"] and res["streamed"]["files"] > 10 and res["streamed"]["bytes"] > 100 * 2**20, res
    assert _answers(fleet["gate"]).strip()
    warmctl("down", "tiny", env=fleet["b"])
    # B's local store now names it and holds its chunks: the next up reads nothing remote
    # (what it reads locally depends on whether this host kept the restored image)
    ls = json.loads(warmctl("ls", "--json", env=fleet["b"]).stdout)
    assert [(x["name"], x["tag"], x["digest"]) for x in ls] == [("tiny", "latest", fleet["digest"])]
    r, res = _up(fleet["b"])
    assert res["path"] == "restore" and res["fetched"]["remote"] == 0, res
    assert res["streamed"] is None, res  # the kept image: nothing to wait for


def _files(d: Path, pattern: str = "*") -> list[Path]:
    return [p for p in d.rglob(pattern) if p.is_file()] if d.is_dir() else []


def test_a_fresh_node_killed_after_its_port_opened_keeps_only_temporary_chunks(fleet, engine_ports):
    """The chunks a fresh node fetches are committed to its local store after the public port
    opened ("commit"): ``up`` killed there (``kill -9``, after the gate opened) leaves an engine
    that serves, and a local store with no chunk object and nothing named, only temporary files
    (gc's, once an hour old); ``verify`` passes. A restore that fails after materialize (a rank
    killed before the ranks check) commits what it fetched before it raises, names nothing and
    leaves nothing open; the next ``up`` then serves and names the snapshot locally."""
    warmctl("push", "tiny", "--to", str(fleet["remote"]), env=fleet["a"])
    c = node(fleet["root"] / "c", engine_ports, trust=[fleet["a_pub"]], WARMCTL_REMOTE_STORE=str(fleet["remote"]))
    home = Path(c["WARMCTL_TEST_HOME"])
    store = home / "store"
    try:
        r = warmctl("up", "tiny", "--json", "--cold-start", "never", env={**c, "WARMCTL_TEST_KILL_AT_PHASE": "commit"},
                    check=False)
        assert r.returncode == -9, r.stdout + r.stderr
        assert _answers(fleet["gate"]).strip()  # the port opened before the commit: the engine serves
        assert _files(store / "chunks") == []
        tmp = _files(store / "tmp", "*.tmp")
        assert len(tmp) > 100, len(tmp)  # tiny's ~460 fetched chunk objects, none durable or visible yet
        assert json.loads(warmctl("ls", "--json", env=c).stdout) == []
        assert warmctl("verify", env=c, check=False).returncode == 0
        warmctl("down", "tiny", env=c)

        shutil.rmtree(home / "cache" / "images")  # else the kept image is reused and nothing is fetched
        r = warmctl("up", "tiny", "--json", "--cold-start", "never", env={**c, "WARMCTL_TEST_KILL_RANK": "ranks:Worker"},
                    check=False)
        assert r.returncode == 39 and "Worker" in r.stderr, r.stdout + r.stderr  # RankError
        assert not listening(fleet["gate"])
        chunks = _files(store / "chunks")
        assert len(chunks) > 100 and not set(_files(store / "tmp", "*.tmp")) - set(tmp), "committed, nothing left pending"
        assert json.loads(warmctl("ls", "--json", env=c).stdout) == []  # no partial snapshot named
        assert warmctl("verify", env=c, check=False).returncode == 0
        assert not _engine_procs(home)

        r, res = _up(c, "--cold-start", "never")
        assert res["path"] == "restore" and "commit" in res["timings_s"] and "keep" in res["timings_s"], r.stderr
        assert _answers(fleet["gate"]).strip()
        ls = json.loads(warmctl("ls", "--json", env=c).stdout)
        assert [(x["name"], x["digest"]) for x in ls] == [("tiny", fleet["digest"])]
        warmctl("down", "tiny", env=c)
        old = __import__("time").time() - 2 * 3600
        for p in tmp:
            os.utime(p, (old, old))
        r = warmctl("gc", env=c)
        assert _files(store / "tmp", "*.tmp") == [], r.stdout + r.stderr
        # named now, gc keeps them (with the few chunks no materialize fetched, e.g. of bundled files
        # already in place, which keep copied)
        assert set(chunks) <= set(_files(store / "chunks"))
        assert warmctl("verify", env=c, check=False).returncode == 0
    finally:  # node C is no fixture's: its engine goes whatever failed
        warmctl("down", "tiny", env=c, check=False)


def test_b_without_as_key_refuses_and_names_the_key(fleet, engine_ports):
    stranger = node(fleet["root"] / "stranger", engine_ports, trust=[], WARMCTL_REMOTE_STORE=str(fleet["remote"]))
    shm_before = set(os.listdir("/dev/shm"))
    r, _ = _up(stranger, "--cold-start", "never", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    kid = json.loads(warmctl("catalog", "show", "tiny", "--json", env=fleet["b"]).stdout)["entries"][0]["signed_by"][0]
    assert kid in r.stderr and "trust" in r.stderr.lower(), r.stderr
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_agent_on_b_restores_from_the_remote(fleet, engine_ports):
    env = node(fleet["root"] / "b-agent", engine_ports, trust=[fleet["a_pub"]], WARMCTL_REMOTE_STORE=str(fleet["remote"]))
    agent = Agent(env)
    try:
        h = agent.http
        j = agent.wait_job(h.post("/v1/engines/tiny/up", json={"cold_start": "never"}).json()["id"])
        assert j["state"] == "succeeded", j
        assert j["result"]["path"] == "restore" and j["result"]["snapshot"] == fleet["digest"]
        assert j["result"]["fetched"]["remote"] > 100 * 2**20
        assert _answers(fleet["gate"]).strip()
        assert [s["digest"] for s in h.get("/v1/snapshots").json()] == [fleet["digest"]]  # cached locally
        jd = agent.wait_job(h.post("/v1/engines/tiny/down").json()["id"], 60)
        assert jd["state"] == "succeeded" and jd["result"]["was_up"] is True
    finally:
        agent.stop()


@pytest.mark.s3
def test_b_restores_from_ceph_rgw(fleet, engine_ports, rgw_bucket):
    ep, ak, sk, bucket = rgw_bucket  # the session's RGW (conftest's ceph_rgw), a bucket of this test's
    s3env = {"WARMCTL_S3_ENDPOINT": ep, "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk,
             "AWS_DEFAULT_REGION": "us-east-1"}
    url = f"s3://{bucket}/warmctl"
    warmctl("push", "tiny", "--to", url, env=dict(fleet["a"], **s3env))
    b3 = node(fleet["root"] / "b-rgw", engine_ports, trust=[fleet["a_pub"]], WARMCTL_REMOTE_STORE=url, **s3env)
    try:
        r, res = _up(b3, "--cold-start", "never")
        assert res["path"] == "restore" and res["snapshot"] == fleet["digest"], r.stderr
        assert res["fetched"]["remote"] > 100 * 2**20
        assert _answers(fleet["gate"]).strip()
    finally:
        warmctl("down", "tiny", env=b3, check=False)


@pytest.mark.oci
def test_b_restores_from_an_oci_registry_and_two_nodes_through_a_mirror(fleet, engine_ports, tmp_path_factory):
    """A pushes to a registry (Distribution 2.8, TLS from a test CA, bearer tokens); a fresh B's ``up``
    restores from it, the canary passes, B's second ``up`` fetches nothing remote. Then two fresh
    nodes restore through a pull-through mirror of it: the origin serves each blob a few times
    for both together (the mirror's fill), not once per node."""
    from ports import free_port
    from registry_server import Registry, TokenServer, docker_config, make_ca, missing_binary

    from tests.conftest import need_service

    need_service(missing_binary() and "docker-registry missing: run scripts/install-test-services.sh", "WARMCTL_REQUIRE_REGISTRY")
    d = tmp_path_factory.mktemp("oci")
    ca = make_ca(d / "ca")
    tok = TokenServer(d / "tok", free_port(), ca, {"fleet": "fleet-pw"})  # the proxy logs in only with tokens
    with Registry(d / "origin", free_port(), ca=ca, token=tok) as origin, \
            Registry(d / "mirror", free_port(), ca=ca, proxy=(origin.url, "fleet", "fleet-pw")) as mirror:
        auth = docker_config(d / "auth.json", origin.host, "fleet", "fleet-pw")
        oenv = {"WARMCTL_OCI_CA_BUNDLE": str(ca.ca_cert), "REGISTRY_AUTH_FILE": str(auth)}
        url = f"oci://{origin.host}/fleet/warmctl"
        warmctl("push", "tiny", "--to", url, env=dict(fleet["a"], **oenv))
        b = node(fleet["root"] / "b-oci", engine_ports, trust=[fleet["a_pub"]], WARMCTL_REMOTE_STORE=url, **oenv)
        try:
            r, res = _up(b, "--cold-start", "never")
            assert res["path"] == "restore" and res["snapshot"] == fleet["digest"], r.stderr
            assert res["fetched"]["remote"] > 100 * 2**20
            assert _answers(fleet["gate"]).strip()
            warmctl("down", "tiny", env=b)
            r, res = _up(b, "--cold-start", "never")
            assert res["path"] == "restore" and res["fetched"]["remote"] == 0, res
        finally:
            warmctl("down", "tiny", env=b, check=False)
        via = f"oci://{mirror.host}/fleet/warmctl"
        marks = [len(origin.access_log())]
        for name in ("c-oci", "d-oci"):
            n = node(fleet["root"] / name, engine_ports, trust=[fleet["a_pub"]], WARMCTL_REMOTE_STORE=via, **oenv)
            try:
                r, res = _up(n, "--cold-start", "never")
                assert res["path"] == "restore" and res["snapshot"] == fleet["digest"], r.stderr
                assert res["fetched"]["remote"] > 100 * 2**20
                assert _answers(fleet["gate"]).strip()
            finally:
                warmctl("down", "tiny", env=n, check=False)
            marks.append(len(origin.access_log()))
        log = origin.access_log()

        def blob_gets(a: int, b: int) -> dict[str, int]:
            out: dict[str, int] = {}
            for m, p, st in log[a:b]:
                if m == "GET" and "/blobs/sha256:" in p and st in (200, 206):
                    out[p] = out.get(p, 0) + 1
            return out

        first, second = blob_gets(marks[0], marks[1]), blob_gets(marks[1], marks[2])
        print("origin blob GETs for the first node through the mirror:", sorted(first.values()))
        # the mirror's fill: each blob twice (kept + streamed) plus early probes (docs/operations.md)
        assert first and max(first.values()) <= 8, first
        assert not second, second  # the second node costs the origin no blob
    tok.stop()
