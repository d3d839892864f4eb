"""``warmctl profile ls|show|check|command`` through the real entry point; ``profile
diff`` and stale snapshots are in test_profile_drift.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from warmctl.records.profile import PROFILES_DIR, load_profile, load_profile_file

# Seed 003 ("Launch command" of the Ling-3.0-flash-fp4 speed-test matrix on 2 x H200 NVL), as given.
SEED_003 = ('"$HOME/env_h200-inclusionai-vllm/bin/vllm" serve inclusionAI/Ling-3.0-flash-fp4 --served-model-name ling '
            "--trust-remote-code --tensor-parallel-size 2 --reasoning-parser ling3 --enable-auto-tool-choice "
            "--tool-call-parser ling3 --max-model-len 262144 --gpu-memory-utilization 0.872320 --host 0.0.0.0 "
            "--port 8000 --api-key <redacted> --mamba-cache-mode align")


def _flags(argv: list[str]) -> tuple[str, dict[str, str | bool]]:
    """(model, {flag: value or True}) of a ``vllm serve MODEL --flag [value] ...`` argv."""
    i = argv.index("serve")
    model, rest, out = argv[i + 1], argv[i + 2:], {}
    while rest:
        f = rest.pop(0)
        assert f.startswith("--"), f
        out[f] = rest.pop(0) if rest and not rest[0].startswith("--") else True
    return model, out


def wc(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmctl", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


@pytest.fixture
def home(tmp_path):
    """A home with its own config (none), keys dir and profile dir; returns (env, root)."""
    (tmp_path / "none.toml").write_text("")
    (tmp_path / "profiles").mkdir()
    env = {**os.environ, "WARMCTL_CONFIG": str(tmp_path / "none.toml"), "WARMCTL_HOME": str(tmp_path / "home"),
           "WARMCTL_KEYS_DIR": str(tmp_path / "home" / "keys"), "WARMCTL_PROFILE_DIRS": str(tmp_path / "profiles"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for k in ("WARMCTL_STORE", "WARMCTL_REMOTE_STORE", "WARMCTL_CATALOG", "WARMCTL_AGENT_URL", "WARMCTL_SIGNING_KEY"):
        env.pop(k, None)
    return env, tmp_path


# ----------------------------------------------------------------------------- ls, show, check, command


def test_profile_ls_show_and_search_order(home):
    env, root = home
    r = wc("profile", "ls", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["search"][0] == str(root / "profiles") and doc["search"][-1] == str(PROFILES_DIR)
    by = {p["name"]: p for p in doc["profiles"]}
    assert {"tiny", "ling30-flash-fp4-h200x2"} <= by.keys()
    assert by["tiny"]["file"] == str(PROFILES_DIR / "tiny.toml") and by["tiny"]["hides"] == []
    # A configured directory comes first and hides the shipped profile of the same name.
    mine = root / "profiles" / "tiny.toml"
    mine.write_text((PROFILES_DIR / "tiny.toml").read_text().replace("concurrency = [1, 4]", "concurrency = [1, 8]"))
    r = wc("profile", "ls", env=env)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("tiny "))
    assert str(mine) in line and f"hides {PROFILES_DIR / 'tiny.toml'}" in line
    show = wc("profile", "show", "tiny", env=env)
    assert show.returncode == 0, show.stderr
    assert f"# {mine}" in show.stdout and f"# digest {load_profile_file(mine).digest()}" in show.stdout
    assert "warmup.concurrency = [1, 8]" in show.stdout
    assert "checkpoint.lock_timeout_s = 30.0" in show.stdout  # a default the file leaves out
    assert json.loads(wc("profile", "show", "tiny", "--json", env=env).stdout)["profile"]["warmup"]["concurrency"] == [1, 8]
    missing = wc("profile", "show", "nope", env=env)
    assert missing.returncode == 15 and "no profile named 'nope'" in missing.stderr  # ProfileError


def test_profile_check_validates_and_suggests_the_key(home):
    env, root = home
    bad = root / "bad.toml"
    bad.write_text((PROFILES_DIR / "tiny.toml").read_text().replace("concurrency =", "concurency =")
                   .replace("max_tokens = 16", "max_tokens = 0").replace("[gate]\n", "[gate]\nprot = 9000\n"))
    good = PROFILES_DIR / "tiny.toml"
    r = wc("profile", "check", str(good), str(bad), env=env)
    assert r.returncode == 1
    assert f"{good}: ok (tiny, {load_profile_file(good).digest()})" in r.stdout
    assert f"{bad}: warmup.concurency: Extra inputs are not permitted; did you mean 'concurrency'?" in r.stderr
    assert "canary.max_tokens: Input should be greater than 0" in r.stderr
    assert "did you mean 'port'?" in r.stderr
    js = json.loads(wc("profile", "check", "--json", str(bad), env=env).stdout)
    assert js[0]["ok"] is False and len(js[0]["errors"]) == 3
    assert wc("profile", "check", str(good), "ling30-flash-fp4-h200x2", env=env).returncode == 0
    # a key with no close match gets no guess
    far = root / "far.toml"
    far.write_text((PROFILES_DIR / "tiny.toml").read_text() + "\nzzzzzz = 1\n")
    r = wc("profile", "check", str(far), env=env)
    assert r.returncode == 1 and "zzzzzz: Extra inputs are not permitted" in r.stderr and "did you mean" not in r.stderr


def test_profile_command_is_seed_003_flag_by_flag(home):
    env, _ = home
    r = wc("profile", "command", "ling30-flash-fp4-h200x2", "--json", env=env)
    assert r.returncode == 0, r.stderr
    launch = json.loads(r.stdout)
    model, ours = _flags(launch["engine_argv"])
    seed_model, seed = _flags(shlex.split(SEED_003))
    assert model == seed_model
    differ = {f for f in ours.keys() | seed.keys() if ours.get(f) != seed.get(f)}
    # Only what warmctl owns differs: the engine binds loopback on its internal port (the gate
    # serves 0.0.0.0:8000, the profile's gate section, with the API key), and the TP restore flag.
    assert differ == {"--host", "--port", "--api-key", "--disable-custom-all-reduce"}, differ
    assert ours["--host"] == "127.0.0.1" and ours["--disable-custom-all-reduce"] is True
    p = load_profile("ling30-flash-fp4-h200x2")
    assert (p.gate.host, str(p.gate.port)) == (seed["--host"], seed["--port"])
    assert launch["env"]["NCCL_P2P_DISABLE"] == "1" and launch["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert launch["argv"][-len(launch["engine_argv"]):] == launch["engine_argv"]
    assert launch["argv"][:5] == ["unshare", "--pid", "--fork", "--mount-proc", "setsid"]
    assert launch["argv"][6:9] == ["-m", "warmctl.engine.launch", "--stdio"]
    assert launch["argv"][9].endswith("/ling30-flash-fp4-h200x2/engine.log")  # the run's engine log
    # The human form: the environment lines, then the whole command on one line (never wrapped).
    text = wc("profile", "command", "ling30-flash-fp4-h200x2", env={**env, "COLUMNS": "40"}).stdout.splitlines()
    assert "NCCL_P2P_DISABLE=1" in text and shlex.split(text[-1]) == launch["argv"]
    tiny = json.loads(wc("profile", "command", "tiny", "--json", env=env).stdout)
    assert tiny["model"].startswith(str(Path(env["WARMCTL_HOME"]) / "models" / "tiny-llama-"))
    assert not Path(tiny["model"]).exists()  # shown, not built
    # a CPU engine keeps the host's mount namespace; a CUDA one (above) has its own /proc
    assert tiny["argv"][:4] == ["unshare", "--pid", "--fork", "setsid"]


# ----------------------------------------------------------------------------- credentials

PROBE = "sk-probe-7f3a9c1e5d"


def test_profile_check_refuses_credentials_naming_each_field(home):
    """--api-key in args and a token in [engine.env] are refused by `profile check` (and so by
    every command that loads the profile), each named with where it belongs; the value is never
    printed. A vLLM knob that counts text tokens is no credential."""
    env, root = home
    bad = root / "profiles" / "creds.toml"
    text = (PROFILES_DIR / "tiny.toml").read_text().replace('name = "tiny"', 'name = "creds"')
    text = text.replace('args = ["--seed", "0"]', f'args = ["--seed", "0", "--api-key", "{PROBE}", "--hf-token={PROBE}"]')
    text = text.replace('HF_HUB_OFFLINE = "1"', f'HF_HUB_OFFLINE = "1"\nHF_TOKEN = "{PROBE}"\n'
                        'VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD = "1024"')
    bad.write_text(text)
    r = wc("profile", "check", str(bad), env=env)
    assert r.returncode == 1, r.stdout
    assert f"{bad}: engine.args.2: --api-key carries a credential" in r.stderr and "gate_api_key_file" in r.stderr
    assert f"{bad}: engine.args.4: --hf-token carries a credential" in r.stderr
    assert f"{bad}: engine.env.HF_TOKEN: HF_TOKEN names a credential" in r.stderr
    assert "engine_env_passthrough" in r.stderr  # where a start-up credential belongs
    assert "TOKEN_THRESHOLD" not in r.stderr
    assert PROBE not in r.stderr + r.stdout
    js = json.loads(wc("profile", "check", "--json", "creds", env=env).stdout)
    assert js[0]["ok"] is False and len(js[0]["errors"]) == 3 and PROBE not in json.dumps(js)
    # every command that loads it refuses it too (CredentialInProfile, exit 40), before anything starts
    r = wc("snapshot", "creds", env=env)
    assert r.returncode == 40 and "engine.args.2: --api-key" in r.stderr and PROBE not in r.stderr


URL_PASSWORD = "s3cretPassw0rd-81c4"
BEARER = "9f8e7d6c5b4a39281706f5e4d3c2b1a0"
HUB_TOKEN = "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"


def test_profile_check_snapshot_and_up_refuse_a_credential_inside_a_value(home):
    """A credential a name does not betray (a private mirror's URL with user:password@, a
    bearer header, a hub token inside a JSON flag value) is refused by its shape: each field
    named with its rule and where the credential belongs, no value in any output."""
    env, root = home
    bad = root / "profiles" / "mirror.toml"
    text = (PROFILES_DIR / "tiny.toml").read_text().replace('name = "tiny"', 'name = "mirror"')
    text = text.replace('args = ["--seed", "0"]', 'args = ["--seed", "0", "--model-loader-extra-config", '
                        f"'{{\"token\": \"{HUB_TOKEN}\"}}'" + "]")
    text = text.replace('HF_HUB_OFFLINE = "1"', 'HF_HUB_OFFLINE = "1"\n'
                        f'HF_ENDPOINT = "https://ci-bot:{URL_PASSWORD}@hf-mirror.internal"\n'
                        f'SITE_HEADERS = "Authorization: Bearer {BEARER}"')
    bad.write_text(text)
    r = wc("profile", "check", str(bad), env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"{bad}: engine.env.HF_ENDPOINT: holds a password in a URL" in r.stderr and "(rule url-userinfo)" in out
    assert "write the URL without user:password@ here" in r.stderr
    assert f"{bad}: engine.env.SITE_HEADERS: holds an Authorization header value" in r.stderr
    assert f"{bad}: engine.args.3: holds a Hugging Face token (rule huggingface-token)" in r.stderr
    assert "*_FILE variable" in r.stderr and "engine_env_passthrough" in r.stderr  # where it belongs
    assert "credential rules: names, url-userinfo, private-key, aws-access-key" in r.stdout
    js = json.loads(wc("profile", "check", "--json", "mirror", env=env).stdout)
    assert js[0]["ok"] is False and len(js[0]["errors"]) == 3
    outs = [out, json.dumps(js)]
    for cmd in (("snapshot", "mirror"), ("up", "mirror")):  # ProfileError (15) before anything starts
        r = wc(*cmd, env=env)
        assert r.returncode == 40 and "engine.env.HF_ENDPOINT: holds a password in a URL" in r.stderr, r.stderr
        outs.append(r.stdout + r.stderr)
    for secret in (URL_PASSWORD, BEARER, HUB_TOKEN):
        assert not [o for o in outs if secret in o]
    ok = wc("profile", "check", "tiny", env=env)
    assert ok.returncode == 0 and "tiny.toml: ok" in ok.stdout


def test_profile_scan_finds_credentials_older_versions_published(home):
    """A store written before the shape rules: its catalog profile record and its manifest
    hold a profile whose HF_ENDPOINT carries a password. `profile scan` names both objects,
    the snapshot's entry and the rule, never the value; a clean store scans clean."""
    from test_profile_drift import _publish_tiny

    env, root = home
    clean = wc("profile", "scan", env=env)
    assert clean.returncode == 0 and "no stored profile holds a credential" in clean.stdout, clean.stdout + clean.stderr
    import warmctl.records.credentials as credentials

    real = credentials.profile_problems
    credentials.profile_problems = lambda args, env_: []  # as an older warmctl validated it
    try:
        import warmctl.records.profile as profile_mod

        tiny = (PROFILES_DIR / "tiny.toml").read_text().replace(
            'HF_HUB_OFFLINE = "1"', f'HF_HUB_OFFLINE = "1"\nHF_ENDPOINT = "https://ci-bot:{URL_PASSWORD}@hf-mirror.internal"')
        (root / "old.toml").write_text(tiny)
        old = profile_mod.load_profile_file(root / "old.toml")
    finally:
        credentials.profile_problems = real
    d, m, _ = _publish_tiny(root, old)
    r = wc("profile", "scan", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    store = root / "home" / "store"
    assert f"{store}/catalog/tiny/profile.json: profile record of tiny: engine.env.HF_ENDPOINT: holds a password in a URL" in r.stdout
    assert f"{store}/manifests/sha256/{d.split(':')[1]}: manifest of tiny (tiny:latest): engine.env.HF_ENDPOINT" in r.stdout
    assert "(rule url-userinfo)" in r.stdout and "2 problem(s)" in r.stdout
    js = json.loads(wc("profile", "scan", "--json", "--store", str(store), env=env).stdout)
    assert {(p["kind"], p["field"]) for p in js["problems"]} == {("profile record", "engine.env.HF_ENDPOINT"),
                                                                 ("manifest", "engine.env.HF_ENDPOINT")}
    assert URL_PASSWORD not in r.stdout + r.stderr + json.dumps(js)


def test_profile_check_and_snapshot_refuse_expert_parallel_on_the_cpu_build(home):
    """`profile check` refuses a CPU profile with --enable-expert-parallel (its ranks crash in
    the CPU MoE kernel, docs/design.md), and `snapshot` stops before starting an engine (exit 15,
    no run directory, well under the ~60 s a cold start of the model takes to reach the crash)."""
    import time

    env, root = home
    ep = root / "profiles" / "moe-ep.toml"
    ep.write_text((PROFILES_DIR / "tiny-moe-tp2.toml").read_text().replace('name = "tiny-moe-tp2"', 'name = "moe-ep"')
                  .replace('"--tensor-parallel-size", "2"]', '"--tensor-parallel-size", "2", "--enable-expert-parallel"]'))
    r = wc("profile", "check", "tiny-moe-tp2", "moe-ep", env=env)
    assert r.returncode == 1
    assert "tiny-moe-tp2.toml: ok (tiny-moe-tp2," in r.stdout and "TP2: 2 ranks (Worker_TP0, Worker_TP1)" in r.stdout
    assert f"{ep}: engine.args: --enable-expert-parallel does not run on the CPU build of vLLM" in r.stderr
    assert "SIGSEGV" in r.stderr and "without expert parallel" in r.stderr
    t0 = time.monotonic()
    r = wc("snapshot", "moe-ep", env=env)
    assert r.returncode == 15 and "--enable-expert-parallel does not run on the CPU build" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20 and not (root / "home" / "run").exists()  # no engine was started
    assert "ling31-flash.toml: ok" in wc("profile", "check", "ling31-flash", env=env).stdout  # a GPU profile: EP stands


def test_profile_command_shows_the_declared_environment(home):
    """`profile command` shows what the engine gets: warmctl's and the profile's variables with
    values, those taken from this environment (base list, engine_env_passthrough) by name only;
    a credential of this environment is neither shown nor passed."""
    env, root = home
    cfg = root / "pass.toml"
    cfg.write_text('engine_env_passthrough = ["SITE_PROXY_URL", "NCCL_*"]\n')
    env = {**env, "WARMCTL_CONFIG": str(cfg), "SITE_PROXY_URL": "http://proxy.example:3128", "NCCL_SOCKET_IFNAME": "eth0",
           "AWS_SECRET_ACCESS_KEY": PROBE, "OMP_NUM_THREADS": "2", "UNRELATED_SETTING": "x"}
    launch = json.loads(wc("profile", "command", "tiny", "--json", env=env).stdout)
    assert launch["env"]["HF_HUB_OFFLINE"] == "1" and launch["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    src = launch["from_environment"]
    assert src["SITE_PROXY_URL"] == src["NCCL_SOCKET_IFNAME"] == "passthrough"
    assert src["PATH"] == src["HOME"] == src["OMP_NUM_THREADS"] == "base"
    assert "AWS_SECRET_ACCESS_KEY" not in src and "UNRELATED_SETTING" not in src
    text = wc("profile", "command", "tiny", env=env).stdout
    assert "# from this environment (engine_env_passthrough): NCCL_SOCKET_IFNAME SITE_PROXY_URL" in text
    assert "proxy.example" not in text and PROBE not in text
    cfg.write_text('engine_env_passthrough = ["*"]\n')
    r = wc("profile", "command", "tiny", env=env)
    assert r.returncode == 13 and "engine_env_passthrough" in r.stderr and "a bare '*'" in r.stderr
