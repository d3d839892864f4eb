"""The module map of docs/design.md ("Architecture") is the import contract, row for row.

``[tool.importlinter]`` in pyproject.toml holds the layers (``lint-imports`` checks the imports
against them in scripts/test.sh); these tests fail when design.md's table says otherwise, when
a module of ``warmctl/`` is in no row, and (where import-linter is installed: the test extras)
when an import breaks a contract.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _contract_rows() -> list[set[str]]:
    """The ``layers`` contract's rows, top to bottom, each a set of module names under warmctl."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in cfg["contracts"] if c.get("id") == "layers"]
    assert layers["containers"] == ["warmctl"] and layers["exhaustive"] is True
    return [{m.strip() for m in re.split(r"[:|]", row)} for row in layers["layers"]]


def _table_rows() -> list[tuple[str, set[str]]]:
    """``(layer, {module})`` of each row of design.md's module map, top to bottom: ``x.py`` and
    ``x/`` in the modules column are the module or package ``warmctl.x``."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "---") or not line.startswith("|"):
            continue
        names = re.findall(r"`([^`]+)`", cells[1])
        bad = [n for n in names if not re.fullmatch(r"[a-z_]+(\.py|/)", n)]
        assert not bad, f"design.md, layer {cells[0]}: {bad} are not a top-level module (x.py) or package (x/)"
        rows.append((cells[0], {n.removesuffix(".py").removesuffix("/") for n in names}))
        if cells[0] == "base":
            break
    return rows


def _package_children() -> set[str]:
    pkg = ROOT / "warmctl"
    return ({p.stem for p in pkg.glob("*.py") if p.name != "__init__.py"}
            | {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()})


def test_design_md_module_map_is_the_import_contract():
    contract = _contract_rows()
    table = _table_rows()
    assert [layer for layer, _ in table][0] == "commands" and table[-1][0] == "base"
    assert len(table) == len(contract), (f"design.md has {len(table)} layers, the contract in pyproject.toml "
                                         f"{len(contract)}")
    for (layer, mods), row in zip(table, contract):
        assert mods == row, (f"layer {layer}: design.md lists {sorted(mods)}, pyproject.toml's layers contract "
                             f"{sorted(row)}")


def test_every_module_of_the_package_is_in_exactly_one_layer():
    rows = _contract_rows()
    placed = [m for row in rows for m in row]
    assert len(placed) == len(set(placed)), f"in two layers: {sorted({m for m in placed if placed.count(m) > 1})}"
    assert set(placed) == _package_children(), (f"not in a layer: {sorted(_package_children() - set(placed))}; "
                                                f"no such module: {sorted(set(placed) - _package_children())}")


def test_the_imports_keep_the_contracts():
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists() and shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]'); scripts/test.sh runs it")
    r = subprocess.run([str(exe) if exe.exists() else "lint-imports", "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
