"""Imported at interpreter start when this directory is on PYTHONPATH: makes the packages named
in ``$WARMCTL_BLOCK_IMPORTS`` (comma-separated top-level names) unimportable, as on a machine
where they are not installed. Used by tests/test_gpu_check.py to prove what the GPU check needs."""

import importlib.abc
import os
import sys

_BLOCKED = frozenset(n for n in os.environ.get("WARMCTL_BLOCK_IMPORTS", "").split(",") if n)


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not on the GPU machine)", name=name)
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _Blocker())
