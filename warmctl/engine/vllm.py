"""Launching and talking to a vLLM engine (``vllm serve``) so that CRIU can checkpoint it.

The engine is started as::

    python -m warmctl.engine.launch -- unshare --pid --fork setsid vllm serve MODEL ...

- ``warmctl.engine.launch`` blocks ``io_uring_setup`` (CRIU cannot dump io_uring; libuv falls
  back to epoll).
- ``unshare --pid --fork``: the tree lives in its own PID namespace, so a restore does not need
  the original host PIDs to be free. The namespace's PID 1 is the dump root.
- ``setsid``: the tree has its own session, so CRIU finds no outside session or terminal.
- stdin is ``/dev/null``; stdout and stderr go to one log file opened in append mode (CRIU
  restores the descriptor; the file must exist at restore).

Facts used here were verified on this kind of machine (``../shared/DESIGN.md``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from warmctl.errors import EngineError
from warmctl.profile import Profile


def vllm_command(profile: Profile, model_path: str, python: str | None = None) -> list[str]:
    """The ``vllm serve`` argument vector for ``profile`` (without the launch wrappers).

    The engine binds the profile's internal port on 127.0.0.1 only; the public port belongs to
    the gate. With ``checkpoint.weights_outside_image`` warmctl's worker extension is added
    (``--worker-extension-cls``, see :mod:`warmctl.engine.worker_ext`) unless the profile's
    args name one already.
    """
    from warmctl.engine.sleep import WORKER_EXTENSION

    e = profile.engine
    vllm_bin = Path(python or sys.executable).with_name("vllm")
    cmd = [str(vllm_bin), "serve", model_path, "--served-model-name", e.served_model_name,
           "--host", "127.0.0.1", "--port", str(e.port)]
    if e.max_model_len:
        cmd += ["--max-model-len", str(e.max_model_len)]
    if profile.checkpoint.weights_outside_image and "--worker-extension-cls" not in e.args:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    return cmd + list(e.args)


def wrapped_command(inner: list[str], python: str | None = None) -> list[str]:
    """``inner`` wrapped so the tree is checkpointable (see module docstring).

    Raises :class:`EngineError` if ``unshare`` or ``setsid`` (util-linux) is missing.
    """
    for tool in ("unshare", "setsid"):
        if not shutil.which(tool):
            raise EngineError(f"'{tool}' not found on PATH (install util-linux)")
    return [python or sys.executable, "-m", "warmctl.engine.launch", "--",
            "unshare", "--pid", "--fork", "setsid", *inner]


@dataclass
class EngineProcess:
    """A launched engine tree.

    ``launcher``: the ``unshare`` process (host PID, our child). ``root_pid``: the namespace's
    PID 1 (host PID), the CRIU dump root. ``port``: internal port.
    """

    launcher: subprocess.Popen | None
    root_pid: int
    port: int
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return pid_alive(self.root_pid)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start(profile: Profile, model_path: str, log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> EngineProcess:
    """Start the engine tree for ``profile`` in the background; returns once its root exists.

    ``env`` adds to the current environment and the profile's ``engine.env``; profiles that
    checkpoint through the engine (``checkpoint.cuda``, ``sleep_level`` or
    ``weights_outside_image``) get ``VLLM_SERVER_DEV_MODE=1`` (the ``/sleep``, ``/wake_up`` and
    ``/collective_rpc`` endpoints; the engine listens on loopback only). Raises
    :class:`EngineError` if the launcher dies before the namespace root appears (the log's
    tail is in the message).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    c = profile.checkpoint
    if c.cuda or c.sleep_level or c.weights_outside_image:
        full_env["VLLM_SERVER_DEV_MODE"] = "1"
    full_env.update(profile.engine.env)
    full_env.update(env or {})
    cmd = wrapped_command(vllm_command(profile, model_path))
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=log, stderr=log, env=full_env,
                                cwd=cwd or log_path.parent, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children() if pid_alive(proc.pid) else []
        if children:
            return EngineProcess(proc, children[0].pid, profile.engine.port, log_path)
        if proc.poll() is not None:
            raise EngineError(f"engine launcher exited with {proc.returncode}:\n{tail(log_path)}")
        time.sleep(0.05)
    kill_tree(proc.pid)
    raise EngineError("engine launcher did not create its PID namespace within 30 s")


def tail(path: Path, lines: int = 12) -> str:
    """The lines of a log that explain a failure: the last 5 lines naming an error (vLLM's root
    cause is often far above its final traceback), then the last ``lines`` lines."""
    try:
        all_lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln for ln in all_lines[:-lines] if re.search(r"Error|ERROR|Killed|Traceback", ln)][-5:]
    return "\n".join(errors + (["..."] if errors else []) + all_lines[-lines:])


def wait_healthy(eng: EngineProcess, timeout_s: float, progress=None) -> float:
    """Poll ``GET /health`` until 200. Returns seconds waited.

    Raises :class:`EngineError` with the log's tail when the engine dies or ``timeout_s``
    (seconds) passes. ``progress(elapsed_s)`` is called about once a second.
    """
    t0 = time.monotonic()
    last = 0.0
    with httpx.Client(timeout=2.0) as client:
        while True:
            elapsed = time.monotonic() - t0
            try:
                if client.get(eng.base_url + "/health").status_code == 200:
                    return elapsed
            except httpx.HTTPError:
                pass
            if not eng.alive():
                raise EngineError(f"engine exited during start-up; log {eng.log_path}:\n{tail(eng.log_path)}")
            if elapsed > timeout_s:
                raise EngineError(f"engine not healthy after {timeout_s:.0f} s; log {eng.log_path}:\n{tail(eng.log_path)}")
            if progress and elapsed - last >= 1.0:
                progress(elapsed)
                last = elapsed
            time.sleep(0.2)


def kill_tree(root_pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM ``root_pid`` and all its descendants, SIGKILL what is left after ``timeout_s``.

    Killing a PID namespace's PID 1 also kills every process inside it (kernel rule).
    """
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


# --- start-up log phases ------------------------------------------------------------------

_PHASE_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("weights", re.compile(r"Loading weights took ([\d.]+) s")),
    ("model_init", re.compile(r"Initializing model took ([\d.]+) s")),
    ("torch_compile", re.compile(r"torch\.compile takes ([\d.]+) s in total")),
    ("dynamo_transform", re.compile(r"Dynamo bytecode transform time: ([\d.]+) s")),
    ("graph_capture", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
    ("engine_init", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")),
]


_TS = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")
#: CPU builds print no "torch.compile takes" line; the compile spans these two log lines.
_COMPILE_START = "Warming up model for the compilation"
_COMPILE_END = ("saved AOT compiled function", "Initial profiling/warmup run took")


def _ts_seconds(line: str) -> float | None:
    m = _TS.search(line)
    if not m:
        return None
    mo, d, h, mi, s = (int(x) for x in m.groups())
    return (((mo * 31 + d) * 24 + h) * 60 + mi) * 60 + s


def _compile_span(log_text: str) -> float | None:
    start = None
    for line in log_text.splitlines():
        if start is None and _COMPILE_START in line:
            start = _ts_seconds(line)
        elif start is not None and any(k in line for k in _COMPILE_END):
            end = _ts_seconds(line)
            return None if end is None else float(end - start)
    return None


def parse_startup_phases(log_text: str, total_s: float | None = None) -> dict[str, float]:
    """Seconds per start-up phase, read from vLLM's log (the lines it prints itself).

    Keys: ``weights``, ``torch_compile``, ``graph_capture`` (0 on CPU: no CUDA graphs),
    ``other`` (``total - the rest``) and ``total`` (``total_s`` as measured by the caller:
    launch to healthy). Phases the log does not mention count as 0. The patterns are those of
    vLLM 0.32 (``Loading weights took``, ``torch.compile takes ... in total``,
    ``Graph capturing finished in``); where the CPU build prints no compile total, the compile
    is the span between its "Warming up model for the compilation" line and the line that
    reports the compiled function saved (whole-second log timestamps).
    """
    found: dict[str, float] = {}
    for name, pat in _PHASE_PATTERNS:
        vals = [float(m) for m in pat.findall(log_text)]
        if vals:
            found[name] = max(vals)
    if "torch_compile" not in found and (span := _compile_span(log_text)) is not None:
        found["torch_compile"] = span
    phases = {
        "weights": found.get("weights", 0.0),
        "torch_compile": found.get("torch_compile", 0.0),
        "graph_capture": found.get("graph_capture", 0.0),
    }
    if total_s is not None:
        phases["other"] = max(0.0, total_s - sum(phases.values()))
        phases["total"] = total_s
    return phases
