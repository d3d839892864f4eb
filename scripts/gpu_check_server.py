"""A small CUDA PyTorch server for scripts/gpu-check.sh: greedy generation by a tiny recurrent
model whose decode step is a captured CUDA graph.

    POST /generate {"prompt": [token ids], "n": tokens}  ->
         {"tokens": [...], "logits_sha256": hex of every step's float32 logits, "served": k}
    GET  /health -> "ok"

Weights come from a fixed seed, so two fresh servers answer alike; ``served`` counts requests in
a GPU tensor, so a restored server continues the count of the one that was snapshotted (GPU
memory survived). Usage: python gpu_check_server.py PORT
"""

import hashlib
import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch

V, H = 1024, 1024
dev = torch.device("cuda")
g = torch.Generator(device="cpu").manual_seed(1234)
emb = (torch.randn(V, H, generator=g) * 0.05).to(dev)
w1 = (torch.randn(H, 4 * H, generator=g) / H**0.5).to(dev)
w2 = (torch.randn(4 * H, H, generator=g) / (4 * H) ** 0.5).to(dev)
wo = (torch.randn(H, V, generator=g) / H**0.5).to(dev)
ballast = torch.ones(256 * 2**20 // 4, device=dev)  # 256 MiB of GPU memory to checkpoint
served = torch.zeros(1, dtype=torch.int64, device=dev)

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
            digest.update(logits_out.float().cpu().numpy().tobytes())
            nxt = int(logits_out.argmax(dim=-1).item())
            out.append(nxt)
    served.add_(1)
    return {"tokens": out, "logits_sha256": digest.hexdigest(), "served": int(served.item())}


class Handler(BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, "ok")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(200, generate([int(t) % V for t in req["prompt"]], int(req["n"])))

    def log_message(self, *a):
        pass


HTTPServer.allow_reuse_address = True
srv = HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print("serving", flush=True)
srv.serve_forever()
