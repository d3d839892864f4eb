"""Content digests of required files (:mod:`warmctl.checkpoint.filedigest`) and the check
``up`` runs before a restore (:func:`warmctl.checkpoint.capture.missing_or_changed`), on real
files: a rewrite with other bytes of the same size is named, an unchanged file is not re-hashed;
and ``warmctl pull`` fills a node's cache for the ``up`` after it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.conftest import fake_env, warmctl

from warmctl.checkpoint.capture import missing_or_changed
from warmctl.checkpoint.filedigest import DigestCache, digests_of, file_key, hash_file, overlay_devices


def _lib(tmp_path, name="libfake.so", size=3 * (1 << 20) + 17):
    p = tmp_path / name
    p.write_bytes(os.urandom(size))
    return p


def test_hash_file_is_the_stores_digest_of_the_bytes(tmp_path):
    p = _lib(tmp_path)
    assert hash_file(p, "sha256") == "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
    assert hash_file(p).startswith("blake3:") and len(hash_file(p)) == len("blake3:") + 64


def test_an_unchanged_file_costs_a_stat_and_a_rewrite_of_the_same_size_is_named(tmp_path):
    lib, other = _lib(tmp_path), _lib(tmp_path, "libother.so", 4096)
    cache_file = tmp_path / "cache" / "file-digests.json"
    required = {str(lib): lib.stat().st_size, str(other): 4096}
    digests = digests_of(required, DigestCache(cache_file))
    assert cache_file.is_file()

    again = DigestCache(cache_file)  # a later `up`: a new process reads the cache
    assert missing_or_changed(required, digests, again) == [] and again.hashed == []

    st = lib.stat()
    with open(lib, "r+b") as f:  # rewritten in place: other bytes, the same size
        f.seek(1 << 20)
        f.write(b"\xff" * 64)
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back (ctime moves)
    assert lib.stat().st_size == st.st_size and lib.stat().st_mtime_ns == st.st_mtime_ns
    later = DigestCache(cache_file)
    problems = missing_or_changed(required, digests, later)
    assert len(problems) == 1 and problems[0].startswith(f"{lib}: content differs (same size, {st.st_size} bytes")
    assert "snapshot expects " + digests[str(lib)][:23] in problems[0]
    assert later.hashed == [str(lib)]  # the unchanged file was not read


def test_missing_and_resized_files_are_named_each(tmp_path):
    a, b = _lib(tmp_path, "a.so", 100), _lib(tmp_path, "b.so", 100)
    required = {str(a): 100, str(b): 100, str(tmp_path / "gone.so"): 5}
    digests = digests_of([str(a), str(b)], DigestCache(None))
    b.write_bytes(b"x" * 101)
    problems = missing_or_changed(required, digests)
    assert problems == [f"{b}: size 101 bytes, snapshot expects 100", f"{tmp_path / 'gone.so'}: missing"]


def test_a_manifest_without_digests_is_checked_by_size_and_a_damaged_cache_is_rebuilt(tmp_path):
    lib = _lib(tmp_path, size=10)
    assert missing_or_changed({str(lib): 10}) == []
    cache_file = tmp_path / "file-digests.json"
    cache_file.write_text("{not json")
    c = DigestCache(cache_file)
    assert c.entries == {} and c.digest(str(lib)) == hash_file(lib)
    c.save()
    assert DigestCache(cache_file).entries[str(lib)][5] == hash_file(lib)


def _overlay(tmp_path, lower, n: int):
    """A fresh overlay mount of ``lower`` at ``tmp_path/root`` (what a container's root is: a
    new mount, with a new anonymous device number, at each start); its own upper and work dirs."""
    upper, work, root = tmp_path / f"upper{n}", tmp_path / f"work{n}", tmp_path / "root"
    for d in (upper, work, root):
        d.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={upper},workdir={work}",
                    str(root)], check=True, capture_output=True)
    return root


def test_the_same_image_file_under_a_new_overlay_mount_is_not_hashed_again_but_a_changed_one_is(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("needs root to mount overlayfs (the test suite runs as root)")
    lower = tmp_path / "layer"
    lower.mkdir()
    lib = _lib(lower)
    cache_file = tmp_path / "file-digests.json"
    root = _overlay(tmp_path, lower, 1)  # the first pod of an image on a node
    path = str(root / lib.name)
    try:
        first = os.stat(path).st_dev
        assert first in overlay_devices() and first != lib.stat().st_dev
        digests = digests_of([path], DigestCache(cache_file))
        # the next pod: the same layer under a new mount at the same path (mounted over the first,
        # which keeps its device number taken: the kernel reuses a freed one)
        _overlay(tmp_path, lower, 2)
        assert os.stat(path).st_dev not in (first, 0)
        again = DigestCache(cache_file)
        assert missing_or_changed({path: lib.stat().st_size}, digests, again) == [] and again.hashed == []
        with open(path, "r+b") as f:  # changed inside the container (copied up): its ctime moves
            f.write(b"\xff" * 64)
        later = DigestCache(cache_file)
        problems = missing_or_changed({path: lib.stat().st_size}, digests, later)
        assert later.hashed == [path] and len(problems) == 1 and "content differs" in problems[0]
    finally:
        for _ in range(2):
            subprocess.run(["umount", str(root)], capture_output=True)
    # on a plain filesystem the device stays in the key
    st = lib.stat()
    assert file_key(st, overlay_devices())[0] == st.st_dev != 0


def test_pull_hashes_the_files_the_snapshot_maps_so_up_on_that_node_hashes_none(tmp_path, fk_env, fake_snapshot,
                                                                                 engine_ports):
    """Node B pulls the fake engine's snapshot (the real pipeline under real CRIU) from a
    directory remote: ``pull --json`` reports the mapped files it hashed into B's digest cache,
    a second pull none, and B's ``up`` then hashes none (it says when it does: without the
    cache it hashes the same files)."""
    remote = tmp_path / "remote"
    warmctl("push", "fake", "--to", str(remote), env=fk_env)
    b = fake_env(tmp_path / "b", *engine_ports, hold=Path(fk_env["WARMCTL_CONFIG"]).parent / "hold")
    keys = Path(b["WARMCTL_CONFIG"]).parent / "keys"
    keys.mkdir(exist_ok=True)
    for pub in (Path(fk_env["WARMCTL_CONFIG"]).parent / "keys").glob("*.pub"):
        shutil.copy(pub, keys / pub.name)
    r = warmctl("pull", "fake", "--from", str(remote), "--json", env=b)
    [out] = json.loads(r.stdout)
    assert out["digest"] == fake_snapshot["digest"] and out["chunks_copied"] > 0, out
    hashed = out["files_hashed"]
    assert hashed > 0 and out["hash_seconds"] > 0, out
    r = warmctl("pull", "fake", "--from", str(remote), env=b)
    assert "hashed into this host's digest cache" not in r.stderr, r.stderr
    assert json.loads(warmctl("pull", "fake", "--from", str(remote), "--json", env=b).stdout)[0]["files_hashed"] == 0
    try:
        r = warmctl("up", "fake", "--json", "--cold-start", "never", env=b)
        res = json.loads(r.stdout)
        assert res["path"] == "restore" and res["snapshot"] == fake_snapshot["digest"], r.stderr
        assert "required files:" not in r.stderr, r.stderr
        warmctl("down", "fake", env=b)
        (Path(b["WARMCTL_TEST_HOME"]) / "cache" / "file-digests.json").unlink()
        r = warmctl("up", "fake", "--cold-start", "never", env=b)
        assert f"required files: {hashed} of {hashed} hashed" in r.stderr, r.stderr
    finally:
        warmctl("down", "fake", env=b, check=False)
