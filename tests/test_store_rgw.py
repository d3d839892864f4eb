"""The S3 backend against a real Ceph RGW on loopback (Debian 12's radosgw/ceph-mon/ceph-osd 16.2).

Runs by default whenever the ceph binaries exist (``scripts/install-test-services.sh``, which
``scripts/test.sh`` runs first). Without them the tests are skipped on a developer machine but
FAIL when ``CI`` or ``WARMCTL_REQUIRE_RGW=1`` is set (``scripts/test.sh`` sets the latter), so
CI cannot lose them silently.

The cluster (``tests/rgw_server.py``: one mon, one memstore OSD, radosgw with beast, cephx with
generated keys, free ports picked at start) comes up in about 3 s, once per session (conftest's
``ceph_rgw``, shared with test_sealed.py and test_e2e_fleet.py); this module has a bucket of its own.
Covered here, where a real server can behave differently from moto: push/pull round trip with
chunk objects large enough to go through multipart upload, ranged GETs across part boundaries,
RGW's 5 MiB minimum part size (the failed upload is aborted, nothing dangles), ``verify`` of the
remote store, and a chunk object deleted or damaged on the RGW side named by ``verify``,
``read_file`` and ``pull``, and credentials RGW refuses (403 ``SignatureDoesNotMatch``,
``InvalidAccessKeyId``) or a missing bucket reported in one line without retries. Server faults,
outages and a killed, resumed pull are tested against moto (``test_store_s3.py``,
``test_store_s3_outage.py``).
"""

from __future__ import annotations

import os
import uuid

import pytest
from test_store_fixtures import MiB, pull, push, snapshot, tag_of, write_payload

from warmctl.base.errors import HostError, IntegrityError
from warmctl.store import (
    ChunkMissing,
    ObjectNotFound,
    RetryingBackend,
    S3Backend,
    Store,
    TransientBackendError,
    chunk_key,
    open_store,
)
from warmctl.store import maintenance

pytestmark = pytest.mark.s3

BUCKET = "warmctl"


@pytest.fixture(scope="module")
def rgw(ceph_rgw):
    """The session's Ceph RGW (conftest's ``ceph_rgw``) with a bucket ``warmctl`` for this
    module; yields (endpoint, access key, secret key). Each test works under a fresh prefix."""
    import boto3

    ep, ak, sk = ceph_rgw
    client = boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id=ak, aws_secret_access_key=sk)
    client.create_bucket(Bucket=BUCKET)
    yield ep, ak, sk
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=o["Key"])
    client.delete_bucket(Bucket=BUCKET)


@pytest.fixture
def s3(rgw, monkeypatch):
    """(endpoint, raw boto3 client, a fresh prefix); S3 credentials of the RGW user in the environment."""
    import boto3

    ep, ak, sk = rgw
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ak)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", sk)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    # explicit keys: boto3's default session caches the credentials it first resolved (an
    # earlier moto test's), so a plain boto3.client() here would sign with those
    client = boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id=ak, aws_secret_access_key=sk)
    return ep, client, f"t-{uuid.uuid4().hex[:8]}"


def _remote(ep: str, prefix: str) -> Store:
    # 5 MiB parts, RGW's minimum: a chunk object above 5 MiB goes through multipart upload
    return Store(RetryingBackend(S3Backend(BUCKET, prefix, endpoint_url=ep, multipart_threshold=5 * MiB, part_size=5 * MiB)))


def test_push_pull_verify_round_trip_with_multipart_chunks(s3, tmp_path):
    ep, client, prefix = s3
    f = write_payload(tmp_path / "p.img", [("random", 16 * MiB), ("zero", 8 * MiB), ("text", 3 * MiB)])
    local = open_store(tmp_path / "a", chunk_size=8 * MiB)  # random 8 MiB chunks stay ~8 MiB compressed
    d = snapshot(local, "tiny", {"p.img": f})
    remote = _remote(ep, prefix)
    rep = push(local, remote, "tiny", "latest")
    assert rep.digest == d and rep.chunks_copied == rep.chunks_total == 3  # 2 random + 1 text; the zero chunk is never stored

    chunks = local.get_manifest(d).files[0].chunks
    etags = {c.digest: client.head_object(Bucket=BUCKET, Key=f"{prefix}/{chunk_key(c.digest)}")["ETag"].strip('"') for c in chunks[:2]}
    assert all(e.endswith("-2") for e in etags.values()), etags  # RGW's multipart ETag: 2 parts (5 + ~3 MiB)

    b = open_store(tmp_path / "b")
    rep = pull(_remote(ep, prefix), b, "tiny", "latest")
    assert rep.digest == d and rep.chunks_copied == rep.chunks_total == 3
    b.read_file(b.get_manifest(d).files[0].chunks, tmp_path / "out.img")
    assert (tmp_path / "out.img").read_bytes() == f.read_bytes()
    # straight from the RGW too (no local copy)
    _remote(ep, prefix).read_file(chunks, tmp_path / "direct.img")
    assert (tmp_path / "direct.img").read_bytes() == f.read_bytes()
    v = maintenance.verify(_remote(ep, prefix))
    assert v.ok and v.manifests_checked == 1 and v.chunks_checked == 3, str(v)
    assert pull(_remote(ep, prefix), b, "tiny", "latest").chunks_copied == 0


def test_backend_multipart_ranges_list_remove(s3):
    ep, client, prefix = s3
    b = S3Backend(BUCKET, prefix, endpoint_url=ep, multipart_threshold=6 * MiB, part_size=5 * MiB)
    big = os.urandom(11 * MiB)
    b.save("big/obj", big)  # 3 parts: 5 + 5 + 1 MiB
    assert client.head_object(Bucket=BUCKET, Key=f"{prefix}/big/obj")["ETag"].strip('"').endswith("-3")
    assert b.load("big/obj") == big
    assert b.load("big/obj", 5 * MiB - 50, 100) == big[5 * MiB - 50 : 5 * MiB + 50]  # across a part boundary
    assert b.load("big/obj", 10 * MiB - 1, MiB + 1) == big[10 * MiB - 1 :]  # last two parts, to the end
    assert b.load("big/obj", 11 * MiB - 5) == big[-5:]  # open-ended
    assert b.load("big/obj", 3, 0) == b""
    assert b.stat("big/obj").size == len(big)
    b.save("small/x", b"abc")
    assert sorted(o.key for o in b.list("")) == ["big/obj", "small/x"]
    assert [o.key for o in b.list("small/")] == ["small/x"]
    with pytest.raises(ObjectNotFound, match=f"s3://{BUCKET}/{prefix}/nope"):
        b.load("nope")
    b.remove("small/x")
    b.remove("small/x")  # removing a missing object is not an error
    assert not b.exists("small/x")
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")


def test_part_below_rgw_minimum_is_refused_and_aborted(s3):
    """RGW enforces S3's 5 MiB minimum part size at completion (moto is laxer): the error names
    the object and the upload is aborted, leaving neither object nor upload behind."""
    ep, client, prefix = s3
    b = S3Backend(BUCKET, prefix, endpoint_url=ep, multipart_threshold=2 * MiB, part_size=1 * MiB)
    with pytest.raises(HostError, match=f"s3://{BUCKET}/{prefix}/small-parts.*EntityTooSmall"):
        b.save("small-parts", os.urandom(3 * MiB))
    assert not b.exists("small-parts")
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")


def test_chunk_deleted_or_damaged_on_rgw_is_named(s3, tmp_path):
    ep, client, prefix = s3
    f = write_payload(tmp_path / "p.img", [("random", 12 * MiB), ("text", 4 * MiB)], seed=3)
    local = open_store(tmp_path / "a")
    d = snapshot(local, "tiny", {"p.img": f})
    push(local, _remote(ep, prefix), "tiny", "latest")
    chunks = local.get_manifest(d).files[0].chunks
    gone, bad = chunks[1].digest, chunks[3].digest
    gone_at = f"s3://{BUCKET}/{prefix}/{chunk_key(gone)}"
    bad_at = f"s3://{BUCKET}/{prefix}/{chunk_key(bad)}"
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{chunk_key(gone)}")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{chunk_key(bad)}", Body=b"not a zstd frame")

    v = maintenance.verify(_remote(ep, prefix))
    assert not v.ok
    assert [(p.digest, p.location) for p in v.missing] == [(gone, gone_at)]
    assert [(p.digest, p.location) for p in v.corrupt] == [(bad, bad_at)]
    assert gone in str(v) and "(tiny)" in str(v)

    with pytest.raises(ChunkMissing, match=f"{gone}.*{gone_at}"):
        _remote(ep, prefix).read_file(chunks[:3], tmp_path / "out.img")  # the damaged chunk is the 4th
    assert not (tmp_path / "out.img").exists()

    b = open_store(tmp_path / "b")
    with pytest.raises(IntegrityError, match=f"{gone}|{bad}"):  # whichever the parallel copy meets first
        pull(_remote(ep, prefix), b, "tiny", "latest")
    assert tag_of(b, "tiny", "latest") is None  # nothing half-written: no tag, no manifest
    assert not b.list_manifests()


@pytest.mark.parametrize(("key_id", "secret", "code"), [(None, "not-the-secret", "SignatureDoesNotMatch"), ("WARMCTLNOSUCHKEY0000", "x", "InvalidAccessKeyId")])
def test_refused_credentials_and_missing_bucket_are_one_line_without_retry(s3, monkeypatch, key_id, secret, code):
    ep, _, prefix = s3
    good = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id or good[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    b = RetryingBackend(S3Backend(BUCKET, prefix, endpoint_url=ep), 30)
    with pytest.raises(HostError) as ei:
        b.load("tags/tiny/latest")
    assert not isinstance(ei.value, TransientBackendError) and b.retries == 0
    assert str(ei.value) == (
        f"load s3://{BUCKET}/{prefix}/tags/tiny/latest at {ep}: access refused (HTTP 403 {code}); check the "
        "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket policy"
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", good[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", good[1])
    s3_ok = RetryingBackend(S3Backend("warmctl-no-such-bucket", prefix, endpoint_url=ep), 30)
    with pytest.raises(HostError, match=r"bucket 'warmctl-no-such-bucket' does not exist; check the bucket") as ei:
        s3_ok.load("tags/tiny/latest")
    assert s3_ok.retries == 0
