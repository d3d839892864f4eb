"""Verified CRIU images kept between ``up``\\ s of one snapshot (issue 12).

Without this, every ``up`` rewrote the whole CRIU image (2.7 GiB for ``tiny``) from the store
into a run directory, restored from it and deleted it: seconds of copying and hashing per
``up``, and a freshly written image whose dirty pages the kernel writes back while CRIU reads
them. A snapshot's image is fixed by its manifest digest, so it only needs writing once per
host.

Layout (``<home>/cache/images``, created mode 0700, owned by the user running warmctl: root)::

    <root>/<algorithm>-<hex>/      one entry per manifest digest (``sha256:ab..`` -> ``sha256-ab..``)
        images/                    the manifest's ``image`` files (CRIU's image directory)
        weights/                   its ``weights`` files (loaded into the engine after restore)
        shm/                       its ``/dev/shm`` files, copied to /dev/shm at every restore
        verified.json              written last: digest, and (size, mtime_ns, inode) per file
    <root>/.partial-*              an entry being written (removed on failure, swept after 1 h)

An entry is *verified once, when written*: every chunk is checked against its digest by
:meth:`warmctl.store.Store.read_file` on the way in, the files are made read-only, the marker
written, and the directory renamed into place (so a crash never leaves an entry that looks
complete). On reuse the entry is trusted only if its marker names the same digest, every file
still has the size, mtime and inode recorded at write time, and neither the root nor the entry
is writable by anyone but its owner (then nobody but root changed it, and not through a normal
write); anything else removes the entry and the image is written again.

``/dev/shm`` files are put back for every ``up`` (the restored tree changes them), but from a
verified copy in the entry (``shm/``), copied region by region so their holes stay holes
(:meth:`ImageCache.put_back_shm`: 400 MiB with 80 MiB of data for ``tiny`` in ~80 ms, where
decompressing and verifying them from the store took 200-500 ms). Bundled files are written
back from the store when missing or changed, as before.

The cache keeps the :data:`DEFAULT_KEEP` most recently used entries (``up`` prunes after
writing one); ``warmctl store gc`` removes entries whose manifest the local store no longer
holds, and ``warmctl store du`` reports the space it takes.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from warmctl.errors import HostError
from warmctl.manifest import Manifest
from warmctl.proc import pid_alive

#: Entries kept after a new one is written (most recently used first).
DEFAULT_KEEP = 2
#: Version of ``verified.json``.
MARKER_FORMAT = 1
MARKER = "verified.json"
#: A ``.partial-*`` directory older than this is left over from a crash and is removed.
PARTIAL_STALE_S = 3600.0
#: Roles kept in an entry, and the subdirectory each goes to.
CACHED_ROLES = {"image": "images", "weights": "weights", "shm": "shm"}


def entry_name(digest: str) -> str:
    """Directory name of the entry for manifest ``digest`` (``sha256:<hex>`` -> ``sha256-<hex>``).
    Raises :class:`ValueError` for a digest that is not ``<algorithm>:<hex>``."""
    alg, _, hexpart = digest.partition(":")
    if not alg.isalnum() or not hexpart or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a manifest digest: {digest!r}")
    return f"{alg}-{hexpart}"


@dataclass
class CachedImage:
    """A usable entry: ``images`` is CRIU's image directory, ``weights`` the weights directory
    (may not exist when the snapshot has no weights files). ``written``: True if this call
    wrote it (False: reused)."""

    digest: str
    path: Path
    written: bool

    @property
    def images(self) -> Path:
        return self.path / "images"

    @property
    def weights(self) -> Path:
        return self.path / "weights"


@dataclass
class CacheEntry:
    """One entry as listed by :meth:`ImageCache.entries`: ``bytes`` on disk (allocated blocks,
    so holes count as nothing), ``last_used`` (Unix seconds), ``valid`` (marker readable)."""

    digest: str
    path: Path
    bytes: int
    last_used: float
    valid: bool


def _cached_files(m: Manifest) -> list:
    return [f for f in m.files if f.role in CACHED_ROLES]


def _rel(f) -> str:
    sub = CACHED_ROLES[f.role]
    # weights entries are stored under their base name (warmctl.engine.sleep loads by rank file)
    return f"{sub}/{Path(f.path).name}" if f.role == "weights" else f"{sub}/{f.path}"


def _owner_only(path: Path) -> str | None:
    """None if ``path`` is a directory owned by us and writable by nobody else; else why not."""
    try:
        st = path.lstat()
    except OSError as e:
        return f"{path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class ImageCache:
    """The image cache under ``root`` (see module doc). ``keep``: entries kept by
    :meth:`prune` (0 disables the cache: :meth:`get` then writes a throwaway entry that
    :meth:`release` removes)."""

    def __init__(self, root: Path, keep: int = DEFAULT_KEEP):
        self.root = Path(root)
        self.keep = keep

    @classmethod
    def for_settings(cls, settings) -> "ImageCache":
        """The cache of a :class:`warmctl.config.Settings`: ``<home>/cache/images``."""
        return cls(Path(settings.home) / "cache" / "images")

    # -- reading -------------------------------------------------------------------------

    def _ensure_root(self) -> None:
        """Create the root 0700; raise :class:`HostError` if it exists with looser rights or
        another owner (a cache others can write would let them change what root restores)."""
        if not self.root.exists():
            self.root.mkdir(parents=True, mode=0o700)
            os.chmod(self.root, 0o700)
        problem = _owner_only(self.root)
        if problem:
            raise HostError(f"image cache {self.root} is unsafe: {problem}; remove it or fix its owner and mode (0700)")

    def lookup(self, m: Manifest, digest: str) -> CachedImage | None:
        """The verified entry of ``digest`` if it is intact (see module doc); an entry that is
        not is removed and None returned. Marks the entry used (its marker's mtime)."""
        path = self.root / entry_name(digest)
        if not path.exists() or _owner_only(self.root):
            return None
        why = self._invalid(path, m, digest)
        if why:
            shutil.rmtree(path, ignore_errors=True)
            return None
        os.utime(path / MARKER)
        return CachedImage(digest, path, written=False)

    def _invalid(self, path: Path, m: Manifest, digest: str) -> str | None:
        problem = _owner_only(path)
        if problem:
            return problem
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError) as e:
            return f"marker unreadable: {e}"
        if marker.get("format") != MARKER_FORMAT or marker.get("manifest") != digest:
            return "marker names another manifest or format"
        files: dict = marker.get("files", {})
        if set(files) != {_rel(f) for f in _cached_files(m)}:
            return "entry's file list differs from the manifest"
        for rel, rec in files.items():
            try:
                st = (path / rel).stat()
            except OSError:
                return f"{rel} missing"
            if [st.st_size, st.st_mtime_ns, st.st_ino] != rec:
                return f"{rel} changed since it was verified"
        return None

    # -- writing -------------------------------------------------------------------------

    def get(self, store, m: Manifest, digest: str, progress: Callable[[int], None] | None = None,
            cache=None, fetched=None) -> CachedImage:
        """The entry of ``digest``: reused if intact, else written from ``store`` (every chunk
        verified; ``cache``: the local store that keeps chunks read from a remote ``store``;
        ``fetched``: counts the stored bytes loaded from each, as in ``read_file``).
        ``progress(n)``: bytes written (or, for a reused entry, skipped) since the last call.

        The caller holds the host's CRIU lock (two writers of one entry never race). Raises
        :class:`IntegrityError` on a bad chunk and :class:`HostError` when the cache root is
        unsafe; either way no partial entry is left.
        """
        self._ensure_root()
        hit = self.lookup(m, digest)
        if hit is not None:
            if progress:
                progress(sum(f.size for f in _cached_files(m) if f.hardlink_to is None))
            return hit
        self._sweep_partials()
        tmp = self.root / f".partial-{entry_name(digest)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        try:
            for sub in set(CACHED_ROLES.values()):
                (tmp / sub).mkdir(mode=0o700)
            whole = [f for f in _cached_files(m) if f.hardlink_to is None]
            # every file's chunks through one pool: no drain between the image's hundred files
            store.read_files([(f.chunks, tmp / _rel(f)) for f in whole], progress=progress, cache=cache, fetched=fetched)
            for f in whole:
                os.chmod(tmp / _rel(f), f.mode & 0o555)  # read-only: CRIU and the weights loader only read
            for f in _cached_files(m):
                if f.hardlink_to is not None:
                    dest = tmp / _rel(f)
                    os.link(dest.parent / f.hardlink_to, dest)
            files = {}
            for f in _cached_files(m):
                st = (tmp / _rel(f)).stat()
                files[_rel(f)] = [st.st_size, st.st_mtime_ns, st.st_ino]
            marker = tmp / MARKER
            marker.write_text(json.dumps({"format": MARKER_FORMAT, "manifest": digest, "files": files,
                                          "verified_at": time.time()}))
            final = self.root / entry_name(digest)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune(protect={digest})
        return CachedImage(digest, final, written=True)

    def put_back_shm(self, img: CachedImage, m: Manifest, shm_dir: Path = Path("/dev/shm")) -> list[Path]:
        """Copy the snapshot's ``/dev/shm`` files from ``img`` into ``shm_dir`` (data regions
        only: holes stay holes; ``hardlink_to`` entries as hard links, as CRIU's link_remap
        files must be). Returns the paths written. Raises :class:`HostError` if one exists
        already (another restore of this snapshot is running); on any failure the files
        written so far are removed."""
        written: list[Path] = []
        try:
            for f in sorted((f for f in m.files if f.role == "shm"), key=lambda f: f.hardlink_to is not None):
                dest = shm_dir / f.path
                if f.hardlink_to is not None:
                    os.link(shm_dir / f.hardlink_to, dest)
                else:
                    _sparse_copy(img.path / _rel(f), dest, f.mode)
                written.append(dest)
        except FileExistsError as e:
            for p in written:
                p.unlink(missing_ok=True)
            raise HostError(f"{e.filename} exists already: another restore of this snapshot is running on this "
                            "host; `warmctl down` it first") from None
        except BaseException:
            for p in written:
                p.unlink(missing_ok=True)
            raise
        return written

    def release(self, img: CachedImage) -> None:
        """Done restoring from ``img``: with ``keep == 0`` the entry is removed."""
        if self.keep <= 0:
            shutil.rmtree(img.path, ignore_errors=True)

    # -- housekeeping --------------------------------------------------------------------

    def _sweep_partials(self) -> None:
        now = time.time()
        for p in self.root.glob(".partial-*"):
            try:
                if now - p.stat().st_mtime > PARTIAL_STALE_S or not pid_alive(int(p.name.rsplit("-", 1)[1])):
                    shutil.rmtree(p, ignore_errors=True)
            except (OSError, ValueError):
                continue

    def entries(self) -> list[CacheEntry]:
        """Every entry, most recently used first."""
        out = []
        if not self.root.is_dir():
            return out
        for p in self.root.iterdir():
            if p.name.startswith(".") or not p.is_dir():
                continue
            alg, _, hexpart = p.name.partition("-")
            marker = p / MARKER
            try:
                used, valid = marker.stat().st_mtime, True
            except OSError:
                used, valid = p.stat().st_mtime, False
            out.append(CacheEntry(f"{alg}:{hexpart}", p, _disk_bytes(p), used, valid))
        out.sort(key=lambda e: e.last_used, reverse=True)
        return out

    def prune(self, keep_digests: Iterable[str] | None = None, protect: Iterable[str] = (),
              unused_for: float = 0.0, dry_run: bool = False) -> list[CacheEntry]:
        """Remove entries: those beyond the :attr:`keep` most recently used, those without a
        readable marker, and (when ``keep_digests`` is given: ``store gc``) those whose digest
        is not in it and that were not used for ``unused_for`` seconds (an ``up`` from a
        remote catalog keeps no manifest in the local store); never those in ``protect``.
        Returns what was (or, with ``dry_run``, would be) removed."""
        keep_set = None if keep_digests is None else set(keep_digests)
        protect = set(protect)
        removed = []
        kept = 0
        now = time.time()
        for e in self.entries():
            if e.digest in protect:
                kept += 1
                continue
            orphan = keep_set is not None and e.digest not in keep_set and now - e.last_used >= unused_for
            if orphan or kept >= self.keep or not e.valid:
                if not dry_run:
                    shutil.rmtree(e.path, ignore_errors=True)
                removed.append(e)
            else:
                kept += 1
        return removed

    def du(self) -> int:
        """Bytes the cache takes on disk (allocated blocks)."""
        return sum(e.bytes for e in self.entries())


def _sparse_copy(src: Path, dest: Path, mode: int) -> None:
    """Copy ``src`` to a new file ``dest`` (``O_EXCL``), only its data regions
    (``SEEK_DATA``/``SEEK_HOLE``, ``sendfile``); the rest stays a hole of the same size."""
    fi = os.open(src, os.O_RDONLY)
    created = False
    try:
        fo = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & 0o777)
        created = True
        try:
            size = os.fstat(fi).st_size
            os.ftruncate(fo, size)
            off = 0
            while off < size:
                try:
                    data = os.lseek(fi, off, os.SEEK_DATA)
                except OSError:  # ENXIO: only a hole is left
                    break
                end = os.lseek(fi, data, os.SEEK_HOLE)
                os.lseek(fo, data, os.SEEK_SET)
                pos = data
                while pos < end:
                    n = os.sendfile(fo, fi, pos, end - pos)
                    if n == 0:
                        raise OSError(f"{src} shrank while being copied")
                    pos += n
                off = end
            os.fchmod(fo, mode & 0o777)
        finally:
            os.close(fo)
    except BaseException:
        if created:  # never a file that was there before
            dest.unlink(missing_ok=True)
        raise
    finally:
        os.close(fi)


def _disk_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                continue
    return total
