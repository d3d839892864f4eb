"""A small CUDA PyTorch server for scripts/gpu-check.sh: greedy generation by a tiny recurrent
model whose decode step is a captured CUDA graph.

    POST /generate {"prompt": [token ids], "n": tokens}  ->
         {"tokens": [...], "logits_sha256": hex of every step's float32 logits, "served": k}
    POST /weights {"op": "save" | "zero" | "load", "dir": path}  -> the worker method's result
    GET  /health -> "ok"

``/weights`` runs warmctl's vLLM worker extension (:mod:`warmctl.engine.worker_ext`) on this
server's weights: ``save`` writes them, ``zero`` clears them in place (what vLLM's sleep level 2
does to the contents while keeping the addresses the CUDA graph uses), ``load`` copies them
back in place.

Weights come from a fixed seed, so two fresh servers answer alike; ``served`` counts requests in
a GPU tensor, so a restored server continues the count of the one that was snapshotted (GPU
memory survived). Usage: python gpu_check_server.py PORT
"""

import ctypes
import hashlib
import sys

import torch
from json_http import JsonHandler, serve  # scripts/json_http.py, beside this file

from warmctl.engine.worker_ext import WeightsExtension

V, H = 1024, 1024
dev = torch.device("cuda")
g = torch.Generator(device="cpu").manual_seed(1234)
emb = (torch.randn(V, H, generator=g) * 0.05).to(dev)
w1 = (torch.randn(H, 4 * H, generator=g) / H**0.5).to(dev)
w2 = (torch.randn(4 * H, H, generator=g) / (4 * H) ** 0.5).to(dev)
wo = (torch.randn(H, V, generator=g) / H**0.5).to(dev)
ballast = torch.ones(256 * 2**20 // 4, device=dev)  # 256 MiB of GPU memory to checkpoint
served = torch.zeros(1, dtype=torch.int64, device=dev)

model = torch.nn.Module()  # the weights as parameters sharing the tensors' storage (no copy)
for _name, _t in (("emb", emb), ("w1", w1), ("w2", w2), ("wo", wo)):
    model.register_parameter(_name, torch.nn.Parameter(_t, requires_grad=False))


class Worker(WeightsExtension):
    rank = 0

    def get_model(self):
        return model


def weights_op(op: str, directory: str) -> dict:
    w = Worker()
    if op == "save":
        return w.warmctl_save_weights(directory)
    if op == "load":
        return w.warmctl_load_weights(directory)
    if op == "zero":
        for p in model.parameters():
            p.data.zero_()
        torch.cuda.synchronize()
        return {"zeroed": sum(p.numel() * p.element_size() for p in model.parameters())}
    raise ValueError(f"unknown weights op {op!r}")

tok = torch.zeros(1, dtype=torch.long, device=dev)
h_in = torch.zeros(1, H, device=dev)


def step(t, h):
    x = emb[t] + h
    h2 = torch.tanh(torch.relu(x @ w1) @ w2)
    return h2 @ wo, h2


s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        step(tok, h_in)
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    logits_out, h_out = step(tok, h_in)
torch.cuda.synchronize()


def generate(prompt, n):
    h_in.zero_()
    digest = hashlib.sha256()
    out = []
    nxt = None
    for i in range(len(prompt) + n - 1):
        tok.fill_(prompt[i] if i < len(prompt) else nxt)
        graph.replay()
        h_in.copy_(h_out)
        if i >= len(prompt) - 1:
            c = logits_out.float().cpu().contiguous()  # no numpy: the GPU machine may lack it
            digest.update(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()))
            nxt = int(logits_out.argmax(dim=-1).item())
            out.append(nxt)
    served.add_(1)
    return {"tokens": out, "logits_sha256": digest.hexdigest(), "served": int(served.item())}


class Handler(JsonHandler):
    def do_GET(self):
        self.send(200 if self.path == "/health" else 404, "ok")

    def do_POST(self):
        req = self.body()
        if self.path == "/weights":
            try:
                self.send(200, weights_op(req["op"], req.get("dir", "")))
            except Exception as e:  # reported to the check, which fails on it
                self.send(500, {"error": f"{type(e).__name__}: {e}"})
            return
        self.send(200, generate([int(t) % V for t in req["prompt"]], int(req["n"])))


serve(int(sys.argv[1]), Handler)
