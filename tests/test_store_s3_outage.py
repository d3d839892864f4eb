"""S3 outages: the endpoint (a TCP proxy in front of a real moto server) dies mid-pull.

A short outage is retried through (one notice when it starts, one when it ends); an outage
longer than the window ends the command with one line naming the endpoint and the object, and
a rerun fetches only the chunks still missing. Every other failure of the S3 client is either
retried or one clear error (see warmctl/store/s3.py)."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
from tests.conftest import isolated_env, warmctl
from tcp_proxy import TcpProxy
from test_store_fixtures import chunk_files, push, snapshot, write_payload
from test_store_proxy import FaultProxy

from warmctl.naming.catalog import Catalog
from warmctl.base.errors import HostError
from warmctl.naming.trust import generate_keypair
from warmctl.store import (
    BackendUnavailable,
    ObjectNotFound,
    RetryingBackend,
    S3Backend,
    TransientBackendError,
    manifest_key,
    open_store,
)
from warmctl.store import maintenance

pytestmark = pytest.mark.s3
CH = 64 * 1024  # small chunks: dozens of objects in a few MiB


@pytest.fixture
def remote_snap(s3_url, tmp_path):
    """tiny:latest (48 random chunks of 64 KiB + some zeros) pushed to the moto bucket; yields
    (s3 url, digest, the file, number of stored chunks, their stored bytes)."""
    f = write_payload(tmp_path / "pages-1.img", [("random", 48 * CH), ("zero", 4 * CH)], seed=7)
    local = open_store(tmp_path / "local", chunk_size=CH)
    kp = generate_keypair(tmp_path / "node" / "keys", "publisher")  # the node's keys_dir trusts it
    d = snapshot(local, "tiny", {"pages-1.img": f}, signer=kp.private)
    rep = push(local, open_store(s3_url), "tiny", "latest")
    local.close()
    assert rep.chunks_total == 48
    return s3_url, d, f, rep.chunks_total, rep.bytes_copied


def _env(tmp_path, endpoint, **extra):
    env = isolated_env(tmp_path / "node", 1, 2)  # no engine here: the ports are never opened
    env["WARMCTL_S3_ENDPOINT"] = endpoint
    env["COLUMNS"] = "100"  # as on a narrow terminal: the error must still be one line
    env.update(extra)
    return env


def _pull(url, dst, env):
    # --all: the synthetic snapshot records no host fingerprint for pull's host check
    return warmctl("pull", "tiny", "--all", "--from", url, "--store", str(dst), env=env, check=False, timeout=300)


def _check_restored(dst, digest, f, tmp_path):
    store = open_store(dst)
    assert Catalog(store).newest("tiny") == digest
    assert maintenance.verify(store).ok
    store.read_file(store.get_manifest(digest).files[0].chunks, tmp_path / "restored.img")
    assert (tmp_path / "restored.img").read_bytes() == f.read_bytes()


def test_pull_survives_endpoint_down_for_3_s(remote_snap, moto_endpoint, tmp_path):
    url, d, f, total, stored = remote_snap
    dst = tmp_path / "dst"
    proxy = TcpProxy(moto_endpoint).start()
    proxy.down_after, proxy.down_for = stored // 3, 3.0  # a third of the way in, for 3 s
    try:
        r = _pull(url, dst, _env(tmp_path, proxy.url))
    finally:
        proxy.stop()
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert proxy.downs == 1, "the endpoint did not go down mid-pull"
    # one notice for the outage and one for the recovery, not one per retry
    assert len(re.findall(r"remote store http://127\.0\.0\.1:\d+ not answering", r.stderr)) == 1, r.stderr
    assert len(re.findall(r"answering again after", r.stderr)) == 1, r.stderr
    assert f"{total}/{total} chunks copied" in r.stderr
    _check_restored(dst, d, f, tmp_path)


def test_pull_gives_up_after_window_then_rerun_fetches_only_missing(remote_snap, moto_endpoint, tmp_path):
    url, d, f, total, stored = remote_snap
    bucket = urlparse(url).netloc
    dst = tmp_path / "dst"
    proxy = TcpProxy(moto_endpoint).start()
    proxy.down_after = stored // 3  # and stays down
    try:
        env = _env(tmp_path, proxy.url, WARMCTL_S3_OUTAGE_S="2")
        r = _pull(url, dst, env)
        assert r.returncode != 0 and proxy.downs == 1
        assert "Traceback" not in r.stderr, r.stderr
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and errors[0] == r.stderr.rstrip("\n").splitlines()[-1], r.stderr
        line = errors[0]
        assert f"remote store {proxy.url} unavailable" in line
        assert re.search(rf"load s3://{bucket}/snaps/chunks/blake3/[0-9a-f]{{2}}/[0-9a-f]{{64}} at {re.escape(proxy.url)}: ", line), line
        assert "s3_outage_s = 2 s" in line and "rerun" in line
        have = len(chunk_files(dst))
        assert 0 < have < total
        assert Catalog(open_store(dst)).newest("tiny") is None  # nothing half-done is visible

        proxy.up()
        r = _pull(url, dst, env)
        assert r.returncode == 0, r.stderr
        assert f"{total - have}/{total} chunks copied" in r.stderr, r.stderr
    finally:
        proxy.stop()
    _check_restored(dst, d, f, tmp_path)


def test_push_survives_endpoint_down_for_3_s(s3_url, moto_endpoint, tmp_path):
    f = write_payload(tmp_path / "pages-1.img", [("random", 48 * CH)], seed=8)
    local = open_store(tmp_path / "local", chunk_size=CH)
    kp = generate_keypair(tmp_path / "node" / "keys", "publisher")  # the node's keys_dir trusts it
    d = snapshot(local, "tiny", {"pages-1.img": f}, signer=kp.private)
    local.close()
    proxy = TcpProxy(moto_endpoint).start()
    proxy.down_after, proxy.down_for = 16 * CH, 3.0  # mid-upload, for 3 s
    try:
        r = warmctl("push", "tiny", "--to", s3_url, "--store", str(tmp_path / "local"),
                    env=_env(tmp_path, proxy.url), check=False, timeout=300)
    finally:
        proxy.stop()
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert proxy.downs == 1
    assert len(re.findall(r"not answering", r.stderr)) == 1 and "answering again" in r.stderr, r.stderr
    assert "48/48 chunks copied" in r.stderr
    remote = open_store(s3_url)  # straight to moto
    assert Catalog(remote).newest("tiny") == d and maintenance.verify(remote).ok


def _backend(endpoint, url, window=0.5, **kw):
    u = urlparse(url)
    return RetryingBackend(S3Backend(u.netloc, u.path, endpoint_url=endpoint, **kw), window, base_delay=0.01, setting="s3_outage_s")


@pytest.mark.parametrize("outage", ["refused", "dns", "stall"])
def test_unreachable_endpoint_is_retried_then_one_line(remote_snap, moto_endpoint, outage):
    url = remote_snap[0]
    key = "config"
    proxy = TcpProxy(moto_endpoint).start()
    try:
        if outage == "refused":
            proxy.down()
            endpoint, reason = proxy.url, "connection refused"
        elif outage == "dns":
            endpoint, reason = "http://warmctl-test.invalid:9000", "cannot resolve host 'warmctl-test.invalid' (DNS)"
        else:
            proxy.stall = True
            endpoint, reason = proxy.url, "no answer for 0.2 s (read timeout)"
        b = _backend(endpoint, url, read_timeout=0.2)
        with pytest.raises(BackendUnavailable) as ei:
            b.load(key)
    finally:
        proxy.stop()
    msg = str(ei.value)
    assert "\n" not in msg and b.retries >= 1
    assert f"remote store {endpoint} unavailable" in msg and f"load {url}/{key} at {endpoint}: {reason}" in msg


def test_answers_recovering_within_the_window_are_retried(remote_snap, moto_endpoint):
    url, d = remote_snap[:2]
    proxy = TcpProxy(moto_endpoint).start()
    proxy.down_after, proxy.down_for = 1, 0.5  # down at the first answer's first bytes, back after 0.5 s
    try:
        b = _backend(proxy.url, url, window=30)
        assert b.load(manifest_key(d)) == open_store(url).get_manifest_bytes(d)
    finally:
        proxy.stop()
    assert proxy.downs == 1 and b.retries >= 1


@pytest.mark.parametrize("fault", ["503", "truncate", "reset"])
def test_server_faults_are_transient(remote_snap, moto_endpoint, fault):
    url = remote_snap[0]
    proxy = FaultProxy(moto_endpoint).start()
    proxy.fault = lambda m, p, n: fault if m == "GET" else None
    try:
        with pytest.raises(BackendUnavailable, match=r"HTTP 503 SlowDown|body cut short|connection"):
            _backend(proxy.url, url, window=0.3).load("config")
    finally:
        proxy.stop()


def test_permanent_errors_are_one_line_without_retry(remote_snap, moto_endpoint):
    url = remote_snap[0]
    b = _backend(moto_endpoint, url.replace(urlparse(url).netloc, "warmctl-no-such-bucket"), window=30)
    with pytest.raises(HostError) as ei:
        b.load("config")
    assert not isinstance(ei.value, TransientBackendError) and b.retries == 0
    assert str(ei.value) == (
        f"load s3://warmctl-no-such-bucket/snaps/config at {moto_endpoint}: bucket "
        "'warmctl-no-such-bucket' does not exist; check the bucket in the store URL and the endpoint"
    )
    proxy = FaultProxy(moto_endpoint).start()
    proxy.fault = lambda m, p, n: "403"
    try:
        b = _backend(proxy.url, url, window=30)
        with pytest.raises(HostError, match=r"access refused \(HTTP 403 AccessDenied\); check the credentials") as ei:
            b.load("config")
        assert b.retries == 0 and "\n" not in str(ei.value)
    finally:
        proxy.stop()
    with pytest.raises(ObjectNotFound):
        _backend(moto_endpoint, url, window=30).load("manifests/sha256/0000000000000000000000000000000000000000000000000000000000000000")


def test_ranged_load_checks_length(remote_snap, moto_endpoint):
    url = remote_snap[0]
    b = _backend(moto_endpoint, url).inner
    b.save("obj", bytes(range(256)) * 40)
    assert b.load("obj", 10, 20) == bytes(range(10, 30))
    assert b.load("obj", 10_230) == (bytes(range(256)) * 40)[10_230:]
    assert b.load("obj", 10_230, 100) == (bytes(range(256)) * 40)[10_230:]  # past the end: what there is
    r = {"ResponseMetadata": {"HTTPStatusCode": 206}, "ContentRange": "bytes 10-29/10240"}
    with pytest.raises(TransientBackendError, match=r"body cut short: 15 of 20 bytes"):
        b._check_length("obj", r, bytes(15), 10, 20, True)
    whole = {"ResponseMetadata": {"HTTPStatusCode": 200}, "ContentLength": 10240}  # Range ignored
    assert b._check_length("obj", whole, bytes(range(256)) * 40, 10, 20, True) == bytes(range(10, 30))
