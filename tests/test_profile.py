"""Profiles: the shipped ones validate; a malformed one is refused with file, field and expectation."""

from pathlib import Path

import pytest

from warmctl.records.profile import PROFILES_DIR, ProfileError, load_profile, load_profile_file


@pytest.mark.parametrize("path", sorted(PROFILES_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_profiles_validate(path):
    p = load_profile_file(path)
    assert p.name == path.stem
    assert p.canary.prompts and p.warmup.cells()


def test_digest_ignores_comments_and_order(tmp_path):
    src = (PROFILES_DIR / "tiny.toml").read_text()
    a = tmp_path / "a.toml"
    a.write_text(src)
    b = tmp_path / "b.toml"
    b.write_text("# another comment\n" + src)
    assert load_profile_file(a).digest() == load_profile_file(b).digest()
    c = tmp_path / "c.toml"
    c.write_text(src.replace("max_tokens = 16", "max_tokens = 17"))
    assert load_profile_file(c).digest() != load_profile_file(a).digest()


def test_malformed_profile_names_file_and_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((PROFILES_DIR / "tiny.toml").read_text().replace(
        "prompt_tokens = [16, 128, 512]", "prompt_tokens = [16, -1]"))
    with pytest.raises(ProfileError) as e:
        load_profile_file(bad)
    msg = str(e.value)
    assert str(bad) in msg and "warmup.prompt_tokens" in msg and "positive" in msg


def test_unknown_field_and_wrong_type(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((PROFILES_DIR / "tiny.toml").read_text().replace("port = 8000", 'port = "eight"\ncolour = "red"'))
    msg = str(pytest.raises(ProfileError, load_profile_file, bad).value)
    assert "gate.port" in msg and "gate.colour" in msg and "eight" in msg


def test_weights_outside_image_with_sleep_level_1_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((PROFILES_DIR / "tiny.toml").read_text() + "\n[checkpoint]\nsleep_level = 1\nweights_outside_image = true\n")
    msg = str(pytest.raises(ProfileError, load_profile_file, bad).value)
    assert str(bad) in msg and "checkpoint" in msg and "level 1 offloads the weights to host RAM" in msg


def test_not_toml_and_missing(tmp_path):
    bad = tmp_path / "x.toml"
    bad.write_text("name = [unclosed\n")
    assert "not valid TOML" in str(pytest.raises(ProfileError, load_profile_file, bad).value)
    assert "no profile named 'nope'" in str(pytest.raises(ProfileError, load_profile, "nope").value)
    assert "no such profile file" in str(pytest.raises(ProfileError, load_profile_file, Path(tmp_path / "z.toml")).value)


def test_cli_reports_bad_profile(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "tiny.toml"
    bad.write_text((PROFILES_DIR / "tiny.toml").read_text().replace("max_tokens = 16", "max_tokens = 0"))
    r = subprocess.run([sys.executable, "-m", "warmctl", "snapshot", str(bad)], capture_output=True, text=True)
    assert r.returncode == 15  # ProfileError
    assert "canary.max_tokens" in r.stderr and "greater than 0" in r.stderr


def test_weights_outside_image_adds_the_worker_extension(tmp_path):
    from warmctl.engine.sleep import WORKER_EXTENSION
    from warmctl.engine.vllm import vllm_command

    plain = load_profile("tiny")
    assert "--worker-extension-cls" not in vllm_command(plain, "/m")
    wx = plain.model_copy(update={"checkpoint": plain.checkpoint.model_copy(update={"weights_outside_image": True})})
    cmd = vllm_command(wx, "/m")
    assert cmd[cmd.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    # the named class is importable the way vLLM resolves it (module path + attribute)
    mod, _, attr = WORKER_EXTENSION.rpartition(".")
    assert hasattr(__import__(mod, fromlist=[attr]), attr)


def _moe(tmp_path, args: str, hardware: str = "[hardware]\ngpu_count = 0\n") -> Path:
    """The shipped tiny-moe-tp2 profile with ``args`` as its engine.args and ``hardware``."""
    text = (PROFILES_DIR / "tiny-moe-tp2.toml").read_text()
    text = text.replace('args = ["--seed", "0", "--tensor-parallel-size", "2"]', f"args = {args}")
    f = tmp_path / "moe.toml"
    f.write_text(text.replace("[hardware]\ngpu_count = 0\n", hardware))
    return f


@pytest.mark.parametrize("flag", ['"--enable-expert-parallel"', '"-ep"', '"--enable-expert-parallel=true"'])
def test_expert_parallel_on_the_cpu_build_is_refused_naming_the_crash_and_the_alternative(tmp_path, flag):
    """The CPU build's ranks die of SIGSEGV in its MoE kernel at the first request with expert
    parallel (docs/design.md): the profile is refused at load, so `profile check`, `snapshot` and
    `up` stop before any engine starts, naming the flag, the build, the crash and TP2 without EP."""
    bad = _moe(tmp_path, f'["--seed", "0", "--tensor-parallel-size", "2", {flag}]')
    msg = str(pytest.raises(ProfileError, load_profile_file, bad).value)
    assert msg.startswith(f"{bad}: engine.args: --enable-expert-parallel does not run on the CPU build of vLLM")
    assert "SIGSEGV" in msg and "cpu_fused_moe.cpp" in msg and "expert map" in msg
    assert "at TP2 without expert parallel" in msg and "profiles/tiny-moe-tp2.toml" in msg
    assert "(got" not in msg and msg.count("\n") == 0  # one sentence, not pydantic's dump of the input
    # Turned off explicitly, or on a GPU host (the ling31-flash profiles: TP8 + EP8), it stands.
    assert load_profile_file(_moe(tmp_path, '["--tensor-parallel-size", "2", "--enable-expert-parallel=false"]'))
    gpu = load_profile_file(_moe(tmp_path, f'["--tensor-parallel-size", "2", {flag}]',
                                 '[hardware]\ngpu_count = 2\ngpu_model = "NVIDIA H200"\n'))
    assert gpu.hardware.gpu_count == 2


@pytest.mark.parametrize("name", ["ling31-flash", "ling31-flash-mtp", "ling31-flash-mi355x", "ling31-flash-mi355x-mtp"])
def test_the_shipped_gpu_profiles_keep_expert_parallel(name):
    p = load_profile(name)
    assert "--enable-expert-parallel" in p.engine.args and p.hardware.gpu_count == 8
