"""``criu restore --stream`` served by warmctl's :class:`~warmctl.checkpoint.stream.ImageStreamer`
against a plain ``criu restore`` of the same files, and the streamer's pipe capacity
(``stream.PIPE_BYTES``, ``F_SETPIPE_SZ``).

No engine: a process holding ``--size`` GiB of random memory (every page data, none zero) is
dumped once (not timed). Then each round restores it once per side, in an order that rotates
from round to round, page cache warm for every side (the image was just written, and each side
reads the same files):

- **files**: ``criu restore -D DIR`` (warmctl's flags, :func:`warmctl.checkpoint.criu.restore`);
- **stream P**: ``criu restore --stream``, every file served by an ``ImageStreamer`` told the
  entry is whole (:meth:`~warmctl.checkpoint.stream.ImageStreamer.complete`), with each pipe
  CRIU sends set to ``P`` bytes (``default``: the kernel's 64 KiB).

Timed: ``criu.restore`` (CRIU's start to the restored tree running). After each restore the
restored process hashes its memory again and must find the digest it had before the dump (not
timed); then it is killed. Printed: the median seconds per side, each stream side's ratio to
``files`` (median of per-round ratios: the machine is shared) and its GiB/s.

Usage::

    python benchmarks/stream_pipe.py [--size 2] [--rounds 5] [--pipes default,1M,4M] [--json FILE]

Needs root and CRIU (``scripts/install.sh``). Leaves nothing behind: every restored process is
killed and the work directory (about ``--size`` GiB) removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from warmctl.checkpoint import criu, stream  # noqa: E402
from warmctl.base.proc import ProcessId, kill_tree  # noqa: E402

#: Holds argv[1] GiB of random bytes; writes "ready DIGEST" to argv[2], and on each SIGUSR1
#: hashes its memory again and writes "ok DIGEST" or "BAD DIGEST".
HOLDER = r"""
import hashlib, os, signal, sys, time
buf = bytearray(os.urandom(int(float(sys.argv[1]) * 2**30)))
want = hashlib.sha256(buf).hexdigest()
def check(*_):
    with open(sys.argv[2], "a") as out:
        out.write(("ok " if hashlib.sha256(buf).hexdigest() == want else "BAD ") + want + "\n")
signal.signal(signal.SIGUSR1, check)
with open(sys.argv[2], "a") as out:
    out.write("ready " + want + "\n")
while True:
    time.sleep(1)
"""


def _size(text: str) -> int | None:
    if text == "default":
        return None
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1].upper(), 1)
    return int(float(text.rstrip("KkMmGg")) * mult)


def _wait_line(path: Path, prefix: str, count: int, timeout: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if sum(1 for line in lines if line.startswith(prefix)) >= count or any(line.startswith("BAD") for line in lines):
            return lines
        time.sleep(0.05)
    raise SystemExit(f"the holder wrote no {prefix!r} line in {timeout:.0f} s ({path})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=2.0, help="GiB the holder keeps (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="restores per side (default 5)")
    ap.add_argument("--pipes", default="default,1M,4M", help="pipe capacities for the stream sides, comma-separated")
    ap.add_argument("--json", type=Path, help="write the per-round figures here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("stream_pipe.py needs root (CRIU)")
    pipes = args.pipes.split(",")
    sides = ["files"] + [f"stream {p}" for p in pipes]
    work = Path(tempfile.mkdtemp(prefix="warmctl-stream-pipe-", dir="/var/tmp"))
    restored: list[int] = []
    launcher = None
    try:
        log = work / "holder.log"
        launcher = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", HOLDER, str(args.size), str(log)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        digest = _wait_line(log, "ready ", 1, 600)[-1].split()[1]
        root = psutil.Process(launcher.pid).children()[0].pid
        img = work / "entry" / stream.IMAGES
        dump_s = criu.dump(root, img)
        launcher.wait(30)
        image_bytes = sum(f.stat().st_size for f in img.iterdir())
        sizes = {f"{stream.IMAGES}/{f.name}": f.stat().st_size for f in img.iterdir()}
        pages = max(sizes, key=sizes.get)  # the holder's memory: served whole to every stream side
        print(f"holder {args.size:g} GiB dumped in {dump_s:.1f} s: image {image_bytes / 2**30:.2f} GiB in {len(sizes)} files")
        times: dict[str, list[float]] = {s: [] for s in sides}
        for rnd in range(args.rounds):
            order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
            for side in order:
                log.write_text("")
                pidfile = work / "pid"
                pidfile.unlink(missing_ok=True)
                if side == "files":
                    pid, secs = criu.restore(img, pidfile, log_file=work / "restore.log", work_dir=work)
                    restored.append(pid)
                else:
                    stream.PIPE_BYTES = _size(side.split()[1])
                    sock = work / "s"
                    sock.mkdir(mode=0o700, exist_ok=True)
                    with stream.ImageStreamer(sizes, sock) as st:
                        st.complete(work / "entry")
                        pid, secs = criu.restore(sock, pidfile, log_file=work / "restore.log", work_dir=work, stream=True)
                        restored.append(pid)
                        rep = st.close()
                    if not (all(rep.served[n] == sizes[n] for n in rep.served) and pages in rep.served):
                        raise SystemExit(f"{side}: CRIU was not served the whole image: {rep}")
                os.kill(pid, signal.SIGUSR1)
                lines = _wait_line(log, "ok ", 1, 120)
                if lines[-1] != f"ok {digest}":
                    raise SystemExit(f"{side}: the restored holder's memory is not what was dumped: {lines[-1]}")
                kill_tree(ProcessId.of(pid))
                restored.remove(pid)
                times[side].append(secs)
                print(f"round {rnd + 1} {side:>14}: {secs:6.2f} s", flush=True)
        print(f"\n{'side':>14}  median s   GiB/s   / files (median of rounds)")
        out = {"size_gib": args.size, "image_bytes": image_bytes, "rounds": args.rounds, "times_s": times, "ratios": {}}
        for side in sides:
            med = statistics.median(times[side])
            ratio = statistics.median(t / f for t, f in zip(times[side], times["files"]))
            out["ratios"][side] = ratio
            print(f"{side:>14}  {med:8.2f}  {image_bytes / 2**30 / med:6.2f}   {ratio:.2f}")
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
    finally:
        if launcher is not None and launcher.poll() is None:  # failed before the dump: the holder runs
            for p in psutil.Process(launcher.pid).children(recursive=True):
                p.kill()
            launcher.kill()
            launcher.wait(30)
        for pid in restored:
            ident = ProcessId.of(pid)
            if ident is not None:
                kill_tree(ident)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
