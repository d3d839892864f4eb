"""Integration test against a real Ceph RGW on loopback (Debian's radosgw, ceph-mon, ceph-osd).

OPT-IN and NOT YET PASSING HERE: set ``WARMCTL_RGW_TESTS=1`` after
``scripts/install-test-services.sh``. The fixture starts a one-node cluster (mon on
127.0.0.1:19110, one memstore OSD, auth none) and radosgw (beast on 127.0.0.1:19111), creates an
S3 user, and runs the push/pull round trip against it. Status (this session): mon and OSD come
up in ~5 s, but radosgw 16.2.15 keeps logging ``send_auth_request get_initial_auth_request
returned -13`` towards the mon even with ``auth_client_required=none`` (a ``ceph`` client with
the same name and config connects fine), so the fixture skips after its start timeout with the
log tail. Next step: find which auth/connection-mode setting radosgw overrides for daemons
(``ms_mon_client_mode``? a cephx-only default of ``auth_supported`` for daemons?), or run with
cephx and a generated keyring.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from test_store_fixtures import snapshot, write_payload

from warmctl.store import S3Backend, Store, open_store, pull, push

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(os.environ.get("WARMCTL_RGW_TESTS") != "1", reason="opt-in: WARMCTL_RGW_TESTS=1 (see module docstring)"),
    pytest.mark.skipif(not all(shutil.which(b) for b in ("radosgw", "ceph-mon", "ceph-osd", "radosgw-admin", "monmaptool")), reason="ceph binaries missing: run scripts/install-test-services.sh"),
]

MON_PORT, RGW_PORT = 19110, 19111
CONF = """[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon}
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon warn on pool no redundancy = false
osd objectstore = memstore
memstore device bytes = 1073741824
osd crush chooseleaf type = 0
run dir = {d}/run
admin socket = {d}/run/$name.asok
log file = {d}/log/$name.log
pid file = {d}/run/$name.pid
mon data = {d}/mon/$cluster-$id
osd data = {d}/osd/$cluster-$id
keyring = /dev/null
ms bind ipv6 = false
osd max object name len = 460
osd max object namespace len = 64
[client.rgw.t]
rgw frontends = beast endpoint=127.0.0.1:{rgw}
rgw data = {d}/rgw
"""


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def rgw(tmp_path_factory):
    """A Ceph RGW on 127.0.0.1:19111; yields (endpoint, access key, secret key)."""
    d = tmp_path_factory.mktemp("ceph")
    for sub in ("mon", "osd/ceph-0", "run", "log", "rgw"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    fsid = str(uuid.uuid4())
    conf = d / "ceph.conf"
    conf.write_text(CONF.format(fsid=fsid, mon=MON_PORT, rgw=RGW_PORT, d=d))
    c = ["-c", str(conf)]
    run = lambda *a: subprocess.run(list(a), check=True, capture_output=True, timeout=60)  # noqa: E731
    run("monmaptool", "--create", "--add", "a", f"v2:127.0.0.1:{MON_PORT}", "--fsid", fsid, str(d / "monmap"))
    run("ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", str(d / "monmap"))
    run("ceph-mon", *c, "-i", "a")
    try:
        run("ceph", *c, "osd", "create")
        run("ceph-osd", *c, "-i", "0", "--mkfs")
        run("ceph-osd", *c, "-i", "0")
        subprocess.Popen(["radosgw", *c, "-n", "client.rgw.t", "--auth-client-required=none"])
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and not _port_open(RGW_PORT):
            time.sleep(0.5)
        if not _port_open(RGW_PORT):
            tail = (d / "log" / "client.rgw.t.log").read_text()[-600:] if (d / "log" / "client.rgw.t.log").exists() else ""
            pytest.skip(f"radosgw did not start within 45 s (known issue, see module docstring); log tail: {tail}")
        ak, sk = "warmctltest", "warmctltestsecret"
        run("radosgw-admin", *c, "-n", "client.rgw.t", "user", "create", "--uid", "warmctl", "--display-name", "warmctl", "--access-key", ak, "--secret", sk)
        yield f"http://127.0.0.1:{RGW_PORT}", ak, sk
    finally:
        for pidfile in sorted((d / "run").glob("*.pid")):
            try:
                os.kill(int(pidfile.read_text().strip()), 15)
            except (ValueError, ProcessLookupError):
                pass


def test_push_pull_against_ceph_rgw(rgw, tmp_path, monkeypatch):
    import boto3

    ep, ak, sk = rgw
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ak)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", sk)
    boto3.client("s3", endpoint_url=ep, region_name="us-east-1").create_bucket(Bucket="warmctl")
    f = write_payload(tmp_path / "p.img", [("random", 5 << 20), ("zero", 8 << 20), ("text", 3 << 20)])
    local = open_store(tmp_path / "a")
    d = snapshot(local, "tiny", {"p.img": f})
    remote = Store(S3Backend("warmctl", "snaps", endpoint_url=ep, multipart_threshold=5 << 20, part_size=5 << 20))
    push(local, remote, "tiny", "latest")
    b = open_store(tmp_path / "b")
    rep = pull(remote, b, "tiny", "latest")
    assert rep.digest == d and rep.chunks_copied == rep.chunks_total
    b.read_file(b.get_manifest(d).files[0].chunks, tmp_path / "out.img")
    assert Path(tmp_path / "out.img").read_bytes() == f.read_bytes()
    assert remote.verify().ok
