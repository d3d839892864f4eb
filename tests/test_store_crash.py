"""Crash safety of the local store: a real ``warmctl`` writer (push, gc) is
killed with SIGKILL at every write point of the local backend in turn
(``WARMCTL_FAULT_KILL_AT_WRITE=N``, :mod:`warmctl.store.local`), and after each kill the store
passes ``verify``, every catalog entry and signature names a stored manifest, and the next run
of the command succeeds. A power loss is not simulated (the page cache survives SIGKILL); that
each rename, removal and new directory is followed by an fsync of its directory is checked apart,
by recording the fsync calls."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
import signal
import stat
import subprocess
import time
import sys
from pathlib import Path

import pytest
from test_store_fixtures import snapshot, write_payload

from warmctl.naming.catalog import Catalog
from warmctl.naming.fleet import entries_to_copy, transfer
from warmctl.naming.catalog import Ref
from warmctl.store import open_store
from warmctl.store.chunks import is_zero_chunk
from warmctl.store.local import FAULT_ENV, LocalBackend
from warmctl.store import maintenance
from warmctl.naming.trust import generate_keypair, sign_manifest

CH = 64 * 1024
REPO = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")}
    env.update({"WARMCTL_CONFIG": str(cfg), "WARMCTL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}, **extra)
    return env


def _warmctl(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmctl", *args], env=env, capture_output=True, text=True, timeout=120)


def _source(tmp_path: Path) -> Path:
    """A store holding ``tiny:latest`` (two files, 7 stored chunks and a zero run) and
    ``old:latest``, both signed."""
    root = tmp_path / "src"
    kp = generate_keypair(tmp_path / "keys")
    with open_store(root, chunk_size=CH) as s:
        a = write_payload(tmp_path / "a.img", [("random", 4 * CH), ("zero", 2 * CH), ("text", CH)], seed=1)
        b = write_payload(tmp_path / "b.img", [("text", 2 * CH)], seed=2)
        for name, files in (("tiny", {"pages-1.img": a, "core.img": b}), ("old", {"pages-1.img": b})):
            d = snapshot(s, name, files)
            sign_manifest(s, d, kp.private)
    return root


def assert_consistent(root: Path) -> None:
    """What ``warmctl verify`` checks (every manifest's chunks present and intact), plus: every
    catalog entry and every signature names a manifest that is stored and verifies."""
    with open_store(root) as s:
        rep = maintenance.verify(s)
        assert rep.ok, str(rep)
        stored = set(s.list_manifests())
        for e in Catalog(s).all_entries():
            assert e.manifest in stored, f"catalog entry {e.name}:{e.tag} names missing manifest {e.manifest}"
        for o in s.backend.list("signatures/"):
            d = "sha256:" + o.key.split("/")[2]
            assert d in stored, f"signature {o.key} of a missing manifest"


def _kill_at_every_write(args: list[str], fresh: callable, tmp_path: Path, after: callable) -> int:
    """Run ``warmctl args`` killed at write point 1, 2, ... (``fresh()`` sets the store up before
    each run; ``after(n)`` checks it) until a run completes; returns the number of kills."""
    n = 0
    while True:
        n += 1
        assert n < 200, "never completed"
        fresh()
        r = _warmctl(args, _env(tmp_path, **{FAULT_ENV: str(n)}))
        if r.returncode == 0:
            return n - 1
        assert r.returncode == -signal.SIGKILL, f"kill at write {n}: exit {r.returncode}\n{r.stderr}"
        after(n)


def test_push_killed_at_every_write_leaves_a_verifiable_store(tmp_path):
    """A push into a directory store (``copy_manifest`` into a local store: the chunks go
    through the pull's bounded :class:`~warmctl.store.local.SaveBatch`) killed at each write
    point: the store verifies, and every 4th time the next push copies exactly the chunks not
    committed before the kill, then names the snapshot."""
    src = _source(tmp_path)
    dst = tmp_path / "dst"

    def fresh():
        subprocess.run(["rm", "-rf", str(dst)], check=True)

    with open_store(src) as s:
        e = Catalog(s).entries("tiny")[0]
        need = {c.digest for f in s.get_manifest(e.manifest).files for c in f.chunks if not is_zero_chunk(c.digest, c.size)}

    def after(n):
        assert_consistent(dst)
        if n % 4 == 0:  # the next push completes (and only then names the snapshot) ...
            have = len([p for p in (dst / "chunks").rglob("*") if p.is_file()]) if (dst / "chunks").is_dir() else 0
            with open_store(src) as s, open_store(dst) as d:
                [c] = transfer(s, d, entries_to_copy(s, Ref(name="tiny")))
            assert c.report.chunks_copied == len(need) - have, (n, have)  # ... copying only the chunks not committed
            assert_consistent(dst)
            with open_store(dst) as d:
                assert Catalog(d).entries("tiny")

    kills = _kill_at_every_write(["push", "tiny", "--to", str(dst), "--store", str(src)], fresh, tmp_path, after)
    print(f"push: killed at each of {kills} write points, store verified after each")
    # lock + config + 6 chunks + manifest + signature + entry + profile, two points each (and more)
    assert kills >= 24, kills
    assert_consistent(dst)
    r = _warmctl(["verify", "--store", str(dst)], _env(tmp_path))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_gc_killed_at_every_write_leaves_a_verifiable_store(tmp_path):
    src = _source(tmp_path)
    work = tmp_path / "work"

    def fresh():
        subprocess.run(["rm", "-rf", str(work)], check=True)
        subprocess.run(["cp", "-a", str(src), str(work)], check=True)
        with open_store(work) as s:
            Catalog(s).remove_tag("old", "latest")

    def after(n):
        assert_consistent(work)
        if n % 3 == 0:
            with open_store(work) as s:
                maintenance.gc(s, keep=Catalog(s).referenced_manifests(), grace=0)
            assert_consistent(work)

    kills = _kill_at_every_write(["gc", "--grace", "0", "--store", str(work)], fresh, tmp_path, after)
    print(f"gc: killed at each of {kills} write points, store verified after each")
    assert kills >= 4, kills  # the old manifest, its signature, its unshared chunk(s), lock release
    with open_store(work) as s:
        assert [e.name for e in Catalog(s).all_entries()] == ["tiny"]
        assert len(s.list_manifests()) == 1


def _chunk_objects(root: Path) -> set[str]:
    return {p.name for p in (root / "chunks").rglob("*") if p.is_file()}


def test_gc_killed_at_its_phases_dies_there_and_the_next_gc_finishes(tmp_path):
    """``WARMCTL_TEST_KILL_AT_PHASE`` (:mod:`warmctl.base.faults`) at ``gc_manifests`` and
    ``gc_chunks`` on a store where ``tiny``'s name is gone (its manifest and its unshared chunks
    are garbage): each run is killed there (never exit 0: the point is reached), having removed
    exactly one thing of that kind; the store verifies after each; the next gc removes the rest
    and keeps what ``old`` references."""
    work = tmp_path / "work"
    subprocess.run(["cp", "-a", str(_source(tmp_path)), str(work)], check=True)
    with open_store(work) as s:
        cat = Catalog(s)
        old = cat.entries("old")[0].manifest
        keep = {c.digest.split(":")[1] for f in s.get_manifest(old).files for c in f.chunks}
        cat.remove_tag("tiny", "latest")
    chunks0 = _chunk_objects(work)
    assert chunks0 - keep, "tiny must have chunks of its own for gc_chunks to be reached"
    env = _env(tmp_path, WARMCTL_TEST_KILL_AT_PHASE="gc_manifests")
    r = _warmctl(["gc", "--grace", "0", "--store", str(work)], env)
    assert r.returncode == -signal.SIGKILL, f"gc was not killed at gc_manifests: exit {r.returncode}\n{r.stderr}"
    with open_store(work) as s:
        assert s.list_manifests() == [old]  # tiny's manifest went, then the kill
    assert _chunk_objects(work) == chunks0  # no chunk yet: manifests go first
    assert_consistent(work)
    r = _warmctl(["gc", "--grace", "0", "--store", str(work)], _env(tmp_path, WARMCTL_TEST_KILL_AT_PHASE="gc_chunks"))
    assert r.returncode == -signal.SIGKILL, f"gc was not killed at gc_chunks: exit {r.returncode}\n{r.stderr}"
    gone = chunks0 - _chunk_objects(work)
    assert len(gone) == 1 and not gone & keep, gone  # one chunk of tiny's own, then the kill
    assert_consistent(work)
    r = _warmctl(["gc", "--grace", "0", "--store", str(work)], _env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert _chunk_objects(work) == chunks0 & keep
    assert_consistent(work)


def test_every_rename_removal_and_new_directory_is_made_durable(tmp_path, monkeypatch):
    """fsync of the directory after each rename into it, each removal from it and each directory
    created in it (recorded by inode, so the check names the directory)."""
    synced: list[tuple[int, bool]] = []
    real = os.fsync

    def record(fd):
        st = os.fstat(fd)
        synced.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    b = LocalBackend(tmp_path / "store")
    b.save("chunks/blake3/ab/abcd", b"x" * 10)
    ino = lambda p: (p.stat().st_ino, True)  # noqa: E731
    root = tmp_path / "store"
    file_synced = [s for s in synced if not s[1]]
    assert len(file_synced) == 1  # the object's bytes, before the rename
    for d in (tmp_path, root, root / "chunks", root / "chunks/blake3", root / "chunks/blake3/ab"):  # parents of new dirs
        assert ino(d) in synced, f"{d} not fsync'ed"
    assert synced.index(ino(root / "chunks/blake3/ab")) > synced.index(file_synced[0])  # after the rename
    synced.clear()
    b.save("chunks/blake3/ab/abce", b"y")
    assert synced[-1] == ino(root / "chunks/blake3/ab") and ino(root) not in synced  # existing dirs: just the one
    synced.clear()
    b.remove("chunks/blake3/ab/abcd")
    assert synced == [ino(root / "chunks/blake3/ab")]
    synced.clear()
    b.remove("chunks/blake3/ab/gone")  # absent: nothing to sync
    assert synced == []


@pytest.mark.parametrize("n", [1, 2])
def test_fault_hook_kills_at_the_given_write(tmp_path, n):
    """The hook itself: a save killed before its rename leaves no object, after it leaves it."""
    code = ("from warmctl.store.local import LocalBackend; b = LocalBackend(%r); b.save('k', b'v'); print('done')"
            % str(tmp_path / "s"))
    r = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path, **{FAULT_ENV: str(n)}), capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL and "done" not in r.stdout
    assert (tmp_path / "s" / "k").exists() == (n == 2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


#: The paused writer's lock lifetime (seconds): it refreshes every third of it while it runs.
LIFETIME_S = 1.5


def test_writer_paused_past_its_lock_lifetime_fails_cleanly_or_commits_whole_data(tmp_path):
    """A writer (a real ``warmctl push``) is paused by
    SIGSTOP past its lock's lifetime (1.5 s here, ``WARMCTL_LOCK_STALE_S``) at one write point after
    another, ``warmctl gc --grace 0`` runs meanwhile (and judges the lock stale), the writer is
    resumed (SIGCONT): either it fails cleanly (LockLost, its own exit code, no traceback) or every
    chunk of what it named exists; ``verify`` passes either way. The pauses run four at a time,
    each into a store of its own (each waits out the lifetime mostly asleep)."""
    from warmctl.store import LockLost
    from warmctl.store.local import FAULT_STOP_ENV

    src = _source(tmp_path)

    def pause_at(n: int) -> str:
        """"stopped", "committed", or "never" (past the last write point: it never stopped)."""
        dst = tmp_path / f"dst-{n}"
        env = _env(tmp_path, **{FAULT_STOP_ENV: str(n), "WARMCTL_LOCK_STALE_S": str(LIFETIME_S)})
        p = subprocess.Popen([sys.executable, "-m", "warmctl", "push", "tiny", "--to", str(dst), "--store", str(src)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while p.poll() is None and _state(p.pid) != "T":
                time.sleep(0.02)
            if p.poll() is not None:
                out, err = p.communicate()
                assert p.returncode == 0, err
                return "never"
            time.sleep(LIFETIME_S + 0.3)  # past the lock's lifetime (its last refresh was before the stop)
            g = _warmctl(["gc", "--grace", "0", "--store", str(dst)], _env(tmp_path))
            assert g.returncode == 0, f"stop at {n}: gc exited {g.returncode}: {g.stderr}"
            p.send_signal(signal.SIGCONT)
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert_consistent(dst)
        shutil.rmtree(dst)
        if p.returncode == 0:
            return "committed"
        assert p.returncode == LockLost.exit_code, f"stop at {n}: exit {p.returncode}: {err}"
        assert "lost the shared lock" in err and "run it again" in err and "Traceback" not in err, err
        return "stopped"

    outcomes: dict[int, str] = {}
    points = iter(range(1, 200, 3))
    with ThreadPoolExecutor(4) as pool:
        while True:
            batch = [n for _, n in zip(range(4), points)]
            got = dict(zip(batch, pool.map(pause_at, batch)))
            outcomes.update({n: v for n, v in got.items() if v != "never"})
            if not batch or "never" in got.values():
                break
    print(f"paused push: {sum(v == 'stopped' for v in outcomes.values())} stopped (LockLost), "
          f"{sum(v == 'committed' for v in outcomes.values())} committed whole, of {len(outcomes)} pauses")
    assert "stopped" in outcomes.values(), outcomes
    assert len(outcomes) >= 6, outcomes


def test_a_save_batch_syncs_every_object_before_any_rename_and_each_directory_once(tmp_path, monkeypatch):
    """:class:`~warmctl.store.local.SaveBatch` (a fresh node's read cache): nothing visible
    before commit; at commit every object's bytes are fsync'ed before the first rename, each
    new directory's parent before it is renamed into, and each directory renamed into once."""
    synced: list[tuple[int, bool]] = []
    real = os.fsync

    def record(fd):
        st = os.fstat(fd)
        synced.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        return real(fd)

    b = LocalBackend(tmp_path / "store")
    b.save("config", b"{}")
    batch = b.batch()
    keys = [f"chunks/blake3/{i:02x}/{i:02x}{'0' * 62}" for i in range(6)] * 2  # each twice: written once
    monkeypatch.setattr(os, "fsync", record)
    for i, k in enumerate(keys):
        batch.save(k, bytes([i % 6]) * 100)
    root = tmp_path / "store"
    assert not (root / "chunks").exists() and len(batch) == 6 and synced == []
    renamed = []
    real_replace = os.replace

    def rec_replace(src, dst, **kw):
        renamed.append(len(synced))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", rec_replace)
    assert batch.commit() == 6
    files = [i for i, s in enumerate(synced) if not s[1]]
    assert len(files) == 6 and max(files) < min(renamed)  # every object durable before any rename
    ino = lambda p: (p.stat().st_ino, True)  # noqa: E731
    for d in (root, root / "chunks", root / "chunks/blake3"):  # parents of the new directories, before the renames
        assert synced.index(ino(d)) < min(renamed), d
    for i in range(6):
        d = root / f"chunks/blake3/{i:02x}"
        assert synced.count(ino(d)) == 1 and synced.index(ino(d)) >= max(renamed), d
        assert (d / f"{i:02x}{'0' * 62}").read_bytes() == bytes([i]) * 100
    assert list((root / "tmp").iterdir()) == []


def test_a_cache_fill_killed_at_every_write_leaves_only_whole_chunks(tmp_path):
    """A node filling its read cache from a remote (``read_file`` with ``cache``, what ``up``
    does) is SIGKILLed at each write point of its batched cache in turn; after each kill every
    chunk object visible in the cache is whole (verifies), and the next read completes it."""
    remote = tmp_path / "remote"
    payload = write_payload(tmp_path / "p.img", [("random", 6 * CH), ("zero", CH), ("text", 3 * CH)])
    with open_store(remote, chunk_size=CH) as s:
        refs = s.add_file(payload)
    code = ("import sys; from warmctl.store import open_store; from warmctl.records.manifest import ChunkRef; import json;"
            "refs = [ChunkRef(**r) for r in json.loads(sys.argv[3])];"
            "open_store(sys.argv[1]).read_file(refs, sys.argv[2] + '/out.img', cache=open_store(sys.argv[2] + '/cache'));"
            "print('done')")
    arg = __import__("json").dumps([r.model_dump() for r in refs])

    def fill_killed_at(n: int) -> subprocess.CompletedProcess:
        node = tmp_path / f"node-{n}"
        node.mkdir()
        return subprocess.run([sys.executable, "-c", code, str(remote), str(node), arg],
                              env=_env(tmp_path, **{FAULT_ENV: str(n)}), capture_output=True, text=True)

    def runs():
        """(n, the fill killed at write point n), two at a time, in order of n"""
        with ThreadPoolExecutor(2) as pool:
            for first in range(1, 100, 2):
                yield from zip((first, first + 1), pool.map(fill_killed_at, (first, first + 1)))

    kills = 0
    for n, r in runs():
        node = tmp_path / f"node-{n}"
        if r.returncode == 0:
            assert "done" in r.stdout
            break
        assert r.returncode == -signal.SIGKILL, r.stderr
        kills += 1
        cache = open_store(node / "cache")
        for ref in refs:  # whatever is visible is whole
            if cache.has_chunk(ref.digest, ref.size):
                assert cache.load_chunk(ref) == open_store(remote).load_chunk(ref)
        if (node / "out.img").exists():  # renamed once whole (before the cache's commit)
            assert (node / "out.img").read_bytes() == payload.read_bytes()
        open_store(remote).read_file(refs, node / "out.img", cache=cache)  # the next read completes it
        assert (node / "out.img").read_bytes() == payload.read_bytes()
        assert all(cache.has_chunk(x.digest, x.size) for x in refs)
    print(f"cache fill: killed at each of {kills} write points")
    assert kills >= 9 * 2, kills  # a temporary file and a rename for each of the 9 non-zero chunks
