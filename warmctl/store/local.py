"""Local-disk backend: one file per object under a root directory.

An object ``k`` lives at ``ROOT/k``. Saves are containerd-style ingests: the bytes go to a
temporary file under ``ROOT/tmp/``, are fsync'ed, their size is checked, and only then is the
file renamed into place, so a reader never sees a partial object. The directory is fsync'ed
after the rename (and after a removal), and so is the parent of every directory created, as
restic's local backend does: without it a power loss can lose a committed object's name while
a later object that references it survives. Each call returns only once its change is durable,
so the store's write order (chunks, manifest, signatures, catalog entry) holds on disk too.
A full disk removes the temporary file and raises :class:`warmctl.base.errors.HostError` naming the
bytes needed.

Fault injection for tests (:data:`FAULT_ENV`): ``WARMCTL_FAULT_KILL_AT_WRITE=N`` makes the
process SIGKILL itself at the N-th write point of this backend (counting, in order, "temporary
file written, not yet renamed", "renamed and durable" for each save and "removed" for each
removal), so a test can crash a real writer anywhere (tests/test_store_crash.py);
``WARMCTL_FAULT_STOP_AT_WRITE=N`` stops it there instead (SIGSTOP), to pause a writer past its
lock's lifetime.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import logging
import shutil
import signal
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from warmctl.base.errors import HostError, IntegrityError, WarmctlError
from warmctl.store.backend import Backend, BackendProperties, ObjectInfo, ObjectNotFound, too_large

log = logging.getLogger(__name__)

TMP_DIR = "tmp"
#: load_into maps objects at least this large instead of reading them.
MMAP_MIN = 256 * 1024


def disk_full_error(path: Path | str, needed: int, what: str = "") -> HostError:
    """A :class:`HostError` saying the disk holding ``path`` is full and ``needed`` bytes were needed."""
    try:
        free = shutil.disk_usage(_existing_parent(Path(path))).free
        free_s = f"{free:,} bytes free"
    except OSError:
        free_s = "free space unknown"
    extra = f" ({what})" if what else ""
    return HostError(f"disk full writing {path}: needed {needed:,} bytes{extra}, {free_s}; free space and retry")


#: See the module docstring: the write point at which the process kills itself (tests only).
FAULT_ENV = "WARMCTL_FAULT_KILL_AT_WRITE"
#: Likewise, the write point at which the process stops itself (SIGSTOP; a test resumes it).
FAULT_STOP_ENV = "WARMCTL_FAULT_STOP_AT_WRITE"
_fault_at = {signal.SIGKILL: int(os.environ.get(FAULT_ENV) or 0), signal.SIGSTOP: int(os.environ.get(FAULT_STOP_ENV) or 0)}
_fault_count = itertools.count(1)


def _fault_point() -> None:
    if any(_fault_at.values()):
        n = next(_fault_count)
        for sig, at in _fault_at.items():
            if n == at:
                os.kill(os.getpid(), sig)


def fsync_dir(path: Path | str) -> None:
    """Make ``path``'s entries (a rename, creation or removal inside it) durable: fsync the
    directory itself. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _existing_parent(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a file of type {stat.S_IFMT(mode):o}"


#: Directories below the root are opened with these flags: a symbolic link is never followed.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Objects are opened with these: no link followed, and a FIFO or device opened without blocking
#: (then refused by its type) instead of waiting forever for a writer.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LocalBackend(Backend):
    """Objects as files under ``root`` (created on first save). ``fsync``: sync each object.

    The root is a wall: every path below it is walked one component at a time with
    directory file descriptors (``openat`` with ``O_NOFOLLOW``), so no symbolic link inside the
    store is ever followed, for reads, writes, listings and removals alike; only regular files
    are read or removed as objects (a FIFO, device, socket, directory or link where an object or
    a directory should be raises :class:`~warmctl.base.errors.IntegrityError` naming its path, never
    blocks), and listings skip anything else with a warning. The root itself may be a link
    (it is the operator's path).
    """

    properties = BackendProperties(local=True, prefetch=True, workers=4)

    def __init__(self, root: Path | str, fsync: bool = True):
        self.root = Path(root).absolute()
        self.fsync = fsync

    def __repr__(self) -> str:
        return f"LocalBackend({str(self.root)!r})"

    def _parts(self, key: str) -> list[str]:
        parts = key.split("/") if key else []
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in key:
            raise ValueError(f"bad object key {key!r}")
        return parts

    def _path(self, key: str) -> Path:
        self._parts(key)
        return self.root / key

    def location(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def _unsafe(self, rel: str, mode: int, want: str) -> IntegrityError:
        return IntegrityError(
            f"{self.root / rel} is {_kind(mode)}, not {want}: a store holds only regular files in plain "
            "directories, and warmctl follows no link and reads no special file inside it; refusing it "
            "(someone who can write the store put it there: remove it)")

    def _walk(self, parts: list[str] | tuple[str, ...], create: bool = False,
              made: set[tuple[str, ...]] | None = None) -> int:
        """A descriptor of the directory ``root/parts...``, each component opened relative to
        its parent without following links (``create``: missing ones are made, each new
        directory's entry made durable in its parent; or, given ``made``, not synced here and
        the parts of each one's parent added to ``made``, for one sync per directory later).
        Raises FileNotFoundError (a component is missing), :class:`IntegrityError` (a component
        is a link or not a directory)."""
        if create:
            self._mkdirs(self.root)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, p in enumerate(parts):
                try:
                    nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(p, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass  # made by another thread or process: synced below all the same
                    if made is not None:
                        made.add(tuple(parts[:i]))
                    elif self.fsync:
                        os.fsync(fd)
                    nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise self._unsafe("/".join(parts[: i + 1]), os.stat(p, dir_fd=fd, follow_symlinks=False).st_mode,
                                       "a directory") from None
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _mkdirs(self, d: Path) -> None:
        """Create ``d`` (the root) and its missing parents; with ``fsync``, each new directory's
        entry is made durable (its parent fsync'ed) before anything is renamed into it."""
        if d.is_dir():
            return
        missing = []
        p = d
        while not p.is_dir() and p != p.parent:
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            try:
                os.mkdir(m)
            except FileExistsError:
                pass  # made by another thread or process: synced below all the same
            if self.fsync:
                fsync_dir(m.parent)

    def _write_tmp(self, data: bytes | memoryview, sync: bool) -> tuple[int, str]:
        """Write ``data`` to a new temporary file under ``ROOT/tmp/`` (fsync'ed when ``sync``)
        and check its size; returns (a descriptor of ``tmp/``, the file's name there), for the
        caller to rename or unlink the file and close the descriptor. The one write path of
        :meth:`save` and :meth:`SaveBatch.save`. On any error the file is removed, the
        descriptor closed, and the OSError raised as it came (ENOSPC included: callers name
        the bytes)."""
        tmp = f"{uuid.uuid4().hex}.tmp"
        tmpdir = self._walk([TMP_DIR], create=True)
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=tmpdir)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if sync:
                os.fsync(fd)
            size = os.fstat(fd).st_size
            if size != len(data):  # commit only what is complete
                raise OSError(errno.EIO, f"wrote {size} of {len(data)} bytes")
            return tmpdir, tmp
        except BaseException:
            if fd >= 0:
                os.close(fd)
                fd = -1
            try:
                os.unlink(tmp, dir_fd=tmpdir)
            except FileNotFoundError:
                pass
            os.close(tmpdir)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def save(self, key: str, data: bytes | memoryview) -> None:
        parts = self._parts(key)
        dest = self.root / key
        tmp = ""
        tmpdir = parent = -1
        try:
            tmpdir, tmp = self._write_tmp(data, self.fsync)
            parent = self._walk(parts[:-1], create=True)
            _fault_point()
            # rename replaces a link at the destination itself, never what it points at
            try:
                os.replace(tmp, parts[-1], src_dir_fd=tmpdir, dst_dir_fd=parent)
            except OSError as e:
                if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
                raise self._unsafe(key, stat.S_IFDIR, "a regular file") from None
            tmp = ""
            if self.fsync:
                os.fsync(parent)
            _fault_point()
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(dest, len(data), f"object {key}") from None
            raise
        finally:
            if tmp and tmpdir >= 0:
                try:
                    os.unlink(tmp, dir_fd=tmpdir)
                except FileNotFoundError:
                    pass
            for x in (tmpdir, parent):
                if x >= 0:
                    os.close(x)

    def batch(self, workers: int = 8) -> "SaveBatch":
        """A :class:`SaveBatch` of this backend: saves whose fsyncs are paid once per batch."""
        return SaveBatch(self, workers)

    def _lstat_in(self, key: str) -> tuple[int, str, os.stat_result]:
        """(descriptor of the key's directory, file name, its lstat) of a regular file; the
        caller closes the descriptor. Raises :class:`ObjectNotFound`, :class:`IntegrityError`."""
        parts = self._parts(key)
        try:
            d = self._walk(parts[:-1])
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key, str(self.root / key)) from None
        try:
            st = os.stat(parts[-1], dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            os.close(d)
            raise ObjectNotFound(key, str(self.root / key)) from None
        if not stat.S_ISREG(st.st_mode):
            os.close(d)
            raise self._unsafe(key, st.st_mode, "a regular file")
        return d, parts[-1], st

    def _open(self, key: str) -> int:
        """A read-only descriptor of ``key``'s regular file (no link followed, never blocking).
        Raises :class:`ObjectNotFound`, :class:`IntegrityError` (not a regular file)."""
        d, name, _ = self._lstat_in(key)
        try:
            try:
                fd = os.open(name, _FILE_FLAGS, dir_fd=d)
            except FileNotFoundError:
                raise ObjectNotFound(key, str(self.root / key)) from None
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise self._unsafe(key, stat.S_IFLNK, "a regular file") from None
        finally:
            os.close(d)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the lstat and the open
            os.close(fd)
            raise self._unsafe(key, st.st_mode, "a regular file")
        return fd

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        fd = self._open(key)
        try:
            if length is None:
                length = max(0, os.fstat(fd).st_size - offset)
            data = os.pread(fd, length, offset)  # one syscall, no extra copy in the common case
            if len(data) == length or not data:
                return data
            out = bytearray(data)
            while len(out) < length:
                b = os.pread(fd, length - len(out), offset + len(out))
                if not b:
                    break
                out += b
            return bytes(out)
        finally:
            os.close(fd)

    def load_into(self, key: str, buf: bytearray, limit: int | None = None) -> memoryview:
        """A read-only memory map of the object (objects of at least :data:`MMAP_MIN` bytes),
        else its bytes read into ``buf``. Mapping skips the copy out of the page cache: load
        plus decompress of a 4 MiB chunk measured ~2.3x less CPU than ``preadv`` into a
        buffer. Safe because objects are immutable (replaced only by rename, never rewritten
        or truncated in place); the mapping goes when the last view of it is dropped.
        ``limit``: an object larger than this many bytes raises :class:`IntegrityError`
        unread."""
        fd = self._open(key)
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise too_large(self.location(key), size, limit, "object")
            if size >= MMAP_MIN:
                try:
                    return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
                except (OSError, ValueError):
                    pass  # not mappable (some network file systems): read it
            if size > len(buf):
                buf = bytearray(size)
            view = memoryview(buf)[:size]
            got = 0
            while got < size:  # preadv fills the caller's buffer: no allocation
                n = os.preadv(fd, [view[got:]], got)
                if not n:
                    break  # shrank underneath us: the short view fails verification
                got += n
            return view[:got]
        finally:
            os.close(fd)

    def prefetch(self, key: str) -> None:
        try:
            fd = self._open(key)
        except (WarmctlError, OSError, ValueError):
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)  # asynchronous readahead
        except (AttributeError, OSError):
            pass
        finally:
            os.close(fd)

    def stat(self, key: str) -> ObjectInfo:
        d, _, st = self._lstat_in(key)
        os.close(d)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def _scan(self, fd: int, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        """Regular files under the directory ``fd`` (``rel`` below the root) whose keys start
        with ``prefix``; subdirectories entered without following links; anything else is
        skipped with a warning naming it."""
        with os.scandir(fd) as it:
            yield from self._entries(it, fd, rel, prefix)

    def _entries(self, it: Iterator[os.DirEntry], fd: int, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        for e in it:
            key = f"{rel}/{e.name}" if rel else e.name
            if not rel and e.name == TMP_DIR:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                    try:
                        sub = os.open(e.name, _DIR_FLAGS, dir_fd=fd)
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    except OSError as err:
                        if err.errno != errno.ELOOP:
                            raise
                        continue  # swapped for a link meanwhile: not entered
                    try:
                        yield from self._scan(sub, key, prefix)
                    finally:
                        os.close(sub)
            elif key.startswith(prefix):
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(key, st.st_size, st.st_mtime)
                else:
                    log.warning("store %s: ignoring %s, %s (a store holds only regular files; remove it)",
                                self.root, self.root / key, _kind(st.st_mode))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every regular file whose key starts with ``prefix``, streamed (a directory's names
        are read at once, its files yielded as they are stat'ed). A link or non-directory
        where a directory of ``prefix`` should be raises :class:`IntegrityError`."""
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        try:
            fd = self._walk(base.split("/") if base else [])
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            yield from self._scan(fd, base, prefix)
        finally:
            os.close(fd)

    def remove(self, key: str) -> None:
        """Delete ``key`` (absent: nothing to do); durable on return (the directory is fsync'ed),
        so a removal gc made first (a manifest) cannot come back after a later one (its chunks).
        Only a regular file is removed: anything else raises :class:`IntegrityError`."""
        try:
            d, name, _ = self._lstat_in(key)
        except ObjectNotFound:
            return
        try:
            try:
                os.unlink(name, dir_fd=d)
            except FileNotFoundError:
                return
            if self.fsync:
                os.fsync(d)
        finally:
            os.close(d)
        _fault_point()

    def list_tmp(self) -> Iterator[ObjectInfo]:
        """Temporary ingest files (left by a killed writer); gc removes old ones (regular files
        only: anything else in ``tmp/`` is skipped with a warning)."""
        try:
            fd = self._walk([TMP_DIR])
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            with os.scandir(fd) as it:
                entries = list(it)
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(f"{TMP_DIR}/{e.name}", st.st_size, st.st_mtime)
                else:
                    log.warning("store %s: ignoring %s in its tmp/, %s", self.root, e.name, _kind(st.st_mode))
        finally:
            os.close(fd)


class SaveBatch:
    """Saves into a :class:`LocalBackend` made durable together: each :meth:`save` writes its
    object to a temporary file under ``ROOT/tmp/`` and nothing else (no fsync, not yet visible
    under its key); :meth:`commit` then fsyncs every temporary file (on ``workers`` threads, so
    the file system folds them into a few journal commits), creates the missing directories
    (their parents fsync'ed once each), renames every object into place and fsyncs each
    directory renamed into once. An object is visible only once its bytes are durable, as with
    :meth:`LocalBackend.save`; a crash before or during the commit leaves temporary files
    (removed by gc, :meth:`LocalBackend.list_tmp`) and at worst some objects renamed, each whole.

    Why: a fresh node's ``up`` fills its local store with every chunk it fetches; one fsync of
    the object and one of its directory per chunk (plus one per new ``chunks/xx/``) measured
    4-6 s of a 9 s materialize of ``tiny`` (1,130 fsyncs) while the image was being written
    beside them, against about 0.3 s as one batch (docs/benchmarks.md, "up on a fleet node").
    ``pull`` (:func:`~warmctl.store.copy.copy_manifest`) commits its batches by count and age
    (:meth:`age`), so that a killed pull keeps all but the last second or so of its fetching.
    Without ``fsync`` on the backend the commit only renames. Thread-safe; memory: a name per
    object. A key saved twice in one batch is written once.
    """

    def __init__(self, backend: LocalBackend, workers: int = 8):
        self.backend = backend
        self.workers = max(1, workers)
        self._mu = threading.Lock()
        self._pending: dict[str, str] = {}  # key -> temporary file name under tmp/
        self._first: float | None = None  # time.monotonic() of the first save now pending

    def __len__(self) -> int:
        return len(self._pending)

    def age(self) -> float:
        """Seconds since the first save not yet committed (0.0 when nothing is pending): a
        caller that commits once this passes a bound keeps what a crash can lose to about that
        long's worth of saves (:func:`warmctl.store.copy.copy_manifest`)."""
        with self._mu:
            first = self._first
        return 0.0 if first is None else time.monotonic() - first

    def __contains__(self, key: str) -> bool:
        return key in self._pending

    def save(self, key: str, data: bytes | memoryview) -> None:
        """Write ``data`` for ``key`` to a temporary file (visible under ``key`` only after
        :meth:`commit`). Raises HostError on a full disk (nothing left behind)."""
        b = self.backend
        b._parts(key)
        with self._mu:
            if key in self._pending:
                return
        tmp = ""
        tmpdir = -1
        try:
            tmpdir, tmp = b._write_tmp(data, sync=False)
            _fault_point()
            with self._mu:
                if key not in self._pending:
                    self._pending[key] = tmp
                    if self._first is None:
                        self._first = time.monotonic()
                    tmp = ""
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(b.root / key, len(data), f"object {key}") from None
            raise
        finally:
            if tmp and tmpdir >= 0:
                try:
                    os.unlink(tmp, dir_fd=tmpdir)
                except FileNotFoundError:
                    pass
            if tmpdir >= 0:
                os.close(tmpdir)

    def commit(self) -> int:
        """Make every saved object durable and visible under its key (see the class doc);
        returns how many. Raises OSError (the objects not yet renamed stay temporary files)."""
        from concurrent.futures import ThreadPoolExecutor

        b = self.backend
        with self._mu:
            pending, self._pending, self._first = self._pending, {}, None
        if not pending:
            return 0
        tmpdir = b._walk([TMP_DIR], create=True)
        try:
            if b.fsync:
                def sync(name: str) -> None:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tmpdir)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)

                with ThreadPoolExecutor(min(self.workers, len(pending)), thread_name_prefix="warmctl-sync") as ex:
                    list(ex.map(sync, pending.values()))
            dirs: dict[tuple[str, ...], int] = {}
            try:
                made: set[tuple[str, ...]] = set()  # parents of directories created here
                for key in pending:
                    parts = tuple(b._parts(key)[:-1])
                    if parts not in dirs:
                        dirs[parts] = self._dir(parts, made)
                if b.fsync:
                    for parent in sorted(made, key=len, reverse=True):  # deepest first: an entry before its parent's
                        fd = b._walk(list(parent))
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                for key, tmp in pending.items():
                    parts = b._parts(key)
                    try:
                        os.replace(tmp, parts[-1], src_dir_fd=tmpdir, dst_dir_fd=dirs[tuple(parts[:-1])])
                    except OSError as e:
                        if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                            raise
                        raise b._unsafe(key, stat.S_IFDIR, "a regular file") from None
                if b.fsync:
                    with ThreadPoolExecutor(min(self.workers, len(dirs)), thread_name_prefix="warmctl-sync") as ex:
                        list(ex.map(os.fsync, dirs.values()))
                for _ in pending:
                    _fault_point()
            finally:
                for fd in dirs.values():
                    os.close(fd)
        finally:
            os.close(tmpdir)
        return len(pending)

    def _dir(self, parts: tuple[str, ...], made: set[tuple[str, ...]]) -> int:
        """A descriptor of ``root/parts`` (no link followed), creating missing components
        without syncing; the parent of each one created is added to ``made``."""
        return self.backend._walk(parts, create=True, made=made)

    def abort(self) -> None:
        """Remove every temporary file not committed (nothing becomes visible)."""
        with self._mu:
            pending, self._pending, self._first = self._pending, {}, None
        if not pending:
            return
        try:
            tmpdir = self.backend._walk([TMP_DIR])
        except (FileNotFoundError, IntegrityError):
            return
        try:
            for tmp in pending.values():
                try:
                    os.unlink(tmp, dir_fd=tmpdir)
                except FileNotFoundError:
                    pass
        finally:
            os.close(tmpdir)
