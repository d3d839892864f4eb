"""Every GPU process of an engine, checkpointed and restored as one.

A tensor-parallel vLLM engine is several processes (one per GPU rank, plus the API server and
engine core); each rank holds a CUDA context. CRIU can dump none of them while they hold GPU
mappings, so the CUDA driver checkpoints their GPU state first (:mod:`warmctl.checkpoint.cuda`).
The order matters:

snapshot (:func:`checkpoint_ranks`, around the CRIU dump)::

    record each rank's GPU footprint (NVML)       -> report.gpu_bytes {uuid: bytes}
    check host RAM >= that footprint               GPU memory is staged in host RAM
    lock every rank  (all locks succeed ...)       a rank mid-collective would wait for its
    checkpoint every rank (... before any of this)  peers forever if they were already frozen
    -- body: CRIU dump --
    on an exception in any step: restore + unlock what was done, so the engine keeps serving
    on normal exit: ranks still alive (criu --leave-running) are restored + unlocked

restore (:func:`restore_ranks`, after the CRIU restore)::

    check free memory on each target GPU >= what the snapshot needs   BEFORE any restore:
        a restore that runs out of memory leaves the process stuck for good
        (NVIDIA/cuda-checkpoint#44)
    restore every rank, then unlock every rank
    on any failure: kill every rank (the caller kills the rest of the tree and cleans up)

"All ranks locked before any is checkpointed" and the transports that must be off for a
tensor-parallel restore are from NVIDIA/nvcf#1183 and #1184 (8x H100, vLLM TP2/TP4 restored
with ``--disable-custom-all-reduce``, ``NCCL_P2P_DISABLE=1``, ``NCCL_NVLS_ENABLE=0``,
``NCCL_SHM_DISABLE=1``) and NVIDIA/nccl#2350 (``NCCL_CUMEM_HOST_ENABLE=0``); see ``docs/gpu.md``.
Operations on different ranks within one phase run in parallel threads (one driver call per
rank); a phase has a wall-clock bound, after which its unfinished calls are reported as
timed out (a driver call cannot be cancelled, so its thread is abandoned).

Rank discovery (:func:`gpu_rank_pids`): a process of the tree is a rank when NVML lists it as a
compute process, or when its memory maps include a ``/dev/nvidia*`` device (a CUDA context);
a process that only has such a file open (an NVML client) is not. Before the dump every rank
must have released its ``/dev/nvidia*`` maps and files (CRIU cannot dump them).
After a CUDA checkpoint neither holds (the driver released the GPU), so at restore time the
ranks are found again by their PID inside the engine's PID namespace, recorded at snapshot time
(:attr:`CheckpointReport.nspids`, :func:`restored_ranks`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from warmctl.checkpoint import cuda, nvml
from warmctl.base.errors import CheckpointError
from warmctl.base.proc import ProcessId, nspid, pid_alive, signal_process, tree_pids

#: Device files of the NVIDIA driver; a process mapping or holding one has GPU state.
DEVICE_PREFIX = "/dev/nvidia"

#: Default seconds for a driver lock (the driver's own timeout; seed: profile.checkpoint.lock_timeout_s).
DEFAULT_LOCK_TIMEOUT_S = 30.0


class RankCheckpointError(CheckpointError):
    """Checkpointing or restoring the ranks failed. ``report`` holds what was done and timed,
    ``failures`` maps each failed pid to its error message, ``rolled_back`` says whether the
    rollback completed (snapshot: ranks unlocked and serving; restore: ranks killed)."""

    def __init__(self, message: str, report: "RankReport", failures: Mapping[int, str] | None = None,
                 rolled_back: bool = True):
        super().__init__(message)
        self.report = report
        self.failures = dict(failures or {})
        self.rolled_back = rolled_back


class InsufficientGpuMemory(RankCheckpointError):
    """A target GPU has less free memory than the snapshot needs; nothing was restored."""


class InsufficientHostMemory(RankCheckpointError):
    """Host RAM cannot stage the ranks' GPU memory; nothing was locked."""


@dataclass
class RankReport:
    """What a checkpoint or restore of the ranks did. Times in seconds, memory in bytes.

    ``phases``: seconds per phase (``lock``, ``checkpoint``, ``resume`` / ``precheck``,
    ``restore``, ``unlock``, ``rollback``); ``per_rank``: ``{phase: {pid: seconds}}``;
    ``timeouts``: the limits used (None = unbounded); ``gpu_bytes``: ``{gpu_uuid: bytes}`` the
    ranks held (snapshot) or needed (restore); ``free_bytes``: free memory seen per GPU;
    ``nspids``: ``{host pid: pid inside the engine's PID namespace}``.
    """

    pids: list[int]
    api: str = ""
    driver_version: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    per_rank: dict[str, dict[int, float]] = field(default_factory=dict)
    timeouts: dict[str, float | None] = field(default_factory=dict)
    gpu_bytes: dict[str, int] = field(default_factory=dict)
    free_bytes: dict[str, int] = field(default_factory=dict)
    host_available_bytes: int | None = None
    nspids: dict[int, int] = field(default_factory=dict)
    resumed: list[int] = field(default_factory=list)
    rollback: str | None = None

    def to_dict(self) -> dict:
        """JSON-able form (pids as string keys)."""
        d = asdict(self)
        d["per_rank"] = {ph: {str(p): s for p, s in m.items()} for ph, m in self.per_rank.items()}
        d["nspids"] = {str(k): v for k, v in self.nspids.items()}
        return d


CheckpointReport = RankReport
RestoreReport = RankReport


# ---------------------------------------------------------------------------------------------
# Discovery


def maps_gpu_device(pid: int, prefix: str = DEVICE_PREFIX) -> bool:
    """True when ``pid`` has a memory mapping (``/proc/PID/maps``) of a file whose path starts
    with ``prefix``: what a CUDA context does (device memory and the driver's control pages are
    mapped from ``/dev/nvidia*``), and what CRIU cannot dump ("Can't handle non-regular
    mapping"). False when it cannot be read (gone, or not ours)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(prefix):
                    return True
    except OSError:
        return False
    return False


def opens_gpu_device(pid: int, prefix: str = DEVICE_PREFIX) -> bool:
    """True when ``pid`` has a file descriptor (``/proc/PID/fd``) open on a path starting with
    ``prefix``. An NVML client (``nvmlInit``: ``/dev/nvidiactl``, ``/dev/nvidia0``) does this
    without having a CUDA context, so this alone does not make a rank. False when unreadable."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


def holds_gpu_device(pid: int, prefix: str = DEVICE_PREFIX) -> bool:
    """True when ``pid`` maps or has open a file whose path starts with ``prefix``
    (:func:`maps_gpu_device` or :func:`opens_gpu_device`). False when it cannot be read."""
    return maps_gpu_device(pid, prefix) or opens_gpu_device(pid, prefix)


def gpu_rank_pids(root_pid: int, *, device_prefix: str = DEVICE_PREFIX, nvml_path: str | None = None) -> list[int]:
    """Host PIDs of every process in ``root_pid``'s tree that holds a CUDA context, sorted.

    A process counts when NVML reports it as a compute process or when it *maps* a
    ``/dev/nvidia*`` file (a CUDA context does both). A process that only has such a file open
    (an NVML client, e.g. vLLM's API server asking for GPU names) is not a rank: it has no CUDA
    state to lock or checkpoint. Returns [] on a host without an NVIDIA driver.
    """
    tree = tree_pids(root_pid)
    on_gpu = nvml.compute_processes(nvml_path)
    return [p for p in tree if p in on_gpu or maps_gpu_device(p, device_prefix)]


def gpu_footprint(pids: list[int], nvml_path: str | None = None) -> dict[str, int]:
    """``{gpu_uuid: bytes}`` the given processes hold, summed per GPU (NVML). A process whose
    usage NVML cannot report (``NVML_VALUE_NOT_AVAILABLE``, e.g. in some containers) counts as
    the GPU's whole used memory, to stay on the safe side. {} without a driver."""
    procs = nvml.compute_processes(nvml_path)
    used = {g.uuid: g.used for g in nvml.gpus(nvml_path)}
    out: dict[str, int] = {}
    for p in pids:
        for uuid, b in procs.get(p, {}).items():
            if b >= 2**63:
                b = used.get(uuid, 0)
            out[uuid] = out.get(uuid, 0) + b
    return out


def restored_ranks(root_pid: int, nspids: Mapping[int, int] | list[int]) -> list[int]:
    """After a CRIU restore: the new host PIDs of the ranks whose namespace PIDs were recorded at
    snapshot time (``report.nspids`` values, or a list of them). Raises
    :class:`~warmctl.base.errors.CheckpointError` if one is missing from the restored tree. The
    lookup is the rank model's (:func:`warmctl.checkpoint.layout.restored_pids`), which also
    checks every rank of ``restore.layout`` after a restore, GPU ranks included."""
    from warmctl.checkpoint.layout import restored_pids

    want = set(nspids.values() if isinstance(nspids, Mapping) else nspids)
    found = restored_pids(root_pid, sorted(want))
    missing = want - set(found)
    if missing:
        raise CheckpointError(f"restored tree of pid {root_pid} lacks the GPU ranks with namespace pids {sorted(missing)}")
    return sorted(found.values())


def host_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def default_gpu_pairs(snapshot_uuids: list[str], host_uuids: list[str],
                      checkpointed: Iterable[str] | None = None) -> dict[str, str] | None:
    """The GPU map for a restore: None when every checkpointed GPU exists here (restore in
    place); else checkpointed GPU i -> host GPU i, both in index order.

    ``snapshot_uuids``: the source host's GPUs in index order; ``checkpointed``: the GPUs the
    ranks held (the snapshot's ``gpu_bytes`` keys). Only those are mapped: the driver wants a map
    of "every checkpointed GPU" (driver API doc), and a source GPU the engine did not use must
    not make a restore need more GPUs than it does. Raises
    :class:`~warmctl.base.errors.CheckpointError` when the host has fewer GPUs than were checkpointed.
    """
    if checkpointed is not None:
        used = set(checkpointed)
        snapshot_uuids = [u for u in snapshot_uuids if u in used] + sorted(used - set(snapshot_uuids))
    if set(snapshot_uuids) <= set(host_uuids):
        return None
    if len(host_uuids) < len(snapshot_uuids):
        raise CheckpointError(f"snapshot needs {len(snapshot_uuids)} GPUs, this host has {len(host_uuids)}")
    return dict(zip(snapshot_uuids, host_uuids))


# ---------------------------------------------------------------------------------------------
# Phases


class PhaseTimeout(cuda.CudaCheckpointError):
    """A driver call did not return within the phase's wall-clock bound."""


def _run_phase(name: str, pids: list[int], fn: Callable[[int], None], timeout_s: float | None,
               report: RankReport, parallel: bool = True) -> dict[int, BaseException]:
    """Run ``fn(pid)`` for every pid (in parallel threads), bounded by ``timeout_s`` in all.
    Records seconds per rank and for the phase; returns ``{pid: error}`` for failures."""
    results: dict[int, BaseException | None] = {}
    times: dict[int, float] = {}
    done = threading.Condition()

    def one(pid: int) -> None:
        t0 = time.monotonic()
        err: BaseException | None = None
        try:
            fn(pid)
        except BaseException as e:  # noqa: BLE001 - reported per rank
            err = e
        with done:
            times[pid] = time.monotonic() - t0
            results[pid] = err
            done.notify_all()

    t0 = time.monotonic()
    deadline = None if timeout_s is None else t0 + timeout_s
    if parallel:
        for p in pids:
            threading.Thread(target=one, args=(p,), name=f"cuda-{name}-{p}", daemon=True).start()
        with done:
            while len(results) < len(pids):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                done.wait(left)
    else:
        for p in pids:
            if deadline is not None and time.monotonic() >= deadline:
                break
            one(p)
    report.phases[name] = report.phases.get(name, 0.0) + (time.monotonic() - t0)
    report.per_rank[name] = dict(times)
    errors: dict[int, BaseException] = {}
    with done:
        for p in pids:
            if p not in results:
                errors[p] = PhaseTimeout(
                    f"cuda {name} of pid {p} did not return within {timeout_s:g} s", op=name, pid=p
                )
            elif results[p] is not None:
                errors[p] = results[p]  # type: ignore[assignment]
    return errors


def _describe(errors: Mapping[int, BaseException]) -> str:
    return "; ".join(str(e) for _, e in sorted(errors.items()))


def _kill(idents: list[ProcessId | None]) -> None:
    """SIGKILL each rank that still is the recorded process (:func:`warmctl.base.proc.signal_process`)."""
    for ident in idents:
        signal_process(ident, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Snapshot side


def _resume(api: cuda.CheckpointAPI, pids: list[int], report: RankReport, phase: str,
            timeout_s: float | None) -> dict[int, BaseException]:
    """Bring ranks back to RUNNING from whatever state they reached (rollback / resume)."""

    def back(pid: int) -> None:
        st = api.state(pid)
        if st == cuda.ProcessState.CHECKPOINTED:
            api.restore(pid)
            st = cuda.ProcessState.LOCKED
        if st == cuda.ProcessState.LOCKED:
            api.unlock(pid)
            st = api.state(pid)
        if st != cuda.ProcessState.RUNNING:  # FAILED, or stuck mid-transition: not serving
            raise cuda.IllegalState(f"cuda {phase} of pid {pid}: the process is {st.name}, not RUNNING; "
                                    "its GPU state is lost (kill it)", op=phase, pid=pid, code=None)

    live = [p for p in pids if pid_alive(p)]
    return _run_phase(phase, live, back, timeout_s, report)


def resume_ranks(pids: list[int], *, timeout_s: float | None = 30.0, api: cuda.CheckpointAPI | None = None,
                 phase: str = "resume") -> tuple[RankReport, dict[int, str]]:
    """Bring every live rank back to RUNNING from whatever state it reached (CHECKPOINTED:
    restore + unlock; LOCKED: unlock), all in parallel, bounded by ``timeout_s`` in all. For
    clean-up paths (a check that failed or got SIGTERM) before the ranks are killed: a process
    must not be left LOCKED or CHECKPOINTED in the driver. Returns the report and
    ``{pid: error}`` of the ranks that are not RUNNING afterwards (FAILED, timed out...).
    Never raises for a rank's failure; raises :class:`CudaUnavailable` without a driver."""
    report = RankReport(pids=list(pids))
    report.timeouts = {phase: timeout_s}
    if not pids:
        return report, {}
    api = api or cuda.load()
    report.api, report.driver_version = api.kind, api.driver_version
    errors = _resume(api, pids, report, phase, timeout_s)
    return report, {p: str(e) for p, e in errors.items()}


@contextmanager
def checkpoint_ranks(
    pids: list[int],
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    *,
    checkpoint_timeout_s: float | None = None,
    resume_timeout_s: float | None = None,
    api: cuda.CheckpointAPI | None = None,
    check_host_ram: bool = True,
    resume: bool = True,
    nvml_path: str | None = None,
    device_prefix: str = DEVICE_PREFIX,
) -> Iterator[RankReport]:
    """Lock then checkpoint every rank; yield a :class:`RankReport`; the CRIU dump goes inside.

    ``lock_timeout_s``: the driver's lock timeout per rank (the wall bound of the lock phase is
    that plus 10 s). ``checkpoint_timeout_s``: wall bound of the checkpoint phase (None: none;
    it copies all GPU memory to host RAM, so size it to the footprint). ``resume_timeout_s``:
    bound of the restore+unlock done on rollback or resume.

    Rollback: if a lock or checkpoint fails, or the body raises, every rank reached is restored
    and unlocked, so the source engine keeps serving; the error raised is
    :class:`RankCheckpointError` (phase failures) or the body's own exception (with a note on the
    rollback). On normal exit, ranks still alive (``criu dump --leave-running``) are resumed when
    ``resume`` is true; dead ones (CRIU's default kills the tree) are skipped.
    ``pids == []`` yields an empty report and does nothing. After the checkpoint phase every
    rank must have released its ``device_prefix`` (``/dev/nvidia``) mappings and files, else
    the ranks are rolled back before the body (the dump) runs (phase ``release-check``).
    A rank whose rollback ends in any state but RUNNING (e.g. FAILED) makes the rollback
    ``incomplete``.
    """
    report = RankReport(pids=list(pids))
    report.timeouts = {"lock": lock_timeout_s, "checkpoint": checkpoint_timeout_s, "resume": resume_timeout_s}
    if not pids:
        yield report
        return
    api = api or cuda.load()
    report.api, report.driver_version = api.kind, api.driver_version
    report.nspids = {p: n for p in pids if (n := nspid(p)) is not None}
    report.gpu_bytes = gpu_footprint(pids, nvml_path)
    report.host_available_bytes = host_available_bytes()
    need = sum(report.gpu_bytes.values())
    if check_host_ram and report.host_available_bytes is not None and need > report.host_available_bytes:
        raise InsufficientHostMemory(
            f"the GPU ranks hold {need / 2**30:.1f} GiB of GPU memory, which the driver stages in host RAM, "
            f"but only {report.host_available_bytes / 2**30:.1f} GiB is available; nothing was locked",
            report,
        )

    def fail(phase: str, errors: Mapping[int, BaseException], reached: list[int]) -> RankCheckpointError:
        rb = _resume(api, reached, report, "rollback", resume_timeout_s)
        report.rollback = "complete" if not rb else f"incomplete: {_describe(rb)}"
        msg = (f"cuda {phase} failed on {len(errors)} of {len(pids)} GPU ranks: {_describe(errors)}; "
               + ("rolled back, the engine keeps serving" if not rb
                  else f"ROLLBACK FAILED, ranks may be stuck: {_describe(rb)}"))
        err = RankCheckpointError(msg, report, {p: str(e) for p, e in errors.items()}, rolled_back=not rb)
        first = next(iter(errors.values()))
        err.__cause__ = first
        return err

    lock_bound = lock_timeout_s + 10.0 if lock_timeout_s else None
    errors = _run_phase("lock", pids, lambda p: api.lock(p, lock_timeout_s), lock_bound, report)
    if errors:
        # Ranks whose lock timed out at the phase bound may still get locked later; roll back all.
        raise fail("lock", errors, pids)
    errors = _run_phase("checkpoint", pids, api.checkpoint, checkpoint_timeout_s, report)
    if errors:
        raise fail("checkpoint", errors, pids)
    # A checkpointed process "no longer directly refers to any GPU hardware at the OS level"
    # (cuda-checkpoint README). One that still does would make CRIU fail late, with "Can't
    # handle non-regular mapping": refuse now, before the dump, and roll back.
    held = {p: cuda.CudaCheckpointError(
                f"pid {p} still maps or holds open {device_prefix}* after its CUDA checkpoint; CRIU cannot "
                "dump that (\"Can't handle non-regular mapping\")", op="release-check", pid=p)
            for p in pids if holds_gpu_device(p, device_prefix)}
    if held:
        raise fail("release-check", held, pids)
    try:
        yield report
    except BaseException as e:
        rb = _resume(api, pids, report, "rollback", resume_timeout_s)
        report.rollback = "complete" if not rb else f"incomplete: {_describe(rb)}"
        e.add_note(f"GPU ranks {pids}: rollback (restore + unlock) {report.rollback}")
        raise
    if resume:
        live = [p for p in pids if pid_alive(p)]
        errors = _resume(api, live, report, "resume", resume_timeout_s)
        report.resumed = [p for p in live if p not in errors]
        if errors:
            raise RankCheckpointError(
                f"snapshot taken, but resuming the source GPU ranks failed: {_describe(errors)}",
                report, {p: str(e) for p, e in errors.items()}, rolled_back=False,
            )


# ---------------------------------------------------------------------------------------------
# Restore side


def restore_ranks(
    pids: list[int],
    gpu_pairs: Mapping[str, str] | None = None,
    required_free_bytes: Mapping[str, int] | None = None,
    *,
    restore_timeout_s: float | None = None,
    unlock_timeout_s: float | None = 60.0,
    api: cuda.CheckpointAPI | None = None,
    kill_on_failure: bool = True,
    nvml_path: str | None = None,
) -> RankReport:
    """Restore then unlock every rank of a CRIU-restored engine; returns the report.

    ``gpu_pairs``: ``{snapshot GPU UUID: host GPU UUID}``, the same map for every rank (it must
    name every GPU the snapshot used; driver 580+), or None to restore in place. With
    ``required_free_bytes`` the map is cut down to the checkpointed GPUs (its keys) and must
    name each of them, else :class:`RankCheckpointError` before any restore.
    ``required_free_bytes``: ``{snapshot GPU UUID: bytes}`` (the snapshot's
    ``report.gpu_bytes``); each target GPU's free memory (NVML) is checked against it *before*
    any restore. ``restore_timeout_s`` / ``unlock_timeout_s``: wall bounds of the phases.

    Raises :class:`InsufficientGpuMemory` (nothing restored) or :class:`RankCheckpointError`;
    with ``kill_on_failure`` every rank is SIGKILLed first (the caller then kills the rest of
    the tree and cleans up: a half-restored engine must never serve).
    """
    report = RankReport(pids=list(pids))
    report.timeouts = {"restore": restore_timeout_s, "unlock": unlock_timeout_s}
    if not pids:
        return report
    idents = [ProcessId.of(p) for p in pids]  # what a failure may kill: these processes, no reused PID

    def fail(cls: type[RankCheckpointError], msg: str, errors: Mapping[int, BaseException] | None = None):
        if kill_on_failure:
            t0 = time.monotonic()
            _kill(idents)
            report.phases["rollback"] = time.monotonic() - t0
            report.rollback = "killed"
            msg += f"; killed GPU ranks {pids}"
        err = cls(msg, report, {p: str(e) for p, e in (errors or {}).items()}, rolled_back=kill_on_failure)
        if errors:
            err.__cause__ = next(iter(errors.values()))
        return err

    api = api or cuda.load()
    report.api, report.driver_version = api.kind, api.driver_version
    report.gpu_bytes = dict(required_free_bytes or {})
    if gpu_pairs and required_free_bytes:
        # The map names the checkpointed GPUs, no more (a source GPU the ranks did not use is not
        # part of the checkpoint), and every one of them (driver API doc).
        unmapped = sorted(set(required_free_bytes) - set(gpu_pairs))
        if unmapped:
            raise fail(RankCheckpointError, f"the GPU map {dict(gpu_pairs)} lacks checkpointed GPUs {unmapped}; "
                       "a restore map must name every checkpointed GPU")
        gpu_pairs = {old: new for old, new in gpu_pairs.items() if old in required_free_bytes}

    t0 = time.monotonic()
    if required_free_bytes:
        need: dict[str, int] = {}
        for uuid, b in required_free_bytes.items():
            target = (gpu_pairs or {}).get(uuid, uuid)
            need[target] = need.get(target, 0) + int(b)
        free = nvml.free_bytes(nvml_path)
        report.free_bytes = free
        short = {u: (free.get(u), b) for u, b in need.items() if free.get(u, -1) < b}
        report.phases["precheck"] = time.monotonic() - t0
        if short:
            parts = [
                (f"{u}: not on this host" if f is None else f"{u}: {f / 2**30:.2f} GiB free, {b / 2**30:.2f} GiB needed")
                for u, (f, b) in sorted(short.items())
            ]
            raise fail(
                InsufficientGpuMemory,
                "not enough free GPU memory to restore (checked before restoring, because a restore "
                "that runs out of memory leaves the process stuck for good): " + "; ".join(parts),
            )

    errors = _run_phase("restore", pids, lambda p: api.restore(p, gpu_pairs), restore_timeout_s, report)
    if errors:
        raise fail(RankCheckpointError, f"cuda restore failed on {len(errors)} of {len(pids)} GPU ranks: {_describe(errors)}", errors)
    errors = _run_phase("unlock", pids, api.unlock, unlock_timeout_s, report)
    if errors:
        raise fail(RankCheckpointError, f"cuda unlock failed on {len(errors)} of {len(pids)} GPU ranks: {_describe(errors)}", errors)
    return report
