"""Store maintenance over a :class:`~warmctl.store.store.Store`: verify, gc and du.

Owns what reads the whole store at once: re-hashing every chunk of a set of manifests
(:func:`verify`), removing what no manifest (or no manifest the catalog names)
references under the exclusive lock (:func:`gc`), and space accounting per manifest
(:func:`du`). Each takes a :class:`~warmctl.store.store.Store` from outside, as restic's
``prune``/``check`` work on a repository: :mod:`warmctl.store.store` never imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from warmctl.base import faults
from warmctl.base.errors import IntegrityError
from warmctl.records.manifest import ChunkRef
from warmctl.store import chunks as ck
from warmctl.store import lock as lk
from warmctl.store.chunkio import ChunkCorrupt, ChunkMissing, Progress, load_verified, ordered_map, thread_buffers
from warmctl.store.layout import _digest_from_chunk_key, attachment_prefixes, chunk_key, manifest_key
from warmctl.store.reports import ChunkProblem, DuReport, DuRow, GcReport, VerifyReport

if TYPE_CHECKING:
    from warmctl.store.store import Store


def chunk_sizes(store: Store) -> dict[str, int]:
    """digest -> stored size of every chunk object."""
    out = {}
    for o in store.backend.list("chunks/"):
        d = _digest_from_chunk_key(o.key)
        if d:
            out[d] = o.size
    return out


def verify(store: Store, digests: Iterable[str] | None = None, progress: Progress | None = None) -> VerifyReport:
    """Re-hash every chunk of the given manifests (default: all) and report what is
    missing or corrupt, naming each chunk, its location and the manifests that use it.
    ``progress(n)``: uncompressed bytes checked. Never raises for damaged data."""
    rep = VerifyReport()
    users: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for d in digests if digests is not None else store.list_manifests():
        try:
            m = store.get_manifest(d)
        except IntegrityError as e:
            rep.bad_manifests.append(str(e))
            continue
        label = f"{d[:19]} ({m.name})"
        rep.manifests_checked += 1
        for f in m.files:
            for c in f.chunks:
                if ck.is_zero_chunk(c.digest, c.size):
                    continue
                sizes[c.digest] = c.size
                users.setdefault(c.digest, [])
                if label not in users[c.digest]:
                    users[c.digest].append(label)

    def work(d: str) -> tuple[str, str | None, str | None]:
        try:
            load_verified(store.backend, ChunkRef(digest=d, size=sizes[d]), thread_buffers())
        except ChunkMissing:
            return d, "missing", "not found"
        except ChunkCorrupt as e:
            return d, "corrupt", e.reason
        return d, None, None

    for d, kind, msg in ordered_map(work, list(sizes), store.workers):
        rep.chunks_checked += 1
        rep.bytes_checked += sizes[d]
        if progress:
            progress(sizes[d])
        if kind:
            p = ChunkProblem(d, store.backend.location(chunk_key(d)), msg, users[d])
            (rep.missing if kind == "missing" else rep.corrupt).append(p)
    return rep


def gc(store: Store, keep: Iterable[str] | None = None, grace: float = 300.0, dry_run: bool = False) -> GcReport:
    """Remove manifests that are not in ``keep`` (with their signatures), then chunks no kept
    manifest references. ``keep``: the digests the naming layer declares live
    (:meth:`warmctl.naming.catalog.Catalog.referenced_manifests`); ``None`` keeps every manifest and
    removes only unreferenced chunks.

    Takes the exclusive lock (StoreLocked if a push/pull holds the store); the store's own
    writer lock is released first, so do not call it between add_file and put_manifest. Objects younger
    than ``grace`` seconds are kept in any case. Stale locks and, on local disk, ingest
    temp files older than max(grace, 1 h) are removed. Raises IntegrityError if a
    manifest cannot be read (gc cannot know what it references).
    """
    store.check_config(writing=False)
    store.close()  # our own writer lock would block the exclusive one
    rep = GcReport(dry_run=dry_run)
    lock = lk.acquire(store.backend, "exclusive", "gc", store.lock_stale_after, 0)
    try:
        now = time.time()
        _, stale = lk.other_locks(store.backend, lock.key, store.lock_stale_after)
        for k in stale:
            if not dry_run:
                store.backend.remove(k)
            rep.locks_removed += 1
        roots = None if keep is None else set(keep)
        mtimes = {"sha256:" + o.key.rsplit("/", 1)[1]: o.mtime for o in store.backend.list("manifests/sha256/")}
        live: set[str] = set()
        for d, mt in mtimes.items():
            if roots is not None and d not in roots and now - mt >= grace:
                if not dry_run:  # signatures first: a crash between leaves an unsigned, unnamed manifest
                    for prefix in attachment_prefixes(d):
                        for a in store.backend.list(prefix):
                            store.backend.remove(a.key)
                    store.backend.remove(manifest_key(d))
                    faults.point("gc_manifests")  # a test's kill -9 after a manifest went
                rep.manifests_removed.append(d)
                continue
            live |= store.get_manifest(d).chunk_digests()
            rep.manifests_kept += 1
        for o in store.backend.list("signatures/"):  # of a manifest gone (an older gc killed midway)
            parts = o.key.split("/")
            if len(parts) >= 4 and f"{parts[1]}:{parts[2]}" not in mtimes and now - o.mtime >= grace:
                if not dry_run:
                    store.backend.remove(o.key)
                rep.attachments_removed += 1
        for o in store.backend.list("chunks/"):
            d = _digest_from_chunk_key(o.key)
            if d is None or d in live:
                rep.chunks_kept += 1
                continue
            if now - o.mtime < grace:
                rep.chunks_too_new += 1
                continue
            if not dry_run:
                store.remove_chunk(d)
                faults.point("gc_chunks")  # a test's kill -9 after a chunk went
            rep.chunks_removed += 1
            rep.bytes_removed += o.size
        for o in store.backend.list_tmp():
            if now - o.mtime >= max(grace, 3600.0):
                if not dry_run:
                    store.backend.remove(o.key)
                rep.tmp_removed += 1
    finally:
        lock.release()
    return rep


def du(store: Store, names: dict[str, list[str]] | None = None) -> DuReport:
    """Space per manifest: logical, stored, unique and shared bytes (see :class:`DuRow`).
    ``names``: manifest digest -> ``name:tag`` labels from the catalog (:meth:`Catalog.names_of`)."""
    sizes = chunk_sizes(store)
    tags = names or {}
    manifests = {d: store.get_manifest(d) for d in store.list_manifests()}
    refcount: dict[str, int] = {}
    for m in manifests.values():
        for digest in m.chunk_digests():
            refcount[digest] = refcount.get(digest, 0) + 1
    rows = []
    for d, m in manifests.items():
        logical = stored = unique = zero = missing = 0
        seen: set[str] = set()
        for f in m.files:
            if f.hardlink_to is None:
                logical += f.size
            for c in f.chunks:
                if ck.is_zero_chunk(c.digest, c.size):
                    zero += c.size
                    continue
                if c.digest in seen:
                    continue
                seen.add(c.digest)
                if c.digest not in sizes:
                    missing += 1
                    continue
                stored += sizes[c.digest]
                if refcount[c.digest] == 1:
                    unique += sizes[c.digest]
        rows.append(DuRow(d, sorted(tags.get(d, [])), m.name, logical, stored, unique, stored - unique, zero, missing))
    rows.sort(key=lambda r: (r.name, r.digest))
    unref = sum(s for c, s in sizes.items() if c not in refcount)
    return DuReport(rows, sum(sizes.values()), unref, len(sizes))
