"""Store API on the local backend: round trip, dedup, zero chunks, integrity, tags, verify, gc, du."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_store_fixtures import MiB, chunk_files, make_manifest, pull, push, snapshot, tag_of, write_payload

from warmctl.naming.catalog import Catalog, CatalogError, Ref
from warmctl.base.errors import HostError, IntegrityError
from warmctl.records.manifest import ChunkRef
from warmctl.store import (
    CHUNK_SIZE,
    Backend,
    LocalBackend,
    ObjectInfo,
    ObjectNotFound,
    RetryingBackend,
    Store,
    StoreLocked,
    TransientBackendError,
    chunk_key,
    open_store,
)
from warmctl.store import chunks as ck
from warmctl.store import maintenance


@pytest.fixture
def payload(tmp_path: Path) -> Path:
    return write_payload(
        tmp_path / "src" / "pages-1.img",
        [("random", 3 * MiB), ("zero", 2 * CHUNK_SIZE), ("text", 5 * MiB), ("random", 12345)],
    )


def test_round_trip_restores_identical_sparse_file(tmp_path, payload):
    store = open_store(tmp_path / "store")
    seen = []
    refs = store.add_file(payload, progress=seen.append)
    assert sum(seen) == payload.stat().st_size
    assert sum(r.size for r in refs) == payload.stat().st_size
    assert all(r.digest.startswith(ck.DIGEST_ALGORITHM + ":") for r in refs)
    dest = tmp_path / "out" / "deep" / "pages-1.img"
    got = []
    store.read_file(refs, dest, progress=got.append)
    assert dest.read_bytes() == payload.read_bytes()
    assert sum(got) == payload.stat().st_size
    # zero chunks are holes, not written blocks
    assert os.stat(dest).st_blocks * 512 < payload.stat().st_size - CHUNK_SIZE + 65536
    assert not [p for p in dest.parent.iterdir() if p.name != dest.name], "temp file left behind"
    store.close()


def test_zero_chunks_are_never_stored(tmp_path):
    f = write_payload(tmp_path / "z.img", [("zero", 3 * CHUNK_SIZE + 100)])
    store = open_store(tmp_path / "store")
    refs = store.add_file(f)
    assert len(refs) == 4
    assert chunk_files(tmp_path / "store") == []
    assert refs[0].digest == ck.hash_bytes(bytes(CHUNK_SIZE))  # an honest digest, recognisable by size
    d = store.put_manifest(make_manifest(store, "z", {"z.img": f}))
    store.read_file(store.get_manifest(d).files[0].chunks, tmp_path / "z.out")
    assert (tmp_path / "z.out").read_bytes() == bytes(3 * CHUNK_SIZE + 100)


def test_second_add_dedups(tmp_path, payload):
    store = open_store(tmp_path / "store")
    a = store.add_file(payload)
    n = len(chunk_files(tmp_path / "store"))
    mtimes = [p.stat().st_mtime_ns for p in chunk_files(tmp_path / "store")]
    b = Store(LocalBackend(tmp_path / "store")).add_file(payload)
    assert a == b
    assert len(chunk_files(tmp_path / "store")) == n == 4  # 5 chunks, one all-zero
    assert [p.stat().st_mtime_ns for p in chunk_files(tmp_path / "store")] == mtimes


def test_put_manifest_refuses_missing_chunk(tmp_path, payload):
    store = open_store(tmp_path / "store")
    m = make_manifest(store, "snap", {"pages-1.img": payload})
    victim = m.files[0].chunks[0].digest
    (tmp_path / "store" / chunk_key(victim)).unlink()
    fresh = open_store(tmp_path / "store")  # no cached knowledge
    with pytest.raises(IntegrityError) as ei:
        fresh.put_manifest(m)
    assert victim in str(ei.value) and str(tmp_path / "store" / chunk_key(victim)) in str(ei.value)
    assert fresh.list_manifests() == []


def test_manifests_by_digest_names_in_the_catalog(tmp_path, payload):
    store = open_store(tmp_path / "store")
    d = snapshot(store, "tiny", {"pages-1.img": payload})
    assert store.has_manifest(d)
    assert store.get_manifest(d).name == "tiny"
    assert tag_of(store, "tiny", "latest") == d
    assert tag_of(store, "tiny", "nope") is None
    assert not (tmp_path / "store" / "tags").exists()  # the store names nothing
    assert Ref.parse("tiny") == Ref(name="tiny", tag="latest") and Ref.parse("a:b") == Ref(name="a", tag="b")
    assert Ref.parse("a@sha256:" + "1" * 64).digest == "sha256:" + "1" * 64
    for bad in ("a@sha256:12", ":b", "a b", "a:b c", "a@md5:" + "1" * 64):
        with pytest.raises(CatalogError):
            Ref.parse(bad)
    # a corrupted manifest is caught by its digest
    mpath = tmp_path / "store" / "manifests" / "sha256" / d.split(":")[1]
    mpath.write_bytes(mpath.read_bytes().replace(b'"tiny"', b'"tinY"', 1))
    with pytest.raises(IntegrityError, match="corrupt"):
        store.get_manifest(d)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_read_file_names_bad_chunk_and_leaves_nothing(tmp_path, payload, damage):
    store = open_store(tmp_path / "store")
    refs = store.add_file(payload)
    bad = refs[-1]
    obj = tmp_path / "store" / chunk_key(bad.digest)
    blob = obj.read_bytes()
    if damage == "flip":
        obj.write_bytes(blob[:-40] + bytes([blob[-40] ^ 0xFF]) + blob[-39:])
    elif damage == "truncate":
        obj.write_bytes(blob[: len(blob) // 2])
    else:
        obj.unlink()
    dest = tmp_path / "out" / "pages-1.img"
    with pytest.raises(IntegrityError) as ei:
        open_store(tmp_path / "store").read_file(refs, dest)
    msg = str(ei.value)
    assert bad.digest in msg and str(obj) in msg and str(dest) in msg
    assert ("missing" if damage == "delete" else "corrupt") in msg
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_verify_reports_missing_and_corrupt(tmp_path, payload):
    store = open_store(tmp_path / "store")
    snapshot(store, "tiny", {"pages-1.img": payload})
    assert maintenance.verify(store).ok
    files = chunk_files(tmp_path / "store")
    files[0].unlink()
    files[1].write_bytes(b"garbage")
    rep = maintenance.verify(store)
    assert not rep.ok and len(rep.missing) == 1 and len(rep.corrupt) == 1
    assert rep.missing[0].location == str(files[0]) and rep.corrupt[0].location == str(files[1])
    assert "(tiny)" in str(rep)


def test_gc_removes_only_unreferenced(tmp_path, payload):
    store = open_store(tmp_path / "store")
    d1 = snapshot(store, "a", {"p.img": payload})
    other = write_payload(tmp_path / "other.img", [("random", 2 * MiB)], seed=7)
    d2 = snapshot(store, "b", {"p.img": other})
    store.close()
    before = len(chunk_files(tmp_path / "store"))
    assert maintenance.gc(store, grace=0).chunks_removed == 0
    cat = Catalog(store)
    assert cat.remove_tag("b", "latest") == [d2]
    store.close()
    rep = maintenance.gc(store, keep=cat.referenced_manifests(), grace=3600)  # too young: nothing goes
    assert rep.chunks_removed == 0 and rep.manifests_removed == []
    rep = maintenance.gc(store, keep=cat.referenced_manifests(), grace=0)
    assert rep.manifests_removed == [d2] and rep.chunks_removed == 1
    assert len(chunk_files(tmp_path / "store")) == before - 1
    assert maintenance.verify(store).ok and store.list_manifests() == [d1]


def test_gc_refuses_while_writer_holds_store(tmp_path, payload):
    writer = open_store(tmp_path / "store")
    refs = writer.add_file(payload)  # chunks stored, manifest not yet: gc must not take them
    with pytest.raises(StoreLocked, match="add_file"):
        maintenance.gc(open_store(tmp_path / "store"), grace=0)
    m = make_manifest(writer, "w", {"p.img": payload})
    assert m.files[0].chunks == refs
    writer.put_manifest(m)
    writer.close()
    assert maintenance.gc(open_store(tmp_path / "store"), grace=0).chunks_removed == 0


def test_concurrent_push_and_gc_never_lose_chunks(tmp_path, payload):
    """Hammer: pushes of new content race gcs; every finished push must verify."""
    src = open_store(tmp_path / "src")
    snapshot(src, "base", {"p.img": payload})
    dst_dir = tmp_path / "dst"
    errors, done = [], []

    def pusher():
        try:
            for i in range(4):
                f = write_payload(tmp_path / f"f{i}.img", [("random", MiB), ("text", CHUNK_SIZE)], seed=100 + i)
                snapshot(src, f"s{i}", {"p.img": f, "base.img": payload})
                with open_store(dst_dir) as dst:
                    push(src, dst, f"s{i}", "latest")
                done.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=pusher)
    t.start()
    gcs = locked = 0
    while t.is_alive():
        try:
            maintenance.gc(open_store(dst_dir), grace=0)
            gcs += 1
        except StoreLocked:
            locked += 1
        time.sleep(0.01)
    t.join()
    assert not errors, errors
    assert done == [0, 1, 2, 3] and gcs + locked > 0
    dst = open_store(dst_dir)
    assert maintenance.gc(dst, grace=0).chunks_removed == 0
    rep = maintenance.verify(dst)
    assert rep.ok and rep.manifests_checked == 4, str(rep)


def test_stale_lock_of_dead_process_is_ignored(tmp_path, payload):
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, os; from warmctl.store import open_store; s=open_store(sys.argv[1]); s.add_file(sys.argv[2]); os._exit(0)", str(tmp_path / "store"), str(payload)],
        check=True,
    )
    assert proc.returncode == 0
    assert list((tmp_path / "store" / "locks").iterdir()), "the killed writer left its lock"
    rep = maintenance.gc(open_store(tmp_path / "store"), grace=0)
    assert rep.locks_removed == 1 and rep.chunks_removed == 4


def test_push_pull_local_resumes(tmp_path, payload):
    a = open_store(tmp_path / "a")
    d = snapshot(a, "tiny", {"pages-1.img": payload})
    b = open_store(tmp_path / "b")
    rep = push(a, b, "tiny", "latest")
    assert rep.digest == d and rep.chunks_copied == rep.chunks_total == 4
    again = pull(a, b, "tiny", "latest")
    assert again.chunks_copied == 0 and again.bytes_copied == 0
    chunk_files(tmp_path / "b")[0].unlink()
    third = pull(a, open_store(tmp_path / "b"), "tiny", "latest")
    assert third.chunks_copied == 1
    assert maintenance.verify(b).ok and tag_of(b, "tiny", "latest") == d


class FlakyBackend(Backend):
    """In-process backend (same interface) that fails the first ``fail`` calls of each op."""

    def __init__(self, inner: Backend, fail: int):
        self.inner, self.fail, self.calls = inner, fail, {}

    def _maybe(self, op):
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.calls[op] <= self.fail:
            raise TransientBackendError(f"injected {op} failure {self.calls[op]}")

    def location(self, key=""):
        return self.inner.location(key)

    def save(self, key, data):
        self._maybe("save")
        self.inner.save(key, data)

    def load(self, key, offset=0, length=None):
        self._maybe("load")
        return self.inner.load(key, offset, length)

    def stat(self, key):
        return self.inner.stat(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def remove(self, key):
        self.inner.remove(key)


def test_retrying_backend_retries_then_gives_up(tmp_path):
    seen = []
    rb = RetryingBackend(FlakyBackend(LocalBackend(tmp_path), 2), attempts=3, base_delay=0.001, on_retry=lambda *a: seen.append(a[:3]))
    rb.save("x/y", b"data")
    assert rb.load("x/y") == b"data"
    assert seen == [("save", "x/y", 1), ("save", "x/y", 2), ("load", "x/y", 1), ("load", "x/y", 2)]
    hopeless = RetryingBackend(FlakyBackend(LocalBackend(tmp_path), 10), attempts=3, base_delay=0.001)
    with pytest.raises(TransientBackendError, match=", 3 attempts"):
        hopeless.load("x/y")


def test_local_backend_ranges_list_stat(tmp_path):
    b = LocalBackend(tmp_path / "r")
    b.save("chunks/a/1", b"0123456789")
    b.save("chunks/b/2", b"xy")
    b.save("tags/t/latest", b"z")
    assert b.load("chunks/a/1", 3, 4) == b"3456" and b.load("chunks/a/1", 8) == b"89"
    assert sorted(o.key for o in b.list("chunks/")) == ["chunks/a/1", "chunks/b/2"]
    assert [o.key for o in b.list("chunks/a")] == ["chunks/a/1"]
    assert b.stat("chunks/b/2").size == 2 and isinstance(b.stat("chunks/b/2"), ObjectInfo)
    with pytest.raises(ObjectNotFound, match="nope"):
        b.load("nope")
    b.remove("chunks/a/1")
    b.remove("chunks/a/1")
    assert not b.exists("chunks/a/1")
    with pytest.raises(ValueError):
        b.save("../escape", b"")


def test_full_disk_aborts_cleanly_naming_bytes(tmp_path, small_fs):
    big = write_payload(tmp_path / "big.img", [("random", 3 * CHUNK_SIZE)])
    store = open_store(small_fs / "store")
    with pytest.raises(HostError) as ei:
        store.add_file(big)
    msg = str(ei.value)
    assert "disk full" in msg and "needed" in msg and str(small_fs) in msg
    assert list((small_fs / "store" / "tmp").iterdir()) == []
    # read_file refuses before writing when the destination is too small
    src = open_store(tmp_path / "store")
    refs = src.add_file(big)
    with pytest.raises(HostError, match=f"needed {3 * CHUNK_SIZE:,} bytes"):
        src.read_file(refs, small_fs / "out.img")
    assert not list(small_fs.glob("*.tmp")) and not (small_fs / "out.img").exists()


def test_digest_helpers():
    data = b"abc"
    assert ck.verify_bytes(data, ck.hash_bytes(data, "sha256"))
    assert ck.verify_bytes(data, ck.hash_bytes(data, "blake3"))
    assert not ck.verify_bytes(b"abd", ck.hash_bytes(data))
    with pytest.raises(ValueError):
        ck.split_digest("md5:abc")
    assert ck.is_zero_chunk(ck.zero_digest(10, "sha256"), 10)
    assert not ck.is_zero_chunk(ck.zero_digest(10), 11)
    assert ChunkRef(digest=ck.hash_bytes(data), size=3).size == 3


def test_a_lock_whose_pid_is_another_process_now_is_stale(tmp_path):
    """A lock taken on this host names its holder by PID and start ticks; a PID that
    is alive but started at another moment (reused) is a gone holder, the live holder is not."""
    import json as _json
    import socket

    from warmctl.base.proc import boot_id, start_ticks
    from warmctl.store.lock import holder_gone

    me = {"pid": os.getpid(), "start": start_ticks(os.getpid()), "boot": boot_id(), "host": socket.gethostname()}
    assert holder_gone(me) is False
    assert holder_gone({**me, "start": me["start"] - 1}) is True  # the PID was reused
    assert holder_gone({"pid": os.getpid()}) is False  # a lock from before start ticks: the PID alone
    assert holder_gone({**me, "boot": "another-boot"}) is False  # cannot tell: the PID alone
    s = open_store(tmp_path / "store")
    (tmp_path / "store" / "locks").mkdir(parents=True, exist_ok=True)
    (tmp_path / "store" / "locks" / "reused").write_text(_json.dumps(
        {**me, "start": me["start"] - 1, "kind": "exclusive", "time": time.time(), "purpose": "a killed gc"}))
    assert maintenance.gc(s, grace=0).locks_removed == 1  # not refused as a live exclusive lock


def _ten_chunk_store(tmp_path: Path):
    """A local store (64 KiB chunks) holding tiny:latest: 10 stored chunks (and zeros)."""
    f = write_payload(tmp_path / "p.img", [("random", 6 * 64 * 1024), ("zero", 2 * 64 * 1024), ("text", 4 * 64 * 1024)])
    s = open_store(tmp_path / "src", chunk_size=64 * 1024)
    return s, snapshot(s, "tiny", {"p.img": f})


def test_copy_into_a_local_store_commits_bounded_batches_before_the_manifest(tmp_path, monkeypatch):
    """copy_manifest into a local store: chunks committed in SaveBatches of at least
    ``commit_chunks`` (the last one excepted), every one of them before the manifest is written."""
    from warmctl.store import copy_manifest
    from warmctl.store.local import SaveBatch

    src, d = _ten_chunk_store(tmp_path)
    events: list[tuple[str, int]] = []
    real_commit, real_put = SaveBatch.commit, Store.put_manifest

    def commit(self):
        n = real_commit(self)
        events.append(("commit", n))
        return n

    def put_manifest(self, m):
        events.append(("manifest", len(chunk_files(tmp_path / "dst"))))
        return real_put(self, m)

    monkeypatch.setattr(SaveBatch, "commit", commit)
    monkeypatch.setattr(Store, "put_manifest", put_manifest)
    dst = open_store(tmp_path / "dst")
    rep = copy_manifest(src, dst, d, workers=2, commit_chunks=3, commit_seconds=float("inf"))
    assert rep.chunks_copied == 10
    sizes = [n for e, n in events if e == "commit" and n]
    assert sum(sizes) == 10 and len(sizes) >= 3 and all(n >= 3 for n in sizes[:-1]), events
    assert events[-1] == ("manifest", 10), events  # every chunk visible before the manifest
    assert maintenance.verify(dst).ok and list((tmp_path / "dst" / "tmp").iterdir()) == []
    events.clear()
    dst2 = open_store(tmp_path / "dst2")
    copy_manifest(src, dst2, d, workers=1, commit_chunks=1000, commit_seconds=0.0)  # due at each save (one worker)
    assert [n for e, n in events if e == "commit" and n] == [1] * 10, events


def test_a_copy_that_fails_keeps_the_chunks_verified_so_far(tmp_path):
    """A source chunk corrupt: the copy raises IntegrityError naming it, names nothing, and the
    chunks it had verified are committed (visible, whole), no temporary file left; the rerun
    after the repair fetches only the rest."""
    from warmctl.store import copy_manifest

    src, d = _ten_chunk_store(tmp_path)
    refs = [c for f in src.get_manifest(d).files for c in f.chunks if not ck.is_zero_chunk(c.digest, c.size)]
    victim = refs[-1]
    path = tmp_path / "src" / chunk_key(victim.digest)
    good = path.read_bytes()
    path.write_bytes(good[:-3] + b"xyz")
    dst = open_store(tmp_path / "dst")
    with pytest.raises(IntegrityError, match=victim.digest):
        copy_manifest(src, dst, d, workers=1, commit_chunks=1000, commit_seconds=float("inf"))
    have = len(chunk_files(tmp_path / "dst"))
    assert have == len(refs) - 1 and dst.list_manifests() == []  # one worker: every chunk before the victim
    assert list((tmp_path / "dst" / "tmp").iterdir()) == [] and maintenance.verify(dst).ok
    path.write_bytes(good)
    assert copy_manifest(src, dst, d).chunks_copied == 1 and maintenance.verify(dst).ok
