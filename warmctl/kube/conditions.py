"""The pod condition ``warmctl.io/Restored``: what ``up --foreground`` is doing, on its own pod.

When ``pod_name`` is set (the downward API, deploy/kubernetes/), the supervisor keeps one
condition of type :data:`CONDITION_TYPE` in its pod's ``status.conditions``, through the
``pods/status`` subresource with a strategic-merge patch (pod conditions merge by ``type``: the
kubelet's ``Ready``, ``ContainersReady``, ... are kept). Each change is one patch carrying
``status``, ``reason``, a one-line ``message`` (the snapshot's digest, the bytes fetched, the
phase's seconds), ``lastProbeTime`` (when it was written) and ``lastTransitionTime`` (when
``status`` last changed).

Reasons (:data:`REASONS`; ``status`` is ``"True"`` only for ``Serving``):

==============  ======  =============================================================
reason          status  when
==============  ======  =============================================================
Resolving       False   choosing the snapshot in the catalog, checking its signature
Pulling         False   fetching and verifying the chunks ("materialize")
Restoring       False   CRIU restore, ranks, GPU state, waiting for ``/health``
CanaryRunning   False   replaying the canary, bit for bit
ColdStarting    False   no usable snapshot: starting, warming and recording the engine
Serving         True    the canary passed and the public port is open
CanaryFailed    False   the canary did not match (:class:`~warmctl.base.errors.CanaryMismatch`)
Refused         False   a snapshot refused: untrusted, corrupt, sealed with another key,
                        holding a secret, or made in another image (:data:`REFUSED`)
<ErrorClass>    False   any other warmctl error, named by its class (``SnapshotNotFound``,
                        ``HostError``, ...); ``Failed`` for an unexpected one
Draining        False   a stop signal: the gate drains, then the engine goes
Stopped         False   stopped by a signal (after the drain, or during ``up``)
EngineDied      False   the supervised engine died or stayed unhealthy
==============  ======  =============================================================

The condition is information for people and routers, never readiness (the readiness probe
asks the gate's ``/health``). A patch never fails or slows ``up``: patches are sent in order
by a child process, ``python -m warmctl.kube.conditions`` (consecutive updates of one reason
coalesce), the first failure is reported once on its standard error and later ones are dropped
silently, and :meth:`PodCondition.close` waits a bounded time for the last ones. ``lightkube``
is imported by that child only: a thread importing it (0.33 s of CPU) held the GIL while ``up``
resolved the snapshot, and the ``catalog`` phase took 0.27-0.48 s instead of 0.05 s
(docs/benchmarks.md); the child runs on another core, in a session of its own (a signal to the
supervisor's process group does not cut the last patches short), and ends at the end of its
standard input (the supervisor closed it or died).
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmctl.records.config import Settings

#: the condition's type on the pod
CONDITION_TYPE = "warmctl.io/Restored"

RESOLVING, PULLING, RESTORING = "Resolving", "Pulling", "Restoring"
CANARY_RUNNING, COLD_STARTING, SERVING = "CanaryRunning", "ColdStarting", "Serving"
CANARY_FAILED, REFUSED, FAILED = "CanaryFailed", "Refused", "Failed"
DRAINING, STOPPED, ENGINE_DIED = "Draining", "Stopped", "EngineDied"

#: every fixed reason (an error's class name is one too: ``SnapshotNotFound``, ``HostError``, ...)
REASONS = (RESOLVING, PULLING, RESTORING, CANARY_RUNNING, COLD_STARTING, SERVING, CANARY_FAILED, REFUSED,
           FAILED, DRAINING, STOPPED, ENGINE_DIED)

#: ``up``'s phases (:class:`warmctl.records.progress.Reporter`) -> the reason their start sets. Phases
#: not named here (``gate``, ``commit``, ``keep``, the snapshot phases of ``--snapshot-after``)
#: keep the reason and, before ``Serving``, update its message.
PHASE_REASONS = {
    "catalog": RESOLVING,
    "materialize": PULLING,
    "restore": RESTORING, "ranks": RESTORING, "vram_preflight": RESTORING, "gpu_restore": RESTORING,
    "weights": RESTORING, "health": RESTORING,
    "canary": CANARY_RUNNING,
    "cold_start": COLD_STARTING, "warmup": COLD_STARTING, "canary_record": COLD_STARTING,
}

#: error classes (by name, anywhere in the error's class hierarchy) whose failure is ``Refused``:
#: the snapshot itself was refused, not the host or the engine
REFUSED_ERRORS = frozenset({"TrustError", "IntegrityError", "ChunkCorrupt", "ChunkMissing", "SealKeyError",
                            "SecretInSnapshot", "ImageMismatch"})

#: a message is cut to this many characters (one line)
MESSAGE_MAX = 1024
#: seconds between two byte-progress updates of ``Pulling``
PROGRESS_INTERVAL_S = 2.0
#: seconds each request to the API server may take
REQUEST_TIMEOUT_S = 5.0


def failure_reason(err: BaseException) -> str:
    """The reason an ``up`` that raised ``err`` ends at: ``CanaryFailed``, ``Refused`` (see
    :data:`REFUSED_ERRORS`), the class name of any other :class:`~warmctl.base.errors.WarmctlError`,
    else ``Failed``."""
    names = [c.__name__ for c in type(err).__mro__]
    if "CanaryMismatch" in names:
        return CANARY_FAILED
    if REFUSED_ERRORS.intersection(names):
        return REFUSED
    if "WarmctlError" in names and type(err).__name__ != "WarmctlError":
        return type(err).__name__
    return FAILED


def one_line(text: str, limit: int = MESSAGE_MAX) -> str:
    """``text`` on one line (lines joined by ``"; "``, blank ones dropped), at most ``limit``
    characters (an ellipsis marks a cut)."""
    s = "; ".join(x.strip() for x in str(text).splitlines() if x.strip())
    return s if len(s) <= limit else s[: limit - 1] + "\u2026"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodCondition:
    """Keeps :data:`CONDITION_TYPE` on the pod ``settings.pod_name`` in
    ``settings.pod_namespace`` (unset: the kubeconfig's or the service account's namespace).

    The ``up`` side calls :meth:`phase_started`, :meth:`phase_finished`, :meth:`chosen`,
    :meth:`progress`, then :meth:`serving` or :meth:`failed`; the supervisor :meth:`draining`,
    :meth:`stopped`, :meth:`died`; :meth:`close` last. None of them blocks on the API server or
    raises for it: each update is one JSON line to the sender (:func:`main`, a child process),
    written by a thread of this process that does nothing else. A sender that cannot start is
    reported through ``warn`` (once); the sender reports its own first failed patch on the
    standard error it shares with this process."""

    def __init__(self, settings: Settings, warn: Callable[[str], None]) -> None:
        self.pod = settings.pod_name
        self._warn = warn
        self._q: queue.Queue[dict | None] = queue.Queue()
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._status: str | None = None
        self._since = _now()
        self._cold = False
        self._digest: str | None = None
        self._ref: str | None = None
        self._t0 = time.monotonic()
        self._phase_t0 = self._t0
        self._last_phase: tuple[str, float] | None = None
        self._last_progress = 0.0
        target = {"pod": settings.pod_name, "namespace": settings.pod_namespace,
                  "kube_config": str(settings.kube_config) if settings.kube_config else None}
        self._sender: subprocess.Popen[bytes] | None = None
        try:
            self._sender = subprocess.Popen([sys.executable, "-m", "warmctl.kube.conditions"], stdin=subprocess.PIPE,
                                            stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            self._warn(f"warning: cannot start the sender of the pod condition {CONDITION_TYPE}: {e} "
                       "(the engine is not affected)")
        self._q.put(target)
        self._thread = threading.Thread(target=self._write, name="warmctl-pod-condition", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what up reports

    def chosen(self, ref: str, digest: str) -> None:
        """The catalog chose snapshot ``digest`` for ``ref`` (``NAME:TAG``)."""
        self._ref, self._digest = ref, digest

    def phase_started(self, name: str, desc: str) -> None:
        """Phase ``name`` of ``up`` started (``desc``: what it does)."""
        self._phase_t0 = self._last_progress = time.monotonic()
        reason = PHASE_REASONS.get(name)
        if reason == COLD_STARTING:
            self._cold = True
        elif reason is not None and self._cold and reason != CANARY_RUNNING:
            reason = COLD_STARTING  # a restore-path phase name reused on the cold path
        if reason is None:
            if self._reason in (None, SERVING):
                return
            reason = self._reason
        parts = [f"{name}: {desc}" if desc else name]
        if self._digest and reason != COLD_STARTING:
            parts.append(f"snapshot {self._digest}")
        if self._last_phase is not None:
            parts.append(f"{self._last_phase[0]} took {self._last_phase[1]:.2f} s")
        self._set("False", reason, "; ".join(parts))

    def phase_finished(self, name: str, seconds: float, ok: bool) -> None:
        """Phase ``name`` ended after ``seconds`` (``ok``: without an error). The end of the
        ``gate`` phase is ``Serving``: the canary passed and the port is open."""
        self._last_phase = (name, seconds)
        if name == "gate" and ok:
            what = f"snapshot {self._digest}" if self._digest and not self._cold else "cold start"
            self._set("True", SERVING, f"canary passed, public port open ({what}); "
                      f"{time.monotonic() - self._t0:.2f} s since start")

    def progress(self, done: int, total: int) -> None:
        """Bytes of the current phase done so far (of ``total``): an update of the message at
        most every :data:`PROGRESS_INTERVAL_S` seconds."""
        now = time.monotonic()
        if self._reason != PULLING or now - self._last_progress < PROGRESS_INTERVAL_S:
            return
        self._last_progress = now
        pct = 100.0 * done / total if total else 100.0
        self._set("False", PULLING, f"materialize: {_mib(done)} of {_mib(total)} verified and written ({pct:.0f}%); "
                  f"snapshot {self._digest}; {now - self._phase_t0:.1f} s")

    def serving(self, res: Any) -> None:
        """``up`` returned ``res`` (a :class:`warmctl.records.contract.UpResult`): ``Serving`` with the
        snapshot's digest, the bytes fetched and the seconds of the phases."""
        st = res.state
        where = f"{st.public_host}:{st.public_port}" if st is not None else "?"
        if res.already_up:
            self._set("True", SERVING, f"already up on {where} ({res.source})")
            return
        parts = [f"serving on {where}"]
        if res.source == "restore":
            parts.append(f"restored {res.snapshot_digest}")
            if res.fetched:
                parts.append(f"read {_mib(res.fetched.get('remote', 0))} from the remote store, "
                             f"{_mib(res.fetched.get('local', 0))} from the local one")
        else:
            parts.append(f"{res.source}" + (f", snapshot {res.snapshot_digest}" if res.snapshot_digest else ""))
        t = res.timings
        shown = [k for k in ("materialize", "restore", "health", "canary", "cold_start", "warmup") if k in t]
        parts.append(f"{t.get('total', 0.0):.2f} s" + (" (" + ", ".join(f"{k} {t[k]:.2f} s" for k in shown) + ")"
                                                       if shown else ""))
        self._set("True", SERVING, "; ".join(parts))

    def failed(self, err: BaseException, exit_code: int) -> None:
        """``up`` raised ``err``; the process exits ``exit_code``."""
        self._set("False", failure_reason(err), f"{type(err).__name__} (exit {exit_code}): {err}")

    # ------------------------------------------------------------------ what the supervisor reports

    def draining(self, signum: int) -> None:
        """A stop signal: the gate drains (its ``/health`` no longer answers), then the engine goes."""
        self._set("False", DRAINING, f"signal {signum}: draining the public port, then taking the engine down")

    def stopped(self, message: str) -> None:
        """Stopped by a signal; ``message`` says what was taken down."""
        self._set("False", STOPPED, message)

    def died(self, why: str) -> None:
        """The supervised engine died (``why``); it was torn down."""
        self._set("False", ENGINE_DIED, why)

    # ------------------------------------------------------------------ the patches

    @property
    def reason(self) -> str | None:
        """The last reason set (sent or queued)."""
        return self._reason

    def _set(self, status: str, reason: str, message: str) -> None:
        with self._lock:
            if status != self._status:
                self._since = _now()
            self._status, self._reason = status, reason
            self._q.put({"type": CONDITION_TYPE, "status": status, "reason": reason, "message": one_line(message),
                         "lastProbeTime": _now(), "lastTransitionTime": self._since})

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued and end the sender, waiting at most ``timeout_s`` seconds for
        both (then the sender is killed)."""
        t_end = time.monotonic() + timeout_s
        self._q.put(None)
        self._thread.join(timeout_s)
        if self._sender is None:
            return
        try:
            self._sender.wait(max(0.0, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._sender.kill()
            self._sender.wait()

    def _write(self) -> None:
        """This process's side: each queued update, one JSON line, to the sender's stdin (in
        order; None closes it). A sender gone (its pipe broken) drops the rest."""
        if self._sender is None or self._sender.stdin is None:
            return
        pipe = self._sender.stdin
        try:
            while (item := self._q.get()) is not None:
                pipe.write(json.dumps(item).encode() + b"\n")
                pipe.flush()
            pipe.close()
        except (OSError, ValueError):  # the sender died (or was killed by close): nothing more can be sent
            pass


# ---------------------------------------------------------------------- the sender (a child process)

def _updates(stream) -> queue.Queue[dict | None]:
    """The JSON lines of ``stream`` on a queue, read by a thread; None at its end (or a line
    that is not JSON: the supervisor is not talking to this)."""
    q: queue.Queue[dict | None] = queue.Queue()

    def read() -> None:
        try:
            for line in stream:
                q.put(json.loads(line))
        except ValueError:
            pass
        q.put(None)

    threading.Thread(target=read, name="updates", daemon=True).start()
    return q


def send(updates: queue.Queue[dict | None], patch: Callable[[dict], None],
         failed: Callable[[BaseException], None]) -> int:
    """Send each condition from ``updates`` with ``patch`` until None, in order; a queued
    newer update of the same reason and status replaces an older one. The first failure is
    passed to ``failed``; later ones are dropped. Returns the number of patches that succeeded."""
    held: list[dict | None] = []  # what the look-ahead took that is not this update's (the end included)
    warned, sent = False, 0
    while True:
        item = held.pop() if held else updates.get()
        if item is None:
            return sent
        while not held:
            try:
                nxt = updates.get_nowait()
            except queue.Empty:
                break
            if nxt is not None and nxt["reason"] == item["reason"] and nxt["status"] == item["status"]:
                item = nxt
            else:
                held.append(nxt)
        try:
            patch(item)
            sent += 1
        except Exception as e:  # noqa: BLE001 - never fails up: reported once, then dropped
            if not warned:
                warned = True
                failed(e)


def main() -> int:
    """``python -m warmctl.kube.conditions``: the sender. Its first stdin line is the target
    (``{"pod", "namespace", "kube_config"}``), each later line a condition to patch onto the
    pod's status; it exits 0 at the end of its stdin. Its first failure goes to its standard
    error, one line. SIGINT and SIGTERM are ignored: a stop meant for the supervisor's group or
    unit must not cut short the patches that say what the stop did (SIGKILL ends it)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    updates = _updates(sys.stdin.buffer)
    target = updates.get()
    if target is None:
        return 0
    pod, kc = target["pod"], target.get("kube_config")
    namespace: str | None = target.get("namespace")
    client: Any = None

    def patch(cond: dict) -> None:
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import PatchType

        from warmctl.kube.client import client_for

        nonlocal client, namespace
        if client is None:
            client = client_for(Path(kc) if kc else None, timeout_s=REQUEST_TIMEOUT_S)
            namespace = namespace or client.namespace
        client.patch(Pod.Status, pod, {"status": {"conditions": [cond]}}, namespace=namespace,
                     patch_type=PatchType.STRATEGIC)

    def failed(e: BaseException) -> None:
        print(f"warning: cannot set the pod condition {CONDITION_TYPE} on pod {namespace or '?'}/{pod}: "
              f"{one_line(str(e) or type(e).__name__, 300)} (the engine is not affected; later failures are not "
              "reported)", file=sys.stderr, flush=True)

    send(updates, patch, failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
