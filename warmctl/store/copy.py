"""Copying a snapshot's content between stores by manifest digest: :func:`copy_manifest`.

Owns the copy order (chunks the destination lacks, each verified on the way, then the
manifest, then its attachments), which makes a killed copy restartable. Names travel one
layer up: :mod:`warmctl.naming.fleet` copies catalog entries, each after the content it names.

Into a local store (a backend with ``batch``: ``pull``, a push to a directory) the chunks go
through a :class:`~warmctl.store.local.SaveBatch` committed when :data:`COMMIT_CHUNKS` are
pending or :data:`COMMIT_SECONDS` have passed since the batch's first save, whichever comes
first, instead of two fsyncs per chunk: a killed copy loses at most about that much fetching
(temporary files, removed by gc), and its rerun fetches only the chunks not committed.
"""

from __future__ import annotations

import logging
import threading
import time

import pydantic_core

from warmctl.base.errors import HostError, IntegrityError
from warmctl.records.manifest import ChunkRef, Manifest
from warmctl.store import chunks as ck
from warmctl.store.backend import ObjectNotFound, load_limited
from warmctl.store.chunkio import Progress, kept, load_verified, ordered_map, thread_buffers
from warmctl.store.layout import MAX_SIGNATURE_BYTES, attachment_prefixes, chunk_key, manifest_key
from warmctl.store.reports import CopyReport
from warmctl.store.store import Store

log = logging.getLogger(__name__)

#: A copy into a local store commits its batch of chunks once this many are pending ...
COMMIT_CHUNKS = 256
#: ... or once this many seconds have passed since the batch's first save, whichever is first
#: (docs/benchmarks.md, "pull into a local store": why these values).
COMMIT_SECONDS = 1.0


class _Chunks:
    """Where :func:`copy_manifest` puts verified chunks into ``dst``: through a
    :class:`~warmctl.store.local.SaveBatch` when ``dst``'s backend offers one, committed when
    ``max_chunks`` are pending or the batch is ``max_seconds`` old, by the worker whose save
    found it due (the others keep fetching into the next batch meanwhile; one commit at a
    time); else :meth:`Store.put_chunk_blob`, each chunk durable on return. The writer lock is
    checked before each commit (:class:`~warmctl.store.lock.LockLost`: a gc may have removed
    what was committed before). Thread-safe."""

    def __init__(self, dst: Store, what: str, max_chunks: int, max_seconds: float):
        self.dst, self.what = dst, what
        self.max_chunks, self.max_seconds = max(1, max_chunks), max_seconds
        make = getattr(dst.backend, "batch", None)
        self.batch = make(workers=8) if make is not None else None
        self._mu = threading.Lock()
        self._committing = threading.Lock()
        self._digests: list[str] = []  # saved into the batch, not yet known committed

    def put(self, digest: str, blob: bytes | memoryview) -> None:
        """Store one verified chunk (durable at once, or at the next commit). Raises HostError
        (disk full), OSError, LockLost (from a commit this save made due)."""
        if self.batch is None:
            self.dst.put_chunk_blob(digest, blob)
            return
        self.batch.save(chunk_key(digest), blob)
        with self._mu:
            self._digests.append(digest)
        if (len(self.batch) >= self.max_chunks or self.batch.age() >= self.max_seconds) and self._committing.acquire(blocking=False):
            try:
                self._commit()
            finally:
                self._committing.release()

    def flush(self) -> None:
        """Commit what is pending (waiting for a commit under way first); every chunk put so far
        is durable and visible on return. Raises OSError, HostError, LockLost."""
        if self.batch is not None:
            with self._committing:
                self._commit()

    def discard(self) -> None:
        """Drop what is pending (its temporary files removed)."""
        if self.batch is not None:
            self.batch.abort()

    def _commit(self) -> None:
        # Taken before the batch's own swap: every digest taken here was saved before it, so
        # it is in what this commit renames or an earlier one did (a digest saved in between
        # is noted at the next commit).
        with self._mu:
            digests, self._digests = self._digests, []
        if len(self.batch):
            self.dst.check_lock(f"copy {self.what}")
            self.batch.commit()
        self.dst.note_chunks(digests)


def copy_manifest(src: Store, dst: Store, digest: str, progress: Progress | None = None, workers: int | None = None,
                  commit_chunks: int | None = None, commit_seconds: float | None = None) -> CopyReport:
    """Copy manifest ``digest`` and what it needs from ``src`` to ``dst``: chunks first (only
    those ``dst`` lacks, each verified on the way), then the manifest, then its attachments
    (signatures). Restartable: a killed copy, rerun, moves only what is still missing.

    Into a local ``dst`` chunks are committed in batches (see the module doc): when
    ``commit_chunks`` (default :data:`COMMIT_CHUNKS`) are pending or ``commit_seconds``
    (default :data:`COMMIT_SECONDS`) after the batch's first save; a killed copy keeps every
    batch committed before it. The last commit is made before the manifest is written; on an
    error the chunks verified so far are committed (if that fails too, they are dropped and the
    first error is raised).

    ``progress(n)``: snapshot file bytes accounted for (copied, already present, or zero).
    Raises IntegrityError (the manifest or a source chunk is missing or corrupt), HostError
    (disk full: bytes needed named), LockLost (``dst``'s writer lock was lost: nothing named).
    """
    t0 = time.monotonic()
    data = src.get_manifest_bytes(digest)
    try:
        manifest = Manifest.from_bytes(data)
    except ValueError as e:
        raise IntegrityError(f"manifest {digest} at {src.location}: {e}") from None
    rep = CopyReport(digest=digest, logical=manifest.total_size())
    refs: dict[str, int] = {}
    zero = 0
    for f in manifest.files:
        for c in f.chunks:
            if ck.is_zero_chunk(c.digest, c.size):
                zero += c.size
            elif c.digest not in refs:
                refs[c.digest] = c.size
    rep.chunks_total = len(refs)
    what = f"{manifest.name} ({digest[:19]})"
    dst.lock_for_write(f"copy {what} from {src.location}")
    if progress and zero:
        progress(zero)
    remaining = [sum(refs.values())]

    out = _Chunks(dst, what, COMMIT_CHUNKS if commit_chunks is None else commit_chunks,
                  COMMIT_SECONDS if commit_seconds is None else commit_seconds)

    def work(d: str) -> tuple[int, int]:
        size = refs[d]
        if dst.has_chunk(d):  # committed (a chunk pending in the batch is not: refs names each once)
            return size, 0
        blob, _ = load_verified(src.backend, ChunkRef(digest=d, size=size), thread_buffers(), f"{what} in {src.location}")
        try:
            out.put(d, blob)
        except HostError as e:
            raise HostError(f"{e}; about {remaining[0]:,} more bytes (uncompressed, at most) remain to copy for {what}") from None
        return size, len(blob)

    with kept(out):  # every chunk durable and visible before the manifest names them
        for size, copied in ordered_map(work, list(refs), workers or max(src.workers, dst.workers)):
            remaining[0] -= size
            if copied:
                rep.chunks_copied += 1
                rep.bytes_copied += copied
            if progress:
                progress(size)
    # Manifest bytes are copied verbatim (same digest), after every chunk is in place.
    dst.check_lock(f"copy {what}")  # LockLost: chunks seen or committed above may be gone
    if not dst.has_manifest(digest):
        dst.put_manifest(manifest)
        if not dst.has_manifest(digest):  # pragma: no cover - would mean to_bytes is not canonical
            dst.backend.save(manifest_key(digest), data)
    # Attachments of the manifest (signatures, see warmctl.naming.trust) travel with it.
    # Each must be what the store writes there (a small JSON object; a "signature" that
    # was a link to /etc/shadow travelled onward): anything else is left behind, with a warning.
    for prefix in attachment_prefixes(digest):
        for o in src.backend.list(prefix):
            try:
                blob = load_limited(src.backend, o.key, MAX_SIGNATURE_BYTES, "signature")
                if not o.key.endswith(".json") or not isinstance(pydantic_core.from_json(blob), dict):
                    raise ValueError("not a JSON object named *.json")
            except ObjectNotFound:
                continue
            except (IntegrityError, ValueError) as e:
                log.warning("not copying %s with %s: %s", src.backend.location(o.key), what, str(e).splitlines()[0])
                continue
            try:
                if load_limited(dst.backend, o.key, MAX_SIGNATURE_BYTES, "signature") == blob:
                    continue
            except (ObjectNotFound, IntegrityError):
                pass
            dst.commit(o.key, blob, f"copy of {what}")
    rep.seconds = time.monotonic() - t0
    return rep
