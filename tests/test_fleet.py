"""The catalog as the one naming layer, between stores: push and pull carry catalog entries and
the profile record, a tag moves on the remote, ``NAME@digest`` pins a snapshot until gc, ``rm``
and gc free what nothing names, and stores written with the earlier ``tags/`` layout are read and
migrated. Real local stores and a real S3 server (moto) on loopback; two nodes = two stores,
each with its own signing key, trusting each other through ``keys_dir``."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from test_catalog import host, publish_snapshot

from warmctl.naming.catalog import Catalog, Ref
from warmctl.base.errors import IntegrityError, SnapshotNotFound
from warmctl.naming.fleet import copy_entry, entries_to_copy, transfer
from warmctl.store import open_store
from warmctl.store import maintenance
from warmctl.naming.trust import TrustError, generate_keypair

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def nodes(tmp_path):
    """Node A (publishes, key A) and node B (restores; trusts A only through its keys_dir)."""
    a_key = generate_keypair(tmp_path / "a-keys", "node-a")
    b_trust = tmp_path / "b-trusted"
    b_trust.mkdir()
    (b_trust / "node-a.pub").write_bytes(a_key.public.read_bytes())
    return {"a": open_store(tmp_path / "a"), "b": open_store(tmp_path / "b"), "a_key": a_key, "b_trust": b_trust}


def snap_on_a(nodes, tmp: Path, seed: int, created: datetime, fp=None, tag: str = "latest"):
    d, m = publish_snapshot(nodes["a"], tmp, fp or host(), seed, created=created)
    Catalog(nodes["a"]).publish(d, m, tag=tag, signer=nodes["a_key"].private)
    return d


def push(src, dst, ref: str):
    return transfer(src, dst, entries_to_copy(src, Ref.parse(ref)))


def test_push_then_pull_carries_entry_profile_and_signature(nodes, tmp_path):
    remote = open_store(tmp_path / "remote")
    d = snap_on_a(nodes, tmp_path, 1, T0)
    (copied,) = push(nodes["a"], remote, "tiny")
    assert copied.report.digest == d and copied.report.chunks_copied == copied.report.chunks_total > 0
    rc = Catalog(remote)
    assert [e.manifest for e in rc.entries("tiny")] == [d]
    assert rc.profile("tiny")["profile"] == {"name": "tiny", "seed": 1}
    # B resolves straight from the remote catalog: signed by A, trusted through B's keys_dir.
    r = rc.resolve("tiny", host(), nodes["b_trust"])
    assert r.entry.manifest == d and r.verification.trusted
    # pull for this host: B's local catalog names it; a second pull moves nothing.
    (pulled,) = transfer(remote, nodes["b"], entries_to_copy(remote, Ref.parse("tiny"), host()))
    assert pulled.report.chunks_copied > 0
    assert Catalog(nodes["b"]).resolve("tiny", host(), nodes["b_trust"]).entry.manifest == d
    (again,) = transfer(remote, nodes["b"], entries_to_copy(remote, Ref.parse("tiny"), host()))
    assert again.report.chunks_copied == 0
    # A node whose keys_dir lacks A's key refuses, naming the key that signed it.
    other = tmp_path / "nobody"
    generate_keypair(other, "someone-else")
    (other / "someone-else.key").unlink()
    with pytest.raises(TrustError) as e:
        rc.resolve("tiny", host(), other)
    assert nodes["a_key"].key_id in str(e.value)


def test_pull_picks_this_hosts_snapshot_or_names_every_rejection(nodes, tmp_path):
    remote = open_store(tmp_path / "remote")
    d_h100 = snap_on_a(nodes, tmp_path, 1, T0)
    d_cpu = snap_on_a(nodes, tmp_path, 2, T0, fp=host(gpus=0))
    assert len(push(nodes["a"], remote, "tiny")) == 2
    assert [e.manifest for e in entries_to_copy(remote, Ref.parse("tiny"), host(gpus=0))] == [d_cpu]
    with pytest.raises(SnapshotNotFound) as e:
        entries_to_copy(remote, Ref.parse("tiny"), host(arch="aarch64"))
    assert d_h100 in str(e.value) and d_cpu in str(e.value) and "architecture" in str(e.value)
    with pytest.raises(SnapshotNotFound, match="no snapshot tiny:nope in the catalog at"):
        entries_to_copy(remote, Ref.parse("tiny:nope"))


def test_tag_moves_on_the_remote_old_snapshot_stays_by_digest_until_gc(nodes, tmp_path):
    remote = open_store(tmp_path / "remote")
    old = snap_on_a(nodes, tmp_path, 1, T0)
    push(nodes["a"], remote, "tiny")
    new = snap_on_a(nodes, tmp_path, 2, T0 + timedelta(hours=1))  # same kind of host: the tag moves
    push(nodes["a"], remote, "tiny")
    rc = Catalog(remote)
    assert [e.manifest for e in rc.entries("tiny")] == [new]
    assert rc.resolve("tiny", host(), nodes["b_trust"]).entry.manifest == new
    # the old one is still restorable by digest, signature checked, until gc
    assert rc.resolve("tiny", host(), nodes["b_trust"], digest=old).verification.manifest.digest() == old
    with pytest.raises(SnapshotNotFound, match="does not fit this host"):
        rc.resolve("tiny", host(gpus=0), nodes["b_trust"], digest=old)
    old_chunks = remote.get_manifest(old).chunk_digests() - remote.get_manifest(new).chunk_digests()
    assert old_chunks
    rep = maintenance.gc(remote, keep=rc.referenced_manifests(), grace=0)
    assert rep.manifests_removed == [old] and rep.chunks_removed == len(old_chunks)
    assert not remote.has_manifest(old) and maintenance.verify(remote).ok
    with pytest.raises(SnapshotNotFound, match="no manifest"):
        rc.resolve("tiny", host(), nodes["b_trust"], digest=old)


def test_rm_then_gc_frees_what_nothing_else_names(nodes, tmp_path):
    remote = open_store(tmp_path / "remote")
    d = snap_on_a(nodes, tmp_path, 1, T0)
    keep = snap_on_a(nodes, tmp_path, 2, T0, tag="stable")
    push(nodes["a"], remote, "tiny")
    push(nodes["a"], remote, "tiny:stable")
    rc = Catalog(remote)
    assert rc.remove_tag("tiny", "latest") == [d] and rc.remove_tag("tiny", "latest") == []
    with pytest.raises(SnapshotNotFound):
        rc.resolve("tiny", host(), nodes["b_trust"])
    rep = maintenance.gc(remote, keep=rc.referenced_manifests(), grace=0)
    assert rep.manifests_removed == [d] and remote.list_manifests() == [keep]
    assert maintenance.verify(remote).ok  # the kept snapshot lost no chunk


def test_a_copy_that_fails_names_nothing_in_the_destination(nodes, tmp_path):
    remote = open_store(tmp_path / "remote")
    d = snap_on_a(nodes, tmp_path, 1, T0)
    victim = sorted(nodes["a"].get_manifest(d).chunk_digests())[0]
    algo, hx = victim.split(":")
    (tmp_path / "a" / "chunks" / algo / hx[:2] / hx).unlink()
    (entry,) = entries_to_copy(nodes["a"], Ref.parse("tiny"))
    with pytest.raises(IntegrityError, match=victim):
        copy_entry(nodes["a"], remote, entry)
    assert Catalog(remote).all_entries() == [] and remote.list_manifests() == []


def test_earlier_tags_layout_is_read_kept_by_gc_and_migrated(nodes, tmp_path):
    store = nodes["a"]
    d, _ = publish_snapshot(store, tmp_path, host(), 1, created=T0)
    store.backend.save("tags/tiny/latest", (d + "\n").encode())  # as the earlier warmctl wrote it
    cat = Catalog(store)
    assert cat.names() == ["tiny"] and cat.tags("tiny") == ["latest"]
    assert [e.manifest for e in cat.entries("tiny")] == [d]
    assert cat.referenced_manifests() == {d}
    assert maintenance.gc(store, keep=cat.referenced_manifests(), grace=0).manifests_removed == []
    assert cat.migrate() == 1 and cat.migrate() == 0
    assert not store.backend.exists("tags/tiny/latest")
    assert [e.manifest for e in Catalog(open_store(store.location)).entries("tiny")] == [d]


@pytest.mark.s3
def test_push_to_s3_and_pull_to_another_node(nodes, tmp_path, s3_url):  # noqa: F811
    d = snap_on_a(nodes, tmp_path, 1, T0)
    remote = open_store(s3_url)
    push(nodes["a"], remote, "tiny")
    rc = Catalog(open_store(s3_url))
    assert [e.manifest for e in rc.entries("tiny")] == [d]
    (pulled,) = transfer(rc.store, nodes["b"], entries_to_copy(rc.store, Ref.parse("tiny"), host()))
    assert pulled.report.chunks_copied == pulled.report.chunks_total
    assert Catalog(nodes["b"]).resolve("tiny", host(), nodes["b_trust"]).entry.manifest == d
