"""The few NVML facts the GPU checkpoint path needs, through ctypes on ``libnvidia-ml.so.1``.

- :func:`gpus`: every GPU with its UUID and memory (bytes): ``nvmlDeviceGetMemoryInfo``.
- :func:`compute_processes`: ``{pid: {gpu_uuid: used_bytes}}`` from
  ``nvmlDeviceGetComputeRunningProcesses_v3`` (host PIDs; a process whose CUDA state is
  checkpointed no longer appears: NVIDIA/cuda-checkpoint README, "Use nvidia-smi to confirm that
  counter is no longer running on a GPU").
- :func:`driver_version`: ``nvmlSystemGetDriverVersion``, e.g. ``"580.65.06"``.

Signatures and structs from the NVML API Reference (https://docs.nvidia.com/deploy/nvml-api/):
``nvmlMemory_t {unsigned long long total, free, used}``, ``nvmlProcessInfo_t {unsigned int pid;
unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId}``;
``NVML_ERROR_INSUFFICIENT_SIZE`` (7) asks for a larger array.

Why not ``pynvml``: it always loads ``libnvidia-ml.so.1`` by soname; this module takes a path
(``WARMCTL_LIBNVML``) so that tests can load the fake driver in ``tests/fake_libcuda``.
Every function returns empty results when there is no NVIDIA driver (the library cannot be
loaded or ``nvmlInit`` fails): a CPU host has no GPU ranks.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _ProcessInfo(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


@dataclass(frozen=True)
class Gpu:
    """One GPU. Memory in bytes."""

    index: int
    uuid: str
    total: int
    free: int
    used: int


#: The NVML library loaded when no ``path`` is given (the ``libnvml`` setting names another).
DEFAULT_LIB = "libnvidia-ml.so.1"
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def _lib(path: str | None = None) -> ctypes.CDLL | None:
    path = path or DEFAULT_LIB
    with _lock:
        if path not in _libs:
            try:
                lib = ctypes.CDLL(path)
                lib.nvmlInit_v2.restype = ctypes.c_int
                _libs[path] = lib if lib.nvmlInit_v2() == NVML_SUCCESS else None
            except (OSError, AttributeError):
                _libs[path] = None
        return _libs[path]


def available(path: str | None = None) -> bool:
    """True when NVML loads and initialises (an NVIDIA driver is present)."""
    return _lib(path) is not None


def driver_version(path: str | None = None) -> str | None:
    """The kernel driver version string (``"580.65.06"``), or None without a driver."""
    lib = _lib(path)
    if lib is None:
        return None
    buf = ctypes.create_string_buffer(96)
    if lib.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(len(buf))) != NVML_SUCCESS:
        return None
    return buf.value.decode()


def _handles(lib: ctypes.CDLL) -> list[tuple[int, ctypes.c_void_p, str]]:
    n = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != NVML_SUCCESS:
        return []
    out = []
    for i in range(n.value):
        h = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h)) != NVML_SUCCESS:
            continue
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlDeviceGetUUID(h, buf, ctypes.c_uint(len(buf))) != NVML_SUCCESS:
            continue
        out.append((i, h, buf.value.decode()))
    return out


def gpus(path: str | None = None) -> list[Gpu]:
    """Every GPU NVML sees, in NVML index order (which need not be CUDA's order: compare by
    UUID, never by index - NVIDIA/cuda-python#1983 review notes)."""
    lib = _lib(path)
    if lib is None:
        return []
    out = []
    for i, h, uuid in _handles(lib):
        m = _Memory()
        if lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) == NVML_SUCCESS:
            out.append(Gpu(i, uuid, int(m.total), int(m.free), int(m.used)))
    return out


def free_bytes(path: str | None = None) -> dict[str, int]:
    """``{gpu_uuid: free bytes}`` for every GPU; ``{}`` without a driver."""
    return {g.uuid: g.free for g in gpus(path)}


def compute_processes(path: str | None = None) -> dict[int, dict[str, int]]:
    """``{pid: {gpu_uuid: used_bytes}}`` of every process with a CUDA context on a GPU."""
    lib = _lib(path)
    if lib is None:
        return {}
    out: dict[int, dict[str, int]] = {}
    for _, h, uuid in _handles(lib):
        cap = 64
        while True:
            arr = (_ProcessInfo * cap)()
            n = ctypes.c_uint(cap)
            rc = lib.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(n), arr)
            if rc == NVML_ERROR_INSUFFICIENT_SIZE and cap < 65536:
                cap = max(cap * 2, n.value + 8)
                continue
            break
        if rc != NVML_SUCCESS:
            continue
        for info in arr[: n.value]:
            out.setdefault(int(info.pid), {})[uuid] = int(info.usedGpuMemory)
    return out
