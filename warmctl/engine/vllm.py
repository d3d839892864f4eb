"""Launching and talking to a vLLM engine (``vllm serve``) so that CRIU can checkpoint it.

The engine is started as::

    unshare --pid --fork [--mount-proc] setsid python -m warmctl.engine.launch --stdio LOG -- vllm serve MODEL ...

:mod:`warmctl.engine.launch` says why each part is there: its own PID namespace (its PID 1 is
the dump root) and, for CUDA engines, mount namespace, its own session, stdio opened inside, and
``io_uring_setup`` blocked (CRIU cannot dump io_uring; libuv falls back to epoll).
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

from warmctl.engine import launch
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


def wrapped_command(inner: list[str], log_path: Path, python: str | None = None, *,
                    mount_proc: bool = False) -> list[str]:
    """``inner`` wrapped so the tree is checkpointable, its output appended to ``log_path``,
    in its own mount namespace and ``/proc`` with ``mount_proc`` (CUDA engines)
    (:func:`warmctl.engine.launch.command`).

    Raises :class:`EngineError` if ``unshare`` or ``setsid`` (util-linux) is missing.
    """
    for tool in launch.WRAPPERS:
        if not shutil.which(tool):
            raise EngineError(f"'{tool}' not found on PATH (install util-linux)")
    return launch.command(inner, log_path, python, mount_proc=mount_proc)


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
    cmd = wrapped_command(vllm_command(profile, model_path), log_path, mount_proc=profile.checkpoint.cuda)
    # the launcher's own stdio (unshare's and setsid's complaints); the engine opens its own
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


def _exec_done(p: psutil.Process) -> bool:
    """True once the namespace root ``p`` runs the engine's executable, not a wrapper (util-linux's
    or :mod:`warmctl.engine.launch`): its identity (:class:`warmctl.base.proc.ProcessId`,
    executable included) is recorded right after."""
    try:
        return Path(p.exe()).name not in launch.WRAPPERS and "warmctl.engine.launch" not in p.cmdline()
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
