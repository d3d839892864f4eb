"""What the engine's CPU binding is worth after a restore: the same restored engine serving the
same streaming requests with the binding ``up`` puts back, and without it (as CRIU alone leaves
every thread: on any CPU), side by side.

CRIU does not restore thread affinity; ``up`` re-applies what the snapshot recorded
(:mod:`warmctl.checkpoint.affinity`). With ``tiny`` up (this script snapshots it if needed and
brings it up in its own work dir), for each concurrency level C (``--concurrency 8,64``) it runs
``--rounds`` rounds; a round sets the engine's threads to one state and sends C streaming
completions (``--max-tokens`` tokens, ``ignore_eos``) straight to the engine's port, then the
other state, the state that goes first alternating. Per state: TTFT and ITL medians over
requests, tokens/s median over rounds (as ``gate_overhead.py`` measures them), and the ratios
unbound/bound.

Usage::

    python benchmarks/cpu_binding.py [--concurrency 8,64] [--rounds 6] [--max-tokens 32] [--keep-home DIR]

Ports: $WARMCTL_TEST_ENGINE_PORT / $WARMCTL_TEST_GATE_PORT when set (else 18600/18680). The
engine is brought down at the end (also on Ctrl-C or SIGTERM); the binding is put back before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gate_overhead import ENGINE_PORT, GATE_PORT, one_round  # noqa: E402
from restore_vs_cold import wc  # noqa: E402

SIDES = ("bound", "unbound")


def unbind(root_pid: int) -> int:
    """Every thread of ``root_pid``'s tree onto every CPU this process may use (what a CRIU
    restore leaves); returns how many threads."""
    from warmctl.checkpoint.affinity import tree_threads

    everywhere = os.sched_getaffinity(0)
    n = 0
    for tid, _ in list(tree_threads(root_pid)):
        try:
            os.sched_setaffinity(tid, everywhere)
            n += 1
        except OSError:
            pass
    return n


async def measure(root_pid: int, recorded: dict, levels: list[int], rounds: int, max_tokens: int, port: int) -> dict:
    from warmctl.checkpoint import affinity

    def set_state(side: str) -> None:
        if side == "bound":
            done = affinity.apply(root_pid, recorded)
            if done.note():
                raise SystemExit(f"cannot put the binding back: {done.note()}")
        else:
            unbind(root_pid)

    out = {}
    for conc in levels:
        res = {k: {"ttft": [], "itl": [], "tput": []} for k in SIDES}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300,
                                     limits=httpx.Limits(max_connections=conc, max_keepalive_connections=conc)) as c:
            for side in SIDES:  # warm the connections and both states
                set_state(side)
                await one_round(c, "/v1/completions", conc, max_tokens)
            for r in range(rounds):
                for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    set_state(side)
                    got, tps = await one_round(c, "/v1/completions", conc, max_tokens)
                    res[side]["ttft"] += [x[0] for x in got]
                    res[side]["itl"] += [x[1] for x in got]
                    res[side]["tput"].append(tps)
        out[conc] = {k: {"ttft_ms": 1e3 * statistics.median(v["ttft"]), "itl_ms": 1e3 * statistics.median(v["itl"]),
                         "tok_s": statistics.median(v["tput"])} for k, v in res.items()}
    set_state("bound")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="8,64", help="concurrent streams per round, comma-separated levels")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per state and level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--keep-home", type=Path, default=None)
    a = ap.parse_args()
    from tests.conftest import isolated_env

    root = a.keep_home or Path(tempfile.mkdtemp(prefix="warmctl-binding-"))
    root.mkdir(parents=True, exist_ok=True)
    env = isolated_env(root, ENGINE_PORT, GATE_PORT)
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    from warmctl.naming.catalog import Catalog
    from warmctl.records.config import load_settings
    from warmctl.records.state import load as load_state
    from warmctl.store import open_store

    settings = load_settings()
    try:
        store = open_store(settings.store_dir)
        if Catalog(store).newest("tiny") is None:
            print("making the snapshot once (warmctl snapshot tiny) ...", flush=True)
            wc(env, "snapshot", "tiny", "--quiet")
        digest = Catalog(store).newest("tiny")
        recorded = store.get_manifest(digest).restore.cpu_affinity
        if not recorded:
            raise SystemExit(f"the snapshot {digest} recorded no bound thread (made before warmctl recorded "
                             f"CPU binding, or on a 1-CPU host): use a fresh --keep-home")
        wc(env, "up", "tiny")
        st = load_state(settings.run_dir, "tiny")
        print(f"engine pid {st.root_pid}; bound at snapshot time: "
              f"{', '.join(f'{len(t)} thread(s) on CPUs {c}' for c, t in recorded.items())}", flush=True)
        res = asyncio.run(measure(st.root_pid, recorded, [int(x) for x in a.concurrency.split(",")], a.rounds,
                                  a.max_tokens, ENGINE_PORT))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        wc(env, "down", "tiny", "--now", check=False)
        if a.keep_home is None:
            shutil.rmtree(root, ignore_errors=True)
    for conc, by in res.items():
        b, u = by["bound"], by["unbound"]
        print(f"{conc} concurrent streams, {a.rounds} rounds x {conc} requests per state, {a.max_tokens} tokens each:")
        for k, v in by.items():
            print(f"  {k:>8}: TTFT {v['ttft_ms']:8.2f} ms  ITL {v['itl_ms']:7.2f} ms  {v['tok_s']:8.1f} tok/s")
        print(f"  unbound/bound: x{u['ttft_ms'] / b['ttft_ms']:.3f} TTFT, x{u['itl_ms'] / b['itl_ms']:.3f} ITL, "
              f"x{u['tok_s'] / b['tok_s']:.3f} tok/s")
    print(json.dumps({str(k): v for k, v in res.items()}))


if __name__ == "__main__":
    from warmctl.bench.shm import run

    run(main, Path(__file__).stem)  # /dev/shm left as found; SIGTERM cleans up like Ctrl-C (main's finally)
