"""A full disk during ``pull`` and during ``up``'s materialize (issue 14's fault table), on a
real size-limited tmpfs mounted for the test (skipped where mounting is not allowed): the error
names the disk and the bytes, nothing is named or kept half-written, and the source stays
intact."""

from __future__ import annotations

import subprocess

import pytest

from tests.test_catalog import host, publish_snapshot
from tests.test_store_fixtures import MiB, make_manifest, write_payload
from warmctl.catalog import Catalog, Ref
from warmctl.checkpoint.imagecache import ImageCache
from warmctl.errors import HostError
from warmctl.fleet import entries_to_copy, transfer
from warmctl.store import open_store
from warmctl.trust import generate_keypair


def test_full_disk_during_pull_names_the_disk_and_names_nothing(tmp_path, small_fs):
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
    assert "disk full" in str(e.value) and str(small_fs) in str(e.value)
    local.close()
    local = open_store(small_fs / "store")
    assert Catalog(local).entries("tiny") == [] and local.list_manifests() == []  # nothing named
    assert local.verify().ok  # what was written is whole (at worst unreferenced chunks)
    assert not [p for p in (small_fs / "store" / "tmp").iterdir()]  # no half-written temp file
    assert remote.verify([d]).ok


def test_full_disk_during_materialize_keeps_no_partial_image(tmp_path, small_fs):
    store = open_store(tmp_path / "store")
    m = make_manifest(store, "tiny", {"pages-1.img": write_payload(tmp_path / "p.img", [("random", 12 * MiB)])})
    digest = store.put_manifest(m)
    cache = ImageCache(small_fs / "images")
    with pytest.raises(HostError) as e:
        cache.get(store, m, digest)
    assert "disk full" in str(e.value) and "needed 12,582,912 bytes" in str(e.value), str(e.value)
    assert cache.entries() == [] and not list(cache.root.glob(".partial-*"))
    assert store.verify([digest]).ok
    # the same image fits on a larger disk afterwards (nothing of the failed try is in the way)
    assert ImageCache(tmp_path / "images").get(store, m, digest).written
