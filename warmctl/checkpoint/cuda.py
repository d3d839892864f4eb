"""The CUDA driver's checkpoint API, through ctypes on ``libcuda.so.1``, with the
``cuda-checkpoint`` utility as a fallback.

What it does, per process (``pid`` is a host PID, as seen by the calling process):

====================  =========================  ==========================================
call                  state before -> after      notes
====================  =========================  ==========================================
``lock``              RUNNING -> LOCKED          blocks the target's CUDA calls and waits for
                                                 submitted work; with a timeout, a lock that
                                                 does not succeed in time leaves it RUNNING
``checkpoint``        LOCKED -> CHECKPOINTED     copies GPU memory to host RAM and releases
                                                 every GPU resource (the process then holds no
                                                 ``/dev/nvidia*`` reference, so CRIU can dump it)
``restore``           CHECKPOINTED -> LOCKED     re-acquires GPUs, copies memory back at the
                                                 same virtual addresses; optional GPU UUID map
``unlock``            LOCKED -> RUNNING          CUDA calls proceed
``state``             any                        :class:`ProcessState`
``restore_thread_id`` any                        the driver's restore thread in the target
====================  =========================  ==========================================

Sources (NVIDIA's words, not measured here: this machine has no GPU):

- CUDA Driver API, module "CUDA Checkpointing"
  (https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CHECKPOINT.html): the six
  functions and their signatures ``CUresult f(int pid, Args *args)``; states RUNNING=0,
  LOCKED=1, CHECKPOINTED=2, FAILED=3 (newer headers add CHECKPOINTING=4, RESTORING=5); "If
  timeoutMs is specified and the timeout is reached the process will be left in the RUNNING
  state"; restore: "The GPU to restore onto needs to have enough memory and be of the same chip
  type", "If an array of GPU UUID pairs is specified, it must contain every checkpointed GPU",
  "CUDA process restore requires persistence mode to be enabled or cuInit to have been called
  before execution" (hence :meth:`DriverAPI.restore` calls ``cuInit(0)`` first).
- Struct references ``CUcheckpointLockArgs`` (``unsigned timeoutMs; unsigned reserved0;
  cuuint64_t reserved1[7]``), ``CUcheckpointCheckpointArgs`` / ``CUcheckpointUnlockArgs``
  (``cuuint64_t reserved[8]``), ``CUcheckpointRestoreArgs`` (``CUcheckpointGpuPair *gpuPairs;
  unsigned gpuPairsCount;`` then reserved bytes up to 64; CUDA 13.x headers carve
  ``customStorageInfo_out`` out of that reserved area, which we leave zero = NULL = "restore
  from host"), ``CUcheckpointGpuPair`` (``CUuuid oldUuid, newUuid``): every struct is 64 bytes
  and "reserved ... must be zeroed".
- Availability: the driver functions ship with CUDA 12.8 / driver 570 ("CUDA Driver interfaces
  at feature parity with the cuda-checkpoint utility", NVIDIA/cuda-checkpoint README, "570
  Features"); GPU remapping needs driver 580 / CUDA 13.0 (CUDA 13.0 release notes, quoted in
  NVIDIA/cuda-checkpoint#35; ``--device-map`` appears in cuda-checkpoint 580.65.06,
  NVIDIA/cuda-checkpoint#18). ``cuDriverGetVersion`` reports the CUDA version the driver
  supports (12080 = 12.8, 13000 = 13.0), which is what we compare against.
- A restore that fails with ``CUDA_ERROR_OUT_OF_MEMORY`` leaves the process stuck for good:
  later restores return ``CUDA_ERROR_OPERATING_SYSTEM`` and unlock ``CUDA_ERROR_ILLEGAL_STATE``
  (NVIDIA/cuda-checkpoint#44, driver 580.95.05). Check free GPU memory *before* restoring
  (:mod:`warmctl.checkpoint.ranks` does).
- A driver call cannot be interrupted; a caller that needs a deadline runs it in a thread and
  gives up waiting (see :mod:`warmctl.checkpoint.ranks`). Killing the ``cuda-checkpoint``
  utility mid-operation can desynchronise the driver (CRIU PR checkpoint-restore/criu#2547,
  comment by NVIDIA's jesus-ramos), so the fallback never kills it either.

Errors are :class:`CudaCheckpointError` subclasses (all :class:`~warmctl.base.errors.CheckpointError`):
:class:`CudaUnavailable` (no libcuda / no GPU), :class:`DriverTooOld`, :class:`NotSupported`,
:class:`GpuOutOfMemory`, :class:`IllegalState`, :class:`LockTimeout`; anything else is the base
class with the driver's error name and string.

Library locations can be overridden with ``WARMCTL_LIBCUDA`` (path of ``libcuda.so.1``) and
``WARMCTL_CUDA_CHECKPOINT`` (path of the utility); tests point them at a fake driver.
"""

from __future__ import annotations

import ctypes
import enum
import os
import shutil
import subprocess
import threading
import time
import uuid as uuidlib
from collections.abc import Mapping
from typing import Protocol

from warmctl.base.errors import CheckpointError

#: ``cuDriverGetVersion`` value from which the checkpoint driver API exists (CUDA 12.8, r570).
MIN_CHECKPOINT_API = 12080
#: ``cuDriverGetVersion`` value from which restore accepts GPU UUID pairs (CUDA 13.0, r580).
MIN_GPU_REMAP = 13000

# CUresult values (cuda.h, "Data types used by CUDA driver", enum cudaError_enum).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803
CUDA_ERROR_TIMEOUT = 909
CUDA_ERROR_UNKNOWN = 999

_ERROR_NAMES = {
    v: k
    for k, v in globals().items()
    if k.startswith("CUDA_ERROR_") or k == "CUDA_SUCCESS"
}

# cuGetErrorString texts, used to map the utility's messages back to codes.
_ERROR_STRINGS = {
    "invalid argument": CUDA_ERROR_INVALID_VALUE,
    "out of memory": CUDA_ERROR_OUT_OF_MEMORY,
    "initialization error": CUDA_ERROR_NOT_INITIALIZED,
    "no CUDA-capable device is detected": CUDA_ERROR_NO_DEVICE,
    "CUDA driver is a stub library": CUDA_ERROR_STUB_LIBRARY,
    "CUDA driver version is insufficient for CUDA runtime version": CUDA_ERROR_INSUFFICIENT_DRIVER,
    "OS call failed or operation not supported on this OS": CUDA_ERROR_OPERATING_SYSTEM,
    "the operation cannot be performed in the present state": CUDA_ERROR_ILLEGAL_STATE,
    "operation not permitted": CUDA_ERROR_NOT_PERMITTED,
    "operation not supported": CUDA_ERROR_NOT_SUPPORTED,
    "the operation timed out": CUDA_ERROR_TIMEOUT,
}


class ProcessState(enum.IntEnum):
    """``CUprocessState``. 4 and 5 exist in CUDA 13.x headers (transient states)."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5


# ---------------------------------------------------------------------------------------------
# Errors


class CudaCheckpointError(CheckpointError):
    """A checkpoint-API call failed. ``op`` is the operation (``lock``, ``restore``...),
    ``pid`` the target, ``code`` the ``CUresult`` (None when no driver call was made)."""

    def __init__(self, message: str, *, op: str = "", pid: int | None = None, code: int | None = None):
        super().__init__(message)
        self.op = op
        self.pid = pid
        self.code = code


class CudaUnavailable(CudaCheckpointError):
    """No NVIDIA driver here: ``libcuda.so.1`` cannot be loaded, or no GPU is visible."""


class DriverTooOld(CudaCheckpointError):
    """The driver lacks what was asked for (checkpoint API: r570 / CUDA 12.8; GPU remapping:
    r580 / CUDA 13.0) and no ``cuda-checkpoint`` utility can stand in."""


class NotSupported(CudaCheckpointError):
    """``CUDA_ERROR_NOT_SUPPORTED``: the driver refuses to checkpoint this process (e.g. UVM or
    CUDA IPC memory, cross-GPU peer state, a non-x86-64 host)."""


class GpuOutOfMemory(CudaCheckpointError):
    """``CUDA_ERROR_OUT_OF_MEMORY``. On restore this leaves the process unrecoverable
    (NVIDIA/cuda-checkpoint#44): kill it."""


class IllegalState(CudaCheckpointError):
    """``CUDA_ERROR_ILLEGAL_STATE``: the process is not in the state the call needs
    (e.g. checkpoint of a process that is not LOCKED), or is FAILED."""


class LockTimeout(CudaCheckpointError):
    """The lock did not succeed within its timeout; the process is still RUNNING."""


_HINTS = {
    CUDA_ERROR_OUT_OF_MEMORY: (
        GpuOutOfMemory,
        "out of GPU memory; after a failed restore the process cannot be restored again "
        "(NVIDIA/cuda-checkpoint#44) and must be killed",
    ),
    CUDA_ERROR_NOT_SUPPORTED: (
        NotSupported,
        "the driver does not support checkpointing this process (UVM or CUDA IPC memory, "
        "NVLink/P2P/NVLS peer state, or an unsupported platform)",
    ),
    CUDA_ERROR_ILLEGAL_STATE: (IllegalState, "the process is not in a state that allows this"),
    CUDA_ERROR_TIMEOUT: (LockTimeout, "timed out"),
    CUDA_ERROR_INSUFFICIENT_DRIVER: (DriverTooOld, "the driver is older than the CUDA version needed"),
    CUDA_ERROR_STUB_LIBRARY: (CudaUnavailable, "libcuda.so.1 is the toolkit's stub, not a driver"),
    CUDA_ERROR_NO_DEVICE: (CudaUnavailable, "no CUDA device is visible to warmctl"),
}


def error_for(op: str, pid: int | None, code: int, detail: str = "") -> CudaCheckpointError:
    """The exception for a failed call: class and message chosen by ``code``.

    The message names the operation, the pid, the error name and, when known, what it means
    for the operator, e.g. ``cuda restore of pid 42 failed: CUDA_ERROR_OUT_OF_MEMORY (out of
    memory): out of GPU memory; ...``.
    """
    name = _ERROR_NAMES.get(code, f"CUresult {code}")
    cls, hint = _HINTS.get(code, (CudaCheckpointError, ""))
    where = f" of pid {pid}" if pid is not None else ""
    msg = f"cuda {op}{where} failed: {name}"
    if detail:
        msg += f" ({detail})"
    if hint:
        msg += f": {hint}"
    return cls(msg, op=op, pid=pid, code=code)


# ---------------------------------------------------------------------------------------------
# Argument structs (all 64 bytes, zeroed)


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (64 - ctypes.sizeof(ctypes.c_void_p) - ctypes.sizeof(ctypes.c_uint))),
    ]


class CUcheckpointUnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


for _s in (CUcheckpointLockArgs, CUcheckpointCheckpointArgs, CUcheckpointRestoreArgs, CUcheckpointUnlockArgs):
    assert ctypes.sizeof(_s) == 64, _s  # the driver ABI: 64-byte argument structs


def uuid_bytes(gpu_uuid: str) -> bytes:
    """16 bytes of a GPU UUID as NVML / nvidia-smi print it (``GPU-xxxxxxxx-xxxx-...``).

    Raises ValueError for anything else (MIG UUIDs, ``MIG-...``, are not GPUs and cannot be
    remapped by the checkpoint API).
    """
    s = gpu_uuid.strip()
    if s.upper().startswith("GPU-"):
        s = s[4:]
    return uuidlib.UUID(s).bytes


def uuid_str(raw: bytes) -> str:
    """Inverse of :func:`uuid_bytes`: ``GPU-`` + the canonical lower-case UUID."""
    return "GPU-" + str(uuidlib.UUID(bytes=bytes(raw)))


def gpu_pair_array(gpu_pairs: Mapping[str, str]) -> ctypes.Array:
    """A ``CUcheckpointGpuPair[n]`` from ``{old_uuid: new_uuid}``. ValueError on a bad UUID or
    when two old GPUs map to the same new one."""
    if len(set(gpu_pairs.values())) != len(gpu_pairs):
        raise ValueError(f"GPU map sends two GPUs to one: {dict(gpu_pairs)}")
    arr = (CUcheckpointGpuPair * len(gpu_pairs))()
    for i, (old, new) in enumerate(gpu_pairs.items()):
        ctypes.memmove(arr[i].oldUuid.bytes, uuid_bytes(old), 16)
        ctypes.memmove(arr[i].newUuid.bytes, uuid_bytes(new), 16)
    return arr


# ---------------------------------------------------------------------------------------------
# The interface, and its two implementations


class CheckpointAPI(Protocol):
    """What :mod:`warmctl.checkpoint.ranks` needs; :class:`DriverAPI` and :class:`CliAPI`.

    ``timeout_s`` on :meth:`lock` is seconds (None or 0: wait forever, as the driver does).
    ``gpu_pairs`` on :meth:`restore` is ``{old GPU UUID: new GPU UUID}`` and must then name
    every GPU the process was checkpointed on.
    """

    kind: str
    driver_version: int

    def state(self, pid: int) -> ProcessState: ...
    def restore_thread_id(self, pid: int) -> int: ...
    def lock(self, pid: int, timeout_s: float | None = None) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, gpu_pairs: Mapping[str, str] | None = None) -> None: ...
    def unlock(self, pid: int) -> None: ...


def _timeout_ms(timeout_s: float | None) -> int:
    if not timeout_s:
        return 0
    if timeout_s < 0:
        raise ValueError("lock timeout must be >= 0 seconds")
    return max(1, min(int(round(timeout_s * 1000)), 2**32 - 1))


#: The driver library loaded when no path is given (the ``libcuda`` setting names another).
DEFAULT_LIBCUDA = "libcuda.so.1"


class DriverAPI:
    """The checkpoint API of ``libcuda.so.1`` (or ``path``), through ctypes.

    Raises :class:`CudaUnavailable` if the library cannot be loaded, :class:`DriverTooOld` if it
    lacks ``cuCheckpointProcess*`` (driver < 570; use :class:`CliAPI` there).
    Thread-safe: calls on different pids may run in parallel threads (ctypes releases the GIL).
    """

    kind = "driver"
    _FUNCS = ("Lock", "Checkpoint", "Restore", "Unlock", "GetState", "GetRestoreThreadId")

    def __init__(self, path: str | None = None):
        self.path = path or DEFAULT_LIBCUDA
        try:
            self._lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise CudaUnavailable(
                f"cannot load the NVIDIA driver library {self.path}: {e}; is the NVIDIA driver installed?"
            ) from None
        ver = ctypes.c_int(0)
        rc = self._lib.cuDriverGetVersion(ctypes.byref(ver))
        if rc != CUDA_SUCCESS:
            raise error_for("driver-version", None, rc)
        self.driver_version = ver.value
        missing = [f for f in self._FUNCS if not hasattr(self._lib, f"cuCheckpointProcess{f}")]
        if missing:
            raise DriverTooOld(
                f"{self.path} (CUDA {_cuda_ver(self.driver_version)}) has no cuCheckpointProcess"
                f"{missing[0]}: the checkpoint driver API needs driver 570+ / CUDA 12.8 "
                "(NVIDIA/cuda-checkpoint README); install a newer driver or the cuda-checkpoint utility",
                op="load",
            )
        self._init_lock = threading.Lock()
        self._inited = False
        for f in self._FUNCS:
            getattr(self._lib, f"cuCheckpointProcess{f}").restype = ctypes.c_int
        self._lib.cuCheckpointProcessGetState.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self._lib.cuCheckpointProcessGetRestoreThreadId.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self._lib.cuCheckpointProcessLock.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)]
        self._lib.cuCheckpointProcessCheckpoint.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointCheckpointArgs)]
        self._lib.cuCheckpointProcessRestore.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointRestoreArgs)]
        self._lib.cuCheckpointProcessUnlock.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointUnlockArgs)]

    def _detail(self, code: int) -> str:
        fn = getattr(self._lib, "cuGetErrorString", None)
        if fn is None:
            return ""
        s = ctypes.c_char_p()
        if fn(code, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode(errors="replace")
        return ""

    def _check(self, op: str, pid: int, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            raise error_for(op, pid, rc, self._detail(rc))

    def state(self, pid: int) -> ProcessState:
        st = ctypes.c_int(-1)
        self._check("get-state", pid, self._lib.cuCheckpointProcessGetState(pid, ctypes.byref(st)))
        return ProcessState(st.value)

    def restore_thread_id(self, pid: int) -> int:
        tid = ctypes.c_int(0)
        self._check("get-restore-tid", pid, self._lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid)))
        return tid.value

    def lock(self, pid: int, timeout_s: float | None = None) -> None:
        args = CUcheckpointLockArgs()  # ctypes zero-fills
        args.timeoutMs = _timeout_ms(timeout_s)
        t0 = time.monotonic()
        rc = self._lib.cuCheckpointProcessLock(pid, ctypes.byref(args))
        if rc == CUDA_SUCCESS:
            return
        waited = time.monotonic() - t0
        # The doc says a timed-out lock leaves the process RUNNING but does not name the code;
        # CUDA_ERROR_TIMEOUT, or any failure after the full wait with the process RUNNING, is a
        # lock timeout.
        if args.timeoutMs and (rc == CUDA_ERROR_TIMEOUT or waited >= timeout_s * 0.95):
            still_running = self._state_or_none(pid) == ProcessState.RUNNING
            if rc == CUDA_ERROR_TIMEOUT or still_running:
                raise LockTimeout(
                    f"cuda lock of pid {pid} timed out after {waited:.1f} s (limit {timeout_s:g} s); "
                    "the process keeps running: it has CUDA work that did not finish in time",
                    op="lock", pid=pid, code=rc,
                )
        self._check("lock", pid, rc)

    def _state_or_none(self, pid: int) -> ProcessState | None:
        try:
            return self.state(pid)
        except CudaCheckpointError:
            return None

    def checkpoint(self, pid: int) -> None:
        args = CUcheckpointCheckpointArgs()
        self._check("checkpoint", pid, self._lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args)))

    def ensure_init(self) -> None:
        """``cuInit(0)`` once: restore needs it unless persistence mode is on (driver API doc).
        Raises :class:`CudaUnavailable` when no GPU is visible to this process."""
        with self._init_lock:
            if self._inited:
                return
            rc = self._lib.cuInit(0)
            if rc != CUDA_SUCCESS:
                err = error_for("init", None, rc, self._detail(rc))
                raise CudaUnavailable(
                    f"{err}; restore needs cuInit in the restoring process (or persistence mode), "
                    "and every GPU of the snapshot visible to it (do not set CUDA_VISIBLE_DEVICES for warmctl)",
                    op="init", code=rc,
                )
            self._inited = True

    def restore(self, pid: int, gpu_pairs: Mapping[str, str] | None = None) -> None:
        args = CUcheckpointRestoreArgs()
        keep = None
        if gpu_pairs:
            if self.driver_version < MIN_GPU_REMAP:
                raise DriverTooOld(
                    f"restoring pid {pid} onto other GPUs needs driver 580+ / CUDA 13.0; this driver "
                    f"is CUDA {_cuda_ver(self.driver_version)} (CUDA 13.0 release notes)",
                    op="restore", pid=pid,
                )
            keep = gpu_pair_array(gpu_pairs)
            args.gpuPairs = ctypes.cast(keep, ctypes.POINTER(CUcheckpointGpuPair))
            args.gpuPairsCount = len(gpu_pairs)
        self.ensure_init()
        rc = self._lib.cuCheckpointProcessRestore(pid, ctypes.byref(args))
        del keep
        self._check("restore", pid, rc)

    def unlock(self, pid: int) -> None:
        args = CUcheckpointUnlockArgs()
        self._check("unlock", pid, self._lib.cuCheckpointProcessUnlock(pid, ctypes.byref(args)))


class CliAPI:
    """The same operations through NVIDIA's ``cuda-checkpoint`` utility (driver 550+; lock with
    timeout from 570; ``--device-map`` from 580). Interface as documented in the
    NVIDIA/cuda-checkpoint README and ``--help`` (580.65.06, quoted in NVIDIA/cuda-checkpoint#18).

    Failures are read from the utility's message ``Could not <action> on process ID <pid>:
    "<cuGetErrorString text>"`` and mapped to the same exceptions as :class:`DriverAPI`.
    ``call_timeout_s`` bounds each run (None: no bound); the utility is never killed on a
    bound (see module doc) - a :class:`CudaCheckpointError` is raised while it keeps running.
    """

    kind = "cli"

    def __init__(self, binary: str | None = None, driver_version: int = 0):
        b = binary or shutil.which("cuda-checkpoint")
        if not b or not os.access(b, os.X_OK):
            raise DriverTooOld(
                "the driver has no checkpoint API (needs 570+) and no cuda-checkpoint utility was found "
                "(https://github.com/NVIDIA/cuda-checkpoint; put it on PATH or set cuda_checkpoint / WARMCTL_CUDA_CHECKPOINT)",
                op="load",
            )
        self.binary = b
        self.driver_version = driver_version

    def _run(self, op: str, pid: int, args: list[str]) -> str:
        p = subprocess.run([self.binary, *args, "--pid", str(pid)], capture_output=True, text=True)
        if p.returncode == 0:
            return p.stdout.strip()
        out = (p.stderr + p.stdout).strip()
        code = CUDA_ERROR_UNKNOWN
        for text, c in _ERROR_STRINGS.items():
            if f'"{text}"' in out:
                code = c
                break
        raise error_for(op, pid, code, out.splitlines()[-1] if out else f"exit {p.returncode}")

    def state(self, pid: int) -> ProcessState:
        out = self._run("get-state", pid, ["--get-state"]).lower()
        for st in ProcessState:
            if out.startswith(st.name.lower()):
                return st
        raise CudaCheckpointError(f"cuda-checkpoint printed an unknown state for pid {pid}: {out!r}", op="get-state", pid=pid)

    def restore_thread_id(self, pid: int) -> int:
        out = self._run("get-restore-tid", pid, ["--get-restore-tid"])
        try:
            return int(out.split()[-1])
        except (ValueError, IndexError):
            raise CudaCheckpointError(f"cuda-checkpoint printed no thread id for pid {pid}: {out!r}", op="get-restore-tid", pid=pid) from None

    def lock(self, pid: int, timeout_s: float | None = None) -> None:
        ms = _timeout_ms(timeout_s)
        t0 = time.monotonic()
        try:
            self._run("lock", pid, ["--action", "lock"] + (["--timeout", str(ms)] if ms else []))
        except CudaCheckpointError as e:
            waited = time.monotonic() - t0
            if ms and (e.code == CUDA_ERROR_TIMEOUT or waited >= timeout_s * 0.95):
                raise LockTimeout(
                    f"cuda lock of pid {pid} timed out after {waited:.1f} s (limit {timeout_s:g} s); "
                    "the process keeps running: it has CUDA work that did not finish in time",
                    op="lock", pid=pid, code=e.code,
                ) from None
            raise

    def checkpoint(self, pid: int) -> None:
        self._run("checkpoint", pid, ["--action", "checkpoint"])

    def restore(self, pid: int, gpu_pairs: Mapping[str, str] | None = None) -> None:
        extra: list[str] = []
        if gpu_pairs:
            for u in list(gpu_pairs) + list(gpu_pairs.values()):
                uuid_bytes(u)  # validate before handing to the utility
            extra = ["--device-map", ",".join(f"{o}={n}" for o, n in gpu_pairs.items())]
        self._run("restore", pid, ["--action", "restore", *extra])

    def unlock(self, pid: int) -> None:
        self._run("unlock", pid, ["--action", "unlock"])


def _cuda_ver(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "unknown"


def load(libcuda: str | None = None, cli: str | None = None) -> CheckpointAPI:
    """The best available implementation: :class:`DriverAPI` when ``libcuda`` exports the
    checkpoint symbols, else :class:`CliAPI` when the ``cuda-checkpoint`` utility exists.

    Raises :class:`CudaUnavailable` when there is no NVIDIA driver at all, :class:`DriverTooOld`
    when neither path works.
    """
    try:
        return DriverAPI(libcuda)
    except DriverTooOld as e:
        lib = ctypes.CDLL(libcuda or DEFAULT_LIBCUDA)
        ver = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(ver))
        try:
            return CliAPI(cli, driver_version=ver.value)
        except DriverTooOld:
            raise e from None
