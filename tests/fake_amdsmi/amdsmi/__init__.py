"""A test double of AMD SMI's Python package (``amdsmi``), at the GPU-driver boundary.

Only the calls :mod:`warmctl.checkpoint.kfd` makes, with the return shapes of AMD SMI's
``py-interface/amdsmi_interface.py``: ``amdsmi_get_gpu_kfd_info`` -> ``{"kfd_id", "node_id",
"current_partition_id"}``; ``amdsmi_get_gpu_asic_info`` -> ``{"market_name", "vendor_id",
"device_id", ... }`` (ids as hex strings); ``amdsmi_get_gpu_device_uuid`` -> str;
``amdsmi_get_gpu_driver_info`` -> ``{"driver_name", "driver_version", "driver_date"}``.

What it answers comes from the JSON file named by ``$FAKE_AMDSMI_JSON``:
``{"fail_init": bool, "gpus": [{"kfd_id", "node_id", "market_name", "uuid", "driver_version",
"device_id"}]}``. A test puts this directory on ``sys.path`` (or ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os

_state: dict | None = None


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int, err_info: str = ""):
        super().__init__(f"Error code:\n\t{err_code} | {err_info}")
        self.err_code = err_code


def _load() -> dict:
    with open(os.environ["FAKE_AMDSMI_JSON"]) as f:
        return json.load(f)


def amdsmi_init(flag=None) -> None:
    global _state
    state = _load()
    if state.get("fail_init"):
        raise AmdSmiLibraryException(8, "AMDSMI_STATUS_INIT_ERROR")  # what a host without /dev/kfd access sees
    _state = state


def amdsmi_shut_down() -> None:
    global _state
    if _state is None:
        raise AmdSmiLibraryException(32, "AMDSMI_STATUS_NOT_INIT")
    _state = None


def _gpu(handle: int) -> dict:
    if _state is None:
        raise AmdSmiLibraryException(32, "AMDSMI_STATUS_NOT_INIT")
    return _state["gpus"][handle]


def amdsmi_get_processor_handles() -> list[int]:
    if _state is None:
        raise AmdSmiLibraryException(32, "AMDSMI_STATUS_NOT_INIT")
    return list(range(len(_state["gpus"])))


def amdsmi_get_gpu_kfd_info(handle: int) -> dict:
    g = _gpu(handle)
    return {"kfd_id": g["kfd_id"], "node_id": g["node_id"], "current_partition_id": 0}


def amdsmi_get_gpu_asic_info(handle: int) -> dict:
    g = _gpu(handle)
    return {"market_name": g["market_name"], "vendor_id": "0x1002", "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002", "device_id": g["device_id"], "rev_id": "0x00", "asic_serial": "0x0000000000000001",
            "oam_id": handle, "num_compute_units": 256, "target_graphics_version": "gfx950"}


def amdsmi_get_gpu_device_uuid(handle: int) -> str:
    return _gpu(handle)["uuid"]


def amdsmi_get_gpu_driver_info(handle: int) -> dict:
    return {"driver_name": "amdgpu", "driver_version": _gpu(handle)["driver_version"], "driver_date": "2015/01/01 00:00"}
