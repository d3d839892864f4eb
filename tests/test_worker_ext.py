"""The weights worker extension on plain torch modules (no engine): file format, determinism,
release and in-place load, and the errors. The same class runs inside the real vLLM engine in
``tests/test_e2e_weights.py``; here a minimal worker stands in for vLLM's ``Worker`` (it only
provides ``get_model()`` and ``rank``, the two things the extension uses)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from warmctl.engine.worker_ext import WeightsExtension, rank_file, write_safetensors


class Worker(WeightsExtension):
    def __init__(self, model: torch.nn.Module, rank: int = 0):
        self.model, self.rank = model, rank

    def get_model(self) -> torch.nn.Module:
        return self.model


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
    m[1].weight.data = m[1].weight.data.to(torch.bfloat16)  # mixed dtypes, as quantised layers have
    m.register_buffer("rope", torch.arange(8.0))  # buffers stay in the image
    m.gone = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # a weight vLLM removed
    return m


def snapshot_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_file_is_safetensors_in_name_order_without_empty_params(tmp_path):
    w = Worker(model(), rank=3)
    res = w.warmctl_save_weights(str(tmp_path))
    path = rank_file(tmp_path, 3)
    assert res["path"] == str(path) and res["rank"] == 3 and res["tensors"] == 5
    assert res["bytes"] == sum(p.numel() * p.element_size() for p in w.model.parameters())
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == sorted(["0.weight", "1.weight", "1.bias", "2.weight", "2.bias"])
        assert f.metadata() == {"format": "pt", "warmctl": "weights/1", "rank": "3"}
        for name, p in w.model.named_parameters():
            if p.numel():
                assert torch.equal(f.get_tensor(name), p.detach())
    assert not list(tmp_path.glob("*.tmp"))


def test_same_weights_give_identical_bytes(tmp_path):
    """Determinism is what lets two snapshots of one model share every weights chunk."""
    Worker(model(0)).warmctl_save_weights(str(tmp_path / "a"))
    Worker(model(0)).warmctl_save_weights(str(tmp_path / "b"))
    Worker(model(1)).warmctl_save_weights(str(tmp_path / "c"))
    a, b, c = (rank_file(tmp_path / d, 0).read_bytes() for d in "abc")
    assert a == b and a != c


def test_release_then_load_restores_every_parameter_in_place(tmp_path):
    w = Worker(model())
    before = snapshot_of(w.model)
    ids = {n: id(p) for n, p in w.model.named_parameters()}
    w.warmctl_save_weights(str(tmp_path))
    rel = w.warmctl_release_weights()
    assert rel["bytes"] == sum(t.numel() * t.element_size() for t in before.values())
    for name, p in w.model.named_parameters():
        assert p.untyped_storage().nbytes() == 0, name
    assert torch.equal(w.model.rope, torch.arange(8.0))  # buffers untouched
    res = w.warmctl_load_weights(str(tmp_path))
    assert res["bytes"] == rel["bytes"]
    for name, p in w.model.named_parameters():
        assert id(p) == ids[name] and p.dtype == before[name].dtype
        assert torch.equal(p.detach(), before[name]), name
    x = torch.tensor([1, 2, 3])
    assert torch.equal(w.model[0](x), model()[0](x))  # usable again


def test_load_refuses_a_file_of_another_layout(tmp_path):
    Worker(model()).warmctl_save_weights(str(tmp_path))
    other = model()
    other[1] = torch.nn.Linear(16, 33)
    with pytest.raises(RuntimeError, match=r"rank 0: 1\.bias in .*rank-0\.safetensors is F32 \(32,\), the engine has F32 \(33,\)"):
        Worker(other).warmctl_load_weights(str(tmp_path))
    fewer = model()
    del fewer[2]
    with pytest.raises(RuntimeError, match=r"does not match the engine's parameters \(missing \[\], unexpected \['2\.bias', '2\.weight'\]\)"):
        Worker(fewer).warmctl_load_weights(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"rank 1: weights file .*rank-1\.safetensors does not exist"):
        Worker(model(), rank=1).warmctl_load_weights(str(tmp_path))


def test_writer_takes_non_contiguous_tensors_and_refuses_unknown_dtypes(tmp_path):
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    write_safetensors(tmp_path / "x.safetensors", [("t", t)], {})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("t"), t)
    with pytest.raises(ValueError, match="complex64 has no safetensors name"):
        write_safetensors(tmp_path / "y.safetensors", [("c", torch.zeros(2, dtype=torch.complex64))], {})


def test_load_names_a_truncated_or_malformed_file(tmp_path):
    Worker(model()).warmctl_save_weights(str(tmp_path))
    path = rank_file(tmp_path, 0)
    full = path.read_bytes()
    path.write_bytes(full[:-10])
    with pytest.raises(RuntimeError, match=r"rank-0\.safetensors: 2\.weight lies outside the file"):
        Worker(model()).warmctl_load_weights(str(tmp_path))
    path.write_bytes(full[:8] + b"{not json" + full[17:])
    with pytest.raises(RuntimeError, match="malformed safetensors header"):
        Worker(model()).warmctl_load_weights(str(tmp_path))
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(RuntimeError, match="is not a safetensors file"):
        Worker(model()).warmctl_load_weights(str(tmp_path))


def test_load_puts_non_contiguous_parameters_back_through_their_strides(tmp_path):
    """A parameter that is a strided view (transposed, or a slice with a storage offset) has no
    flat view (``.view(-1)`` raises); the load copies into its strides, in place."""
    torch.manual_seed(1)
    m = torch.nn.Module()
    m.t = torch.nn.Parameter(torch.randn(8, 4).t(), requires_grad=False)  # shape (4, 8), strides (1, 4)
    m.s = torch.nn.Parameter(torch.randn(10, 6)[2:, ::2], requires_grad=False)  # offset 12, strides (6, 2)
    m.c = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    assert not m.t.is_contiguous() and not m.s.is_contiguous() and m.s.storage_offset() == 12
    before = snapshot_of(m)
    layout = {n: (p.stride(), p.storage_offset()) for n, p in m.named_parameters()}
    w = Worker(m)
    w.warmctl_save_weights(str(tmp_path))
    w.warmctl_release_weights()
    assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())
    res = w.warmctl_load_weights(str(tmp_path))
    assert res["bytes"] == sum(t.numel() * t.element_size() for t in before.values())
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n
        assert (p.stride(), p.storage_offset()) == layout[n], n
    # Over live weights (as after vLLM's sleep level 2, which keeps the addresses): zeroed,
    # then loaded at the same addresses.
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    for p in m.parameters():
        p.data.zero_()
    w.warmctl_load_weights(str(tmp_path))
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) and p.data_ptr() == ptrs[n], n


def test_save_refuses_weights_held_outside_the_parameters(tmp_path):
    """A linear layer whose weight vLLM's CPU GEMM dispatch moved into a packed copy (parameter
    emptied, ``cpu_linear`` computing), and a large weight tensor kept as a plain attribute:
    saving writes nothing and says why (an attention layer's ``kv_cache`` attribute does not count) (the real oneDNN case: tests/test_e2e_weights.py)."""
    m = model()
    assert Worker(m).warmctl_save_weights(str(tmp_path / "ok"))["tensors"] == 5  # the plain model saves
    lin = m[1]
    packed = lin.weight.detach().clone()
    lin.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
    lin.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    m[2]._unpacked_weight = torch.zeros(1 << 19, dtype=torch.float32)  # 2 MiB, not a parameter or buffer
    m[0].kv_cache = torch.zeros(1 << 20, dtype=torch.float32)  # state, not weights: stays in the image
    res = Worker(m, rank=1).warmctl_save_weights(str(tmp_path / "no"))
    assert "path" not in res and not (tmp_path / "no").exists()
    assert res["outside"] == ["1: weight packed by vLLM's CPU GEMM dispatch, parameter emptied",
                              "2._unpacked_weight: a 2.0 MiB tensor held as an attribute"]
    assert res["refused"].startswith("weights_outside_image refused: 2 module(s) of rank 1")
    assert "weights_outside_image = false" in res["refused"]
