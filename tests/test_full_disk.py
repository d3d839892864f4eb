"""A full disk during ``pull`` and during ``up``'s materialize, on a
real size-limited tmpfs mounted for the test (skipped where mounting is not allowed): the error
names the disk and the bytes, nothing is named or kept half-written, and the source stays
intact."""

from __future__ import annotations


import pytest

from tests.test_catalog import host
from tests.test_store_fixtures import MiB, make_manifest, write_payload
from warmctl import diskspace
from warmctl.naming.catalog import Catalog, Ref
from warmctl.checkpoint.imagecache import ImageCache
from warmctl.base.errors import HostError
from warmctl.naming.fleet import entries_to_copy, transfer
from warmctl.store import open_store
from warmctl.store import maintenance
from warmctl.naming.trust import generate_keypair


@pytest.mark.parametrize("precheck", [True, False], ids=["refused-before", "filled-during"])
def test_full_disk_during_pull_names_the_disk_and_names_nothing(tmp_path, small_fs, monkeypatch, precheck):
    """Refused before the first chunk (the chunks to fetch, 12 MiB, against 6 MiB
    free); and, with that check out of the way (another writer filling the disk meanwhile), the
    copy failing amid the chunks."""
    if not precheck:
        monkeypatch.setattr(diskspace, "shortfall", lambda needs, freed=None: [])
    remote = open_store(tmp_path / "remote")
    key = generate_keypair(tmp_path / "keys", "a")
    src = write_payload(tmp_path / "big.img", [("random", 12 * MiB)])
    m = make_manifest(remote, "tiny", {"pages-1.img": src})
    m.host = host().model_dump(mode="json")
    d = remote.put_manifest(m)
    Catalog(remote).publish(d, m, tag="latest", signer=key.private)
    local = open_store(small_fs / "store")
    with pytest.raises(HostError) as e:
        transfer(remote, local, entries_to_copy(remote, Ref.parse("tiny")))
    if precheck:
        assert "not enough disk space for pull tiny:latest" in str(e.value), str(e.value)
        assert "needed 12,58" in str(e.value) and "3 chunk(s) to fetch of 3" in str(e.value), str(e.value)
        assert "6,291,456 bytes free" in str(e.value)
        assert not [p for p in (small_fs / "store").rglob("*") if p.is_file() and "chunks" in p.parts]  # none fetched
    else:
        assert "disk full" in str(e.value)
    assert str(small_fs) in str(e.value)
    local.close()
    local = open_store(small_fs / "store")
    assert Catalog(local).entries("tiny") == [] and local.list_manifests() == []  # nothing named
    assert maintenance.verify(local).ok  # what was written is whole (at worst unreferenced chunks)
    tmp = small_fs / "store" / "tmp"
    assert not tmp.exists() or not list(tmp.iterdir())  # no half-written temp file
    assert maintenance.verify(remote, [d]).ok


def test_full_disk_during_materialize_keeps_no_partial_image(tmp_path, small_fs):
    store = open_store(tmp_path / "store")
    m = make_manifest(store, "tiny", {"pages-1.img": write_payload(tmp_path / "p.img", [("random", 12 * MiB)])})
    digest = store.put_manifest(m)
    cache = ImageCache(small_fs / "images")
    with pytest.raises(HostError) as e:
        cache.get(store, m, digest)
    # refused before writing: the numbers and the path named
    assert "not enough disk space" in str(e.value) and "needed 12,582,912 bytes" in str(e.value), str(e.value)
    assert str(small_fs) in str(e.value) and "bytes free" in str(e.value)
    assert cache.entries() == [] and not list(cache.root.glob(".partial-*"))
    assert maintenance.verify(store, [digest]).ok
    # the same image fits on a larger disk afterwards (nothing of the failed try is in the way)
    assert ImageCache(tmp_path / "images").get(store, m, digest).written
