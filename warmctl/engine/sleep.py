"""vLLM sleep mode and checkpoint hooks, over the engine's HTTP development endpoints.

Endpoints (vLLM 0.32, ``vllm/entrypoints/serve/dev/``; registered only when the server runs
with ``VLLM_SERVER_DEV_MODE=1``; sleep levels 1 and 2 also need ``--enable-sleep-mode``, which
vLLM accepts on CUDA, ROCm and XPU only - ``Platform.is_sleep_mode_available``)::

    POST /sleep?level=N&mode=M     N: 0 pause scheduling, 1 weights offloaded to host RAM and KV
                                   cache discarded, 2 weights and KV cache discarded; M: what
                                   happens to running requests: abort | wait | keep
                                   -> {"status": "sleeping", "level": N}
    POST /wake_up[?tags=T...]      T in weights | kv_cache | scheduling; none = all
                                   -> {"status": "awake" | "sleeping", "tags": [...]}
    GET  /is_sleeping              -> {"is_sleeping": bool}
    POST /collective_rpc           {"method": M, "args": [str], "kwargs": {str: str},
                                   "timeout": s} -> {"results": [...]} (one per worker)

Sleep keeps virtual addresses (vLLM's ``CuMemAllocator`` unmaps physical memory but keeps the
reservations), so CUDA graphs captured at warm-up stay valid after ``wake_up``. Worker methods
used through ``collective_rpc``: ``checkpoint_prepare`` / ``checkpoint_restore`` (vLLM 0.32
``gpu_worker.py``: prepare FlashInfer all-reduce / all2all workspaces for a process checkpoint
and rebuild them after; a no-op for other transports) and warmctl's own ``warmctl_*_weights``
(below).

Weights outside the process image (``checkpoint.weights_outside_image``): the engine runs with
warmctl's worker extension (:mod:`warmctl.engine.worker_ext`, added to the command line by
:func:`warmctl.engine.vllm.vllm_command`). Before the checkpoint :meth:`SleepClient.save_weights`
has every rank write its parameters as the engine laid them out (post-sharding,
post-quantisation) to ``rank-<r>.safetensors``; these files become store objects of role
``weights`` (deduplicated across snapshots of the same model). Then either sleep level 2 (GPU:
weights and KV cache dropped, virtual addresses kept) or :meth:`SleepClient.release_weights`
(engines without sleep mode, e.g. the CPU build: storage zeroed and freed) keeps them out of the
image. After restore, :func:`wake` wakes the weights, copies every tensor back in place
(:meth:`SleepClient.load_weights`, timed, GB/s in :class:`WeightReload`), then wakes the KV cache.

Errors are :class:`~warmctl.base.errors.EngineError` with the endpoint, HTTP status and body.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from warmctl.base.errors import EngineError

if TYPE_CHECKING:  # imported by the client that uses it: `up` of a snapshot without kept weights never does
    import httpx

SleepLevel = Literal[0, 1, 2]
PauseMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache", "scheduling"]

#: The worker extension class warmctl loads into vLLM workers (``--worker-extension-cls``).
WORKER_EXTENSION = "warmctl.engine.worker_ext.WeightsExtension"

DEV_MODE_HINT = (
    "the engine has no development endpoints: start it with VLLM_SERVER_DEV_MODE=1 "
    "(and --enable-sleep-mode for sleep levels 1 and 2)"
)


@dataclass(frozen=True)
class WeightReload:
    """One in-place weight reload. ``seconds`` of wall time; ``nbytes`` read (0 if unknown)."""

    seconds: float
    nbytes: int

    @property
    def gb_per_s(self) -> float | None:
        """Decimal GB/s (1e9 bytes), None when the size or time is unknown."""
        return self.nbytes / 1e9 / self.seconds if self.nbytes and self.seconds > 0 else None


class SleepClient:
    """Drives one engine's sleep / wake / checkpoint hooks. ``base_url`` like
    ``http://127.0.0.1:18000``; ``timeout_s`` bounds each request (sleep at level 1 copies all
    weights to host RAM: size it accordingly)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str | None = None):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SleepClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise EngineError(f"vLLM {method} {path}: {type(e).__name__}: {e}") from None
        if r.status_code == 404:
            raise EngineError(f"vLLM {method} {path}: 404: {DEV_MODE_HINT}")
        if r.status_code >= 400:
            raise EngineError(f"vLLM {method} {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r

    def is_sleeping(self) -> bool:
        """GET /is_sleeping."""
        return bool(self._call("GET", "/is_sleeping").json()["is_sleeping"])

    def sleep(self, level: SleepLevel = 1, mode: PauseMode = "wait") -> float:
        """POST /sleep; returns seconds taken. ``mode="wait"`` lets running requests finish."""
        if level not in (0, 1, 2):
            raise ValueError("sleep level must be 0, 1 or 2")
        t0 = time.monotonic()
        self._call("POST", "/sleep", params={"level": level, "mode": mode})
        return time.monotonic() - t0

    def wake_up(self, tags: list[WakeTag] | None = None) -> bool:
        """POST /wake_up (all memory when ``tags`` is None); True when fully awake."""
        params = [("tags", t) for t in tags] if tags else None
        return self._call("POST", "/wake_up", params=params).json().get("status") == "awake"

    def collective_rpc(self, method: str, args: list[str] | None = None,
                       kwargs: dict[str, str] | None = None, timeout_s: float | None = None) -> list:
        """POST /collective_rpc: call ``method`` on every worker; the per-worker results.
        Arguments are strings (vLLM refuses other types for safety)."""
        body: dict = {"method": method, "args": args or [], "kwargs": kwargs or {}}
        if timeout_s is not None:
            body["timeout"] = timeout_s
        r = self._call("POST", "/collective_rpc", json=body)
        return r.json().get("results", []) if r.content else []

    def checkpoint_prepare(self) -> None:
        """Before the CUDA lock: let the workers quiesce checkpoint-unfriendly communicator
        workspaces (FlashInfer all-reduce / all2all, vLLM 0.32)."""
        self.collective_rpc("checkpoint_prepare")

    def checkpoint_restore(self) -> None:
        """After the CUDA unlock: rebuild what :meth:`checkpoint_prepare` released."""
        self.collective_rpc("checkpoint_restore")

    def save_weights(self, directory: str | Path) -> list[dict]:
        """Every rank writes its parameters to ``<directory>/rank-<r>.safetensors`` (the
        directory must be writable by the engine: same host). Returns one dict per rank:
        ``rank``, ``path``, ``tensors``, ``bytes``, ``seconds``. Raises :class:`EngineError`
        (no worker extension, disk full in a worker, ...)."""
        return self._rank_rpc("warmctl_save_weights", [str(directory)])

    def release_weights(self) -> list[dict]:
        """Every rank zeroes and frees its parameters' storage (engines without sleep mode).
        The engine answers garbage until :meth:`load_weights`."""
        return self._rank_rpc("warmctl_release_weights", [])

    def load_weights(self, directory: str | Path) -> WeightReload:
        """Every rank copies ``<directory>/rank-<r>.safetensors`` back into its parameters in
        place (on a GPU engine: awake with tags ``["weights"]`` first). Returns the wall time
        and the bytes loaded over all ranks."""
        t0 = time.monotonic()
        res = self._rank_rpc("warmctl_load_weights", [str(directory)])
        return WeightReload(time.monotonic() - t0, sum(int(r.get("bytes", 0)) for r in res))

    def _rank_rpc(self, method: str, args: list[str]) -> list[dict]:
        try:
            res = self.collective_rpc(method, args)
        except EngineError as e:
            if "has no attribute" in str(e) or "not found" in str(e).lower():
                raise EngineError(f"{e}\n(the engine was started without warmctl's worker extension: "
                                  f"--worker-extension-cls {WORKER_EXTENSION})") from None
            raise
        bad = [r for r in res if not isinstance(r, dict)]
        if bad or not res:
            raise EngineError(f"vLLM collective_rpc {method}: unexpected results {res!r:.300}")
        return res


def wake(sc: SleepClient, sleep_level: int, weights_dir: str | Path | None) -> WeightReload | None:
    """Bring an engine frozen for a checkpoint back to serving: wake what sleep dropped and, when
    ``weights_dir`` is given (weights kept outside the image), load them back in place between
    waking the weights and waking the KV cache (the order vLLM's sleep mode gives for updating
    weights: the KV cache is not allocated until the weights are back, which keeps peak GPU
    memory down). Used after a restore and, after a dump that leaves the source engine running,
    on the source engine. Returns the weight load, if any."""
    reload = None
    if weights_dir is not None:
        if sleep_level:
            sc.wake_up(["weights"])
        reload = sc.load_weights(weights_dir)
    if sleep_level:
        sc.wake_up()
    return reload
