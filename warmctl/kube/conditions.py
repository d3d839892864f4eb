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
by a background thread (consecutive updates of one reason coalesce), the first failure is
reported once through ``warn`` and later ones are dropped silently, and :meth:`PodCondition.close`
waits a bounded time for the last ones. ``lightkube`` is imported by that thread only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
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
    raises for it. ``warn(line)`` reports the first failed patch (once). ``connect``: how the
    thread gets a ``lightkube.Client`` (default :func:`warmctl.kube.client.connect`)."""

    def __init__(self, settings: Settings, warn: Callable[[str], None],
                 connect: Callable[[Settings], Any] | None = None) -> None:
        self.settings = settings
        self.pod = settings.pod_name
        self.namespace = settings.pod_namespace
        self._warn = warn
        self._connect = connect
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
        self._warned = False
        self.sent: list[tuple[str, str, str]] = []  # (status, reason, message) patched, in order
        self._thread = threading.Thread(target=self._run, name="warmctl-pod-condition", daemon=True)
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
        """Send what is queued (waiting at most ``timeout_s`` seconds), then stop the thread."""
        self._q.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        client = None
        pending: dict | None = None
        while True:
            item = pending if pending is not None else self._q.get()
            pending = None
            if item is None:
                return
            # coalesce: a newer update of the same reason replaces this one
            while True:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is not None and nxt["reason"] == item["reason"] and nxt["status"] == item["status"]:
                    item = nxt
                    continue
                pending = nxt
                break
            try:
                if client is None:
                    client = self._client()
                self._patch(client, item)
                self.sent.append((item["status"], item["reason"], item["message"]))
            except Exception as e:  # noqa: BLE001 - never fails up: reported once, then dropped
                if not self._warned:
                    self._warned = True
                    self._warn(f"warning: cannot set the pod condition {CONDITION_TYPE} on pod "
                               f"{self.namespace or '?'}/{self.pod}: {one_line(str(e) or type(e).__name__, 300)} "
                               "(the engine is not affected; later failures are not reported)")

    def _client(self) -> Any:
        from warmctl.kube.client import connect

        client = self._connect(self.settings) if self._connect else connect(self.settings, timeout_s=REQUEST_TIMEOUT_S)
        if not self.namespace:
            self.namespace = client.namespace
        return client

    def _patch(self, client: Any, cond: dict) -> None:
        from lightkube.resources.core_v1 import Pod
        from lightkube.types import PatchType

        client.patch(Pod.Status, self.pod, {"status": {"conditions": [cond]}}, namespace=self.namespace,
                     patch_type=PatchType.STRATEGIC)

