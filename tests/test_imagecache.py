"""The image cache: a verified CRIU image kept between ``up``s of one snapshot (real local store,
real files; no engine)."""

from __future__ import annotations

import json
import os

import pytest

from tests.test_store_fixtures import MiB, make_manifest, write_payload
from warmctl.naming.catalog import Catalog
from warmctl.checkpoint.imagecache import MARKER, ImageCache, entry_name, image_bytes
from warmctl.base.errors import HostError, IntegrityError
from warmctl.records.manifest import FileEntry
from warmctl.store import open_store


@pytest.fixture()
def snap(tmp_path):
    """A local store holding a snapshot of two image files, one weights file and one shm file."""
    store = open_store(tmp_path / "store")
    src = tmp_path / "src"
    files = {
        "pages-1.img": write_payload(src / "pages-1.img", [("random", 3 * MiB), ("zero", 5 * MiB), ("text", MiB)]),
        "core-1.img": write_payload(src / "core-1.img", [("text", 100_000)], seed=1),
    }
    m = make_manifest(store, "tiny", files)
    w = write_payload(src / "rank0.safetensors", [("random", 200_000)], seed=2)
    # chunk 0 has data, chunks 1-2 are zero (holes once written), chunk 3 has a little text
    s = write_payload(src / "psm_x", [("random", 10_000), ("zero", 12 * MiB - 10_000), ("text", 5000)], seed=3)
    m.files.append(FileEntry(path="ranks/rank0.safetensors", role="weights", size=w.stat().st_size,
                             chunks=store.add_file(w)))
    m.files.append(FileEntry(path="psm_x", role="shm", size=s.stat().st_size, chunks=store.add_file(s)))
    digest = store.put_manifest(m)
    return store, m, digest, src


def test_first_get_writes_verified_entry_then_reuses_it(tmp_path, snap):
    store, m, digest, src = snap
    cache = ImageCache(tmp_path / "cache" / "images")
    seen = []
    img = cache.get(store, m, digest, progress=seen.append)
    assert img.written and img.path.name == entry_name(digest)
    assert (img.images / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
    assert (img.images / "core-1.img").read_bytes() == (src / "core-1.img").read_bytes()
    assert (img.weights / "rank0.safetensors").read_bytes() == (src / "rank0.safetensors").read_bytes()
    assert not (img.images / "psm_x").exists() and (img.path / "shm" / "psm_x").is_file()
    assert sum(seen) == sum(f.size for f in m.files if f.role in ("image", "weights", "shm"))
    assert os.stat(cache.root).st_mode & 0o777 == 0o700
    assert json.loads((img.path / MARKER).read_text())["manifest"] == digest
    ino = (img.images / "pages-1.img").stat().st_ino

    again = cache.get(store, m, digest)
    assert not again.written and (again.images / "pages-1.img").stat().st_ino == ino  # nothing rewritten
    assert not list(cache.root.glob(".partial-*"))


def test_changed_file_invalidates_entry(tmp_path, snap):
    store, m, digest, src = snap
    cache = ImageCache(tmp_path / "cache")
    img = cache.get(store, m, digest)
    p = img.images / "core-1.img"
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:  # same size, other bytes
        f.write(b"X")
    assert cache.lookup(m, digest) is None and not img.path.exists()  # removed, not trusted
    img2 = cache.get(store, m, digest)
    assert img2.written and (img2.images / "core-1.img").read_bytes() == (src / "core-1.img").read_bytes()


def test_missing_marker_or_file_is_a_miss(tmp_path, snap):
    store, m, digest, _ = snap
    cache = ImageCache(tmp_path / "cache")
    img = cache.get(store, m, digest)
    (img.path / MARKER).unlink()
    assert cache.lookup(m, digest) is None
    img = cache.get(store, m, digest)
    (img.images / "core-1.img").unlink()
    assert cache.lookup(m, digest) is None


def test_entry_writable_by_others_is_not_trusted(tmp_path, snap):
    store, m, digest, _ = snap
    cache = ImageCache(tmp_path / "cache")
    img = cache.get(store, m, digest)
    os.chmod(img.path, 0o777)
    assert cache.lookup(m, digest) is None and not img.path.exists()


def test_unsafe_root_refused(tmp_path, snap):
    store, m, digest, _ = snap
    root = tmp_path / "cache"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    with pytest.raises(HostError, match="writable by group or others"):
        ImageCache(root).get(store, m, digest)


def test_corrupt_chunk_leaves_no_entry(tmp_path, snap):
    store, m, digest, _ = snap
    ref = next(c for f in m.files if f.path == "core-1.img" for c in f.chunks)
    chunk = next(p for p in (tmp_path / "store" / "chunks").rglob("*") if p.is_file() and ref.digest.split(":")[1] in p.name)
    os.chmod(chunk, 0o644)
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(IntegrityError):
        cache.get(store, m, digest)
    assert list(cache.root.iterdir()) == []


def test_prune_keeps_most_recent_and_gc_set(tmp_path, snap):
    store, m, digest, src = snap
    m2 = make_manifest(store, "other", {"pages-1.img": write_payload(src / "o.img", [("random", MiB)], seed=9)})
    d2 = store.put_manifest(m2)
    cache = ImageCache(tmp_path / "cache", budget=image_bytes(m) + image_bytes(m2) // 2 + 64 * 1024)
    cache.get(store, m, digest)
    img2 = cache.get(store, m2, d2)  # both do not fit the budget: the older entry goes
    assert [e.digest for e in cache.entries()] == [d2] and [e.digest for e in img2.evicted] == [digest]
    assert cache.du() >= MiB
    removed = cache.prune(keep_digests=set())  # gc: no manifest left that names it
    assert [e.digest for e in removed] == [d2] and cache.entries() == []


def test_budget_zero_keeps_nothing_and_release_removes(tmp_path, snap):
    store, m, digest, src = snap
    cache = ImageCache(tmp_path / "cache", budget=0)
    img = cache.get(store, m, digest, scratch=tmp_path / "run" / "unkept-image")
    assert img.written and not img.kept and "keeps no image" in img.not_kept
    assert img.path == tmp_path / "run" / "unkept-image"
    assert (img.images / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
    assert cache.entries() == []
    cache.release(img, busy=True)  # a lazy restore's daemon still reads it
    assert img.path.exists()
    cache.release(img)
    assert not img.path.exists()


def test_entry_name_rejects_non_digest():
    assert entry_name("sha256:" + "ab" * 32) == "sha256-" + "ab" * 32
    for bad in ("../x", "sha256:../../etc", "sha256:", "nocolon"):
        with pytest.raises(ValueError):
            entry_name(bad)


def test_store_gc_and_du_know_the_image_cache(tmp_path, monkeypatch):
    """`warmctl store du` lists kept images; `store gc` drops those whose manifest the local
    store no longer holds (after the grace period) and keeps the others."""
    import typer
    from typer.testing import CliRunner

    from warmctl.cli import store as store_cli

    monkeypatch.setenv("WARMCTL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WARMCTL_STORE", raising=False)
    monkeypatch.setenv("WARMCTL_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    store = open_store(tmp_path / "home" / "store")
    src = tmp_path / "src"
    m1 = make_manifest(store, "a", {"pages-1.img": write_payload(src / "a.img", [("random", MiB)], seed=1)})
    m2 = make_manifest(store, "b", {"pages-1.img": write_payload(src / "b.img", [("random", MiB)], seed=2)})
    d1 = store.put_manifest(m1)
    Catalog(store).publish(d1, m1)
    d2 = m2.digest()  # an image whose manifest this store does not hold (e.g. removed since)
    cache = ImageCache(tmp_path / "home" / "cache" / "images")
    cache.get(store, m1, d1)
    cache.get(store, m2, d2)
    store.close()  # its writer lock would block gc
    app = typer.Typer()
    store_cli.register(app)
    r = CliRunner()
    res = r.invoke(app, ["du"])
    assert res.exit_code == 0, res.output
    assert "kept images: 2" in res.output and d1[:19] in res.output and d2[:19] in res.output
    assert "(image only: no manifest here)" in res.output  # d2: its manifest is not in this store
    res = r.invoke(app, ["gc"])  # default grace 300 s: both were just used
    assert res.exit_code == 0, res.output
    assert sorted(e.digest for e in cache.entries()) == sorted([d1, d2])
    res = r.invoke(app, ["gc", "--grace", "0", "--dry-run"])
    assert "would remove 1 kept restore image" in res.output and len(cache.entries()) == 2
    res = r.invoke(app, ["gc", "--grace", "0"])
    assert res.exit_code == 0 and "removed 1 kept restore image" in res.output, res.output
    assert [e.digest for e in cache.entries()] == [d1]


def test_put_back_shm_copies_data_keeps_holes_and_links(tmp_path, snap):
    store, m, digest, src = snap
    m.files.append(FileEntry(path="link_remap.7", role="shm", size=m.files[-1].size, hardlink_to="psm_x"))
    digest = store.put_manifest(m)
    cache = ImageCache(tmp_path / "cache")
    img = cache.get(store, m, digest)
    shm = tmp_path / "shm"
    shm.mkdir()
    written = cache.put_back_shm(img, m, shm)
    assert sorted(p.name for p in written) == ["link_remap.7", "psm_x"]
    assert (shm / "psm_x").read_bytes() == (src / "psm_x").read_bytes()
    assert os.path.samefile(shm / "psm_x", shm / "link_remap.7")
    assert (shm / "psm_x").stat().st_blocks * 512 < 6 * MiB  # of 12 MiB: the zero chunks stayed holes
    (shm / "link_remap.7").unlink()
    with pytest.raises(HostError, match="another restore"):  # psm_x exists: nothing is overwritten
        cache.put_back_shm(img, m, shm)
    assert (shm / "psm_x").read_bytes() == (src / "psm_x").read_bytes() and not (shm / "link_remap.7").exists()
