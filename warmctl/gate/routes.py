"""What the public port serves: an allow list of the engine's inference routes, and the key.

The gate serves only the routes in its allow list (:data:`DEFAULT_ALLOW_PATHS`: vLLM's
OpenAI-compatible inference API, plus ``/health``; ``gate_allow_paths`` opens more, ``/metrics``
for example). Every other path gets 404 (403 for a route known to control the engine, and for
``gate_deny_paths``) and never reaches the engine, so a route a newer vLLM adds stays closed
until an operator opens it.

Paths are compared on the form the engine routes on: uvicorn's ``scope["path"]`` (the path of
``httptools.parse_url``, percent-decoded; :func:`warmctl.gate.http.request_path`), exactly, with
no case folding or dot-segment removal (Starlette does none either); a template segment
``{name}`` matches one non-empty segment without ``/`` (Starlette's ``[^/]+``). Control
characters never get this far (:mod:`warmctl.gate.http` refuses them with 400), so a
Starlette route regex ending in ``$`` cannot match more than the gate allowed.

:func:`engine_routes` reads the engine's own route table (``/openapi.json`` on its loopback
port); the gate logs, once, which routes the engine serves that stay closed.
"""

from __future__ import annotations

import hmac
import json
import posixpath
import re
from dataclasses import dataclass, field

#: vLLM's inference API (0.32's OpenAI-, Anthropic- and score/rerank-compatible routes), the
#: public port's default allow list.
DEFAULT_ALLOW_PATHS = (
    "/health", "/version",
    "/v1/models",
    "/v1/chat/completions", "/v1/completions",
    "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
    "/v1/embeddings", "/pooling", "/classify",
    "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
    "/v1/messages", "/v1/messages/count_tokens",
    "/v1/audio/transcriptions", "/v1/audio/translations",
    "/tokenize", "/detokenize",
)
#: Paths answered without a key by default.
DEFAULT_PUBLIC_PATHS = ("/health",)

#: Routes of vLLM 0.32 known to control the engine (dev mode, profiler, sleep, weight transfer,
#: LoRA loading, elastic EP, pause/resume, the disaggregated ``/inference/v1`` API). The allow
#: list keeps them closed like any other path; these (and anything below them, in any case or
#: spelling) get 403 instead of 404, and the test suite probes each.
CONTROL_PATHS = (
    "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
    "/reset_mm_cache", "/reset_encoder_cache", "/pause", "/resume", "/is_paused",
    "/abort_requests", "/release_kv_cache_memory", "/start_profile", "/stop_profile",
    "/server_info", "/get_world_size", "/kv_event_sources", "/fault_tolerance",
    "/scale_elastic_ep", "/is_scaling_elastic_ep", "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine", "/update_weights", "/start_weight_update",
    "/start_draft_weight_update", "/finish_weight_update", "/update_weight_version",
    "/weight_info", "/weight_checker", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/inference/v1/generate", "/inference/v1/abort_requests",
)

_SEGMENT = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


def _template(path: str) -> re.Pattern | None:
    """A template path (``/v1/responses/{id}``) as a regex for :meth:`re.Pattern.fullmatch`;
    None for a plain path (compared as a string)."""
    if "{" not in path:
        return None
    parts = _SEGMENT.split(path)
    return re.compile("[^/]+".join(re.escape(p) for p in parts))


def check_route_path(path: str, what: str) -> str:
    """``path`` if it can be an allow-list entry, else ValueError naming ``what``: it starts
    with ``/``, holds no control character, and its braces are whole ``{name}`` segments."""
    if not path.startswith("/") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ValueError(f"{what} {path!r}: a path starting with '/', without control characters")
    if "{" in path or "}" in path:
        if _SEGMENT.sub("", path).count("{") or _SEGMENT.sub("", path).count("}"):
            raise ValueError(f"{what} {path!r}: a template segment is '{{name}}' (letters, digits, '_')")
    return path


class Routes:
    """A set of allowed paths: plain ones (exact) and templates (``{name}``: one segment)."""

    def __init__(self, paths: tuple[str, ...] | list[str]):
        self.paths = tuple(dict.fromkeys(check_route_path(p, "allowed path") for p in paths))
        self._exact = frozenset(p for p in self.paths if "{" not in p)
        self._templates = tuple(t for p in self.paths if (t := _template(p)) is not None)

    def __contains__(self, path: str) -> bool:
        return path in self._exact or any(t.fullmatch(path) for t in self._templates)

    def covers(self, route: str) -> bool:
        """True if the engine's route ``route`` (a path or template from its route table) is
        allowed: listed as such, or a plain route one of the templates matches."""
        return route in self.paths or ("{" not in route and route in self)


def _norm(path: str) -> str:
    p = posixpath.normpath("/" + path.lstrip("/")) if path else "/"
    return p.lower()


@dataclass
class Policy:
    """What the gate lets through. ``keys``: accepted API keys (None: no key needed);
    ``allow``: the paths served (:class:`Routes`); ``public_paths``: served without a key
    (allowed too); ``deny_paths``: refused with 403 even if allowed, with everything below
    them (:data:`CONTROL_PATHS` are always among them)."""

    keys: list[bytes] | None = None
    allow: Routes = field(default_factory=lambda: Routes(DEFAULT_ALLOW_PATHS))
    public_paths: frozenset[str] = frozenset(DEFAULT_PUBLIC_PATHS)
    deny_paths: tuple[str, ...] = ()
    _deny: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._deny = tuple(_norm(p).rstrip("/") for p in (*CONTROL_PATHS, *self.deny_paths))

    def denied(self, path: str) -> bool:
        """True if ``path`` (or its normalized form: ``//``, ``.``/``..`` and case folded) is
        a control route or a denied path, or below one: answered 403 rather than 404."""
        for p in {path.lower(), _norm(path)}:
            for d in self._deny:
                if p == d or p.startswith(d + "/"):
                    return True
        return False

    def allowed(self, path: str) -> bool:
        """True if the decoded request path ``path`` is served on the public port."""
        return (path in self.allow or path in self.public_paths) and not self.denied(path)

    def key_ok(self, authorization: bytes | None) -> bool:
        """True if ``authorization`` (the header's value) is ``Bearer <one of the keys>``;
        compared with :func:`hmac.compare_digest` against every key (no early exit)."""
        if self.keys is None:
            return True
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for k in self.keys:
            ok |= hmac.compare_digest(token, k)
        return ok

    def needs_key(self, path: str) -> bool:
        """True unless ``path`` is answered without a key (:attr:`public_paths`)."""
        return path not in self.public_paths


async def engine_routes(host: str, port: int, timeout_s: float = 30.0) -> list[str]:
    """The paths (FastAPI templates) the engine at ``host:port`` lists in its ``/openapi.json``
    (read with asyncio and llhttp's response parser, so a stop of the gate cancels it). Raises
    OSError, TimeoutError, ValueError (not 200, not JSON, or no ``paths``) or httptools'
    HttpParserError."""
    import asyncio

    import httptools

    class Response:
        def __init__(self) -> None:
            self.body: list[bytes] = []
            self.done = False

        def on_body(self, b: bytes) -> None:
            self.body.append(b)

        def on_message_complete(self) -> None:
            self.done = True

    async def fetch() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(b"GET /openapi.json HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n\r\n")
            r = Response()
            parser = httptools.HttpResponseParser(r)
            while not r.done and (data := await reader.read(65536)):
                parser.feed_data(data)
            if not r.done:
                raise ValueError("the engine closed before its /openapi.json answer ended")
            if parser.get_status_code() != 200:
                raise ValueError(f"GET /openapi.json answered {parser.get_status_code()}")
            return b"".join(r.body)
        finally:
            writer.close()

    paths = json.loads(await asyncio.wait_for(fetch(), timeout_s)).get("paths")
    if not isinstance(paths, dict):
        raise ValueError("/openapi.json has no 'paths'")
    return sorted(paths)


def route_report(policy: Policy, served: list[str]) -> str:
    """One log line on the engine's route table ``served`` against ``policy``: how many of its
    routes the public port serves, and which stay closed."""
    closed = [r for r in served if not (policy.allow.covers(r) or r in policy.public_paths) or policy.denied(r)]
    open_ = len(served) - len(closed)
    line = f"gate: the engine serves {len(served)} routes; {open_} are open on the public port"
    if closed:
        line += f"; {len(closed)} stay closed (gate_allow_paths opens one): {' '.join(closed)}"
    return line
