"""Configuration: defaults < file < environment < flags, with the source of every value."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import warmctl.records.config as config
from warmctl.records.config import ENV_VARS, ConfigError, Settings, load_settings

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in [*ENV_VARS.values(), "WARMCTL_CONFIG"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(config, "DEFAULT_CONFIG_FILE", tmp_path / "no-such-default.toml")


def test_defaults_without_any_file():
    s = load_settings()
    assert s.home == config.DEFAULT_HOME
    assert s.store_dir == s.home / "store" and s.run_dir == s.home / "run"
    assert s.models_dir == s.home / "models" and s.cache_dir == s.home / "cache"
    assert s.catalog_url == str(s.home / "store")
    assert s.match_driver == "exact" and s.agent_port == 7420
    assert set(s.sources) == set(Settings.model_fields) - {"sources"}
    assert set(s.sources.values()) == {"default"}


def test_file_env_and_flags_in_rising_priority(tmp_path, monkeypatch):
    cfg = tmp_path / "etc" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text(
        'home = "data"\nremote_store = "s3://bucket/snaps"\nkeys_dir = "/k"\ngate_port = 9000\n'
        'profile_dirs = ["profiles", "/abs/profiles"]\nmatch_driver = "major"\n'
    )
    monkeypatch.setenv("WARMCTL_KEYS_DIR", "/env/keys")
    monkeypatch.setenv("WARMCTL_GATE_PORT", "9100")
    s = load_settings(cfg, {"gate_port": 9200, "criu": None})
    assert s.home == cfg.parent / "data"  # relative to the file's directory
    assert s.profile_dirs == [cfg.parent / "profiles", Path("/abs/profiles")]
    assert s.keys_dir == Path("/env/keys") and s.gate_port == 9200 and s.criu == "criu"
    assert s.catalog_url == "s3://bucket/snaps"  # catalog falls back to the remote store
    assert s.sources["home"] == f"file:{cfg}"
    assert s.sources["match_driver"] == f"file:{cfg}"
    assert s.sources["keys_dir"] == "env:WARMCTL_KEYS_DIR"
    assert s.sources["gate_port"] == "flag"
    assert s.sources["criu"] == "default"  # a None flag does not override


def test_config_file_from_environment_and_env_lists(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('catalog = "s3://cat/x"\n')
    monkeypatch.setenv("WARMCTL_CONFIG", str(cfg))
    monkeypatch.setenv("WARMCTL_PROFILE_DIRS", "/a:/b")
    monkeypatch.setenv("WARMCTL_HOME", "rel-home")
    s = load_settings()
    assert s.catalog_url == "s3://cat/x" and s.sources["catalog"] == f"file:{cfg}"
    assert s.profile_dirs == [Path("/a"), Path("/b")]
    assert s.home == Path.cwd() / "rel-home"  # env paths are relative to the working directory


@pytest.mark.parametrize(
    ("text", "env", "expect"),
    [
        ("home = [", {}, "not valid TOML"),
        ('hme = "/x"\n', {}, "hme: Extra inputs are not permitted"),
        ("gate_port = 70000\n", {}, "gate_port: Input should be less than or equal to 65535"),
        ('match_driver = "fuzzy"\n', {}, "match_driver"),
        ("", {"WARMCTL_AGENT_PORT": "eighty"}, "$WARMCTL_AGENT_PORT: agent_port"),
        ("", {"WARMCTL_S3_OUTAGE_S": "-1"}, "$WARMCTL_S3_OUTAGE_S: s3_outage_s: Input should be greater than or equal to 0"),
    ],
)
def test_bad_values_name_the_source_and_field(tmp_path, monkeypatch, text, env, expect):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    assert expect in str(e.value)
    if not env:
        assert str(cfg) in str(e.value)


def test_bad_flag_and_missing_explicit_file(tmp_path):
    with pytest.raises(ConfigError, match="command-line flag: gate_port"):
        load_settings(overrides={"gate_port": "x"})
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(tmp_path / "missing.toml")


def test_example_config_is_valid_and_complete():
    example = REPO / "docs" / "config.example.toml"
    text = example.read_text()
    s = load_settings(example)
    assert s.sources["home"] == f"file:{example}"
    for field in Settings.model_fields:
        if field not in ("sources", "config_file"):  # config_file: the file itself, not a key of it
            assert f"{field} =" in text or f"# {field} =" in text, f"{field} is not documented in {example}"


def test_cli_config_show_prints_values_and_sources(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('home = "/srv/warm"\n')
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "250", "WARMCTL_SIGNING_KEY": "/keys/pub.key"}
    exe = str(Path(sys.executable).parent / "warmctl")
    out = subprocess.run([exe, "config", "show", "--json", "--config", str(cfg)], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["home"] == {"value": "/srv/warm", "source": f"file:{cfg}"}
    assert data["store"] == {"value": "/srv/warm/store", "source": "default (home/store)"}
    assert data["signing_key"] == {"value": "/keys/pub.key", "source": "env:WARMCTL_SIGNING_KEY"}
    table = subprocess.run([exe, "config", "show", "--config", str(cfg)], capture_output=True, text=True, env=env,
                           timeout=60)
    assert table.returncode == 0 and "env:WARMCTL_SIGNING_KEY" in table.stdout and "/srv/warm" in table.stdout
    bad = subprocess.run([exe, "config", "show", "--config", str(tmp_path / "nope.toml")], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 13 and "nope.toml: config file not found" in bad.stderr
