"""Store against a real S3 server on loopback (moto), with faults injected by a proxy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import boto3
import pytest
from test_store_fixtures import MiB, chunk_files, pull, push, snapshot, tag_of, write_payload
from test_store_proxy import FaultProxy

from warmctl.base.errors import IntegrityError
from warmctl.store import (
    BackendUnavailable,
    ObjectNotFound,
    RetryingBackend,
    S3Backend,
    Store,
    chunk_key,
    open_store,
)
from warmctl.store import maintenance

pytestmark = pytest.mark.s3
CH = 256 * 1024  # small chunks: many objects, fast tests


def _split(url):
    u = urlparse(url)
    return u.netloc, u.path.strip("/")


@pytest.fixture
def local_snap(tmp_path):
    """A local store (256 KiB chunks) holding snapshot tiny:latest of ~3 MiB mixed data."""
    f = write_payload(tmp_path / "pages-1.img", [("random", 5 * CH), ("zero", 3 * CH), ("text", 4 * CH + 77)])
    store = open_store(tmp_path / "local", chunk_size=CH)
    d = snapshot(store, "tiny", {"pages-1.img": f})
    store.close()
    return store, d, f


def test_s3_store_round_trip(s3_url, tmp_path):
    f = write_payload(tmp_path / "a.img", [("random", 2 * CH), ("zero", 2 * CH), ("text", CH)])
    with open_store(s3_url, chunk_size=CH) as s:
        d = snapshot(s, "tiny", {"a.img": f})
        assert tag_of(s, "tiny", "latest") == d and s.list_manifests() == [d]
        s.read_file(s.get_manifest(d).files[0].chunks, tmp_path / "out" / "a.img")
        assert (tmp_path / "out" / "a.img").read_bytes() == f.read_bytes()
        assert maintenance.verify(s).ok
        assert s.location == s3_url + "/"


def test_push_then_pull_to_another_host(s3_url, tmp_path, local_snap):
    local, d, f = local_snap
    remote = open_store(s3_url)
    seen = []
    rep = push(local, remote, "tiny", "latest", progress=seen.append)
    assert rep.digest == d and rep.chunks_copied == rep.chunks_total == 10
    assert sum(seen) == f.stat().st_size
    other = open_store(tmp_path / "other")
    rep = pull(open_store(s3_url), other, "tiny", "latest")
    assert rep.chunks_copied == 10 and tag_of(other, "tiny", "latest") == d
    other.read_file(other.get_manifest(d).files[0].chunks, tmp_path / "restored.img")
    assert (tmp_path / "restored.img").read_bytes() == f.read_bytes()
    assert pull(open_store(s3_url), other, "tiny", "latest").chunks_copied == 0


def test_s3_backend_ranges_multipart_list(s3_url, moto_endpoint):
    bucket, prefix = _split(s3_url)
    b = S3Backend(bucket, prefix, endpoint_url=moto_endpoint, multipart_threshold=6 * MiB, part_size=5 * MiB)
    big = os.urandom(11 * MiB)
    b.save("big/obj", big)  # 3 parts
    assert b.load("big/obj") == big
    assert b.load("big/obj", 7 * MiB, 100) == big[7 * MiB : 7 * MiB + 100]
    assert b.load("big/obj", 11 * MiB - 5) == big[-5:]
    assert b.stat("big/obj").size == len(big)
    b.save("small/x", b"abc")
    assert sorted(o.key for o in b.list("")) == ["big/obj", "small/x"]
    assert [o.key for o in b.list("small/")] == ["small/x"]
    with pytest.raises(ObjectNotFound, match=f"s3://{bucket}/{prefix}/nope"):
        b.load("nope")
    b.remove("small/x")
    b.remove("small/x")
    assert not b.exists("small/x")
    # no multipart upload left dangling
    c = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    assert not c.list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_s3_object_is_named_and_nothing_half_written(s3_url, moto_endpoint, tmp_path, local_snap, damage):
    local, d, _ = local_snap
    push(local, open_store(s3_url), "tiny", "latest")
    bucket, prefix = _split(s3_url)
    victim = local.get_manifest(d).files[0].chunks[1].digest
    key = f"{prefix}/{chunk_key(victim)}"
    c = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    blob = c.get_object(Bucket=bucket, Key=key)["Body"].read()
    c.put_object(Bucket=bucket, Key=key, Body=blob[:-3] + b"xyz" if damage == "corrupt" else blob[: len(blob) // 3])
    dst = open_store(tmp_path / "dst")
    with pytest.raises(IntegrityError) as ei:
        pull(open_store(s3_url), dst, "tiny", "latest")
    assert victim in str(ei.value) and f"s3://{bucket}/{key}" in str(ei.value)
    assert tag_of(dst, "tiny", "latest") is None and dst.list_manifests() == []
    assert not (tmp_path / "dst" / chunk_key(victim)).exists()
    rep = maintenance.verify(open_store(s3_url))
    assert [p.digest for p in rep.corrupt] == [victim]
    # pushing again repairs nothing by itself (the object exists) -- but verify names it, and
    # removing it lets a push restore it:
    c.delete_object(Bucket=bucket, Key=key)
    push(local, open_store(s3_url), "tiny", "latest")
    assert maintenance.verify(open_store(s3_url)).ok


def _proxied(s3_url, proxy, **kw) -> Store:
    bucket, prefix = _split(s3_url)
    return Store(RetryingBackend(S3Backend(bucket, prefix, endpoint_url=proxy.url), base_delay=0.01, **kw))


def test_pull_survives_server_faults_mid_pull(s3_url, moto_endpoint, tmp_path, local_snap):
    local, d, f = local_snap
    push(local, open_store(s3_url), "tiny", "latest")
    proxy = FaultProxy(moto_endpoint).start()
    try:
        # first GET of every chunk fails, in turn: 503, truncated body, connection reset
        modes = ["503", "truncate", "reset"]
        proxy.fault = lambda m, p, n: modes[hash(p) % 3] if (m == "GET" and "/chunks/" in p and n == 1) else None
        src = _proxied(s3_url, proxy)
        rep = pull(src, open_store(tmp_path / "dst"), "tiny", "latest")
        assert rep.chunks_copied == 10
        assert sum(proxy.faults.values()) == 10 and src.backend.retries >= 10
        assert set(proxy.faults) <= set(modes) and len(proxy.faults) >= 2
        dst = open_store(tmp_path / "dst")
        assert maintenance.verify(dst).ok
        dst.read_file(dst.get_manifest(d).files[0].chunks, tmp_path / "r.img")
        assert (tmp_path / "r.img").read_bytes() == f.read_bytes()
    finally:
        proxy.stop()


def test_pull_gives_up_cleanly_when_server_keeps_failing(s3_url, moto_endpoint, tmp_path, local_snap):
    local, _, _ = local_snap
    push(local, open_store(s3_url), "tiny", "latest")
    proxy = FaultProxy(moto_endpoint).start()
    try:
        proxy.fault = lambda m, p, n: "503" if (m == "GET" and "/chunks/" in p) else None
        dst = open_store(tmp_path / "dst")
        with pytest.raises(BackendUnavailable, match=r"still failing after .* 3 attempts .*load s3://.*/chunks/.* at http://127\.0\.0\.1:\d+: HTTP 503 SlowDown"):
            pull(_proxied(s3_url, proxy, attempts=3), dst, "tiny", "latest")
        assert tag_of(dst, "tiny", "latest") is None and dst.list_manifests() == []
    finally:
        proxy.stop()


_PULL = """
import sys
from warmctl.naming.catalog import Ref
from warmctl.naming.fleet import entries_to_copy, transfer
from warmctl.records.config import load_settings
from warmctl.store import open_store
settings = load_settings()  # this script is an edge: $WARMCTL_S3_ENDPOINT names the proxy
src = open_store(sys.argv[1], settings=settings)
transfer(src, open_store(sys.argv[2], settings=settings), entries_to_copy(src, Ref(name="tiny")))
print("finished")
"""


#: seconds between one chunk GET's answer and the next (the proxy serializes them), so that a
#: pull's batches, bounded by COMMIT_SECONDS, commit a few chunks each while the test watches
GAP = 0.3


def _paced(gap: float):
    """A FaultProxy fault that answers the chunk GETs one at a time, ``gap`` seconds apart."""
    mu, nxt = threading.Lock(), [time.monotonic()]

    def fault(m, p, n):
        if m != "GET" or "/chunks/" not in p:
            return None
        with mu:
            nxt[0] = max(nxt[0] + gap, time.monotonic())
            at = nxt[0]
        return max(0.0, at - time.monotonic())

    return fault


def _tmp_files(root):
    return sorted(p for p in (root / "tmp").iterdir() if p.is_file()) if (root / "tmp").is_dir() else []


@pytest.mark.parametrize("when", ["after_commit", "mid_batch"])
def test_killed_pull_resumes_fetching_only_missing(s3_url, moto_endpoint, tmp_path, local_snap, when):
    """A real pull (a child process, chunks served one per GAP s) is SIGKILLed once it has
    committed at least 3 chunks (``after_commit``), or then with a batch not yet committed
    (``mid_batch``: temporary files in ``tmp/`` only). What it committed stays; what was
    pending is not visible, at most COMMIT_SECONDS' worth of chunks, and is removed by gc; the
    rerun fetches exactly the chunks not committed and only then names the snapshot."""
    from warmctl.store.copy import COMMIT_SECONDS

    local, d, f = local_snap
    push(local, open_store(s3_url), "tiny", "latest")
    total = maintenance.verify(local).chunks_checked
    proxy = FaultProxy(moto_endpoint).start()
    try:
        proxy.fault = _paced(GAP)
        env = dict(os.environ, WARMCTL_S3_ENDPOINT=proxy.url)
        dst_dir = tmp_path / "dst"
        proc = subprocess.Popen([sys.executable, "-c", _PULL, s3_url, str(dst_dir)], env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if (dst_dir / "chunks").exists() and len(chunk_files(dst_dir)) >= 3 and (when == "after_commit" or _tmp_files(dst_dir)):
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        have, pending = len(chunk_files(dst_dir)), len(_tmp_files(dst_dir))
        print(f"killed {when}: {have} of {total} chunks committed, {pending} pending")
        assert 3 <= have < total, f"the pull was not killed midway: {have} of {total} chunks committed"
        if when == "mid_batch":
            assert pending >= 1, "killed with nothing pending"
        # what a kill loses: the chunks fetched since the batch's first save, COMMIT_SECONDS at most
        assert pending <= COMMIT_SECONDS / GAP + 1, (pending, have)
        dst = open_store(dst_dir)
        assert tag_of(dst, "tiny", "latest") is None and dst.list_manifests() == []
        assert maintenance.verify(dst).ok  # what is visible is whole
        before = proxy.gets()
        proxy.fault = None
        rep = pull(_proxied(s3_url, proxy), dst, "tiny", "latest")
        assert proxy.gets() - before == total - have == rep.chunks_copied
        assert tag_of(dst, "tiny", "latest") == d and maintenance.verify(dst).ok
        # the killed puller's lock is recognised as dead; gc can run and removes its temporary
        # files (once an hour old: aged here)
        old = time.time() - 7200
        for t in _tmp_files(dst_dir):
            os.utime(t, (old, old))
        g = maintenance.gc(dst, grace=0)
        assert g.chunks_removed == 0 and g.tmp_removed == pending and _tmp_files(dst_dir) == []
    finally:
        proxy.stop()
