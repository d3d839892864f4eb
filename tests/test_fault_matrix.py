"""The fault matrix run as tests: every cell of tests/fault_matrix.py's :data:`MATRIX` (remote x
sealed x path x fault) injects its fault at the remote and asserts one property:

- the command ends within the cell's bound and exits with its error class's code
  (warmctl.base.errors.EXIT_CODES), one error line naming the object (the chunk's digest, or a key
  of the remote) and the fault, no traceback (the agent's ``up``: the job ends ``failed`` with
  that error, its class and exit code);
- it names nothing it could not verify: the node's catalog (pull, up) or the remote's (push)
  names nothing new;
- it leaves no process of the node, no new ``/dev/shm`` file and no partial object: the node's
  store (and, for push and gc, the remote) verifies, and gc leaves no lock object;
- with the fault removed the same command succeeds, fetching (or sending) only what is missing:
  ``pull --json``/``push --json``'s ``chunks_copied``, ``up --json``'s (the agent's job
  result's) ``fetched``.

The snapshot is the fake engine's (tests/fake_vllm.py, the real snapshot pipeline under real
CRIU), made once per session and pushed once per (remote, sealed) to a master remote; each cell
gets its own copy of it (a directory copied, a bucket copied object by object on the RGW), its
own node (home, store), and for a network fault its own loopback proxy, so the cells run side by
side: :func:`ran` runs every selected cell in a thread pool before the first test, and each
parametrized test asserts on its own cell's outcome (one pytest id per cell, the ids the table of
docs/reliability.md is made from). The engine's internal port is the snapshot's (CRIU restores
its socket, and its ``/dev/shm`` files under their recorded names), so the ``up``-family runs, the
failing ones and the reruns that serve, run one at a time per snapshot (:attr:`World.serving`):
more publishing homes, each with its own fake snapshot on other ports (:func:`_lane`), share
them out (:data:`LANES` in all), and the lanes run in a pool of their own beside the other cells. Small bounds (:data:`fault_matrix.SETTINGS`) keep each cell to
seconds. Each cell's outcome and seconds, and the matrix's wall time, are written to
``build/fault-matrix.json`` (``scripts/reliability_table.py`` prints its summary).

Its checks are its own (the cells' homes, processes and ``/dev/shm`` names), so it is marked
``fast_stream``: scripts/test.sh runs it in the fast stream, beside the engine stream's real
engines (tests/conftest.py, :func:`~tests.conftest.in_engine_stream`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from tests.conftest import FAKE_PORT_OFFSET, fake_env, procs_under, shm_leaked, shm_names, snapshot_once, stop_process, wait_agent_ready, warmctl
from tests.damage import damaged
from tests.fault_matrix import BOUND_S, DATA, FAULTS, MATRIX, RERUN_SETTINGS, SETTINGS, Cell

from warmctl.base.errors import EXIT_CODES
from warmctl.naming.catalog import Catalog
from warmctl.records.config import Settings
from warmctl.store import chunk_key, maintenance, open_backend, open_store
from warmctl.store.sealed import load_key, seal_store

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "build" / "fault-matrix.json"
#: cells other than the up-family run side by side (each mostly waits: on its fault's bound, on the CLI's processes;
#: fewer leave the one-at-a-time up-family, which sets the wall time, more of the two cores)
WORKERS = 4
UP_PATHS = ("up", "up-stream", "agent-up")
#: snapshots the up-family cells are shared out over (each restores one at a time): more lanes
#: cost a snapshot each and shorten the matrix's wall time while the two cores have room
LANES = 3


#: every registry the matrix started (its masters' and its cells'): stopped at the end whatever
#: happened (they run from worker threads, so the parent-death signal does not reach them)
_REGISTRIES: list = []
_REG_MU = threading.Lock()
#: ports a registry must not take: the lanes' engine ports (and those near them: the fake
#: profile's own), free only while their engine is down, and the registries' own
_TAKEN: set[int] = set()


def _registry_port() -> int:
    """A free port for a registry, none of :data:`_TAKEN` (the kernel hands a port just freed
    out again, so a port a lane chose earlier would come back)."""
    from ports import free_port

    with _REG_MU:
        while True:
            port = free_port()
            if port not in _TAKEN:
                _TAKEN.add(port)
                return port
#: largest pack of an OCI remote's push (``oci_pack_bytes``): a few chunks a pack, so a pack's
#: damage (truncated, gone) touches a few chunks and the reads within a pack are ranged
OCI_PACK_BYTES = 4 << 20


class Remote:
    """One remote: ``url``, ``env`` (what a process needs to read it: endpoint, credentials,
    fleet key), ``settings`` (the same, for this process), and direct access to its objects
    (``get``/``put``/``delete`` by key under the store's root), bypassing warmctl. ``rgw``:
    (endpoint, access key, secret key) of the S3 server. An ``oci`` remote is a repository of
    its own Distribution registry on loopback (plain HTTP, no login; ``tests/registry_server.py``),
    so the damage of one cell (an edit of the registry's storage on disk: its blobs are shared by
    the registry's repositories) reaches no other; its chunks live in pack blobs (:attr:`layout`:
    chunk digest -> (pack digest, offset, length), read once from the master), damaged in place
    by :func:`_damage`. ``source``: the remote a copy is made of (its registry's storage,
    blobs hard-linked: an edit writes a new file)."""

    def __init__(self, kind: str, seal: str, tmp: Path, rgw: tuple[str, str, str] | None, key: Path | None,
                 seal_it: bool = True, source: "Remote | None" = None):
        self.kind, self.seal, self.tmp, self.rgw, self.key = kind, seal, tmp, rgw, key
        self.env: dict[str, str] = {}
        self.layout: dict[str, tuple[str, int, int]] = source.layout if source is not None else {}
        kw: dict = {}
        if seal == "sealed":
            self.env["WARMCTL_SEAL_KEY"] = str(key)
            kw["seal_key"] = key
        if kind == "rgw":
            import boto3

            ep, ak, sk = rgw  # type: ignore[misc]
            self.s3 = boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id=ak,
                                   aws_secret_access_key=sk)
            self.bucket = f"fm-{uuid.uuid4().hex[:12]}"
            self.s3.create_bucket(Bucket=self.bucket)
            self.prefix = "snaps"
            self.url = f"s3://{self.bucket}/{self.prefix}"
            self.endpoint = ep
            self.env.update(WARMCTL_S3_ENDPOINT=ep, AWS_ACCESS_KEY_ID=ak, AWS_SECRET_ACCESS_KEY=sk,
                            AWS_DEFAULT_REGION="us-east-1")
            kw["s3_endpoint"] = ep
        elif kind == "oci":
            from registry_server import Registry

            d = tmp / f"registry-{uuid.uuid4().hex[:8]}"
            self.reg = Registry(d, _registry_port())
            if source is not None:  # the source's storage: blobs hard-linked, the small link files copied
                v2 = Path("docker") / "registry" / "v2"
                src, dst = source.reg.data_dir() / v2, self.reg.data_dir() / v2
                shutil.copytree(src / "blobs", dst / "blobs", copy_function=os.link)
                shutil.copytree(src / "repositories", dst / "repositories")
            with _REG_MU:
                _REGISTRIES.append(self.reg)
            self.reg.start()
            self.host = self.reg.host
            self.endpoint = self.reg.url
            self.repo = "warmctl/fm"
            self.url = f"oci://{self.host}/{self.repo}"
            self.env.update(WARMCTL_OCI_INSECURE=self.host, WARMCTL_OCI_PACK_BYTES=str(OCI_PACK_BYTES))
            kw.update(oci_insecure=[self.host], oci_pack_bytes=OCI_PACK_BYTES)
        else:
            self.dir = tmp / f"remote-{uuid.uuid4().hex[:8]}"
            self.dir.mkdir()
            self.url = str(self.dir)
        self.settings = Settings(**kw)
        if seal == "sealed" and seal_it:
            seal_store(open_backend(self.url, settings=self.settings, unseal=False), load_key(key))  # type: ignore[arg-type]

    def copy(self) -> "Remote":
        """A new remote of the same kind holding the same objects (sealed alike)."""
        r = Remote(self.kind, self.seal, self.tmp, self.rgw, self.key, seal_it=False, source=self)
        if self.kind == "oci":
            return r
        if self.kind == "rgw":
            for k in self.keys(""):
                r.s3.copy_object(Bucket=r.bucket, Key=f"{r.prefix}/{k}",
                                 CopySource={"Bucket": self.bucket, "Key": f"{self.prefix}/{k}"})
        else:
            shutil.copytree(self.dir, r.dir, symlinks=True, dirs_exist_ok=True)
        return r

    def via(self, endpoint: str) -> str:
        """The URL of this remote through ``endpoint`` (a proxy): an OCI remote's URL names its
        registry's address; an S3 remote's endpoint is a setting (the URL is the same)."""
        return f"oci://{endpoint.split('://', 1)[1]}/{self.repo}" if self.kind == "oci" else self.url

    def close(self) -> None:
        """Stop this remote's registry (an OCI remote's; its storage stays)."""
        if self.kind == "oci":
            self.reg.stop()

    def read_layout(self) -> None:
        """:attr:`layout` of an OCI remote, from its snapshot artifacts and pack indexes."""
        if self.kind == "oci":
            b = open_backend(self.url, settings=self.settings, retry=False, unseal=False)
            try:
                b._scan()  # type: ignore[attr-defined]
                self.layout = dict(b._chunks)  # type: ignore[attr-defined]
            finally:
                b.close()

    def pack(self, digest: str) -> Path:
        """The file of the pack blob holding chunk ``digest`` in an OCI remote's registry storage."""
        return self.reg.blob_path(self.layout[digest][0])

    def in_pack(self, digest: str) -> list[str]:
        """The chunks stored in the pack of chunk ``digest`` (an OCI remote), or just it."""
        if self.kind != "oci":
            return [digest]
        return [d for d, loc in self.layout.items() if loc[0] == self.layout[digest][0]]

    def get(self, key: str) -> bytes:
        if self.kind == "rgw":
            return self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()
        return (self.dir / key).read_bytes()

    def put(self, key: str, data: bytes) -> None:
        if self.kind == "rgw":
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)
        else:
            p = self.dir / key
            if p.exists():
                p.chmod(0o644)
            p.write_bytes(data)

    def delete(self, key: str) -> None:
        if self.kind == "rgw":
            self.s3.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")
        else:
            (self.dir / key).unlink()

    def keys(self, under: str) -> list[str]:
        if self.kind == "oci":  # what the backend lists (its chunks: those of the packs its artifacts name)
            b = open_backend(self.url, settings=self.settings, retry=False, unseal=False)
            try:
                return [o.key for o in b.list(under)]
            finally:
                b.close()
        if self.kind == "rgw":
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
    snapshot's chunks, and one master remote per (kind, sealed) holding it."""

    def __init__(self, a_env: dict[str, str], digest: str, tmp: Path, rgw: tuple[str, str, str] | None,
                 engine_ports: tuple[int, int]):
        self.a_env, self.digest, self.tmp, self.rgw, self.engine_ports = a_env, digest, tmp, rgw, engine_ports
        self.masters: dict[tuple[str, str], Remote] = {}
        self.key = tmp / "fleet.key"
        self.key.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
        self.key.chmod(0o600)
        with open_store(Path(a_env["WARMCTL_TEST_HOME"]) / "store") as a:
            m = a.get_manifest(digest)
        self.refs = {c.digest: c for f in m.files for c in f.chunks}
        # the /dev/shm files a restore of this snapshot writes (others on a shared host are not its)
        self.shm = {f.path for f in m.files if f.role == "shm"}
        self.nchunks = len(self.refs)
        big = max(m.files, key=lambda f: len(f.chunks))
        self.target = big.chunks[len(big.chunks) // 2].digest  # the object each data fault damages
        self.other = next(c.digest for c in big.chunks if c.digest != self.target)
        self.a_pub = next((Path(a_env["WARMCTL_CONFIG"]).parent / "keys").glob("local-*.pub"))
        # the restores of the fake snapshot bind its internal port: see the module docstring
        self.serving = threading.Lock()

    def empty(self, kind: str, seal: str) -> Remote:
        return Remote(kind, seal, self.tmp, self.rgw, self.key)

    def master(self, kind: str, seal: str) -> Remote:
        r = self.empty(kind, seal)
        warmctl("push", "fake", "--to", r.url, env={**self.a_env, **r.env}, timeout=300)
        r.read_layout()
        self.masters[(kind, seal)] = r
        return r


class Node:
    """A fresh node (its own home and store) that trusts A's key and reads ``remote``."""

    def __init__(self, root: Path, world: World, remote: Remote):
        self.root = root
        hold = Path(world.a_env["WARMCTL_CONFIG"]).parent / "hold"  # the same fake profile as A's
        self.env = fake_env(root, *world.engine_ports, hold=hold)
        (root / "keys").mkdir(exist_ok=True)
        shutil.copy(world.a_pub, root / "keys" / "a.pub")
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
        return procs_under(self.home)


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


class Fault:
    """A network fault between a node and ``remote`` (its own loopback proxy): ``url`` the node
    uses; :meth:`clear` lifts the fault (the proxy stays, forwarding whole: a rerun, and an
    agent started with this endpoint, go through it)."""

    def __init__(self, cell: Cell, remote: Remote, world: World):
        from tcp_proxy import TcpProxy
        from test_store_proxy import FaultProxy

        self.cell = cell
        if cell.fault == "5xx":
            self.proxy = FaultProxy(remote.endpoint).start()
            everything = cell.path == "gc"
            if remote.kind == "oci":  # a chunk lives in a pack blob: its reads, and a push's uploads of blobs
                packs = {loc[0] for loc in remote.layout.values()}
                chunky = (lambda path: "/blobs/uploads/" in path) if cell.path == "push" else \
                    (lambda path: any(p in path for p in packs))
            else:
                chunky = lambda path: "/chunks/" in path  # noqa: E731
            self.proxy.fault = lambda method, path, n: "503" if everything or chunky(path) else None
            self.url = self.proxy.url
            return
        self.proxy = t = TcpProxy(remote.endpoint).start()
        self.url = t.url
        if cell.fault == "stall":
            t.stall = True
        elif cell.fault == "cut":  # the target's body cut 4 KiB in, the object deleted at that instant
            key = chunk_key(world.target)
            if remote.kind == "oci":  # the ranged GET of the target's bytes; its pack blob deleted
                _, off, n = remote.layout[world.target]
                t.cut = (f"bytes={off}-{off + n - 1}".encode(), 4096)
                t.on_cut = lambda: remote.pack(world.target).unlink()
            else:
                t.cut = (f"/{remote.bucket}/{remote.prefix}/{key}".encode(), 4096)
                t.on_cut = lambda: remote.delete(key)
        elif cell.path == "push":
            t.trickle = ("up", 16 << 10, 0.05, 1 << 10)  # 20 KiB/s against a 64 MiB/s minimum
        else:
            t.trickle = ("down", 64 << 10, 0.2)  # 64 KiB, then a byte every 0.2 s

    def clear(self) -> None:
        if self.cell.fault == "5xx":
            self.proxy.fault = None
        else:  # and the failed run's connections reset: a trickle in flight would finish its upload later
            self.proxy.stall, self.proxy.trickle, self.proxy.cut = False, None, None
            self.proxy.reset()

    def stop(self) -> None:
        self.proxy.stop()


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` as a new file (a registry's blob may be a hard link shared with the master)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _damage(remote: Remote, world: World, fault: str) -> bytes:
    """Inject a data fault in the chunk object of ``world.target``; returns its bytes to restore
    (:func:`_undamage`). In an OCI remote the chunk is a byte range of a pack blob: ``flip``
    flips its middle byte, ``swap`` writes another chunk's bytes over it (cut or padded with
    zeros to its length), ``truncate`` cuts the pack blob in the middle of it, ``vanish``
    deletes the pack blob (the registry still names it)."""
    if remote.kind == "oci":
        path = remote.pack(world.target)
        good = path.read_bytes()
        _, off, n = remote.layout[world.target]
        if fault == "vanish":
            path.unlink()
        elif fault == "truncate":
            _replace(path, good[: off + n // 2])
        else:
            o_pack, o_off, o_n = remote.layout[world.other]
            other = remote.reg.blob_path(o_pack).read_bytes()[o_off: o_off + o_n]
            _replace(path, good[:off] + damaged(good[off: off + n], fault, (other + bytes(n))[:n]) + good[off + n:])
        return good
    key = chunk_key(world.target)
    good = remote.get(key)
    if fault == "vanish":
        remote.delete(key)
    else:
        remote.put(key, damaged(good, fault, remote.get(chunk_key(world.other))))
    return good


def _undamage(remote: Remote, world: World, good: bytes) -> None:
    """Put back the bytes :func:`_damage` returned."""
    if remote.kind == "oci":
        _replace(remote.pack(world.target), good)
    else:
        remote.put(chunk_key(world.target), good)


def _command(cell: Cell, url: str, json_out: bool) -> list[str]:
    """The cell's command on the remote at ``url``."""
    j = ["--json"] if json_out else []
    return {"push": ["push", "fake", "--to", url, *j],
            "pull": ["pull", "fake", *j],
            "up": ["up", "fake", "--cold-start", "never", *j],
            "up-stream": ["up", "fake", "--cold-start", "never", *j],
            "verify": ["verify", "--store", url],
            "gc": ["gc", "--store", url, "--grace", "0"]}[cell.path]


class Agent:
    """``warmctl agent`` of a node on a free port; :meth:`up` runs its ``up`` job to its end."""

    def __init__(self, root: Path, env: dict[str, str]):
        from ports import free_port

        self.root, self.env = root, env
        self.log_path = root / "agent.log"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", self.url.rsplit(":", 1)[1]],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_agent_ready(self.url, self.proc, self.log_path.read_text, timeout_s=120)
        token = (Path(env["WARMCTL_TEST_HOME"]) / "agent" / "token").read_text().strip()
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def job(self, route: str, body: dict, wait_s: float) -> dict:
        """POST ``route`` and poll its job until it ends (AssertionError after ``wait_s``)."""
        t0 = time.monotonic()
        job = self.http.post(route, json=body).json()
        assert "id" in job, job
        while (j := self.http.get(f"/v1/jobs/{job['id']}").json())["state"] in ("queued", "running"):
            assert time.monotonic() - t0 < wait_s, f"the agent's job still {j['state']} after {wait_s} s: {j['log'][-5:]}"
            time.sleep(0.1)
        return j

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc)
        self.log.close()


def run_cell(cell: Cell, world: World, root: Path) -> dict:
    """Run ``cell`` (see the module docstring); its record: ``exit``, ``seconds`` (the failing
    command), ``kept``, ``cell_seconds``. Raises AssertionError naming what does not hold."""
    held: dict = {}
    try:
        return _run_cell(cell, world, root, held)
    finally:  # what a failed check left running
        if "agent" in held:
            held["agent"].stop()
        if "fault" in held:
            held["fault"].stop()
        for p in held["node"].procs() if "node" in held else []:
            p.kill()
        if "remote" in held:
            held["remote"].close()


def _run_cell(cell: Cell, world: World, root: Path, held: dict) -> dict:
    t_cell = time.monotonic()
    push = cell.path == "push"
    master = world.masters[(cell.remote, cell.seal)]
    remote = held["remote"] = world.empty(cell.remote, cell.seal) if push else master.copy()
    url = remote.url  # the remote as the node reaches it (through the fault's proxy)
    node = held["node"] = Node(root / "node", world, remote)
    env = dict(world.a_env, **remote.env, **SETTINGS) if push else node.env
    env["WARMCTL_RESTORE_STREAM"] = "auto" if cell.path == "up-stream" else "never"
    env["WARMCTL_RESTORE_PAGES"] = "eager"
    rec: dict = {}
    good, fault = None, None
    # the chunks the error may name: the target, or in an OCI remote any chunk of the target's
    # pack when the fault is the pack's (cut short, gone: whichever chunk of it is read first)
    whole_pack = cell.fault in ("truncate", "vanish", "cut")
    if cell.fault in DATA:
        good = _damage(remote, world, cell.fault)
        names = remote.in_pack(world.target) if whole_pack else [world.target]
    else:
        fault = held["fault"] = Fault(cell, remote, world)
        if remote.kind == "oci":
            url = remote.via(fault.url)
            env = dict(env, WARMCTL_OCI_INSECURE=f"{remote.host},{url.split('/')[2]}")
            if not push:
                env["WARMCTL_REMOTE_STORE"] = url
            # a registry's errors name the object and the registry's address
            names = remote.in_pack(world.target) if cell.fault == "cut" else [f"{url}/", f" at {fault.url}"]
        else:
            env = dict(env, WARMCTL_S3_ENDPOINT=fault.url)
            names = [world.target] if cell.fault == "cut" else [f"{remote.url}/"]
    lock = world.serving
    agent = None
    try:
        if cell.path == "agent-up":
            agent = held["agent"] = Agent(root, env)
        with (lock if cell.path in UP_PATHS else _nothing()):
            shm_before = shm_names()
            t0 = time.monotonic()  # the command's time, not the wait for the lock
            if agent is not None:
                j = agent.job("/v1/engines/fake/up", {"cold_start": "never"}, 2 * cell.bound_s)
                took = time.monotonic() - t0
                assert j["state"] == "failed", json.dumps(j)[:2000]
                err = j["error"]
                code, said, says = err["exit_code"], err["message"], err["message"]
                assert err["type"] == cell.exit, err
                out = json.dumps(j)
            else:
                try:
                    r = warmctl(*_command(cell, url, False), env=env, check=False, timeout=2 * cell.bound_s)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{cell.id}: still running after {2 * cell.bound_s} s") from None
                took = time.monotonic() - t0
                out = r.stdout + r.stderr
                code, says = r.returncode, r.stderr
                # verify reports each damaged chunk on stdout, its error line sums them up
                said = out if cell.path == "verify" else r.stderr
                assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")], r.stderr[-3000:]
            if cell.path in UP_PATHS and (set(os.listdir("/dev/shm")) - shm_before) & world.shm:
                # the one run that may have written the snapshot's /dev/shm files now: none left
                shm_left = shm_leaked(shm_before) & world.shm
                assert shm_left == set(), f"{cell.id}: /dev/shm files left: {sorted(shm_left)}"
    finally:
        if good is not None:
            _undamage(remote, world, good)
        if fault is not None:
            if cell.fault == "cut" and remote.kind == "oci":  # the pack deleted mid-read: put back
                _replace(remote.pack(world.target), master.pack(world.target).read_bytes())
            elif cell.fault == "cut":
                remote.put(chunk_key(world.target), master.get(chunk_key(world.target)))
            fault.clear()
    try:
        rec.update(exit=code, seconds=round(took, 1))
        left = node.procs()
        if agent is not None:
            left = [p for p in left if p.pid != agent.proc.pid]
        for p in left:
            p.kill()
        want = EXIT_CODES[cell.exit][0]
        assert code == want, f"{cell.id}: exit {code}, not {want} ({cell.exit})\n{out[-3000:]}"
        assert took < cell.bound_s, f"{cell.id}: {took:.1f} s"
        assert "Traceback" not in out, out[-3000:]
        assert any(n in said for n in names), f"{cell.id}: {names} not named\n{out[-3000:]}"
        assert cell.says in says, f"{cell.id}: the fault ({cell.says!r}) not named\n{says[-3000:]}"
        if fault is not None and cell.fault == "cut":
            assert fault.proxy.cuts == 1, "the body was never cut"
        # names nothing it could not verify; leaves no process or partial object
        assert node.named() == []
        assert left == [], f"processes left: {left}"
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
        have = node.chunks()
        if push:
            sent = len({k.rsplit("/", 1)[-1] for k in remote.keys("chunks/")})
        rec["kept"] = len(have) if not push else sent
        with (lock if cell.path in UP_PATHS else _nothing()):
            try:
                if agent is not None:
                    j = agent.job("/v1/engines/fake/up", {"cold_start": "never"}, 300)
                    assert j["state"] == "succeeded", json.dumps(j)[:3000]
                    res = j["result"]
                else:
                    r2 = warmctl(*_command(cell, url, cell.path not in ("verify", "gc")), env={**env, **RERUN_SETTINGS},
                                 check=False, timeout=300)
                    assert r2.returncode == 0, f"{cell.id}: the rerun failed\n{(r2.stdout + r2.stderr)[-3000:]}"
                    if cell.path in ("pull", "push"):
                        [rep] = json.loads(r2.stdout)
                        done = len(have) if cell.path == "pull" else sent
                        assert rep["chunks_copied"] == rep["chunks_total"] - done, (rep, done)
                    res = json.loads(r2.stdout) if cell.path in UP_PATHS else None
                if res is not None:
                    assert res["source"] == "restore", res
                    # the chunks the failed run committed are read locally, only the others fetched
                    now = node.chunks()
                    assert len(now) == world.nchunks and set(have) <= set(now)
                    assert res["fetched"] == {"remote": sum(n for c, n in now.items() if c not in have),
                                              "local": sum(have.values())}, (res["fetched"], len(have))
            finally:
                if agent is not None:
                    agent.job("/v1/engines/fake/down", {}, 120)
                elif cell.path in UP_PATHS:
                    warmctl("down", "fake", env=env, check=False)
    finally:
        if agent is not None:
            agent.stop()
            held.pop("agent")
        if fault is not None:
            fault.stop()
            held.pop("fault")
    left = node.procs()
    for p in left:
        p.kill()
    assert left == [], f"processes left after the rerun: {left}"
    rec["cell_seconds"] = round(time.monotonic() - t_cell, 1)
    return rec


@contextmanager
def _nothing():
    yield


def _selected(request) -> list[Cell]:
    """The cells of this module's selected tests (all of :data:`MATRIX`, or what ``-k`` kept)."""
    out = []
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if item.module is sys.modules[__name__] and cs is not None and isinstance(cs.params.get("cell"), Cell):
            out.append(cs.params["cell"])
    return out


def _lane(tmp: Path, rgw, n: int) -> World:
    """Lane ``n``: another publishing home with its own fake snapshot, its engine on other ports
    (and so its own ``/dev/shm`` names): the ``up``-family cells of the lanes restore side by side."""
    from ports import free_port

    d = tmp / f"lane{n}"
    d.mkdir()
    with _REG_MU:
        ports = (free_port() - FAKE_PORT_OFFSET, free_port() - FAKE_PORT_OFFSET)
        _TAKEN.update(q for port in ports for q in range(port - 16, port + 17))
    env = fake_env(d / "a", *ports)
    return World(env, snapshot_once(env, "fake")["digest"], d, rgw, ports)


@pytest.fixture(scope="module")
def ran(request, fk_env, fake_snapshot, tmp_path_factory, engine_ports):
    """Every selected cell run (side by side, :data:`WORKERS` at a time): cell id -> ("ok",
    record) or ("failed", what) or ("skipped", why)."""
    cells = _selected(request)
    out: dict[str, tuple[str, object]] = {}
    rgw = None
    if any(c.remote == "rgw" for c in cells):
        try:
            rgw = request.getfixturevalue("ceph_rgw")
        except pytest.skip.Exception as e:
            out.update({c.id: ("skipped", str(e)) for c in cells if c.remote == "rgw"})
            cells = [c for c in cells if c.remote != "rgw"]
    if any(c.remote == "oci" for c in cells):
        from registry_server import missing_binary

        from tests.conftest import need_service

        try:
            missing = missing_binary()
            need_service(missing and f"{missing} missing: run scripts/install-test-services.sh", "WARMCTL_REQUIRE_REGISTRY")
        except pytest.skip.Exception as e:
            out.update({c.id: ("skipped", str(e)) for c in cells if c.remote == "oci"})
            cells = [c for c in cells if c.remote != "oci"]
    tmp = tmp_path_factory.mktemp("fault-matrix")
    mp = pytest.MonkeyPatch()
    if rgw is not None:  # this process's stores of the RGW (the checks) use its user's keys
        mp.setenv("AWS_ACCESS_KEY_ID", rgw[1])
        mp.setenv("AWS_SECRET_ACCESS_KEY", rgw[2])
    (tmp / "lane0").mkdir()
    worlds = [World(fk_env, fake_snapshot["digest"], tmp / "lane0", rgw, engine_ports)]
    ups = [c for c in cells if c.path in UP_PATHS]
    shm_before = shm_names()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            more = [pool.submit(_lane, tmp, rgw, n) for n in range(1, min(LANES, len(ups)))]
            kinds = sorted({(c.remote, c.seal) for c in cells})
            for _ in pool.map(lambda ks: worlds[0].master(*ks), kinds):
                pass
            worlds += [f.result() for f in more]
            up_kinds = sorted({(c.remote, c.seal) for c in ups})
            for _ in pool.map(lambda wk: wk[0].master(*wk[1]), [(w, k) for w in worlds[1:] for k in up_kinds]):
                pass
            lane = {c.id: worlds[k % len(worlds)] for k, c in enumerate(ups)}

            def one(i_cell):
                i, cell = i_cell
                try:
                    return cell.id, ("ok", run_cell(cell, lane.get(cell.id, worlds[0]), tmp / f"c{i:03d}-{cell.id}"))
                except AssertionError as e:
                    return cell.id, ("failed", str(e))
                except Exception:  # noqa: BLE001 - reported as the cell's failure
                    return cell.id, ("failed", traceback.format_exc())

            # the up-family, one at a time per lane (two threads each: one prepares while the other
            # runs), beside the rest
            with ThreadPoolExecutor(2 * len(worlds)) as up_pool:
                futs = [(up_pool if c.path in UP_PATHS else pool).submit(one, (i, c)) for i, c in enumerate(cells)]
                out.update(dict(f.result() for f in futs))
    finally:
        mp.undo()
        with _REG_MU:
            regs, _REGISTRIES[:] = list(_REGISTRIES), []
        for reg in regs:
            reg.stop()
    wall = time.monotonic() - t0
    leaked = shm_leaked(shm_before) & {n for w in worlds for n in w.shm}
    if leaked:  # the cells share /dev/shm: a file of the snapshots left is every cell's failure
        for cid, (state, _) in list(out.items()):
            if state == "ok":
                out[cid] = ("failed", f"/dev/shm files left by the matrix: {sorted(leaked)}")
    records = {cid: rec for cid, (state, rec) in out.items() if state == "ok"}
    for cid, (state, what) in out.items():
        if state == "failed":
            records[cid] = {"failed": str(what)[:300]}
    RESULTS.parent.mkdir(exist_ok=True)
    prev = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    merged = dict(prev.get("cells", {}), **records)  # a run of some cells updates theirs
    RESULTS.write_text(json.dumps({"cells": merged, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   "run": {"cells": len(cells), "wall_seconds": round(wall, 1), "workers": WORKERS, "lanes": len(worlds),
                                           "cores": os.cpu_count()}}, indent=1) + "\n")
    return out


@pytest.mark.e2e
@pytest.mark.fast_stream
@pytest.mark.s3
@pytest.mark.parametrize("cell", MATRIX, ids=lambda c: c.id)
def test_fault(cell: Cell, ran):
    state, what = ran[cell.id]
    if state == "skipped":
        pytest.skip(str(what))
    assert state == "ok", f"{cell.id}:\n{what}"


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
