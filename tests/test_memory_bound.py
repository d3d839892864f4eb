"""warmctl's own memory stays bounded whatever the snapshot's size. A synthetic
snapshot of 2 GiB (513 chunks of 4 MiB, none zero, each with 256 KiB of random bytes so that
every stored object is mapped, not read) is published by home A's key into a directory remote; then, in
child processes whose peak resident set (``ru_maxrss`` from ``wait4``, this child only, started by a
small launcher: :data:`LAUNCHER`) must
stay under :data:`LIMIT`:

- node B's real ``warmctl pull`` (every chunk fetched, decompressed, hashed, written);
- ``up``'s materialize of it on a fresh node C (:meth:`warmctl.checkpoint.imagecache.ImageCache.get`
  from the remote with C's local store as the cache: the 2 GiB image written, every chunk
  verified and kept), the step ``up`` runs before CRIU (the synthetic snapshot's profile stops
  the real ``up`` before it).

Measured here: 125 MiB for each (2026-12-01). What breaks it (tried): a reader that keeps a
quarter of each chunk it verified (a list in ``load_verified``) makes the same ``pull`` peak at
637 MiB (598 MiB on 2026-12-03) and the test fail; anything that holds data in proportion to the snapshot does. No
engine is started; about 25 s on 2 cores, mostly the kernel writing the 2 GiB payload and C's 2 GiB
image (the stored chunks compress to 128 MiB)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

from test_hostile_remote import Fleet

from warmctl.naming.catalog import Catalog
from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest

#: the issue's bound on warmctl's own peak RSS (bytes)
LIMIT = 512 << 20
CHUNKS = 513  # 2 GiB + 4 MiB
CH = 4 << 20
RANDOM = 256 << 10
REPO = Path(__file__).resolve().parent.parent


def _payload(path: Path) -> Path:
    rnd = random.Random(27)
    filler = (b"warmctl scale " * 300)[:4096] * (CH // 4096)
    with open(path, "wb") as f:
        for _ in range(CHUNKS):
            f.write(rnd.randbytes(RANDOM) + filler[RANDOM:])
    return path


#: Runs argv[2:] as its child and writes that child's peak RSS (KiB, ``wait4``) to argv[1]. A
#: child of pytest itself cannot be measured so: at ``execve`` the kernel folds the high-water
#: RSS of the memory it replaces (a copy of the forking process: pytest, 700 MiB late in a full
#: run) into the new program's ``ru_maxrss`` (``exec_mmap``, ``setmax_mm_hiwater_rss``). This
#: launcher is a fresh, small interpreter, so its child's figure is the child's own.
LAUNCHER = r"""
import os, subprocess, sys
p = subprocess.Popen(sys.argv[2:])
_, status, ru = os.wait4(p.pid, 0)
p.returncode = 0
with open(sys.argv[1], "w") as f:
    f.write(str(ru.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _peak_rss(args: list[str], env: dict[str, str], timeout: float = 600) -> tuple[int, int, str]:
    """(exit status, peak RSS in bytes of that child alone, its stderr tail)."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".maxrss") as out:
        p = subprocess.Popen([sys.executable, "-c", LAUNCHER, out.name, *args], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        err = p.stderr.read()  # type: ignore[union-attr]
        p.wait(timeout)
        kib = int(open(out.name).read() or 0)
    return p.returncode, kib * 1024, err[-2000:]


MATERIALIZE = r"""
import sys
from warmctl.naming.catalog import Catalog
from warmctl.checkpoint.imagecache import ImageCache
from warmctl.store import Fetched, open_store
remote, home = sys.argv[1], sys.argv[2]
r = open_store(remote)
(e,) = Catalog(r).entries("big")
m = r.get_manifest(e.manifest)
f = Fetched()
img = ImageCache(home + "/cache/images").get(r, m, e.manifest, cache=open_store(home + "/store"), fetched=f)
print(f.as_dict(), file=sys.stderr)
assert f.as_dict()["remote"] > 0 and img.written
"""


def test_pull_and_materialize_of_2_gib_stay_under_512_mib(tmp_path):
    f = Fleet(tmp_path)
    src = _payload(tmp_path / "pages-1.img")
    # A publishes straight into the directory remote (a store of the same format as its own):
    # the pull and the materialize below read what a push would have left there, without a
    # third 2 GiB copy in A's store first
    with f.remote() as r:
        m = Manifest(name="big", profile_digest="sha256:" + "27" * 32, profile={"name": "big"},
                     host=f.fp().model_dump(mode="json"),
                     canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
                     files=[FileEntry(path="pages-1.img", size=src.stat().st_size, chunks=r.add_file(src))])
        src.unlink()
        assert m.total_size() > 2 << 30 and len({c.digest for c in m.files[0].chunks}) == CHUNKS
        Catalog(r).publish(r.put_manifest(m), m, signer=f.a_key.private)

    env = {**f.b_env, "PYTHONPATH": str(REPO)}
    rc, peak, err = _peak_rss([sys.executable, "-m", "warmctl", "pull", "big"], env)
    assert rc == 0, err
    assert len(Catalog(f.b()).entries("big")) == 1  # pulled and named: the work was done
    print(f"pull: peak RSS {peak / 2**20:.0f} MiB")
    assert peak < LIMIT, f"warmctl pull of a 2 GiB snapshot peaked at {peak / 2**20:.0f} MiB RSS: {err}"

    rc, peak, err = _peak_rss([sys.executable, "-c", MATERIALIZE, f.remote_url, str(tmp_path / "c" / "home")], env)
    assert rc == 0, err
    image = next((tmp_path / "c" / "home" / "cache" / "images").glob("*/images/pages-1.img"))
    assert image.stat().st_size == m.total_size()
    print(f"materialize: peak RSS {peak / 2**20:.0f} MiB")
    assert peak < LIMIT, f"materialize of a 2 GiB snapshot peaked at {peak / 2**20:.0f} MiB RSS: {err}"
