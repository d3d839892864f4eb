"""Snapshot and restore a CUDA PyTorch server with warmctl's CRIU and CUDA pieces; check that
the restored server answers bit for bit as before. Run by scripts/gpu-check.sh (root, one
NVIDIA GPU, driver 570+, CRIU 4.2+). Prints one JSON line of results and exits 0 on success.

Phases (seconds): server cold start (CUDA init + graph capture), weights saved with warmctl's
worker extension and zeroed in place, CUDA lock and checkpoint (warmctl.checkpoint.ranks), criu
dump / restore (warmctl.checkpoint.criu), free-memory check, CUDA restore and unlock, weights
loaded back in place (GB/s), first answer after restore.

Time and clean-up: every wait (server start, answers, CUDA lock / checkpoint / restore /
unlock, criu dump / restore) is bounded by what is left of ``--limit`` (gpu-check.sh's
``timeout``) less :data:`CLEANUP_RESERVE_S`. SIGTERM (``timeout``) becomes
:class:`Terminated`, so rollbacks and ``finally`` run. On any exit :class:`Cleanup` brings
every known rank back to RUNNING (nothing left LOCKED in the driver), SIGKILLs each PID
namespace's first process and its tree, then the launchers, and records what it did in the
result line (``cleanup``). ``--imports-only`` checks the imports and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from warmctl.checkpoint import criu, cuda, nvml, ranks  # noqa: E402
from warmctl.base.proc import pid_alive, tree_pids  # noqa: E402
from warmctl.engine import launch  # noqa: E402


class _Knobs:
    """The host paths this script passes down to warmctl's checkpoint modules, read here, at its
    edge, from the variables ``warmctl config show`` documents (``criu``, ``xtile_perm_lib``,
    ``libcuda``, ``cuda_checkpoint``, ``libnvml``). Not warmctl's config loader: the GPU
    machine's venv holds only what the checkpoint modules import (no pydantic)."""

    def __init__(self, env: dict[str, str] | None = None):
        e = os.environ if env is None else env
        self.criu = e.get("WARMCTL_CRIU") or None
        self.xtile_perm_lib = e.get("WARMCTL_XTILE_PERM_LIB") or None
        self.libcuda = e.get("WARMCTL_LIBCUDA") or None
        self.cuda_checkpoint = e.get("WARMCTL_CUDA_CHECKPOINT") or None
        self.libnvml = e.get("WARMCTL_LIBNVML") or None

PROMPTS = [[1, 2, 3], [17, 99, 5, 240, 7], list(range(40, 72))]
#: Seconds kept back from the script's limit for the clean-up and the result line: every wait
#: of the check ends this long before the limit (gpu-check.sh's `timeout`).
CLEANUP_RESERVE_S = 40.0
#: Bound of the whole clean-up (unlock what is locked, kill, wait for the deaths).
CLEANUP_TIMEOUT_S = 25.0


class CheckTimeout(Exception):
    """The check's own time budget ran out before a step could start."""


class Terminated(BaseException):
    """SIGTERM (from `timeout`, or an operator): raised in the main thread so that every
    ``finally`` and context-manager exit (rollback of locked ranks) runs."""


class Budget:
    """Deadline of the check: ``limit_s`` from now, less ``reserve_s`` for the clean-up.
    :meth:`left` gives a step its bound: ``min(want, seconds left)``; raises
    :class:`CheckTimeout` naming the step when under a second is left."""

    def __init__(self, limit_s: float, reserve_s: float = CLEANUP_RESERVE_S):
        self.limit_s = limit_s
        self.end = time.monotonic() + max(limit_s - reserve_s, 1.0)

    def left(self, want: float, what: str = "the next step") -> float:
        rest = self.end - time.monotonic()
        if rest < 1.0:
            raise CheckTimeout(f"no time left for {what} (limit {self.limit_s:g} s, {CLEANUP_RESERVE_S:g} s kept for clean-up)")
        return min(want, rest)


_cleaning = False


def install_sigterm() -> None:
    """Turn SIGTERM into :class:`Terminated` (ignored once the clean-up has begun)."""

    def handler(signum, frame):  # noqa: ARG001
        if not _cleaning:
            raise Terminated(f"signal {signum} (the check's time limit, or an operator)")

    signal.signal(signal.SIGTERM, handler)


class Cleanup:
    """What a finished, failed or interrupted check undoes, in this order:

    1. every known GPU rank still alive is brought back to RUNNING (restore what is
       CHECKPOINTED, unlock what is LOCKED; :func:`warmctl.checkpoint.ranks.resume_ranks`), so
       no process is left locked in the driver;
    2. every process of every tree is SIGKILLed: the PID namespace's first process (killing it
       kills the whole namespace, kernel rule) and each of its descendants, then the launchers;
    3. waits for them to be gone;
    4. removes the directories in ``paths`` (none for the check, which keeps its work dir).

    Every step is bounded; the whole takes at most ``timeout_s``. Returns what it did. SIGTERM
    is ignored while it runs; with ``final=False`` it is honoured again afterwards (a caller
    that goes on, like the benchmark's next size).
    """

    def __init__(self, api: cuda.CheckpointAPI | None = None):
        self.api = api
        self.ranks: list[int] = []
        self.roots: list[int] = []
        self.launchers: list[subprocess.Popen] = []
        self.paths: list[Path] = []

    def run(self, timeout_s: float = CLEANUP_TIMEOUT_S, final: bool = True) -> dict:
        global _cleaning
        _cleaning = True
        try:
            return self._run(timeout_s)
        finally:
            _cleaning = final

    def _run(self, timeout_s: float) -> dict:
        end = time.monotonic() + timeout_s
        out: dict = {"not_running": {}, "killed": [], "left": []}
        live = [p for p in dict.fromkeys(self.ranks) if pid_alive(p)]
        if live and self.api is not None:
            try:
                _, errors = ranks.resume_ranks(live, timeout_s=max(1.0, (end - time.monotonic()) / 2),
                                               api=self.api, phase="cleanup")
                out["not_running"] = {str(p): e for p, e in errors.items()}
            except cuda.CudaCheckpointError as e:
                out["not_running"] = {"*": str(e)}
        victims: list[int] = []
        for r in self.roots:
            victims += [r] + [p for p in tree_pids(r) if p != r]
        for lp in self.launchers:
            victims += tree_pids(lp.pid) + [lp.pid]
        victims = list(dict.fromkeys(victims))
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
                out["killed"].append(p)
            except ProcessLookupError:
                pass
        for lp in self.launchers:
            try:
                lp.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while time.monotonic() < end and any(pid_alive(p) for p in victims):
            time.sleep(0.05)
        out["left"] = [p for p in victims if pid_alive(p)]
        for path in self.paths:
            shutil.rmtree(path, ignore_errors=True)
        out["left_paths"] = [str(p) for p in self.paths if p.exists()]
        return out


def start_in_pid_namespace(inner: list[str], log, env: dict[str, str], budget: Budget,
                           clean: Cleanup) -> tuple[subprocess.Popen, int]:
    """Start ``inner`` the way warmctl starts a CUDA engine (:func:`warmctl.engine.launch.command`:
    its own PID and mount namespaces, its output appended to ``log``'s file), registering
    launcher and namespace root with ``clean`` as soon as each exists. Returns (launcher, host
    PID of the namespace's first process: the dump root)."""
    cmd = launch.command(inner, log.name, mount_proc=True)
    launcher = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    clean.launchers.append(launcher)
    root = child_of(launcher.pid, budget.left(10, "the namespace's first process"))
    clean.roots.append(root)
    return launcher, root


def post(port: int, prompt: list[int], n: int = 32, timeout: float = 30, path: str = "/generate", body: dict | None = None) -> dict:
    data = json.dumps(body if body is not None else {"prompt": prompt, "n": n}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path)
    ap.add_argument("--port", type=int, default=18777)
    ap.add_argument("--limit", type=float, default=float(os.environ.get("GPU_CHECK_TIMEOUT_S", 290)),
                    help="seconds the caller allows (gpu-check.sh's timeout); every wait ends "
                         f"{CLEANUP_RESERVE_S:g} s before it")
    ap.add_argument("--imports-only", action="store_true", help="exit 0 once the imports succeeded")
    a = ap.parse_args()
    if a.imports_only:
        print("[gpu-check] imports ok: warmctl.checkpoint.{criu,cuda,nvml,ranks}, warmctl.base.proc", flush=True)
        return 0
    if a.work is None:
        ap.error("--work is required")
    budget = Budget(a.limit)
    install_sigterm()
    a.work.mkdir(parents=True, exist_ok=True)
    st = _Knobs()
    res: dict = {"driver": nvml.driver_version(st.libnvml), "gpus": [g.uuid for g in nvml.gpus(st.libnvml)], "limit_s": a.limit}
    api = cuda.load(st.libcuda, st.cuda_checkpoint)
    res["api"], res["cuda_driver_version"] = api.kind, api.driver_version
    t = res.setdefault("seconds", {})
    clean = Cleanup(api)

    log = open(a.work / "server.log", "a")
    inner = [sys.executable, str(Path(__file__).with_name("gpu_check_server.py")), str(a.port)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    try:
        launcher, root = start_in_pid_namespace(inner, log, env, budget, clean)  # root: the dump root
        t["cold_start"] = wait_health(a.port, budget.left(120, "the server's cold start"), launcher)
        ask = lambda p: post(a.port, p, timeout=budget.left(30, "an answer"))  # noqa: E731
        before = [ask(p) for p in PROMPTS]
        again = [ask(p) for p in PROMPTS]
        assert [x["tokens"] for x in before] == [x["tokens"] for x in again], "server is not deterministic"
        assert [x["logits_sha256"] for x in before] == [x["logits_sha256"] for x in again]
        pids = ranks.gpu_rank_pids(root, nvml_path=st.libnvml)
        res["ranks"] = pids
        clean.ranks += pids
        assert pids, f"no GPU process found in the tree of {root}"
        wop = lambda op: post(a.port, [], path="/weights", body={"op": op, "dir": str(a.work / "weights")},  # noqa: E731
                              timeout=budget.left(120, f"weights {op}"))
        t["weights_save"] = wop("save")["seconds"]
        wop("zero")
        res["zeroed_answer_differs"] = ask(PROMPTS[0])["logits_sha256"] != before[0]["logits_sha256"]

        lock_s = budget.left(30, "the CUDA lock")
        with ranks.checkpoint_ranks(pids, lock_timeout_s=lock_s, api=api,
                                    checkpoint_timeout_s=budget.left(60, "the CUDA checkpoint"),
                                    resume_timeout_s=min(20.0, CLEANUP_TIMEOUT_S), nvml_path=st.libnvml) as snap:
            t["criu_dump"] = criu.dump(root, a.work / "img", timeout_s=budget.left(120, "criu dump"), binary=st.criu)
        launcher.wait(timeout=budget.left(30, "the dumped tree's exit"))
        t["cuda_lock"], t["cuda_checkpoint"] = snap.phases["lock"], snap.phases["checkpoint"]
        res["gpu_bytes"] = snap.gpu_bytes
        res["image_bytes"] = sum(f.stat().st_size for f in (a.work / "img").iterdir() if f.is_file())

        t0 = time.monotonic()
        restored_root, t["criu_restore"] = criu.restore(a.work / "img", a.work / "restore.pid",
                                                        timeout_s=budget.left(120, "criu restore"), binary=st.criu,
                                                        xtile_lib=st.xtile_perm_lib)
        clean.roots.append(restored_root)
        new = ranks.restored_ranks(restored_root, snap.nspids)
        clean.ranks += new
        rr = ranks.restore_ranks(new, required_free_bytes=snap.gpu_bytes, api=api, nvml_path=st.libnvml,
                                 restore_timeout_s=budget.left(60, "the CUDA restore"),
                                 unlock_timeout_s=budget.left(30, "the CUDA unlock"))
        t.update({"precheck": rr.phases.get("precheck", 0.0), "cuda_restore": rr.phases["restore"],
                  "cuda_unlock": rr.phases["unlock"]})
        loaded = wop("load")
        t["weights_load"] = loaded["seconds"]
        res["weights_bytes"] = loaded["bytes"]
        res["weights_load_gb_per_s"] = round(loaded["bytes"] / 1e9 / max(loaded["seconds"], 1e-9), 2)
        first = ask(PROMPTS[0])
        t["first_answer_after_restore"] = time.monotonic() - t0
        after = [first] + [ask(p) for p in PROMPTS[1:]]
        res["bit_identical"] = ([x["tokens"] for x in after] == [x["tokens"] for x in before]
                                and [x["logits_sha256"] for x in after] == [x["logits_sha256"] for x in before])
        res["gpu_state_survived"] = after[0]["served"] == again[-1]["served"] + 2  # +1: the zeroed probe
        ok = res["bit_identical"] and res["gpu_state_survived"] and res["zeroed_answer_differs"]
        res["ok"] = ok
        return 0 if ok else 1
    except BaseException as e:  # report, then clean up (SIGTERM arrives here as Terminated)
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        return 1
    finally:
        res["cleanup"] = clean.run()
        log.close()
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    sys.exit(main())
