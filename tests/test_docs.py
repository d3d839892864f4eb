"""Claims of the docs that a test can check, checked against the code.

- Every ``warmctl COMMAND [SUBCOMMAND] [--flag]`` named in docs/, README.md, catalog/README.md,
  the package's docstrings and comments and the scripts exists in the CLI (the real click tree).
- The ``--json`` documents of docs/cli-json.md are the ones the commands print: the real
  commands run on a small home with the fake engine (tests/fake_vllm.py, real CRIU), and each
  document's keys are compared with the keys its section lists.
- design.md's "``teardown()`` is the only place ...": the modules that kill a process tree or
  remove an engine's record are the ones it names.
- Every ``test_x.py::test_name`` the docs cite as evidence exists; no doc or comment cites a
  tracker number the repository does not hold ("issue 31").
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from tests.conftest import fake_env, warmctl

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli-json.md"


# ----------------------------------------------------------------------------- commands named


def _cli_tree():
    """The CLI's click command tree (every command registered, as shell completion sees it)."""
    import typer.main

    import warmctl.cli as cli

    cli._register()
    return typer.main.get_command(cli.app)


def _flags(cmd) -> set[str]:
    out = {"--help"}
    for p in cmd.params:
        out |= {o for o in [*p.opts, *p.secondary_opts] if o.startswith("--")}
    return out


def _texts() -> list[tuple[Path, str]]:
    """``(file, text)`` of every file that may name a command, with the command lines of code
    blocks and shell scripts marked as if quoted (`` `warmctl ...` ``)."""
    files = [*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "catalog" / "README.md",
             *ROOT.glob("warmctl/**/*.py"), *ROOT.glob("scripts/*.sh"), *ROOT.glob("deploy/**/*")]
    out = []
    for f in files:
        if not f.is_file():
            continue
        lines, inside = [], False
        for line in f.read_text(errors="replace").splitlines():
            if f.suffix == ".md" and line.lstrip().startswith("```"):
                inside = not inside
            elif (inside and f.suffix == ".md") or (f.suffix == ".sh" and not line.lstrip().startswith("#")):
                line = re.sub(r"(^\s*|(?:\$|sudo|&&|\|\||;|\|) |bin/)warmctl ", r"\1`warmctl ", line)
            lines.append(line)
        out.append((f, "\n".join(lines)))
    return out


def test_every_warmctl_command_named_in_docs_and_code_exists():
    root = _cli_tree()
    named = re.compile(r"(?:`+|\$ |\bsudo )(warmctl [^`\n]*)")
    checked, bad = 0, []
    for f, text in _texts():
        for m in named.finditer(text):
            words = re.split(r"\s(?:&&|\|\||\||;|#)\s", m.group(1))[0].split()  # one command of a line
            where = f"{f.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1).strip()}"
            if len(words) < 2 or not re.fullmatch(r"[a-z][a-z0-9-]*", words[1]):
                continue  # `warmctl` alone, `warmctl NAME`-style placeholders, `warmctl --version`
            cmd = root.commands.get(words[1])
            if cmd is None:
                bad.append(f"{where}: no command {words[1]!r}")
                continue
            rest = words[2:]
            subs = getattr(cmd, "commands", None)
            if subs is not None and rest and re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]):
                if rest[0] not in subs:
                    bad.append(f"{where}: {words[1]} has no subcommand {rest[0]!r}")
                    continue
                cmd, rest = subs[rest[0]], rest[1:]
            checked += 1
            if getattr(cmd, "commands", None) is not None:
                continue
            flags = _flags(cmd)
            for w in rest:
                flag = re.match(r"--[a-z][a-z0-9-]*", w)
                if flag and flag.group(0) not in flags:
                    bad.append(f"{where}: {cmd.name} has no option {flag.group(0)}")
    assert checked > 200, checked  # the scan finds the commands (not vacuously green)
    assert not bad, "\n".join(bad)


def test_every_test_the_docs_cite_exists():
    """``test_x.py::test_name`` (and the `` `test_other` `` names listed after it) cited in the
    docs as evidence are tests of that file."""
    cited, bad = 0, []
    for f in [*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "catalog" / "README.md"]:
        for m in re.finditer(r"(test_\w+\.py)::(\w+)((?:`?,\s*`test_\w+`)*)", f.read_text()):
            src = ROOT / "tests" / m.group(1)
            text = src.read_text() if src.is_file() else ""
            for name in [m.group(2), *re.findall(r"`(test_\w+)`", m.group(3))]:
                cited += 1
                if not re.search(rf"^(?:async )?def {name}\b", text, re.M):
                    bad.append(f"{f.relative_to(ROOT)}: {m.group(1)}::{name}")
    assert cited > 50, cited
    assert not bad, "\n".join(bad)


def test_no_doc_or_comment_cites_a_tracker_number():
    """The repository does not hold its tracker: "issue 31" in a doc or a comment points at
    nothing a reader has (an upstream project's ``owner/repo#N`` or URL is fine)."""
    bad = []
    files = [*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "catalog" / "README.md",
             *ROOT.glob("warmctl/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"),
             *ROOT.glob("scripts/*")]
    for f in files:
        if not f.is_file() or f == Path(__file__):
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in re.finditer(r"(?<![A-Za-z])[Ii]ssues?[ _]#?\d+(?!\d)", line):  # also in a name: issue_30
                if not re.search(r"(https?://\S*|[\w.-]+/[\w.-]+)$", line[: m.start()].rstrip()):
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- teardown


def _calls(tree: ast.AST, names: set[str]) -> list[tuple[str, str]]:
    """``(enclosing function, callee)`` of every call of one of ``names`` in ``tree``."""
    out = []

    def visit(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call):
                f = child.func
                callee = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if callee in names:
                    out.append((fn, callee))
            visit(child, inner)

    visit(tree, "<module>")
    return out


def test_teardown_is_the_only_place_that_kills_an_engine_tree_or_drops_its_record():
    """design.md, "One running engine": ``EngineRun.teardown()`` (with its helpers for strays)
    kills trees and removes records; the gate's lazy guard (gate/lazy.py) is the one other
    caller of ``kill_tree``, and design.md names it."""
    found: dict[str, set[str]] = {}
    for f in (ROOT / "warmctl").rglob("*.py"):
        rel = str(f.relative_to(ROOT / "warmctl"))
        for fn, callee in _calls(ast.parse(f.read_text()), {"kill_tree", "remove_state"}):
            found.setdefault(rel, set()).add(fn)
    assert found == {
        "engine/run.py": {"teardown", "_kill_strays", "_kill_restored"},
        "gate/lazy.py": {"take_down"},
        "base/proc.py": {"kill_child"},
    }, found
    design = (ROOT / "docs" / "design.md").read_text()
    for named in ("`gate/lazy.py`", "`gate/drain.py`", "`checkpoint/ranks.py`", "`teardown()` is the\nonly place"):
        assert named in design, named


# ----------------------------------------------------------------------------- --json keys


def _sections() -> dict[str, str]:
    """docs/cli-json.md's ``###`` sections: heading -> text."""
    parts = re.split(r"^(#{2,3} .+)$", DOC.read_text(), flags=re.M)
    return {parts[i][4:].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2) if parts[i].startswith("### ")}


def _section(start: str) -> str:
    (text,) = [t for h, t in _sections().items() if h.startswith(start)]
    return text


def _braced(text: str, n: int = 0) -> set[str]:
    """The names of the ``n``-th ``{"a", "b", ...}`` group in ``text``."""
    groups = re.findall(r'\{("\w+"(?:,\s*"\w+")*)\}', text)
    return set(re.findall(r'"(\w+)"', groups[n]))


def _code_block_keys(text: str) -> set[str]:
    (block,) = re.findall(r"```json\n(.*?)```", text, re.S)
    return set(json.loads(block))


def _mentioned(text: str) -> set[str]:
    """Every name the section quotes: `` `name` `` and ``"name"``."""
    return set(re.findall(r'`(\w+)`', text)) | set(re.findall(r'"(\w+)"', text))


def _json(env, *args: str):
    r = warmctl(*args, "--json", env=env)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def home(tmp_path_factory, engine_ports):
    """A fresh home with the fake engine's profile and one snapshot of it, up while the tests of
    this section run (then down)."""
    env = fake_env(tmp_path_factory.mktemp("docs-home"), *engine_ports)
    snap = _json(env, "snapshot", "fake")
    up = _json(env, "up", "fake", "--cold-start", "never")
    try:
        yield env, snap, up
    finally:
        warmctl("down", "fake", "--now", env=env, check=False)


def test_snapshot_and_up_print_the_documented_documents(home):
    env, snap, up = home
    assert set(snap) == _code_block_keys(_section("`snapshot NAME --json`"))
    (example,) = re.findall(r"```json\n(.*?)```", _section("`snapshot NAME --json`"), re.S)
    assert set(json.loads(example)["timings_s"]) <= set(snap["timings_s"])
    assert {"warmup", "canary_record", "secret_scan", "criu_dump", "store"} <= set(snap["timings_s"])
    doc = _section("`up NAME --json`")
    assert set(up) == _code_block_keys(doc) and up["source"] == "restore" and up["failure"] is None
    assert set(up["state"]) <= _mentioned(_section("`status [NAME] --json`"))
    (example,) = re.findall(r"```json\n(.*?)```", doc, re.S)
    assert set(json.loads(example)["timings_s"]) <= set(up["timings_s"]) and up["timings"] == up["timings_s"]


def test_status_ls_and_catalog_print_the_documented_keys(home):
    env, snap, _ = home
    status = _section("`status [NAME] --json`")
    (st,) = _json(env, "status")
    assert set(st) <= _mentioned(status), sorted(set(st) - _mentioned(status))
    # the state record's fields and the live facts, as listed
    assert {"engine_alive", "gate_alive", "healthy", "shm_count", "shm_bytes", "lazy_copy", "failure",
            "snapshot_error", "profile"} <= set(st)
    assert set(st["profile"]) == _braced(status)  # {"profile_file", "current", "changes", "error"}
    ls = _section("`ls [--remote] --json`")
    (row,) = _json(env, "ls")
    assert set(row) == _braced(ls), (sorted(row), sorted(_braced(ls)))
    assert set(row["layout"]) <= _braced(ls, 1) | _mentioned(ls)
    cat = _section("`catalog ls --json`")
    (entry,) = _json(env, "catalog", "ls")
    assert {"format", "kind", "name", "tag", "manifest", "created", "published", "profile_digest", "size",
            "host"} <= set(entry)
    show = _json(env, "catalog", "show", "fake")
    assert set(show) == _braced(cat)  # {"name", "tag", "profile_digest", "chosen", "entries"}
    assert {"fits", "rejection", "signature", "layout"} <= set(show["entries"][0])
    host = _section("`host --json`")
    fp = _json(env, "host")
    assert set(fp) <= _mentioned(host), sorted(set(fp) - _mentioned(host))
    assert all(isinstance(v, dict) and set(v) == {"value", "source"} for v in _json(env, "config", "show").values())


def test_store_commands_print_the_documented_keys(home, tmp_path):
    env, snap, _ = home
    verify = _json(env, "verify")
    assert set(verify) == _braced(_section("`verify [REF...] --json`")) and verify["ok"] is True
    gc = _json(env, "gc", "--dry-run")
    assert set(gc) == _braced(_section("`gc --json`"))
    du_doc = _section("`du --json`")
    du = _json(env, "du")
    assert set(du) == _braced(du_doc)
    assert set(du["rows"][0]) == _braced(du_doc, 1) and set(du["images"][0]) == _braced(du_doc, 2)
    assert set(du["image_cache"]) == _braced(du_doc, 3) and set(du["filesystems"][0]) == _braced(du_doc, 4)
    (pushed,) = _json(env, "push", "fake", "--to", str(tmp_path / "remote"))
    assert set(pushed) == _braced(_section("`push NAME[:TAG] --json`"))
    keys_doc = _section("`keys ls --json`")
    keys = _json(env, "keys", "ls")
    documented = set(re.findall(r'"(\w+)"\s*[,:}]', keys_doc))  # {"keys_dir", "keys": [{"key_id", ...}]}
    assert set(keys) | set(keys["keys"][0]) == documented, (sorted(set(keys) | set(keys["keys"][0])), sorted(documented))
