"""A fleet's names move: a second publisher's ``snapshot`` (``remote_store`` set) pushes and
moves the tag, a node's next ``up`` follows it, the old snapshot stays reachable by digest, and
``rm`` + ``gc`` free the remote. Nodes are homes on this machine, each with its own signing key
(A2 uses A's); B trusts A's public key only, through its ``keys_dir``.

What is tested is naming and the store (catalog entries, signatures, push, gc), so the engine
is the two-process stand-in ``tests/fake_vllm.py`` (``fake_env``): real CRIU, about a second a
snapshot. Restoring the real engine across nodes is test_e2e_fleet.py's. Self-contained: the
test builds its own nodes and remote.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest

from tests.conftest import fake_env, warmctl, with_signing
from tests.test_agent_e2e import _engine_procs

pytestmark = pytest.mark.e2e


def _node(root: Path, engine_ports, remote: Path, *, trust: list[Path], signing_key: Path | None = None) -> dict[str, str]:
    """A :func:`fake_env` home under ``root`` reading and writing the directory remote
    ``remote``: its own signing key (generated, or ``signing_key``) and ``keys_dir`` holding its
    own public key plus the ``trust`` ones."""
    env = fake_env(root, *engine_ports, hold=remote.parent / "hold")  # one profile on every node
    with_signing(env, root, trust=trust, signing_key=signing_key)
    return dict(env, WARMCTL_REMOTE_STORE=str(remote))


def _up(env, *args: str, check: bool = True):
    r = warmctl("up", "fake", "--json", *args, env=env, check=check)
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def test_snapshot_push_moves_the_tag_the_old_one_stays_by_digest_then_rm_and_gc_free_the_remote(tmp_path, engine_ports):
    remote = tmp_path / "remote"
    a = _node(tmp_path / "a", engine_ports, remote, trust=[])
    nodes = [a]
    try:
        r = warmctl("snapshot", "fake", env=a)
        assert "ok push" in r.stderr, r.stderr  # the snapshot's push phase ran (remote_store is set)
        [first] = json.loads(warmctl("ls", "--json", "--remote", env=a).stdout)
        b = _node(tmp_path / "b", engine_ports, remote, trust=[tmp_path / "a" / "signing" / "node.pub"])
        a2 = _node(tmp_path / "a2", engine_ports, remote, trust=[], signing_key=tmp_path / "a" / "signing" / "node.key")
        nodes += [b, a2]
        r, res = _up(b, "--cold-start", "never")
        assert res["path"] == "restore" and res["snapshot"] == first["digest"] and res["fetched"]["remote"] > 0, r.stderr
        warmctl("down", "fake", env=b)

        r = warmctl("snapshot", "fake", env=a2)  # a second publisher, A's key: the tag moves
        assert "ok push" in r.stderr, r.stderr
        new = json.loads(warmctl("ls", "--json", "--remote", env=a2).stdout)
        assert len(new) == 1 and new[0]["digest"] != first["digest"], new
        r, res = _up(b)  # B's next up sees the moved tag
        assert res["path"] == "restore" and res["snapshot"] == new[0]["digest"], r.stderr
        warmctl("down", "fake", env=b)
        r = warmctl("up", f"fake@{first['digest']}", "--json", env=b)  # the old one, by digest
        assert json.loads(r.stdout)["snapshot"] == first["digest"]
        warmctl("down", "fake", env=b)

        chunks_before = sum(1 for p in (remote / "chunks").rglob("*") if p.is_file())
        r = warmctl("rm", "fake", env=a2)
        assert "removed 1 entry from" in r.stdout, r.stdout
        r, _ = _up(b, "--cold-start", "never", check=False)
        assert r.returncode != 0 and "no snapshot fake:latest in the catalog at" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        r = warmctl("gc", "--store", str(remote), "--grace", "0", env=a2)
        assert "2 manifests" in r.stdout, r.stdout
        chunks_after = sum(1 for p in (remote / "chunks").rglob("*") if p.is_file())
        assert chunks_before > 0 and chunks_after == 0
    finally:
        for n in nodes:
            warmctl("down", "fake", env=n, check=False)
    for n in nodes:
        assert not _engine_procs(Path(n["WARMCTL_TEST_HOME"]))


def test_a_node_that_never_had_the_publishers_home_restores_its_snapshot(tmp_path, engine_ports):
    """The engine's working directory and log are recorded at the publisher's paths, its run
    directory in its home (CRIU reopens them there, and checks the directory's mode). A node
    that never had that home (another host; here A's home removed after its push) makes them
    as the publisher's cold start had them, 0700, and restores from the remote."""
    remote = tmp_path / "remote"
    a = _node(tmp_path / "a", engine_ports, remote, trust=[])
    r = warmctl("snapshot", "fake", env=a)
    assert "ok push" in r.stderr, r.stderr
    recorded = Path(a["WARMCTL_TEST_HOME"]) / "run" / "fake"  # the publisher's run directory: its cwd
    assert recorded.is_relative_to(tmp_path / "a")
    pub = shutil.copy(tmp_path / "a" / "signing" / "node.pub", tmp_path / "a.pub")
    shutil.rmtree(tmp_path / "a")
    b = _node(tmp_path / "b", engine_ports, remote, trust=[Path(pub)])
    try:
        r, res = _up(b, "--cold-start", "never")
        assert res["path"] == "restore" and res["fetched"]["remote"] > 0, r.stderr
        assert stat.S_IMODE(recorded.stat().st_mode) == 0o700
        warmctl("down", "fake", env=b)
    finally:
        warmctl("down", "fake", env=b, check=False)
    assert not _engine_procs(Path(b["WARMCTL_TEST_HOME"]))
