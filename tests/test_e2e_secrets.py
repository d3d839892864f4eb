"""A secret the engine itself reads at start-up is found by `snapshot`'s scan (issue 26), with
real CRIU and the real vLLM engine (CPU build): one cold start of a ``tiny`` whose warm-up grid
is a single cell.

The site's logging config reaches the engine through ``engine_env_passthrough``
(``VLLM_LOGGING_CONFIG_PATH``: vLLM reads the file at start-up and keeps what it configures);
its log-shipping handler carries the token of the site's token file, which warmctl knows as a
secret because a credential-looking variable of its environment (``SITE_LOG_TOKEN_FILE``)
names it. The token is then in the engine's memory, CRIU writes it into the page images, and
`snapshot` must refuse, naming the token's file and the image file, never the value, and leave
nothing: no chunk, manifest or catalog entry in the store, no process, no ``/dev/shm`` file.
(The probes in the environment of the session snapshot, which must publish cleanly, are
checked in test_e2e_main.py.)
"""

from __future__ import annotations

import json
import re

import pytest
from tests.conftest import isolated_env, listening, shm_leaked, shm_names, tiny_profile, warmctl

pytestmark = pytest.mark.e2e

TOKEN = "site-log-token-4f9b2e7c1a6d3085"


def test_a_token_the_engine_reads_at_start_up_is_refused_and_nothing_is_left(tmp_path, engine_ports):
    env = isolated_env(tmp_path, *engine_ports)
    small = re.sub(r"(?ms)^\[warmup\].*?(?=^\[canary\])",
                   "[warmup]\nprompt_tokens = [16]\noutput_tokens = [1]\nconcurrency = [1]\n\n",
                   tiny_profile(*engine_ports))
    (tmp_path / "profiles" / "tiny.toml").write_text(small)
    token_file = tmp_path / "log-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    logging_cfg = tmp_path / "logging.json"
    logging_cfg.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(message)s", "datefmt": "%m-%d %H:%M:%S"}},
        # a handler the site's tooling wrote from its token file; "." sets attributes on it
        "handlers": {"ship": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout",
                              ".": {"auth_token": TOKEN}}},
        "loggers": {"vllm": {"handlers": ["ship"], "level": "INFO", "propagate": False}}}))
    cfg = tmp_path / "config.toml"
    cfg.write_text(cfg.read_text() + 'engine_env_passthrough = ["VLLM_LOGGING_CONFIG_PATH"]\n')
    env.update(SITE_LOG_TOKEN_FILE=str(token_file), VLLM_LOGGING_CONFIG_PATH=str(logging_cfg))
    command = json.loads(warmctl("profile", "command", "tiny", "--json", env=env).stdout)
    assert command["from_environment"]["VLLM_LOGGING_CONFIG_PATH"] == "passthrough"
    assert "SITE_LOG_TOKEN_FILE" not in command["from_environment"]

    shm0 = shm_names()
    r = warmctl("snapshot", "tiny", env=env, check=False, timeout=1500)
    out = r.stdout + r.stderr
    assert r.returncode == 37, out  # SecretInSnapshot
    assert re.search(rf"the file {re.escape(str(token_file))} named by environment variable SITE_LOG_TOKEN_FILE: "
                     r"found in image file pages-\d+\.img", out), out
    assert "nothing was stored or pushed" in out and TOKEN not in out
    # nothing stored: no chunk, no manifest, no catalog entry; nothing running, nothing in /dev/shm
    store = tmp_path / "home" / "store"
    stored = [p.relative_to(store) for p in store.rglob("*") if p.is_file()] if store.exists() else []
    assert not [p for p in stored if p.parts[0] in ("chunks", "manifests", "catalog")], stored
    assert json.loads(warmctl("ls", "--json", env=env).stdout) == []
    assert json.loads(warmctl("status", "--json", env=env).stdout) == []
    assert not listening(engine_ports[0])
    assert not (left := shm_leaked(shm0)), f"a refused snapshot left {left} in /dev/shm"
    assert not (tmp_path / "home" / "run" / "tiny" / "images").exists()

