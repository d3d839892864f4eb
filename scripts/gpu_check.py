"""Snapshot and restore a CUDA PyTorch server with warmctl's CRIU and CUDA pieces; check that
the restored server answers bit for bit as before. Run by scripts/gpu-check.sh (root, one
NVIDIA GPU, driver 570+, CRIU 4.2+). Prints one JSON line of results and exits 0 on success.

Phases (seconds): server cold start (CUDA init + graph capture), weights saved with warmctl's
worker extension and zeroed in place, CUDA lock and checkpoint (warmctl.checkpoint.ranks), criu
dump / restore (warmctl.checkpoint.criu), free-memory check, CUDA restore and unlock, weights
loaded back in place (GB/s), first answer after restore.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from warmctl.checkpoint import criu, cuda, nvml, ranks  # noqa: E402

PROMPTS = [[1, 2, 3], [17, 99, 5, 240, 7], list(range(40, 72))]


def post(port: int, prompt: list[int], n: int = 32, timeout: float = 30, path: str = "/generate", body: dict | None = None) -> dict:
    data = json.dumps(body if body is not None else {"prompt": prompt, "n": n}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def weights(port: int, op: str, directory: Path) -> dict:
    return post(port, [], path="/weights", body={"op": op, "dir": str(directory)}, timeout=120)


def wait_health(port: int, timeout: float, proc: subprocess.Popen | None = None) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"server not healthy after {timeout} s")


def child_of(pid: int, timeout: float = 10) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        kids = [p for p in ranks.tree_pids(pid) if p != pid]
        if kids:
            return min(kids)
        time.sleep(0.05)
    raise SystemExit(f"no child under {pid}")


def answers(port: int) -> list[dict]:
    return [post(port, p) for p in PROMPTS]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--port", type=int, default=18777)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    res: dict = {"driver": nvml.driver_version(), "gpus": [g.uuid for g in nvml.gpus()]}
    api = cuda.load()
    res["api"], res["cuda_driver_version"] = api.kind, api.driver_version
    t = res.setdefault("seconds", {})

    log = open(a.work / "server.log", "a")
    inner = [sys.executable, str(Path(__file__).with_name("gpu_check_server.py")), str(a.port)]
    cmd = [sys.executable, "-m", "warmctl.engine.launch", "--", "unshare", "--pid", "--fork", "setsid", *inner]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    launcher = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    restored_root = None
    try:
        t["cold_start"] = wait_health(a.port, 120, launcher)
        root = child_of(launcher.pid)  # PID 1 of the engine's PID namespace: the dump root
        before = answers(a.port)
        again = answers(a.port)
        assert [x["tokens"] for x in before] == [x["tokens"] for x in again], "server is not deterministic"
        assert [x["logits_sha256"] for x in before] == [x["logits_sha256"] for x in again]
        pids = ranks.gpu_rank_pids(root)
        res["ranks"] = pids
        assert pids, f"no GPU process found in the tree of {root}"
        saved = weights(a.port, "save", a.work / "weights")
        t["weights_save"] = saved["seconds"]
        weights(a.port, "zero", a.work / "weights")
        res["zeroed_answer_differs"] = post(a.port, PROMPTS[0])["logits_sha256"] != before[0]["logits_sha256"]

        with ranks.checkpoint_ranks(pids, lock_timeout_s=30, api=api) as snap:
            t["criu_dump"] = criu.dump(root, a.work / "img")
        launcher.wait(timeout=30)
        t["cuda_lock"], t["cuda_checkpoint"] = snap.phases["lock"], snap.phases["checkpoint"]
        res["gpu_bytes"] = snap.gpu_bytes
        res["image_bytes"] = sum(f.stat().st_size for f in (a.work / "img").iterdir() if f.is_file())

        t0 = time.monotonic()
        restored_root, t["criu_restore"] = criu.restore(a.work / "img", a.work / "restore.pid")
        new = ranks.restored_ranks(restored_root, snap.nspids)
        rr = ranks.restore_ranks(new, required_free_bytes=snap.gpu_bytes, restore_timeout_s=120, api=api)
        t.update({"precheck": rr.phases.get("precheck", 0.0), "cuda_restore": rr.phases["restore"],
                  "cuda_unlock": rr.phases["unlock"]})
        loaded = weights(a.port, "load", a.work / "weights")
        t["weights_load"] = loaded["seconds"]
        res["weights_bytes"] = loaded["bytes"]
        res["weights_load_gb_per_s"] = round(loaded["bytes"] / 1e9 / max(loaded["seconds"], 1e-9), 2)
        first = post(a.port, PROMPTS[0])
        t["first_answer_after_restore"] = time.monotonic() - t0
        after = [first] + [post(a.port, p) for p in PROMPTS[1:]]
        res["bit_identical"] = ([x["tokens"] for x in after] == [x["tokens"] for x in before]
                                and [x["logits_sha256"] for x in after] == [x["logits_sha256"] for x in before])
        res["gpu_state_survived"] = after[0]["served"] == again[-1]["served"] + 2  # +1: the zeroed probe
        ok = res["bit_identical"] and res["gpu_state_survived"] and res["zeroed_answer_differs"]
        res["ok"] = ok
        return 0 if ok else 1
    except BaseException as e:  # report, then clean up
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        return 1
    finally:
        print(json.dumps(res), flush=True)
        for p in (restored_root, launcher.pid):
            if p:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    sys.exit(main())
