"""The random-weight Llama family (``warmctl/models/randmodel.py``): sizes as asked, weights from the seed.

No engine: a 2x256 instance is built (about 3 MB, a second) and read back with safetensors.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from warmctl.models import builtinmodels, randmodel

REPO = Path(__file__).resolve().parent.parent


def test_names_parse_to_llama_shapes():
    s = randmodel.parse("builtin:random-llama-32x4096-bf16")
    assert (s.layers, s.hidden, s.heads, s.intermediate, s.dtype) == (32, 4096, 32, 11008, "bfloat16")  # Llama-2-7B's
    # Llama-2-7B has 6.74 B parameters with its 32000-token vocabulary; ours has 1024 tokens
    assert s.params() == 6_738_415_616 - 2 * (32000 - 1024) * 4096 and s.weight_bytes() == 2 * s.params()
    f32 = randmodel.parse("builtin:random-llama-16x4096")
    assert f32.dtype == "float32" and f32.weight_bytes() == 4 * f32.params()
    assert randmodel.parse("builtin:tiny") is None and randmodel.parse("builtin:random-llama-2x4096x") is None
    with pytest.raises(ValueError, match="multiple of 128"):
        randmodel.parse("builtin:random-llama-2x1000")


@pytest.mark.parametrize("name, gib", [("scale-8g", 8), ("scale-16g", 16)])
def test_benchmark_profiles_are_the_engine_memory_they_say(name, gib):
    """Weights + KV cache of the benchmark profiles and of their weights-outside variants within
    10% of their nominal size, in bfloat16 (what vLLM serves a float32 checkpoint as)."""
    for variant, dtype in (("", "bfloat16"), ("-wout", "bfloat16")):
        p = tomllib.loads((REPO / "benchmarks" / "profiles" / f"{name}{variant}.toml").read_text())
        shape = randmodel.parse(p["engine"]["model"])
        total = shape.weight_bytes() + int(p["engine"]["env"]["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
        assert shape.dtype == dtype and abs(total / 2**30 - gib) / gib < 0.10, (variant, total / 2**30)
        assert p.get("checkpoint", {}).get("weights_outside_image", False) == (variant == "-wout")


@pytest.mark.parametrize("suffix", ["", "-bf16"])
def test_build_is_deterministic_and_cached_by_recipe(tmp_path, suffix):
    import torch
    from safetensors import safe_open

    name = "builtin:random-llama-2x256" + suffix
    shape = randmodel.parse(name)
    d = builtinmodels.build_builtin(name, tmp_path)
    assert d == randmodel.model_dir(tmp_path, shape) and d.name.startswith(f"random-llama-2x256{suffix}-")
    for other in ("builtin:random-llama-3x256", "builtin:random-llama-2x384", "builtin:random-llama-2x256" + ("" if suffix else "-bf16")):
        assert randmodel.model_dir(tmp_path, randmodel.parse(other)) != d  # the recipe names it
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (2, 256, 768)
    assert cfg.get("torch_dtype", cfg.get("dtype")) == shape.dtype
    f = d / "model.safetensors"
    assert shape.weight_bytes() < f.stat().st_size < shape.weight_bytes() + 64 * 1024
    with safe_open(str(f), "pt") as st:
        assert sorted(st.keys()) == sorted(n for n, _ in shape.tensors())
        w = st.get_tensor("model.layers.1.mlp.down_proj.weight")
        norm = st.get_tensor("model.norm.weight").float()
    assert tuple(w.shape) == (256, 768) and bool(w.isfinite().all()) and w.dtype == getattr(torch, shape.dtype)
    w = w.float()
    assert 0.02 < float(w.std()) < 0.035 and abs(float(w.mean())) < 0.002  # symmetric, bounded draw
    assert float(w.abs().max()) < 0.0625 and bool((norm == 1).all())
    # the same recipe gives the same bytes, whatever the chunk size; another tensor differs
    again = tmp_path / "again.safetensors"
    randmodel.write_weights(again, shape, chunk_elems=1000)
    assert again.read_bytes() == f.read_bytes()
    mtime = f.stat().st_mtime_ns
    assert builtinmodels.build_builtin(name, tmp_path) == d and f.stat().st_mtime_ns == mtime  # reused
