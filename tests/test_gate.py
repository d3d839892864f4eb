"""The gate, with real sockets: a real uvicorn upstream (streaming), the real gate process."""

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from warmctl import gate
from warmctl.base.errors import HostError
from tests.ports import free_port


@pytest.fixture(scope="module")
def upstream():
    app = FastAPI()

    @app.get("/v1/responses/{x}")  # a template route of the allow list
    def echo(x: str):
        return {"x": x}

    @app.get("/v1/completions")
    def stream():
        def gen():
            for i in range(5):
                yield f"data: {i}\n\n"
                time.sleep(0.05)
        return StreamingResponse(gen(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    t.join(5)


def test_relays_requests_and_streams(upstream, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    port = free_port()
    pid = gate.start("127.0.0.1", port, upstream, sleeper.pid, tmp_path / "gate.log")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
            assert c.get("/v1/responses/abc").json() == {"x": "abc"}
            with c.stream("GET", "/v1/completions") as r:
                arrivals = [time.monotonic() for _ in r.iter_lines() if _]
        assert len(arrivals) == 5
        assert arrivals[-1] - arrivals[0] > 0.15  # streamed, not buffered
        # the gate closes when the engine is gone
        sleeper.kill()
        sleeper.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and gate.port_free("127.0.0.1", port) is False:
            time.sleep(0.1)
        assert gate.port_free("127.0.0.1", port)
    finally:
        subprocess.run(["kill", str(pid)], check=False)
        sleeper.kill()


def test_port_taken_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(HostError) as e:
            gate.require_port_free("127.0.0.1", port, "public port")
        assert f"public port 127.0.0.1:{port} is already in use" in str(e.value)
        assert f"pid {__import__('os').getpid()}" in str(e.value)
        with pytest.raises(HostError, match="could not open"):
            gate.start("127.0.0.1", port, 1, 1, tmp_path / "g.log")


def test_upstream_down_gives_502(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    port = free_port()
    pid = gate.start("127.0.0.1", port, free_port(), sleeper.pid, tmp_path / "gate.log")
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 502
    finally:
        subprocess.run(["kill", str(pid)], check=False)
        sleeper.kill()


def test_prestarted_gate_listens_only_once_opened(upstream, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    port = free_port()
    pending = gate.prestart("127.0.0.1", port, upstream, tmp_path / "gate.log")
    try:
        time.sleep(1.0)  # time enough to have started listening, were it going to
        assert pending.proc.poll() is None and gate.port_free("127.0.0.1", port)
        pid = pending.open(sleeper.pid)
        assert pid == pending.pid and not gate.port_free("127.0.0.1", port)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/responses/abc").json() == {"x": "abc"}
        sleeper.kill()  # it follows the engine PID it was given at open
        sleeper.wait()
        pending.proc.wait(timeout=5)
        assert gate.port_free("127.0.0.1", port)
    finally:
        pending.proc.kill()
        sleeper.kill()


def test_prestarted_gate_cancelled_never_listens(tmp_path):
    port = free_port()
    pending = gate.prestart("127.0.0.1", port, 1, tmp_path / "gate.log")
    pending.cancel()
    assert pending.proc.returncode == 0 and gate.port_free("127.0.0.1", port)


def test_prestarted_gate_port_taken_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        pending = gate.prestart("127.0.0.1", s.getsockname()[1], 1, tmp_path / "g.log")
        with pytest.raises(HostError, match="could not open"):
            pending.open(os.getpid())
        assert pending.proc.poll() is not None
