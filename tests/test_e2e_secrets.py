"""Secrets and the real engine, with real CRIU and the real vLLM engine (CPU build):
a secret the engine itself reads at start-up is found by `snapshot`'s scan (one cold start of a
``tiny`` whose warm-up grid is a single cell), and the session's snapshot travels through a
sealed remote (one restore).

The site's logging config reaches the engine through ``engine_env_passthrough``
(``VLLM_LOGGING_CONFIG_PATH``: vLLM reads the file at start-up and keeps what it configures);
its log-shipping handler carries the token of the site's token file, which warmctl knows as a
secret because a credential-looking variable of its environment (``SITE_LOG_TOKEN_FILE``)
names it. The token is then in the engine's memory, CRIU writes it into the page images, and
`snapshot` must refuse, naming the token's file and the image file, never the value, and leave
nothing: no chunk, manifest or catalog entry in the store, no process, no ``/dev/shm`` file.
The same start passes through ``HF_ENDPOINT``, a private mirror's URL with ``user:password@``: no
name betrays it, its shape does (the ``url-userinfo`` rule), so the password is scanned for and
found in the images too, the refusal naming the variable.
(The probes in the environment of the session snapshot, which must publish cleanly, are
checked in test_e2e_main.py.)
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest
from tests.conftest import isolated_env, listening, shm_leaked, shm_names, tiny_profile, warmctl

from warmctl.store import chunk_key

pytestmark = pytest.mark.e2e

TOKEN = "site-log-token-4f9b2e7c1a6d3085"
MIRROR_PASSWORD = "s3cretPassw0rd-e2e-7d41"


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
    cfg.write_text(cfg.read_text() + 'engine_env_passthrough = ["VLLM_LOGGING_CONFIG_PATH", "HF_ENDPOINT"]\n')
    env.update(SITE_LOG_TOKEN_FILE=str(token_file), VLLM_LOGGING_CONFIG_PATH=str(logging_cfg),
               HF_ENDPOINT=f"https://ci-bot:{MIRROR_PASSWORD}@hf-mirror.internal")
    command = json.loads(warmctl("profile", "command", "tiny", "--json", env=env).stdout)
    assert command["from_environment"]["VLLM_LOGGING_CONFIG_PATH"] == "passthrough"
    assert command["from_environment"]["HF_ENDPOINT"] == "passthrough" and MIRROR_PASSWORD not in json.dumps(command)
    assert "SITE_LOG_TOKEN_FILE" not in command["from_environment"]

    shm0 = shm_names()
    r = warmctl("snapshot", "tiny", env=env, check=False, timeout=1500)
    out = r.stdout + r.stderr
    assert r.returncode == 37, out  # SecretInSnapshot
    assert re.search(rf"the file {re.escape(str(token_file))} named by environment variable SITE_LOG_TOKEN_FILE: "
                     r"found in image file pages-\d+\.img", out), out
    assert re.search(r"a password in a URL \(scheme://user:password@host\) \(rule url-userinfo\) in environment "
                     r"variable HF_ENDPOINT: found in image file pages-\d+\.img", out), out
    assert "nothing was stored or pushed" in out and TOKEN not in out and MIRROR_PASSWORD not in out
    # nothing stored: no chunk, no manifest, no catalog entry; nothing running, nothing in /dev/shm
    store = tmp_path / "home" / "store"
    stored = [p.relative_to(store) for p in store.rglob("*") if p.is_file()] if store.exists() else []
    assert not [p for p in stored if p.parts[0] in ("chunks", "manifests", "catalog")], stored
    assert json.loads(warmctl("ls", "--json", env=env).stdout) == []
    assert json.loads(warmctl("status", "--json", env=env).stdout) == []
    assert not listening(engine_ports[0])
    assert not (left := shm_leaked(shm0)), f"a refused snapshot left {left} in /dev/shm"
    assert not (tmp_path / "home" / "run" / "tiny" / "images").exists()


def _image_samples(store_dir: Path, digest: str, n: int = 4) -> list[bytes]:
    """``n`` 48-byte pieces of the snapshot's page images (non-zero, varied bytes), each from
    another chunk: what a remote holding plaintext pages would show."""
    from warmctl.store import open_store

    store = open_store(store_dir)
    m = store.get_manifest(digest)
    refs = sorted((c for f in m.files if f.role == "image" and f.path.startswith("pages-") for c in f.chunks
                   if (store_dir / chunk_key(c.digest)).is_file()), key=lambda c: -c.size)
    out = []
    for c in refs:
        data = store.load_chunk(c)
        for off in range(len(data) // 3, len(data) - 48, 4096):
            piece = data[off:off + 48]
            if len(set(piece)) > 24:
                out.append(piece)
                break
        if len(out) == n:
            return out
    raise AssertionError(f"fewer than {n} varied pieces in the images of {digest}")


def test_a_sealed_snapshot_travels_between_two_homes_and_serves(tiny_snapshot, wc_env, engine_ports, tmp_path):
    """A (the session's home) pushes the real engine's snapshot to a sealed directory remote:
    no object there holds a piece of the page images; B, sharing A's fleet key and trusting A's
    signing key, restores it and serves; C, with another fleet key, is refused naming both key
    ids, before anything is restored."""
    from tests.test_e2e_fleet import _answers, node

    k1, k2 = tmp_path / "fleet.key", tmp_path / "other.key"
    for k in (k1, k2):
        k.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
        k.chmod(0o600)
    remote = tmp_path / "remote"
    a = dict(wc_env, WARMCTL_SEAL_KEY=str(k1))
    warmctl("seal", str(remote), env=a)
    warmctl("push", "tiny", "--to", str(remote), env=a)
    samples = _image_samples(Path(wc_env["WARMCTL_TEST_HOME"]) / "store", tiny_snapshot["digest"])
    objects = [p for p in remote.rglob("*") if p.is_file()]
    assert len(objects) > 20
    for p in objects:
        data = p.read_bytes()
        assert not [s for s in samples if s in data], f"{p} holds plaintext of the image"
    a_pub = next(Path(wc_env["WARMCTL_CONFIG"]).parent.joinpath("keys").glob("local-*.pub"))
    b = node(tmp_path / "b", engine_ports, trust=[a_pub], WARMCTL_REMOTE_STORE=str(remote), WARMCTL_SEAL_KEY=str(k1))
    try:
        r = warmctl("up", "tiny", "--json", "--cold-start", "never", env=b)
        res = json.loads(r.stdout)
        assert res["source"] == "restore" and res["snapshot"] == tiny_snapshot["digest"], r.stderr
        assert res["fetched"]["remote"] > 2**20
        assert _answers(engine_ports[1]).strip()
    finally:
        warmctl("down", "tiny", env=b, check=False)
    c = node(tmp_path / "c", engine_ports, trust=[a_pub], WARMCTL_REMOTE_STORE=str(remote), WARMCTL_SEAL_KEY=str(k2))
    r = warmctl("up", "tiny", "--cold-start", "never", env=c, check=False)
    assert r.returncode == 38, r.stdout + r.stderr  # SealKeyError
    from warmctl.store.sealed import key_id, load_key

    assert key_id(load_key(k1)) in r.stderr and key_id(load_key(k2)) in r.stderr
    assert not listening(engine_ports[1]) and json.loads(warmctl("status", "--json", env=c).stdout) == []
