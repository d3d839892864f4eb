"""Loaded by every Python process of a CPU-build engine (this directory leads its PYTHONPATH,
:func:`warmctl.engine.vllm.engine_env`): vLLM's CPU worker reads its own memory-node affinity
from ``/proc/{os.getpid()}/status`` (``vllm.utils.cpu_resource_utils.get_memory_affinity``).
The engine runs in its own PID namespace but sees the host's ``/proc``, so that path names
*another* process (whatever host process has the worker's namespace PID, often a kernel thread)
or none: then the worker dies at start-up with ``FileNotFoundError: /proc/32/status`` (seen at
``--tensor-parallel-size 2``). ``/proc/self`` always names the reader, so the default (no pid)
is read from there. Nothing else is changed; any other ``get_memory_affinity(pid)`` call is
vLLM's own.
"""

import importlib.abc
import importlib.util
import sys

_MODULE = "vllm.utils.cpu_resource_utils"


def _self_mems() -> list:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Mems_allowed_list:"):
                from vllm.utils.cpu_resource_utils import parse_id_list

                return parse_id_list(line.split(":", 1)[1].strip())
    return []


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            own = module.get_memory_affinity
            module.get_memory_affinity = lambda pid=0: own(pid) if pid else _self_mems()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
