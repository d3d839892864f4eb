"""The shipped GPU profiles validate and carry what a tensor-parallel CUDA restore needs."""

from __future__ import annotations

import json

import pytest

from warmctl.records.profile import PROFILES_DIR, load_profile_file

TP_RESTORE_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_CUMEM_HOST_ENABLE": "0",
}


def _flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


@pytest.mark.parametrize("name", ["ling31-flash", "ling31-flash-mtp", "ling30-flash-fp4-h200x2"])
def test_gpu_profiles_validate_with_restore_defaults(name):
    p = load_profile_file(PROFILES_DIR / f"{name}.toml")
    assert p.name == name
    assert p.checkpoint.cuda is True
    assert p.hardware.gpu_count > 1 and p.hardware.min_driver == "580"
    for k, v in TP_RESTORE_ENV.items():
        assert p.engine.env.get(k) == v, k
    assert "--disable-custom-all-reduce" in p.engine.args
    assert _flag(p.engine.args, "--tensor-parallel-size") == str(p.hardware.gpu_count)
    # Every warm-up request fits the context.
    assert max(p.warmup.prompt_tokens) + max(p.warmup.output_tokens) <= p.engine.max_model_len


@pytest.mark.parametrize("name", ["ling31-flash", "ling31-flash-mtp"])
def test_ling31_flash_carries_the_seed_flags(name):
    p = load_profile_file(PROFILES_DIR / f"{name}.toml")
    a = p.engine.args
    assert p.hardware.gpu_model == "NVIDIA B200" and p.hardware.gpu_count == 8
    assert _flag(a, "--tensor-parallel-size") == "8" and "--enable-expert-parallel" in a
    for f in ("--trust-remote-code", "--enable-chunked-prefill", "--enable-prefix-caching", "--enable-auto-tool-choice"):
        assert f in a
    assert _flag(a, "--tool-call-parser") == "ling3" and _flag(a, "--reasoning-parser") == "ling3"
    assert json.loads(_flag(a, "--compilation-config")) == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert _flag(a, "--gpu-memory-utilization") == "0.9"
    assert int(_flag(a, "--kv-cache-memory-bytes")) == 64 * 2**30
    assert _flag(a, "--max-num-seqs") == "64" and _flag(a, "--mamba-cache-mode") == "align"
    # Seed 000 section 04: a long prefill (>= 32K) is in the warm-up grid.
    assert max(p.warmup.prompt_tokens) >= 32768 and 8192 in p.warmup.prompt_tokens
    # Sleep mode needs its flag and the dev endpoints.
    assert p.checkpoint.sleep_level == 2 and "--enable-sleep-mode" in a
    assert p.engine.env["VLLM_SERVER_DEV_MODE"] == "1"
    spec = "--speculative-config" in a
    assert spec == name.endswith("-mtp")
    if spec:
        assert json.loads(_flag(a, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 3}


def test_the_mtp_line_is_offered_commented_in_the_base_profile():
    text = (PROFILES_DIR / "ling31-flash.toml").read_text()
    assert '# "--speculative-config", \'{"method":"mtp","num_speculative_tokens":3}\'' in text


def test_ling30_h200x2_is_the_seed_003_launch_command():
    p = load_profile_file(PROFILES_DIR / "ling30-flash-fp4-h200x2.toml")
    a = p.engine.args
    assert p.engine.model == "inclusionAI/Ling-3.0-flash-fp4" and p.engine.served_model_name == "ling"
    assert p.engine.max_model_len == 262144
    assert p.hardware.gpu_model == "NVIDIA H200 NVL" and p.hardware.gpu_count == 2
    assert _flag(a, "--gpu-memory-utilization") == "0.872320"
    assert _flag(a, "--mamba-cache-mode") == "align"
    assert _flag(a, "--tool-call-parser") == "ling3" and _flag(a, "--reasoning-parser") == "ling3"
    assert "--trust-remote-code" in a and "--enable-auto-tool-choice" in a
    # Host, port and API key are warmctl's, not the engine's.
    assert "--host" not in a and "--port" not in a and "--api-key" not in a
