"""A streamed restore: ``criu restore --stream`` reads the CRIU image while it is still being
fetched, verified and written (a fresh node restored only after its whole image was
on disk, one phase after the other).

CRIU's image streaming interface (CRIU 4.2, ``criu/img-streamer.c``, ``images/img-streamer.proto``;
made for ``criu-image-streamer``) replaces every open of an image file by a request on a UNIX
socket, ``streamer-serve.sock`` in the ``-D`` directory: CRIU sends an
``img_streamer_request_entry {filename}`` (each message a native-endian u32 length, then the
protobuf bytes), the streamer answers ``img_streamer_reply_entry {exists}``, and for a file that
exists CRIU passes the write end of a pipe (``SCM_RIGHTS``) and reads the file's bytes from the
read end, in order, to its end. A short file (the pipe closed early) fails the restore, and CRIU
kills what it had restored.

:class:`ImageStreamer` is that streamer for an image being written by
:meth:`warmctl.checkpoint.imagecache.ImageCache.get` (it is the :class:`ImageWatch` there):
each requested file is served from its temporary file, on its own thread, a range at a time as
``get`` reports the range verified and written (``splice``, no copy through Python; holes, the
snapshot's zero chunks, as zeros from memory), blocking until the next range arrives. Only verified bytes reach CRIU. If the write fails, :meth:`fail`
closes every pipe before its end: CRIU's restore fails, and the caller reports the write's
error. Files the manifest does not hold are answered "does not exist" (CRIU asks for optional
images, e.g. ``memfd.img``, and treats that as none).
"""

from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from warmctl.checkpoint import criuimage

log = logging.getLogger(__name__)

#: The socket CRIU connects to in its ``-D`` directory on restore (``IMG_STREAMER_SERVE_SOCKET_NAME``).
SERVE_SOCKET = "streamer-serve.sock"
#: The entry's subdirectory holding CRIU's image files (:data:`warmctl.checkpoint.imagecache.CACHED_ROLES`).
IMAGES = "images"
#: Largest request CRIU sends (a file name: CRIU's PATH_MAX) and the most bytes one splice moves.
MAX_REQUEST = 4096 + 16
SPLICE_BYTES = 4 * 2**20
#: Capacity asked for each pipe CRIU sends (``F_SETPIPE_SZ``; the kernel's default is 64 KiB,
#: 16 pages, so each splice would move at most that much between two wake-ups of CRIU); None
#: keeps the default. A refusal (``EPERM`` over ``/proc/sys/fs/pipe-max-size`` without
#: CAP_SYS_RESOURCE, ``EBUSY``) keeps the default too. 1 MiB (the default ``pipe-max-size``):
#: a 2 GiB streamed restore took 1.23x a plain ``criu restore`` of the same files, against
#: 2.05x with 64 KiB pipes, and 1.80x / 2.31x with 2 / 4 MiB (``benchmarks/stream_pipe.py``,
#: docs/benchmarks.md).
PIPE_BYTES: int | None = 2**20
#: Zeros written into CRIU's pipe for an image's holes (the zero chunks): read from this untouched
#: allocation (the kernel's zero page) instead of the file, whose holes would each cost a fresh,
#: zeroed page-cache page (measured on a fresh node's first restore, docs/benchmarks.md).
_ZEROS = memoryview(bytes(SPLICE_BYTES))


class StreamError(RuntimeError):
    """The image streamer failed (its socket, a pipe CRIU closed early, a request it could not
    parse): the message names the file and why."""


@dataclass
class _File:
    size: int
    fd: int | None = None  # opened for reading where get wrote it
    end: int = 0  # bytes [0, end) verified and written
    served: int = 0  # bytes handed to CRIU, for the report


@dataclass
class StreamReport:
    """What CRIU asked for: ``served`` (entry name, ``images/NAME`` -> bytes sent), ``absent`` (names it asked for that
    the image does not hold), ``waited_s`` (seconds the file threads spent waiting for bytes
    not yet written, summed over threads), ``errors`` (the streamer's own failures: its socket,
    a request it could not read, a pipe CRIU closed before the file's end)."""

    served: dict[str, int] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)
    waited_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class ImageStreamer:
    """Serve the files ``sizes`` (name in the image cache's entry, e.g. ``images/pages-4.img``
    -> bytes) as they are written: those under ``images/`` to one ``criu restore --stream -D
    sock_dir`` (see the module doc), any of them to :meth:`wait` (e.g. the ``/dev/shm`` files,
    put back before CRIU starts).

    Use as a context manager: on entry it listens on ``sock_dir/streamer-serve.sock``
    (``sock_dir`` must exist, be private to us and short enough for a socket path: 107 bytes);
    on exit every thread is stopped and every file descriptor closed. Feed it as an
    :class:`~warmctl.checkpoint.imagecache.ImageWatch` (``opened``/``written``) while the entry
    is written, or :meth:`complete` with an entry already whole; :meth:`fail` when writing it
    failed. Thread-safe. Raises :class:`StreamError` from :meth:`close` (``check=True``) when
    serving failed other than by :meth:`fail`.
    """

    def __init__(self, sizes: dict[str, int], sock_dir: Path):
        self.files = {rel: _File(size) for rel, size in sizes.items()}
        self.sock_path = Path(sock_dir) / SERVE_SOCKET
        if len(os.fsencode(self.sock_path)) > 107:
            raise StreamError(f"socket path {self.sock_path} is longer than a UNIX socket path may be (107 bytes)")
        self.report = StreamReport()
        self._cond = threading.Condition()
        self._failed: str | None = None  # why the write failed: every pipe is closed early
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._srv: socket.socket | None = None

    # -- fed by the writer (ImageWatch) --------------------------------------------------

    def opened(self, rel: str, tmp: Path) -> None:
        f = self.files.get(rel)
        if f is None:
            return
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        with self._cond:
            if f.fd is None:
                f.fd = fd
                fd = -1
        if fd >= 0:
            os.close(fd)

    def written(self, rel: str, end: int) -> None:
        f = self.files.get(rel)
        if f is None:
            return
        with self._cond:
            f.end = max(f.end, end)
            self._cond.notify_all()

    def complete(self, root: Path) -> None:
        """Every file is whole under ``root`` (the entry: ``root/images/NAME``), e.g. an entry
        that ``get`` found already written; files not yet opened are opened there."""
        for rel, f in self.files.items():
            with self._cond:
                if f.fd is not None:
                    f.end = f.size
                    continue
            fd = os.open(Path(root) / rel, os.O_RDONLY | os.O_CLOEXEC)
            with self._cond:
                if f.fd is None:
                    f.fd = fd
                else:
                    os.close(fd)
                f.end = f.size
        with self._cond:
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        """Writing the image failed (``why``): every file CRIU is reading ends early, so its
        restore fails; nothing more is served."""
        with self._cond:
            self._failed = self._failed or why
            self._cond.notify_all()

    def wait(self, rels: list[str]) -> dict[str, Path]:
        """Block until each of ``rels`` is whole; a path to read each (``/proc/self/fd/N`` of
        the descriptor held here: valid until :meth:`close`, whatever the file is renamed to).
        Raises :class:`StreamError` when the write failed first (naming why)."""
        with self._cond:
            while True:
                if self._failed:
                    raise StreamError(f"the image was not written: {self._failed}")
                if self._closing:
                    raise StreamError("the image streamer was closed")
                if all(self.files[r].fd is not None and self.files[r].end >= self.files[r].size for r in rels):
                    return {r: Path(f"/proc/self/fd/{self.files[r].fd}") for r in rels}
                self._cond.wait()

    # -- serving CRIU ------------------------------------------------------------------

    def __enter__(self) -> "ImageStreamer":
        self.sock_path.unlink(missing_ok=True)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            srv.bind(str(self.sock_path))
            os.chmod(self.sock_path, 0o600)
            srv.listen(1)
        except OSError:
            srv.close()
            raise
        srv.settimeout(0.2)
        self._srv = srv
        self._start(self._accept, "warmctl-stream")
        return self

    def __exit__(self, *exc) -> None:
        self.close(check=False)

    def close(self, check: bool = True) -> StreamReport:
        """Stop serving: wake and join every thread, close every descriptor, remove the socket.
        Returns :attr:`report`; with ``check``, raises :class:`StreamError` if serving failed."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in list(self._threads):
            t.join()
        for f in self.files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
        if self._srv is not None:
            self._srv.close()
            self._srv = None
        self.sock_path.unlink(missing_ok=True)
        if check and self.report.errors:
            raise StreamError("; ".join(self.report.errors))
        return self.report

    def _start(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        srv = self._srv
        assert srv is not None
        while True:
            with self._cond:
                if self._closing:
                    return
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError as e:
                self.report.errors.append(f"image streamer socket {self.sock_path}: {e}")
                return
            break
        with conn:
            conn.settimeout(0.2)
            try:
                self._requests(conn)
            except (OSError, ValueError, StreamError) as e:
                self.report.errors.append(f"image streamer: {e}")

    def _recv(self, conn: socket.socket, n: int) -> bytes | None:
        """``n`` bytes from CRIU, None at its end of the connection or when closing."""
        buf = b""
        while len(buf) < n:
            try:
                got = conn.recv(n - len(buf))
            except socket.timeout:
                with self._cond:
                    if self._closing:
                        return None
                continue
            if not got:
                if buf:
                    raise StreamError(f"CRIU closed the connection in the middle of a request ({len(buf)} of {n} bytes)")
                return None
            buf += got
        return buf

    def _requests(self, conn: socket.socket) -> None:
        while True:
            head = self._recv(conn, 4)
            if head is None:
                return
            (n,) = struct.unpack("=I", head)
            if n > MAX_REQUEST:
                raise StreamError(f"a request of {n} bytes (at most {MAX_REQUEST})")
            body = self._recv(conn, n)
            if body is None:
                return
            name = _request_filename(body)
            f = self.files.get(f"{IMAGES}/{name}")
            reply = bytes([0x08, 1 if f is not None else 0])  # img_streamer_reply_entry {exists}
            conn.sendall(struct.pack("=I", len(reply)) + reply)
            if f is None:
                self.report.absent.append(name)
                continue
            wfd = self._recv_fd(conn, name)
            if wfd is None:
                return
            self._start(self._serve, f"warmctl-stream-{name}", f"{IMAGES}/{name}", f, wfd)

    def _recv_fd(self, conn: socket.socket, name: str) -> int | None:
        while True:
            try:
                _, anc, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(4))
                break
            except socket.timeout:
                with self._cond:
                    if self._closing:
                        return None
        fds = array.array("i")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise StreamError(f"CRIU sent {len(fds)} descriptors for {name}, not one pipe")
        return fds[0]

    def _serve(self, name: str, f: _File, wfd: int) -> None:
        """Splice ``f`` into CRIU's pipe ``wfd`` as its bytes are written; close the pipe at its
        end, or early when the write failed (CRIU then fails its restore)."""
        off = 0
        if PIPE_BYTES:
            try:
                fcntl.fcntl(wfd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError as e:
                log.debug("%s: pipe kept at its size (F_SETPIPE_SZ %d: %s)", name, PIPE_BYTES, e)
        try:
            while off < f.size:
                t0 = time.monotonic()
                with self._cond:
                    while not (self._failed or self._closing or (f.fd is not None and f.end > off)):
                        self._cond.wait()
                    if self._failed or self._closing:
                        return
                    end, fd = f.end, f.fd
                    self.report.waited_s += time.monotonic() - t0  # under the lock: one sum for every file's thread
                while off < end:
                    data, hole = _next_data(fd, off, end)
                    while off < data:  # a hole (zero chunks): zeros from memory, not the file's page cache
                        off += os.write(wfd, _ZEROS[: min(data - off, len(_ZEROS))])
                    while off < hole:
                        n = os.splice(fd, wfd, min(hole - off, SPLICE_BYTES), offset_src=off)
                        if n == 0:
                            raise StreamError(f"{name}: read 0 bytes at offset {off} of {f.size}")
                        off += n
                    f.served = off
        except BrokenPipeError:
            with self._cond:
                if not (self._failed or self._closing):
                    self.report.errors.append(f"CRIU closed its pipe for {name} after {off:,} of {f.size:,} bytes")
        except (OSError, StreamError) as e:
            self.report.errors.append(f"serving {name} ({off:,} of {f.size:,} bytes): {e}")
        finally:
            with self._cond:
                self.report.served[name] = off
            os.close(wfd)


def _next_data(fd: int, off: int, end: int) -> tuple[int, int]:
    """(start, end) of the first data region of ``fd`` at or after ``off``, both clipped to
    ``end`` (``SEEK_DATA``/``SEEK_HOLE``; the bytes before the start are a hole, zeros). A file
    system without them reports all data."""
    try:
        data = os.lseek(fd, off, os.SEEK_DATA)
    except OSError as e:
        if e.errno == errno.ENXIO:  # only a hole is left
            return end, end
        return off, end
    if data >= end:
        return end, end
    return data, min(os.lseek(fd, data, os.SEEK_HOLE), end)


def _request_filename(body: bytes) -> str:
    """The ``filename`` (field 1, a string) of an ``img_streamer_request_entry``. Raises
    ValueError for anything else."""
    f = criuimage.fields(body)
    names = f.get(1, [])
    if set(f) != {1} or len(names) != 1 or not isinstance(names[0], bytes) or body[0] != 0x0A:
        raise ValueError(f"not a file request: {body[:16]!r}")
    name = names[0].decode()
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"a file request for {name!r}, not a file of the image directory")
    return name
