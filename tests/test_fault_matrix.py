"""The fault matrix run as tests: every cell of tests/fault_matrix.py's :data:`MATRIX` (remote x
sealed x path x fault) injects its fault at the remote and asserts one property:

- the command ends within the cell's bound and exits with its error class's code
  (warmctl.base.errors.EXIT_CODES), one error line naming the object (the chunk's digest, or a key
  of the remote) and the fault, no traceback;
- it names nothing it could not verify: the node's catalog (pull, up) or the remote's (push)
  names nothing new;
- it leaves no process of the node, no new ``/dev/shm`` file and no partial object: the node's
  store (and, for push and gc, the remote) verifies, and gc leaves no lock object;
- with the fault removed the same command succeeds, fetching (or sending) only what is missing:
  ``pull --json``/``push --json``'s ``chunks_copied``, ``up --json``'s ``fetched``.

The snapshot is the fake engine's (tests/fake_vllm.py, the real snapshot pipeline under real
CRIU), made once per session and pushed once per (remote, sealed) to a remote the module shares;
each cell reads it from a fresh node. A data fault edits one chunk object of the shared remote
(a directory's file; S3: put_object/delete_object through boto3) and puts it back after the
cell; a network fault puts a loopback proxy between the node and moto. Small bounds
(:data:`fault_matrix.SETTINGS`) keep each cell to seconds. Each cell's outcome and seconds are
written to ``build/fault-matrix.json`` (``scripts/reliability_table.py`` prints its summary).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest
from tests.conftest import fake_env, shm_leaked, shm_names, warmctl
from tests.fault_matrix import BOUND_S, DATA, FAULTS, MATRIX, SETTINGS, Cell

from warmctl.naming.catalog import Catalog
from warmctl.records.config import Settings
from warmctl.base.errors import EXIT_CODES
from warmctl.store import chunk_key, maintenance, open_backend, open_store
from warmctl.store.sealed import load_key, seal_store

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "build" / "fault-matrix.json"
_results: dict[str, dict] = {}


class Remote:
    """One remote holding the fake snapshot: ``url``, ``env`` (what a process needs to read it:
    endpoint, fleet key), ``settings`` (the same, for this process), and direct access to its
    objects (``get``/``put``/``delete`` by key under the store's root), bypassing warmctl."""

    def __init__(self, kind: str, seal: str, tmp: Path, moto: str | None):
        self.kind, self.seal, self.tmp, self.moto = kind, seal, tmp, moto
        self.env: dict[str, str] = {}
        kw: dict = {}
        if seal == "sealed":
            key = tmp / "fleet.key"
            if not key.exists():
                key.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
                key.chmod(0o600)
            self.key = key
            self.env["WARMCTL_SEAL_KEY"] = str(key)
            kw["seal_key"] = key
        if kind == "s3":
            import boto3

            self.s3 = boto3.client("s3", endpoint_url=moto, region_name="us-east-1")
            self.bucket = f"fm-{uuid.uuid4().hex[:12]}"
            self.s3.create_bucket(Bucket=self.bucket)
            self.prefix = "snaps"
            self.url = f"s3://{self.bucket}/{self.prefix}"
            self.env.update(WARMCTL_S3_ENDPOINT=moto, AWS_ACCESS_KEY_ID=os.environ["AWS_ACCESS_KEY_ID"],  # type: ignore[arg-type]
                            AWS_SECRET_ACCESS_KEY=os.environ["AWS_SECRET_ACCESS_KEY"], AWS_DEFAULT_REGION="us-east-1")
            kw["s3_endpoint"] = moto
        else:
            self.dir = tmp / f"remote-{uuid.uuid4().hex[:8]}"
            self.url = str(self.dir)
        self.settings = Settings(**kw)
        if seal == "sealed":
            seal_store(open_backend(self.url, settings=self.settings, unseal=False), load_key(self.key))

    def fresh(self) -> "Remote":
        """Another, empty remote of the same kind (sealed for the same key)."""
        return Remote(self.kind, self.seal, self.tmp, self.moto)

    def get(self, key: str) -> bytes:
        if self.kind == "s3":
            return self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()
        return (self.dir / key).read_bytes()

    def put(self, key: str, data: bytes) -> None:
        if self.kind == "s3":
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)
        else:
            p = self.dir / key
            if p.exists():
                p.chmod(0o644)
            p.write_bytes(data)

    def delete(self, key: str) -> None:
        if self.kind == "s3":
            self.s3.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")
        else:
            (self.dir / key).unlink()

    def keys(self, under: str) -> list[str]:
        if self.kind == "s3":
            out = []
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/{under}"):
                out += [o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", [])]
            return out
        d = self.dir / under
        return [str(p.relative_to(self.dir)) for p in d.rglob("*") if p.is_file()] if d.exists() else []

    def store(self):
        return open_store(self.url, settings=self.settings)


class World:
    """The module's shared state: node A (the session's fake home, which made the snapshot), its
    snapshot's chunks, and one remote per (kind, sealed) holding it, made on first use."""

    def __init__(self, a_env: dict[str, str], digest: str, tmp: Path, moto_factory):
        self.a_env, self.digest, self.tmp, self.moto_factory = a_env, digest, tmp, moto_factory
        self.remotes: dict[tuple[str, str], Remote] = {}
        with open_store(Path(a_env["WARMCTL_TEST_HOME"]) / "store") as a:
            m = a.get_manifest(digest)
        self.refs = {c.digest: c for f in m.files for c in f.chunks}
        self.nchunks = len(self.refs)
        big = max(m.files, key=lambda f: len(f.chunks))
        self.target = big.chunks[len(big.chunks) // 2].digest  # the object each data fault damages
        self.other = next(c.digest for c in big.chunks if c.digest != self.target)
        self.a_pub = next((Path(a_env["WARMCTL_CONFIG"]).parent / "keys").glob("local-*.pub"))

    def remote(self, kind: str, seal: str, empty: bool = False) -> Remote:
        moto = self.moto_factory() if kind == "s3" else None
        if empty:
            return Remote(kind, seal, self.tmp, moto)
        if (kind, seal) not in self.remotes:
            r = Remote(kind, seal, self.tmp, moto)
            warmctl("push", "fake", "--to", r.url, env={**self.a_env, **r.env}, timeout=300)
            self.remotes[(kind, seal)] = r
        return self.remotes[(kind, seal)]


@pytest.fixture(scope="module")
def world(fk_env, fake_snapshot, tmp_path_factory, request):
    def moto():
        return request.getfixturevalue("moto_endpoint")

    yield World(fk_env, fake_snapshot["digest"], tmp_path_factory.mktemp("fault-matrix"), moto)
    if _results:  # merged into the file's cells: a run of some cells updates theirs
        RESULTS.parent.mkdir(exist_ok=True)
        cells = json.loads(RESULTS.read_text())["cells"] if RESULTS.exists() else {}
        cells.update(_results)
        RESULTS.write_text(json.dumps({"cells": cells, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                      indent=1) + "\n")


class Node:
    """A fresh node (its own home and store) that trusts A's key and reads ``remote``."""

    def __init__(self, root: Path, a_env: dict[str, str], a_pub: Path, remote: Remote, engine_ports):
        self.root = root
        hold = Path(a_env["WARMCTL_CONFIG"]).parent / "hold"  # the same fake profile as A's
        self.env = fake_env(root, *engine_ports, hold=hold)
        (root / "keys").mkdir(exist_ok=True)
        shutil.copy(a_pub, root / "keys" / "a.pub")
        self.env.update({**remote.env, **SETTINGS, "WARMCTL_REMOTE_STORE": remote.url})
        self.home = Path(self.env["WARMCTL_TEST_HOME"])
        self.store_dir = self.home / "store"

    def chunks(self) -> dict[str, int]:
        """The node's committed chunk objects: name -> stored bytes (temporary files left out)."""
        if not (self.store_dir / "chunks").exists():
            return {}
        return {p.name: p.stat().st_size for p in (self.store_dir / "chunks").rglob("*")
                if p.is_file() and not p.name.startswith(".")}

    def named(self) -> list[str]:
        if not (self.store_dir / "config").exists():
            return []
        with open_store(self.store_dir) as s:
            return Catalog(s).names()

    def verifies(self, refs: dict) -> None:
        """Every chunk object in the node's store is one of the snapshot's (``refs``: digest ->
        ChunkRef) and reads back whole (its digest checked)."""
        if (self.store_dir / "config").exists():
            with open_store(self.store_dir) as s:
                intact(s, refs)

    def procs(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and (str(self.home) in " ".join(p.cmdline()) or str(self.home) in p.cwd()):
                    out.append(p)
            except (psutil.Error, OSError):
                continue
        return out


def intact(store, refs: dict) -> None:
    """Every chunk object ``store`` holds is one of ``refs`` (digest -> ChunkRef) and reads back
    whole, its digest checked (a partial or damaged object raises), and ``maintenance.verify``
    of its manifests passes."""
    keys = {chunk_key(d) for d in refs}
    stray = {o.key for o in store.backend.list("chunks/") if o.key not in keys}
    assert stray == set(), f"objects that are no chunk of the snapshot: {sorted(stray)[:5]}"
    for ref in refs.values():
        if store.has_chunk(ref.digest):
            store.load_chunk(ref)
    assert maintenance.verify(store).ok


def _proxy(cell: Cell, moto: str, push: bool):
    """The loopback proxy between the node and moto for a network fault: (proxy, url)."""
    from tcp_proxy import TcpProxy
    from test_store_proxy import FaultProxy

    if cell.fault == "5xx":
        p = FaultProxy(moto).start()
        everything = cell.path == "gc"
        p.fault = lambda method, path, n: "503" if everything or "/chunks/" in path else None
        return p, p.url
    t = TcpProxy(moto).start()
    if cell.fault == "stall":
        t.stall = True
    elif push:
        t.trickle = ("up", 16 << 10, 0.05, 1 << 10)  # 20 KiB/s against a 64 MiB/s minimum
    else:
        t.trickle = ("down", 64 << 10, 0.2)  # 64 KiB, then a byte every 0.2 s
    return t, t.url


def _damage(remote: Remote, world: World, fault: str) -> bytes:
    """Inject a data fault in the chunk object of ``world.target``; returns its bytes to restore."""
    key = chunk_key(world.target)
    good = remote.get(key)
    if fault == "flip":
        b = bytearray(good)
        b[len(b) // 2] ^= 0x01
        remote.put(key, bytes(b))
    elif fault == "truncate":
        remote.put(key, good[: len(good) // 2])
    elif fault == "swap":
        remote.put(key, remote.get(chunk_key(world.other)))
    else:
        remote.delete(key)
    return good


def _command(cell: Cell, remote: Remote, json_out: bool) -> list[str]:
    j = ["--json"] if json_out else []
    return {"push": ["push", "fake", "--to", remote.url, *j],
            "pull": ["pull", "fake", *j],
            "up": ["up", "fake", "--cold-start", "never", *j],
            "up-stream": ["up", "fake", "--cold-start", "never", *j],
            "verify": ["verify", "--store", remote.url],
            "gc": ["gc", "--store", remote.url, "--grace", "0"]}[cell.path]


@pytest.mark.e2e
@pytest.mark.s3
@pytest.mark.parametrize("cell", MATRIX, ids=lambda c: c.id)
def test_fault(cell: Cell, world: World, tmp_path, engine_ports):
    t_cell = time.monotonic()
    push = cell.path == "push"
    remote = world.remote(cell.remote, cell.seal, empty=push)
    node = Node(tmp_path / "node", world.a_env, world.a_pub, remote, engine_ports)
    env = dict(world.a_env, **remote.env, **SETTINGS) if push else node.env
    if cell.path == "up-stream":
        env["WARMCTL_RESTORE_STREAM"] = "auto"
    elif cell.path == "up":
        env["WARMCTL_RESTORE_STREAM"] = "never"
    env["WARMCTL_RESTORE_PAGES"] = "eager"
    before = shm_names()
    good, proxy = None, None
    if cell.fault in DATA:
        good = _damage(remote, world, cell.fault)
        names = [world.target]
    else:
        proxy, url = _proxy(cell, remote.moto, push)  # type: ignore[arg-type]
        env = dict(env, WARMCTL_S3_ENDPOINT=url)
        names = [f"{remote.url}/"]
    try:
        t0 = time.monotonic()
        try:
            r = warmctl(*_command(cell, remote, False), env=env, check=False, timeout=2 * cell.bound_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{cell.id}: still running after {2 * cell.bound_s} s")
        took = time.monotonic() - t0
    finally:
        if proxy is not None:
            proxy.stop()
        if good is not None:
            remote.put(chunk_key(world.target), good)
    out = r.stdout + r.stderr
    _results[cell.id] = {"exit": r.returncode, "seconds": round(took, 1)}
    left = node.procs()
    for p in left:
        p.kill()
    code = EXIT_CODES[cell.exit][0]
    assert r.returncode == code, f"{cell.id}: exit {r.returncode}, not {code} ({cell.exit})\n{out[-3000:]}"
    assert took < cell.bound_s, f"{cell.id}: {took:.1f} s"
    assert "Traceback" not in out, out[-3000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert err, r.stderr[-3000:]
    # verify reports each damaged chunk on stdout, its error line sums them up
    said = out if cell.path == "verify" else r.stderr
    assert any(n in said for n in names), f"{cell.id}: {names} not named\n{out[-3000:]}"
    assert cell.says in r.stderr, f"{cell.id}: the fault ({cell.says!r}) not named\n{r.stderr[-3000:]}"
    # names nothing it could not verify; leaves no process, /dev/shm file or partial object
    assert node.named() == []
    assert left == [], f"processes left: {left}"
    assert {n for n in shm_leaked(before) if not n.startswith("tmp:")} == set()
    node.verifies(world.refs)
    if push:
        with remote.store() as s:
            assert Catalog(s).names() == [], "a push that failed named its snapshot"
            intact(s, world.refs)
    if cell.path == "gc":
        assert remote.keys("locks/") == [], "a failed gc left its lock"
        with remote.store() as s:
            intact(s, world.refs)

    # the fault removed: the same command succeeds, moving only what is missing
    env = dict(env, WARMCTL_S3_ENDPOINT=remote.moto) if proxy is not None else env
    have = node.chunks()
    if push:
        sent = len({k.rsplit("/", 1)[-1] for k in remote.keys("chunks/")})
    _results[cell.id]["kept"] = len(have) if not push else sent
    r2 = warmctl(*_command(cell, remote, cell.path not in ("verify", "gc")), env=env, check=False, timeout=300)
    try:
        assert r2.returncode == 0, f"{cell.id}: the rerun failed\n{(r2.stdout + r2.stderr)[-3000:]}"
        if cell.path in ("pull", "push"):
            [rep] = json.loads(r2.stdout)
            done = len(have) if cell.path == "pull" else sent
            assert rep["chunks_copied"] == rep["chunks_total"] - done, (rep, done)
        elif cell.path in ("up", "up-stream"):
            res = json.loads(r2.stdout)
            assert res["source"] == "restore", res
            # the chunks the failed run committed are read locally, only the others fetched
            now = node.chunks()
            assert len(now) == world.nchunks and set(have) <= set(now)
            assert res["fetched"] == {"remote": sum(n for c, n in now.items() if c not in have),
                                      "local": sum(have.values())}, (res["fetched"], len(have))
    finally:
        if cell.path in ("up", "up-stream"):
            warmctl("down", "fake", env=env, check=False)
    _results[cell.id]["cell_seconds"] = round(time.monotonic() - t_cell, 1)


def test_the_reliability_table_is_the_matrix():
    """docs/reliability.md's fault-matrix section is what scripts/reliability_table.py makes of
    tests/fault_matrix.py (run it to update the doc)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reliability_table", ROOT / "scripts" / "reliability_table.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    doc = (ROOT / "docs" / "reliability.md").read_text()
    assert mod.section(doc) == mod.table(), "docs/reliability.md's fault matrix differs: run scripts/reliability_table.py"
    listed = {(ln.split(" | ")[0][3:-1], ln.split(" | ")[1].split(":")[0], where)
              for ln in mod.table().splitlines() if ln.startswith("| `") for where in ln.split(" | ")[2].split(", ")}
    assert listed == {(c.path, c.fault, f"{c.remote} {c.seal}") for c in MATRIX}
    assert set(BOUND_S) == set(FAULTS)
    assert re.search(r"\d+ cells", mod.table())
