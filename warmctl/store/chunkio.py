"""The parallel chunk I/O engine, over any :class:`~warmctl.store.backend.Backend`.

Owns :func:`ordered_map` (bounded parallel map, results in order), each worker thread's reusable
chunk buffers, the one verify-and-refetch loop every chunk read goes through
(:func:`load_verified`: decompress, hash, re-fetch a damaged object once, name what failed), and
:func:`read_file`, which writes a file back from its chunks. A caching backend
(:class:`warmctl.store.cache.CachingBackend`) plugs into the loop through ``Backend.keep`` and
``Backend.forget``: a copy is kept only once verified, and a damaged copy is dropped and the
source read instead.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

from warmctl.base.errors import IntegrityError
from warmctl.records.manifest import ChunkRef
from warmctl.store import chunks as ck
from warmctl.store.backend import Backend, ObjectNotFound
from warmctl.store.layout import chunk_key
from warmctl.store.local import disk_full_error

log = logging.getLogger(__name__)

#: ``progress(n)``: called with the number of bytes done since the last call.
Progress = Callable[[int], None]
T = TypeVar("T")
R = TypeVar("R")

#: read_file on local disk hints this many non-zero chunks ahead of the one being read
#: (posix_fadvise WILLNEED): 16 x 4 MiB keeps a disk busy while two cores verify.
PREFETCH_AHEAD = 16
#: read_file hashes and writes a chunk in pieces of this size, each while it is in the CPU
#: cache (measured: ~1.5x less CPU per byte than hashing and writing 4 MiB at once).
PIECE = 256 * 1024


class ChunkMissing(IntegrityError):
    """A chunk the caller needs is not in the store: attributes ``digest`` and ``location``
    (where it was looked for), with the operator's message."""

    def __init__(self, message: str, digest: str, location: str):
        super().__init__(message)
        self.digest, self.location = digest, location


class ChunkCorrupt(IntegrityError):
    """A stored chunk does not decompress to bytes matching its digest: attributes ``digest``,
    ``location`` and ``reason`` (what was wrong with the last copy read)."""

    def __init__(self, message: str, digest: str, location: str, reason: str):
        super().__init__(message)
        self.digest, self.location, self.reason = digest, location, reason


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


class ChunkBuffers:
    """One worker thread's reusable buffers: a stored blob and a chunk's uncompressed bytes
    (``size`` bytes each, plus room for zstd's frame overhead; grown when a chunk needs more)."""

    __slots__ = ("blob", "data")

    def __init__(self, size: int = ck.CHUNK_SIZE) -> None:
        self.blob = bytearray(size + 4096)
        self.data = bytearray(size)


_tls = threading.local()


def thread_buffers() -> ChunkBuffers:
    """This thread's :class:`ChunkBuffers` (made on first use; freed when the thread ends, so
    call it from worker threads such as :func:`ordered_map`'s, not a long-lived one)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = ChunkBuffers()
    return bufs


class Flushable(Protocol):
    """Saves made durable and visible together (``flush``) or dropped (``discard``):
    :class:`~warmctl.store.cache.CachingBackend`, the pull's batch in :mod:`warmctl.store.copy`."""

    def flush(self) -> object: ...

    def discard(self) -> None: ...


@contextmanager
def kept(saves: Flushable) -> Iterator[Flushable]:
    """Around work that saves verified objects into ``saves``: on return they are flushed;
    on any error (an interrupt included) those verified so far are flushed too, for the next
    try, and if that flush fails they are discarded; the work's error is the one raised
    (a flush's error is raised only when the work succeeded). Nothing half-written is left
    visible either way."""
    try:
        yield saves
    except BaseException:
        try:
            saves.flush()
        except Exception:  # noqa: BLE001 - the first error is the one to report
            saves.discard()
        raise
    saves.flush()


def load_verified(
    backend: Backend, ref: ChunkRef, bufs: ChunkBuffers, context: str = "", sink: Callable[[int, memoryview], None] | None = None
) -> tuple[memoryview, memoryview]:
    """(stored blob, verified uncompressed bytes) of the non-zero chunk ``ref``, loaded from
    ``backend`` into ``bufs`` (no allocation, no page faults when reused); the views are valid
    until ``bufs`` is reused.

    A damaged object is fetched once more before giving up; a damaged copy that ``backend``
    can drop (``Backend.forget``: a cache) is dropped and the source read, without counting as
    that second try -- once: a second drop counts as a failure, so at most three loads are
    made whatever ``backend`` answers. Once verified, ``Backend.keep`` is told (a cache writes
    its copy then).

    ``sink(offset, piece)``: called with each :data:`PIECE` of the chunk right after that piece
    is hashed, while it is still in the CPU cache (read_file writes it to the destination
    there). The digest is only known at the end: a caller must discard what the sink received
    if this raises, and expect a second pass after a re-fetch.

    Raises :class:`ChunkMissing` / :class:`ChunkCorrupt` naming the digest, ``backend``'s
    location of it and ``context`` (e.g. the destination file).
    """
    key = chunk_key(ref.digest)
    algo = ck.split_digest(ref.digest)[0]
    ctx = f" (needed for {context})" if context else ""
    reason = first_reason = ""
    failures = 0
    dropped = False  # a cached copy was dropped: the one free retry is spent
    while failures < 2:
        try:
            blob = backend.load_into(key, bufs.blob, ck.frame_bound(ref.size))
        except ObjectNotFound:
            where = backend.location(key)
            raise ChunkMissing(f"chunk {ref.digest} is missing: not found at {where}{ctx}", ref.digest, where) from None
        except IntegrityError as e:  # too large to be its frame, or not a regular file: never read
            reason = str(e)
            if backend.forget(key) and not dropped:
                dropped = True
                continue
            failures += 1
            first_reason = first_reason or reason
            continue
        if isinstance(blob.obj, bytearray) and blob.obj is not bufs.blob:
            bufs.blob = blob.obj  # the backend needed a larger buffer: keep it
        if len(bufs.data) < ref.size:
            bufs.data = bytearray(ref.size)
        try:
            data = ck.decompress_into(blob, bufs.data, ref.size)
        except ValueError as e:
            reason = f"damaged or truncated ({len(blob)} stored bytes): {e}"
        else:
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
                backend.keep(key, blob)
                if failures:  # the first read was bad, the second good: say so (a flaky disk or network)
                    log.warning("chunk %s at %s: the first read was bad (%s); read again, it verified",
                                ref.digest, backend.location(key), first_reason)
                return blob, data
            reason = f"content does not match its digest (got {got})"
        cache = getattr(backend, "cache", None)
        if backend.forget(key) and not dropped:
            dropped = True
            log.warning("chunk %s: the copy in the cache %s is bad (%s); dropped it, reading %s instead",
                        ref.digest, cache.location(key) if cache is not None else "", reason, backend.location(key))
        else:
            failures += 1
            first_reason = first_reason or reason
    where = backend.location(key)
    raise ChunkCorrupt(f"chunk {ref.digest} at {where} is corrupt: {reason}{ctx}", ref.digest, where, reason)


def read_file(backend: Backend, chunks: list[ChunkRef], dest: Path | str, workers: int, progress: Progress | None = None,
              count: Callable[[int], None] | None = None) -> None:
    """Write the file made of ``chunks`` (loaded from ``backend`` on ``workers`` threads) to
    ``dest``; see :meth:`warmctl.store.Store.read_file` for the guarantees and errors.
    ``count(n)``: called with the stored bytes of each chunk loaded."""
    read_files(backend, [(chunks, dest)], workers, progress, count)


class FileWatch(Protocol):
    """What :func:`read_files` tells a reader of the files it is writing (e.g. an image streamer
    serving them to ``criu restore --stream`` while they arrive). ``index``: the file's position
    in ``files``. Called from the thread running read_files, in order: ``opened`` once the file's
    temporary file exists at its full size (open it there to read: it is renamed later);
    ``written(index, end)`` each time bytes ``[0, end)`` of it are verified and written (zero
    chunks as holes), up to its size; ``failed(error)`` once, if read_files raises."""

    def opened(self, index: int, tmp: Path) -> None: ...

    def written(self, index: int, end: int) -> None: ...

    def failed(self, error: BaseException) -> None: ...


def read_files(backend: Backend, files: list[tuple[list[ChunkRef], Path | str]], workers: int,
               progress: Progress | None = None, count: Callable[[int], None] | None = None,
               watch: FileWatch | None = None) -> None:
    """Write each ``(chunks, dest)`` of ``files`` as :func:`read_file` does, through one pool of
    ``workers`` threads for all of them: the chunks of every file are one ordered stream, so a
    CRIU image of a hundred small files and a few large ones keeps every worker busy across file
    boundaries (one pool per file drained the pipeline at each file and started its threads
    again). Each file goes to a temporary file beside ``dest`` and is renamed once its last
    chunk is written; at most about ``2 * workers`` files are open at once. Free space is checked
    once for the non-zero bytes of all of them. On error no temporary file is left; files
    already renamed stay (the caller's directory is itself temporary, or the files are whole).
    ``watch``: told of each file's progress (:class:`FileWatch`); the files are written in the
    order given, each chunk reported only once it is verified.
    """
    items = [(list(chunks), Path(dest)) for chunks, dest in files]
    for _, dest in items:
        dest.parent.mkdir(parents=True, exist_ok=True)
    needed = 0
    by_dir: dict[Path, int] = {}
    for chunks, dest in items:
        n = sum(c.size for c in chunks if not ck.is_zero_chunk(c.digest, c.size))
        needed += n
        by_dir[dest.parent] = by_dir.get(dest.parent, 0) + n
    for d, n in by_dir.items():
        try:
            free = shutil.disk_usage(d).free
        except OSError:
            continue
        if n > free + sum(dest.stat().st_size for _, dest in items if dest.parent == d and dest.exists()):
            where = items[0][1] if len(items) == 1 else d
            raise disk_full_error(where, n, f"file of {sum(c.size for c in items[0][0]):,} bytes, {n:,} non-zero"
                                  if len(items) == 1 else f"{len(items)} files, {n:,} non-zero bytes")
    # one task per chunk: (file index, chunk index, offset in the file, ref)
    tasks: list[tuple[int, int, ChunkRef]] = []
    for fi, (chunks, _) in enumerate(items):
        off = 0
        for c in chunks:
            tasks.append((fi, off, c))
            off += c.size
    zero = [ck.is_zero_chunk(c.digest, c.size) for _, _, c in tasks]
    nonzero = [i for i, z in enumerate(zero) if not z]
    left = [len(chunks) for chunks, _ in items]  # chunks of each file not yet written
    fds: dict[int, int] = {}
    tmps: dict[int, Path] = {}
    prefetch = backend.properties.prefetch
    suffix = f".warmctl-{os.getpid()}-{threading.get_ident()}.tmp"

    def open_tmp(fi: int) -> None:
        chunks, dest = items[fi]
        tmp = dest.parent / f".{dest.name}{suffix}"
        tmps[fi] = tmp
        fds[fi] = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fds[fi], sum(c.size for c in chunks))
        if watch is not None:
            watch.opened(fi, tmp)

    def finish(fi: int) -> None:
        os.close(fds.pop(fi))
        os.replace(tmps.pop(fi), items[fi][1])

    def work(i: int) -> int:
        fi, base, c = tasks[i]
        if zero[i]:
            return c.size
        fd = fds[fi]

        def write(off: int, view: memoryview) -> None:
            pos = base + off
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n

        blob, _ = load_verified(backend, c, thread_buffers(), str(items[fi][1]), write)
        if count is not None:
            count(len(blob))
        return c.size

    def feed() -> Iterator[int]:
        """Chunk indexes in order, each file opened before its first chunk (files without
        chunks written here); where the backend prefetches (local disk), first hint the
        non-zero chunks up to PREFETCH_AHEAD ahead of the workers so that cold chunk files
        are read asynchronously while earlier chunks are decompressed and verified."""
        hinted = seen = 0
        ti = 0
        for fi, (chunks, _) in enumerate(items):
            open_tmp(fi)
            if not chunks:
                finish(fi)
                continue
            for _ in chunks:
                i = ti
                ti += 1
                if not zero[i]:
                    seen += 1
                    if prefetch:
                        while hinted < len(nonzero) and hinted < seen + PREFETCH_AHEAD:
                            backend.prefetch(chunk_key(tasks[nonzero[hinted]][2].digest))
                            hinted += 1
                yield i

    try:
        for i, n in enumerate(ordered_map(work, feed(), workers)):  # in task order
            fi = tasks[i][0]
            if watch is not None:
                watch.written(fi, tasks[i][1] + n)
            left[fi] -= 1
            if left[fi] == 0:
                finish(fi)
            if progress:
                progress(n)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise disk_full_error(items[0][1] if len(items) == 1 else items[0][1].parent, needed,
                              f"file of {sum(c.size for c in items[0][0]):,} bytes" if len(items) == 1
                              else f"{len(items)} files") from None
    finally:
        for fd in fds.values():
            os.close(fd)
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
