"""The JSON-over-HTTP base of the GPU check's and the benchmark's small servers
(scripts/gpu_check_server.py, scripts/gpu_bench_holder.py): standard library only."""

import json
from http.server import BaseHTTPRequestHandler, HTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    """``send(code, body)``: a str as is, anything else as JSON; one request per connection;
    ``body()``: the request's JSON (``{}`` when empty). Nothing is logged."""

    def send(self, code: int, body: object) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")

    def log_message(self, *a):
        pass


def serve(port: int, handler: type[JsonHandler], banner: str = "serving") -> None:
    """Serve ``handler`` on 127.0.0.1:``port`` until killed, after printing ``banner``."""
    HTTPServer.allow_reuse_address = True
    srv = HTTPServer(("127.0.0.1", port), handler)
    print(banner, flush=True)
    srv.serve_forever()
