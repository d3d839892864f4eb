"""Disk at scale: the kept images' byte budget with least-recently-used
eviction that never removes an image a running engine uses, images larger than the budget
restored from and not kept, free space checked before ``up`` writes anything, and ``du``'s
per-snapshot cost on this node. Real local stores, real files, a real size-limited tmpfs
(:func:`tests.conftest.small_fs`), real processes as the "running engines"; no engine."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.test_store_fixtures import MiB, make_manifest, write_payload
from warmctl import diskspace
from warmctl.naming.catalog import Catalog
from warmctl.checkpoint.imagecache import ImageCache, image_bytes, live_digests
from warmctl.records.config import ConfigError, load_settings
from warmctl.engine.run import EngineRun
from warmctl.base.errors import HostError
from warmctl.records.manifest import FileEntry
from warmctl.records.progress import Reporter
from warmctl.records.state import EngineState
from warmctl.store import open_store


def _snaps(store, src, n: int, size: int = MiB) -> list[tuple]:
    """``n`` snapshots of one random image file of ``size`` bytes each: [(manifest, digest)]."""
    out = []
    for i in range(n):
        m = make_manifest(store, f"s{i}", {"pages-1.img": write_payload(src / f"{i}.img", [("random", size)], seed=i)})
        out.append((m, store.put_manifest(m)))
    return out


def test_lru_by_recorded_use_not_mtime(tmp_path):
    """Budget for two entries: A, B written, A reused, C written: B (least recently used) goes,
    although B's marker was touched into the future and A's into the past (mtime does not
    decide: the use order recorded on each reuse does)."""
    store = open_store(tmp_path / "store")
    (a, da), (b, db), (c, dc) = _snaps(store, tmp_path / "src", 3)
    cache = ImageCache(tmp_path / "cache", budget=2 * image_bytes(a) + 200_000)
    cache.get(store, a, da)
    img_b = cache.get(store, b, db)
    assert not cache.get(store, a, da).written  # reuse: A is now the most recently used
    os.utime(img_b.path / "verified.json", (time.time() + 3600,) * 2)
    os.utime(cache.root / f"sha256-{da[7:]}" / "verified.json", (1.0, 1.0))
    img_c = cache.get(store, c, dc)
    assert [e.digest for e in img_c.evicted] == [db]
    assert [e.digest for e in cache.entries()] == [dc, da]  # most recent first
    assert cache.du() <= cache.budget


def test_entry_in_use_by_a_running_engine_is_never_evicted(tmp_path):
    """A state file in the home's run directory names A's digest and a live process as its
    root (what a restored engine's record looks like): A stays, although it is the oldest and
    the budget is over; the next oldest goes instead. Once that process is gone, A may go."""
    store = open_store(tmp_path / "store")
    (a, da), (b, db), (c, dc) = _snaps(store, tmp_path / "src", 3)
    run_dir = tmp_path / "run"
    cache = ImageCache(tmp_path / "cache", budget=2 * image_bytes(a) + 200_000, in_use=lambda: live_digests(run_dir))
    cache.get(store, a, da)
    cache.get(store, b, db)
    engine = subprocess.Popen(["sleep", "60"])
    try:
        run = EngineRun(run_dir, "e", 1).prepare()
        run.set_root(engine.pid)
        run.record(EngineState(name="e", phase="serving", source="restore", manifest_digest=da, internal_port=1,
                               public_host="127.0.0.1", public_port=2, served_model_name="e", log_path=str(run.log_path)))
        assert live_digests(run_dir) == {da}
        assert [e.digest for e in cache.entries() if e.in_use] == [da]
        img = cache.get(store, c, dc)
        assert [e.digest for e in img.evicted] == [db]
        assert sorted(e.digest for e in cache.entries()) == sorted([da, dc])
        assert cache.prune(keep_digests=set()) and [e.digest for e in cache.entries()] == [da]  # gc spares it too
    finally:
        engine.kill()
        engine.wait()
    assert live_digests(run_dir) == set()
    assert [e.digest for e in cache.prune(keep_digests=set())] == [da]


def test_image_larger_than_the_budget_is_restored_from_not_kept(tmp_path):
    store = open_store(tmp_path / "store")
    (small, ds), (big, db) = _snaps(store, tmp_path / "src", 1) + _snaps(store, tmp_path / "src2", 1, size=3 * MiB)[0:1]
    cache = ImageCache(tmp_path / "cache", budget=2 * MiB)
    cache.get(store, small, ds)
    img = cache.get(store, big, db, scratch=tmp_path / "run" / "unkept-image")
    assert not img.kept and img.written and img.path == tmp_path / "run" / "unkept-image"
    assert "3.0 MiB" in img.not_kept and "2.0 MiB" in img.not_kept, img.not_kept  # both numbers named
    assert (img.images / "pages-1.img").stat().st_size == 3 * MiB
    assert [e.digest for e in cache.entries()] == [ds] and not img.evicted  # nothing evicted for it
    cache.release(img)
    assert not img.path.exists()


def test_disk_full_evicts_unused_images_beyond_the_budget_or_refuses_naming_numbers(tmp_path, small_fs):
    """On a 6 MiB filesystem with no budget limit: a second 3 MiB image does not fit beside the
    first, so the first (unused) goes; when it is in use instead, nothing is removed or written
    and the error names the path, the bytes needed and free, and the image kept in use."""
    store = open_store(tmp_path / "store")
    (a, da), (b, db) = _snaps(store, tmp_path / "src", 2, size=3 * MiB)
    busy: set[str] = set()
    cache = ImageCache(small_fs / "images", budget=None, in_use=lambda: set(busy))
    cache.get(store, a, da)
    img = cache.get(store, b, db)
    assert [e.digest for e in img.evicted] == [da] and [e.digest for e in cache.entries()] == [db]

    busy.add(db)
    with pytest.raises(HostError) as e:
        cache.get(store, a, da, command="up s0")
    msg = str(e.value)
    assert msg.startswith("not enough disk space for up s0, nothing written"), msg
    assert f"needed {image_bytes(a):,} bytes" in msg and str(small_fs) in msg and "bytes free" in msg, msg
    assert "in use by running engines" in msg, msg
    assert [e.digest for e in cache.entries()] == [db]  # nothing removed
    assert not list(cache.root.glob(".partial-*"))  # nothing written


def test_other_writes_count_with_the_image(tmp_path, small_fs):
    """``also`` (what ``up`` writes besides: fetched chunks, /dev/shm) is checked with the image on
    the same filesystem: a 1 MiB image fits 6 MiB alone, not beside 5 MiB of chunks to fetch."""
    store = open_store(tmp_path / "store")
    (a, da), = _snaps(store, tmp_path / "src", 1)
    cache = ImageCache(small_fs / "images")
    with pytest.raises(HostError, match="5.0 MiB under"):
        cache.get(store, a, da, also=[diskspace.Need(small_fs / "store", 5 * MiB, "chunks to fetch")])
    assert cache.entries() == []
    assert cache.get(store, a, da).written


def test_up_checks_free_space_for_chunks_from_a_remote_before_writing(tmp_path, small_fs):
    """``up``'s materialize from a remote store: the chunks the local store lacks (12 MiB) are
    counted against the local store's filesystem (6 MiB) before any byte is written; the
    message names that store and the numbers; the local store and the image cache stay empty."""
    from warmctl.pipelines.materialize import materialize as _materialize

    remote = open_store(tmp_path / "remote")
    m = make_manifest(remote, "tiny", {"pages-1.img": write_payload(tmp_path / "p.img", [("random", 12 * MiB)])})
    d = remote.put_manifest(m)
    local = open_store(small_fs / "store")
    run = EngineRun(tmp_path / "run", "tiny", 1)
    cache = ImageCache(tmp_path / "images")
    with pytest.raises(HostError) as e:
        _materialize(remote, m, d, run, cache, Reporter(), cache=local)
    msg = str(e.value)
    assert "not enough disk space for up tiny" in msg and "3 chunk(s) to fetch into the local store" in msg, msg
    assert str(small_fs / "store") in msg and "needed 12,582,912 bytes" in msg, msg
    assert cache.entries() == [] and not [p for p in (small_fs / "store").rglob("*") if p.is_file() and "chunks" in p.parts]


def test_budget_setting_bytes_fraction_percent_and_errors(tmp_path, small_fs, monkeypatch):
    cfg = tmp_path / "c.toml"
    monkeypatch.delenv("WARMCTL_IMAGE_CACHE_BYTES", raising=False)
    cfg.write_text(f'home = "{small_fs}"\n')
    s = load_settings(cfg)
    assert s.image_cache_bytes == "50%" and s.image_cache_budget() == 3 * MiB  # half of the 6 MiB filesystem
    for value, want in (('"25%"', 6 * MiB // 4), ("0.5", 3 * MiB), ("1000", 1000), ('"2 MiB"', 2 * MiB), ("0", 0)):
        cfg.write_text(f'home = "{small_fs}"\nimage_cache_bytes = {value}\n')
        assert load_settings(cfg).image_cache_budget() == want, value
    monkeypatch.setenv("WARMCTL_IMAGE_CACHE_BYTES", "0.25")
    assert load_settings(cfg).image_cache_budget() == 6 * MiB // 4
    monkeypatch.setenv("WARMCTL_IMAGE_CACHE_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"\$WARMCTL_IMAGE_CACHE_BYTES: image_cache_bytes"):
        load_settings(cfg)
    monkeypatch.delenv("WARMCTL_IMAGE_CACHE_BYTES")
    cfg.write_text(f'home = "{small_fs}"\nimage_cache_bytes = 1.5\n')
    with pytest.raises(ConfigError, match="image_cache_bytes"):
        load_settings(cfg)


def test_du_json_costs_per_snapshot_on_this_node(tmp_path, monkeypatch):
    """Two snapshots sharing one chunk, one with a kept image: ``on node`` = unique + image, the
    shared chunk counted once in the store's shared total, the budget and filesystems shown."""
    import typer
    from typer.testing import CliRunner

    from warmctl.cli import store as store_cli

    home = tmp_path / "home"
    monkeypatch.setenv("WARMCTL_HOME", str(home))
    monkeypatch.delenv("WARMCTL_STORE", raising=False)
    monkeypatch.setenv("WARMCTL_CONFIG", str(tmp_path / "c.toml"))
    (tmp_path / "c.toml").write_text('image_cache_bytes = "1 GiB"\n')
    store = open_store(home / "store")
    src = tmp_path / "src"
    shared = write_payload(src / "shared.img", [("random", 4 * MiB)], seed=7)
    m1 = make_manifest(store, "a", {"pages-1.img": write_payload(src / "a.img", [("random", MiB)], seed=1),
                                    "pages-2.img": shared})
    m2 = make_manifest(store, "b", {"pages-1.img": write_payload(src / "b.img", [("random", 2 * MiB)], seed=2),
                                    "pages-2.img": shared})
    d1, d2 = store.put_manifest(m1), store.put_manifest(m2)
    Catalog(store).publish(d1, m1)
    Catalog(store).publish(d2, m2)
    ImageCache(home / "cache" / "images").get(store, m1, d1)
    store.close()
    app = typer.Typer()
    store_cli.register(app)
    res = CliRunner().invoke(app, ["du", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    rows = {r["digest"]: r for r in doc["rows"]}
    a, b = rows[d1], rows[d2]
    assert a["image"] >= 5 * MiB and b["image"] == 0 and not a["image_in_use"]
    assert a["node"] == a["unique"] + a["image"] and b["node"] == b["unique"]
    assert a["shared"] == b["shared"] == doc["shared"] > 0  # the one shared chunk, counted once in the total
    assert doc["total_stored"] == a["unique"] + b["unique"] + doc["shared"] + doc["unreferenced"]
    assert doc["image_cache"]["budget"] == 2**30 and doc["image_cache"]["setting"] == "1 GiB"
    assert doc["image_cache"]["bytes"] == a["image"] and [i["digest"] for i in doc["images"]] == [d1]
    assert doc["filesystems"] and all(f["free"] <= f["size"] for f in doc["filesystems"])
    text = CliRunner().invoke(app, ["du"])
    assert text.exit_code == 0 and "kept images: 1" in text.output and "1.0 GiB (image_cache_bytes = 1 GiB)" in text.output, text.output


def test_weights_and_shm_count_as_image_bytes_holes_do_not(tmp_path):
    store = open_store(tmp_path / "store")
    src = tmp_path / "src"
    m = make_manifest(store, "t", {"pages-1.img": write_payload(src / "p.img", [("random", 4 * MiB), ("zero", 8 * MiB)])})
    w = write_payload(src / "w", [("random", 300_000)], seed=2)
    m.files.append(FileEntry(path="ranks/rank0.safetensors", role="weights", size=w.stat().st_size, chunks=store.add_file(w)))
    assert image_bytes(m) == 4 * MiB + 300_000  # the two all-zero 4 MiB chunks are holes
    d = store.put_manifest(m)
    img = ImageCache(tmp_path / "cache").get(store, m, d)
    assert img.path.exists() and ImageCache(tmp_path / "cache").du() < 5 * MiB


def test_a_budget_lowered_to_zero_drops_unused_kept_images_at_the_next_up(tmp_path):
    store = open_store(tmp_path / "store")
    (a, da), (b, db) = _snaps(store, tmp_path / "src", 2)
    ImageCache(tmp_path / "cache").get(store, a, da)
    ImageCache(tmp_path / "cache").get(store, b, db)
    busy = {db}
    cache = ImageCache(tmp_path / "cache", budget=0, in_use=lambda: busy)
    img = cache.get(store, a, da, scratch=tmp_path / "run" / "unkept-image")
    assert img.written and not img.kept  # its kept entry was removed, not reused
    assert [e.digest for e in cache.entries()] == [db]  # the one in use stays


def test_warmctl_pull_refuses_with_exit_10_before_fetching(tmp_path, small_fs):
    """The CLI as an operator runs it: `warmctl pull` into a home on a 6 MiB filesystem of a
    signed 12 MiB snapshot exits 10 with one line naming the numbers; nothing is named locally."""
    import sys

    from tests.test_catalog import host
    from warmctl.naming.trust import generate_keypair

    remote = open_store(tmp_path / "remote")
    key = generate_keypair(tmp_path / "keys", "a")
    m = make_manifest(remote, "tiny", {"pages-1.img": write_payload(tmp_path / "p.img", [("random", 12 * MiB)])})
    m.host = host().model_dump(mode="json")
    Catalog(remote).publish(remote.put_manifest(m), m, tag="latest", signer=key.private)
    remote.close()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'home = "{small_fs / "home"}"\nkeys_dir = "{tmp_path / "keys"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
    env.update(WARMCTL_CONFIG=str(cfg), COLUMNS="400")
    r = subprocess.run([sys.executable, "-m", "warmctl", "pull", "tiny", "--all", "--from", str(tmp_path / "remote")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 10, (r.returncode, r.stdout, r.stderr)
    err = " ".join(r.stderr.split())
    assert "not enough disk space for pull tiny:latest" in err and "needed 12,58" in err and "bytes free" in err, err
    assert str(small_fs) in err
    assert Catalog(open_store(small_fs / "home" / "store")).entries("tiny") == []


def test_the_one_byte_formatter(monkeypatch):
    """Every byte count the CLI and the messages show goes through :func:`diskspace.human` (the
    CLI's through :func:`warmctl.cli.output.human`, which calls it: registering the commands
    imports no disk-space module)."""
    assert [diskspace.human(n) for n in (0, 512, 1023, 1024, 1536, 1000 * 1024, 5 * 2**30, 1536 * 2**40, -2048)] == [
        "0 B", "512 B", "1,023 B", "1.0 KiB", "1.5 KiB", "1,000.0 KiB", "5.0 GiB", "1,536.0 TiB", "-2.0 KiB"]
    import warmctl.cli.catalog as catalog
    import warmctl.cli.core as core
    import warmctl.cli.output as output
    import warmctl.cli.store as store

    assert core._human is store._human is catalog.human is output.human
    assert output.human(1536) == "1.5 KiB"
    monkeypatch.setattr(diskspace, "human", lambda n: f"<{n}>")
    assert output.human(1536) == "<1536>"
