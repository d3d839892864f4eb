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
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import psutil

from warmctl.engine.loopback import Connection, LoopbackError
from warmctl.base.errors import EngineError
from warmctl.base.proc import kill_child, pid_alive
from warmctl.records.profile import Profile


#: A test hook: the command line (split as a shell would) warmctl runs in place of ``vllm``,
#: e.g. ``tests/fake_vllm.py`` (a two-process tree serving the same endpoints, dumped and
#: restored by the real CRIU in about a second) for tests of warmctl's own orchestration.
#: Unset (always, outside tests): ``vllm`` beside the interpreter. The engine never sees it
#: (:func:`engine_environment`).
TEST_ENGINE_ENV = "WARMCTL_TEST_ENGINE_CMD"


def vllm_command(profile: Profile, model_path: str, python: str | None = None) -> list[str]:
    """The ``vllm serve`` argument vector for ``profile`` (without the launch wrappers).

    The engine binds the profile's internal port on 127.0.0.1 only; the public port belongs to
    the gate. With ``checkpoint.weights_outside_image`` warmctl's worker extension is added
    (``--worker-extension-cls``, see :mod:`warmctl.engine.worker_ext`) unless the profile's
    args name one already.
    """
    from warmctl.engine.sleep import WORKER_EXTENSION

    e = profile.engine
    hook = os.environ.get(TEST_ENGINE_ENV)
    head = shlex.split(hook) if hook else [str(Path(python or sys.executable).with_name("vllm"))]
    cmd = [*head, "serve", model_path, "--served-model-name", e.served_model_name,
           "--host", "127.0.0.1", "--port", str(e.port)]
    if e.max_model_len:
        cmd += ["--max-model-len", str(e.max_model_len)]
    if profile.checkpoint.weights_outside_image and "--worker-extension-cls" not in e.args:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    return cmd + list(e.args)


#: What the engine takes from warmctl's own environment whatever the config says: what the
#: interpreter, vLLM, the locale, the BLAS/OpenMP runtimes and the accelerator runtime need
#: (docs/operations.md, "Credentials and snapshots"). A name ending in ``*`` is a prefix. A
#: name that looks like a credential (:func:`warmctl.records.credentials.credential_name`) is never
#: taken from this list.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR",
            "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME",
            "OMP_*", "KMP_*", "GOMP_*", "OPENBLAS_*", "MKL_*",
            "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _matches(name: str, patterns) -> bool:
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


@dataclass(frozen=True)
class EngineEnv:
    """The engine's whole environment (``values``) and where each variable came from
    (``sources``: name -> ``base`` (:data:`BASE_ENV`), ``passthrough`` (the config's
    ``engine_env_passthrough``), ``warmctl`` (set by warmctl, :func:`engine_env`) or
    ``profile`` (its ``[engine.env]``, which wins)). A manifest records ``sources`` only:
    names, never values."""

    values: dict[str, str]
    sources: dict[str, str]


def engine_environment(profile: Profile, passthrough: Sequence[str] = (),
                       environ: Mapping[str, str] | None = None) -> EngineEnv:
    """The environment ``profile``'s engine starts with: from ``environ`` (default: this
    process's) only the variables :data:`BASE_ENV` names (never a credential-looking one) and
    those ``passthrough`` names (exact names, or prefixes ending in ``*``; a credential
    passed through reaches the engine, and ``snapshot`` then refuses to publish the image
    that holds it); then what warmctl and the profile set (:func:`engine_env`). Nothing
    else of warmctl's environment reaches the engine."""
    from warmctl.records.credentials import credential_name

    env = os.environ if environ is None else environ
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    for k in sorted(env):
        if _matches(k, passthrough):
            values[k], sources[k] = env[k], "passthrough"
        elif _matches(k, BASE_ENV) and not credential_name(k):
            values[k], sources[k] = env[k], "base"
    ours = engine_env(profile)
    for k, v in ours.items():
        values[k] = v
        sources[k] = "profile" if k in profile.engine.env else "warmctl"
    return EngineEnv(values, sources)


def engine_env(profile: Profile) -> dict[str, str]:
    """The variables warmctl sets for ``profile``'s engine on top of what it takes from its
    own environment (:func:`engine_environment`): offline Hugging Face, unbuffered output,
    ``VLLM_SERVER_DEV_MODE=1`` for profiles that checkpoint through the engine
    (``checkpoint.cuda``, ``sleep_level`` or ``weights_outside_image``: the ``/sleep``,
    ``/wake_up`` and ``/collective_rpc`` endpoints, on loopback only), then the profile's
    ``engine.env`` (which wins)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    c = profile.checkpoint
    if c.cuda or c.sleep_level or c.weights_outside_image:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(profile.engine.env)
    return env


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
    #: the engine's environment by name: variable -> where it came from (:class:`EngineEnv`)
    env_sources: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return pid_alive(self.root_pid)


def start(profile: Profile, model_path: str, log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None, passthrough: Sequence[str] = ()) -> EngineProcess:
    """Start the engine tree for ``profile`` in the background; returns once its root exists.

    The environment is :func:`engine_environment` (with the config's ``passthrough`` names)
    plus ``env``; the returned process's ``env_sources`` records it by name. Raises
    :class:`EngineError` if the launcher dies before the namespace root appears (the log's
    tail is in the message).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    declared = engine_environment(profile, passthrough)
    full_env = {**declared.values, **(env or {})}
    cmd = wrapped_command(vllm_command(profile, model_path))
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(cmd, stdin=devnull, stdout=log, stderr=log, env=full_env,
                                cwd=cwd or log_path.parent, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = psutil.Process(proc.pid).children() if pid_alive(proc.pid) else []
        if children and _exec_done(children[0]):
            return EngineProcess(proc, children[0].pid, profile.engine.port, log_path,
                                 env_sources={**declared.sources, **{k: "warmctl" for k in env or {}}})
        if proc.poll() is not None:
            raise EngineError(f"engine launcher exited with {proc.returncode}:\n{tail(log_path)}")
        time.sleep(0.01 if children else 0.05)
    kill_child(proc)
    raise EngineError("engine launcher did not create its PID namespace within 30 s")


#: the programs between the launcher and the engine (see the module doc): the namespace root
#: execs through them, so its executable is final (and recordable) only after them
_WRAPPERS = ("unshare", "setsid")


def _exec_done(p: psutil.Process) -> bool:
    """True once the namespace root ``p`` runs the engine's executable, not a wrapper: its
    identity (:class:`warmctl.base.proc.ProcessId`, executable included) is recorded right after."""
    try:
        return Path(p.exe()).name not in _WRAPPERS
    except (psutil.Error, OSError):
        return False


def tail(path: Path, lines: int = 12) -> str:
    """The lines of a log that explain a failure: the last 5 lines naming an error (vLLM's root
    cause is often far above its final traceback), then the last ``lines`` lines."""
    try:
        all_lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln for ln in all_lines[:-lines] if re.search(r"Error|ERROR|Killed|Traceback", ln)][-5:]
    return "\n".join(errors + (["..."] if errors else []) + all_lines[-lines:])


def wait_healthy(eng, timeout_s: float, progress=None, interval_s: float = 0.2) -> float:
    """Poll ``GET /health`` every ``interval_s`` seconds until 200. Returns seconds waited.

    ``eng``: an :class:`EngineProcess` or a :class:`warmctl.engine.run.EngineRun` (anything
    with ``base_url``, ``alive()`` and ``log_path``).

    Raises :class:`EngineError` with the log's tail when the engine dies or ``timeout_s``
    (seconds) passes. ``progress(elapsed_s)`` is called about once a second. A restored engine
    answers within milliseconds, so ``up`` polls it at 10 ms; a cold start takes a minute.
    """
    t0 = time.monotonic()
    last = 0.0
    with Connection(eng.base_url, 2.0) as client:  # http.client, not httpx: see warmctl.engine.loopback
        while True:
            elapsed = time.monotonic() - t0
            try:
                if client.status("/health") == 200:
                    return elapsed
            except LoopbackError:
                pass
            if not eng.alive():
                raise EngineError(f"engine exited during start-up; log {eng.log_path}:\n{tail(eng.log_path)}")
            if elapsed > timeout_s:
                raise EngineError(f"engine not healthy after {timeout_s:.0f} s; log {eng.log_path}:\n{tail(eng.log_path)}")
            if progress and elapsed - last >= 1.0:
                progress(elapsed)
                last = elapsed
            time.sleep(interval_s)


# --- start-up log phases ------------------------------------------------------------------
#
# Two kinds of evidence in vLLM 0.32's log (messages read from its source, e.g.
# ``vllm/v1/engine/core.py``, ``vllm/v1/worker/cpu_model_runner.py``,
# ``vllm/model_executor/warmup/*.py``):
#
# - *milestones*: lines that mark where a stage of the start-up begins. The time from one
#   milestone to the next (whole-second log timestamps) is that stage's duration.
# - *measurements*: lines that state a duration themselves (``Loading weights took 0.03
#   seconds``), or a tqdm bar's elapsed time (``DeepGEMM warmup: 100%|...| 2883/2883
#   [06:37<00:00, ...]``). A measurement is carved out of the milestone stage it was printed in.

#: (phase, what starts it). Only the first match of each counts; stages follow log order.
_MILESTONES: list[tuple[str, re.Pattern[str]]] = [
    # the API server's first log line: arguments parsed; before it, interpreter + vllm imports
    ("model_config", re.compile(r"non-default args:|\bversion \d+\.\d+")),
    # model config resolved (HF config read, platform detected); the engine core starts now
    ("engine_core_start", re.compile(r"Resolved architecture: ")),
    # the engine core process is up; it starts the worker process(es)
    ("worker_start", re.compile(r"Initializing a V1 LLM engine")),
    ("model_load", re.compile(r"Starting to load model ")),
    ("torch_compile", re.compile(r"Warming up model for the compilation|Starting torch\.compile")),
    # CPU: compile done, the worker sizes and allocates the KV cache; GPU: profiling done
    ("kv_cache", re.compile(r"Explicitly set \(.*GiB for KV cache|Available KV cache memory: "
                            r"|(?:CPU|GPU|XPU|TPU) KV cache size: ")),
    # engine core ready; the API server connects, loads the tokenizer/chat template, binds
    ("api_server_start", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
    ("serve", re.compile(r"Starting vLLM (?:API )?server on ")),
]
#: A stage ends where the next starts, or at one of these lines, which starts the stage named
#: with it: after the compile, vLLM's profiling run (the memory profile on GPUs).
_STAGE_ENDS: dict[str, tuple[re.Pattern[str], str]] = {
    "torch_compile": (re.compile(r"saved AOT compiled function|Warming up done\.|torch\.compile (?:took|takes)"),
                      "profile_run"),
}

#: Measurements stated in seconds: (phase, pattern with the seconds as group 1).
_MEASURED: list[tuple[str, re.Pattern[str]]] = [
    ("weights", re.compile(r"Loading weights took ([\d.]+) s")),
    ("jit_warmup", re.compile(r"JIT kernel warmup finished in ([\d.]+) ?s")),
    ("graph_capture", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
]
#: ``[tag] torch.compile took X s in total`` (``takes`` before vLLM 0.1x; the "and initial
#: profiling/warmup run together" form when compile and profiling are timed as one).
_COMPILE_TOTAL = re.compile(r"(?:\[([\w.-]+)\] )?torch\.compile (?:and initial profiling/warmup run together )?"
                            r"(?:took|takes) ([\d.]+) s in total")
#: tqdm bars: (phase, pattern); groups: done, total, [hours], minutes, seconds of elapsed time.
_TQDM = r":\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)<"
_BARS: list[tuple[str, re.Pattern[str]]] = [
    ("deepgemm_warmup", re.compile(r"DeepGEMM warmup" + _TQDM)),
    ("jit_warmup", re.compile(r"JIT kernel warmup \((\d+) compile keys\)" + _TQDM)),
]
#: FlashInfer's autotuner logs its own start and end (its own timestamp format, so only the
#: difference of the two is used).
_FI_START = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)[,.](\d+).*\[Autotuner\]:? Autotuning process starts")
_FI_END = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)[,.](\d+).*\[Autotuner\]:? Autotuning process ends")

_ENDED_BY = {v[1] for v in _STAGE_ENDS.values()}

_TS = re.compile(r"(?:INFO|WARNING|DEBUG|ERROR) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")

#: Display names of the phases (``warmctl bench startup``, ``warmctl snapshot``).
PHASE_NAMES = {
    "imports": "process start, Python imports",
    "model_config": "model config, platform",
    "engine_core_start": "engine core process start",
    "worker_start": "worker process start",
    "model_load": "model init (excl. weights)",
    "weights": "load weights",
    "torch_compile": "torch.compile",
    "profile_run": "profiling run",
    "kv_cache": "KV cache allocation",
    "jit_warmup": "Triton JIT warm-up",
    "deepgemm_warmup": "DeepGEMM warm-up",
    "flashinfer_autotune": "FlashInfer autotuning",
    "graph_capture": "CUDA graph capture",
    "api_server_start": "API server start, engine handshake",
    "serve": "server bind to /health",
}


def _ts_seconds(line: str) -> float | None:
    m = _TS.search(line)
    if not m:
        return None
    mo, d, h, mi, s = (int(x) for x in m.groups())
    return (((mo * 31 + d) * 24 + h) * 60 + mi) * 60 + s


def _wall(m: re.Match) -> float:
    y, mo, d, h, mi, s, frac = m.groups()
    return ((((int(mo) * 31 + int(d)) * 24 + int(h)) * 60 + int(mi)) * 60 + int(s)) + float("0." + frac)


def _bar_seconds(h: str | None, mi: str, s: str) -> float:
    return int(h or 0) * 3600 + int(mi) * 60 + int(s)


def _measurements(lines: list[str]) -> tuple[list[tuple[str, float, int]], dict[str, int]]:
    """(phase, seconds, line index) of every measurement, and the counts the log gives."""
    out: list[tuple[str, float, int]] = []
    counts: dict[str, int] = {}
    compile_by_tag: dict[str, tuple[float, int]] = {}
    bars: dict[str, tuple[float, int]] = {}
    fi_start: float | None = None
    fi_total, fi_last, fi_runs = 0.0, -1, 0
    for i, line in enumerate(lines):
        for name, pat in _MEASURED:
            for v in pat.findall(line):
                out.append((name, float(v), i))
        for tag, v in _COMPILE_TOTAL.findall(line):  # per rank: the slowest rank counts once per tag
            if float(v) >= compile_by_tag.get(tag, (0.0, 0))[0]:
                compile_by_tag[tag] = (float(v), i)
        for name, pat in _BARS:
            for m in pat.finditer(line):  # tqdm redraws: the last drawing has the final numbers
                g = m.groups()
                if name == "jit_warmup":
                    counts["jit_warmup_compile_keys"] = int(g[0])
                    g = g[1:]
                counts[name + "_kernels"] = int(g[1])
                bars[name] = (_bar_seconds(g[2], g[3], g[4]), i)
        if (m := _FI_START.search(line)) and fi_start is None:
            fi_start = _wall(m)
        elif (m := _FI_END.search(line)) and fi_start is not None:
            fi_total, fi_last, fi_runs = fi_total + max(0.0, _wall(m) - fi_start), i, fi_runs + 1
            fi_start = None
    # the same phase both measured and drawn as a bar (JIT warm-up): keep the measurement
    measured = {n for n, _, _ in out}
    out += [(n, v, i) for n, (v, i) in bars.items() if n not in measured]
    out += [("torch_compile", v, i) for v, i in compile_by_tag.values()]
    if fi_runs:
        out.append(("flashinfer_autotune", fi_total, fi_last))
        counts["flashinfer_autotune_runs"] = fi_runs
    # several ranks print the same measurement: one value per phase and line kind (the max)
    best: dict[str, tuple[float, int]] = {}
    for n, v, i in out:
        if n == "torch_compile":
            continue
        if v >= best.get(n, (0.0, 0))[0]:
            best[n] = (v, i)
    final = [(n, v, i) for n, (v, i) in best.items()] + [x for x in out if x[0] == "torch_compile"]
    return final, counts


def _timeline(lines: list[str]) -> list[tuple[str, int, float]]:
    """(phase, line index, start) of each milestone found, in log order, stage ends
    (:data:`_STAGE_ENDS`) included."""
    found: list[tuple[str, int, float]] = []
    seen: set[str] = set()
    open_stage = None
    for i, line in enumerate(lines):
        t = _ts_seconds(line)
        if t is None:
            continue
        if open_stage and (end := _STAGE_ENDS.get(open_stage)) and end[0].search(line):
            found.append((end[1], i, t))
            open_stage = end[1]
        for name, pat in _MILESTONES:
            if name not in seen and pat.search(line):
                seen.add(name)
                found.append((name, i, t))
                open_stage = name
                break
    return found


def startup_breakdown(log_text: str, total_s: float | None = None) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds per start-up phase and the counts the log gives, read from vLLM's own log.

    Phases (keys of :data:`PHASE_NAMES`, only those the log shows, plus ``weights``,
    ``torch_compile`` and ``graph_capture`` always): the stages between milestone lines
    (see :data:`_MILESTONES`; whole-second timestamps), with what vLLM measures itself
    (weights, torch.compile, JIT warm-up, DeepGEMM warm-up, FlashInfer autotuning, CUDA graph
    capture) carved out of the stage it was printed in. With ``total_s`` (launch to healthy,
    measured by the caller): ``imports`` = time before the first log line (the log's last
    timestamp is taken as the moment it became healthy), ``other`` = ``total_s`` minus every
    phase (never negative), ``total`` = ``total_s``. Counts: ``deepgemm_warmup_kernels``,
    ``jit_warmup_kernels``, ``jit_warmup_compile_keys``, ``flashinfer_autotune_runs``.
    """
    lines = log_text.splitlines()
    phases: dict[str, float] = {}
    marks = _timeline(lines)
    stamps = [t for t in map(_ts_seconds, lines) if t is not None]
    end = stamps[-1] if stamps else None
    for k, (name, i, t) in enumerate(marks):
        nxt = marks[k + 1][2] if k + 1 < len(marks) else end
        phases[name] = phases.get(name, 0.0) + max(0.0, float(nxt - t))
    if marks and total_s is not None and end is not None:
        phases = {"imports": max(0.0, total_s - float(end - marks[0][2])), **phases}
    measured, counts = _measurements(lines)
    replaced: set[str] = set()
    for name, secs, line_no in measured:
        # the stage that was open when the measurement was printed gives its time up; a
        # stage that measures itself (torch.compile) takes the measurement instead of its span
        host = None
        for mname, i, _ in marks:
            if i > line_no or (i == line_no and mname in _ENDED_BY):  # a line that ends a stage is in it
                break
            host = mname
        if host == name and name not in replaced:
            phases[name] = 0.0
            replaced.add(name)
        elif host and host != name:
            phases[host] = max(0.0, phases.get(host, 0.0) - secs)
        phases[name] = phases.get(name, 0.0) + secs
    for k in ("weights", "torch_compile", "graph_capture"):
        phases.setdefault(k, 0.0)
    if total_s is not None:
        phases["other"] = max(0.0, total_s - sum(phases.values()))
        phases["total"] = total_s
    return phases, counts


def parse_startup_phases(log_text: str, total_s: float | None = None) -> dict[str, float]:
    """Seconds per start-up phase (see :func:`startup_breakdown`, which also gives counts)."""
    return startup_breakdown(log_text, total_s)[0]
