"""What a process tree needs from the file system besides its CRIU image.

CRIU stores memory and file *references*, not the contents of files the processes map or keep
open. A restore therefore needs:

- ``/dev/shm`` files (vLLM's shared-memory ring buffers ``psm_*``, multiprocessing semaphores
  ``sem.*``, and the ``link_remap.*`` hard links CRIU makes at dump time for unlinked ones):
  CRIU records them by size only, so their contents travel with the snapshot (role ``shm``).
- *bundled files*: regular files the tree maps or holds open outside the interpreter's and the
  operating system's own directories, e.g. torch.compile's kernels
  (``~/.cache/vllm/torch_compile_cache/.../*.so``): they travel with the snapshot (role
  ``file``) and are written back if missing or different.
- *required files*: mapped files under the interpreter prefix and system directories (the
  venv's ``.so`` files, libc...). CRIU checks only their sizes at restore; warmctl records
  (path, size) and each file's content digest (:mod:`warmctl.checkpoint.filedigest`) and checks
  both first, to fail with a clear message naming each file instead of CRIU's, or instead of
  restoring onto a library rewritten with other bytes of the same size.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from warmctl.base.proc import tree_pids

SHM = Path("/dev/shm")
#: Paths under these prefixes are required (checked), not bundled.
SYSTEM_PREFIXES = ("/usr/", "/lib/", "/lib64/", "/bin/", "/sbin/", "/etc/", "/proc/", "/sys/", "/dev/")


def _paths_of(pid: int) -> set[str]:
    paths: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    paths.add(parts[5].rstrip("\n"))
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/"):
                paths.add(target)
    except OSError:
        pass
    return paths


@dataclass
class TreeFiles:
    """Files a tree references, classified (see module docstring). Paths are absolute."""

    shm: list[Path] = field(default_factory=list)
    bundled: list[Path] = field(default_factory=list)
    required: dict[str, int] = field(default_factory=dict)  # path -> size in bytes


def referenced_files(root_pid: int, exclude: Sequence[Path] = ()) -> TreeFiles:
    """Classify every file the tree of ``root_pid`` maps or has open.

    ``exclude``: paths (files or directories) never bundled (e.g. the engine's own log, which
    restore recreates). Deleted files (``... (deleted)``) are skipped: CRIU saves those itself.
    """
    prefixes = {str(Path(p).resolve()) + "/" for p in {sys.prefix, sys.base_prefix}}
    excl = [str(Path(p)) for p in exclude]
    out = TreeFiles()
    seen: set[str] = set()
    for pid in tree_pids(root_pid):
        seen |= _paths_of(pid)
    for p in sorted(seen):
        if p.endswith(" (deleted)") or any(p == e or p.startswith(e + "/") for e in excl):
            continue
        path = Path(p)
        if p.startswith(str(SHM) + "/"):
            if path.is_file():
                out.shm.append(path)
            continue
        if not path.is_file():
            continue
        if p.startswith(SYSTEM_PREFIXES) or any(p.startswith(x) for x in prefixes):
            out.required[p] = path.stat().st_size
        else:
            out.bundled.append(path)
    return out


def shm_inodes_of(root_pid: int) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every ``/dev/shm`` file the tree of ``root_pid`` maps or has open,
    deleted names included (``/proc/PID/map_files`` and ``/proc/PID/fd``; root only).

    glibc's ``sem_open`` maps a semaphore under a temporary name it then removes, so the tree
    never names ``sem.mp-*`` itself; the inode is what ties that file to the tree, and
    :func:`remove_by_inode` then finds every name it has.
    """
    return {key for pid in tree_pids(root_pid) for key, _ in _shm_links(pid)}


def shm_names() -> set[str]:
    """Names now in ``/dev/shm``."""
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def link_remaps_since(before: set[str]) -> list[Path]:
    """``link_remap.*`` files CRIU created in ``/dev/shm`` since ``before`` was taken."""
    return sorted(SHM / n for n in shm_names() - before if n.startswith("link_remap."))


#: Only multiprocessing's named semaphores are swept as orphans (the one leak observed: a killed
#: vLLM tree leaves ``sem.mp-*`` files that none of its processes maps).
ORPHAN_PATTERN = "sem.mp-*"
#: A file younger than this may belong to an engine that is starting right now (its spawned
#: children open the semaphore by name a moment later), so it is never swept.
ORPHAN_MIN_AGE_S = 60.0


def orphaned_shm(since: float) -> list[Path]:
    """Semaphore files in ``/dev/shm`` created at or after ``since`` (Unix seconds, ctime),
    at least :data:`ORPHAN_MIN_AGE_S` old, that no live process maps or holds open: what a
    killed engine tree left behind. Files of the tree that are known by path (ring buffers,
    restored files) are removed by the caller directly.
    """
    now = time.time()
    try:
        candidates = [p for p in SHM.glob(ORPHAN_PATTERN)
                      if p.is_file() and since <= p.stat().st_ctime <= now - ORPHAN_MIN_AGE_S]
    except OSError:
        return []
    if not candidates:
        return []
    in_use: set[str] = set()
    for pid in psutil.pids():
        in_use |= {x for x in _paths_of(pid) if x.startswith("/dev/shm/")}
    return [p for p in candidates if str(p) not in in_use]


def bound_unix_sockets() -> set[str]:
    """Paths of the Unix sockets bound now in this network namespace (``/proc/net/unix``'s
    last column; abstract names left out): a socket file no live socket is bound to is what a
    killed process left. Empty if the table cannot be read."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {parts[7] for parts in map(str.split, lines) if len(parts) >= 8 and parts[7].startswith("/")}


def remove_by_inode(inodes) -> list[Path]:
    """Unlink every ``/dev/shm`` entry whose (st_dev, st_ino) is in ``inodes``; returns them.

    CRIU links a ``link_remap.N`` file to the same inode as the semaphore it stands for (at
    dump) and back to the original name (at restore), so files of a tree are found by inode,
    never by a name another snapshot may share.
    """
    wanted = {tuple(x) for x in inodes}
    removed: list[Path] = []
    if not wanted:
        return removed
    for p in SHM.iterdir():
        try:
            st = p.lstat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def group_hardlinks(paths: list[Path]) -> dict[Path, Path | None]:
    """Map each path to the first earlier path with the same inode (``None`` if it is first).

    CRIU's ``link_remap.N`` must come back as a hard link of the file it names.
    """
    first_by_inode: dict[tuple[int, int], Path] = {}
    out: dict[Path, Path | None] = {}
    for p in sorted(paths, key=lambda q: (q.name.startswith("link_remap."), str(q))):
        st = p.stat()
        key = (st.st_dev, st.st_ino)
        out[p] = first_by_inode.get(key)
        first_by_inode.setdefault(key, p)
    return out


def missing_or_changed(required: dict[str, int], digests: dict[str, str] | None = None, cache=None) -> list[str]:
    """Human-readable problems with required files, one per file: missing, size differs from
    the snapshot's, or (for the files ``digests`` names, ``{path: "<algorithm>:<hex>"}``) the
    content differs. ``cache``: a :class:`warmctl.checkpoint.filedigest.DigestCache` (an
    unchanged file then costs a ``stat``); it is saved. Empty when everything matches."""
    from warmctl.checkpoint.filedigest import DigestCache

    cache = cache if cache is not None else DigestCache(None)
    digests = digests or {}
    problems = []
    for p, size in sorted(required.items()):
        try:
            st = os.stat(p)
        except OSError:
            problems.append(f"{p}: missing")
            continue
        if st.st_size != size:
            problems.append(f"{p}: size {st.st_size} bytes, snapshot expects {size}")
            continue
        want = digests.get(p)
        if want is None:
            continue
        try:
            got = cache.digest(p, st, want.partition(":")[0])
        except (OSError, ValueError) as e:
            problems.append(f"{p}: cannot be read to check its content ({e})")
            continue
        if got != want:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(st.st_mtime))
            problems.append(f"{p}: content differs (same size, {st.st_size} bytes; digest {got[:23]}..., "
                            f"snapshot expects {want[:23]}...; file modified {when})")
    cache.save()
    return problems


#: Bundled files (role ``file``) are never written under these directories, whatever the manifest
#: or its signature says: the operating system's own trees, /root (except :data:`WRITABLE_UNDER_PROTECTED`)
#: and the package managers' databases.
PROTECTED_DIRS = ("/etc", "/usr", "/boot", "/root", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                  "/proc", "/sys", "/dev", "/run", "/var/lib/dpkg", "/var/lib/apt", "/var/lib/rpm")
#: Exceptions inside :data:`PROTECTED_DIRS`: the per-user cache (torch.compile's kernels live in
#: ``~/.cache/vllm``, and the root agent's home is /root).
WRITABLE_UNDER_PROTECTED = ("/root/.cache",)
#: Directory names a bundled file may never be written under, anywhere (login keys).
PROTECTED_COMPONENTS = (".ssh", ".gnupg")
DPKG_INFO = Path("/var/lib/dpkg/info")


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def package_owned(paths: list[str], info_dir: Path = DPKG_INFO) -> set[str]:
    """The ``paths`` (absolute) that a dpkg package installed: exact lines of
    ``/var/lib/dpkg/info/*.list`` (what ``dpkg -S`` reads). One pass over the ~800 list files of
    a Debian host (~7 MB, tens of ms); an empty set where there is no dpkg database."""
    if not paths or not info_dir.is_dir():
        return set()
    want = {p.encode(): p for p in paths}
    found: set[str] = set()
    for lst in info_dir.glob("*.list"):
        try:
            body = b"\n" + lst.read_bytes()
        except OSError:
            continue
        for b, p in want.items():
            if p not in found and (b"\n" + b + b"\n") in body:
                found.add(p)
    return found


def bundled_target_problems(paths: list[str], protected: Sequence[Path] = (), info_dir: Path = DPKG_INFO) -> list[str]:
    """Why each of ``paths`` (absolute destinations of bundled files) may not be written, one
    line each (empty: all may). A path is refused when it, or where it resolves to through
    symlinks, is under :data:`PROTECTED_DIRS` (bar :data:`WRITABLE_UNDER_PROTECTED`) or one
    of ``protected`` (warmctl's own home, keys, config), passes through a
    :data:`PROTECTED_COMPONENTS` directory, or is a file a dpkg package owns (:func:`package_owned`)."""
    problems: list[str] = []
    rest: dict[str, str] = {}
    own = [str(Path(p).absolute()) for p in protected if p]
    for p in paths:
        real = os.path.realpath(p)
        why = None
        for q in dict.fromkeys((p, real)):
            hit = next((d for d in PROTECTED_DIRS if _under(q, d) and not any(_under(q, w) for w in WRITABLE_UNDER_PROTECTED)), None)
            if hit:
                why = f"{q} is under {hit}"
            elif any(c in PROTECTED_COMPONENTS for c in q.split("/")):
                why = f"{q} is under a {'/'.join(c for c in q.split('/') if c in PROTECTED_COMPONENTS)} directory"
            else:
                mine = next((d for d in own if _under(q, d)), None)
                if mine:
                    why = f"{q} is under warmctl's own {mine}"
            if why:
                break
        if why:
            problems.append(why)
        else:
            rest[p] = real
    owned = package_owned(sorted(set(rest) | set(rest.values())), info_dir)
    for p, real in rest.items():
        if p in owned or real in owned:
            problems.append(f"{p if p in owned else real} belongs to an installed package (dpkg)")
    return problems


def _shm_links(pid: int):
    """``(st_dev, st_ino, stat)`` of every ``/dev/shm`` file process ``pid`` maps or has open
    (``/proc/PID/map_files`` and ``/proc/PID/fd``; root only), deleted names included."""
    for sub in ("map_files", "fd"):
        try:
            entries = os.listdir(f"/proc/{pid}/{sub}")
        except OSError:
            continue
        for e in entries:
            link = f"/proc/{pid}/{sub}/{e}"
            try:
                if os.readlink(link).startswith(str(SHM) + "/"):
                    st = os.stat(link)
                    yield (st.st_dev, st.st_ino), st
            except OSError:
                continue


def shm_of(root_pid: int | None, recorded_inodes=(), recorded_files=()) -> dict[tuple[int, int], os.stat_result]:
    """The ``/dev/shm`` files an engine holds, by (st_dev, st_ino): every file the tree of
    ``root_pid`` (None: no live tree) maps or has open, deleted names included, and every file
    recorded on its run (``recorded_inodes``: (st_dev, st_ino) pairs; ``recorded_files``:
    paths) still in ``/dev/shm``."""
    seen: dict[tuple[int, int], os.stat_result] = {}
    if root_pid is not None:
        for pid in tree_pids(root_pid):
            for key, st in _shm_links(pid):
                seen.setdefault(key, st)
    wanted = {tuple(x) for x in recorded_inodes}
    names = {str(p) for p in recorded_files}
    for p in _shm_entries() if (wanted or names) else ():
        try:
            st = p.lstat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in wanted or str(p) in names:
            seen.setdefault((st.st_dev, st.st_ino), st)
    return seen


def shm_bytes(files: dict[tuple[int, int], os.stat_result]) -> int:
    """Bytes of memory ``files`` (:func:`shm_of`) take: ``st_blocks`` x 512 each (a sparse ring
    buffer counts what was written, not its size)."""
    return sum(st.st_blocks * 512 for st in files.values())


def _shm_entries() -> list[Path]:
    try:
        return [p for p in SHM.iterdir() if p.is_file()]
    except OSError:
        return []


@dataclass
class ShmFile:
    """A file in ``/dev/shm``: ``path``, ``size`` (bytes, ``st_size``), ``allocated`` (bytes of
    memory it takes, ``st_blocks`` x 512), ``age_s`` (seconds since it was last written,
    ``st_mtime``: tmpfs keeps no creation time that Python reads; for a file nothing writes any
    more, how long it has been left), ``users``: PIDs of the
    processes that map it or hold it open (empty: nothing uses it)."""

    path: Path
    size: int
    allocated: int
    age_s: float
    users: list[int] = field(default_factory=list)


def shm_not_owned(owned_inodes) -> list[ShmFile]:
    """Every file in ``/dev/shm`` whose (st_dev, st_ino) is not in ``owned_inodes`` (the files of
    the live engines, :func:`shm_of`), oldest first, with the processes of the host that use
    each (every process's ``map_files`` and ``fd``; root sees them all)."""
    owned = {tuple(x) for x in owned_inodes}
    now = time.time()
    files: dict[tuple[int, int], ShmFile] = {}
    for p in _shm_entries():
        try:
            st = p.lstat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key not in owned and key not in files:
            files[key] = ShmFile(p, st.st_size, st.st_blocks * 512, max(0.0, now - st.st_mtime))
    if files:
        for pid in psutil.pids():
            for key, _ in _shm_links(pid):
                f = files.get(key)
                if f is not None and pid not in f.users:
                    f.users.append(pid)
    return sorted(files.values(), key=lambda f: -f.age_s)
