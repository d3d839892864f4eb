"""Cold start: what ``snapshot`` and the cold path of ``up`` share.

:func:`preflight` refuses early; :func:`start` launches the engine tree of a profile into an
:class:`~warmctl.engine.run.EngineRun` (:mod:`warmctl.engine.vllm`: own PID namespace, io_uring
blocked) and waits for ``/health``; :func:`warm_and_record` runs the warm-up grid and records
the canary. Each either succeeds or leaves nothing running (the run is torn down).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from warmctl.models import builtinmodels
from warmctl.checkpoint import layout
from warmctl.engine import canary, startlog, vllm, warmup
from warmctl.engine.run import EngineRun
from warmctl.base.errors import EngineError, HostError
from warmctl.gate import require_port_free
from warmctl.records.manifest import CanaryRecord
from warmctl.records.profile import Profile
from warmctl.records.progress import Reporter
from warmctl.records.state import EngineState


def resolve_model(profile: Profile, models_dir: Path) -> str:
    """The model path for ``profile``; builds a ``builtin:`` model (``tiny``, ``tiny-moe``:
    :data:`warmctl.models.tinymodel.BUILTIN`; ``random-llama-<L>x<H>``: :mod:`warmctl.models.randmodel`) under
    ``models_dir`` on first use. Raises :class:`EngineError` if a model path does not exist."""
    m = profile.engine.model
    if (d := builtinmodels.build_builtin(m, models_dir)) is not None:
        return str(d)
    if m.startswith("/") or m.startswith("."):
        if not Path(m).exists():
            raise EngineError(f"profile {profile.name}: engine.model {m} does not exist")
    return m


#: Leads the PYTHONPATH of CPU-build engines: its ``sitecustomize`` makes vLLM's CPU worker read
#: its memory-node affinity from ``/proc/self`` (the engine's PID namespace sees the host's /proc).
NSPROC_DIR = Path(__file__).resolve().parent / "nsproc"


def launch_env(profile: Profile, inherited: dict[str, str] | None = None) -> dict[str, str]:
    """What warmctl adds to ``profile``'s engine environment at launch, beyond
    :func:`warmctl.engine.vllm.engine_env`: the ranks' default CPU binding
    (:func:`warmctl.checkpoint.layout.cpu_binding`), and on the CPU build (``gpu_count = 0``)
    :data:`NSPROC_DIR` ahead of the inherited ``PYTHONPATH`` (``inherited``: default this
    process's environment). Raises :class:`HostError` as ``cpu_binding`` does."""
    env = layout.cpu_binding(profile).env()
    if not profile.hardware.gpu_count:
        import os

        rest = (os.environ if inherited is None else inherited).get("PYTHONPATH")
        env["PYTHONPATH"] = str(NSPROC_DIR) + (f":{rest}" if rest else "")
    return env


def preflight(profile: Profile, run_dir: Path) -> None:
    """Refuse early (:class:`HostError`): an engine of this name serving in ``run_dir``, the
    profile's internal port taken, or a CPU binding of its ranks this host cannot satisfy
    (:func:`warmctl.checkpoint.layout.cpu_binding`, naming the ranks and CPUs). A recorded engine that is not serving is what a killed
    ``snapshot`` or ``up`` left (the caller holds the name's lock, :mod:`warmctl.records.enginelock`,
    so nothing else is starting it): it is torn down first."""
    run = EngineRun.load(run_dir, profile.name)
    if run is not None and run.alive() and run.state is not None and run.state.phase == "serving":
        raise HostError(f"engine {profile.name} is running (pid {run.root_pid}); `warmctl down {profile.name}` first")
    if run is not None:
        run.teardown(strays=True)  # also a root known only by engine.pid / restore.pid
    require_port_free("127.0.0.1", profile.engine.port, f"engine port for {profile.name}:")
    layout.cpu_binding(profile)


def start(run: EngineRun, profile: Profile, model: str, reporter: Reporter,
          passthrough: Sequence[str] = ()) -> dict[str, float]:
    """Launch ``profile``'s engine (model path ``model``) as ``run`` and wait until healthy.
    Its environment is declared (:func:`warmctl.engine.vllm.engine_environment`, with the
    config's ``engine_env_passthrough`` names as ``passthrough``) and recorded on the run by
    name (``run.engine_env``).

    The run is recorded (``<run>/state.json``, phase ``starting``, no public port yet) as soon
    as its root process exists. Returns the start-up phases in seconds, parsed from the log
    (:func:`warmctl.engine.startlog.parse_startup_phases`: its stages and ``other``; launch to
    healthy is the ``cold_start`` phase, so its ``total`` is left out: ``total`` is each
    pipeline's own sum). The ranks of a CPU profile with several get warmctl's default CPU
    binding when the profile gives none (:func:`warmctl.checkpoint.layout.cpu_binding`). On failure the run is torn down and :class:`EngineError` raised (with
    the log's tail).
    """
    run.prepare()
    offset = run.log_path.stat().st_size if run.log_path.exists() else 0
    binding = layout.cpu_binding(profile)
    if binding.source == "default":
        reporter.info(f"CPU binding of the ranks: {layout.BIND_VAR}={binding.value} (warmctl's default from the "
                      f"CPUs it may use; set it in [engine.env] to choose)")
    eng = vllm.start(profile, model, run.log_path, env={**run.tmp_env, **launch_env(profile)}, cwd=run.cwd,
                     passthrough=passthrough)
    run.engine_env = eng.env_sources
    run.set_root(eng.root_pid)
    if run.state is None:  # recorded at once: a killed warmctl leaves a tree the next run finds
        run.record(EngineState(name=profile.name, phase="starting", source="cold", profile_digest=profile.digest(),
                               started_at=run.started_at, internal_port=profile.engine.port, public_host="",
                               public_port=0, served_model_name=profile.engine.served_model_name,
                               log_path=str(run.log_path)))
    try:
        with reporter.phase("cold_start", f"starting {profile.engine.kind} for {profile.name} (log: {run.log_path})"):
            total = vllm.wait_healthy(run, profile.engine.startup_timeout_s, progress=lambda _: run.sample_shm())
    except BaseException:
        run.teardown()
        raise
    with open(run.log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    phases = startlog.parse_startup_phases(text, total_s=total)
    phases.pop("total", None)  # launch to healthy is the cold_start phase; "total" is each pipeline's own sum
    return phases


def warm_and_record(run: EngineRun, profile: Profile, reporter: Reporter, silence_s: float = 0.0) -> CanaryRecord:
    """Run the warm-up grid, then record the canary, with the engine's ranks watched
    (:class:`warmctl.checkpoint.layout.RankWatch`) and its ``/dev/shm`` files sampled
    (:meth:`EngineRun.sample_shm`) while they run.

    The requests run in a thread; this one looks at the ranks every
    :data:`~warmctl.checkpoint.layout.WATCH_INTERVAL_S` seconds. A rank that dies ends the
    wait at once, one that stays stopped after
    :data:`~warmctl.checkpoint.layout.STOP_GRACE_S` seconds (its peers wait in the all-reduce
    for ever) too, and one alive but silent (no CPU time for ``silence_s`` seconds while the
    grid's or the canary's requests are in flight: the ``rank_silence_s`` setting; 0: not
    watched): :class:`~warmctl.checkpoint.layout.RankError` naming it, its process and
    its log lines, instead of a request that would wait out its 600 s timeout. A request that
    fails because a rank died is reported as that rank's error. Raises :class:`EngineError`
    otherwise; the caller owns the run (and tears it down on failure, which ends the
    requests still in flight)."""
    import threading
    import time

    from warmctl.checkpoint import rankfaults

    watch = layout.RankWatch(run.root_pid, layout.profile_sizes(profile), run.log_path, silence_s=silence_s)

    def after_cell(done: int, total: int, cell) -> None:
        if done == 1:  # in the grid's own thread, before its next request: the same moment on any machine
            rankfaults.kill_rank("warmup", run.root_pid)  # a test's kill -9 / SIGSTOP of one rank

    def grid() -> None:
        warmup.run_grid(run.base_url, profile.engine.served_model_name, profile.warmup, progress=after_cell)

    def watched(fn, what: str):
        out: dict = {}

        def body() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # handed to the waiting thread
                out["error"] = e

        # a daemon thread: neither this wait nor the interpreter's exit ever waits on a request
        # a stopped rank holds up (the teardown's kill of the tree ends it)
        t = threading.Thread(target=body, name="warmctl-" + what.split()[-1], daemon=True)
        watch.busy()  # its requests are in flight from here until it returns
        t.start()
        last_sample = 0.0
        while True:
            t.join(layout.WATCH_INTERVAL_S)
            if not t.is_alive():
                watch.idle()
                if "error" in out:
                    e = out["error"]
                    if isinstance(e, EngineError):
                        raise (watch.problem(what) or e) from e
                    raise e
                return out.get("value")
            if (err := watch.problem(what)) is not None:
                raise err
            if time.monotonic() - last_sample >= 1.0:
                run.sample_shm()
                last_sample = time.monotonic()

    with reporter.phase("warmup", f"warm-up grid: {len(profile.warmup.cells())} cells"):
        watched(grid, "the warm-up")
    with reporter.phase("canary_record", f"recording canary ({len(profile.canary.prompts)} prompts)"):
        return watched(lambda: canary.run(run.base_url, profile.canary, profile.engine.served_model_name),
                       "the canary record")
