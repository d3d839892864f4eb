"""Every read and write of an S3 or OCI remote has a total deadline: a server that trickles its
answer (one byte every 0.2 s here, as one every 19 s would keep a 20 s read timeout from ever
firing) or reads an upload slowly ends in ``RemoteTooSlow`` (exit 43) within
``remote_deadline_floor_s`` + size / ``remote_min_rate_bytes_s``, naming the object, the remote,
the bytes moved and the seconds waited. Real servers on loopback (moto, the Distribution
registry) behind ``tests/tcp_proxy.py``'s trickle; small bounds, so each test takes seconds."""

from __future__ import annotations

import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.conftest import isolated_env, warmctl
from tcp_proxy import TcpProxy

from warmctl.records.config import Settings
from warmctl.store import ObjectNotFound, RemoteTooSlow, S3Backend, TransferBound, open_backend

pytestmark = pytest.mark.s3
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def bucket(s3_url):
    from urllib.parse import urlparse

    return urlparse(s3_url).netloc


@pytest.fixture
def proxy(moto_endpoint):
    p = TcpProxy(moto_endpoint).start()
    yield p
    p.stop()


def test_bound_is_floor_plus_size_at_the_minimum_rate():
    b = TransferBound(30.0, MiB)
    assert b.seconds(0) == 30.0 and b.seconds(4 * MiB) == 34.0 and b.seconds(1 << 30) == 30.0 + 1024
    s = Settings()
    assert (s.remote_deadline_floor_s, s.remote_min_rate_bytes_s) == (30.0, MiB)


def test_a_trickled_s3_body_ends_at_its_deadline(bucket, moto_endpoint, proxy):
    direct = S3Backend(bucket, "t", endpoint_url=moto_endpoint)
    direct.save("chunks/big", os.urandom(256 * KiB))
    b = S3Backend(bucket, "t", endpoint_url=proxy.url, bound=TransferBound(1.0, MiB))
    assert len(b.load("chunks/big")) == 256 * KiB  # untrickled: whole
    proxy.trickle = ("down", 4 * KiB, 0.2)  # each new answer: 4 KiB, then a byte every 0.2 s
    b.client.close()  # new connections (the trickle counts per connection)
    for read, size in ((lambda: b.load("chunks/big"), 256 * KiB),
                       (lambda: b.load_into("chunks/big", bytearray(), 512 * KiB), 256 * KiB),
                       (lambda: b.load("chunks/big", 1000, 100 * KiB), 100 * KiB)):
        t0 = time.monotonic()
        with pytest.raises(RemoteTooSlow) as ei:
            read()
        took = time.monotonic() - t0
        bound = 1.0 + size / MiB
        assert took < bound + 1.0, (took, bound)
        msg = str(ei.value)
        assert f"s3://{bucket}/t/chunks/big at {proxy.url}" in msg, msg
        m = re.search(r"too slow: ([\d,]+) of ([\d,]+) bytes received in ([\d.]+) s", msg)
        assert m and int(m.group(1).replace(",", "")) < int(m.group(2).replace(",", "")), msg
        assert float(m.group(3)) >= 1.0 and "remote_min_rate_bytes_s" in msg
    assert RemoteTooSlow.exit_code == 43


def test_through_open_store_a_trickle_is_not_retried_as_an_outage(bucket, moto_endpoint, proxy):
    direct = S3Backend(bucket, "t", endpoint_url=moto_endpoint)
    direct.save("obj", os.urandom(128 * KiB))
    proxy.trickle = ("down", 2 * KiB, 0.2)
    s = Settings(s3_endpoint=proxy.url, remote_deadline_floor_s=1.0, s3_outage_s=30)
    b = open_backend(f"s3://{bucket}/t", settings=s, unseal=False)
    t0 = time.monotonic()
    with pytest.raises(RemoteTooSlow):
        b.load("obj")
    assert time.monotonic() - t0 < 1.0 + 0.125 + 1.0  # one attempt: not 30 s of retries
    assert b.retries == 0


def test_an_upload_the_server_takes_slowly_ends_at_its_deadline(bucket, moto_endpoint, proxy):
    # loopback's socket buffers take a few MiB at once: 24 MiB at a 64 MiB/s minimum (1.375 s)
    b = S3Backend(bucket, "t", endpoint_url=proxy.url, connect_timeout=1.0, bound=TransferBound(1.0, 64 * MiB))
    proxy.trickle = ("up", 64 * KiB, 0.05, 16 * KiB)  # 320 KiB/s: each 128 KiB piece within 1 s
    t0 = time.monotonic()
    with pytest.raises(RemoteTooSlow) as ei:
        b.save("chunks/up", os.urandom(24 * MiB))
    took = time.monotonic() - t0
    # the deadline, plus at most one socket timeout for the piece being handed over when it passed
    # (while a request is sent urllib3's socket has the connect timeout, 1 s here, 5 s by default)
    assert took < 1.375 + 1.0 + 1.0, took
    msg = str(ei.value)
    assert f"save s3://{bucket}/t/chunks/up at {proxy.url}" in msg and "bytes sent in" in msg, msg
    proxy.trickle = None
    assert not S3Backend(bucket, "t", endpoint_url=moto_endpoint).exists("chunks/up")  # nothing half-written


@pytest.mark.parametrize("fault", ["headers", "stall"])
def test_every_s3_request_ends_at_its_deadline_head_included(bucket, moto_endpoint, proxy, fault):
    """A server that trickles its whole answer from the first byte (the status line and headers a
    byte every 0.2 s: never silent for the 20 s read timeout), or answers nothing at all: every
    request (``load``, ``load_into``, a ranged ``load``, ``stat``, a ``list`` page, ``save``,
    ``remove``) ends at its total deadline (floor 1 s + size at 1 MiB/s), naming the request,
    the object and the seconds waited, not at the read timeout."""
    direct = S3Backend(bucket, "t", endpoint_url=moto_endpoint)
    direct.save("chunks/c", os.urandom(64 * KiB))
    b = S3Backend(bucket, "t", endpoint_url=proxy.url, read_timeout=20.0, bound=TransferBound(1.0, MiB))
    if fault == "headers":
        proxy.trickle = ("down", 0, 0.2)
    else:
        proxy.stall = True
    calls = {"load": (lambda: b.load("chunks/c"), 0), "load_into": (lambda: b.load_into("chunks/c", bytearray(), 128 * KiB), 128 * KiB + 1),
             "ranged load": (lambda: b.load("chunks/c", 10, 32 * KiB), 32 * KiB), "stat": (lambda: b.stat("chunks/c"), 0),
             "list": (lambda: list(b.list("chunks/")), 0), "save": (lambda: b.save("chunks/d", b"x" * 1000), 1000),
             "remove": (lambda: b.remove("chunks/c"), 0)}
    def timed(call) -> tuple[RemoteTooSlow, float]:
        t0 = time.monotonic()
        with pytest.raises(RemoteTooSlow) as ei:
            call()
        return ei.value, time.monotonic() - t0

    with ThreadPoolExecutor(len(calls)) as pool:  # side by side: each waits out its own deadline
        ended = dict(zip(calls, pool.map(timed, (call for call, _ in calls.values()))))
    for name, (_, size) in calls.items():
        err, took = ended[name]
        bound = 1.0 + size / MiB
        assert bound - 0.05 < took < bound + 0.5, (name, took, bound)
        msg = str(err)
        op = {"ranged load": "load", "load_into": "load"}.get(name, name)
        where = "chunks/" if name == "list" else ("chunks/d" if name == "save" else "chunks/c")
        assert f"{op} s3://{bucket}/t/{where} at {proxy.url}: too slow: " in msg, (name, msg)
        # a save waits for "100 Continue" before its body: it may end with none of it sent
        m = re.search(r"too slow: (stalled: no answer after|0 of [\d,]+ bytes sent in) (\d+\.\d+) s", msg)
        assert m and float(m.group(2)) >= 1.0 and "remote_deadline_floor_s 1 s" in msg, msg
    if fault == "stall":  # nothing reached the server (a trickled answer's request did)
        assert direct.exists("chunks/c") and not direct.exists("chunks/d")


def test_pull_of_a_trickling_remote_exits_43_within_its_bound(bucket, moto_endpoint, proxy, tmp_path):
    from test_store_fixtures import push, snapshot, write_payload
    from warmctl.store import open_store
    from warmctl.naming.trust import generate_keypair

    f = write_payload(tmp_path / "pages-1.img", [("random", 6 * 64 * KiB)], seed=3)
    local = open_store(tmp_path / "local", chunk_size=64 * KiB)
    kp = generate_keypair(tmp_path / "node" / "keys", "publisher")
    snapshot(local, "tiny", {"pages-1.img": f}, signer=kp.private)
    push(local, open_store(f"s3://{bucket}/snaps"), "tiny", "latest")
    local.close()
    proxy.trickle = ("down", 16 * KiB, 0.2)
    env = isolated_env(tmp_path / "node", 1, 2)
    env.update(WARMCTL_S3_ENDPOINT=proxy.url, WARMCTL_REMOTE_DEADLINE_FLOOR_S="1", WARMCTL_S3_OUTAGE_S="30")
    t0 = time.monotonic()
    r = warmctl("pull", "tiny", "--all", "--from", f"s3://{bucket}/snaps", "--store", str(tmp_path / "dst"),
                env=env, check=False, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 43, (r.returncode, r.stderr)
    assert "too slow" in r.stderr and f"s3://{bucket}/snaps/" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert took < 20, took  # interpreter start + a few requests + one 1.1 s deadline, not 30 s of retries
    cfg = warmctl("config", "show", "--json", env=env, check=False)
    assert '"remote_deadline_floor_s"' in cfg.stdout and '"remote_min_rate_bytes_s"' in cfg.stdout


@pytest.mark.oci
def test_a_trickled_registry_blob_ends_at_its_deadline(tmp_path, monkeypatch, tmp_path_factory):
    from ports import free_port
    from registry_server import Registry, docker_config, make_ca, missing_binary
    from tests.conftest import need_service
    from test_store_fixtures import snapshot, write_payload

    from warmctl.store import Store, open_store
    from warmctl.store.layout import chunk_key
    from warmctl.store.oci import OCIBackend

    missing = missing_binary()
    need_service(missing and f"{missing} missing: run scripts/install-test-services.sh", "WARMCTL_REQUIRE_REGISTRY")
    d = tmp_path_factory.mktemp("registry")
    ca = make_ca(d / "ca")
    with Registry(d / "reg", free_port(), ca=ca, users={"u": "p"}) as reg:
        p = TcpProxy(f"http://{reg.host}").start()
        try:
            ph = f"127.0.0.1:{p.port}"
            auth = tmp_path / "auth.json"
            docker_config(auth, reg.host, "u", "p")
            import json

            doc = json.loads(auth.read_text())
            doc["auths"][ph] = doc["auths"][reg.host]
            auth.write_text(json.dumps(doc))
            monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
            repo = f"warmctl/t{uuid.uuid4().hex[:8]}"
            f = write_payload(tmp_path / "p.img", [("random", 512 * KiB)], seed=5)
            local = open_store(tmp_path / "a", chunk_size=256 * KiB)
            dig = snapshot(local, "tiny", {"p.img": f})
            direct = Store(OCIBackend(reg.host, repo, ca_bundle=ca.ca_cert))
            from test_store_fixtures import push

            push(local, direct, "tiny")
            chunk = local.get_manifest(dig).files[0].chunks[0].digest
            slow = OCIBackend(ph, repo, ca_bundle=ca.ca_cert, bound=TransferBound(1.0, MiB))
            slow._scan()  # metadata read untrickled: only the chunk's bytes trickle below
            p.trickle = ("down", 4 * KiB, 0.2)
            slow.api.client.close()  # new connections (the trickle counts per connection)
            slow.api.client = OCIBackend(ph, repo, ca_bundle=ca.ca_cert).api.client
            t0 = time.monotonic()
            with pytest.raises(RemoteTooSlow) as ei:
                slow.load(chunk_key(chunk))
            took = time.monotonic() - t0
            assert took < 1.0 + 0.3 + 1.0, took
            msg = str(ei.value)
            assert f"load chunk {chunk}" in msg and f"https://{ph}" in msg and "bytes received in" in msg, msg

            # an upload the registry takes at 320 KiB/s against a 64 MiB/s minimum: 24 MiB, 1.375 s
            p.trickle = ("up", 64 * KiB, 0.05, 16 * KiB)
            up = OCIBackend(ph, repo, ca_bundle=ca.ca_cert, bound=TransferBound(1.0, 64 * MiB))
            blob = os.urandom(24 * MiB)
            import hashlib

            digest = "sha256:" + hashlib.sha256(blob).hexdigest()
            t0 = time.monotonic()
            with pytest.raises(RemoteTooSlow) as ei:
                up.api.put_blob(digest, blob, len(blob), "upload a test blob")
            took = time.monotonic() - t0
            assert took < 1.375 + 1.5, took
            msg = str(ei.value)
            assert "upload a test blob" in msg and "bytes sent in" in msg, msg
            p.trickle = None
            from warmctl.store import ObjectNotFound

            with pytest.raises(ObjectNotFound):  # nothing half-uploaded under its digest
                direct.backend.api.send("HEAD", direct.backend.api.url(f"blobs/{digest}"), "probe").close()
        finally:
            p.stop()


@pytest.mark.oci
@pytest.mark.parametrize("fault", ["headers", "stall"])
def test_every_registry_request_ends_at_its_deadline_head_included(tmp_path, fault):
    """A registry (a real Distribution on loopback, plain HTTP, so the proxy trickles the head's
    own bytes) that trickles its whole answer from the first byte (the status line and headers a
    byte every 0.2 s: never silent for the 20 s read timeout), or answers nothing at all: every
    request of the OCI backend (a chunk's ranged GET, a manifest blob, an object's ``stat``, a
    ``list`` (the tags list), a ``save`` (its first request, the blob's HEAD) and a ``remove``)
    ends at its total deadline (floor 1 s + size at 1 MiB/s; a metadata read at most
    ``oci_read_deadline_s``, 1 s here) in ``RemoteTooSlow`` naming the request, the registry and
    the seconds waited, not at the read timeout."""
    from ports import free_port
    from registry_server import Registry, missing_binary
    from tests.conftest import need_service
    from test_store_fixtures import push, snapshot, write_payload

    from warmctl.store import Store, open_store
    from warmctl.store.layout import chunk_key
    from warmctl.store.oci import OCIBackend

    missing = missing_binary()
    need_service(missing and f"{missing} missing: run scripts/install-test-services.sh", "WARMCTL_REQUIRE_REGISTRY")
    with Registry(tmp_path / "reg", free_port()) as reg:
        p = TcpProxy(reg.url).start()
        try:
            ph, repo = f"127.0.0.1:{p.port}", f"warmctl/t{uuid.uuid4().hex[:8]}"
            f = write_payload(tmp_path / "p.img", [("random", 512 * KiB)], seed=6)
            local = open_store(tmp_path / "a", chunk_size=256 * KiB)
            dig = snapshot(local, "tiny", {"p.img": f})
            direct = OCIBackend(reg.host, repo, insecure=[reg.host])
            push(local, Store(direct), "tiny")
            direct._scan()
            direct.stat("config")  # the objects the calls below ask for exist
            chunk = local.get_manifest(dig).files[0].chunks[0].digest
            n = direct._chunks[chunk][2]

            def slow() -> OCIBackend:
                """A backend through the proxy that knows the layout (read untrickled)."""
                b = OCIBackend(ph, repo, insecure=[ph], read_timeout=20.0, read_deadline=1.0, bound=TransferBound(1.0, MiB))
                b._chunks, b._packs, b._artifacts = dict(direct._chunks), dict(direct._packs), dict(direct._artifacts)
                b._scanned = True
                return b

            if fault == "headers":
                p.trickle = ("down", 0, 0.2)
            else:
                p.stall = True
            calls = {"load chunk": (lambda b: b.load(chunk_key(chunk)), 1.0 + n / MiB, f"load chunk {chunk}"),
                     "load manifest": (lambda b: b.load(f"manifests/sha256/{dig[7:]}"), 1.0, f"manifest {dig[7:19]}"),
                     "stat": (lambda b: b.stat("config"), 1.0, "object config"),
                     "list": (lambda b: list(b.list("catalog/")), 1.0, "list tags"),
                     "save": (lambda b: b.save("catalog/x/y.json", b"x" * 1000), 1.0, "save catalog/x/y.json"),
                     "remove": (lambda b: b.remove("catalog/x/z.json"), 1.0, "remove catalog/x/z.json")}
            def timed(call) -> tuple[RemoteTooSlow, float]:
                b = slow()
                t0 = time.monotonic()
                with pytest.raises(RemoteTooSlow) as ei:
                    call(b)
                took = time.monotonic() - t0
                b.close()
                return ei.value, took

            with ThreadPoolExecutor(len(calls)) as pool:  # side by side: each waits out its own deadline
                ended = dict(zip(calls, pool.map(timed, (call for call, _, _ in calls.values()))))
            for name, (_, bound, what) in calls.items():
                err, took = ended[name]
                assert bound - 0.05 < took < bound + 0.5, (name, took, bound)
                msg = str(err)
                assert what in msg and f" at http://{ph}: too slow: stalled: no answer after" in msg, (name, msg)
                assert "remote_deadline_floor_s 1 s" in msg, msg
            if fault == "stall":  # nothing reached the registry
                with pytest.raises(ObjectNotFound):
                    direct.stat("catalog/x/y.json")
        finally:
            p.stop()
