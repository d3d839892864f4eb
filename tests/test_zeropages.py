"""All-zero pages out of a real CRIU image (warmctl/checkpoint/zeropages.py): a small Python
process tree under real CRIU, dumped, compacted, restored, its memory compared byte for byte.

The process maps, and touches every page of:

- a private anonymous region, half a pattern and half written with zeros (the zeros are real
  pages, as an allocator's zeroed memory is): the zero half leaves the image;
- a private mapping of a file of 0xAB bytes, one page of it overwritten with zeros: that page
  stays in the image (absent, it would read the file's 0xAB again);
- a forked child that inherits the anonymous region copy-on-write and zeroes a page the parent
  keeps non-zero: after the restore the child reads zeros there and the parent its pattern
  (CRIU drops the inherited page the child's image lacks).

Then each process writes the SHA-256 of each region (taken again from memory after the restore)
and the test compares them with what it wrote before the dump.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from warmctl.base.errors import CheckpointError
from warmctl.base.proc import ProcessId, kill_tree
from warmctl.checkpoint import criu, criuimage, zeropages

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")

PAGE = zeropages.PAGE
ANON_PAGES = 512  # 2 MiB: 256 pattern pages, 256 zero pages

_PROG = r"""
import hashlib, json, mmap, os, signal, sys, time
work = sys.argv[1]
P = 4096
anon = mmap.mmap(-1, {n} * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range({n}):
    anon[i * P:(i + 1) * P] = bytes([1 + i % 200]) * P if i < {n} // 2 else bytes(P)
with open(os.path.join(work, "file.bin"), "r+b") as f:
    fmap = mmap.mmap(f.fileno(), 4 * P, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
fmap[P:2 * P] = bytes(P)  # a file page made all zero in this process only
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
me = "parent"
if os.fork() == 0:
    me = "child"
    anon[0:P] = bytes(P)  # the child zeroes a page the parent keeps
def report(tag):
    with open(os.path.join(work, f"{{me}}-{{tag}}.json"), "w") as f:
        json.dump({{"anon": hashlib.sha256(anon[:]).hexdigest(), "file": hashlib.sha256(fmap[:]).hexdigest(),
                   "page0": anon[0], "filepage1": fmap[P]}}, f)
report("before")
while not os.path.exists(os.path.join(work, "go")):
    time.sleep(0.05)
report("after")
while True:
    time.sleep(1)
"""


def _start(work: Path) -> tuple[subprocess.Popen, int]:
    (work / "file.bin").write_bytes(b"\xab" * 4 * PAGE)
    prog = work / "prog.py"
    prog.write_text(_PROG.format(n=ANON_PAGES))
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, str(prog), str(work)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(work / "err.log", "ab"),
                         start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (work / "parent-before.json").exists() and (work / "child-before.json").exists():
            return p, psutil.Process(p.pid).children()[0].pid
        time.sleep(0.05)
    p.kill()
    raise AssertionError(f"the test's process did not start: {(work / 'err.log').read_text()[-2000:]}")


def _pages_bytes(img: Path) -> int:
    return sum(p.stat().st_size for p in img.glob("pages-*.img"))


def test_zero_pages_of_anonymous_memory_leave_the_image_and_the_restored_memory_is_the_same(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    img = tmp_path / "img"
    launcher, root = _start(work)
    criu.dump(root, img)
    launcher.wait(10)
    before_bytes = _pages_bytes(img)

    done = zeropages.compact(img)
    # the parent's 256 zero pages, the child's 256 and the one it zeroed (the rest of the
    # interpreter's heap has zero pages too: at least these)
    assert done.dropped >= 2 * ANON_PAGES // 2 + 1, done
    assert done.left_whole == {}, done
    assert _pages_bytes(img) == before_bytes - done.bytes_dropped
    again = zeropages.compact(img)  # nothing left to drop: the image is not touched again
    assert again.dropped == 0 and again.pages == done.pages - done.dropped

    new_root, _ = criu.restore(img, tmp_path / "pid", log_file=tmp_path / "restore.log")
    try:
        (work / "go").touch()
        deadline = time.monotonic() + 30
        while not ((work / "parent-after.json").exists() and (work / "child-after.json").exists()):
            assert time.monotonic() < deadline, (work / "err.log").read_text()[-2000:]
            time.sleep(0.05)
        time.sleep(0.2)  # the files are whole
        for who in ("parent", "child"):
            before = json.loads((work / f"{who}-before.json").read_text())
            after = json.loads((work / f"{who}-after.json").read_text())
            assert after == before, who
        assert json.loads((work / "child-after.json").read_text())["page0"] == 0
        assert json.loads((work / "parent-after.json").read_text())["page0"] == 1
        assert json.loads((work / "parent-after.json").read_text())["filepage1"] == 0  # not 0xAB from the file
    finally:
        kill_tree(ProcessId.of(new_root))


def test_a_pagemap_with_pages_in_a_parent_image_is_left_whole(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    magic = b"\x19\x43\x56\x54\x25\x40\x08\x56"
    entries = [(0x10000, 2, zeropages.PE_PRESENT), (0x20000, 1, zeropages.PE_PARENT)]
    (img / "pagemap-7.img").write_bytes(zeropages._pagemap_bytes(magic, 3, entries))
    (img / "pages-3.img").write_bytes(bytes(2 * PAGE))
    done = zeropages.compact(img)
    assert done.dropped == 0 and done.pages == 3 and "flags 0x1" in done.left_whole[7]
    assert (img / "pages-3.img").stat().st_size == 2 * PAGE


def test_a_damaged_image_is_named(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    magic = b"\x19\x43\x56\x54\x25\x40\x08\x56"
    (img / "pagemap-7.img").write_bytes(zeropages._pagemap_bytes(magic, 3, [(0x10000, 4, zeropages.PE_PRESENT)]))
    (img / "mm-7.img").write_bytes(magic + criuimage.record(b""))
    (img / "pages-3.img").write_bytes(bytes(2 * PAGE))  # two pages where the pagemap lists four
    with pytest.raises(CheckpointError, match=r"pages-3\.img: 8192 bytes, but its pagemap lists 16384"):
        zeropages.compact(img)
    (img / "pagemap-7.img").write_bytes(magic + b"\x40\x00\x00\x00\x08")
    with pytest.raises(CheckpointError, match=r"pagemap-7\.img: a 64-byte record at byte 8 runs past the end"):
        zeropages.compact(img)
