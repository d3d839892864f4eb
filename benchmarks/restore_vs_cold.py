"""Cold start vs ``warmctl up`` from the local store: time to the first *correct* token.

Both sides run in one process, interleaved (this machine is shared and noisy; the ratio of
medians is the result, not the absolute seconds):

- **cold**: what an operator does without warmctl: launch ``vllm serve`` for the profile
  (``tiny``, or ``tiny-tp2``: the same at tensor parallel 2; same flags, same launcher, the
  ranks' CPU binding warmctl would give them) and send the first canary prompt until a token
  comes back.
- **restore**: ``warmctl up NAME`` (the real CLI, from the local store: materialize, CRIU
  restore, the ranks checked, canary, gate), then the same request on the public port.

"Correct" means the returned token id equals the first token of the snapshot's canary record.
Usage::

    python benchmarks/restore_vs_cold.py [--runs 3] [--keep-home DIR] [--profile tiny --profile tiny-tp2]

Prints one line per run and a summary with medians and the ratio cold/restore, per profile
(several ``--profile``: one after the other in one run, the same home).
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

ENGINE_PORT, GATE_PORT = 18600, 18680


def setup(home_root: Path, engine_port: int = ENGINE_PORT, gate_port: int = GATE_PORT) -> dict[str, str]:
    # the test suite's isolated config, on this script's ports, with tiny-tp2 beside tiny
    from tests.conftest import isolated_env, tp2_env

    return tp2_env(isolated_env(home_root, engine_port, gate_port), engine_port, gate_port)


def wc(env, *args, check=True):
    r = subprocess.run([sys.executable, "-m", "warmctl", *args], env=env, capture_output=True, text=True)
    if check and r.returncode:
        sys.exit(f"warmctl {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r


def first_token(port: int, prompt: str, deadline_s: float = 900, model: str = "tiny") -> tuple[int, float]:
    """Poll until the engine on ``port`` answers ``prompt`` with one token; (token id, time)."""
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
            time.sleep(0.05)
    raise TimeoutError(f"no token from port {port} within {deadline_s} s")


def stop_cold(eng) -> None:
    """Stop a cold engine like ``warmctl down`` does (:meth:`warmctl.engine.run.EngineRun.teardown`:
    the tree killed, every ``/dev/shm`` file it mapped or held open removed, by inode too)."""
    from warmctl.engine.run import EngineRun

    run = EngineRun(Path(eng.log_path).parent / "run", "cold", eng.port, log_path=eng.log_path)
    run.set_root(eng.root_pid)
    run.teardown()
    if eng.launcher is not None:
        eng.launcher.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each side (default 3)")
    ap.add_argument("--keep-home", type=Path, default=None, help="reuse/keep this work dir (its snapshot)")
    ap.add_argument("--engine-port", type=int, default=ENGINE_PORT)
    ap.add_argument("--gate-port", type=int, default=GATE_PORT)
    ap.add_argument("--profile", action="append", choices=("tiny", "tiny-tp2"), default=None,
                    help="profile to measure (repeat for several; default tiny)")
    a = ap.parse_args()
    a.profile = a.profile or ["tiny"]
    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-bench-"))
    try:
        run(a, root)
    finally:
        if a.keep_home is None:  # the store of a throwaway home (a 2.7 GiB snapshot) goes too
            shutil.rmtree(root, ignore_errors=True)


def run(a, root: Path) -> None:
    env = setup(root, a.engine_port, a.gate_port)
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    results = {name: run_profile(a, root, env, name) for name in a.profile}
    if len(results) > 1:
        print("\n" + "\n".join(f"{n}: cold {c:.2f} s, up {r:.2f} s, {c / r:.1f}x" for n, (c, r) in results.items()))


def run_profile(a, root: Path, env: dict[str, str], name: str) -> tuple[float, float]:
    """Both sides for profile ``name``; (median cold, median up) in seconds."""
    from warmctl.records.config import load_settings
    from warmctl.records.profile import load_profile
    from warmctl.naming.catalog import Catalog
    from warmctl.engine.cold import resolve_model
    from warmctl.store import open_store

    settings = load_settings()
    prof = load_profile(name, settings.profile_dirs)
    store = open_store(settings.store_dir)
    if Catalog(store).newest(name) is None:
        print(f"making the snapshot once (warmctl snapshot {name}) ...", flush=True)
        wc(env, "snapshot", name, "--quiet")
    manifest = store.get_manifest(Catalog(store).newest(name))
    prompt = manifest.canary.completions[0].prompt
    expected = manifest.canary.completions[0].token_ids[0]
    model = resolve_model(prof, settings.models_dir)

    cold, restore = [], []
    try:
        measure(a, env, root, prof, model, prompt, expected, cold, restore)
    finally:
        wc(env, "down", name, check=False)
    mc, mr = statistics.median(cold), statistics.median(restore)
    print(f"\n{name}: median over {a.runs} runs: cold {mc:.2f} s, warmctl up {mr:.2f} s, ratio cold/up = {mc / mr:.1f}x")
    print(f"{name}: snapshot {manifest.total_size() / 2**30:.2f} GiB logical")
    return mc, mr


def measure(a, env, root, prof, model, prompt, expected, cold, restore) -> None:
    from warmctl.engine import vllm
    from warmctl.engine.cold import launch_env

    name, served = prof.name, prof.engine.served_model_name
    for i in range(a.runs):
        wc(env, "down", name)
        t0 = time.monotonic()
        eng = vllm.start(prof, model, root / f"cold-{name}-{i}.log", env=launch_env(prof))
        try:
            tok, t1 = first_token(prof.engine.port, prompt, model=served)
        finally:
            stop_cold(eng)
        assert tok == expected, f"cold engine's first token {tok} != canary {expected}"
        cold.append(t1 - t0)
        print(f"run {i}: cold start -> first correct token {cold[-1]:7.2f} s", flush=True)
        time.sleep(2)

        t0 = time.monotonic()
        wc(env, "up", name)
        tok, t1 = first_token(a.gate_port, prompt, model=served)
        assert tok == expected, f"restored engine's first token {tok} != canary {expected}"
        restore.append(t1 - t0)
        status = json.loads(wc(env, "status", name, "--json").stdout)[0]
        wc(env, "down", name)
        phases = ", ".join(f"{k} {v:.2f}" for k, v in (status.get("timings") or {}).items())
        print(f"run {i}: warmctl up  -> first correct token {restore[-1]:7.2f} s ({phases})", flush=True)
        time.sleep(2)


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
