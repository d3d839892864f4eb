"""Credentials kept out of snapshots, without an engine: the name rule, the engine's
declared environment, every secret warmctl can know, and the scan on real CRIU images of a
small process that holds a secret in its environment. The engine's end-to-end side (a probe in
`snapshot`'s environment, a token the engine reads at start-up) is in test_e2e_secrets.py and
test_e2e_main.py."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from warmctl.records import credentials
from warmctl.checkpoint import criu
from warmctl.records.config import Settings
from warmctl.records.credentials import Secret, SecretInSnapshot, credential_name, known_secrets, scan_file, scan_files
from warmctl.engine.vllm import BASE_ENV, engine_environment
from warmctl.records.profile import PROFILES_DIR, load_profile_file

PROBE = "probe-2c9e41b7a6d05f38"


@pytest.mark.parametrize(("name", "is_cred"), [
    ("HF_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True), ("AWS_ACCESS_KEY_ID", True), ("AWS_SESSION_TOKEN", True),
    ("VLLM_API_KEY", True), ("--api-key", True), ("--hf-token", True), ("--ssl-keyfile", True), ("DB_PASSWORD", True),
    ("GOOGLE_APPLICATION_CREDENTIALS", True), ("hf_token", True), ("HF_TOKEN_PATH", True),
    # counts of text tokens and sets are no credentials (real vLLM knobs and flags)
    ("VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD", False), ("--long-prefill-token-threshold", False),
    ("--max-tokens", False), ("--tokenizer", False), ("VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE", False),
    ("PATH", False), ("KEYBOARD", False), ("NCCL_P2P_DISABLE", False),
])
def test_credential_name_rule(name, is_cred):
    assert credential_name(name) is is_cred


def test_every_shipped_profile_is_free_of_credentials():
    for f in sorted(PROFILES_DIR.glob("*.toml")):
        load_profile_file(f)  # raises ProfileError on a credential


def test_engine_environment_is_declared_not_inherited():
    prof = load_profile_file(PROFILES_DIR / "tiny.toml")
    environ = {"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C", "OPENBLAS_CORETYPE": "Haswell",
               "OMP_NUM_THREADS": "2", "AWS_SECRET_ACCESS_KEY": PROBE, "HF_TOKEN": PROBE, "OMP_SECRET_KEY": PROBE,
               "HTTPS_PROXY": "http://proxy:3128", "NCCL_SOCKET_IFNAME": "eth0", "RANDOM_SETTING": "x",
               "VLLM_TARGET_DEVICE": "gpu"}
    e = engine_environment(prof, [], environ)
    assert set(e.values) == {"PATH", "HOME", "LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OMP_NUM_THREADS",
                             "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONUNBUFFERED", "VLLM_TARGET_DEVICE",
                             "VLLM_CPU_KVCACHE_SPACE"}
    assert PROBE not in e.values.values()  # a credential-looking name never comes from the base list
    assert e.values["VLLM_TARGET_DEVICE"] == "cpu" and e.sources["VLLM_TARGET_DEVICE"] == "profile"  # profile wins
    assert e.sources["PATH"] == "base" and e.sources["PYTHONUNBUFFERED"] == "warmctl"
    p = engine_environment(prof, ["HTTPS_PROXY", "NCCL_*", "HF_TOKEN"], environ)
    assert p.sources["HTTPS_PROXY"] == p.sources["NCCL_SOCKET_IFNAME"] == p.sources["HF_TOKEN"] == "passthrough"
    assert "RANDOM_SETTING" not in p.values and "AWS_SECRET_ACCESS_KEY" not in p.values
    assert "PATH" in BASE_ENV and "LC_*" in BASE_ENV


def _settings(tmp_path: Path, **kw) -> Settings:
    return Settings(home=tmp_path / "home", keys_dir=tmp_path / "keys", **kw)


def test_known_secrets_names_every_source_never_printing_a_value(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("# the gate's keys\ngate-key-0123456789\nshort\n")
    tls = tmp_path / "tls.key"
    subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(tls)], check=True)
    agent = tmp_path / "home" / "agent" / "token"
    agent.parent.mkdir(parents=True)
    agent.write_text("agent-token-abcdefgh\n")
    hf = tmp_path / "hf-token"
    hf.write_text("hf_tokenvalue12345\n")
    site = tmp_path / "site-token"
    site.write_text("[default]\naws_secret_access_key = sitefile-secret-123\n")
    env = {"HF_TOKEN_PATH": str(hf), "AWS_SECRET_ACCESS_KEY": PROBE, "DB_PASSWORD": "pw", "PATH": "/usr/bin",
           "SITE_CREDENTIALS_FILE": str(site), "HOME": str(tmp_path)}
    k = known_secrets(_settings(tmp_path, gate_api_key_file=keys, gate_tls_key=tls), env)
    by_source = {s.source: s.value for s in k.secrets}
    assert by_source["environment variable AWS_SECRET_ACCESS_KEY"] == PROBE.encode()
    assert by_source[f"an API key of the gate's key file {keys}"] == b"gate-key-0123456789"
    assert by_source[f"the agent's token file {agent}"] == b"agent-token-abcdefgh"
    assert by_source[f"the Hugging Face token file {hf}"] == b"hf_tokenvalue12345"
    assert b"sitefile-secret-123" in {s.value for s in k.secrets if str(site) in s.source}
    assert sum(str(tls) in s.source for s in k.secrets) == 2  # the PEM's first line, the key's middle
    assert k.short == 2  # "short" and "pw": under 8 bytes, counted, not scanned for
    assert "/usr/bin" not in {s.value.decode(errors="replace") for s in k.secrets}
    assert PROBE not in repr(k.secrets)  # a Secret's repr never shows its value


def test_s3_credentials_boto3_resolves_are_known_for_an_s3_store(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(v, raising=False)
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = AKIAFILEKEY000001\naws_secret_access_key = file-secret-000000001\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))  # not a variable warmctl reads itself
    env = {k: v for k, v in os.environ.items() if not credentials.credential_name(k)}
    local = known_secrets(_settings(tmp_path), env)
    assert not any(s.source.startswith("S3 credential") for s in local.secrets)  # no S3 store configured
    s3 = known_secrets(_settings(tmp_path, remote_store="s3://fleet/warmctl"), env)
    vals = {s.source: s.value for s in s3.secrets}
    assert vals["S3 credential (secret key) boto3 resolved for the store"] == b"file-secret-000000001"
    pushed = known_secrets(_settings(tmp_path), env, store_urls=["s3://other/x"])
    assert any(s.value == b"file-secret-000000001" for s in pushed.secrets)


def test_scan_finds_each_secret_across_window_edges(tmp_path, monkeypatch):
    monkeypatch.setattr(credentials, "WINDOW", 4096)
    f = tmp_path / "pages-1.img"
    data = bytearray(os.urandom(3 * 4096))
    a, b = Secret("A", b"secret-aaaaaaaa"), Secret("B", b"secret-bbbbbbbb")
    data[4090:4090 + 15] = a.value  # straddles the first window's end
    data[-15:] = b.value  # the very last bytes
    f.write_bytes(bytes(data))
    found = {x.secret.source: x.offset for x in scan_file(f, [a, b, Secret("C", b"never-there-123")], "image file pages-1.img")}
    assert found == {"A": 4090, "B": len(data) - 15}
    assert scan_file(tmp_path / "pages-1.img", []) == []
    (tmp_path / "empty").write_bytes(b"")
    assert scan_files([(tmp_path / "empty", "empty")], [a]) == ([], 0)


def test_refusal_names_source_and_file_never_the_value():
    f = credentials.Finding(Secret("environment variable HF_TOKEN", PROBE.encode()), "image file pages-3.img", 123)
    with pytest.raises(SecretInSnapshot) as e:
        credentials.refuse_if_found([f], "snapshot tiny")
    msg = str(e.value)
    assert "environment variable HF_TOKEN: found in image file pages-3.img" in msg and "nothing was stored" in msg
    assert PROBE not in msg and e.value.exit_code == 37
    credentials.refuse_if_found([], "snapshot tiny")  # nothing found: nothing raised


@pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")
def test_scan_finds_an_environment_secret_in_real_criu_images(tmp_path):
    """What the issue saw: a process started with the whole environment holds a credential in
    its memory, CRIU writes it into the page images, and the scan finds it there; a process
    started with the declared environment does not."""
    def dump(env: dict[str, str], img: Path) -> None:
        log = open(tmp_path / "out.log", "ab")
        p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "sh", "-c", "trap 'exit 0' TERM; while :; do sleep 0.1; done"],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env)
        for _ in range(100):
            if kids := psutil.Process(p.pid).children():
                break
            time.sleep(0.05)
        criu.dump(kids[0].pid, img)
        p.wait(10)

    prof = load_profile_file(PROFILES_DIR / "tiny.toml")
    environ = {**os.environ, "AWS_SECRET_ACCESS_KEY": PROBE}
    secrets = known_secrets(_settings(tmp_path), environ).secrets
    dump(environ, tmp_path / "inherited")
    files = [(p, f"image file {p.name}") for p in sorted((tmp_path / "inherited").iterdir()) if p.is_file()]
    found, nbytes = scan_files(files, secrets)
    hits = [x for x in found if x.secret.source == "environment variable AWS_SECRET_ACCESS_KEY"]
    assert hits and all(x.where.startswith("image file pages-") for x in hits), found
    assert nbytes == sum(p.stat().st_size for p, _ in files) > 0
    dump(engine_environment(prof, [], environ).values, tmp_path / "declared")
    files = [(p, p.name) for p in sorted((tmp_path / "declared").iterdir()) if p.is_file()]
    assert not [x for x in scan_files(files, secrets)[0] if x.secret.value == PROBE.encode()]


def test_parallel_scan_finds_secrets_across_part_edges(tmp_path, monkeypatch):
    """Parts scanned by worker processes: a secret straddling two parts is found once, at its
    offset, and a secret in two files is named in each."""
    monkeypatch.setattr(credentials, "PART", 1 << 20)
    a, b = Secret("A", b"secret-aaaaaaaa"), Secret("B", b"secret-bbbbbbbb")
    f1, f2 = tmp_path / "pages-1.img", tmp_path / "pages-2.img"
    d1 = bytearray(os.urandom(3 << 20))
    d1[(1 << 20) - 7:(1 << 20) + 8] = a.value  # across the first part edge
    d1[(2 << 20) + 5:(2 << 20) + 20] = b.value
    f1.write_bytes(bytes(d1))
    d2 = bytearray(os.urandom(1 << 19))
    d2[100:115] = a.value
    f2.write_bytes(bytes(d2))
    found, n = scan_files([(f1, "image file pages-1.img"), (f2, "image file pages-2.img")], [a, b], workers=2)
    assert n == (3 << 20) + (1 << 19)
    assert sorted((x.where, x.secret.source, x.offset) for x in found) == [
        ("image file pages-1.img", "A", (1 << 20) - 7), ("image file pages-1.img", "B", (2 << 20) + 5),
        ("image file pages-2.img", "A", 100)]


# --- credentials inside values: the shape rules ------------------------------------------------

_B64_USERPASS = base64.b64encode(b"ci-bot:s3cretPassw0rd").decode()
_PEM = ("-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgq0vJ3cF1g0m8dV2d\n"
        "hR6c2a0s9bX0Yq4a3uE2sLk7PfWhRANCAAQm9z1Q0y2VQ0m2m4N7bqJXWk1nqU0g\n-----END PRIVATE KEY-----\n")


@pytest.mark.parametrize(("value", "rule", "part"), [
    ("https://ci-bot:s3cretPassw0rd@hf-mirror.internal", "url-userinfo", "s3cretPassw0rd"),
    ("s3://ci-bot:s3cretPassw0rd@bucket/models", "url-userinfo", "ci-bot:s3cretPassw0rd"),
    ("redis://:s3cretPassw0rd@cache:6379/0", "url-userinfo", "s3cretPassw0rd"),
    ("Authorization: Bearer eyJraWQiOiJhYmMiLCJhbGciOiJIUzI1NiJ9xyz", "authorization", None),
    ("--header=Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0", "authorization", "9f8e7d6c5b4a39281706f5e4d3c2b1a0"),
    (f"Basic {_B64_USERPASS}", "basic-auth", "ci-bot:s3cretPassw0rd"),
    (_PEM, "private-key", None),
    (_PEM.replace("\n", "\\n"), "private-key", None),  # as a JSON string holds it
    ("AKIAZ7Q3XUPW4JH2KD6F", "aws-access-key", "AKIAZ7Q3XUPW4JH2KD6F"),
    ("hf_" + "kQzTbWnPxRyLmVcJdHsGfAeUoIi" + "qwertyu", "huggingface-token", None),
    ("ghp_" + "Ab3De6Gh9Jk2Mn5Pq8St1Vw4Yz7Bc0Ef3Hi6", "github-token", None),
    ("glpat-" + "x3Yz9Qw2Er5Ty8Ui1Op4", "gitlab-token", None),
    ("dckr_pat_" + "Zq8Wx7Ec6Rv5Tb4Yn3Um2Ik1Ol0P", "registry-token", None),
])
def test_a_credential_inside_a_value_is_recognised_by_its_shape(value, rule, part):
    hits = {h.rule.name: h for h in credentials.find_shapes(value)}
    assert rule in hits, hits
    assert hits[rule].parts  # something to scan for
    if part:
        assert part in hits[rule].parts
    assert value not in repr(hits[rule])  # a hit's repr never shows a part


@pytest.mark.parametrize("value", [
    "https://hf-mirror.internal", "https://huggingface.co/api/models?a=1&b=2", "git@github.com:org/repo.git",
    "meta-llama/Llama-3.1-8B-Instruct", "sha256:" + "ab12" * 16, "/var/lib/warmctl/models/tiny", "0.872320",
    "basic tokenizer settings", "0-3|4-7", '{"max_loras": 2}', "user@example.com",
])
def test_ordinary_values_match_no_shape_rule(value):
    assert credentials.find_shapes(value) == []


def test_detect_secrets_expressions_read_from_source_equal_the_imported_plugins():
    """The shape rules take detect-secrets' expressions from the plugins' source files (importing
    a plugin imports ``requests``); they are the very expressions the imported plugins hold."""
    import importlib

    for name, _what, module, cls, _parts in credentials._DETECT_SECRETS_RULES:
        read = credentials.plugin_denylist(module, cls)
        assert read is not None, f"{name}: detect_secrets.plugins.{module}.{cls}.denylist not read from its source"
        imported = getattr(importlib.import_module(f"detect_secrets.plugins.{module}"), cls).denylist
        assert [(x.pattern, x.flags) for x in read] == [(x.pattern, x.flags) for x in imported], name
    rules = {r.name: r for r in credentials.shape_rules()}
    assert [p.pattern for p in rules["url-userinfo"].patterns][1:] == list(credentials._EXTRA_PATTERNS["url-userinfo"])


def test_loading_a_profile_checks_shapes_without_importing_detect_secrets_or_requests(tmp_path):
    """Every profile load (``up``'s included) runs the shape rules; it imports neither the
    detect_secrets package nor ``requests`` (70-90 ms of CPU), and still refuses a credential
    inside a value."""
    bad = tmp_path / "mirror.toml"
    bad.write_text((PROFILES_DIR / "tiny.toml").read_text().replace(
        'HF_HUB_OFFLINE = "1"', 'HF_HUB_OFFLINE = "1"\nHF_ENDPOINT = "https://ci-bot:s3cretPassw0rd@mirror.internal"'))
    code = ("import sys\n"
            "from warmctl.records.profile import CredentialInProfile, load_profile_file\n"
            f"load_profile_file({str(PROFILES_DIR / 'tiny.toml')!r})\n"
            "try:\n"
            f"    load_profile_file({str(bad)!r})\n"
            "    print('accepted')\n"
            "except CredentialInProfile as e:\n"
            "    print('refused', 'url-userinfo' in str(e))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('detect_secrets', 'requests', 'urllib3')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(credentials.__file__).parent.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["refused True", "[]"], r.stdout


def test_known_secrets_adds_the_secret_part_of_shaped_values_and_of_the_files_variables_name(tmp_path):
    """A passed-through variable holding a URL with a password, a file a ``*_FILE`` variable
    names holding a bearer token, and a file the profile's ``*_PATH`` variable names holding a
    Hugging Face token: each secret part is known, with the variable's name as its source."""
    site = tmp_path / "site.conf"
    site.write_text("header = Authorization: Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0\n")
    logging_cfg = tmp_path / "logging.json"
    logging_cfg.write_text('{"handlers": {"h": {"token": "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"}}}')
    env = {"HF_ENDPOINT": "https://ci-bot:s3cretPassw0rd@hf-mirror.internal", "SITE_HEADERS_FILE": str(site),
           "PATH": "/usr/bin", "HOME": str(tmp_path)}
    k = known_secrets(_settings(tmp_path), env, profile_env={"VLLM_LOGGING_CONFIG_PATH": str(logging_cfg)})
    by_value = {s.value: s.source for s in k.secrets}
    assert by_value[b"s3cretPassw0rd"] == ("a password in a URL (scheme://user:password@host) (rule url-userinfo) "
                                           "in environment variable HF_ENDPOINT")
    assert b"https://ci-bot:s3cretPassw0rd@hf-mirror.internal" not in by_value  # the part, not the whole URL
    assert f"the file {site} named by environment variable SITE_HEADERS_FILE" in by_value[
        b"9f8e7d6c5b4a39281706f5e4d3c2b1a0"]
    assert by_value[b"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"].endswith(
        f"the file {logging_cfg} named by the profile's engine.env.VLLM_LOGGING_CONFIG_PATH")
    assert "s3cretPassw0rd" not in repr(k)


@pytest.mark.parametrize("engine", ["hyperscan", "bytes.find"])
def test_the_scan_finds_64_secrets_in_one_pass_across_window_and_part_edges(tmp_path, monkeypatch, engine):
    """64 secrets, some split across two windows (the stream's reads) and one across two parts
    (worker processes), found once each at their offsets, by the one-pass matcher and by the
    fallback."""
    if engine == "hyperscan":
        assert credentials.scan_engine() == "hyperscan"  # installed with warmctl on x86-64
    else:
        monkeypatch.setattr(credentials, "scan_engine", lambda: "bytes.find")
    monkeypatch.setattr(credentials, "WINDOW", 4096)
    secrets = [Secret(f"s{i}", os.urandom(10 + i % 11).hex().encode()) for i in range(64)]
    f = tmp_path / "pages-1.img"
    data = bytearray(os.urandom(64 * 4096))
    where = {0: 4096 - 5, 1: 2 * 4096 - 1, 7: 17 * 4096 - 20, 63: len(data) - len(secrets[63].value)}
    for i, at in where.items():
        data[at:at + len(secrets[i].value)] = secrets[i].value
    f.write_bytes(bytes(data))
    found = {x.secret.source: x.offset for x in scan_file(f, secrets)}
    assert found == {f"s{i}": at for i, at in where.items()}
    monkeypatch.setattr(credentials, "PART", 16 * 4096)
    parts, n = scan_files([(f, "pages-1.img")], secrets, workers=1)
    assert n == len(data) and {x.secret.source: x.offset for x in parts} == found
    half = 16 * 4096 - 9  # across the first part's end: found by that part only
    data[half:half + len(secrets[5].value)] = secrets[5].value
    f.write_bytes(bytes(data))
    parts, _ = scan_files([(f, "pages-1.img")], secrets, workers=1)
    assert [x.offset for x in parts if x.secret.source == "s5"] == [half]
