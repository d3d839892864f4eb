"""A stand-in for a GPU engine's HTTP front, for measuring what a relay in front of it costs
(``gate_overhead.py --upstream paced``): it answers like vLLM's OpenAI server but spends no
CPU on tokens, so on a small host the relay's cost is not hidden behind the CPU the real
(CPU-build) engine needs. Not a model: every token is the same text.

Timing is that of a batching engine: a streaming completion gets its first token ``ttft_ms``
after its request ends, then joins the running batch; every ``itl_ms`` one decode step sends
the next token to every stream in the batch at once (so a relay sees bursts of as many chunks
as there are streams, as in front of a real engine). ``ttft_ms`` and ``itl_ms`` come with each
request, in a body field ``"paced": {"ttft_ms": .., "itl_ms": ..}`` (defaults: seed 003's H200
decode at 8 concurrent requests, 8K context: TTFT 166 ms, 8.5 ms between tokens); a relay
passes bodies through untouched.

Routes: ``GET /health`` (200, empty), ``GET /v1/models``, ``POST /v1/completions`` (with
``"stream": true``: SSE chunks in chunked transfer encoding, then ``data: [DONE]``, like vLLM;
otherwise one JSON response after TTFT + (max_tokens - 1) steps). HTTP/1.1 keep-alive; closes a
connection idle for 5 s, like vLLM's server.

Usage: ``python benchmarks/paced_engine.py --port PORT`` (prints ``ready`` once listening;
SIGTERM/SIGINT stop it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

DEFAULT_TTFT_MS, DEFAULT_ITL_MS = 166.0, 8.5  # seed 003: sustained decode, 8K context, 8 at once
IDLE_S = 5.0


class Batch:
    """The streams decoding at one step interval: one task ticks every ``itl_s`` (on an
    absolute schedule, so steps do not drift) and writes each stream's next token."""

    def __init__(self, itl_s: float):
        self.itl_s = itl_s
        self.streams: list[list] = []  # [writer, tokens left, done future, model]
        self.task: asyncio.Task | None = None

    def join(self, writer, left: int, model: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.streams.append([writer, left, fut, model])
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        return fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        nxt = loop.time() + self.itl_s
        while self.streams:
            await asyncio.sleep(max(0.0, nxt - loop.time()))
            nxt += self.itl_s
            keep = []
            for s in self.streams:
                writer, left, fut, model = s
                try:
                    writer.write(_chunk(_event(model)))
                    if left == 1:
                        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                        fut.set_result(None)
                        continue
                except (ConnectionError, RuntimeError) as e:
                    fut.set_exception(ConnectionError(str(e)))
                    continue
                s[1] = left - 1
                keep.append(s)
            self.streams = keep


BATCHES: dict[float, Batch] = {}


def _event(model: str) -> bytes:
    body = {"id": "cmpl-paced", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


async def _completion(req: dict, writer) -> None:
    paced = req.get("paced") or {}
    ttft_s = float(paced.get("ttft_ms", DEFAULT_TTFT_MS)) / 1e3
    itl_s = float(paced.get("itl_ms", DEFAULT_ITL_MS)) / 1e3
    n = max(1, int(req.get("max_tokens") or 16))
    model = str(req.get("model") or "paced")
    if not req.get("stream"):
        await asyncio.sleep(ttft_s + (n - 1) * itl_s)
        body = {"id": "cmpl-paced", "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}],
                "usage": {"completion_tokens": n}}
        writer.write(_response("200 OK", json.dumps(body).encode()))
        return
    await asyncio.sleep(ttft_s)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                 b"transfer-encoding: chunked\r\n\r\n" + _chunk(_event(model)))
    if n == 1:
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return
    batch = BATCHES.setdefault(itl_s, Batch(itl_s))
    await batch.join(writer, n - 1, model)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                break
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v.strip())
            body = await reader.readexactly(length) if length else b""
            if method == "GET" and path == "/health":
                writer.write(_response("200 OK", b""))
            elif method == "GET" and path == "/v1/models":
                writer.write(_response("200 OK", b'{"object":"list","data":[{"id":"paced","object":"model"}]}'))
            elif method == "POST" and path == "/v1/completions":
                await _completion(json.loads(body or b"{}"), writer)
            else:
                writer.write(_response("404 Not Found", b'{"detail":"Not Found"}'))
            await writer.drain()
    except (ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True, backlog=1024)
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    try:
        import uvloop
        uvloop.run(serve(a.port))
    except ImportError:
        asyncio.run(serve(a.port))


if __name__ == "__main__":
    main()
