"""Real CRIU, ``criu restore --stream``, served by :class:`warmctl.checkpoint.stream.ImageStreamer`
while the image is still being written (no engine: a small process holding 48 MiB of
pseudo-random memory that checks its own digest every 0.1 s)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from tests.conftest import wait_until

from warmctl.checkpoint import criu
from warmctl.checkpoint.stream import ImageStreamer, StreamError, _request_filename
from warmctl.base.errors import CheckpointError
from warmctl.base.proc import ProcessId, kill_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

HOLDER = r"""
import hashlib, os, random, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # a PID namespace's init ignores it otherwise
buf = bytearray(random.Random(7).randbytes(48 * 2**20))
zeros = bytearray(24 * 2**20)  # touched pages of zeros: the dump holds them, the store keeps them as zero chunks (holes)
for i in range(0, len(zeros), 4096):
    zeros[i] = 1
    zeros[i] = 0
want = hashlib.sha256(buf + zeros).hexdigest()
out = open(sys.argv[1], "a", buffering=1)
while True:
    out.write(("ok " if hashlib.sha256(buf + zeros).hexdigest() == want else "BAD ") + want + "\n")
    time.sleep(0.1)
"""


def _holder(tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    out = tmp_path / "holder.log"
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", HOLDER, str(out)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = psutil.Process(p.pid).children()
        if kids and out.exists() and out.read_text().startswith("ok "):
            return p, kids[0].pid, out
        time.sleep(0.05)
    raise AssertionError("the holder did not start")


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """A dumped holder: (image directory, its log, the digest it checks)."""
    tmp = tmp_path_factory.mktemp("stream")
    launcher, root, out = _holder(tmp)
    digest = out.read_text().split()[1]
    criu.dump(root, tmp / "img")
    launcher.wait(10)
    return tmp / "img", out, digest


def _feed(src: Path, dst: Path, streamer: ImageStreamer, piece: int, pause_s: float, stop_at: int | None = None,
          order: list[str] | None = None, hold: str | None = None) -> None:
    """Write ``src``'s files into ``dst`` as ImageCache.get does (temporary file at full size,
    then ranges, telling the streamer), ``piece`` bytes every ``pause_s``; with ``stop_at``,
    stop after that many bytes in all and report a failure. With ``hold`` (a file's name), after
    that file's first piece wait until CRIU has been served some of it (at most 60 s): CRIU is
    then reading the file while the rest is written, however late a loaded host started it."""
    done = 0
    for name in order or sorted(os.listdir(src)):
        data = (src / name).read_bytes()
        tmp = dst / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.truncate(len(data))
            streamer.opened(f"images/{name}", tmp)
            for off in range(0, len(data), piece):
                if stop_at is not None and done >= stop_at:
                    streamer.fail(f"chunk of {name} at offset {off} is corrupt (test)")
                    return
                f.write(data[off : off + piece])
                f.flush()
                done += len(data[off : off + piece])
                streamer.written(f"images/{name}", min(off + piece, len(data)))
                if name == hold and off == 0:
                    wait_until(lambda: streamer.files[f"images/{name}"].served > 0, 60)
                if len(data) > piece:
                    time.sleep(pause_s)
        os.replace(tmp, dst / name)  # renamed once whole, as get does: the streamer reads its open fd


def _sizes(img: Path) -> dict[str, int]:
    return {f"images/{n}": (img / n).stat().st_size for n in os.listdir(img)}


def _holders() -> set[int]:
    """PIDs of live holder processes (restored or not)."""
    return {p.pid for p in psutil.process_iter(["cmdline", "status"])
            if "hashlib" in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE}


def _stop(pid: int) -> None:
    ident = ProcessId.of(pid)
    if ident is not None and ident.alive():
        kill_tree(ident)


def test_a_streamed_restore_starts_before_the_image_is_written_and_restores_every_byte(dumped, tmp_path):
    img, out, digest = dumped
    sizes = _sizes(img)
    pages = max(sizes, key=sizes.get)
    assert pages.startswith("images/pages-") and sizes[pages] >= 48 * 2**20
    dst, sock = tmp_path / "dst", tmp_path / "s"
    dst.mkdir()
    sock.mkdir(mode=0o700)
    out.write_text("")
    fed: dict[str, float] = {}
    with ImageStreamer(sizes, sock) as streamer:
        # pages files last (as an image's largest files come): 4 MiB every 50 ms, about 1 s for the holder's,
        # the rest of it once CRIU has read its first piece
        order = sorted(os.listdir(img), key=lambda n: (n.startswith("pages-"), n))
        feeder = threading.Thread(target=lambda: (_feed(img, dst, streamer, 4 * 2**20, 0.05, order=order,
                                                        hold=pages.removeprefix("images/")),
                                                  fed.setdefault("end", time.monotonic())))
        t0 = time.monotonic()
        feeder.start()
        pid, _ = criu.restore(sock, tmp_path / "pid", log_file=tmp_path / "restore.log", work_dir=tmp_path, stream=True)
        feeder.join()
        report = streamer.close()
    try:
        # CRIU was waiting for pages while they were written: the restore overlapped the write
        assert report.waited_s > 0.2, report
        assert report.served[pages] == sizes[pages]
        assert all(report.served[n] == sizes[n] for n in report.served)
        assert "images/inventory.img" in report.served and report.absent  # optional images CRIU asked for
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(out.read_text().splitlines()) < 3:
            time.sleep(0.05)
        lines = out.read_text().splitlines()
        assert len(lines) >= 3 and all(line == f"ok {digest}" for line in lines), lines[:3]
        assert fed["end"] - t0 > 0.3
    finally:
        _stop(pid)
    assert sorted(os.listdir(sock)) == []  # the socket is removed


def test_a_write_that_fails_fails_the_restore_and_nothing_is_left_running(dumped, tmp_path):
    img, out, digest = dumped
    sizes = _sizes(img)
    dst, sock = tmp_path / "dst", tmp_path / "s"
    dst.mkdir()
    sock.mkdir(mode=0o700)
    before = _holders()
    with ImageStreamer(sizes, sock) as streamer:
        order = sorted(os.listdir(img), key=lambda n: (n.startswith("pages-"), n))
        small = sum(s for n, s in sizes.items() if not n.startswith("images/pages-"))
        # the write fails 16 MiB into the pages, once CRIU has been served their first piece
        pages = max(sizes, key=sizes.get).removeprefix("images/")
        feeder = threading.Thread(target=_feed, args=(img, dst, streamer, 4 * 2**20, 0.02, small + 16 * 2**20, order,
                                                      pages))
        feeder.start()
        with pytest.raises(CheckpointError) as e:
            criu.restore(sock, tmp_path / "pid", log_file=tmp_path / "restore.log", work_dir=tmp_path, stream=True)
        feeder.join()
        report = streamer.close(check=False)
    assert "criu restore --stream" in str(e.value)
    assert 0 < max(report.served.values()) < max(sizes.values())
    time.sleep(0.5)
    assert _holders() <= before  # CRIU killed what it had restored


def test_a_request_is_read_strictly():
    assert _request_filename(b"\x0a\x0dinventory.img") == "inventory.img"
    for bad in (b"", b"\x08\x01", b"\x0a\x05abc", b"\x0a\x02..", b"\x0a\x05a/b.c", b"\x0a\xff\xff\xff\xff\xff\x01x"):
        with pytest.raises(ValueError):
            _request_filename(bad)


def test_a_socket_path_too_long_is_refused(tmp_path):
    with pytest.raises(StreamError, match="107 bytes"):
        ImageStreamer({}, tmp_path / ("d" * 120))


class _Slow:
    """A watch in front of the streamer that sleeps a little on each range of the largest file,
    as a remote fetch would: the restore then has to wait for the write. The largest file's
    first range waits (at most 60 s) until CRIU has been served bytes of some file, so however
    late a loaded host starts CRIU, it is reading while that file is written."""

    def __init__(self, streamer: ImageStreamer, big: str, pause_s: float):
        self.streamer, self.big, self.pause_s = streamer, big, pause_s
        self.held = False

    def opened(self, rel, tmp):
        self.streamer.opened(rel, tmp)

    def written(self, rel, end):
        if rel == self.big:
            if not self.held:
                self.held = True
                wait_until(lambda: any(f.served for f in self.streamer.files.values()), 60)
            time.sleep(self.pause_s)
        self.streamer.written(rel, end)


def _stored(dumped, tmp_path):
    from tests.test_store_fixtures import make_manifest
    from warmctl.store import open_store

    img = dumped[0]
    store = open_store(tmp_path / "store")
    m = make_manifest(store, "holder", {n: img / n for n in sorted(os.listdir(img))})
    for f in m.files:
        f.role = "image"
    return store, m, store.put_manifest(m)


def _get_streamed(store, m, digest, tmp_path, streamer, big, pause_s=0.03):
    from warmctl.checkpoint.imagecache import ImageCache

    out = {}

    def write():
        try:
            out["img"] = ImageCache(tmp_path / "cache").get(store, m, digest, watch=_Slow(streamer, big, pause_s))
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
            streamer.fail(str(e))

    t = threading.Thread(target=write)
    t.start()
    return t, out


def test_image_cache_get_streams_a_stored_image_to_criu_as_it_verifies_it(dumped, tmp_path):
    from warmctl.checkpoint.imagecache import entry_sizes

    store, m, digest = _stored(dumped, tmp_path)
    out_log, want = dumped[1], dumped[2]
    sizes = entry_sizes(m)
    big = max(sizes, key=sizes.get)
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    out_log.write_text("")
    with ImageStreamer(sizes, sock) as streamer:
        t, res = _get_streamed(store, m, digest, tmp_path, streamer, big)
        pid, _ = criu.restore(sock, tmp_path / "pid", log_file=tmp_path / "restore.log", work_dir=tmp_path, stream=True)
        t.join()
        report = streamer.close()
    try:
        assert "error" not in res and res["img"].written
        zero_chunks = [c for f in m.files for c in f.chunks if not store.has_chunk(c.digest)]
        assert len(zero_chunks) >= 4  # the holder's zeros: holes in the written image, served as zeros
        assert (res["img"].images / big.split("/")[1]).read_bytes() == (dumped[0] / big.split("/")[1]).read_bytes()
        assert report.served[big] == sizes[big] and report.waited_s > 0.1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(out_log.read_text().splitlines()) < 2:
            time.sleep(0.05)
        assert out_log.read_text().splitlines()[:2] == [f"ok {want}"] * 2
    finally:
        _stop(pid)


def test_a_corrupt_chunk_fails_the_streamed_restore_and_names_the_chunk(dumped, tmp_path):
    from warmctl.checkpoint.imagecache import entry_sizes
    from warmctl.store.layout import chunk_key

    store, m, digest = _stored(dumped, tmp_path)
    sizes = entry_sizes(m)
    big = max(sizes, key=sizes.get)
    f = next(x for x in m.files if f"images/{x.path}" == big)
    stored = [c for c in f.chunks if store.has_chunk(c.digest)]
    bad = stored[len(stored) // 2]
    obj = tmp_path / "store" / chunk_key(bad.digest)
    obj.chmod(0o644)
    obj.write_bytes(obj.read_bytes()[:-7] + b"garbage")
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    before = _holders()
    with ImageStreamer(sizes, sock) as streamer:
        t, res = _get_streamed(store, m, digest, tmp_path, streamer, big, pause_s=0.01)
        with pytest.raises(CheckpointError):
            criu.restore(sock, tmp_path / "pid", log_file=tmp_path / "restore.log", work_dir=tmp_path, stream=True)
        t.join()
        report = streamer.close(check=False)
    assert bad.digest in str(res["error"])  # the chunk is named, and CRIU got nothing past it
    assert report.served.get(big, 0) < sizes[big]
    assert not list((tmp_path / "cache").glob("*/images")) and not list((tmp_path / "cache").glob(".partial-*"))
    time.sleep(0.5)
    assert _holders() <= before


def test_wait_gives_a_whole_file_to_read_or_the_write_error(tmp_path):
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    tmp = tmp_path / ".psm.tmp"
    tmp.write_bytes(bytes(8))
    with ImageStreamer({"shm/psm": 8, "images/core-1.img": 3}, sock) as streamer:
        got = {}
        t = threading.Thread(target=lambda: got.update(streamer.wait(["shm/psm"])))
        t.start()
        streamer.opened("shm/psm", tmp)
        streamer.written("shm/psm", 4)
        time.sleep(0.2)
        assert not got  # half written: still waiting
        with open(tmp, "r+b") as f:
            f.write(b"12345678")
        streamer.written("shm/psm", 8)
        t.join(5)
        os.replace(tmp, tmp_path / "psm")  # renamed: the path given still reads it
        assert got["shm/psm"].read_bytes() == b"12345678"
        streamer.fail("chunk X is corrupt")
        with pytest.raises(StreamError, match="chunk X is corrupt"):
            streamer.wait(["images/core-1.img"])
