"""Agent under load: many concurrent status and metrics requests while a restore runs.

Starts ``warmctl agent`` (a subprocess, with the config in ``$WARMCTL_CONFIG`` or
``--config``, whose store must hold ``NAME:latest``), then alternates runs *without* load and
*with* load. A run is ``POST /v1/engines/NAME/up``, wait for the job, ``POST .../down``. During
a loaded run ``--concurrency`` clients send ``GET /v1/engines/NAME`` and ``GET /metrics``
(half each) back to back, from just before the ``up`` until its job ends. Reports, per mode,
the restore time (the job's ``total`` from ``up``'s phase timings, and the wall time from POST
to the job's end), and for the load: requests, failures (non-200 or transport error), p50/p99
latency and requests per second.

    python benchmarks/agent_load.py --config /path/config.toml --runs 3 --concurrency 32

Prints a Markdown table; ``--json FILE`` writes every number. Leaves nothing running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port(start: int = 19590, end: int = 19600) -> int:
    for p in range(start, end):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise SystemExit("no free port in 19590-19599")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def wait_job(c: httpx.AsyncClient, job_id: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        j = (await c.get(f"/v1/jobs/{job_id}", params={"log_lines": 0})).json()
        if j["state"] not in ("queued", "running"):
            return j
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} did not finish in {timeout} s")
        await asyncio.sleep(0.1)


async def one_run(url: str, token: str, name: str, concurrency: int) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    lat: list[float] = []
    fails: list[str] = []
    stop = asyncio.Event()

    async def worker(i: int, c: httpx.AsyncClient) -> None:
        path = f"/v1/engines/{name}" if i % 2 == 0 else "/metrics"
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await c.get(path)
                ok = r.status_code == 200
                if not ok:
                    fails.append(f"{path}: HTTP {r.status_code}")
            except httpx.HTTPError as e:
                ok = False
                fails.append(f"{path}: {type(e).__name__}")
            if ok:
                lat.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as ctl, \
            httpx.AsyncClient(base_url=url, headers=headers, timeout=30, limits=limits) as load:
        tasks = [asyncio.create_task(worker(i, load)) for i in range(concurrency)]
        t_load0 = time.perf_counter()
        await asyncio.sleep(0.5 if concurrency else 0)
        t0 = time.perf_counter()
        r = await ctl.post(f"/v1/engines/{name}/up", json={})
        r.raise_for_status()
        job = await wait_job(ctl, r.json()["id"])
        wall = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*tasks)
        load_s = time.perf_counter() - t_load0
        if job["state"] != "succeeded":
            raise SystemExit(f"up failed: {job['error']}")
        if job["result"]["path"] != "restore":
            raise SystemExit(f"up took the {job['result']['path']} path ({job['result']['reason']}); need a snapshot")
        d = await ctl.post(f"/v1/engines/{name}/down")
        dj = await wait_job(ctl, d.json()["id"])
        if dj["state"] != "succeeded":
            raise SystemExit(f"down failed: {dj['error']}")
    timings = job["result"]["timings"]
    return {"restore_total_s": timings.get("total"), "timings": timings, "wall_s": wall, "requests": len(lat) + len(fails),
            "failures": len(fails), "failure_samples": fails[:5], "latencies": lat,
            "rps": (len(lat) + len(fails)) / load_s if concurrency else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="warmctl config file (default: $WARMCTL_CONFIG)")
    ap.add_argument("--name", default="tiny")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (alternating)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--json", help="write all numbers here")
    a = ap.parse_args()

    env = dict(os.environ)
    if a.config:
        env["WARMCTL_CONFIG"] = a.config
    os.environ.update({"WARMCTL_CONFIG": env.get("WARMCTL_CONFIG", "")})
    from warmctl.records.config import load_settings

    settings = load_settings()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(settings.home / f"agent-bench-{port}.log", "w")
    agent = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(port)], env=env,
                             stdout=log, stderr=subprocess.STDOUT)
    results: dict[str, list[dict]] = {"no load": [], "load": []}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"agent did not start; see {log.name}")
            time.sleep(0.2)
        token = (settings.agent_token_file or settings.home / "agent" / "token").read_text().strip()
        for i in range(a.runs):
            for mode in (("no load", "load") if i % 2 == 0 else ("load", "no load")):
                res = asyncio.run(one_run(url, token, a.name, a.concurrency if mode == "load" else 0))
                results[mode].append(res)
                print(f"run {i + 1} {mode:8s}: restore {res['restore_total_s']:.2f} s, wall {res['wall_s']:.2f} s, "
                      f"{res['requests']} requests, {res['failures']} failures", file=sys.stderr, flush=True)
    finally:
        agent.terminate()
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
        subprocess.run([sys.executable, "-m", "warmctl", "down", a.name], env=env, capture_output=True)
        log.close()

    base = [r["restore_total_s"] for r in results["no load"]]
    loaded = [r["restore_total_s"] for r in results["load"]]
    base_w = [r["wall_s"] for r in results["no load"]]
    loaded_w = [r["wall_s"] for r in results["load"]]
    lat = [x for r in results["load"] for x in r["latencies"]]
    reqs = sum(r["requests"] for r in results["load"])
    fails = sum(r["failures"] for r in results["load"])
    rps = statistics.mean(r["rps"] for r in results["load"])
    slow = statistics.median(loaded) / statistics.median(base) - 1
    slow_w = statistics.median(loaded_w) / statistics.median(base_w) - 1
    print(f"\n| | no load | with load ({a.concurrency} clients) |\n|---|---|---|")
    print(f"| restore `total` (median of {a.runs}), s | {statistics.median(base):.2f} "
          f"({', '.join(f'{x:.2f}' for x in base)}) | {statistics.median(loaded):.2f} "
          f"({', '.join(f'{x:.2f}' for x in loaded)}) |")
    print(f"| POST up -> job end (median), s | {statistics.median(base_w):.2f} | {statistics.median(loaded_w):.2f} |")
    print(f"| slowdown (total / wall) | | {100 * slow:+.1f} % / {100 * slow_w:+.1f} % |")
    print(f"| status+metrics requests | | {reqs} ({rps:.0f}/s), {fails} failed |")
    print(f"| latency p50 / p99 | | {1000 * pct(lat, 0.5):.1f} ms / {1000 * pct(lat, 0.99):.1f} ms |")
    if a.json:
        for rs in results.values():
            for r in rs:
                r["latency_p50_ms"] = 1000 * pct(r["latencies"], 0.5)
                r["latency_p99_ms"] = 1000 * pct(r["latencies"], 0.99)
                del r["latencies"]
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": results, "slowdown": slow,
                                            "slowdown_wall": slow_w, "requests": reqs, "failures": fails,
                                            "p50_ms": 1000 * pct(lat, 0.5), "p99_ms": 1000 * pct(lat, 0.99),
                                            "rps": rps}, indent=2))


if __name__ == "__main__":
    from warmctl.bench.shm import as_found

    with as_found(Path(__file__).stem):  # leaves /dev/shm as it found it, or exits 1 naming what it left
        main()
