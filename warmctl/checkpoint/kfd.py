"""AMD GPUs as the kernel's KFD driver shows them in sysfs, with ``amdsmi`` where it is importable.

What is read, and where it comes from (the Linux kernel's ``amdkfd/kfd_topology.c`` writes these
files; CRIU's amdgpu plugin, ``plugins/amdgpu/amdgpu_plugin_topology.c``, reads the same ones at
dump and restore, so warmctl's verdict and the plugin's rest on the same numbers):

- ``<sysfs>/class/kfd/kfd/topology/nodes/<N>/``: one directory per HSA node, CPUs included.
  ``gpu_id`` holds one decimal number (0 for a CPU node); ``name`` one line (the ASIC name in lower
  case); ``properties`` one ``<name> <unsigned decimal>`` pair per line (``simd_count``,
  ``gfx_target_version`` such as 90500 for gfx950, ``vendor_id`` 4098 = 0x1002, ``device_id``
  (PCI), ``drm_render_minor``, ``fw_version`` (the MEC firmware), ``sdma_fw_version``,
  ``unique_id``, ``num_xcc`` ... on GPU nodes). ``mem_banks/<M>/properties`` has
  ``heap_type`` (1 = public frame buffer, 2 = private) and ``size_in_bytes``: the VRAM.
- ``<sysfs>/class/kfd/kfd/proc/<pid>/vram_<gpu_id>``: bytes of VRAM a process holds on one GPU
  (``kfd_process.c``, one file per GPU the process opened).
- ``<sysfs>/class/drm/renderD<minor>/device/mem_info_vram_total`` and ``mem_info_vram_used``:
  bytes, per GPU (amdgpu driver), for the free-VRAM check before a restore.
- ``<sysfs>/module/amdgpu/version``: the amdgpu driver version when it is built as a module
  outside the kernel tree (ROCm's DKMS package); an in-tree driver has none, and the kernel
  release then names it.

``<sysfs>`` is ``/sys``, or ``$WARMCTL_SYSFS_ROOT`` (tests point it at a fake tree), or the
``root`` argument. ``amdsmi`` (AMD SMI's Python package, shipped with ROCm, not a dependency of
warmctl) adds what sysfs does not give cleanly: the market name (``AMD Instinct MI355X``), the
GPU's UUID and the driver version. Its per-GPU answers are tied to KFD nodes by
``amdsmi_get_gpu_kfd_info(handle)["kfd_id"]``, which is the node's ``gpu_id``.

Not run on AMD hardware: the file formats follow the kernel and CRIU sources cited above; the
``amdsmi`` calls follow its Python API reference (``amdsmi_interface.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Environment variable naming the sysfs root (default ``/sys``).
SYSFS_ENV = "WARMCTL_SYSFS_ROOT"
#: The topology's nodes, relative to the sysfs root.
TOPOLOGY_NODES = Path("class/kfd/kfd/topology/nodes")
#: Per-process KFD files, relative to the sysfs root.
KFD_PROC = Path("class/kfd/kfd/proc")
#: HSA heap types of VRAM banks (``mem_banks/<M>/properties``: ``heap_type``).
VRAM_HEAP_TYPES = (1, 2)


def sysfs_root(root: str | Path | None = None) -> Path:
    """``root``, else ``$WARMCTL_SYSFS_ROOT``, else ``/sys``."""
    return Path(root or os.environ.get(SYSFS_ENV) or "/sys")


def parse_properties(text: str, where: str = "properties") -> dict[str, int]:
    """``<name> <unsigned decimal>`` lines -> ``{name: value}``. Raises ``ValueError`` naming
    ``where`` and the line for anything else (the kernel writes nothing else)."""
    out: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"{where}:{n}: want '<name> <unsigned integer>', got {line!r}")
        out[parts[0]] = int(parts[1])
    return out


def gfx_name(target_version: int) -> str:
    """``gfx_target_version`` as the ISA name: 90500 -> ``gfx950``, 90402 -> ``gfx942``,
    90010 -> ``gfx90a`` (major * 10000 + minor * 100 + stepping; minor and stepping in hex)."""
    major, minor, step = target_version // 10000, (target_version // 100) % 100, target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


@dataclass(frozen=True)
class KfdGpu:
    """One GPU node of the KFD topology. ``node``: its directory number; ``gpu_id``: KFD's id
    (what CRIU's plugin and ``/proc``-side files name it by); ``name``: the ``name`` file;
    ``props``: the ``properties`` file; ``vram_bytes``: size of its first VRAM bank."""

    node: int
    gpu_id: int
    name: str
    props: dict[str, int] = field(default_factory=dict)
    vram_bytes: int = 0

    def prop(self, key: str) -> int | None:
        return self.props.get(key)

    @property
    def gfx(self) -> str:
        """ISA name (``gfx950``), from ``gfx_target_version``; ``gfx?`` when absent."""
        v = self.props.get("gfx_target_version")
        return gfx_name(v) if v else "gfx?"


class KfdError(Exception):
    """The KFD topology exists but cannot be read (a file is missing or malformed)."""


def read_topology(root: str | Path | None = None) -> list[KfdGpu]:
    """The GPU nodes of the KFD topology under ``root`` (see :func:`sysfs_root`), in node
    order. ``[]`` when there is no topology (no amdgpu driver) or it has no GPU node. Raises
    :class:`KfdError` naming the file when a GPU node's files cannot be read or parsed."""
    nodes_dir = sysfs_root(root) / TOPOLOGY_NODES
    if not nodes_dir.is_dir():
        return []
    out: list[KfdGpu] = []
    for d in sorted((p for p in nodes_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            gpu_id = int((d / "gpu_id").read_text().strip() or 0)
        except (OSError, ValueError):
            continue  # a node hidden by the device cgroup reads as an error; CRIU skips it too
        if not gpu_id:
            continue  # CPU node
        try:
            props = parse_properties((d / "properties").read_text(), str(d / "properties"))
            name = (d / "name").read_text().strip()
        except (OSError, ValueError) as e:
            raise KfdError(f"KFD topology node {d}: {e}") from None
        out.append(KfdGpu(node=int(d.name), gpu_id=gpu_id, name=name, props=props, vram_bytes=_vram_bank(d)))
    return out


def _vram_bank(node_dir: Path) -> int:
    """``size_in_bytes`` of the node's first public or private frame-buffer bank, else 0."""
    banks = node_dir / "mem_banks"
    if not banks.is_dir():
        return 0
    for b in sorted((p for p in banks.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            props = parse_properties((b / "properties").read_text(), str(b / "properties"))
        except (OSError, ValueError):
            continue
        if props.get("heap_type") in VRAM_HEAP_TYPES and props.get("size_in_bytes"):
            return props["size_in_bytes"]
    return 0


def driver_version(root: str | Path | None = None) -> str | None:
    """``<sysfs>/module/amdgpu/version`` (e.g. ``6.12.12``), or ``None`` when the driver is
    the kernel's own (no such file) or absent."""
    try:
        return (sysfs_root(root) / "module/amdgpu/version").read_text().strip() or None
    except OSError:
        return None


# --------------------------------------------------------------------------- amdsmi


def amdsmi_facts() -> tuple[dict[int, dict[str, Any]], str | None]:
    """``({kfd gpu_id: {"market_name", "uuid", "driver_version"}}, reason)`` from ``amdsmi``.

    ``reason`` is ``None`` when amdsmi answered; otherwise the dict is empty and ``reason``
    says why (not importable, init failed, a query failed). Never raises. One
    ``amdsmi_init`` / ``amdsmi_shut_down`` per call."""
    try:
        import amdsmi
    except Exception as e:  # ImportError, or the package present without its libamd_smi.so (OSError)
        return {}, f"amdsmi not importable ({type(e).__name__}: {e})"
    try:
        amdsmi.amdsmi_init()
    except Exception as e:  # AmdSmiException and whatever the C library raises through ctypes
        return {}, f"amdsmi_init failed: {e}"
    out: dict[int, dict[str, Any]] = {}
    try:
        for h in amdsmi.amdsmi_get_processor_handles():
            kfd = amdsmi.amdsmi_get_gpu_kfd_info(h)
            gpu_id = kfd.get("kfd_id")
            if not isinstance(gpu_id, int):
                continue  # "N/A": not a KFD device
            asic = amdsmi.amdsmi_get_gpu_asic_info(h)
            out[gpu_id] = {
                "market_name": asic.get("market_name") if asic.get("market_name") not in (None, "", "N/A") else None,
                "uuid": amdsmi.amdsmi_get_gpu_device_uuid(h) or None,
                "driver_version": (amdsmi.amdsmi_get_gpu_driver_info(h) or {}).get("driver_version") or None,
            }
    except Exception as e:
        return {}, f"amdsmi query failed: {e}"
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:
            pass
    return out, None


# --------------------------------------------------------------------------- memory


def vram_usage(gpu: KfdGpu, root: str | Path | None = None) -> tuple[int, int] | None:
    """``(total, used)`` VRAM bytes of ``gpu`` from the amdgpu driver's
    ``class/drm/renderD<drm_render_minor>/device/mem_info_vram_{total,used}``; ``None`` when
    they cannot be read."""
    minor = gpu.prop("drm_render_minor")
    if minor is None:
        return None
    dev = sysfs_root(root) / f"class/drm/renderD{minor}/device"
    try:
        return int((dev / "mem_info_vram_total").read_text()), int((dev / "mem_info_vram_used").read_text())
    except (OSError, ValueError):
        return None


def process_vram(pids: list[int], root: str | Path | None = None) -> dict[int, int]:
    """``{gpu_id: bytes}`` of VRAM that ``pids`` hold, summed over them, from
    ``class/kfd/kfd/proc/<pid>/vram_<gpu_id>``. A process that never opened ``/dev/kfd`` has
    no directory there and adds nothing."""
    out: dict[int, int] = {}
    base = sysfs_root(root) / KFD_PROC
    for pid in pids:
        d = base / str(pid)
        if not d.is_dir():
            continue
        for f in d.glob("vram_*"):
            try:
                gid, n = int(f.name[len("vram_"):]), int(f.read_text().strip())
            except (OSError, ValueError):
                continue
            out[gid] = out.get(gid, 0) + n
    return out
