"""``warmctl up NAME --foreground``: bring an engine up, then stay as its supervisor.

Made for a ``Type=notify`` systemd unit (systemd/warmctl-up@.service) whose main process this
is, so that ``Restart=on-failure`` brings a crashed engine back by restoring it again:

1. while ``up``'s phases run, each phase start sends ``EXTEND_TIMEOUT_USEC`` (the phase's
   budget: :data:`PHASE_BUDGET_S`, else :data:`DEFAULT_PHASE_BUDGET_S`) and a ``STATUS=`` line,
   so the unit's start timeout follows the work actually going on;
2. ``READY=1`` is sent only when ``up`` returned: the canary passed and the public port is open;
3. then every :data:`CHECK_INTERVAL_S` (or half of ``$WATCHDOG_USEC`` if shorter) the engine's
   root process and its gate are checked and ``/health`` is asked; ``WATCHDOG=1`` is sent after
   each healthy answer;
4. when the engine tree or the gate dies, or ``/health`` fails for :data:`UNHEALTHY_GRACE_S`,
   what is left of the engine is torn down (processes, ``/dev/shm`` files, record) and the
   process exits :data:`ENGINE_DIED_EXIT` (non-zero: systemd restarts the unit);
5. SIGTERM/SIGINT/SIGHUP (``systemctl stop``): ``STOPPING=1``, the engine is taken down like
   ``warmctl down`` (drain, then kill), exit 0. A signal during ``up`` tears down what ``up``
   had started and exits 128+signal; one that comes once the public port is open (the ``gate``
   phase ended: the engine may already be answering requests, a pod already Ready) is held until
   ``up`` returns, then taken as in step 5 (:class:`StopSignals`).

Without ``$NOTIFY_SOCKET`` (a terminal, a test) the same happens, minus the notifications.

In a Kubernetes pod (``pod_name`` set, from the downward API) the same process is the engine
container's main process: it also keeps the pod's ``warmctl.io/Restored`` condition through
every phase (:mod:`warmctl.kube.conditions`: information, never readiness; the readiness probe
asks the gate's ``/health``, which answers only once the canary passed and the port opened, and
no longer once a drain began; with ``--ready-port`` it asks :mod:`warmctl.kube.readiness`'s
``/ready`` instead, which holds the probe until the port opens, then answers what the gate's
``/health`` answers). When ``up`` fails, or the engine dies, the one-line error goes to
the termination message file (``termination_message_path``; ``/dev/termination-log`` in a pod),
which ``kubectl describe pod`` shows; the exit status is warmctl's.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from warmctl.engine.loopback import healthy
from warmctl.records.progress import ConsoleReporter
from warmctl.base.sdnotify import notify, watchdog_interval_s

#: exit status when the supervised engine died or stayed unhealthy (not a WarmctlError code)
ENGINE_DIED_EXIT = 7
#: seconds between checks of the engine (processes alive, ``/health``)
CHECK_INTERVAL_S = 1.0
#: seconds ``/health`` may fail (the process alive) before the engine counts as dead
UNHEALTHY_GRACE_S = 30.0
#: seconds a phase of ``up`` may take before systemd's start timeout fires (EXTEND_TIMEOUT_USEC)
DEFAULT_PHASE_BUDGET_S = 300.0
#: per-phase budgets where the default does not fit (a cold start loads and compiles a model)
PHASE_BUDGET_S = {"cold_start": 1800.0, "warmup": 900.0, "snapshot": 900.0, "dump": 900.0}


class Stopped(BaseException):
    """A stop signal arrived (raised from the signal handler, like KeyboardInterrupt, so that
    ``up``'s clean-up on any exception runs)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class NotifyingReporter(ConsoleReporter):
    """:class:`ConsoleReporter` that also tells systemd each phase: ``EXTEND_TIMEOUT_USEC`` by
    the phase's budget and ``STATUS=NAME: description``."""

    #: the pod condition each phase also drives (a :class:`warmctl.kube.conditions.PodCondition`;
    #: None outside a pod)
    condition: Any = None
    #: called when the ``gate`` phase ended well: the public port is open
    port_opened: Callable[[], None] | None = None

    def started(self, name: str, desc: str) -> None:
        budget = PHASE_BUDGET_S.get(name, DEFAULT_PHASE_BUDGET_S)
        notify(f"EXTEND_TIMEOUT_USEC={int(budget * 1e6)}", f"STATUS={name}: {desc}"[:200])
        if self.condition is not None:
            self.condition.phase_started(name, desc)
        super().started(name, desc)

    def finished(self, name: str, seconds: float, ok: bool) -> None:
        super().finished(name, seconds, ok)
        if name == "gate" and ok and self.port_opened is not None:
            self.port_opened()
        if self.condition is not None:
            self.condition.phase_finished(name, seconds, ok)

    def chosen(self, ref: str, digest: str) -> None:
        if self.condition is not None:
            self.condition.chosen(ref, digest)

    def bytes_progress(self, desc: str, total: int) -> Callable[[int], None]:
        shown = super().bytes_progress(desc, total)
        cond = self.condition
        if cond is None:
            return shown
        done = [0]

        def advance(n: int) -> None:
            shown(n)
            done[0] += n
            cond.progress(done[0], total)

        return advance


#: the signals that stop the supervisor
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """The handler of :data:`STOP_SIGNALS` in :func:`run`: each raises :class:`Stopped`, except
    while held (:meth:`hold`: from the moment the public port is open until supervision begins),
    when the first is kept and raised by :meth:`release`. A stop that lands between the port
    opening and ``up`` returning is thus a drain of a serving engine (exit 0), not a teardown in
    the middle of ``up`` (exit 128+signal, the engine perhaps left serving past ``up``'s clean-up)."""

    def __init__(self) -> None:
        self.holding = False
        self.held: int | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.holding:
            self.held = self.held or signum
            return
        raise Stopped(signum)

    def hold(self) -> None:
        self.holding = True

    def release(self) -> None:
        """Raise :class:`Stopped` from now on; at once if a signal was held."""
        self.holding = False
        if self.held is not None:
            raise Stopped(self.held)


def run(name: str, settings, reporter: NotifyingReporter, up: Callable[[NotifyingReporter], object],
        show: Callable[[object], None], say: Callable[[str], None], ready_at: tuple[str, int] | None = None) -> int:
    """Bring ``name`` up with ``up(reporter)`` (a :class:`warmctl.records.contract.UpResult`), print it
    with ``show``, then supervise it (module doc). ``say`` prints one line to the log.
    ``ready_at``: (host, port) of the readiness endpoint (:mod:`warmctl.kube.readiness`),
    served from before ``up`` starts until this returns; :class:`HostError` when it cannot be
    bound (nothing started then). Returns the exit status: 0 after a stop signal,
    :data:`ENGINE_DIED_EXIT` when the engine died, 128+signal when stopped during ``up``
    before the public port opened."""
    stops = StopSignals()
    stops.install()
    ready: Any = None

    def port_opened() -> None:
        stops.hold()
        if ready is not None:
            ready.opened()

    reporter.port_opened = port_opened
    cond = reporter.condition = pod_condition(settings, say)
    try:
        try:
            notify(f"EXTEND_TIMEOUT_USEC={int(DEFAULT_PHASE_BUDGET_S * 1e6)}", f"STATUS=bringing {name} up")
            if ready_at is not None:
                ready = readiness_server(name, settings, *ready_at)
            res = up(reporter)
        except Stopped as e:
            _ignore_stop_signals()
            say(f"stopped by signal {e.signum} while bringing {name} up; what it had started was torn down")
            if cond is not None:
                cond.stopped(f"signal {e.signum} while bringing {name} up; what it had started was torn down")
            return 128 + e.signum
        except BaseException as e:
            code = getattr(e, "exit_code", 1)
            if cond is not None:
                cond.failed(e, code)
            write_termination_message(settings, f"{type(e).__name__} (exit {code}): {e}", say)
            raise
        if ready is not None:  # an engine already up opened no port
            ready.opened()
        if cond is not None:
            cond.serving(res)
        st = res.state  # type: ignore[attr-defined]
        total = res.timings.get("total")  # type: ignore[attr-defined]
        notify("READY=1", f"STATUS=serving {name} on {st.public_host}:{st.public_port} "
               f"({'already up' if res.already_up else res.source}"  # type: ignore[attr-defined]
               + (f" in {total:.1f} s" if total else "") + ")")
        show(res)
        return watch(name, settings, say, condition=cond, stops=stops)
    finally:
        if ready is not None:
            ready.close()
        if cond is not None:
            cond.close()


def readiness_server(name: str, settings, host: str, port: int) -> Any:
    """A :class:`warmctl.kube.readiness.ReadinessServer` on ``host:port`` whose check, once the
    public port is open, asks the gate's ``/health`` on the public port recorded for ``name``
    (over loopback when the gate listens on every address; over TLS when it has TLS). Raises
    :class:`HostError` when ``host:port`` cannot be bound."""
    from warmctl.base.errors import HostError
    from warmctl.base.ports import require_port_free
    from warmctl.kube.readiness import ReadinessServer
    from warmctl.records.state import load as load_state

    def gate_health() -> tuple[bool, str]:
        st = load_state(settings.run_dir, name)
        if st is None:
            return False, f"engine {name} is not recorded as running"
        addr = "127.0.0.1" if st.public_host in ("0.0.0.0", "", "::") else st.public_host
        if healthy(st.public_port, timeout_s=2.0, host=addr, tls=st.gate_tls):
            return True, ""
        return False, f"the gate's /health on {addr}:{st.public_port} did not answer 200"

    require_port_free(host, port, "the readiness port (--ready-port)")
    try:
        return ReadinessServer(host, port, gate_health)
    except OSError as e:
        raise HostError(f"the readiness port (--ready-port) {host}:{port}: {e}") from None


def pod_condition(settings, say: Callable[[str], None]) -> Any:
    """A :class:`warmctl.kube.conditions.PodCondition` for the pod ``settings.pod_name`` (its
    first failure reported through ``say``), or None outside a pod (``lightkube`` is then never
    imported)."""
    if not settings.pod_name:
        return None
    from warmctl.kube.conditions import PodCondition

    return PodCondition(settings, warn=say)


#: Kubernetes reads at most this many bytes of a termination message
TERMINATION_MESSAGE_MAX = 4096


def termination_message_path(settings) -> Path | None:
    """Where a failing ``up --foreground`` writes its one-line error: ``termination_message_path``,
    else ``/dev/termination-log`` when ``pod_name`` is set (the kubelet's default
    ``terminationMessagePath``), else None."""
    if settings.termination_message_path is not None:
        return Path(settings.termination_message_path)
    return Path("/dev/termination-log") if settings.pod_name else None


def write_termination_message(settings, message: str, say: Callable[[str], None]) -> None:
    """Write ``message`` on one line (lines joined by ``"; "``, cut to
    :data:`TERMINATION_MESSAGE_MAX` bytes) to :func:`termination_message_path`, if any. A
    file that cannot be written is reported through ``say``, never raised."""
    path = termination_message_path(settings)
    if path is None:
        return
    line = "; ".join(x.strip() for x in message.splitlines() if x.strip())
    data = line.encode()
    if len(data) > TERMINATION_MESSAGE_MAX - 1:  # room for the newline
        data = data[: TERMINATION_MESSAGE_MAX - 4].decode(errors="ignore").encode() + "\u2026".encode()
    try:
        path.write_bytes(data + b"\n")
    except OSError as e:
        say(f"warning: cannot write the termination message to {path}: {e}")


def watch(name: str, settings, say: Callable[[str], None], *, interval_s: float = CHECK_INTERVAL_S,
          unhealthy_grace_s: float = UNHEALTHY_GRACE_S, condition: Any = None,
          stops: StopSignals | None = None) -> int:
    """Supervise the running engine ``name`` (steps 3-5 of the module doc); returns the exit
    status. Expects the stop signals to raise :class:`Stopped`; ``stops``, when given, is
    released first (a stop it held is taken at once). ``condition``: the pod condition
    (:class:`warmctl.kube.conditions.PodCondition`) told of a death or a stop."""
    from warmctl.engine.run import EngineRun
    from warmctl.pipelines.lifecycle import down

    try:
        if stops is not None:
            stops.release()
        run_ = EngineRun.load(settings.run_dir, name)
        if run_ is None or run_.state is None:
            say(f"engine {name} is not recorded as running; nothing to supervise")
            return ENGINE_DIED_EXIT
        wd = watchdog_interval_s()
        interval = min(interval_s, wd) if wd else interval_s
        port = run_.state.internal_port
        bad_since: float | None = None
        while True:
            time.sleep(interval)
            why = None
            if not run_.alive():
                why = f"its process tree died (root pid {run_.state.root_pid})"
            elif run_.gate is None or not run_.gate.alive():
                why = f"its gate died (public port {run_.state.public_port} closed)"
            elif healthy(port):
                notify("WATCHDOG=1")
                bad_since = None
            else:
                now = time.monotonic()
                bad_since = bad_since or now
                if now - bad_since >= unhealthy_grace_s:
                    why = f"/health on port {port} failed for {now - bad_since:.0f} s"
            if why:
                notify(f"STATUS=engine {name} died: {why}")
                say(f"engine {name} died: {why}; tearing down what is left, exit {ENGINE_DIED_EXIT}")
                _ignore_stop_signals()
                t0 = time.monotonic()
                run_.teardown()
                say(f"torn down in {time.monotonic() - t0:.2f} s")
                if condition is not None:
                    condition.died(f"engine {name} died: {why}; torn down, exit {ENGINE_DIED_EXIT}")
                write_termination_message(settings, f"engine {name} died: {why} (exit {ENGINE_DIED_EXIT})", say)
                return ENGINE_DIED_EXIT
    except Stopped as e:
        _ignore_stop_signals()
        notify("STOPPING=1", f"STATUS=stopping {name}")
        say(f"signal {e.signum}: taking {name} down")
        if condition is not None:
            condition.draining(e.signum)
        t0 = time.monotonic()
        down(name, settings)
        say(f"{name} is down")
        if condition is not None:
            condition.stopped(f"signal {e.signum}: drained and taken down in {time.monotonic() - t0:.2f} s")
        return 0


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
