"""Exit codes: every WarmctlError subclass in the package has its own code,
given once (warmctl.base.errors.EXIT_CODES) and listed in docs/exit-codes.md; the agent client turns
each error a job reports back into the same class with the same code."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import warmctl
from warmctl.client import JobFailed, _error_for
from warmctl.base.errors import EXIT_CODES, OTHER_EXIT_CODES, WarmctlError, error_class

DOC = Path(__file__).resolve().parent.parent / "docs" / "exit-codes.md"


def _all_error_classes() -> list[type[WarmctlError]]:
    for m in pkgutil.walk_packages(warmctl.__path__, "warmctl."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
    out, todo = [], [WarmctlError]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    return [c for c in out if c.__module__.startswith("warmctl.")]


def test_every_error_class_has_its_own_code_in_the_one_table():
    classes = _all_error_classes()
    assert len(classes) >= 30
    names = [c.__name__ for c in classes]
    assert len(set(names)) == len(names), "two error classes share a name (the agent reports names)"
    for c in classes:
        assert c.__name__ in EXIT_CODES, f"{c.__module__}.{c.__name__} has no exit code in warmctl.base.errors.EXIT_CODES"
        code, module = EXIT_CODES[c.__name__]
        assert c.__module__ == module and c.exit_code == code, c
    by_name = {c.__name__: c for c in classes}
    owner: dict[int, type[WarmctlError]] = {}
    for c in sorted(classes, key=lambda c: len(c.__mro__)):  # a class before its subclasses
        code = EXIT_CODES[c.__name__][0]
        if code in owner:  # only a case of the failure that owns the code may share it
            assert issubclass(c, owner[code]), f"{c.__name__} and {owner[code].__name__} share exit code {code}"
        else:
            owner[code] = c
    shared = {n for n, c in by_name.items() if owner[EXIT_CODES[n][0]] is not c}
    assert shared <= {"RollbackRefused"}, f"new classes sharing a code: {sorted(shared)}"
    codes = [code for code, _ in EXIT_CODES.values()]
    assert all(0 < c < 126 and c not in OTHER_EXIT_CODES for c in codes)
    from warmctl.cli.foreground import ENGINE_DIED_EXIT

    assert ENGINE_DIED_EXIT in OTHER_EXIT_CODES
    assert set(EXIT_CODES) == set(names), "a table row names no class"


def test_the_documented_table_is_the_code_table():
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| `([\w.]+)` \|", DOC.read_text(), re.M)
    assert len(rows) == len({name for _, name, _ in rows}), "a class listed twice"
    assert {name: (int(code), module) for code, name, module in rows} == EXIT_CODES


def test_client_maps_every_reported_error_back_to_its_class():
    for name, (code, _) in EXIT_CODES.items():
        err = _error_for({"type": name, "message": f"it failed: {name}", "exit_code": code})
        assert type(err) is error_class(name) and err.exit_code == code, name
        assert str(err) == f"it failed: {name}"
    unknown = _error_for({"type": "FutureError", "message": "new", "exit_code": 77})
    assert isinstance(unknown, JobFailed) and unknown.exit_code == 77 and str(unknown) == "new"
    assert _error_for({"type": "InternalError", "message": "boom"}).exit_code == JobFailed.exit_code
