"""The processes scripts/gpu_bench.py measures: the pinned copy floor, and a process holding GPU
memory (half random bytes, like weights; half zeros, like a fresh KV cache).

    python gpu_bench_holder.py floor BYTES [--device cuda]
        copies BYTES host->device and device->host through a pinned host buffer, prints one
        JSON line: {"bytes", "h2d_gb_per_s", "d2h_gb_per_s", "reps"} (GB = 1e9 bytes; each rate
        is the best of the reps, i.e. the hardware's floor for the copy time)
    python gpu_bench_holder.py serve PORT BYTES [--device cuda] [--weights-max BYTES] [--seed N]
        allocates BYTES (rounded down to 16 bytes) on the device, fills the first half from a
        seeded generator and zeroes the rest, then serves on 127.0.0.1:PORT:
        GET  /health  -> "ok" once filled
        POST /info    -> {"weights_bytes", "kv_bytes", "reload_bytes", "fill_s", "digest"}
        POST /digest  -> {"digest": {"weights": int, "kv_nonzero": int}, "seconds"}
        POST /weights {"op": "save" | "zero" | "load", "dir": path} -> the worker method's result

The random half is held in chunks of at most 1 GiB; the first chunks, up to ``--weights-max``
bytes, are the parameters of a module that warmctl's vLLM worker extension
(:mod:`warmctl.engine.worker_ext`) saves and loads back in place, the path `warmctl up` takes
with ``weights_outside_image``. ``zero`` clears them in place (addresses kept, as vLLM's sleep
level 2 does). The digest (a position-weighted int64 sum of the random half, computed on the
device, and the count of non-zero bytes in the other half) shows whether the bytes survived a
reload or a checkpoint and restore. ``--device cpu`` holds host memory instead (the CPU
machine's tests). Imports only torch, the standard library and the worker extension.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from json_http import JsonHandler, serve  # scripts/json_http.py, beside this file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from warmctl.engine.worker_ext import WeightsExtension  # noqa: E402

CHUNK = 1 << 30
MASK64 = (1 << 64) - 1


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def floor(nbytes: int, device: str, reps: int = 3) -> dict:
    """Best-of-``reps`` copy rates between a pinned host buffer and a device buffer of
    ``nbytes`` (after one warm-up copy each way). With ``device == "cpu"`` both buffers are in
    host memory (a memcpy rate, no GPU)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(7)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        return time.perf_counter() - t0

    timed(dev, host), timed(host, dev)
    h2d = [timed(dev, host) for _ in range(reps)]
    d2h = [timed(host, dev) for _ in range(reps)]
    return {"bytes": nbytes, "reps": reps, "device": device, "pinned": device == "cuda",
            "h2d_gb_per_s": round(nbytes / 1e9 / min(h2d), 2), "d2h_gb_per_s": round(nbytes / 1e9 / min(d2h), 2),
            "h2d_s": [round(x, 4) for x in h2d], "d2h_s": [round(x, 4) for x in d2h]}


class Holder:
    """``nbytes`` on ``device``: ``weights`` (random chunks) and ``kv`` (zeros); ``model``'s
    parameters are the first weights chunks, up to ``weights_max`` bytes."""

    def __init__(self, nbytes: int, device: str, weights_max: int, seed: int = 1234):
        nbytes -= nbytes % 16
        half = nbytes // 2
        t0 = time.monotonic()
        g = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        self.weights: list[torch.Tensor] = []
        for start in range(0, half, CHUNK):
            c = torch.empty(min(CHUNK, half - start), dtype=torch.uint8, device=device)
            c.random_(generator=g)
            self.weights.append(c)
        self.kv = torch.zeros(nbytes - half, dtype=torch.uint8, device=device)
        self.model = torch.nn.Module()
        reload = 0
        for i, c in enumerate(self.weights):
            if reload + c.numel() > weights_max:
                break
            self.model.register_parameter(f"w{i:04d}", torch.nn.Parameter(c, requires_grad=False))
            reload += c.numel()
        sync(device)
        self.fill_s = time.monotonic() - t0
        self.info = {"weights_bytes": half, "kv_bytes": nbytes - half, "reload_bytes": reload,
                     "fill_s": round(self.fill_s, 3), "device": device, "digest": self.digest()}

    def digest(self) -> dict:
        total = 0
        for i, c in enumerate(self.weights):  # chunk sizes are multiples of 8: an int64 view
            total = (total + (i + 1) * (int(c.view(torch.int64).sum()) & MASK64)) & MASK64
        # counted per GiB: count_nonzero of the whole tensor takes a temporary four to eight
        # times its size (it asked for 128 GiB on a 32 GiB holder, H200, torch 2.11)
        flat = self.kv.view(-1)
        step = CHUNK // flat.element_size()
        kv_nonzero = sum(int(torch.count_nonzero(flat[i:i + step])) for i in range(0, flat.numel(), step))
        if self.kv.is_cuda:  # the temporaries' cached blocks would be checkpointed as the holder's memory
            torch.cuda.empty_cache()
        return {"weights": total, "kv_nonzero": kv_nonzero}

    def weights_op(self, op: str, directory: str) -> dict:
        worker = _Worker(self.model)
        if op == "save":
            return worker.warmctl_save_weights(directory)
        if op == "load":
            return worker.warmctl_load_weights(directory)
        if op == "zero":
            for p in self.model.parameters():
                p.data.zero_()
            sync(self.device)
            return {"zeroed": sum(p.numel() for p in self.model.parameters())}
        raise ValueError(f"unknown weights op {op!r} (save, zero, load)")


class _Worker(WeightsExtension):
    rank = 0

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def get_model(self) -> torch.nn.Module:
        return self._model


def handler(holder: Holder) -> type[JsonHandler]:
    """The HTTP handler serving ``holder`` (module doc)."""

    class Handler(JsonHandler):
        def do_GET(self):
            self.send(200, "ok") if self.path == "/health" else self.send(404, {"error": f"no {self.path}"})

        def do_POST(self):
            req = self.body()
            try:
                if self.path == "/info":
                    self.send(200, holder.info)
                elif self.path == "/digest":
                    t0 = time.monotonic()
                    self.send(200, {"digest": holder.digest(), "seconds": time.monotonic() - t0})
                elif self.path == "/weights":
                    self.send(200, holder.weights_op(req["op"], req.get("dir", "")))
                else:
                    self.send(404, {"error": f"no {self.path}"})
            except Exception as e:  # reported to the benchmark, which fails on it
                self.send(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("floor", help="pinned host<->device copy rates")
    f.add_argument("bytes", type=int)
    s = sub.add_parser("serve", help="hold BYTES of device memory and serve the digest and weights ops")
    s.add_argument("port", type=int)
    s.add_argument("bytes", type=int)
    s.add_argument("--weights-max", type=int, default=16 << 30)
    s.add_argument("--seed", type=int, default=1234)
    for p in (f, s):
        p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
    if a.cmd == "floor":
        print(json.dumps(floor(a.bytes, a.device)), flush=True)
        return 0
    holder = Holder(a.bytes, a.device, a.weights_max, a.seed)
    serve(a.port, handler(holder), f"serving {json.dumps(holder.info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
