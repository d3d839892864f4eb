"""``pull`` into a local store: per-chunk fsyncs (old) against bounded batches (new), interleaved.

A synthetic snapshot ``synth:latest`` (``--chunks`` chunks of 4 MiB, 512 = 2 GiB logical, none
zero; each chunk ``--random-kib`` random bytes, the rest repeated text, so that it stores at
about the 20% of tiny's CRIU pages: 1.4 GiB non-zero -> 296 MiB) is published to a directory
remote and (unless ``--no-rgw``) to a one-node Ceph RGW on loopback (``tests/rgw_server.py``,
memstore). Then, ``--rounds`` times, each variant pulls it into an empty local store, in a
child process (``fleet.transfer``, what ``warmctl pull`` runs, timed inside the child: no
interpreter start-up), the order rotated each round, ``sync`` before each run:

- ``old``: the checkout given by ``--old DIR`` (e.g. ``git worktree add --detach /tmp/old <commit>``),
  whose ``copy_manifest`` fsyncs each chunk and its directory;
- ``new``: this checkout (commit when :data:`~warmctl.store.copy.COMMIT_CHUNKS` are pending or
  :data:`~warmctl.store.copy.COMMIT_SECONDS` after a batch's first save);
- ``new T=<s>`` for each ``--seconds`` value: this checkout with ``COMMIT_SECONDS`` set to it
  (``inf``: bounded by count only, the variant tried and left before);

Reported per remote: every round's seconds, the median, and each variant's median over
``old``'s. Prints ``uptime`` before and
after (the host is shared).

Usage::

    python benchmarks/pull_batch.py --old /tmp/old [--rounds 3] [--chunks 512] [--seconds 0.25,2,inf]
        [--no-rgw] [--work DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
CH = 4 << 20

CHILD = r"""
import json, resource, sys, time
import warmctl, warmctl.store.copy as cp
from warmctl.naming.catalog import Ref
from warmctl.naming.fleet import entries_to_copy, transfer
from warmctl.records.config import load_settings
from warmctl.store import open_store
if sys.argv[3] != "-":
    cp.COMMIT_SECONDS = float(sys.argv[3])
settings = load_settings()  # an edge: the S3 endpoint from $WARMCTL_S3_ENDPOINT
src, dst = open_store(sys.argv[1], settings=settings), open_store(sys.argv[2], settings=settings)
t0 = time.monotonic()
[c] = transfer(src, dst, entries_to_copy(src, Ref(name="synth")))
dst.close()
s = time.monotonic() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": s, "copied": c.report.chunks_copied, "stored_bytes": c.report.bytes_copied,
                  "cpu_s": ru.ru_utime + ru.ru_stime, "warmctl": warmctl.__file__}))
"""


def payload(path: Path, chunks: int, random_kib: int) -> Path:
    """``chunks`` chunks of 4 MiB: ``random_kib`` KiB of random bytes, then repeated text."""
    rnd = random.Random(27)
    words = [b"token", b"engine", b"kv-cache", b"llama", b"vllm", b"page", b"\n"]
    text = b" ".join(rnd.choice(words) for _ in range(12000))
    filler = (text * (CH // len(text) + 1))[:CH]
    r = random_kib << 10
    with open(path, "wb") as f:
        for i in range(chunks):
            f.write(rnd.randbytes(r) + filler[r:])
    return path


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--old", required=True, help="an old warmctl checkout (its root)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--random-kib", type=int, default=800)
    ap.add_argument("--seconds", default="0.25,2,inf", help="extra COMMIT_SECONDS values for this checkout")
    ap.add_argument("--no-rgw", action="store_true")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from test_store_fixtures import snapshot

    from warmctl.store import open_store
    from warmctl.naming.catalog import Ref
    from warmctl.naming.fleet import entries_to_copy, transfer

    work = Path(a.work or f"/tmp/pull-batch-{uuid.uuid4().hex[:6]}")
    work.mkdir(parents=True, exist_ok=True)
    variants = [("old", a.old, "-"), ("new", str(ROOT), "-")] + [(f"new T={t}", str(ROOT), t) for t in a.seconds.split(",") if t]
    res: dict = {"uptime_start": uptime(), "variants": [v[0] for v in variants], "rounds": {}}
    print(res["uptime_start"], flush=True)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        t = time.monotonic()
        f = payload(work / "pages-1.img", a.chunks, a.random_kib)
        with open_store(work / "a") as s:
            d = snapshot(s, "synth", {"pages-1.img": f})
            stored = sum(o.size for o in s.backend.list("chunks/"))
        f.unlink()
        res.update(logical=a.chunks * CH, stored=stored, manifest=d)
        print(f"snapshot: {a.chunks} chunks, {a.chunks * CH / 2**30:.2f} GiB logical, {stored / 2**20:.0f} MiB stored "
              f"({time.monotonic() - t:.0f} s to build)", flush=True)
        remotes = [("dir", str(work / "remote"), {})]
        if not a.no_rgw:
            import boto3
            from rgw_server import free_port, start_rgw

            ep, ak, sk = stack.enter_context(start_rgw(work / "ceph", free_port(), free_port(), capacity_bytes=int(stored * 1.5) + (1 << 30),
                                                       timeout=120))
            env = {"WARMCTL_S3_ENDPOINT": ep, "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk, "AWS_DEFAULT_REGION": "us-east-1"}
            os.environ.update(env)
            bucket = f"pull-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=ep, aws_access_key_id=ak, aws_secret_access_key=sk, region_name="us-east-1").create_bucket(Bucket=bucket)
            remotes.append(("rgw", f"s3://{bucket}/warmctl", env))
        with open_store(work / "a") as s:
            for kind, url, _ in remotes:
                from warmctl.records.config import load_settings

                with open_store(url, settings=load_settings()) as r:
                    transfer(s, r, entries_to_copy(s, Ref(name="synth")))
        for kind, url, env in remotes:
            rows: dict[str, list[dict]] = {v[0]: [] for v in variants}
            for rnd in range(a.rounds):
                order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
                for label, tree, secs in order:
                    dst = work / "dst"
                    shutil.rmtree(dst, ignore_errors=True)
                    os.sync()
                    e = dict(os.environ, PYTHONPATH=tree, **env)
                    r = subprocess.run([sys.executable, "-c", CHILD, url, str(dst), secs], env=e, capture_output=True, text=True,
                                       timeout=1800, cwd=tree)
                    if r.returncode != 0:
                        raise SystemExit(f"{label} pull from {kind} failed:\n{r.stderr}")
                    out = json.loads(r.stdout.strip().splitlines()[-1])
                    assert out["warmctl"].startswith(tree), (label, out["warmctl"])
                    out["load1"] = os.getloadavg()[0]
                    rows[label].append(out)
                    print(f"{kind} round {rnd + 1} {label:12s} {out['s']:6.2f} s  cpu {out['cpu_s']:5.2f} s  "
                          f"{out['stored_bytes'] / 2**20 / out['s']:6.1f} MiB/s stored  load {out['load1']:.2f}", flush=True)
                    shutil.rmtree(dst, ignore_errors=True)
            res["rounds"][kind] = rows
            base = statistics.median(x["s"] for x in rows["old"])
            print(f"\n{kind}: medians of {a.rounds} (ratio = old / variant, >1 faster)")
            for label, _, _ in variants:
                m = statistics.median(x["s"] for x in rows[label])
                print(f"  {label:12s} {m:6.2f} s   x{base / m:5.2f}   rounds " + " / ".join(f"{x['s']:.2f}" for x in rows[label]))
            print(flush=True)
    res["uptime_end"] = uptime()
    print(res["uptime_end"])
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
