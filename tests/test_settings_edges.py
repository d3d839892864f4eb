"""Settings are resolved once, at the edge (the CLI, the agent's start-up, a benchmark or test
script), and passed down: nothing below reads a config file or warmctl's environment.

- an AST scan of ``warmctl/`` (the edges excepted) for ``load_settings`` and for reads of
  ``WARMCTL_*`` variables from ``os.environ`` / ``os.getenv``;
- every knob that used to be read from the environment below the pipelines is a
  :class:`warmctl.records.config.Settings` field with its variable in ``ENV_VARS``, shown by
  ``warmctl config show`` with its source;
- the real agent started with ``--config FILE`` (and no ``$WARMCTL_CONFIG``) uses that file in
  the store layer: a sealed local store is read with the file's ``seal_key``, and an S3 catalog
  on the file's ``s3_endpoint`` that does not answer fails after the file's 5 s outage window;
- ``open_store``/``open_backend`` take what they are given, and the built-in defaults (not the
  environment) when given nothing.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from test_store_fixtures import snapshot, write_payload

from warmctl.records.config import ENV_VARS, Settings
from warmctl.store import open_backend, open_store
from warmctl.store.sealed import load_key, seal_store

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "warmctl"

#: Where settings are resolved: the CLI (every command, ``warmctl agent`` included) and the
#: settings module itself. Nothing else may call ``load_settings`` or read ``WARMCTL_*``.
EDGES = ("cli/", "records/config.py", "__main__.py")

#: Test hooks read from the environment on purpose: they are inherited by every process warmctl
#: starts and are no settings (faults.py: kill at a named point; store/local.py: kill or stop at
#: the Nth write; checkpoint/kfd.py: a fake sysfs tree for the AMD tests; engine/vllm.py: the
#: fake engine's command line, tests/fake_vllm.py, in place of ``vllm``).
TEST_HOOKS = {"WARMCTL_TEST_KILL_AT_PHASE", "WARMCTL_TEST_KILL_RANK", "WARMCTL_FAULT_KILL_AT_WRITE",
              "WARMCTL_FAULT_STOP_AT_WRITE", "WARMCTL_SYSFS_ROOT", "WARMCTL_TEST_ENGINE_CMD"}

#: The knobs that were read straight from the environment below the pipelines.
FORMER_ENV_KNOBS = {
    "WARMCTL_OCI_PACK_BYTES": "oci_pack_bytes", "WARMCTL_OCI_READ_DEADLINE_S": "oci_read_deadline_s",
    "WARMCTL_OCI_CA_BUNDLE": "oci_ca_bundle", "WARMCTL_OCI_CERTS_D": "oci_certs_d",
    "WARMCTL_OCI_INSECURE": "oci_insecure", "WARMCTL_LOCK_STALE_S": "lock_stale_s",
    "WARMCTL_S3_ENDPOINT": "s3_endpoint", "WARMCTL_CRIU": "criu", "WARMCTL_XTILE_PERM_LIB": "xtile_perm_lib",
    "WARMCTL_CRIU_LOCK": "criu_lock", "WARMCTL_LIBNVML": "libnvml", "WARMCTL_LIBCUDA": "libcuda",
    "WARMCTL_CUDA_CHECKPOINT": "cuda_checkpoint",
}


def _below_the_edge() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py")
                  if not any(str(p.relative_to(PKG)).startswith(e) for e in EDGES))


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` (or a bare ``environ`` imported from os)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def _env_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, variable) of every read of a ``WARMCTL_*`` variable: ``os.environ.get(K)``,
    ``os.environ[K]``, ``os.getenv(K)``, ``K in os.environ``, with ``K`` a literal or a
    module-level constant holding one."""
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}

    def name(k: ast.AST) -> str | None:
        if isinstance(k, ast.Constant) and isinstance(k.value, str):
            return k.value
        if isinstance(k, ast.Name):
            return consts.get(k.id)
        return None

    out = []
    for n in ast.walk(tree):
        key = None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
            if n.func.attr in ("get", "pop", "setdefault") and _is_environ(n.func.value):
                key = n.args[0]
            elif n.func.attr == "getenv" and isinstance(n.func.value, ast.Name) and n.func.value.id == "os":
                key = n.args[0]
        elif isinstance(n, ast.Subscript) and _is_environ(n.value):
            key = n.slice
        elif isinstance(n, ast.Compare) and any(_is_environ(c) for c in n.comparators):
            key = n.left
        v = name(key) if key is not None else None
        if v and v.startswith("WARMCTL_") and v not in TEST_HOOKS:
            out.append((n.lineno, v))
    return out


def test_nothing_below_the_edge_reads_the_config_or_warmctl_environment():
    files = _below_the_edge()
    assert len(files) > 50 and PKG / "store" / "__init__.py" in files and PKG / "pipelines" / "lifecycle.py" in files
    bad = []
    for p in files:
        tree = ast.parse(p.read_text(), str(p))
        rel = p.relative_to(REPO)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module == "warmctl.records.config" and any(a.name == "load_settings" for a in n.names):
                bad.append(f"{rel}:{n.lineno}: imports load_settings")
            if isinstance(n, (ast.Name, ast.Attribute)) and getattr(n, "id", getattr(n, "attr", None)) == "load_settings":
                bad.append(f"{rel}:{n.lineno}: uses load_settings")
        bad += [f"{rel}:{line}: reads ${var}" for line, var in _env_reads(tree)]
    assert bad == [], "settings must be resolved at the edge and passed down:\n" + "\n".join(sorted(set(bad)))


def test_the_scan_finds_what_it_looks_for():
    """The scan itself: each form of read it claims to catch is caught (a scan that finds
    nothing proves nothing)."""
    src = '''
import os
LOCK = "WARMCTL_LOCK_STALE_S"
a = os.environ.get("WARMCTL_OCI_PACK_BYTES")
b = os.environ["WARMCTL_CRIU_LOCK"]
c = os.getenv("WARMCTL_LIBCUDA")
d = os.environ.get(LOCK)
e = "WARMCTL_LIBNVML" in os.environ
f = os.environ.get("WARMCTL_TEST_KILL_AT_PHASE")
g = os.environ.get("HOME")
'''
    assert [v for _, v in _env_reads(ast.parse(src))] == [
        "WARMCTL_OCI_PACK_BYTES", "WARMCTL_CRIU_LOCK", "WARMCTL_LIBCUDA", "WARMCTL_LOCK_STALE_S", "WARMCTL_LIBNVML"]


def test_every_former_environment_knob_is_a_setting_with_its_variable():
    for var, field in FORMER_ENV_KNOBS.items():
        assert field in Settings.model_fields, field
        assert ENV_VARS.get(field) == var, (field, var)
    assert len(set(ENV_VARS.values())) == len(ENV_VARS)  # one variable per setting


def test_config_show_prints_the_knobs_with_their_sources(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('oci_pack_bytes = 12345678\nlock_stale_s = 42\noci_insecure = ["127.0.0.1:5000"]\n'
                   'criu_lock = "locks/criu.lock"\n')
    env = {"PATH": os.environ["PATH"], "COLUMNS": "250", "PYTHONPATH": str(REPO),
           "WARMCTL_OCI_READ_DEADLINE_S": "7.5", "WARMCTL_LIBCUDA": "/opt/nv/libcuda.so.1",
           "WARMCTL_OCI_INSECURE": "reg.a:5000, reg.b:5000", "WARMCTL_S3_ENDPOINT": "http://rgw.example:7480"}
    r = subprocess.run([sys.executable, "-m", "warmctl", "config", "show", "--json", "--config", str(cfg)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["oci_pack_bytes"] == {"value": 12345678, "source": f"file:{cfg}"}
    assert data["lock_stale_s"] == {"value": 42.0, "source": f"file:{cfg}"}
    assert data["criu_lock"] == {"value": str(tmp_path / "locks" / "criu.lock"), "source": f"file:{cfg}"}
    assert data["oci_read_deadline_s"] == {"value": 7.5, "source": "env:WARMCTL_OCI_READ_DEADLINE_S"}
    assert data["libcuda"] == {"value": "/opt/nv/libcuda.so.1", "source": "env:WARMCTL_LIBCUDA"}
    assert data["oci_insecure"] == {"value": ["reg.a:5000", "reg.b:5000"], "source": "env:WARMCTL_OCI_INSECURE"}
    assert data["s3_endpoint"] == {"value": "http://rgw.example:7480", "source": "env:WARMCTL_S3_ENDPOINT"}
    assert data["xtile_perm_lib"]["source"] == "default" and data["libnvml"] == {"value": "libnvidia-ml.so.1",
                                                                                   "source": "default"}
    assert data["config_file"] == {"value": str(cfg), "source": "flag"}
    r = subprocess.run([sys.executable, "-m", "warmctl", "config", "show", "--json", "--config", str(cfg)],
                       capture_output=True, text=True, env={**env, "WARMCTL_OCI_PACK_BYTES": "0"}, timeout=60)
    assert r.returncode != 0 and "$WARMCTL_OCI_PACK_BYTES: oci_pack_bytes" in r.stderr, r.stderr


def test_stores_use_the_settings_they_are_given_and_defaults_without(tmp_path, monkeypatch):
    """What is passed down decides; the environment below the edge does not."""
    for var in ("WARMCTL_LOCK_STALE_S", "WARMCTL_OCI_PACK_BYTES", "WARMCTL_S3_OUTAGE_S", "WARMCTL_OCI_INSECURE"):
        monkeypatch.setenv(var, "3")
    s = Settings(lock_stale_s=42, oci_pack_bytes=12345678, s3_outage_s=5, oci_insecure=["reg.example:5000"],
                 oci_read_deadline_s=9, s3_endpoint="http://127.0.0.1:9")
    assert open_store(tmp_path / "a", settings=s).lock_stale_after == 42
    assert open_store(tmp_path / "a").lock_stale_after == 120.0  # Settings() defaults, not $WARMCTL_LOCK_STALE_S
    oci = open_backend("oci://reg.example:5000/team/x", unseal=False, settings=s)
    assert oci.window == 5 and oci.setting == "s3_outage_s"
    assert (oci.inner.pack_bytes, oci.inner.read_deadline, oci.inner.endpoint()) == (12345678, 9, "http://reg.example:5000")
    plain = open_backend("oci://reg.example:5000/team/x", unseal=False)
    assert (plain.window, plain.inner.pack_bytes, plain.inner.endpoint()) == (60.0, 1 << 30, "https://reg.example:5000")
    s3 = open_backend("s3://bucket/p", unseal=False, settings=s)
    assert s3.window == 5 and s3.inner.endpoint_url == "http://127.0.0.1:9"


def _key(path: Path) -> Path:
    path.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    path.chmod(0o600)
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the test connects: connection refused


def test_the_agent_uses_its_config_file_in_every_layer(tmp_path):
    """``warmctl agent --config FILE`` with no ``$WARMCTL_CONFIG`` and no ``/etc/warmctl``
    settings in play: the store layer reads the file's seal_key (a sealed local store lists its
    snapshot) and the file's s3_endpoint and s3_outage_s (an S3 catalog that refuses
    connections fails after 5 s, not the default 60 s, naming the setting and the endpoint)."""
    home, key = tmp_path / "home", _key(tmp_path / "fleet.key")
    sealed = home / "store"
    seal_store(open_backend(sealed, unseal=False), load_key(key))
    with open_store(sealed, settings=Settings(seal_key=key)) as st:
        digest = snapshot(st, "tiny", {"p.img": write_payload(tmp_path / "p.img", [("random", 300_000)])})
    dead = _closed_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'home = "{home}"\nkeys_dir = "{tmp_path / "keys"}"\nseal_key = "{key}"\n'
                   f's3_outage_s = 5\ns3_endpoint = "http://127.0.0.1:{dead}"\ncatalog = "s3://warm/cat"\n'
                   f'lock_stale_s = 42\noci_pack_bytes = 12345678\n')
    assert Settings().s3_outage_s == 60 and Settings().seal_key is None  # the file differs from the defaults
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMCTL_", "AWS_")) and k != "NOTIFY_SOCKET"}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
               AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--config", str(cfg), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the agent did not become ready"
            time.sleep(0.2)
        h = {"Authorization": f"Bearer {(home / 'agent' / 'token').read_text().strip()}"}
        r = httpx.get(f"http://127.0.0.1:{port}/v1/snapshots", headers=h, timeout=30)
        assert r.status_code == 200, r.text  # without the file's seal_key: refused, naming the key id
        assert [(x["name"], x["digest"]) for x in r.json()] == [("tiny", digest)], r.json()
        t0 = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{port}/v1/catalog", headers=h, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 500, r.text
        assert 4.0 <= took < 30, took  # the file's 5 s window (plus one attempt), not 60 s
    finally:
        proc.terminate()
        try:
            log = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
    # the agent's log gives the store's error: the window is the file's, the endpoint the file's
    assert "BackendUnavailable" in log and "outage window s3_outage_s = 5 s" in log, log[-3000:]
    assert f"remote store http://127.0.0.1:{dead} unavailable" in log, log[-3000:]
