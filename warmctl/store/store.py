"""The content-addressed snapshot store over any :class:`Backend` (format: docs/store-format.md).

Object keys::

    config                          JSON {"format": 1, ...}, written with the first object
    chunks/<algo>/<hex[:2]>/<hex>   one zstd frame of the chunk's bytes
    manifests/sha256/<hex>          canonical manifest JSON (Manifest.to_bytes())
    tags/<name>/<tag>               "<manifest digest>\\n"
    locks/<id>                      writer/gc locks (see :mod:`warmctl.store.lock`)

Write order is chunks, then manifest (refused unless every chunk it names exists), then tag;
a crash at any point leaves at worst unreferenced chunks, which gc removes.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import shutil
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from warmctl.errors import HostError, IntegrityError, SnapshotNotFound, WarmctlError
from warmctl.manifest import ChunkRef, Manifest, sha256_digest
from warmctl.store import chunks as ck
from warmctl.store import lock as lk
from warmctl.store.backend import Backend, ObjectNotFound
from warmctl.store.local import LocalBackend, disk_full_error

Progress = Callable[[int], None]
T = TypeVar("T")
R = TypeVar("R")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(kind: str, value: str) -> str:
    """Validate a snapshot name or tag (``[A-Za-z0-9][A-Za-z0-9._-]*``, <= 128 chars)."""
    if not _NAME_RE.match(value or ""):
        raise WarmctlError(f"invalid {kind} {value!r}: use letters, digits, '.', '_', '-' (max 128)")
    return value


def chunk_key(digest: str) -> str:
    """Object key of the chunk ``digest``: ``chunks/<algo>/<hex[:2]>/<hex>``."""
    algo, hx = ck.split_digest(digest)
    return f"chunks/{algo}/{hx[:2]}/{hx}"


def manifest_key(digest: str) -> str:
    """Object key of the manifest ``digest``: ``manifests/sha256/<hex>``."""
    algo, hx = digest.partition(":")[0], digest.partition(":")[2]
    if algo != "sha256" or len(hx) != 64:
        raise ValueError(f"malformed manifest digest {digest!r} (want 'sha256:<64 hex>')")
    return f"manifests/sha256/{hx}"


def tag_key(name: str, tag: str) -> str:
    """Object key of a tag: ``tags/<name>/<tag>``."""
    return f"tags/{check_name('name', name)}/{check_name('tag', tag)}"


def attachment_prefixes(digest: str) -> list[str]:
    """Key prefixes of objects that belong to manifest ``digest`` and are copied with it
    (signatures: ``signatures/sha256/<hex>/``)."""
    return [f"signatures/{digest.replace(':', '/', 1)}/"]


#: Objects under these prefixes may name manifests (``sha256:<hex>``) that gc must keep.
ROOT_PREFIXES = ("tags/", "catalog/")
_MANIFEST_DIGEST_RE = re.compile(rb"sha256:[0-9a-f]{64}")


def _digest_from_chunk_key(key: str) -> str | None:
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "chunks" and parts[1] in ck.ALGORITHMS:
        return f"{parts[1]}:{parts[3]}"
    return None


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, window: int | None = None) -> Iterator[R]:
    """``map(fn, items)`` on ``workers`` threads, results in input order, at most ``window``
    tasks queued or running (bounded memory). On error, pending tasks are cancelled."""
    window = window or workers * 2
    ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="warmctl-store")
    q: deque[Future] = deque()
    try:
        for it in items:
            q.append(ex.submit(fn, it))
            if len(q) >= window:
                yield q.popleft().result()
        while q:
            yield q.popleft().result()
    finally:
        for f in q:
            f.cancel()
        ex.shutdown(wait=True)


#: read_file on local disk hints this many non-zero chunks ahead of the one being read
#: (posix_fadvise WILLNEED): 16 x 4 MiB keeps a disk busy while two cores verify.
PREFETCH_AHEAD = 16
#: read_file hashes and writes a chunk in pieces of this size, each while it is in the CPU
#: cache (measured: ~1.5x less CPU per byte than hashing and writing 4 MiB at once).
PIECE = 256 * 1024


class _ChunkBuffers:
    """One worker thread's reusable buffers: a stored blob and a chunk's uncompressed bytes."""

    __slots__ = ("blob", "data")

    def __init__(self) -> None:
        self.blob = bytearray(ck.CHUNK_SIZE + 4096)
        self.data = bytearray(ck.CHUNK_SIZE)


class ChunkMissing(IntegrityError):
    """A chunk the caller needs is not in the store (``digest``, ``location``)."""


class ChunkCorrupt(IntegrityError):
    """A stored chunk does not decompress to bytes matching its digest (``digest``, ``location``)."""


# ----------------------------------------------------------------------------- reports


@dataclass
class ChunkProblem:
    """A chunk that is ``missing`` or ``corrupt`` (``reason``), where it is, and who needs it."""

    digest: str
    location: str
    reason: str
    manifests: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.digest} at {self.location}: {self.reason} (used by {', '.join(self.manifests) or 'no manifest'})"


@dataclass
class VerifyReport:
    """Result of :meth:`Store.verify`: counts (bytes uncompressed) and every problem found."""

    manifests_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    missing: list[ChunkProblem] = field(default_factory=list)
    corrupt: list[ChunkProblem] = field(default_factory=list)
    bad_manifests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.corrupt or self.bad_manifests)

    def __str__(self) -> str:
        lines = [
            f"checked {self.manifests_checked} manifests, {self.chunks_checked} chunks, {self.bytes_checked:,} bytes: "
            + ("OK" if self.ok else f"{len(self.missing)} missing, {len(self.corrupt)} corrupt, {len(self.bad_manifests)} bad manifests")
        ]
        lines += [f"missing {p}" for p in self.missing]
        lines += [f"corrupt {p}" for p in self.corrupt]
        lines += [f"bad manifest {m}" for m in self.bad_manifests]
        return "\n".join(lines)


@dataclass
class GcReport:
    """Result of :meth:`Store.gc` (bytes are stored, i.e. compressed, sizes)."""

    manifests_kept: int = 0
    manifests_removed: list[str] = field(default_factory=list)
    chunks_kept: int = 0
    chunks_removed: int = 0
    bytes_removed: int = 0
    chunks_too_new: int = 0
    tmp_removed: int = 0
    locks_removed: int = 0
    dry_run: bool = False


@dataclass
class DuRow:
    """Space used by one manifest: ``logical`` (file bytes), ``stored`` (compressed bytes of its
    chunks), ``unique`` (stored bytes no other manifest uses), ``shared`` (stored - unique),
    ``zero`` (bytes of all-zero chunks, not stored)."""

    digest: str
    tags: list[str]
    name: str
    logical: int
    stored: int
    unique: int
    shared: int
    zero: int
    missing_chunks: int = 0


@dataclass
class DuReport:
    """Result of :meth:`Store.du`: a row per manifest plus store totals (bytes)."""

    rows: list[DuRow]
    total_stored: int
    unreferenced: int
    chunk_count: int


@dataclass
class CopyReport:
    """Result of :func:`push`/:func:`pull`: ``digest`` copied; chunk counts; ``bytes_copied``
    (stored bytes moved), ``logical`` (file bytes of the snapshot); ``seconds`` wall time."""

    digest: str
    chunks_total: int = 0
    chunks_copied: int = 0
    bytes_copied: int = 0
    logical: int = 0
    seconds: float = 0.0


# ----------------------------------------------------------------------------- the store

_open_stores: "weakref.WeakSet[Store]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    for s in list(_open_stores):
        s.close()


class Store:
    """A content-addressed snapshot store on ``backend``.

    ``workers``: threads for hashing/compressing/transferring (default: 4 local, 16 S3).
    ``chunk_size``: bytes per chunk for :meth:`add_file` (readers need not know it; changing
    it loses dedup against chunks cut at another size).
    ``lock_stale_after``/``lock_wait``: seconds (see :mod:`warmctl.store.lock`). The first
    write takes a shared lock held until :meth:`close` (or process exit), so a concurrent gc
    cannot remove chunks this writer relies on. Usable as a context manager.
    """

    def __init__(
        self,
        backend: Backend,
        workers: int | None = None,
        lock_stale_after: float = 120.0,
        lock_wait: float = 300.0,
        chunk_size: int = ck.CHUNK_SIZE,
    ):
        if chunk_size <= 0:
            raise ValueError("chunk_size must be > 0")
        self.backend = backend
        self.chunk_size = chunk_size
        inner = getattr(backend, "inner", backend)
        self.is_local = isinstance(inner, LocalBackend)
        self.workers = workers or (4 if self.is_local else 16)
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
        if lock is not None:
            lock.release()

    # -- config and locking

    def _check_config(self, writing: bool) -> None:
        if self._config_checked:
            return
        try:
            cfg = json.loads(self.backend.load("config"))
        except ObjectNotFound:
            cfg = None
        except ValueError:
            raise IntegrityError(f"store config {self.backend.location('config')} is not valid JSON") from None
        if cfg is not None and cfg.get("format") != ck.STORE_FORMAT:
            raise WarmctlError(
                f"store {self.location} has format {cfg.get('format')!r}; this warmctl reads format {ck.STORE_FORMAT}"
            )
        if cfg is None and writing:
            body = {"format": ck.STORE_FORMAT, "chunk_size": self.chunk_size, "digest": ck.DIGEST_ALGORITHM, "compression": f"zstd:{ck.ZSTD_LEVEL}"}
            self.backend.save("config", json.dumps(body, sort_keys=True).encode() + b"\n")
        if cfg is not None or writing:
            self._config_checked = True

    def _writing(self, purpose: str) -> None:
        """Take the shared writer lock once (held until close)."""
        self._check_config(writing=True)
        with self._mu:
            if self._lock is None:
                self._lock = lk.acquire(self.backend, "shared", purpose, self.lock_stale_after, self.lock_wait)
                # a Store dropped without close() still releases its lock
                weakref.finalize(self, self._lock.release)

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
        self.backend.save(chunk_key(digest), blob)
        self._known.add(digest)
        return ref, len(blob)

    def load_chunk_blob(self, ref: ChunkRef, context: str = "") -> tuple[bytes, bytes]:
        """(stored blob, verified uncompressed bytes) of a non-zero chunk.

        A damaged object is fetched once more before giving up. Raises IntegrityError naming
        the digest, its location and ``context`` (e.g. the destination file).
        """
        key = chunk_key(ref.digest)
        where = self.backend.location(key)
        ctx = f" (needed for {context})" if context else ""
        reason = ""
        for _ in range(2):
            try:
                blob = self.backend.load(key)
            except ObjectNotFound:
                raise ChunkMissing(f"chunk {ref.digest} is missing: not found at {where}{ctx}") from None
            try:
                data = ck.decompress(blob, ref.size)
            except ValueError as e:
                reason = f"damaged or truncated ({len(blob)} stored bytes): {e}"
                continue
            if ck.verify_bytes(data, ref.digest):
                return blob, data
            reason = f"content does not match its digest (got {ck.hash_bytes(data, ck.split_digest(ref.digest)[0])})"
        raise ChunkCorrupt(f"chunk {ref.digest} at {where} is corrupt: {reason}{ctx}")

    def _load_verified_into(
        self, ref: ChunkRef, bufs: _ChunkBuffers, context: str = "", sink: Callable[[int, memoryview], None] | None = None
    ) -> tuple[memoryview, memoryview]:
        """Like :meth:`load_chunk_blob`, but the stored blob and the uncompressed bytes land in
        ``bufs`` (reused across chunks by one thread: no allocation, no page faults); returns
        views into them, valid until the thread's next chunk. Same verification, re-fetch and
        errors.

        ``sink(offset, piece)``: called with each :data:`PIECE` of the chunk right after that
        piece is hashed, while it is still in the CPU cache (read_file writes it to the
        destination there). The digest is only known at the end: a caller must discard what
        the sink received if this raises, and expect a second pass after a re-fetch."""
        key = chunk_key(ref.digest)
        reason = ""
        for _ in range(2):
            try:
                blob = self.backend.load_into(key, bufs.blob)
            except ObjectNotFound:
                ctx = f" (needed for {context})" if context else ""
                raise ChunkMissing(f"chunk {ref.digest} is missing: not found at {self.backend.location(key)}{ctx}") from None
            if isinstance(blob.obj, bytearray) and blob.obj is not bufs.blob:
                bufs.blob = blob.obj  # the backend needed a larger buffer: keep it
            if len(bufs.data) < ref.size:
                bufs.data = bytearray(ref.size)
            try:
                data = ck.decompress_into(blob, bufs.data, ref.size)
            except ValueError as e:
                reason = f"damaged or truncated ({len(blob)} stored bytes): {e}"
                continue
            algo = ck.split_digest(ref.digest)[0]
            if sink is None:
                got = ck.hash_bytes(data, algo)
            else:
                h = ck.hasher(algo)
                for off in range(0, ref.size, PIECE):
                    piece = data[off : off + PIECE]
                    h.update(piece)
                    sink(off, piece)
                got = f"{algo}:{h.hexdigest()}"
            if got == ref.digest:
                return blob, data
            reason = f"content does not match its digest (got {got})"
        ctx = f" (needed for {context})" if context else ""
        raise ChunkCorrupt(f"chunk {ref.digest} at {self.backend.location(key)} is corrupt: {reason}{ctx}")

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
        self._writing(f"add_file {path}")
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

    def read_file(self, chunks: list[ChunkRef], dest: Path | str, progress: Progress | None = None, cache: Store | None = None) -> None:
        """Write the file made of ``chunks`` to ``dest`` (parents created; written to a
        temporary file in the same directory, then renamed; zero chunks become holes).

        Every chunk is verified against its digest. ``cache``: a (local) store tried first and
        filled with the chunks fetched here, so a later read needs no download.
        ``progress(n)``: file bytes written since the last call.
        Raises IntegrityError (naming the chunk digest, where it is stored, and ``dest``) for a
        missing/corrupt/truncated chunk; HostError when the disk is too small (naming bytes).
        """
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        total = sum(c.size for c in chunks)
        needed = sum(c.size for c in chunks if not ck.is_zero_chunk(c.digest, c.size))
        try:
            free = shutil.disk_usage(dest.parent).free
        except OSError:
            free = None
        if free is not None and needed > free + (dest.stat().st_size if dest.exists() else 0):
            raise disk_full_error(dest, needed, f"file of {total:,} bytes, {needed:,} non-zero")
        tmp = dest.parent / f".{dest.name}.warmctl-{os.getpid()}-{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        offsets = []
        off = 0
        for c in chunks:
            offsets.append(off)
            off += c.size
        zero = [ck.is_zero_chunk(c.digest, c.size) for c in chunks]
        tls = threading.local()  # per worker thread: reusable blob and chunk buffers
        local_cache = cache is not None and cache.is_local

        def work(i: int) -> int:
            c = chunks[i]
            if zero[i]:
                return c.size
            bufs = getattr(tls, "bufs", None)
            if bufs is None:
                bufs = tls.bufs = _ChunkBuffers()
            base = offsets[i]

            def write(off: int, view: memoryview) -> None:
                pos = base + off
                while view:
                    n = os.pwrite(fd, view, pos)
                    view, pos = view[n:], pos + n

            if cache is not None and cache.has_chunk(c.digest):
                try:
                    cache._load_verified_into(c, bufs, str(dest), write)
                    return c.size
                except IntegrityError:
                    pass  # damaged cache entry: fetch from the source (rewrites the range) and overwrite
            blob, _ = self._load_verified_into(c, bufs, str(dest), write)
            if cache is not None:
                cache._writing(f"cache for {dest}")
                cache.backend.save(chunk_key(c.digest), blob if local_cache else blob.tobytes())
                cache._known.add(c.digest)
            return c.size

        nonzero = [i for i, z in enumerate(zero) if not z]

        def feed() -> Iterator[int]:
            """Chunk indexes in order; on local disk, first hint the non-zero chunks up to
            PREFETCH_AHEAD ahead of the workers so that cold chunk files are read
            asynchronously while earlier chunks are decompressed and verified."""
            hinted = seen = 0
            for i in range(len(chunks)):
                if not zero[i]:
                    seen += 1
                    if self.is_local:
                        while hinted < len(nonzero) and hinted < seen + PREFETCH_AHEAD:
                            self.backend.prefetch(chunk_key(chunks[nonzero[hinted]].digest))
                            hinted += 1
                yield i

        try:
            os.ftruncate(fd, total)
            for n in ordered_map(work, feed(), self.workers):
                if progress:
                    progress(n)
            os.close(fd)
            fd = -1
            os.replace(tmp, dest)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(dest, needed, f"file of {total:,} bytes") from None
            raise
        finally:
            if fd >= 0:
                os.close(fd)
            if tmp.exists():
                tmp.unlink()

    # -- manifests and tags

    def put_manifest(self, manifest: Manifest) -> str:
        """Store ``manifest``; returns its digest (``sha256:<hex>``).

        Refuses (IntegrityError listing what is missing and where) unless every chunk the
        manifest references exists in this store and each file's chunk sizes add up.
        """
        self._writing(f"put_manifest {manifest.name}")
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
            self.backend.save(key, data)
        return digest

    def get_manifest_bytes(self, digest: str) -> bytes:
        """Verified canonical bytes of manifest ``digest``. Raises IntegrityError."""
        key = manifest_key(digest)
        try:
            data = self.backend.load(key)
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
        """Delete a manifest (its chunks go at the next gc). Tags pointing to it are removed too."""
        self._writing(f"remove_manifest {digest}")
        for name, tag, d in self.list_tags():
            if d == digest:
                self.remove_tag(name, tag)
        self.backend.remove(manifest_key(digest))

    def set_tag(self, name: str, tag: str, digest: str) -> None:
        """Point ``name:tag`` at manifest ``digest`` (which must be stored; IntegrityError otherwise)."""
        key = tag_key(name, tag)
        manifest_key(digest)
        self._writing(f"set_tag {name}:{tag}")
        if not self.has_manifest(digest):
            raise IntegrityError(f"cannot tag {name}:{tag}: manifest {digest} not found at {self.backend.location(manifest_key(digest))}")
        self.backend.save(key, (digest + "\n").encode())

    def get_tag(self, name: str, tag: str = "latest") -> str | None:
        """The manifest digest ``name:tag`` points to, or None."""
        key = tag_key(name, tag)
        try:
            d = self.backend.load(key).decode().strip()
        except ObjectNotFound:
            return None
        try:
            manifest_key(d)
        except ValueError:
            raise IntegrityError(f"tag {name}:{tag} at {self.backend.location(key)} is corrupt: {d[:80]!r}") from None
        return d

    def resolve(self, name: str, tag: str = "latest") -> str:
        """Like :meth:`get_tag` but raises SnapshotNotFound naming the store."""
        d = self.get_tag(name, tag)
        if d is None:
            raise SnapshotNotFound(f"no snapshot {name}:{tag} in store {self.location}")
        return d

    def list_tags(self) -> list[tuple[str, str, str]]:
        """Every ``(name, tag, manifest digest)``, sorted."""
        out = []
        for o in self.backend.list("tags/"):
            parts = o.key.split("/")
            if len(parts) != 3:
                continue
            d = self.get_tag(parts[1], parts[2])
            if d:
                out.append((parts[1], parts[2], d))
        return sorted(out)

    def remove_tag(self, name: str, tag: str) -> None:
        """Delete ``name:tag`` (the manifest stays until ``gc(untagged=True)``)."""
        key = tag_key(name, tag)
        self._writing(f"remove_tag {name}:{tag}")
        self.backend.remove(key)

    # -- maintenance

    def _chunk_sizes(self) -> dict[str, int]:
        """digest -> stored size of every chunk object."""
        out = {}
        for o in self.backend.list("chunks/"):
            d = _digest_from_chunk_key(o.key)
            if d:
                out[d] = o.size
        return out

    def verify(self, digests: Iterable[str] | None = None, progress: Progress | None = None) -> VerifyReport:
        """Re-hash every chunk of the given manifests (default: all) and report what is
        missing or corrupt, naming each chunk, its location and the manifests that use it.
        ``progress(n)``: uncompressed bytes checked. Never raises for damaged data."""
        rep = VerifyReport()
        names = {d: [] for d in (digests if digests is not None else self.list_manifests())}
        for name, tag, d in self.list_tags():
            if d in names:
                names[d].append(f"{name}:{tag}")
        users: dict[str, list[str]] = {}
        sizes: dict[str, int] = {}
        for d in names:
            label = f"{d[:19]}" + (f" ({', '.join(names[d])})" if names[d] else "")
            try:
                m = self.get_manifest(d)
            except IntegrityError as e:
                rep.bad_manifests.append(str(e))
                continue
            rep.manifests_checked += 1
            for f in m.files:
                for c in f.chunks:
                    if ck.is_zero_chunk(c.digest, c.size):
                        continue
                    sizes[c.digest] = c.size
                    users.setdefault(c.digest, [])
                    if label not in users[c.digest]:
                        users[c.digest].append(label)

        tls = threading.local()

        def work(d: str) -> tuple[str, str | None, str | None]:
            bufs = getattr(tls, "bufs", None)
            if bufs is None:
                bufs = tls.bufs = _ChunkBuffers()
            try:
                self._load_verified_into(ChunkRef(digest=d, size=sizes[d]), bufs)
            except ChunkMissing:
                return d, "missing", "not found"
            except ChunkCorrupt as e:
                return d, "corrupt", str(e).split(" is corrupt: ", 1)[-1]
            return d, None, None

        for d, kind, msg in ordered_map(work, list(sizes), self.workers):
            rep.chunks_checked += 1
            rep.bytes_checked += sizes[d]
            if progress:
                progress(sizes[d])
            if kind:
                p = ChunkProblem(d, self.backend.location(chunk_key(d)), msg, users[d])
                (rep.missing if kind == "missing" else rep.corrupt).append(p)
        return rep

    def gc(self, grace: float = 300.0, untagged: bool = False, dry_run: bool = False) -> GcReport:
        """Remove chunks no manifest references (and, with ``untagged``, manifests that no tag
        and no catalog entry names, with their signatures).

        Takes the exclusive lock (StoreLocked if a push/pull holds the store); this Store's own
        writer lock is released first, so do not call it between add_file and put_manifest. Objects younger
        than ``grace`` seconds are kept in any case. Stale locks and, on local disk, ingest
        temp files older than max(grace, 1 h) are removed. Raises IntegrityError if a
        manifest cannot be read (gc cannot know what it references).
        """
        self._check_config(writing=False)
        self.close()  # our own writer lock would block the exclusive one
        rep = GcReport(dry_run=dry_run)
        lock = lk.acquire(self.backend, "exclusive", "gc", self.lock_stale_after, 0)
        try:
            now = time.time()
            _, stale = lk.other_locks(self.backend, lock.key, self.lock_stale_after)
            for k in stale:
                if not dry_run:
                    self.backend.remove(k)
                rep.locks_removed += 1
            tagged = {d for _, _, d in self.list_tags()}
            if untagged:  # anything that names a manifest (catalog entries) keeps it too
                for o in self.backend.list("catalog/"):
                    try:
                        tagged |= {m.decode() for m in _MANIFEST_DIGEST_RE.findall(self.backend.load(o.key))}
                    except ObjectNotFound:
                        continue
            mtimes = {"sha256:" + o.key.rsplit("/", 1)[1]: o.mtime for o in self.backend.list("manifests/sha256/")}
            live: set[str] = set()
            for d, mt in mtimes.items():
                if untagged and d not in tagged and now - mt >= grace:
                    if not dry_run:
                        self.backend.remove(manifest_key(d))
                        for prefix in attachment_prefixes(d):
                            for a in self.backend.list(prefix):
                                self.backend.remove(a.key)
                    rep.manifests_removed.append(d)
                    continue
                live |= self.get_manifest(d).chunk_digests()
                rep.manifests_kept += 1
            for o in self.backend.list("chunks/"):
                d = _digest_from_chunk_key(o.key)
                if d is None or d in live:
                    rep.chunks_kept += 1
                    continue
                if now - o.mtime < grace:
                    rep.chunks_too_new += 1
                    continue
                if not dry_run:
                    self.backend.remove(o.key)
                    self._known.discard(d)
                rep.chunks_removed += 1
                rep.bytes_removed += o.size
            inner = getattr(self.backend, "inner", self.backend)
            if isinstance(inner, LocalBackend):
                for o in inner.list_tmp():
                    if now - o.mtime >= max(grace, 3600.0):
                        if not dry_run:
                            (inner.root / o.key).unlink(missing_ok=True)
                        rep.tmp_removed += 1
        finally:
            lock.release()
        return rep

    def du(self) -> DuReport:
        """Space per manifest: logical, stored, unique and shared bytes (see :class:`DuRow`)."""
        sizes = self._chunk_sizes()
        tags: dict[str, list[str]] = {}
        for name, tag, d in self.list_tags():
            tags.setdefault(d, []).append(f"{name}:{tag}")
        manifests = {d: self.get_manifest(d) for d in self.list_manifests()}
        refcount: dict[str, int] = {}
        for m in manifests.values():
            for c in m.chunk_digests():
                refcount[c] = refcount.get(c, 0) + 1
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


# ----------------------------------------------------------------------------- push / pull


def copy_snapshot(src: Store, dst: Store, name: str, tag: str = "latest", progress: Progress | None = None, workers: int | None = None) -> CopyReport:
    """Copy snapshot ``name:tag`` from ``src`` to ``dst``: chunks first (only those ``dst``
    lacks, each verified on the way), then the manifest, then the tag. Restartable: a killed
    copy, rerun, moves only what is still missing.

    ``progress(n)``: snapshot file bytes accounted for (copied, already present, or zero).
    Raises SnapshotNotFound (no such tag in ``src``), IntegrityError (a source chunk is
    missing or corrupt), HostError (disk full: bytes needed named).
    """
    t0 = time.monotonic()
    digest = src.resolve(name, tag)
    data = src.get_manifest_bytes(digest)
    manifest = Manifest.from_bytes(data)
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
    dst._writing(f"copy {name}:{tag} from {src.location}")
    if progress and zero:
        progress(zero)
    remaining = [sum(refs.values())]

    tls = threading.local()  # per worker thread: reusable buffers

    def work(d: str) -> tuple[int, int]:
        size = refs[d]
        if dst.has_chunk(d):
            return size, 0
        bufs = getattr(tls, "bufs", None)
        if bufs is None:
            bufs = tls.bufs = _ChunkBuffers()
        blob, _ = src._load_verified_into(ChunkRef(digest=d, size=size), bufs, f"{name}:{tag} in {src.location}")
        try:
            dst.backend.save(chunk_key(d), blob if dst.is_local else blob.tobytes())
        except HostError as e:
            raise HostError(f"{e}; about {remaining[0]:,} more bytes (uncompressed, at most) remain to copy for {name}:{tag}") from None
        dst._known.add(d)
        return size, len(blob)

    for size, copied in ordered_map(work, list(refs), workers or max(src.workers, dst.workers)):
        remaining[0] -= size
        if copied:
            rep.chunks_copied += 1
            rep.bytes_copied += copied
        if progress:
            progress(size)
    # Manifest bytes are copied verbatim (same digest), after every chunk is in place.
    if not dst.has_manifest(digest):
        dst.put_manifest(manifest)
        if not dst.has_manifest(digest):  # pragma: no cover - would mean to_bytes is not canonical
            dst.backend.save(manifest_key(digest), data)
    # Attachments of the manifest (signatures, see warmctl.trust) travel with it.
    for prefix in attachment_prefixes(digest):
        for o in src.backend.list(prefix):
            blob = src.backend.load(o.key)
            try:
                if dst.backend.load(o.key) == blob:
                    continue
            except ObjectNotFound:
                pass
            dst.backend.save(o.key, blob)
    dst.set_tag(name, tag, digest)
    rep.seconds = time.monotonic() - t0
    return rep


def push(src: Store, dst: Store, name: str, tag: str = "latest", progress: Progress | None = None) -> CopyReport:
    """Publish ``name:tag`` from the local store ``src`` to ``dst`` (see :func:`copy_snapshot`)."""
    return copy_snapshot(src, dst, name, tag, progress)


def pull(src: Store, dst: Store, name: str, tag: str = "latest", progress: Progress | None = None) -> CopyReport:
    """Fetch ``name:tag`` from the remote ``src`` into the local store ``dst`` (see :func:`copy_snapshot`)."""
    return copy_snapshot(src, dst, name, tag, progress)
