"""Private files under warmctl's home: directories 0700, files 0600.

The agent runs as root; its records (``run/NAME/state.json``, ``run/NAME/engine.pid``, the
agent's jobs and token) say which processes and files it may kill and remove, so nobody else
on the host may read or plant them. :func:`private_dir` creates (or tightens) a directory,
:func:`write_private` replaces a file atomically with mode 0600, and :func:`trusted` is the
test recovery applies before it believes a record: a regular file or directory (never a
symbolic link), owned by this process's user, not writable by group or others.
:func:`read_token` reads (or creates) the agent's bearer token file, for the agent and its client.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from warmctl.base.errors import HostError

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path | str) -> Path:
    """Create ``path`` (and missing parents, those 0700 too) and make it 0700; returns it.
    A directory owned by someone else is left as it is (chmod would fail; :func:`trusted`
    refuses it later)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    try:
        st = os.lstat(path)
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != DIR_MODE and not stat.S_ISLNK(st.st_mode):
            os.chmod(path, DIR_MODE)
    except OSError:
        pass
    return path


def write_private(path: Path | str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (a temp file in the same directory, mode
    0600, renamed over it). The temp file is ``NAME.tmp<pid>``; removed on failure."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def untrusted(path: Path | str, *, kind: str = "file") -> str | None:
    """Why ``path`` is not a record this process wrote, or None if it may be: it must exist
    as a ``kind`` (``file`` or ``dir``) and not as a symbolic link, belong to this process's
    user, and not be writable by group or others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def trusted(path: Path | str, *, kind: str = "file") -> bool:
    """True if :func:`untrusted` finds nothing against ``path``."""
    return untrusted(path, kind=kind) is None


def read_token(path: Path | str, *, create: bool = False, private: bool = True) -> str:
    """The bearer token in the agent's token file ``path``: its first line, stripped.

    ``create``: a missing file is created with a fresh random token (32 bytes, URL-safe
    base64), mode 0600, its directory 0700. ``private``: refuse a file readable by group or
    others (mode & 0o077): a token anyone on the host can read protects nothing (the agent
    checks it; a client reading a copy elsewhere does not). Raises :class:`HostError` naming
    the file when it is unreadable, empty, or (``private``) open to others."""
    path = Path(path)
    if create and not path.exists():
        import secrets  # only here: ~15 ms of imports every other user of this module skips

        private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as e:
        raise HostError(f"agent token file {path}: {e.strerror}") from None
    if private and st.st_mode & 0o077:
        raise HostError(f"agent token file {path} is readable by group or others (mode {st.st_mode & 0o777:o}); "
                        f"chmod 600 {path}")
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise HostError(f"agent token file {path} is empty")
    return token
