"""The read cache (warmctl.store.cache.CachingBackend) and declared backend properties.

A remote store (local directory or a moto S3 server) read into a file through a local cache
store, as ``up`` does: chunks land in the cache only once verified, a damaged cache entry is
fetched again from the remote and rewritten, and errors name the remote's location.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_store_fixtures import chunk_files, push, snapshot, write_payload

from warmctl.base.errors import IntegrityError
from warmctl.store import (
    CacheFill,
    CachingBackend,
    ChunkCorrupt,
    ChunkMissing,
    LocalBackend,
    RetryingBackend,
    S3Backend,
    Store,
    chunk_key,
    open_store,
)
from warmctl.store import maintenance
from warmctl.store.backend import ForwardingBackend
from warmctl.store.chunkio import ChunkBuffers, load_verified
from warmctl.store.chunks import frame_bound

CH = 256 * 1024  # small chunks: many objects, fast tests


@pytest.fixture
def remote(tmp_path):
    """A 'remote' store (its own directory) holding tiny:latest; returns (store, refs, file)."""
    f = write_payload(tmp_path / "pages-1.img", [("random", 4 * CH), ("zero", 2 * CH), ("text", 3 * CH + 5)])
    store = open_store(tmp_path / "remote", chunk_size=CH)
    d = snapshot(store, "tiny", {"pages-1.img": f})
    store.close()
    return store, store.get_manifest(d).files[0].chunks, f


def _blobs(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in chunk_files(root)}


def test_read_through_cache_fills_it_and_serves_the_next_read(tmp_path, remote):
    src, refs, f = remote
    cache = open_store(tmp_path / "cache")
    src.read_file(refs, tmp_path / "out" / "a.img", cache=cache)
    assert (tmp_path / "out" / "a.img").read_bytes() == f.read_bytes()
    assert _blobs(tmp_path / "cache") == _blobs(tmp_path / "remote")  # stored verbatim, zeros not at all
    assert len(chunk_files(tmp_path / "cache")) == 8 == len(refs) - 2  # 4 + 4 chunks, 2 zero
    assert (tmp_path / "cache" / "config").exists()  # the cache is an ordinary store
    assert list((tmp_path / "cache" / "locks").iterdir()), "filling the cache takes its writer lock"
    cache.close()
    assert not list((tmp_path / "cache" / "locks").iterdir())
    # with every remote chunk gone, the next read is served by the cache alone
    for p in chunk_files(tmp_path / "remote"):
        p.unlink()
    src.read_file(refs, tmp_path / "out" / "b.img", cache=open_store(tmp_path / "cache"))
    assert (tmp_path / "out" / "b.img").read_bytes() == f.read_bytes()


def _tmp_files(store_dir: Path) -> list[Path]:
    return sorted((store_dir / "tmp").glob("*.tmp")) if (store_dir / "tmp").is_dir() else []


def test_a_fill_keeps_fetched_chunks_uncommitted_until_its_commit(tmp_path, remote):
    """``read_files(cache=, fill=)`` (what ``up`` does since the commit moved after the port
    opened): the file is whole on return, but the fetched chunks are only temporary files of the
    cache (nothing visible under its key, nothing a reader or ``verify`` could see half-written);
    ``commit()`` makes every one visible, each whole."""
    src, refs, f = remote
    cache = open_store(tmp_path / "cache")
    fill = CacheFill(cache)
    src.read_file(refs, tmp_path / "out" / "a.img", cache=cache, fill=fill)
    assert (tmp_path / "out" / "a.img").read_bytes() == f.read_bytes()
    assert chunk_files(tmp_path / "cache") == [] and len(fill) == 8 == len(_tmp_files(tmp_path / "cache"))
    assert not any(cache.has_chunk(r.digest) for r in refs)
    assert list((tmp_path / "cache" / "locks").iterdir()), "the copies are written under the cache's writer lock"
    assert fill.commit() == 8 and len(fill) == 0
    assert _blobs(tmp_path / "cache") == _blobs(tmp_path / "remote") and _tmp_files(tmp_path / "cache") == []
    for p in chunk_files(tmp_path / "remote"):  # the cache alone serves the next read
        p.unlink()
    src.read_file(refs, tmp_path / "out" / "b.img", cache=cache)
    assert (tmp_path / "out" / "b.img").read_bytes() == f.read_bytes()
    cache.close()


def test_a_discarded_fill_leaves_nothing_and_a_wrong_one_is_refused(tmp_path, remote):
    src, refs, _ = remote
    cache = open_store(tmp_path / "cache")
    fill = CacheFill(cache)
    src.read_file(refs, tmp_path / "a.img", cache=cache, fill=fill)
    fill.discard()
    assert chunk_files(tmp_path / "cache") == [] and _tmp_files(tmp_path / "cache") == []
    assert fill.settle() is None and fill.commit() == 0  # nothing left to commit
    with pytest.raises(ValueError, match="CacheFill of the cache"):
        src.read_file(refs, tmp_path / "b.img", cache=open_store(tmp_path / "other"), fill=fill)
    with pytest.raises(ValueError, match="CacheFill of the cache"):
        src.read_file(refs, tmp_path / "b.img", fill=fill)


def test_a_reader_killed_before_its_fill_commits_leaves_temporary_files_gc_removes(tmp_path, remote):
    """A real process reads through the cache with a fill and is SIGKILLed before the commit (as
    ``up`` killed between the restore and its "commit" phase): the cache holds no chunk object,
    only temporary files; the next read fetches and commits every chunk; ``gc`` removes the old
    temporary files (those older than an hour: a live writer's are never that old)."""
    src, refs, f = remote
    code = ("import json, os, signal, sys; from warmctl.store import CacheFill, open_store; "
            "from warmctl.records.manifest import ChunkRef; refs = [ChunkRef(**r) for r in json.loads(sys.argv[3])]; "
            "cache = open_store(sys.argv[2]); fill = CacheFill(cache); "
            "open_store(sys.argv[1]).read_file(refs, sys.argv[2] + '.img', cache=cache, fill=fill); "
            "print(len(fill), flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "remote"), str(tmp_path / "cache"),
                        json.dumps([x.model_dump() for x in refs])], env=env, capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL and r.stdout.strip() == "8", r.stderr
    left = _tmp_files(tmp_path / "cache")
    assert chunk_files(tmp_path / "cache") == [] and len(left) == 8
    cache = open_store(tmp_path / "cache")
    assert maintenance.verify(cache).ok
    src.read_file(refs, tmp_path / "again.img", cache=cache)  # the next read completes the cache
    assert (tmp_path / "again.img").read_bytes() == f.read_bytes()
    assert _blobs(tmp_path / "cache") == _blobs(tmp_path / "remote")
    cache.close()
    old = time.time() - 2 * 3600
    for p in left:
        os.utime(p, (old, old))
    rep = maintenance.gc(cache)
    assert rep.tmp_removed == 8 and _tmp_files(tmp_path / "cache") == []
    assert rep.chunks_too_new == 8  # the committed chunks (no manifest names them here) are within gc's grace


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_cache_entry_is_refetched_from_the_remote_and_rewritten(tmp_path, remote, damage, caplog):
    src, refs, f = remote
    src.read_file(refs, tmp_path / "first.img", cache=open_store(tmp_path / "cache"))
    victim = tmp_path / "cache" / chunk_key(refs[1].digest)
    good = victim.read_bytes()
    bad = bytearray(good)
    if damage == "flip":
        bad[len(bad) // 2] ^= 0xFF
    else:
        del bad[len(bad) // 2 :]
    victim.write_bytes(bytes(bad))
    with caplog.at_level("WARNING", logger="warmctl.store.chunkio"):
        src.read_file(refs, tmp_path / "again.img", cache=open_store(tmp_path / "cache"))
    assert (tmp_path / "again.img").read_bytes() == f.read_bytes()
    assert victim.read_bytes() == good == (tmp_path / "remote" / chunk_key(refs[1].digest)).read_bytes()
    # not in silence: one warning naming the chunk, the bad copy and the source
    (w,) = [r.getMessage() for r in caplog.records if refs[1].digest in r.getMessage()]
    assert str(victim) in w and "is bad" in w and str(tmp_path / "remote") in w


def test_missing_remote_chunk_names_the_remote_location(tmp_path, remote):
    src, refs, _ = remote
    victim = refs[2].digest
    where = tmp_path / "remote" / chunk_key(victim)
    where.unlink()
    dest = tmp_path / "out" / "a.img"
    with pytest.raises(ChunkMissing) as ei:
        src.read_file(refs, dest, cache=open_store(tmp_path / "cache"))
    msg = str(ei.value)
    assert victim in msg and str(where) in msg and str(dest) in msg
    assert (ei.value.digest, ei.value.location) == (victim, str(where))
    assert str(tmp_path / "cache") not in msg
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    assert not (tmp_path / "cache" / chunk_key(victim)).exists()


def test_corrupt_remote_chunk_never_lands_in_the_cache(tmp_path, remote):
    src, refs, _ = remote
    victim = refs[0].digest
    where = tmp_path / "remote" / chunk_key(victim)
    blob = bytearray(where.read_bytes())
    blob[-10] ^= 0xFF
    where.write_bytes(bytes(blob))
    with pytest.raises(ChunkCorrupt) as ei:
        src.read_file(refs, tmp_path / "a.img", cache=open_store(tmp_path / "cache"))
    assert victim in str(ei.value) and str(where) in str(ei.value)
    assert ei.value.location == str(where) and ei.value.reason and ei.value.reason in str(ei.value)
    assert not (tmp_path / "cache" / chunk_key(victim)).exists()
    # a damaged cached copy in front of a damaged remote: the error names the remote, the
    # damaged copy is dropped rather than kept
    (tmp_path / "cache" / chunk_key(victim)).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / chunk_key(victim)).write_bytes(b"not zstd")
    with pytest.raises(IntegrityError, match=str(where)):
        src.read_file(refs, tmp_path / "b.img", cache=open_store(tmp_path / "cache"))
    assert not (tmp_path / "cache" / chunk_key(victim)).exists()


class _Counted(ForwardingBackend):
    """``inner``, counting the loads of each key; past ``cap`` loads of one key it raises
    AssertionError (not an IntegrityError: it ends a reader that would retry forever)."""

    def __init__(self, inner, cap: int = 20):
        super().__init__(inner)
        self.loads: dict[str, int] = {}
        self.cap = cap

    def load_into(self, key, buf, limit=None):
        self.loads[key] = self.loads.get(key, 0) + 1
        assert self.loads[key] <= self.cap, f"{key} loaded {self.loads[key]} times: the reader never gives up"
        return self.inner.load_into(key, buf, limit)


def _grow(where: Path, ref) -> None:
    """Make the stored object at ``where`` larger than any frame of ``ref`` may be: refused
    unread (IntegrityError from the backend's load itself, as a sealed object failing
    authentication is)."""
    where.write_bytes(where.read_bytes() + b"\0" * (frame_bound(ref.size) + 1))


def test_a_remote_object_refused_unread_behind_a_cache_fails_in_a_bounded_number_of_loads(tmp_path, remote):
    """The remote's own load raises IntegrityError (an object too large for its frame): the
    cache had no copy, so ``forget`` is not a dropped copy; the read fails naming the chunk
    after two loads of the remote, and nothing lands in the cache."""
    src, refs, _ = remote
    ref = refs[0]
    where = tmp_path / "remote" / chunk_key(ref.digest)
    _grow(where, ref)
    counted = _Counted(src.backend)
    cache = open_store(tmp_path / "cache")
    cb = CachingBackend(counted, cache.backend)
    cb.load_into(chunk_key(refs[1].digest), bytearray(16))  # any key: forget answers for this thread's last load only
    with pytest.raises(ChunkCorrupt) as ei:
        load_verified(cb, ref, ChunkBuffers(CH), context="a.img")
    assert ref.digest in str(ei.value) and str(where) in str(ei.value) and "a.img" in str(ei.value)
    assert counted.loads[chunk_key(ref.digest)] == 2
    assert not (tmp_path / "cache" / chunk_key(ref.digest)).exists()
    # the same through Store.read_file (up's materialize): ends, names the chunk, leaves no file
    with pytest.raises(IntegrityError, match=ref.digest):
        src.read_file(refs, tmp_path / "out" / "b.img", cache=open_store(tmp_path / "cache"))
    assert list((tmp_path / "out").iterdir()) == []


def test_forget_is_true_only_for_a_copy_the_cache_served(tmp_path, remote):
    src, refs, _ = remote
    cache = open_store(tmp_path / "cache")
    cb = CachingBackend(src.backend, cache.backend)
    k, limit = chunk_key(refs[0].digest), frame_bound(refs[0].size)
    cb.load_into(k, bytearray(16), limit)  # from the remote: not the cache's to drop
    assert cb.forget(k) is False
    _grow(tmp_path / "remote" / k, refs[0])
    with pytest.raises(IntegrityError):
        cb.load_into(k, bytearray(16), limit)  # the remote refused it unread
    assert cb.forget(k) is False
    (tmp_path / "cache" / k).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / k).write_bytes(b"a damaged cached copy")
    cb.load_into(k, bytearray(64), limit)  # served by the cache
    assert cb.forget(k) is True and not (tmp_path / "cache" / k).exists()
    assert cb.forget(k) is False  # nothing loaded since: nothing more to drop


class _AlwaysForgets(ForwardingBackend):
    """A caching wrapper that claims to drop a copy on every ``forget`` (a broken one)."""

    def forget(self, key):
        return True


def test_load_verified_bounds_its_retries_whatever_forget_answers(tmp_path, remote):
    src, refs, _ = remote
    ref = refs[0]
    where = tmp_path / "remote" / chunk_key(ref.digest)
    blob = bytearray(where.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    where.write_bytes(bytes(blob))
    for damage in ("flip", "grow"):
        if damage == "grow":
            _grow(where, ref)
        counted = _Counted(src.backend)
        with pytest.raises(ChunkCorrupt, match=ref.digest):
            load_verified(_AlwaysForgets(counted), ref, ChunkBuffers(CH))
        assert counted.loads[chunk_key(ref.digest)] == 3, damage  # one free retry after a drop, then two tries


def test_backend_properties_are_declared_and_passed_through(tmp_path):
    local = LocalBackend(tmp_path / "a")
    s3 = S3Backend("bucket", "p", endpoint_url="http://127.0.0.1:9")  # no request is made
    assert local.properties.local and local.properties.prefetch and local.properties.workers == 4
    assert not s3.properties.local and not s3.properties.prefetch and s3.properties.workers == 16
    assert RetryingBackend(local).properties == local.properties
    assert CachingBackend(RetryingBackend(s3), local).properties == s3.properties
    assert Store(RetryingBackend(local)).workers == 4 and Store(RetryingBackend(s3)).workers == 16
    assert Store(CachingBackend(s3, local)).is_local is False


@pytest.mark.s3
def test_s3_read_through_local_cache(s3_url, tmp_path, remote):
    """The `up` path: a snapshot pushed to S3 is read into a file through the local store."""
    local, refs, f = remote
    push(local, open_store(s3_url), "tiny", "latest")
    cache = open_store(tmp_path / "cache")
    open_store(s3_url).read_file(refs, tmp_path / "a.img", cache=cache)
    assert (tmp_path / "a.img").read_bytes() == f.read_bytes()
    assert _blobs(tmp_path / "cache") == _blobs(tmp_path / "remote")
    victim = refs[3].digest
    (tmp_path / "cache" / chunk_key(victim)).write_bytes(b"damaged")
    open_store(s3_url).read_file(refs, tmp_path / "b.img", cache=cache)
    assert (tmp_path / "b.img").read_bytes() == f.read_bytes()
    assert _blobs(tmp_path / "cache") == _blobs(tmp_path / "remote")
    cache.close()
