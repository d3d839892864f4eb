"""The store core over any :class:`Backend` (format: docs/store-format.md): config, locking,
chunks in and out, manifests. The store names nothing: snapshots are manifest digests here,
and names and tags live one layer up, in the catalog (:mod:`warmctl.naming.catalog`).

Write order is chunks, then manifest (refused unless every chunk it names exists), then the
catalog entry that names it; a crash at any point leaves at worst unreferenced chunks or an
unnamed manifest, which gc removes. The pieces around
the core have modules of their own: key layout (:mod:`~warmctl.store.layout`), the parallel
chunk I/O engine and its verify-and-refetch loop (:mod:`~warmctl.store.chunkio`), the read
cache (:mod:`~warmctl.store.cache`) and report types (:mod:`~warmctl.store.reports`). What works on
a whole store from outside, verify/gc/du (:mod:`~warmctl.store.maintenance`) and copying between
stores (:mod:`~warmctl.store.copy`), takes a :class:`Store`; this module imports neither.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path

import pydantic_core

from warmctl.base.errors import IntegrityError, WarmctlError
from warmctl.records.manifest import ChunkRef, Manifest, sha256_digest
from warmctl.store import chunks as ck
from warmctl.store import lock as lk
from warmctl.store.backend import Backend, ObjectNotFound, load_limited
from warmctl.store.cache import CachingBackend, Fetched
from warmctl.store.chunkio import ChunkBuffers, Progress, load_verified, ordered_map
from warmctl.store.chunkio import FileWatch, kept
from warmctl.store.chunkio import read_files as _read_files
from warmctl.store.layout import MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES, attachment_prefixes, chunk_key, manifest_key

_open_stores: "weakref.WeakSet[Store]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    for s in list(_open_stores):
        s.close()


class CacheFill:
    """Chunks fetched into a local store's read cache (``Store.read_files(cache=, fill=)``) and
    not yet committed: each verified copy is a temporary file under the cache's ``tmp/`` (one
    :class:`~warmctl.store.local.SaveBatch`), neither durable nor visible under its key, until
    :meth:`commit`. Why: on a fresh node that commit (an fsync of every fetched chunk object,
    1.4 GiB of ``tiny``'s) ran inside ``up``'s "materialize", before CRIU started, although
    nothing on the path to the first token reads the local store; ``up`` now commits after the
    public port opened (its "commit" phase), or, when the restore fails, before it raises.

    The store's invariants hold as for an immediate commit: an object is visible only once
    durable; a crash (``kill -9``) before or during the commit leaves temporary files (gc
    removes them, :meth:`~warmctl.store.local.LocalBackend.list_tmp`) and at worst some whole
    objects renamed, and a later read fetches what is missing again. The copies are written
    under ``cache``'s shared writer lock (taken at the first copy); commit before
    ``cache.close()`` releases it, so that no gc runs between the copies and their commit.
    A cache whose backend has no batches (not a local directory) saved each copy already:
    :meth:`commit` then has nothing to do. Thread-safe as the batch is.
    """

    def __init__(self, cache: "Store"):
        self.cache = cache
        b = cache.backend
        self.batch = b.batch(workers=8) if hasattr(b, "batch") else None

    def __len__(self) -> int:
        """Copies pending (not yet committed)."""
        return 0 if self.batch is None else len(self.batch)

    def commit(self) -> int:
        """Make every pending copy durable and visible in the cache; returns how many. Raises
        OSError / :class:`~warmctl.base.errors.HostError` from the cache's disk (the copies not yet
        renamed stay temporary files: :meth:`discard` removes them)."""
        return 0 if self.batch is None else self.batch.commit()

    def discard(self) -> None:
        """Remove every pending copy's temporary file (nothing becomes visible)."""
        if self.batch is not None:
            self.batch.abort()

    def settle(self) -> Exception | None:
        """:meth:`commit`, or on its failure :meth:`discard`: the store is left either way with
        only whole, durable objects. Returns the commit's error (None when it committed)."""
        try:
            self.commit()
            return None
        except Exception as e:  # noqa: BLE001 - returned for the caller to report
            self.discard()
            return e


class Store:
    """A content-addressed snapshot store on ``backend``.

    ``workers``: threads for hashing/compressing/transferring (default: the backend's
    ``properties.workers``, 4 local, 16 S3).
    ``chunk_size``: bytes per chunk for :meth:`add_file` (readers need not know it; changing
    it loses dedup against chunks cut at another size).
    ``lock_stale_after``/``lock_wait``: seconds (see :mod:`warmctl.store.lock`). The first
    write takes a shared lock held until :meth:`close` (or process exit), so a concurrent gc
    cannot remove chunks this writer relies on. Chunks this writer saw or wrote are not
    checked again by :meth:`put_manifest` only while that lock has been held continuously;
    every commit (manifest, signature, catalog entry: :meth:`commit`) checks it before and
    after, and raises :class:`~warmctl.store.lock.LockLost` once it was lost. Usable as a
    context manager.
    """

    def __init__(
        self,
        backend: Backend,
        workers: int | None = None,
        lock_stale_after: float = lk.DEFAULT_STALE_AFTER,
        lock_wait: float = 300.0,
        chunk_size: int = ck.CHUNK_SIZE,
    ):
        if chunk_size <= 0:
            raise ValueError("chunk_size must be > 0")
        self.backend = backend
        self.chunk_size = chunk_size
        self.is_local = backend.properties.local
        self.workers = workers or backend.properties.workers
        self.lock_stale_after = lock_stale_after
        self.lock_wait = lock_wait
        self._lock: lk.Lock | None = None
        self._mu = threading.Lock()
        self._known: set[str] = set()  # chunk digests known to exist
        self._config_checked = False
        _open_stores.add(self)

    def __repr__(self) -> str:
        return f"Store({self.backend.location()!r})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def location(self) -> str:
        """Where the store is (directory or ``s3://bucket/prefix``)."""
        return self.backend.location()

    def close(self) -> None:
        """Release the writer lock (if held). The store stays usable (a new write re-locks)."""
        with self._mu:
            lock, self._lock = self._lock, None
            self._known.clear()  # known under that lock only: a gc may run once it is released
        if lock is not None:
            lock.release()

    # -- config and locking

    def check_config(self, writing: bool = False) -> None:
        """Check the store's format (WarmctlError for another one, IntegrityError for an
        unreadable config); with ``writing``, write the config of a new store."""
        if self._config_checked:
            return
        try:
            cfg = pydantic_core.from_json(load_limited(self.backend, "config", MAX_CONFIG_BYTES, "store config"))
        except ObjectNotFound:
            cfg = None
        except ValueError:
            raise IntegrityError(f"store config {self.backend.location('config')} is not valid JSON") from None
        if cfg is not None and not isinstance(cfg, dict):
            raise IntegrityError(f"store config {self.backend.location('config')} is not a JSON object")
        if cfg is not None and cfg.get("format") != ck.STORE_FORMAT:
            raise WarmctlError(
                f"store {self.location} has format {cfg.get('format')!r}; this warmctl reads format {ck.STORE_FORMAT}"
            )
        if cfg is None and writing:
            body = {"format": ck.STORE_FORMAT, "chunk_size": self.chunk_size, "digest": ck.DIGEST_ALGORITHM, "compression": f"zstd:{ck.ZSTD_LEVEL}"}
            self.backend.save("config", json.dumps(body, sort_keys=True).encode() + b"\n")
        if cfg is not None or writing:
            self._config_checked = True

    def lock_for_write(self, purpose: str) -> None:
        """Take the shared writer lock once (held until :meth:`close`; ``purpose`` is recorded
        in it), writing the config of a new store first. Every write calls it; so does code
        that writes objects through :attr:`backend` itself (copying, the read cache)."""
        self.check_config(writing=True)
        with self._mu:
            if self._lock is None:
                self._lock = lk.acquire(self.backend, "shared", purpose, self.lock_stale_after, self.lock_wait)
                self._known.clear()  # what was seen before the lock may be gone by now
                # a Store dropped without close() still releases its lock
                weakref.finalize(self, self._lock.release)

    def check_lock(self, what: str) -> None:
        """Take the writer lock if not held; raise :class:`~warmctl.store.lock.LockLost` (naming
        ``what``) if the held one was not kept alive continuously (see :mod:`warmctl.store.lock`)."""
        self.lock_for_write(what)
        lock = self._lock
        if lock is not None:
            lock.check(what)

    def commit(self, key: str, data: bytes, what: str) -> None:
        """Save ``key`` (an object that names others: manifest, signature, catalog entry) under
        the writer lock, checked before and after the save (:meth:`check_lock`). When the lock
        turns out lost after the save, an object this call created is removed again, then
        :class:`~warmctl.store.lock.LockLost` is raised."""
        self.check_lock(what)
        existed = self.backend.exists(key)
        self.backend.save(key, data)
        try:
            self.check_lock(what)
        except lk.LockLost:
            if not existed:
                try:
                    self.backend.remove(key)
                except Exception:  # noqa: BLE001 - the error below says what happened
                    pass
            raise

    # -- chunks

    def has_chunk(self, digest: str, size: int | None = None) -> bool:
        """True when the chunk is stored (all-zero chunks always are, given ``size``)."""
        if size is not None and ck.is_zero_chunk(digest, size):
            return True
        if digest in self._known:
            return True
        ok = self.backend.exists(chunk_key(digest))
        if ok:
            self._known.add(digest)
        return ok

    def _put_chunk(self, data: bytes) -> tuple[ChunkRef, int]:
        """Store one chunk's bytes; returns (ref, stored bytes written, 0 when deduplicated)."""
        n = len(data)
        if ck.is_zero(data):
            return ChunkRef(digest=ck.zero_digest(n), size=n), 0
        digest = ck.hash_bytes(data)
        ref = ChunkRef(digest=digest, size=n)
        if self.has_chunk(digest):
            return ref, 0
        blob = ck.compress(data)
        self.put_chunk_blob(digest, blob)
        return ref, len(blob)

    def put_chunk_blob(self, digest: str, blob: bytes | memoryview) -> None:
        """Store a chunk object as it is stored elsewhere (one zstd frame; the caller has
        verified that it holds ``digest``'s bytes). Raises HostError on a full disk."""
        self.backend.save(chunk_key(digest), blob)
        self._known.add(digest)

    def note_chunks(self, digests: Iterable[str]) -> None:
        """Note chunks a caller made durable in this store itself (a committed
        :class:`~warmctl.store.local.SaveBatch` of chunk objects, each verified), so that
        :meth:`has_chunk` and :meth:`put_manifest` need not look for them again."""
        self._known.update(digests)

    def remove_chunk(self, digest: str) -> None:
        """Delete the chunk object ``digest`` (gc's job: a manifest may still need it)."""
        self.backend.remove(chunk_key(digest))
        self._known.discard(digest)

    def load_chunk_blob(self, ref: ChunkRef, context: str = "") -> tuple[bytes, bytes]:
        """(stored blob, verified uncompressed bytes) of a non-zero chunk.

        A damaged object is fetched once more before giving up. Raises IntegrityError naming
        the digest, its location and ``context`` (e.g. the destination file).
        """
        blob, data = load_verified(self.backend, ref, ChunkBuffers(ref.size), context)
        return bytes(blob), bytes(data)

    def load_chunk(self, ref: ChunkRef, context: str = "") -> bytes:
        """Verified uncompressed bytes of a chunk (zeros for an all-zero chunk)."""
        if ck.is_zero_chunk(ref.digest, ref.size):
            return bytes(ref.size)
        return self.load_chunk_blob(ref, context)[1]

    def add_file(self, path: Path | str, progress: Progress | None = None) -> list[ChunkRef]:
        """Split ``path`` into chunks (fixed ``chunk_size`` bytes, default 4 MiB),
        store the ones missing, return their refs in file order.

        All-zero chunks are never stored. ``progress(n)`` is called (in this thread) with the
        number of file bytes consumed since the last call. Memory: about ``2 * workers``
        chunks. Raises OSError if ``path`` is unreadable, HostError on a full disk.
        """
        path = Path(path)
        self.lock_for_write(f"add_file {path}")
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass

            def work(off: int) -> ChunkRef:
                want = min(self.chunk_size, size - off)
                data = os.pread(fd, want, off)
                while len(data) < want:  # short reads (rare): keep going
                    more = os.pread(fd, want - len(data), off + len(data))
                    if not more:
                        raise IntegrityError(f"{path} shrank while being stored (at byte {off + len(data)})")
                    data += more
                return self._put_chunk(data)[0]

            refs = []
            for ref in ordered_map(work, range(0, size, self.chunk_size), self.workers):
                refs.append(ref)
                if progress:
                    progress(ref.size)
            return refs
        finally:
            os.close(fd)

    def read_file(self, chunks: list[ChunkRef], dest: Path | str, progress: Progress | None = None, cache: Store | None = None,
                  fetched: Fetched | None = None, fill: "CacheFill | None" = None) -> None:
        """Write the file made of ``chunks`` to ``dest`` (parents created; written to a
        temporary file in the same directory, then renamed; zero chunks become holes).

        Every chunk is verified against its digest. ``cache``: a (local) store tried first and
        filled with the chunks fetched here, each once verified, so a later read needs no
        download; a damaged cached chunk is fetched again and replaced
        (:class:`~warmctl.store.cache.CachingBackend`). ``progress(n)``: file bytes written
        since the last call. ``fetched``: adds the stored bytes loaded, by where they came from
        (this store when it is local, else the remote; the cache). ``fill``: see :meth:`read_files`.
        Raises IntegrityError (naming the chunk digest, where it is stored, and ``dest``) for a
        missing/corrupt/truncated chunk; HostError when the disk is too small (naming bytes).
        """
        self.read_files([(chunks, dest)], progress, cache, fetched, fill)

    def read_files(self, files: list[tuple[list[ChunkRef], Path | str]], progress: Progress | None = None,
                   cache: Store | None = None, fetched: Fetched | None = None,
                   fill: "CacheFill | None" = None, watch: FileWatch | None = None) -> None:
        """:meth:`read_file` for each ``(chunks, dest)`` of ``files``, through one pool of
        :attr:`workers` threads for all of them (no drain at file boundaries; see
        :func:`warmctl.store.chunkio.read_files`). Same guarantees and errors; free space is
        checked once for all the files' non-zero bytes. ``watch``: told of each file's progress
        as its chunks are verified and written (:class:`~warmctl.store.chunkio.FileWatch`).

        With ``cache``, the chunks fetched are committed to it (durable and visible: one
        :class:`~warmctl.store.local.SaveBatch`) before this returns or raises; given ``fill``
        (a :class:`CacheFill` of ``cache``), they are put in it instead and this returns without
        committing them: ``fill.commit()`` (or ``discard()``) is the caller's, e.g. once the
        restored engine serves (:func:`warmctl.pipelines.lifecycle.up`)."""
        backend, count = self.backend, None
        what = str(files[0][1]) if len(files) == 1 else f"{len(files)} files in {Path(files[0][1]).parent}" if files else ""
        if fill is not None and (cache is None or fill.cache is not cache):
            raise ValueError("fill= is a CacheFill of the cache= store")
        if cache is not None:
            backend = CachingBackend(backend, cache.backend, before_fill=lambda: cache.lock_for_write(f"cache for {what}"),
                                     fetched=fetched, batch=None if fill is None else fill.batch)
        elif fetched is not None:
            where = "local" if backend.properties.local else "remote"
            count = lambda n: fetched.add(where, n)  # noqa: E731
        if not isinstance(backend, CachingBackend):
            _read_files(backend, files, self.workers, progress, count, watch)
            return
        with kept(backend):  # every copy durable and visible before this returns (on failure, those verified)
            _read_files(backend, files, self.workers, progress, count, watch)

    def put_manifest(self, manifest: Manifest) -> str:
        """Store ``manifest``; returns its digest (``sha256:<hex>``).

        Refuses (IntegrityError listing what is missing and where) unless every chunk the
        manifest references exists in this store and each file's chunk sizes add up; raises
        :class:`~warmctl.store.lock.LockLost` (nothing stored) when the writer lock was not held
        continuously, since chunks it saw may have been removed by a gc meanwhile.
        """
        what = f"put_manifest {manifest.name}"
        self.check_lock(what)  # LockLost: chunks known to this writer may be gone
        need: dict[str, int] = {}
        for f in manifest.files:
            if f.hardlink_to is None and sum(c.size for c in f.chunks) != f.size:
                raise IntegrityError(f"manifest {manifest.name}: file {f.path} has {f.size} bytes but its chunks add up to {sum(c.size for c in f.chunks)}")
            for c in f.chunks:
                need[c.digest] = c.size
        todo = [(d, s) for d, s in need.items() if d not in self._known and not ck.is_zero_chunk(d, s)]
        missing = [d for (d, s), ok in zip(todo, ordered_map(lambda x: self.has_chunk(x[0]), todo, self.workers)) if not ok]
        if missing:
            shown = ", ".join(f"{d} ({self.backend.location(chunk_key(d))})" for d in missing[:5])
            raise IntegrityError(f"manifest {manifest.name} references {len(missing)} chunk(s) not in store {self.location}: {shown}" + (" ..." if len(missing) > 5 else ""))
        data = manifest.to_bytes()
        digest = sha256_digest(data)
        key = manifest_key(digest)
        if not self.backend.exists(key):
            self.commit(key, data, what)
        return digest

    def get_manifest_bytes(self, digest: str) -> bytes:
        """Verified canonical bytes of manifest ``digest``. Raises IntegrityError."""
        key = manifest_key(digest)
        try:
            data = load_limited(self.backend, key, MAX_MANIFEST_BYTES, "manifest")
        except ObjectNotFound:
            raise IntegrityError(f"manifest {digest} is missing: not found at {self.backend.location(key)}") from None
        if sha256_digest(data) != digest:
            raise IntegrityError(f"manifest {digest} at {self.backend.location(key)} is corrupt: its bytes hash to {sha256_digest(data)}")
        return data

    def get_manifest(self, digest: str) -> Manifest:
        """The manifest ``digest``, verified. Raises IntegrityError (missing, corrupt, unreadable)."""
        data = self.get_manifest_bytes(digest)
        try:
            return Manifest.from_bytes(data)
        except ValueError as e:
            raise IntegrityError(f"manifest {digest} at {self.backend.location(manifest_key(digest))}: {e}") from None

    def has_manifest(self, digest: str) -> bool:
        """True when manifest ``digest`` is stored (not verified; see :meth:`get_manifest`)."""
        return self.backend.exists(manifest_key(digest))

    def list_manifests(self) -> list[str]:
        """Digests of every stored manifest."""
        return sorted("sha256:" + o.key.rsplit("/", 1)[1] for o in self.backend.list("manifests/sha256/"))

    def remove_manifest(self, digest: str) -> None:
        """Delete a manifest and its attachments (its chunks go at the next gc). Names are the
        catalog's business: remove its entries first (:class:`warmctl.naming.catalog.Catalog`)."""
        self.lock_for_write(f"remove_manifest {digest}")
        for prefix in attachment_prefixes(digest):  # first: a crash between leaves no orphan signature
            for a in self.backend.list(prefix):
                self.backend.remove(a.key)
        self.backend.remove(manifest_key(digest))
