"""Every read of a damaged remote ends. A node reads a snapshot from a directory remote in which
one chunk object is damaged, and each way it can read it fails promptly, naming the chunk:
``up`` (the image written first), a streamed ``up`` (``restore_stream = auto``: CRIU reads the
image as it is written), ``pull``, and the agent's ``up`` job. Two kinds of damage:

- ``sealed-flip``: one byte flipped in the middle of a chunk object of a sealed remote
  (``warmctl seal``; the node holds the fleet key): the sealed backend's own load raises
  (authentication fails), behind the node's cache;
- ``plain-grown``: a chunk object of an unsealed remote grown past any frame of its chunk: the
  remote refuses it unread, behind the node's cache.

Either one made ``up`` retry forever: the cache answered ``forget`` with True (as if it had
dropped a copy of its own) though the bytes came from the remote. After each failure: nothing is
named in the node's catalog, no process of the node is left and no ``/dev/shm`` file is new.

The snapshot is synthetic (a few MiB, the node's own ``tiny`` profile and host fingerprint,
signed by the publishing home): every failure happens before CRIU or an engine would start, so
no engine is needed."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
from tests.conftest import isolated_env, procs_under, shm_leaked, shm_names, wait_agent_ready, warmctl
from tests.damage import flip_middle
from tests.ports import free_port

from warmctl.records.config import Settings
from warmctl.naming.catalog import Catalog, Ref
from warmctl.store.chunkio import ChunkCorrupt
from warmctl.naming.fleet import copy_entry, entries_to_copy
from warmctl.host import HostFingerprint
from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest
from warmctl.records.profile import load_profile_file
from warmctl.store import chunk_key, open_backend, open_store
from warmctl.store.chunks import frame_bound
from warmctl.store.sealed import load_key, seal_store
from warmctl.naming.trust import generate_keypair

#: every /dev/shm file of the host is checked (check_clean)
pytestmark = pytest.mark.host_wide

CH = 256 * 1024
#: the bound on each failing command (seconds); a healthy run takes a few
BOUND = 60
KINDS = ["sealed-flip", "plain-grown"]


class Node:
    """Home A (publisher, its own signing key) pushes a synthetic ``tiny`` snapshot to the remote
    directory (sealed or not); node B (``env``) trusts A's key, reads the remote and, for a
    sealed one, holds the fleet key. ``digest``: the damaged chunk's digest."""

    def __init__(self, tmp: Path, kind: str, engine_port: int, gate_port: int, monkeypatch):
        self.tmp, self.kind = tmp, kind
        self.remote = tmp / "remote"
        self.env = isolated_env(tmp / "b", engine_port, gate_port)
        self.home = Path(self.env["WARMCTL_TEST_HOME"])
        (tmp / "none.toml").write_text("")
        monkeypatch.setenv("WARMCTL_CONFIG", str(tmp / "none.toml"))
        monkeypatch.delenv("WARMCTL_SEAL_KEY", raising=False)
        self.settings = Settings()  # this process's, passed to the stores it opens
        if kind.startswith("sealed"):
            key = tmp / "fleet.key"
            key.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
            key.chmod(0o600)
            seal_store(open_backend(self.remote, unseal=False), load_key(key))
            self.settings = Settings(seal_key=key)  # this process pushes as a fleet member
            self.env["WARMCTL_SEAL_KEY"] = str(key)
        self.env["WARMCTL_REMOTE_STORE"] = str(self.remote)
        signer = generate_keypair(tmp / "a" / "signing", "node-a")
        (tmp / "b" / "keys").mkdir(parents=True, exist_ok=True)
        (tmp / "b" / "keys" / "node-a.pub").write_bytes(signer.public.read_bytes())
        fp = HostFingerprint.model_validate_json(warmctl("host", "--json", env=self.env).stdout)
        prof = load_profile_file(tmp / "b" / "profiles" / "tiny.toml")
        a = open_store(tmp / "a" / "store", chunk_size=CH)
        rnd = random.Random(7)
        self.shm = f"warmctl-test-damaged-{uuid.uuid4().hex[:12]}"
        files = {"shm": rnd.randbytes(CH // 2), "core.img": rnd.randbytes(3000), "pages-1.img": rnd.randbytes(6 * CH)}
        entries = []
        for path, role in ((self.shm, "shm"), ("core.img", "image"), ("pages-1.img", "image")):
            src = tmp / f"payload-{role}-{len(entries)}"
            src.write_bytes(files["shm" if role == "shm" else path])
            entries.append(FileEntry(path=path, role=role, size=src.stat().st_size, chunks=a.add_file(src)))
        m = Manifest(name="tiny", profile_digest=prof.digest(), profile=prof.model_dump(mode="json"),
                     host=fp.model_dump(mode="json"),
                     canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]), files=entries)
        d = a.put_manifest(m)
        Catalog(a).publish(d, m, signer=signer.private)
        with open_store(self.remote, settings=self.settings) as r:
            for e in entries_to_copy(a, Ref(name="tiny", tag="latest"), only=d):
                copy_entry(a, r, e)
        a.close()
        # the damage: a chunk in the middle of pages-1.img (after the shm file and core.img)
        ref = entries[2].chunks[3]
        self.digest = ref.digest
        obj = self.remote / chunk_key(ref.digest)
        blob = obj.read_bytes()
        blob = flip_middle(blob) if kind == "sealed-flip" else blob + b"\0" * (frame_bound(ref.size) + 1)
        obj.chmod(0o644)
        obj.write_bytes(blob)

    def procs(self) -> list[psutil.Process]:
        """Live processes of node B: whose command line or working directory names its home."""
        return procs_under(self.home)

    def named(self) -> list[str]:
        """Snapshots named in B's local catalog."""
        store = self.home / "store"
        if not (store / "config").exists():
            return []
        with open_store(store) as s:
            return Catalog(s).names()

    def run(self, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
        """B's ``warmctl ARGS``: (the process, seconds it took); a hang fails at twice :data:`BOUND`."""
        t0 = time.monotonic()
        try:
            r = warmctl(*args, env=env or self.env, check=False, timeout=2 * BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`warmctl {' '.join(args)}` still running after {2 * BOUND} s: a read of the damaged chunk never ends")
        return r, time.monotonic() - t0

    def check_clean(self, shm_before: set[str]) -> None:
        assert self.named() == [], "a snapshot whose chunk is damaged is named in the local catalog"
        left = self.procs()
        for p in left:
            p.kill()
        assert left == [], f"processes left behind: {left}"
        assert not (Path("/dev/shm") / self.shm).exists()
        assert {n for n in shm_leaked(shm_before) if not n.startswith("tmp:")} == set()  # /dev/shm files


@pytest.fixture(params=KINDS)
def node(request, tmp_path, engine_ports, monkeypatch):
    n = Node(tmp_path, request.param, *engine_ports, monkeypatch)
    yield n
    for p in n.procs():  # a failed test must not leave an agent or a gate behind
        p.kill()


@pytest.mark.parametrize("stream", ["never", "auto"])
def test_up_of_a_damaged_remote_ends_naming_the_chunk(node, stream):
    before = shm_names()
    env = dict(node.env, WARMCTL_RESTORE_STREAM=stream, WARMCTL_RESTORE_PAGES="eager")
    r, took = node.run("up", "tiny", "--cold-start", "never", env=env)
    assert r.returncode == ChunkCorrupt.exit_code, r.stdout + r.stderr
    assert took < BOUND, f"{took:.0f} s"
    assert node.digest in r.stderr and "corrupt" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    # written first: the image was being written ("materialize" fails). Streamed: the writer
    # fetches the image's files side by side, so the bad chunk ends either the wait for the
    # /dev/shm files CRIU needs first ("materialize": a grown object is refused by its size, before
    # any read, and can be reached before those files are whole) or CRIU's read of the image, its
    # pipes ended by the chunk's error ("restore"); never a later phase
    phases = ("failed restore", "failed materialize") if stream == "auto" else ("failed materialize",)
    assert any(p in r.stderr for p in phases), r.stderr
    node.check_clean(before)


def test_pull_of_a_damaged_remote_ends_naming_the_chunk(node):
    before = shm_names()
    r, took = node.run("pull", "tiny")
    assert r.returncode == ChunkCorrupt.exit_code, r.stdout + r.stderr
    assert took < BOUND and node.digest in r.stderr and "Traceback" not in r.stderr, r.stderr
    node.check_clean(before)


def test_the_agents_up_of_a_damaged_remote_ends_naming_the_chunk(node):
    before = shm_names()
    port = free_port()
    log = open(node.tmp / "agent.log", "w")
    agent = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(port)], env=node.env,
                             stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_agent_ready(url, agent, lambda: (node.tmp / "agent.log").read_text(), timeout_s=120)
        token = (node.home / "agent" / "token").read_text().strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as h:
            t0 = time.monotonic()
            job = h.post("/v1/engines/tiny/up", json={}).json()
            while (j := h.get(f"/v1/jobs/{job['id']}").json())["state"] in ("queued", "running"):
                assert time.monotonic() - t0 < BOUND, f"the agent's up still {j['state']} after {BOUND} s: {j['log'][-5:]}"
                time.sleep(0.2)
    finally:
        agent.terminate()
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        log.close()
    assert j["state"] == "failed", json.dumps(j)[:2000]
    assert j["error"]["type"] == "ChunkCorrupt" and j["error"]["exit_code"] == ChunkCorrupt.exit_code, j["error"]
    assert node.digest in j["error"]["message"], j["error"]
    node.check_clean(before)
