"""Manifest paths are checked whatever the signature says: every path when a
manifest is parsed, and where bundled files (role ``file``) may be written, before ``up`` writes
anything. The end-to-end cases publish a hand-made manifest unsigned into a real store and run
the real ``warmctl up --insecure-skip-signature-check`` against it."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from tests.conftest import isolated_env, warmctl

from warmctl.naming.catalog import Catalog, CatalogEntry, compat_key
from warmctl.checkpoint import capture
from warmctl.base.errors import IntegrityError
from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest, sha256_digest
from warmctl.store import manifest_key, open_store
from warmctl.store import maintenance


def _doc(files: list[dict], host: dict | None = None, **restore) -> dict:
    return {
        "format": 1, "kind": "snapshot", "name": "evil", "created": "2026-01-01T00:00:00Z",
        "profile_digest": "sha256:" + "1" * 64, "profile": {"name": "evil"}, "host": host or {},
        "canary": {"match": "tokens", "max_tokens": 1, "logprobs": 0, "completions": []},
        "phases": [], "restore": restore, "files": files,
    }


def _raw(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize("path, why", [
    ("../../../../../../tmp/x", "'..'"),
    ("a/../../b", "'..'"),
    ("/etc/passwd", "absolute"),
    ("a//b", "empty"),
    ("./a", "'.'"),
    ("a\0b", "NUL"),
    ("", "empty path"),
])
def test_parse_refuses_bad_file_paths(path, why):
    with pytest.raises(ValueError, match=why) as e:
        Manifest.from_bytes(_raw(_doc([{"path": path, "role": "image", "size": 0}])))
    assert "files.0.path" in str(e.value)  # says where


def test_parse_refuses_bad_link_and_restore_paths():
    with pytest.raises(ValueError, match=r"files\.1\.hardlink_to: .*'\.\.'"):
        Manifest.from_bytes(_raw(_doc([{"path": "a", "role": "shm", "size": 0},
                                       {"path": "b", "role": "shm", "size": 0, "hardlink_to": "../a"}])))
    with pytest.raises(ValueError, match=r"restore\.cwd: .*not absolute"):
        Manifest.from_bytes(_raw(_doc([], cwd="run/x")))
    with pytest.raises(ValueError, match=r"restore\.log_path: .*'\.\.'"):
        Manifest.from_bytes(_raw(_doc([], log_path="/var/log/../../etc/cron.d/x")))
    with pytest.raises(ValueError, match=r"restore\.required_files: .*NUL"):
        Manifest.from_bytes(_raw(_doc([], required_files={"/usr/lib/x\0": 1})))
    ok = Manifest.from_bytes(_raw(_doc([{"path": "root/.cache/vllm/k.so", "role": "file", "size": 0},
                                        {"path": "pages-1.img", "role": "image", "size": 0}],
                                       cwd="/var/lib/warmctl/run/x", required_files={"/usr/lib/libc.so.6": 9})))
    assert [f.path for f in ok.files] == ["root/.cache/vllm/k.so", "pages-1.img"]


def test_store_refuses_a_stored_manifest_with_a_bad_path(tmp_path):
    """The bytes match their digest, the content does not pass: IntegrityError naming both."""
    with open_store(tmp_path / "s") as s:
        data = _raw(_doc([{"path": "../../x", "role": "image", "size": 0}]))
        d = sha256_digest(data)
        s.backend.save(manifest_key(d), data)
        with pytest.raises(IntegrityError, match=r"manifest sha256:.*files\.0\.path: path '\.\./\.\./x'"):
            s.get_manifest(d)
        rep = maintenance.verify(s)
        assert not rep.ok and "'..'" in rep.bad_manifests[0]


def test_bundled_targets_refused_where_they_may_not_live(tmp_path):
    home = tmp_path / "home"
    link = tmp_path / "innocent"
    link.symlink_to("/etc")
    probs = capture.bundled_target_problems(
        ["/etc/cron.d/x", "/usr/local/bin/x", "/boot/x", "/root/.bashrc", "/root/.ssh/authorized_keys",
         f"{link}/shadow", f"{home}/store/config", "/home/u/.ssh/authorized_keys",
         "/root/.cache/vllm/torch_compile_cache/k.so", "/var/lib/libuuid/clock.txt", str(tmp_path / "ok.so")],
        [home])
    assert probs == [
        "/etc/cron.d/x is under /etc", "/usr/local/bin/x is under /usr", "/boot/x is under /boot",
        "/root/.bashrc is under /root", "/root/.ssh/authorized_keys is under /root",
        "/etc/shadow is under /etc", f"{home}/store/config is under warmctl's own {home}",
        "/home/u/.ssh/authorized_keys is under a .ssh directory",
    ]


def test_package_owned_reads_dpkg_lists(tmp_path):
    info = tmp_path / "info"
    info.mkdir()
    (info / "foo.list").write_text("/.\n/opt\n/opt/foo\n/opt/foo/bin\n")
    (info / "bar.list").write_text("/srv/bar/data\n")
    assert capture.package_owned(["/opt/foo/bin", "/opt/foo/bi", "/srv/bar/data", "/srv/x"], info) == {"/opt/foo/bin", "/srv/bar/data"}
    assert capture.bundled_target_problems(["/opt/foo/bin", "/opt/foo/lib"], [], info) == ["/opt/foo/bin belongs to an installed package (dpkg)"]
    real = Path("/var/lib/dpkg/info")
    if real.is_dir():  # this host's own database: a file outside the protected trees that dpkg owns
        owned = next((ln for f in sorted(real.glob("*.list")) for ln in f.read_text(errors="replace").splitlines()
                      if ln.startswith("/var/") and not ln.startswith(("/var/lib/dpkg", "/var/lib/apt")) and os.path.isfile(ln)), None)
        if owned:
            assert capture.bundled_target_problems([owned]) == [f"{owned} belongs to an installed package (dpkg)"]


# ----------------------------------------------------------------------------- the real `up`


def _publish_raw(store_dir: Path, doc: dict, payload: bytes, host: dict) -> str:
    """Store ``doc`` (its one file's chunks from ``payload``) and name it ``evil:latest``,
    unsigned, as a careless publisher could: bytes written past the model, which refuses them."""
    src = store_dir.parent.parent / "payload.bin"
    src.write_bytes(payload)
    with open_store(store_dir) as s:
        doc["files"][0]["chunks"] = [c.model_dump() for c in s.add_file(src)]
        doc["files"][0]["size"] = len(payload)
        data = _raw(doc)
        d = sha256_digest(data)
        s.backend.save(manifest_key(d), data)
        now = datetime.now(timezone.utc)
        Catalog(s).add(CatalogEntry(name="evil", tag="latest", manifest=d, created=now, published=now,
                                    profile_digest=doc["profile_digest"], size=len(payload), host=host,
                                    compat=compat_key(host)))
    return d


def _env(tmp_path: Path, engine_ports) -> dict[str, str]:
    return isolated_env(tmp_path, *engine_ports)


def test_up_refuses_image_path_escaping_the_image_dir(tmp_path, engine_ports):
    """The issue's try: an ``image`` entry ``../../../../../../tmp/x``, published unsigned, restored
    with --insecure-skip-signature-check: refused with a clear error, nothing written at /tmp/x
    (a unique name under /tmp here, so parallel runs do not collide)."""
    target = Path(f"/tmp/x-{uuid.uuid4().hex}")
    env = _env(tmp_path, engine_ports)
    d = _publish_raw(tmp_path / "home" / "store", _doc([{"path": f"../../../../../..{target}", "role": "image"}]),
                     b"#!/bin/sh\necho owned\n", {})
    try:
        r = warmctl("up", f"evil@{d}", "--insecure-skip-signature-check", "--cold-start", "never", env=env, check=False)
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "'..' component" in r.stderr and "files.0.path" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_up_refuses_bundled_file_under_etc(tmp_path, engine_ports):
    """A ``file`` entry (bundled file, restored at its absolute path) aimed at /etc: the manifest
    parses (the path is well formed), fits this host, and ``up`` refuses it before writing."""
    from warmctl.host import fingerprint

    target = Path(f"/etc/warmctl-test-{uuid.uuid4().hex[:12]}")  # harmless if a broken build writes it
    env = _env(tmp_path, engine_ports)
    host = fingerprint().model_dump(mode="json")
    src = tmp_path / "payload.bin"
    src.write_bytes(b"written by a warmctl test\n")
    from warmctl.records.profile import load_profile_file

    prof = load_profile_file(tmp_path / "profiles" / "tiny.toml")
    with open_store(tmp_path / "home" / "store") as s:
        m = Manifest(name="tiny", profile_digest=prof.digest(), profile=prof.model_dump(mode="json"), host=host,
                     canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
                     files=[FileEntry(path=str(target).lstrip("/"), role="file", size=src.stat().st_size,
                                      chunks=s.add_file(src))])
        d = s.put_manifest(m)
        Catalog(s).publish(d, m)  # unsigned
    try:
        r = warmctl("up", "tiny", "--insecure-skip-signature-check", "--cold-start", "never", env=env, check=False)
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"{target} is under /etc" in r.stderr and "nothing written" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert d


def test_up_of_a_snapshot_whose_recorded_profile_does_not_validate_is_a_clear_error(tmp_path, engine_ports):
    """No traceback for an expected failure: a manifest (well formed, fits this host, unsigned)
    whose embedded profile is not a profile, and no profile of that name on disk."""
    from warmctl.host import fingerprint

    env = _env(tmp_path, engine_ports)
    host = fingerprint().model_dump(mode="json")
    src = tmp_path / "core.img"
    src.write_bytes(b"x" * 100)
    with open_store(tmp_path / "home" / "store") as s:
        m = Manifest(name="nameless", profile_digest="sha256:" + "1" * 64, profile={"name": "nameless"}, host=host,
                     canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
                     files=[FileEntry(path="core.img", size=100, chunks=s.add_file(src))])
        Catalog(s).publish(s.put_manifest(m), m)
    r = warmctl("up", "nameless", "--insecure-skip-signature-check", "--cold-start", "never", env=env, check=False)
    assert r.returncode == IntegrityError.exit_code, r.stdout + r.stderr
    assert "the profile it records does not validate: engine: Field required" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
