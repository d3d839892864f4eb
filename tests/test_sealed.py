"""Sealed stores, with real directory remotes and the Ceph RGW the suite runs:
two homes share a fleet key; A pushes to a sealed remote, which then holds no plaintext of the
snapshot; B reads it back bit for bit; a host with another key, or none, is refused naming the
key ids; a flipped byte names the chunk; rotation re-wraps the data key without rewriting an
object. The engine's side (B restores a sealed snapshot of the real engine and serves) is in
test_e2e_secrets.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_store_fixtures import push, snapshot, tag_of, write_payload

from warmctl.base.errors import IntegrityError
from warmctl.records.config import Settings
from warmctl.store import chunk_key, open_backend, open_store
from warmctl.store.sealed import OVERHEAD, SEALED, SealKeyError, key_id, load_key, seal_store

REPO = Path(__file__).resolve().parent.parent
MARKER = b"MARKER-of-the-engine-image-5f0c3a9e"


def _key(path: Path) -> Path:
    path.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """A's local store with one snapshot whose files hold MARKER; fleet keys k1 (A and B) and k2."""
    (tmp_path / "none.toml").write_text("")
    monkeypatch.setenv("WARMCTL_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.delenv("WARMCTL_SEAL_KEY", raising=False)  # for the CLI's processes
    k1, k2 = _key(tmp_path / "k1"), _key(tmp_path / "k2")
    a = open_store(tmp_path / "a")
    img = write_payload(tmp_path / "pages-1.img", [("random", 300_000), ("zero", 2 << 20), ("text", 500_000)])
    with open(img, "ab") as f:
        f.write(MARKER * 100 + os.urandom(1000))
    snapshot(a, "tiny", {"pages-1.img": img, "core.img": write_payload(tmp_path / "core.img", [("text", 70_000)])})
    return {"root": tmp_path, "a": a, "k1": k1, "k2": k2, "img": img}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmctl", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def _as(key: Path | None, **more) -> Settings:
    """The settings of a host whose seal_key is ``key`` (what its edge would resolve and pass down)."""
    return Settings(seal_key=key, **more)


def _plaintext_in(objects: dict[str, bytes]) -> list[str]:
    """Objects whose stored bytes show MARKER, the snapshot's name in a manifest, or a zstd frame."""
    return [k for k, v in objects.items() if MARKER in v or b'"name":"tiny"' in v or v.startswith(b"\x28\xb5\x2f\xfd")]


def _read_back(store, name: str = "tiny") -> bytes:
    m = store.get_manifest(tag_of(store, name))
    f = next(f for f in m.files if f.path == "pages-1.img")
    return b"".join(store.load_chunk(c) for c in f.chunks)


def test_sealed_directory_remote_travels_between_two_homes(homes, monkeypatch):
    root, a, k1, k2 = homes["root"], homes["a"], homes["k1"], homes["k2"]
    remote = root / "remote"
    r = _cli("seal", str(remote), "--key", str(k1), "--json", env={"WARMCTL_CONFIG": str(root / "none.toml")})
    assert r.returncode == 0, r.stderr
    sealed = json.loads(r.stdout)
    assert sealed["fleet_keys"] == [key_id(load_key(k1))]
    host = _as(k1)
    push(a, open_store(remote, settings=host), "tiny")
    # the remote holds no plaintext: not the image's bytes, no manifest or catalog JSON, no zstd frame
    objects = {str(p.relative_to(remote)): p.read_bytes() for p in remote.rglob("*") if p.is_file()}
    sealed_objs = {k: v for k, v in objects.items() if k not in ("config", SEALED) and not k.startswith("locks/")}
    assert len(sealed_objs) >= 4 and all(v.startswith(b"WSL1") for v in sealed_objs.values())
    assert _plaintext_in(sealed_objs) == []
    assert key_id(load_key(k1)) in objects[SEALED].decode() and base64.b64encode(load_key(k1)).decode() not in objects[SEALED].decode()
    # B, with the same fleet key, reads it back bit for bit (every chunk verified)
    b = open_store(root / "b")
    push(open_store(remote, settings=host), b, "tiny")
    assert _read_back(b) == homes["img"].read_bytes()
    # C, with another key, and D, with none, are refused naming the store's key id
    host = _as(k2)
    with pytest.raises(SealKeyError) as e:
        push(open_store(remote, settings=host), open_store(root / "c"), "tiny")
    assert key_id(load_key(k1)) in str(e.value) and key_id(load_key(k2)) in str(e.value)
    host = _as(None)
    with pytest.raises(SealKeyError, match="this host has no fleet key"):
        open_store(remote, settings=host).get_manifest(tag_of(a, "tiny"))
    r = _cli("ls", "--remote", "--json", env={"WARMCTL_CONFIG": str(root / "none.toml"), "WARMCTL_REMOTE_STORE": str(remote),
                                              "WARMCTL_HOME": str(root / "d")})
    assert r.returncode == 38 and key_id(load_key(k1)) in r.stderr, r.stderr
    assert not (root / "c" / "manifests").exists()  # nothing half-copied


def test_a_flipped_byte_of_a_sealed_chunk_names_the_chunk(homes, monkeypatch):
    root, a, k1 = homes["root"], homes["a"], homes["k1"]
    remote = root / "remote"
    seal_store(open_backend(remote, unseal=False), load_key(k1))
    host = _as(k1)
    push(a, open_store(remote, settings=host), "tiny")
    m = a.get_manifest(tag_of(a, "tiny"))
    ref = max((c for f in m.files for c in f.chunks if (remote / chunk_key(c.digest)).is_file()), key=lambda c: c.size)
    p = remote / chunk_key(ref.digest)
    blob = bytearray(p.read_bytes())
    assert len(blob) > OVERHEAD
    blob[len(blob) // 2] ^= 0x01
    p.chmod(0o644)
    p.write_bytes(bytes(blob))
    with pytest.raises(IntegrityError) as e:
        open_store(remote, settings=host).load_chunk(ref)
    assert ref.digest.split(":")[1] in str(e.value) and "fails authentication" in str(e.value)
    with pytest.raises(IntegrityError):  # pulling stops at it too, naming it
        push(open_store(remote, settings=host), open_store(root / "b"), "tiny")


def test_rotation_rewraps_the_data_key_and_rewrites_no_object(homes, monkeypatch):
    root, a, k1, k2 = homes["root"], homes["a"], homes["k1"], homes["k2"]
    remote = root / "remote"
    seal_store(open_backend(remote, unseal=False), load_key(k1))
    host = _as(k1)
    push(a, open_store(remote, settings=host), "tiny")
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (remote / "chunks").rglob("*") if p.is_file()}
    r = _cli("seal", str(remote), "--key", str(k2), "--old-key", str(k1),
             env={"WARMCTL_CONFIG": str(root / "none.toml")})
    assert r.returncode == 0 and key_id(load_key(k2)) in r.stdout, r.stderr
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before
    host = _as(k2)
    assert _read_back(open_store(remote, settings=host)) == homes["img"].read_bytes()
    host = _as(k1)
    with pytest.raises(SealKeyError, match=key_id(load_key(k2))):
        _read_back(open_store(remote, settings=host))
    # sealing a store that already holds objects in the clear is refused
    with pytest.raises(SealKeyError, match="in the clear"):
        seal_store(open_backend(root / "a", unseal=False), load_key(k1))


def test_a_fleet_key_file_must_be_private_and_32_bytes(tmp_path):
    k = _key(tmp_path / "k")
    k.chmod(0o644)
    with pytest.raises(SealKeyError, match="chmod 600"):
        load_key(k)
    k.chmod(0o600)
    k.write_text("c2hvcnQ=\n")
    with pytest.raises(SealKeyError, match="32 bytes"):
        load_key(k)


@pytest.mark.s3
def test_sealed_ceph_rgw_remote_holds_no_plaintext(homes, monkeypatch, rgw_bucket):
    import boto3

    a, k1 = homes["a"], homes["k1"]
    ep, ak, sk, bucket = rgw_bucket  # the session's RGW (conftest's ceph_rgw), a bucket of this test's
    client = boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id=ak, aws_secret_access_key=sk)
    for k, v in {"AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{bucket}/warmctl"
    seal_store(open_backend(url, unseal=False, settings=Settings(s3_endpoint=ep)), load_key(k1))
    host = _as(k1, s3_endpoint=ep)
    push(a, open_store(url, settings=host), "tiny")
    objects = {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
               for o in client.list_objects_v2(Bucket=bucket, Prefix="warmctl/")["Contents"]}
    sealed_objs = {k: v for k, v in objects.items() if k.split("/", 1)[1] not in ("config", SEALED)
                   and not k.split("/", 1)[1].startswith("locks/")}
    assert len(sealed_objs) >= 4 and _plaintext_in(sealed_objs) == []
    b = open_store(homes["root"] / "b")
    push(open_store(url, settings=host), b, "tiny")
    assert _read_back(b) == homes["img"].read_bytes()
