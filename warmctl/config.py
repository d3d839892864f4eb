"""Effective configuration: where warmctl keeps its data, which store it uses, default ports.

Values come from, in rising priority: built-in defaults, the config file
(``/etc/warmctl/config.toml``, or ``$WARMCTL_CONFIG``), environment variables
(``WARMCTL_HOME``, ``WARMCTL_STORE``, ...), and command-line flags. ``Settings.sources`` records
where each effective value came from (shown by ``warmctl config show``).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from warmctl.errors import WarmctlError

DEFAULT_CONFIG_FILE = Path("/etc/warmctl/config.toml")
DEFAULT_HOME = Path("/var/lib/warmctl")

#: field -> environment variable
ENV_VARS = {
    "home": "WARMCTL_HOME",
    "store": "WARMCTL_STORE",
    "remote_store": "WARMCTL_REMOTE_STORE",
    "keys_dir": "WARMCTL_KEYS_DIR",
    "signing_key": "WARMCTL_SIGNING_KEY",
    "agent_url": "WARMCTL_AGENT_URL",
    "agent_token_file": "WARMCTL_AGENT_TOKEN_FILE",
}


class ConfigError(WarmctlError):
    """The config file is unreadable or has a bad value."""


class Settings(BaseModel):
    """Effective settings. Paths are absolute after :func:`load_settings`.

    - ``home``: data directory (runtime state, models, local store, cache).
    - ``store``: local content-addressed store (directory); default ``home/store``.
    - ``remote_store``: optional remote store URL (``s3://bucket/prefix`` or a directory)
      that ``up`` pulls from and ``snapshot --push`` publishes to.
    - ``keys_dir``: trusted ed25519 public keys (``*.pub``); default ``/etc/warmctl/keys``.
    - ``signing_key``: private key used to sign manifests on publish (optional).
    - ``profile_dirs``: extra directories searched for ``NAME.toml`` before the shipped ones.
    - ``gate_host``/``gate_port``: override the profile's public address when set.
    - ``agent_url``/``agent_token_file``: when set, the CLI talks to that agent.
    """

    model_config = ConfigDict(extra="forbid")

    home: Path = DEFAULT_HOME
    store: Path | None = None
    remote_store: str | None = None
    keys_dir: Path = Path("/etc/warmctl/keys")
    signing_key: Path | None = None
    profile_dirs: list[Path] = []
    gate_host: str | None = None
    gate_port: int | None = None
    agent_url: str | None = None
    agent_token_file: Path | None = None
    #: field -> "default" | "file:PATH" | "env:VAR" | "flag"
    sources: dict[str, str] = {}

    @property
    def store_dir(self) -> Path:
        return self.store or self.home / "store"

    @property
    def run_dir(self) -> Path:
        """Per-engine runtime state: ``run/NAME/`` (state.json, logs, materialized image)."""
        return self.home / "run"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"


def load_settings(config_file: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Merge defaults, the config file, environment and ``overrides`` (flags).

    Raises :class:`ConfigError` naming the file and field when the file is not valid TOML or a
    value has the wrong type. A missing default config file is not an error; a missing file
    given explicitly (argument or ``$WARMCTL_CONFIG``) is.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    explicit = config_file or os.environ.get("WARMCTL_CONFIG")
    path = Path(explicit) if explicit else DEFAULT_CONFIG_FILE
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for k, v in data.items():
            values[k] = v
            sources[k] = f"file:{path}"
    elif explicit:
        raise ConfigError(f"{path}: config file not found")
    for field, var in ENV_VARS.items():
        if os.environ.get(var):
            values[field] = os.environ[var]
            sources[field] = f"env:{var}"
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
            sources[k] = "flag"
    try:
        s = Settings.model_validate(values)
    except ValidationError as e:
        msgs = [f"{path}: {'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()]
        raise ConfigError("\n".join(msgs)) from None
    s.home = s.home.absolute()
    for f in Settings.model_fields:
        sources.setdefault(f, "default")
    sources.pop("sources", None)
    s.sources = sources
    return s
