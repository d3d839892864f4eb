"""``warmctl up`` vs a raw ``criu restore`` of the same image: time to the first *correct* token.

The raw restore is the floor that orchestration adds to (``../shared/DESIGN.md``: "measure `up`
against the raw floor on the same image"). Both sides run in one process, alternating, on one
snapshot of the ``tiny`` profile, or ``--profile tiny-tp2`` (tensor parallel 2; the raw side
restores it under the host's CRIU network lock, as ``up`` does) (the machine is shared: the
ratio of medians is the result):

- **raw**: the image is materialized once from the store into a work directory (not timed).
  Before each run the snapshot's ``/dev/shm`` files are put back (not timed: CRIU needs them,
  and they are consumed by the restored tree); then, timed: ``criu restore`` with warmctl's
  flags, and the first canary prompt on the *engine* port, polled until a token comes back.
- **up**: the real ``warmctl up tiny --json`` CLI (a fresh Python process, as a user runs it),
  then the same prompt on the *public* port (the gate). Its ``--json`` phase timings and the
  seconds outside any phase (Python start-up, fingerprint, catalog, pre-flight) are reported.
  ``--restore-pages lazy|eager|auto`` chooses how ``up`` restores the memory (the
  ``restore_pages`` setting, default here ``eager``, as in the numbers recorded before lazy
  restores existed); the raw side is always the eager ``criu restore``, so ``--restore-pages
  lazy`` puts ``up`` with lazy pages beside the raw eager restore.

"Correct" means the returned token id equals the first token of the snapshot's canary record.
Beside the two sides the script measures, in this process, the fixed costs ``up`` pays before
its first phase: the CLI's imports in a fresh interpreter (``python -c "import ..."`` minus
``python -c pass``), the host fingerprint, and the catalog resolution (signature check
included). Each is the median of ``--micro`` repeats.

Usage::

    python benchmarks/up_vs_raw.py [--runs 5] [--keep-home DIR] [--gap 2] [--first-up] [--cold] [--via-agent PORT] \\
        [--restore-pages eager|lazy|auto] [--engine-port 18600 --gate-port 18680] [--json FILE] [--profile tiny-tp2]

Leaves nothing behind: every engine is brought down (``warmctl down`` / the raw tree killed and
its ``/dev/shm`` files removed by inode), and the work directory is removed unless
``--keep-home`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def wc(env, *args, check=True):
    r = subprocess.run([sys.executable, "-m", "warmctl", *args], env=env, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"warmctl {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def first_token(port: int, prompt: str, model: str, deadline_s: float = 300) -> tuple[int, float]:
    """Poll until the engine on ``port`` answers ``prompt`` with one token: (token id,
    ``time.monotonic()`` when it came). Polls every 10 ms (connection refused is instant)."""
    t_end = time.monotonic() + deadline_s
    with httpx.Client(timeout=30) as c:
        while time.monotonic() < t_end:
            try:
                r = c.post(f"http://127.0.0.1:{port}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "return_token_ids": True, "seed": 0, "ignore_eos": True})
                if r.status_code == 200:
                    return r.json()["choices"][0]["token_ids"][0], time.monotonic()
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
    raise TimeoutError(f"no token from port {port} within {deadline_s} s")


def put_back_shm(store, manifest) -> list[tuple[int, int]]:
    """Write the snapshot's ``/dev/shm`` files (hard links as links); their (st_dev, st_ino)."""
    from warmctl.checkpoint import capture

    written = []
    for f in sorted((f for f in manifest.files if f.role == "shm"), key=lambda f: f.hardlink_to is not None):
        dest = capture.SHM / f.path
        if f.hardlink_to is not None:
            os.link(dest.parent / f.hardlink_to, dest)
        else:
            store.read_file(f.chunks, dest)
            os.chmod(dest, f.mode)
        written.append(dest)
    return [(s.st_dev, s.st_ino) for s in map(os.stat, written)]


def kill_raw(root_pid: int | None, inodes) -> None:
    """Kill a raw-restored tree and remove every /dev/shm file it maps or we wrote (by inode)."""
    from warmctl.checkpoint import capture
    from warmctl.base.proc import ProcessId, kill_tree

    live: set = set()
    root = ProcessId.of(root_pid) if root_pid else None  # read right after criu restore returned it
    if root is not None and root.alive():
        live = capture.shm_inodes_of(root_pid) | {(p.stat().st_dev, p.stat().st_ino)
                                                  for p in capture.referenced_files(root_pid).shm if p.exists()}
        kill_tree(root)
    capture.remove_by_inode(live | {tuple(x) for x in inodes})


def drop_caches() -> None:
    """Empty the page cache (root): the next read of the image comes from the disk."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def micro(n: int, fn) -> float:
    """Median seconds of ``n`` calls of ``fn``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def import_cost(n: int) -> dict[str, float]:
    """Fresh-interpreter seconds: bare start-up; the extra for the CLI (``import_cli_s``:
    warmctl.cli with every command registered and the click command built, what every
    ``warmctl`` pays); the extra for everything ``up`` imports before its first phase
    (``import_cli_and_lifecycle_s``: the CLI plus the modules the ``up`` command imports)."""
    def run(code):
        return lambda: subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    cli_code = "import typer.main, warmctl.cli as c; c._register(); typer.main.get_command(c.app)"
    bare = micro(n, run("pass"))
    cli = micro(n, run(cli_code))
    up_path = micro(n, run(cli_code + "; from warmctl.records.config import load_settings; from warmctl.records.profile import load_profile; "
                                      "from warmctl.records.progress import ConsoleReporter; from warmctl.naming.catalog import Ref; "
                                      "import warmctl.pipelines.lifecycle"))
    help_ = micro(n, lambda: subprocess.run([sys.executable, "-m", "warmctl", "--help"], check=True, capture_output=True,
                                            env={**os.environ, "PYTHONPATH": str(REPO)}))
    return {"python_bare_s": bare, "import_cli_s": cli - bare, "import_cli_and_lifecycle_s": up_path - bare,
            "warmctl_help_s": help_}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs of each side (default 5)")
    ap.add_argument("--keep-home", type=Path, default=None, help="reuse/keep this work dir (its snapshot)")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds of pause after each engine is killed")
    ap.add_argument("--engine-port", type=int, default=18600)
    ap.add_argument("--gate-port", type=int, default=18680)
    ap.add_argument("--micro", type=int, default=5, help="repeats of each fixed-cost measurement")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    ap.add_argument("--first-up", action="store_true",
                    help="remove the kept restore images first, so run 0's up is the first on this host after a pull")
    ap.add_argument("--via-agent", type=int, default=None, metavar="PORT",
                    help="run `warmctl agent` on this loopback port and send up/down through it (WARMCTL_AGENT_URL)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache (sync; echo 3 > /proc/sys/vm/drop_caches) before each run of each side")
    ap.add_argument("--restore-pages", choices=("eager", "lazy", "auto"), default="eager",
                    help="how `up` restores the engine's memory (restore_pages setting; the raw side is always eager)")
    ap.add_argument("--profile", choices=("tiny", "tiny-tp2"), default="tiny",
                    help="the snapshot's profile (tiny-tp2: tensor parallel 2, two ranks; default tiny)")
    a = ap.parse_args()
    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-upraw-"))
    try:
        run_all(a, root)
    finally:
        if a.keep_home is None:
            shutil.rmtree(root, ignore_errors=True)


def run_all(a, root: Path) -> None:
    from tests.conftest import isolated_env, tp2_env

    env = tp2_env(isolated_env(root, a.engine_port, a.gate_port), a.engine_port, a.gate_port)
    env["WARMCTL_RESTORE_PAGES"] = a.restore_pages  # the CLI's and the agent's setting alike
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]

    from warmctl.naming.catalog import Catalog
    from warmctl.checkpoint import criu
    from warmctl.records.config import load_settings
    from warmctl.engine.run import EngineRun
    from warmctl.host import fingerprint
    from warmctl.store import open_store

    name = a.profile
    settings = load_settings()
    store = open_store(settings.store_dir)
    if Catalog(store).newest(name) is None:
        print(f"making the snapshot once (warmctl snapshot {name}) ...", flush=True)
        wc(env, "snapshot", name, "--quiet")
    digest = Catalog(store).newest(name)
    manifest = store.get_manifest(digest)
    prompt = manifest.canary.completions[0].prompt
    expected = manifest.canary.completions[0].token_ids[0]
    model = manifest.profile["engine"]["served_model_name"]

    # fixed costs before up's first phase
    fixed = import_cost(a.micro)
    fixed["fingerprint_s"] = micro(a.micro, lambda: fingerprint(criu=settings.criu))
    fp = fingerprint(criu=settings.criu)
    fixed["catalog_resolve_s"] = micro(a.micro, lambda: Catalog(store).resolve(name, fp, settings.keys_dir))
    fixed["criu_check_s"] = micro(a.micro, lambda: criu.check(settings.criu))
    print("fixed costs (median of %d): " % a.micro + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in fixed.items()),
          flush=True)

    # the raw side's image, written once
    raw_dir = root / "raw"
    images = raw_dir / "images"
    shutil.rmtree(raw_dir, ignore_errors=True)
    images.mkdir(parents=True)
    for f in manifest.files:
        if f.role == "image":
            if f.hardlink_to is not None:
                os.link(images / f.hardlink_to, images / f.path)
            else:
                store.read_file(f.chunks, images / f.path)
                os.chmod(images / f.path, f.mode)
    run = EngineRun(settings.run_dir, name, 0, log_path=manifest.restore.log_path,
                    cwd=manifest.restore.cwd).prepare()  # CRIU reopens the recorded log and cwd
    run.log_path.touch()
    image_bytes = sum(p.stat().st_size for p in images.iterdir())
    subprocess.run(["sync"], check=False)

    if a.first_up:
        shutil.rmtree(Path(settings.home) / "cache" / "images", ignore_errors=True)
    raw, up, raw_criu, up_phases, up_outside = [], [], [], [], []
    up_env, agent = env, None
    if a.via_agent:  # the long-running agent has its imports done; the CLI only sends the request
        up_env = {**env, "WARMCTL_AGENT_URL": f"http://127.0.0.1:{a.via_agent}"}
        agent = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(a.via_agent)], env=env,
                                 stdout=open(root / "agent.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while wc(up_env, "status", check=False).returncode != 0:
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"warmctl agent did not start: {(root / 'agent.log').read_text()[-2000:]}")
            time.sleep(0.2)
    try:
        for i in range(a.runs):
            wc(env, "down", name)
            root_pid, inodes = None, []
            try:
                with criu.host_lock():
                    inodes = put_back_shm(store, manifest)
                    if manifest.restore.tmp_dir:  # the engine's scratch dir: its UNIX sockets are bound there again
                        Path(manifest.restore.tmp_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
                    if a.cold:
                        drop_caches()
                    t0 = time.monotonic()
                    root_pid, secs = criu.restore(images, raw_dir / "engine.pid", log_file=raw_dir / "restore.log",
                                                  binary=settings.criu)
                tok, t1 = first_token(manifest.restore.internal_port or a.engine_port, prompt, model)
            finally:
                kill_raw(root_pid, inodes)
                if manifest.restore.tmp_dir:  # its sockets, so that up binds them afresh
                    shutil.rmtree(manifest.restore.tmp_dir, ignore_errors=True)
            assert tok == expected, f"raw-restored engine's first token {tok} != canary {expected}"
            raw.append(t1 - t0)
            raw_criu.append(secs)
            print(f"run {i}: raw criu restore -> first correct token {raw[-1]:6.2f} s (criu restore {secs:.2f} s)",
                  flush=True)
            time.sleep(a.gap)

            if a.cold:
                drop_caches()
            t0 = time.monotonic()
            try:
                r = wc(up_env, "up", name, "--json")
                t_up = time.monotonic()
                tok, t1 = first_token(a.gate_port, prompt, model)
            finally:
                wc(up_env, "down", name, check=False)
            assert tok == expected, f"restored engine's first token {tok} != canary {expected}"
            res = json.loads(r.stdout)
            if res["path"] != "restore":  # e.g. the venv changed since the snapshot (environment digest)
                raise RuntimeError(f"warmctl up took the {res['path']} path, not a restore: {res['reason']}")
            phases = {k: v for k, v in res["timings_s"].items() if k != "total"}
            up.append(t1 - t0)
            up_phases.append(phases)
            up_outside.append((t_up - t0) - sum(phases.values()))
            print(f"run {i}: warmctl up      -> first correct token {up[-1]:6.2f} s ("
                  + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                  + f", outside phases {up_outside[-1]:.2f}, after up {t1 - t_up:.2f})", flush=True)
            time.sleep(a.gap)
    finally:
        wc(up_env, "down", name, check=False)
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        shutil.rmtree(raw_dir, ignore_errors=True)

    mr, mu = statistics.median(raw), statistics.median(up)
    keys = list(dict.fromkeys(k for p in up_phases for k in p))
    med_phases = {k: statistics.median([p.get(k, 0.0) for p in up_phases]) for k in keys}
    print(f"\nmedian over {a.runs} runs: raw restore {mr:.2f} s (criu restore {statistics.median(raw_criu):.2f} s), "
          f"warmctl up ({a.restore_pages} pages) {mu:.2f} s; ratio up/raw = {mu / mr:.2f}x")
    print("up's phases (medians): " + ", ".join(f"{k} {v:.2f} s" for k, v in med_phases.items())
          + f", outside phases {statistics.median(up_outside):.2f} s")
    print(f"image: {image_bytes / 2**30:.2f} GiB apparent size; snapshot {manifest.total_size() / 2**30:.2f} GiB")
    if a.json:
        a.json.write_text(json.dumps({"raw_s": raw, "raw_criu_restore_s": raw_criu, "up_s": up,
                                      "up_phases_s": up_phases, "up_outside_phases_s": up_outside,
                                      "fixed_s": fixed, "ratio": mu / mr, "restore_pages": a.restore_pages}, indent=1))


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
