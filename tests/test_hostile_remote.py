"""A hostile remote store (someone who can write its files or objects, but cannot sign)
can do nothing to a node. Each numbered attack of the issue, against a real directory remote
(and the moto S3 server where it translates), with two homes: A publishes with its own key, B
trusts only A's public key and pulls, restores (up to the point where the synthetic snapshot's
profile stops it, before anything starts) and collects from the remote. No engine is started:
every refusal here happens before one would be."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from tests.conftest import isolated_env, warmctl
from test_catalog import publish_snapshot

from warmctl.naming.catalog import Accepted, Catalog, Ref, RollbackRefused, entry_for, entry_key
from warmctl.base.errors import IntegrityError, SnapshotNotFound
from warmctl.naming.fleet import copy_entry, entries_to_copy
from warmctl.host import HostFingerprint
from warmctl.store import StoreLocked, open_store
from warmctl.store.backend import RetryingBackend
from warmctl.store.layout import chunk_key
from warmctl.store.store import Store
from warmctl.store import maintenance
from warmctl.naming.trust import TrustError, generate_keypair

T0 = datetime.now(timezone.utc) - timedelta(days=30)
T1 = datetime.now(timezone.utc) - timedelta(hours=1)
SECRET = b"root:$y$j9T$not-really-a-shadow-line:19000:0:99999:7:::\n"


# ----------------------------------------------------------------------------- two homes


class Fleet:
    """Home A (publisher: its own key, its local store), the remote directory, home B (a node
    whose keys_dir trusts A's public key only). ``b_env``: the environment of B's ``warmctl``."""

    def __init__(self, tmp: Path, remote: str | None = None):
        self.tmp = tmp
        self.a_key = generate_keypair(tmp / "a" / "signing", "node-a")
        self.a = open_store(tmp / "a" / "home" / "store")
        self.remote_dir = tmp / "remote"
        self.remote_url = remote or str(self.remote_dir)
        self.b_env = isolated_env(tmp / "b", 18200, 18280)
        (tmp / "b" / "keys").mkdir(parents=True, exist_ok=True)
        (tmp / "b" / "keys" / "node-a.pub").write_bytes(self.a_key.public.read_bytes())
        self.b_env["WARMCTL_REMOTE_STORE"] = self.remote_url
        self.b_home = tmp / "b" / "home"
        self.b_keys = tmp / "b" / "keys"
        self._fp: HostFingerprint | None = None

    def remote(self) -> Store:
        return open_store(self.remote_url)

    def b(self) -> Store:
        return open_store(self.b_home / "store")

    def fp(self) -> HostFingerprint:
        """B's host fingerprint as B's warmctl computes it (synthetic snapshots record it)."""
        if self._fp is None:
            r = warmctl("host", "--json", env=self.b_env)
            self._fp = HostFingerprint.model_validate_json(r.stdout)
        return self._fp

    def publish(self, seed: int, created: datetime, tag: str = "latest", push: bool = True, **kw) -> str:
        d, m = publish_snapshot(self.a, self.tmp, self.fp(), seed, created=created, **kw)
        Catalog(self.a).publish(d, m, tag=tag, signer=self.a_key.private)
        if push:
            with self.remote() as r:
                for e in entries_to_copy(self.a, Ref(name=m.name, tag=tag), only=d):
                    copy_entry(self.a, r, e)
        return d

    def b_run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return warmctl(*args, env=self.b_env, check=False, timeout=timeout)


def tree(root: Path) -> dict[str, tuple[int, float]]:
    """path -> (size, mtime) of every file under ``root`` (links as links)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime)
    return out


def aged(root: Path, seconds: float) -> None:
    """Make every file under ``root`` ``seconds`` old."""
    t = time.time() - seconds
    for p in root.rglob("*"):
        os.utime(p, (t, t), follow_symlinks=False)


def _outside(tmp: Path, name: str) -> Path:
    """A directory outside both homes and the remote, holding old files (and a subdirectory)."""
    d = tmp / "outside" / name
    (d / "sub").mkdir(parents=True)
    (d / "precious.txt").write_text("keep me")
    (d / "sub" / "deep.txt").write_text("keep me too")
    aged(d, 7 * 86400)
    return d


def plant_unsigned(store: Store, tmp: Path, fp: HostFingerprint, seed: int, created: datetime) -> str:
    """What someone who can write the store but not sign can do: chunks, a manifest and an
    entry naming it (beside the others: nothing superseded)."""
    d, m = publish_snapshot(store, tmp, fp, seed, created=created)
    e = entry_for(m, d, "latest")
    store.backend.save(entry_key(e), e.model_dump_json().encode())
    return d


def no_partials(home: Path) -> None:
    left = [p for p in home.rglob("*") if ".partial-" in p.name or p.name.endswith(".tmp")]
    assert left == [], left


# ----------------------------------------------------------------------------- 1. gc outside the store


@pytest.mark.parametrize("where", ["locks", "tmp", "chunks", "signatures", "manifests/sha256"])
def test_1_gc_never_deletes_through_a_symlinked_directory(tmp_path, where):
    f = Fleet(tmp_path)
    f.publish(1, T1)
    other = tmp_path / "other-store"
    if where in ("chunks", "signatures", "manifests/sha256"):  # another store's objects, named like ours
        o = Fleet(tmp_path / "o")
        o.publish(2, T1, push=False)
        src = tmp_path / "o" / "a" / "home" / "store" / where
        other = src
        aged(src, 7 * 86400)
    else:
        other = _outside(tmp_path, where)
    before = tree(other)
    target = f.remote_dir / where
    if target.exists():
        import shutil

        shutil.rmtree(target)
    target.symlink_to(other, target_is_directory=True)
    r = f.b_run("gc", "--store", f.remote_url, "--grace", "0")
    assert tree(other) == before, "gc deleted outside the store"
    assert r.returncode == 5, r.stderr
    assert f"{target} is a symbolic link, not a directory" in r.stderr and "Traceback" not in r.stderr


def test_1_a_symlinked_object_is_never_removed_through(tmp_path):
    f = Fleet(tmp_path)
    d = f.publish(1, T1)
    victim = _outside(tmp_path, "victim") / "precious.txt"
    remote = f.remote()
    # an unreferenced "chunk" that is a link to a file outside: gc must not delete the file
    link = f.remote_dir / "chunks" / "blake3" / "ff" / ("ff" * 32)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    Catalog(remote).remove_tag("tiny", "latest")
    rep = maintenance.gc(remote, keep=Catalog(remote).referenced_manifests(), grace=0)
    assert victim.read_text() == "keep me"
    assert rep.manifests_removed == [d]
    assert link.is_symlink()  # left alone (a warning names it), not followed


def test_1_push_never_writes_through_a_symlinked_catalog_directory(tmp_path):
    f = Fleet(tmp_path)
    f.publish(1, T1, push=False)
    elsewhere = _outside(tmp_path, "catalog-target")
    before = tree(elsewhere)
    (f.remote_dir / "catalog").mkdir(parents=True)
    (f.remote_dir / "catalog" / "tiny").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(IntegrityError, match="catalog/tiny is a symbolic link, not a directory"):
        with f.remote() as r:
            for e in entries_to_copy(f.a, Ref(name="tiny")):
                copy_entry(f.a, r, e)
    assert tree(elsewhere) == before


# ----------------------------------------------------------------------------- 2. exfiltration


def test_2_a_signature_linked_to_a_secret_is_never_copied(tmp_path):
    f = Fleet(tmp_path)
    d = f.publish(1, T1)
    secret = tmp_path / "outside" / "shadow"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    sig_dir = f.remote_dir / "signatures" / "sha256" / d.split(":")[1]
    (sig_dir / "0123456789abcdef0123456789abcdef.json").symlink_to(secret)
    r = f.b_run("pull", "tiny")
    assert r.returncode == 0, r.stderr  # A's own signature is there: the pull goes on without the link
    assert "a symbolic link" in r.stderr and "0123456789abcdef" in r.stderr
    for p in (tmp_path / "b").rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert SECRET not in p.read_bytes(), f"{p} holds the secret"
    # and B's next push carries nothing of it onward
    onward = tmp_path / "onward"
    assert f.b_run("push", "tiny", "--to", str(onward)).returncode == 0
    assert not any(SECRET in p.read_bytes() for p in onward.rglob("*") if p.is_file())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.read_bytes() == SECRET


# ----------------------------------------------------------------------------- 3. rollback


def _roll_back(f: Fleet, old: str, new: str, tag: str = "latest") -> None:
    """What the attacker does: the old entry (and its still-valid signature, kept from before)
    put back under the tag, the new one removed."""
    cat = f.tmp / "saved"
    base = f.remote_dir / "catalog" / "tiny" / tag
    for suffix in (".json", ".sig"):
        (base / f"sha256-{old.split(':')[1]}{suffix}").write_bytes((cat / f"old{suffix}").read_bytes())
        (base / f"sha256-{new.split(':')[1]}{suffix}").unlink()


def _save_old(f: Fleet, old: str, tag: str = "latest") -> None:
    (f.tmp / "saved").mkdir(exist_ok=True)
    base = f.remote_dir / "catalog" / "tiny" / tag
    for suffix in (".json", ".sig"):
        (f.tmp / "saved" / f"old{suffix}").write_bytes((base / f"sha256-{old.split(':')[1]}{suffix}").read_bytes())


def test_3_rollback_to_an_older_signed_entry_is_refused_and_named(tmp_path):
    f = Fleet(tmp_path)
    old = f.publish(1, T0)
    _save_old(f, old)
    r = f.b_run("up", "tiny", "--cold-start", "never")
    # the synthetic snapshot's profile stops `up` before anything starts, after it said what it restores
    assert f"snapshot tiny:latest = {old}, created {T0.isoformat(timespec='seconds')} (30.0 days ago), " \
           f"signed by key {f.a_key.key_id}" in r.stderr, r.stderr
    new = f.publish(2, T1)
    r = f.b_run("up", "tiny", "--cold-start", "never")
    # T1 is an hour before collection: the age grows with the time the suite took to get here
    assert f"snapshot tiny:latest = {new}" in r.stderr and re.search(r"\(1\.\d h ago\)", r.stderr), r.stderr
    _roll_back(f, old, new)
    r = f.b_run("up", "tiny", "--cold-start", "never")
    assert r.returncode == 8, r.stderr
    assert "rollback refused" in r.stderr and old in r.stderr and new in r.stderr and "--allow-rollback" in r.stderr
    # asked for explicitly: by flag, or by digest
    r = f.b_run("up", "tiny", "--cold-start", "never", "--allow-rollback")
    assert f"snapshot tiny:latest = {old}" in r.stderr and "30.0 days ago" in r.stderr, r.stderr
    r = f.b_run("up", f"tiny@{old}", "--cold-start", "never")
    assert f"snapshot tiny@{old} = {old}" in r.stderr, r.stderr
    # pull refuses the same rollback
    r = f.b_run("pull", "tiny")
    assert r.returncode == 8 and "rollback refused" in r.stderr, r.stderr
    no_partials(f.b_home)


def test_3_a_newer_created_on_an_old_entry_breaks_its_signature(tmp_path):
    f = Fleet(tmp_path)
    old = f.publish(1, T0)
    new = f.publish(2, T1, tag="other")  # never named tiny:latest
    key = f.remote_dir / entry_key(Catalog(f.remote()).entries("tiny")[0])
    original = key.read_bytes()
    doc = json.loads(original)
    doc["created"] = (T1 + timedelta(days=1)).isoformat()
    key.write_text(json.dumps(doc))
    with pytest.raises(TrustError, match="its created is not the signed manifest's"):
        Catalog(f.remote()).resolve("tiny", f.fp(), f.b_keys)
    key.write_bytes(original)
    # the other tag's signed entry moved under latest: its signature covers its tag
    src = f.remote_dir / "catalog" / "tiny" / "other"
    dst = f.remote_dir / "catalog" / "tiny" / "latest"
    for p in src.iterdir():
        doc = p.read_bytes().replace(b'"tag":"other"', b'"tag":"latest"')
        (dst / p.name).write_bytes(doc)
    res = Catalog(f.remote()).resolve("tiny", f.fp(), f.b_keys)
    assert res.digest == old  # the moved one was passed over, with why
    assert [(s.digest, s.rule) for s in res.skipped] == [(new, "signature")]
    assert "does not verify" in res.skipped[0].reason


# ----------------------------------------------------------------------------- 4. names never checked


def test_4_an_unsigned_manifest_is_never_named_and_the_good_entry_stays(tmp_path):
    f = Fleet(tmp_path)
    good = f.publish(1, T1)
    assert f.b_run("pull", "tiny").returncode == 0
    before = sum(p.stat().st_size for p in (f.b_home / "store" / "chunks").rglob("*") if p.is_file())
    # the attacker's manifest (other chunks), unsigned, named tiny:latest with a newer created
    d = plant_unsigned(f.remote(), tmp_path, f.fp(), 9, T1 + timedelta(minutes=5))
    r = f.b_run("pull", "tiny")
    assert r.returncode == 0, r.stderr  # falls back to the signed one, saying why
    assert f"passed over {d} (newer, signature)" in r.stderr and "unsigned" in r.stderr
    b = f.b()
    assert [e.manifest for e in Catalog(b).entries("tiny")] == [good]
    assert not b.has_manifest(d)
    after = sum(p.stat().st_size for p in (f.b_home / "store" / "chunks").rglob("*") if p.is_file())
    assert after == before
    # only the unsigned one left: pull refuses it and names nothing
    Catalog(f.remote()).remove("tiny", "latest", good)
    r = f.b_run("pull", "tiny")
    assert r.returncode == 8 and "unsigned" in r.stderr
    assert [e.manifest for e in Catalog(f.b()).entries("tiny")] == [good]


def test_4_an_entry_that_says_another_name_is_not_used(tmp_path):
    f = Fleet(tmp_path)
    other = f.publish(1, T1, name="other")
    assert f.b_run("pull", "other").returncode == 0
    tiny = f.publish(2, T1 + timedelta(minutes=1))
    # the tiny entry's content rewritten to say "other", left under tiny/latest
    key = f.remote_dir / "catalog" / "tiny" / "latest" / f"sha256-{tiny.split(':')[1]}.json"
    key.write_bytes(key.read_bytes().replace(b'"name":"tiny"', b'"name":"other"'))
    r = f.b_run("pull", "tiny")
    assert r.returncode == 4 and "no snapshot tiny:latest" in r.stderr, r.stderr
    assert "not where it lives" in r.stderr
    assert [e.manifest for e in Catalog(f.b()).entries("other")] == [other]


# ----------------------------------------------------------------------------- 5. memory


MEMORY_PROBE = r"""
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from warmctl.naming.catalog import Catalog
from warmctl.host import HostFingerprint
from warmctl.store import open_store
fp = HostFingerprint.model_validate_json(open(sys.argv[3]).read())
try:
    Catalog(open_store(sys.argv[2])).resolve("tiny", fp, sys.argv[4])
except MemoryError:
    print("MemoryError"); sys.exit(3)
except Exception as e:
    print(type(e).__name__, str(e)[:300]); sys.exit(1)
print("resolved")
"""


def _baseline_vm(env) -> int:
    code = ("import warmctl.naming.catalog, warmctl.store, warmctl.host, resource;"
            "print(int(open('/proc/self/status').read().split('VmPeak:')[1].split()[0]) * 1024)")
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)


def test_5_huge_sparse_signature_and_entry_stay_bounded_under_an_address_space_limit(tmp_path):
    f = Fleet(tmp_path)
    d = f.publish(1, T1)
    (tmp_path / "fp.json").write_text(f.fp().model_dump_json())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    limit = _baseline_vm(env) + (768 << 20)  # 1 GiB objects cannot be read under this
    sig = f.remote_dir / "signatures" / "sha256" / d.split(":")[1] / ("e" * 32 + ".json")
    with open(sig, "wb") as fh:
        fh.truncate(1 << 30)  # a 1 GiB sparse "signature"
    big_entry = f.remote_dir / "catalog" / "tiny" / "latest" / ("sha256-" + "a" * 64 + ".json")
    with open(big_entry, "wb") as fh:
        fh.truncate(1 << 30)
    args = [sys.executable, "-c", MEMORY_PROBE, str(limit), f.remote_url, str(tmp_path / "fp.json"), str(f.b_keys)]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "resolved" in r.stdout, (r.stdout, r.stderr)
    assert "1,073,741,824 bytes, more than" in r.stderr  # both refused unread, each named
    # the node's pull does not copy the gigabyte either
    assert f.b_run("pull", "tiny").returncode == 0
    assert max(p.stat().st_size for p in f.b_home.rglob("*") if p.is_file()) < 1 << 20


def test_5_ls_remote_over_10000_entries_is_bounded(tmp_path):
    f = Fleet(tmp_path)
    d = f.publish(1, T1)
    base = f.remote_dir / "catalog" / "tiny" / "latest"
    doc = json.loads((base / f"sha256-{d.split(':')[1]}.json").read_text())
    for i in range(10_000):
        dig = f"sha256:{i:064x}"
        doc["manifest"] = dig
        (base / f"sha256-{i:064x}.json").write_text(json.dumps(doc))
    env = dict(f.b_env)
    t = time.monotonic()
    code = ("import resource,sys; resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]),) * 2);"
            "sys.argv = ['warmctl', 'ls', '--remote', '--json']; from warmctl.cli import main; main()")
    limit = _baseline_vm({**os.environ}) + (1 << 30)
    r = subprocess.run([sys.executable, "-c", code, str(limit)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert len(rows) == 10_001 and "MemoryError" not in r.stderr
    print(f"ls --remote over 10,001 entries: {time.monotonic() - t:.1f} s")


# ----------------------------------------------------------------------------- 6. disk


def test_6_bytes_after_a_chunk_frame_are_corruption_for_verify_pull_and_up(tmp_path):
    f = Fleet(tmp_path)
    d = f.publish(1, T1)
    m = f.remote().get_manifest(d)
    c = next(c for fe in m.files for c in fe.chunks)
    obj = f.remote_dir / chunk_key(c.digest)
    with open(obj, "r+b") as fh:
        fh.truncate(obj.stat().st_size + (2 << 30))  # +2 GiB, sparse
    r = f.b_run("verify", "--store", f.remote_url)
    assert r.returncode == 5 and c.digest in r.stdout and "more than the" in r.stdout, r.stdout
    r = f.b_run("pull", "tiny")
    assert r.returncode in (5, 20) and c.digest in r.stderr, r.stderr
    assert sum(p.stat().st_blocks * 512 for p in f.b_home.rglob("*") if p.is_file()) < 64 << 20
    no_partials(f.b_home)
    # a few trailing bytes (not enough to break the size bound) are corruption too
    with open(obj, "r+b") as fh:
        fh.truncate(obj.stat().st_size - (2 << 30) + 16)
    rep = maintenance.verify(f.remote())
    assert [p.digest for p in rep.corrupt] == [c.digest] and "follow the zstd frame" in rep.corrupt[0].reason


# ----------------------------------------------------------------------------- 7. hangs


def _fifo(p: Path) -> None:
    if p.exists():
        p.unlink()
    os.mkfifo(p)


@pytest.mark.parametrize("what", ["chunk", "entry", "manifest", "signature", "profile"])
def test_7_a_fifo_anywhere_is_an_error_never_a_hang(tmp_path, what):
    f = Fleet(tmp_path)
    d = f.publish(1, T1)
    hexd = d.split(":")[1]
    m = f.remote().get_manifest(d)
    c = next(c for fe in m.files for c in fe.chunks)
    p = {"chunk": f.remote_dir / chunk_key(c.digest),
         "entry": f.remote_dir / "catalog" / "tiny" / "latest" / f"sha256-{hexd}.json",
         "manifest": f.remote_dir / "manifests" / "sha256" / hexd,
         "signature": f.remote_dir / "signatures" / "sha256" / hexd / f"{f.a_key.key_id}.json",
         "profile": f.remote_dir / "catalog" / "tiny" / "profile.json"}[what]
    _fifo(p)
    for args in (("pull", "tiny"), ("verify", "--store", f.remote_url), ("ls", "--remote")):
        t = time.monotonic()
        r = f.b_run(*args, timeout=60)
        assert time.monotonic() - t < 60
        assert "Traceback" not in r.stderr, r.stderr
        if args[0] == "pull" and what != "profile":  # the profile record is taken from the signed manifest
            assert r.returncode != 0 and (str(p) in r.stderr or "unsigned" in r.stderr or "no snapshot" in r.stderr), r.stderr
    no_partials(f.b_home)
    assert stat.S_ISFIFO(os.lstat(p).st_mode)


# ----------------------------------------------------------------------------- 8. denial of service


def test_8_an_unusable_newest_entry_falls_back_to_the_next_valid_one(tmp_path):
    f = Fleet(tmp_path)
    good = f.publish(1, T0)
    _save_old(f, good)
    # a newer, validly signed entry (it moved the tag) whose manifest then went missing; the
    # older entry put back beside it
    gone = f.publish(2, T1)
    base = f.remote_dir / "catalog" / "tiny" / "latest"
    for suffix in (".json", ".sig"):
        (base / f"sha256-{good.split(':')[1]}{suffix}").write_bytes((tmp_path / "saved" / f"old{suffix}").read_bytes())
    (f.remote_dir / "manifests" / "sha256" / gone.split(":")[1]).unlink()
    r = f.b_run("up", "tiny", "--cold-start", "never")
    assert f"passed over {gone} (newer, integrity)" in r.stderr and "is missing" in r.stderr, r.stderr
    assert f"snapshot tiny:latest = {good}" in r.stderr
    # the synthetic snapshot was not made from the shipped tiny profile: `up` stops there, nothing started
    assert r.returncode == 4 and "not cold-starting tiny" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("body", [b"\xff\xfegarbage", b"[" * 100_000 + b"]" * 100_000, b'{"format": 1}'])
def test_8_a_bad_profile_record_is_a_clear_error_never_a_traceback(tmp_path, body):
    f = Fleet(tmp_path)
    d = f.publish(1, T1)
    (f.remote_dir / "catalog" / "tiny" / "profile.json").write_bytes(body)
    with pytest.raises(Exception) as e:
        Catalog(f.remote()).profile("tiny")
    assert type(e.value).__name__ == "CatalogError" and "profile record" in str(e.value)
    r = f.b_run("pull", "tiny")  # the local record comes from the signed manifest
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert Catalog(f.b()).profile("tiny")["profile"] == f.remote().get_manifest(d).profile
    r = f.b_run("catalog", "show", "tiny")
    assert "Traceback" not in r.stderr


def test_8_a_forged_lock_is_judged_by_its_mtime_and_lifetime(tmp_path):
    f = Fleet(tmp_path)
    f.publish(1, T1, push=False)
    locks = f.remote_dir / "locks"
    locks.mkdir(parents=True)
    forged = {"kind": "exclusive", "host": "evil", "pid": 1, "time": time.time() + 10**9,
              "purpose": "gc", "stale_after": 10**9}
    (locks / "forged").write_text(json.dumps(forged))
    aged(locks, 700)  # written 700 s ago and never refreshed: past any lifetime a lock may claim
    t = time.monotonic()
    with f.remote() as r:
        for e in entries_to_copy(f.a, Ref(name="tiny")):
            copy_entry(f.a, r, e)
    assert time.monotonic() - t < 10
    # a future mtime is no better
    future = time.time() + 10**6
    os.utime(locks / "forged", (future, future))
    with f.remote() as r:
        r.lock_for_write("probe")
    # a fresh forged lock is waited on for the writer's lock_wait, with a line naming it, then refused
    (locks / "forged").write_text(json.dumps({**forged, "time": time.time()}))
    s = Store(open_store(f.remote_url).backend, lock_wait=1.0)
    with pytest.raises(StoreLocked, match="exclusive lock by gc .host evil, pid 1"):
        s.lock_for_write("probe")


# ----------------------------------------------------------------------------- S3 (moto)


def test_s3_sizes_names_rollback_and_streamed_listing(tmp_path, s3_url):
    f = Fleet(tmp_path, remote=s3_url)
    old = f.publish(1, T0)
    remote = f.remote()
    b = f.b_keys
    acc = Accepted(tmp_path / "b-accepted")
    cat = Catalog(remote)
    old_entry, old_sig = (remote.backend.load(k) for k in (entry_key(cat.entries("tiny")[0]),
                                                            entry_key(cat.entries("tiny")[0])[:-5] + ".sig"))
    assert cat.resolve("tiny", f.fp(), b, accepted=acc).digest == old
    new = f.publish(2, T1)
    assert cat.resolve("tiny", f.fp(), b, accepted=acc).digest == new
    # rollback: the old entry and its signature put back, the new one removed
    hx_old = old.split(":")[1]
    remote.backend.save(f"catalog/tiny/latest/sha256-{hx_old}.json", old_entry)
    remote.backend.save(f"catalog/tiny/latest/sha256-{hx_old}.sig", old_sig)
    cat.remove("tiny", "latest", new)
    with pytest.raises(RollbackRefused, match="rollback refused"):  # a TrustError (exit 8)
        cat.resolve("tiny", f.fp(), b, accepted=acc)
    assert cat.resolve("tiny", f.fp(), b, accepted=acc, allow_rollback=True).digest == old
    # sizes: a 2 MiB entry and a 2 MiB signature object are refused by their size, unread
    remote.backend.save(f"catalog/tiny/latest/sha256-{'b' * 64}.json", b" " * (2 << 20))
    remote.backend.save(f"signatures/sha256/{hx_old}/{'c' * 32}.json", b" " * (2 << 20))
    assert cat.resolve("tiny", f.fp(), b, allow_rollback=True).digest == old
    # a name: an unsigned manifest named tiny:latest is passed over
    d = plant_unsigned(remote, tmp_path, f.fp(), 9, T1 + timedelta(hours=1))
    res = cat.resolve("tiny", f.fp(), b, allow_rollback=True)
    assert res.digest == old and res.skipped[0].digest == d and "unsigned" in res.skipped[0].reason
    # a chunk padded after its frame
    c = next(c for fe in remote.get_manifest(old).files for c in fe.chunks)
    blob = remote.backend.load(chunk_key(c.digest))
    remote.backend.save(chunk_key(c.digest), blob + b"\0" * (1 << 20))
    rep = maintenance.verify(remote, [old])
    assert [p.digest for p in rep.corrupt] == [c.digest] and "more than the" in rep.corrupt[0].reason
    # listings are streamed: more than a page (1,000 keys), each yielded as it comes
    rb = remote.backend
    assert isinstance(rb, RetryingBackend)
    for i in range(1_100):
        rb.inner.save(f"junk/{i:05d}", b"x")
    it = rb.list("junk/")
    first = next(it)
    assert first.key.startswith("junk/") and sum(1 for _ in it) == 1_099
    with pytest.raises(SnapshotNotFound):
        Catalog(remote).resolve("ghost", f.fp(), b)


# ----------------------------------------------------------------------------- older entries


def test_an_entry_from_before_signed_entries_is_refused_until_its_publisher_pushes_it(tmp_path):
    """Backward compatibility: an entry without a signature (written by an older warmctl) is
    refused by nodes, naming what to do; the publisher's `push` with signing_key signs it."""
    f = Fleet(tmp_path)
    d, m = publish_snapshot(f.a, tmp_path, f.fp(), 1, created=T1)
    Catalog(f.a).publish(d, m, signer=f.a_key.private)
    f.a.backend.remove(entry_key(Catalog(f.a).entries("tiny")[0])[: -len(".json")] + ".sig")  # as an older one wrote it
    a_env = isolated_env(tmp_path / "a", 18200, 18280)
    assert warmctl("push", "tiny", "--to", f.remote_url, env=a_env, check=False).returncode == 0
    r = f.b_run("pull", "tiny")
    assert r.returncode == 8 and "is unsigned" in r.stderr and "signing_key" in r.stderr, r.stderr
    a_env["WARMCTL_SIGNING_KEY"] = str(f.a_key.private)
    assert warmctl("push", "tiny", "--to", f.remote_url, env=a_env, check=False).returncode == 0
    r = f.b_run("pull", "tiny")
    assert r.returncode == 0, r.stderr
    assert [e.manifest for e in Catalog(f.b()).entries("tiny")] == [d]


def test_a_directory_where_an_object_goes_is_a_clear_error(tmp_path):
    f = Fleet(tmp_path)
    d, m = publish_snapshot(f.a, tmp_path, f.fp(), 1, created=T1)
    Catalog(f.a).publish(d, m, signer=f.a_key.private)
    (f.remote_dir / "catalog" / "tiny" / "latest" / f"sha256-{d.split(':')[1]}.json").mkdir(parents=True)
    with pytest.raises(IntegrityError, match=r"sha256-[0-9a-f]{64}\.json is a directory, not a regular file"):
        with f.remote() as r:
            for e in entries_to_copy(f.a, Ref(name="tiny")):
                copy_entry(f.a, r, e)
    import shutil

    shutil.rmtree(f.remote_dir / "catalog" / "tiny" / "latest")
    (f.remote_dir / "catalog" / "tiny" / "latest").write_text("a file where a directory goes")
    with pytest.raises(IntegrityError, match="catalog/tiny/latest is a regular file, not a directory"):
        with f.remote() as r:
            for e in entries_to_copy(f.a, Ref(name="tiny")):
                copy_entry(f.a, r, e)
