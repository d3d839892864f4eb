"""The wheel works on a node installed the way docs/operations.md says: built from a
copy of this checkout, installed into a fresh venv outside the repository, run from a directory
that is not the repository. It carries every module and the shipped profiles.

Nothing is downloaded: the wheel is built with the test interpreter's own setuptools
(``pip wheel --no-deps --no-build-isolation``) and installed with ``--no-deps``; the fresh venv
reaches the dependencies (typer, pydantic, ...) through one ``.pth`` line naming the test
interpreter's site-packages. A ``.pth`` line only adds that directory to ``sys.path``, after the
venv's own site-packages, and does not run the ``.pth`` files inside it, so an editable install
of warmctl there is not seen: ``warmctl`` is imported from the wheel (asserted).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.packaging


def _copy_checkout(dst: Path) -> None:
    """The files git would commit (tracked, and untracked but not ignored), links kept as links."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = REPO / rel
        if not src.is_symlink() and not src.exists():  # deleted in the work tree
            continue
        d = dst / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), d)
        else:
            shutil.copy2(src, d)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(venv dir, wheel path, env)`` of a fresh venv with the wheel installed."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tmp = tmp_path_factory.mktemp("wheel")
    _copy_checkout(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(tmp / "src")], check=True, timeout=300)
    (whl,) = (tmp / "dist").glob("warmctl-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(whl)],
                   check=True, timeout=300)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "shared-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_") and k != "PYTHONPATH"}
    (tmp / "none.toml").write_text("")
    env.update(WARMCTL_CONFIG=str(tmp / "none.toml"), WARMCTL_HOME=str(tmp / "home"))
    return venv, whl, env


def test_wheel_carries_every_module_and_the_shipped_profiles(installed):
    _, whl, _ = installed
    names = set(zipfile.ZipFile(whl).namelist())
    src = {str(p.relative_to(REPO)) for p in (REPO / "warmctl").rglob("*.py") if "__pycache__" not in p.parts}
    assert src - names == set()
    shipped = {f"warmctl/profiles/{p.name}" for p in (REPO / "profiles").glob("*.toml")}
    assert "warmctl/profiles/tiny.toml" in shipped and shipped <= names


def test_installed_warmctl_runs_outside_the_repository(installed, tmp_path):
    venv, _, env = installed
    exe = str(venv / "bin" / "warmctl")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)

    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import warmctl; print(warmctl.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    ls = run("profile", "ls", "--json")
    assert ls.returncode == 0, ls.stderr
    doc = json.loads(ls.stdout)
    assert doc["search"][-2:] == ["/etc/warmctl/profiles", str(Path(where).parent / "profiles")]
    by = {p["name"]: p["file"] for p in doc["profiles"]}
    assert Path(by["tiny"]).is_relative_to(venv) and "ling30-flash-fp4-h200x2" in by
    assert run("profile", "check", "tiny", "ling31-flash").returncode == 0
    cmd = run("profile", "command", "tiny")
    assert cmd.returncode == 0 and " serve " in cmd.stdout, cmd.stderr
    h = run("snapshot", "--help")
    assert h.returncode == 0 and "PROFILE" in h.stdout, h.stderr
    show = run("profile", "show", "tiny")
    assert show.returncode == 0 and f"# {by['tiny']}" in show.stdout, show.stderr
    keys = run("keys", "ls", "--json")  # the default keys_dir, /etc/warmctl/keys, need not exist
    assert keys.returncode == 0 and json.loads(keys.stdout)["keys_dir"] == "/etc/warmctl/keys", keys.stderr
