"""Weights outside the image: save and in-place load throughput of warmctl's worker extension,
side by side with this machine's limits for the same bytes.

Builds a model-like module of ``--size-gib`` of bf16 parameters (a few large fused projections
and many small norms, like a transformer layer stack), then, per round (interleaved):

- memcpy: ``torch.Tensor.copy_`` of every parameter into a preallocated twin (the floor of any
  in-place load);
- save: ``WeightsExtension.warmctl_save_weights`` (safetensors, streamed, fsync'ed);
- plain read: the saved file read sequentially (``cat``-like, 8 MiB reads into one buffer);
- load_resident: ``WeightsExtension.warmctl_load_weights`` into parameters whose memory is
  still mapped (the file read straight into place) — what a GPU rank's host side does into its
  reused staging buffer;
- load: ``warmctl_load_weights`` after ``warmctl_release_weights`` (storage freed, re-allocated,
  so every page is faulted in again, then filled) — the CPU path of ``warmctl up``.

The page cache stays warm (the file was just written): on a GPU host the restore reads rank
files that ``materialize`` has just written, so warm is the realistic case there too. Prints
GB/s (1e9 bytes / s) per step, medians, and the ratios load/memcpy and load/plain read.

    python benchmarks/weights_reload.py --size-gib 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from warmctl.engine.worker_ext import WeightsExtension, rank_file


class Worker(WeightsExtension):
    rank = 0

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


def build(size_bytes: int, hidden: int = 4096) -> torch.nn.Module:
    """Layers of (qkv 3h x h, o h x h, gate_up 2*4h x h, down h x 4h, two norms) in bf16 until
    ``size_bytes`` is reached. Values are random (incompressible, like real weights)."""
    m = torch.nn.Module()
    per_layer = (3 + 1 + 8 + 4) * hidden * hidden * 2
    g = torch.Generator().manual_seed(0)
    for i in range(max(1, size_bytes // per_layer)):
        layer = torch.nn.Module()
        for name, shape in (("qkv", (3 * hidden, hidden)), ("o", (hidden, hidden)),
                            ("gate_up", (8 * hidden, hidden)), ("down", (hidden, 4 * hidden))):
            t = torch.empty(shape, dtype=torch.bfloat16)
            t.view(torch.int16).random_(-2**15, 2**15 - 1, generator=g)
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        for name in ("norm1", "norm2"):
            layer.register_parameter(name, torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16), requires_grad=False))
        m.add_module(f"l{i}", layer)
    return m


def plain_read(path: Path) -> float:
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the rank file goes (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = build(int(a.size_gib * 2**30))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    twins = [torch.empty_like(p) for p in model.parameters()]
    w = Worker(model)
    d = a.dir or Path(tempfile.mkdtemp(prefix="warmctl-weights-"))
    res: dict[str, list[float]] = {"memcpy": [], "save": [], "plain_read": [], "load_resident": [], "load": []}
    for r in range(a.rounds):
        t0 = time.perf_counter()
        for t, p in zip(twins, model.parameters()):
            t.copy_(p)
        res["memcpy"].append(time.perf_counter() - t0)
        res["save"].append(w.warmctl_save_weights(str(d))["seconds"])
        res["plain_read"].append(plain_read(rank_file(d, 0)))
        res["load_resident"].append(w.warmctl_load_weights(str(d))["seconds"])
        w.warmctl_release_weights()
        res["load"].append(w.warmctl_load_weights(str(d))["seconds"])
        assert all(torch.equal(t.view(torch.int16), p.view(torch.int16)) for t, p in zip(twins, model.parameters())), \
            "load changed the weights"  # bit patterns: random bf16 includes NaNs
        print(f"round {r}: " + ", ".join(f"{k} {nbytes / 1e9 / v[-1]:.2f} GB/s" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    gbps = {k: nbytes / 1e9 / v for k, v in med.items()}
    out = {"bytes": nbytes, "file_bytes": rank_file(d, 0).stat().st_size, "rounds": a.rounds,
           "median_gb_per_s": {k: round(v, 2) for k, v in gbps.items()},
           "load_over_memcpy": round(gbps["load"] / gbps["memcpy"], 2),
           "load_over_plain_read": round(gbps["load"] / gbps["plain_read"], 2),
           "load_resident_over_plain_read": round(gbps["load_resident"] / gbps["plain_read"], 2),
           "loadavg": os.getloadavg()[0]}
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    if a.dir is None:
        rank_file(d, 0).unlink()
        d.rmdir()


if __name__ == "__main__":
    main()
