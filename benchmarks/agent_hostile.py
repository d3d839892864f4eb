"""The agent under hostile clients, measured on the real agent (``python -m warmctl
agent`` on a private home, loopback port from the kernel), for one or more checkouts side by
side::

    python benchmarks/agent_hostile.py [CHECKOUT ...]     # default: this checkout

Prints, per checkout: the answer to a 10 MB ``POST`` without a token and how much of the body
the client had sent when it came (bytes the kernel's socket buffers took, not the agent), the
agent's RSS before/after; ``/healthz`` latency (10 samples, 30 s timeout) while an engine whose
``/health`` never answers is polled by 60 clients; how many of 50 slow-header clients (a
header line every 2 s) the agent closed within ~60 s. Leaves nothing behind (its ``sleep``
processes, the home, the agent).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

TOKEN = "measure-token-0123456789"


def measure(code: str) -> None:
    """Start the agent of checkout ``code`` on a private home and print the three numbers."""
    home = tempfile.mkdtemp(prefix="agent-measure-")
    os.makedirs(f"{home}/agent", mode=0o700)
    open(f"{home}/agent/token", "w").write(TOKEN + "\n"); os.chmod(f"{home}/agent/token", 0o600)
    open(f"{home}/config.toml", "w").write(f'home = "{home}"\nkeys_dir = "{home}/keys"\n')
    # a hung engine
    hung = socket.socket(); hung.bind(("127.0.0.1", 0)); hung.listen(512); hport = hung.getsockname()[1]
    held = []
    def acc():
        while True:
            try: c, _ = hung.accept(); held.append(c)
            except OSError: return
    threading.Thread(target=acc, daemon=True).start()
    eng = subprocess.Popen(["sleep", "600"]); gate = subprocess.Popen(["sleep", "600"])
    time.sleep(0.2)
    os.makedirs(f"{home}/run/hung")
    st = {"name": "hung", "phase": "serving", "source": "restore", "root_pid": eng.pid, "root_ctime": psutil.Process(eng.pid).create_time(),
          "gate_pid": gate.pid, "gate_ctime": psutil.Process(gate.pid).create_time(), "internal_port": hport, "public_host": "127.0.0.1",
          "public_port": 2, "served_model_name": "hung", "log_path": f"{home}/run/hung/engine.log", "started_at": time.time()}
    open(f"{home}/run/hung/state.json", "w").write(json.dumps(st))
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_")} | {"WARMCTL_CONFIG": f"{home}/config.toml", "PYTHONPATH": code}
    agent = subprocess.Popen([sys.executable, "-m", "warmctl", "agent", "--port", str(port)], env=env, cwd=code, stdout=open(f"{home}/log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200: break
        except httpx.TransportError: pass
        time.sleep(0.1)
    P = psutil.Process(agent.pid)
    try:
        # 1. 10 MB body without a token
        rss0 = P.memory_info().rss
        s = socket.create_connection(("127.0.0.1", port)); s.settimeout(20)
        size = 10 * 2**20
        s.sendall(f"POST /v1/engines/tiny/up HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
        sent = 0; t0 = time.monotonic(); status = b""
        chunk = b"[" + b"1," * 32767 + b"1"
        try:
            s.setblocking(False)
            while sent < size:
                try:
                    d = s.recv(4096)
                    if d: status = d.split(b"\r\n")[0]; break
                except BlockingIOError: pass
                try: sent += s.send(chunk[: min(len(chunk), size - sent)])
                except BlockingIOError: time.sleep(0.001)
            s.setblocking(True)
            if not status: status = s.recv(4096).split(b"\r\n")[0]
        except OSError as e:
            status = status or repr(e).encode()
        s.close()
        time.sleep(0.5)
        print(f"10 MB body, no token: answer {status.decode()!r} after the client sent {sent/2**20:.2f} MiB of {size/2**20:.0f}; agent RSS {rss0/2**20:.0f} -> {P.memory_info().rss/2**20:.0f} MiB (peak over the call not sampled)", flush=True)
        # 2. hung engine + 60 pollers: healthz latency
        stop = threading.Event()
        def poll():
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
                while not stop.is_set():
                    try: c.get("/v1/engines")
                    except httpx.HTTPError: pass
        ts = [threading.Thread(target=poll, daemon=True) for _ in range(60)]
        for t in ts: t.start()
        time.sleep(3)
        lat = []
        for _ in range(10):
            t0 = time.monotonic()
            try:
                httpx.get(url + "/healthz", timeout=30); lat.append(time.monotonic() - t0)
            except httpx.HTTPError: lat.append(float("inf"))
            time.sleep(0.3)
        stop.set()
        print(f"/healthz with a hung engine /health and 60 pollers: {len([x for x in lat if x < 30])}/10 answered within 30 s; median {sorted(lat)[5]*1000:.0f} ms, max {max(lat)*1000:.0f} ms", flush=True)
        time.sleep(3)
        # 3. slow-header clients
        conns = []
        for _ in range(50):
            c = socket.create_connection(("127.0.0.1", port)); c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n"); conns.append(c)
        closed_at = {}
        t0 = time.monotonic(); n = 0
        while time.monotonic() - t0 < 62 and len(closed_at) < 50:
            n += 1
            for i, c in enumerate(conns):
                if i in closed_at: continue
                try:
                    c.sendall(f"X-{n}: 1\r\n".encode()); c.settimeout(0.01)
                    if c.recv(1) == b"": closed_at[i] = time.monotonic() - t0
                except socket.timeout: pass
                except OSError: closed_at[i] = time.monotonic() - t0
            time.sleep(2)
        for c in conns: c.close()
        el = time.monotonic() - t0
        print(f"50 slow-header clients (a header line every 2 s): {len(closed_at)} closed by the agent within {el:.0f} s" + (f", the last after {max(closed_at.values()):.1f} s" if closed_at else ""), flush=True)
    finally:
        agent.terminate(); agent.wait(20)
        eng.kill(); gate.kill(); eng.wait(); gate.wait(); hung.close()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    for code in sys.argv[1:] or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]:
        print(f"== {code}", flush=True)
        measure(code)
