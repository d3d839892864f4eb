"""A fake sysfs tree with the files the amdgpu/KFD driver writes for 8 AMD Instinct GPUs.

Layout and formats follow the kernel's ``drivers/gpu/drm/amd/amdkfd/kfd_topology.c``
(``node_show``: ``gpu_id`` and ``name`` one value each, ``properties`` one ``<name> <value>``
line per property in this order; ``mem_show``: ``mem_banks/<M>/properties``) and
``kfd_process.c`` (``proc/<pid>/vram_<gpu_id>``), and the amdgpu driver's
``mem_info_vram_total`` / ``mem_info_vram_used`` files. Node 0 is the CPU (``gpu_id`` 0), GPU
nodes follow, as on a one-socket host. Values are illustrative (an MI355X-like gfx950 part),
not read from a real MI355X.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30

#: Node ``properties`` keys in the order ``node_show`` writes them (GPU nodes).
NODE_KEYS = [
    "cpu_cores_count", "simd_count", "mem_banks_count", "caches_count", "io_links_count", "p2p_links_count",
    "cpu_core_id_base", "simd_id_base", "max_waves_per_simd", "lds_size_in_kb", "gds_size_in_kb", "num_gws",
    "wave_front_size", "array_count", "simd_arrays_per_engine", "cu_per_simd_array", "simd_per_cu",
    "max_slots_scratch_cu", "gfx_target_version", "vendor_id", "device_id", "location_id", "domain",
    "drm_render_minor", "hive_id", "num_sdma_engines", "num_sdma_xgmi_engines", "num_sdma_queues_per_engine",
    "num_cp_queues", "max_engine_clk_fcompute", "local_mem_size", "fw_version", "capability", "capability2",
    "debug_prop", "sdma_fw_version", "unique_id", "num_xcc", "max_engine_clk_ccompute",
]  # fmt: skip


@dataclass
class FakeGpu:
    """One GPU node's facts (the ones tests vary)."""

    device_id: int = 0x75A3
    gfx_target_version: int = 90500
    simd_count: int = 1024
    num_xcc: int = 8
    fw_version: int = 177
    sdma_fw_version: int = 24
    vram_bytes: int = 288 * GIB
    vram_used: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def make_tree(root: Path, gpus: list[FakeGpu] | None = None, amdgpu_version: str | None = "6.14.14",
              name: str = "ip discovery") -> Path:
    """Write the fake sysfs tree under ``root`` (returned); ``gpus`` default: 8 identical
    :class:`FakeGpu`. ``amdgpu_version``: ``module/amdgpu/version`` (``None``: in-kernel driver,
    no file). ``name``: each GPU node's ``name`` file (the ASIC name, lower case)."""
    gpus = [FakeGpu() for _ in range(8)] if gpus is None else gpus
    nodes = root / "class/kfd/kfd/topology/nodes"
    cpu = nodes / "0"
    cpu.mkdir(parents=True)
    (cpu / "gpu_id").write_text("0\n")
    (cpu / "name").write_text("\n")
    (cpu / "properties").write_text("".join(f"{k} {v}\n" for k, v in [
        ("cpu_cores_count", 96), ("simd_count", 0), ("mem_banks_count", 1), ("caches_count", 0),
        ("io_links_count", len(gpus)), ("p2p_links_count", 0), ("cpu_core_id_base", 0), ("simd_id_base", 0),
        ("max_waves_per_simd", 0), ("lds_size_in_kb", 0), ("gds_size_in_kb", 0), ("num_gws", 0),
        ("wave_front_size", 0), ("array_count", 0), ("simd_arrays_per_engine", 0), ("cu_per_simd_array", 0),
        ("simd_per_cu", 0), ("max_slots_scratch_cu", 0), ("gfx_target_version", 0), ("vendor_id", 0),
        ("device_id", 0), ("location_id", 0), ("domain", 0), ("drm_render_minor", 0), ("hive_id", 0),
        ("num_sdma_engines", 0), ("num_sdma_xgmi_engines", 0), ("num_sdma_queues_per_engine", 0),
        ("num_cp_queues", 0), ("max_engine_clk_ccompute", 3700)]))
    for i, g in enumerate(gpus):
        d = nodes / str(i + 1)
        (d / "mem_banks/0").mkdir(parents=True)
        (d / "caches").mkdir()
        (d / "io_links").mkdir()
        (d / "p2p_links").mkdir()
        gpu_id = 0x1000 + 0x111 * (i + 1)
        (d / "gpu_id").write_text(f"{gpu_id}\n")
        (d / "name").write_text(f"{name}\n")
        values = {
            "simd_count": g.simd_count, "mem_banks_count": 1, "caches_count": 600, "io_links_count": 1,
            "max_waves_per_simd": 8, "lds_size_in_kb": 160, "num_gws": 64, "wave_front_size": 64,
            "array_count": 4 * g.num_xcc, "simd_arrays_per_engine": 1, "cu_per_simd_array": 8, "simd_per_cu": 4,
            "max_slots_scratch_cu": 32, "gfx_target_version": g.gfx_target_version, "vendor_id": 4098,
            "device_id": g.device_id, "location_id": 0x100 * (i + 1), "domain": 0, "drm_render_minor": 128 + i,
            "hive_id": 0x5A5A5A5A5A5A5A5A, "num_sdma_engines": 2, "num_sdma_xgmi_engines": 14,
            "num_sdma_queues_per_engine": 8, "num_cp_queues": 24, "max_engine_clk_fcompute": 2400,
            "local_mem_size": 0, "fw_version": g.fw_version, "capability": 0x2B9C0280, "capability2": 0,
            "debug_prop": 0, "sdma_fw_version": g.sdma_fw_version, "unique_id": 0xC0FFEE000000 + i,
            "num_xcc": g.num_xcc, "max_engine_clk_ccompute": 3700, **g.extra,
        }
        (d / "properties").write_text("".join(f"{k} {values.get(k, 0)}\n" for k in NODE_KEYS))
        (d / "mem_banks/0/properties").write_text(
            f"heap_type 1\nsize_in_bytes {g.vram_bytes}\nflags 0\nwidth 8192\nmem_clk_max 2000\n")
        (d / "mem_banks/0/used_memory").write_text(f"{g.vram_used}\n")
        dev = root / f"class/drm/renderD{128 + i}/device"
        dev.mkdir(parents=True)
        (dev / "mem_info_vram_total").write_text(f"{g.vram_bytes}\n")
        (dev / "mem_info_vram_used").write_text(f"{g.vram_used}\n")
    if amdgpu_version is not None:
        (root / "module/amdgpu").mkdir(parents=True)
        (root / "module/amdgpu/version").write_text(f"{amdgpu_version}\n")
    return root


def gpu_ids(root: Path) -> list[int]:
    """The ``gpu_id`` of every GPU node of the tree, in node order."""
    nodes = root / "class/kfd/kfd/topology/nodes"
    ids = [int((d / "gpu_id").read_text()) for d in sorted(nodes.iterdir(), key=lambda p: int(p.name))]
    return [i for i in ids if i]


def set_process_vram(root: Path, pid: int, by_gpu_id: dict[int, int]) -> None:
    """Write ``proc/<pid>/vram_<gpu_id>`` files (bytes) as KFD does for a process using GPUs."""
    d = root / "class/kfd/kfd/proc" / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    for gid, n in by_gpu_id.items():
        (d / f"vram_{gid}").write_text(f"{n}\n")
