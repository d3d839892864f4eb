"""A throwaway OCI registry on loopback (Debian's ``docker-registry``, Distribution 2.8), for
tests and benchmarks.

    from registry_server import Registry, make_ca
    from ports import free_port   # tests/ is on sys.path under pytest
    ca = make_ca(workdir)                                        # CA + a 127.0.0.1 server cert
    with Registry(workdir / "reg", free_port(), ca=ca, users={"alice": "pw"}) as reg:
        reg.host                                                 # "127.0.0.1:PORT"

Each instance: filesystem storage under ``workdir`` (kept across :meth:`Registry.stop` /
:meth:`Registry.start`, so a test can take the registry down and bring it back), deletes enabled,
htpasswd auth (bcrypt hashes made with the system's libxcrypt through ctypes: no extra package)
when ``users`` is given, TLS from ``ca`` (the certificate made by :func:`make_ca` with the
``cryptography`` package) when given, and with ``proxy`` (``(url, user, password)``) a
pull-through mirror of another registry. Its log, access log included, goes to
``workdir/registry.log`` (:meth:`Registry.access_log` parses the request lines).

The process runs in the foreground as a child of the caller, is killed by pid and reaped on
:meth:`Registry.stop` / context exit, and gets SIGKILL if the thread that started it dies
(``PR_SET_PDEATHSIG``, when started from the main thread), so an interrupted run leaves no
registry behind. A registry that exits or
does not listen within ``timeout`` raises :class:`RegistryStartError` with the tail of its log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

BINARY = "docker-registry"


class RegistryStartError(RuntimeError):
    """The registry did not come up; the message carries the tail of its log."""


def missing_binary() -> str | None:
    """``docker-registry`` when it is not on PATH, else None."""
    return None if shutil.which(BINARY) else BINARY


@dataclass(frozen=True)
class CA:
    """A test CA (``ca_cert``: PEM file) and a server certificate it signed for 127.0.0.1 and
    localhost (``cert``, ``key``: PEM files)."""

    ca_cert: Path
    cert: Path
    key: Path


def make_ca(d: Path) -> CA:
    """Make a CA and a server certificate (127.0.0.1, ::1, localhost) under ``d``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmctl test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                       x509.IPAddress(ipaddress.ip_address("::1"))])
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(san, critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = CA(d / "ca.pem", d / "server.pem", d / "server-key.pem")
    out.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return out


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash of ``password`` (``$2b$``, cost 5) from libxcrypt's crypt(3)."""
    lib = ctypes.CDLL(ctypes.util.find_library("crypt") or "libcrypt.so.1")
    lib.crypt_gensalt.restype = ctypes.c_char_p
    lib.crypt.restype = ctypes.c_char_p
    salt = lib.crypt_gensalt(b"$2b$", 5, None, 0)
    h = lib.crypt(password.encode(), salt)
    if not h or not h.startswith(b"$2"):
        raise RuntimeError("libxcrypt made no bcrypt hash")
    return h.decode()


def docker_config(path: Path, host: str, user: str, password: str) -> Path:
    """Write a Docker ``config.json`` at ``path`` with a login for ``host``; returns ``path``."""
    import base64

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}))
    return path


_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_ACCESS_RE = re.compile(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')


class Registry:
    """One ``docker-registry`` on 127.0.0.1:``port`` (see the module docstring)."""

    def __init__(self, workdir: Path, port: int, ca: CA | None = None, users: dict[str, str] | None = None,
                 proxy: tuple[str, str, str] | None = None, token: "TokenServer | None" = None, timeout: float = 20.0,
                 redirect: str | None = None):
        self.d, self.port, self.ca, self.timeout = Path(workdir), port, ca, timeout
        self.host = f"127.0.0.1:{port}"
        self.url = f"{'https' if ca else 'http'}://{self.host}"
        self.d.mkdir(parents=True, exist_ok=True)
        self.logfile = self.d / "registry.log"
        self.proc: subprocess.Popen | None = None
        lines = ["version: 0.1", "log:", "  level: info", "  accesslog:", "    disabled: false",
                 "storage:", f"  filesystem:\n    rootdirectory: {self.d / 'data'}", "  delete:\n    enabled: true",
                 "  maintenance:\n    uploadpurging:\n      enabled: false",
                 "http:", f"  addr: 127.0.0.1:{port}", "  secret: warmctl-test-secret"]
        if ca:
            lines += ["  tls:", f"    certificate: {ca.cert}", f"    key: {ca.key}"]
        if users:
            ht = self.d / "htpasswd"
            ht.write_text("".join(f"{u}:{bcrypt_hash(p)}\n" for u, p in users.items()))
            lines += ["auth:", "  htpasswd:", "    realm: warmctl-test", f"    path: {ht}"]
        if token:
            lines += ["auth:", "  token:", f"    realm: {token.realm}", f"    service: {token.service}",
                      f"    issuer: {token.issuer}", f"    rootcertbundle: {token.cert}"]
        if redirect:  # blob reads answered 307 -> <redirect>/docker/registry/v2/blobs/... (Distribution's middleware)
            lines += ["middleware:", "  storage:", "    - name: redirect", "      options:", f"        baseurl: {redirect}"]
        if proxy:
            lines += ["proxy:", f"  remoteurl: {proxy[0]}", f"  username: {proxy[1]}", f"  password: {proxy[2]}"]
        self.config = self.d / "config.yml"
        self.config.write_text("\n".join(lines) + "\n")

    def __enter__(self) -> "Registry":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _listening(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self) -> None:
        """Start the registry and wait until it listens. Raises RegistryStartError."""
        # Distribution reads REGISTRY_<SECTION>_<KEY> variables as config overrides: a client's
        # REGISTRY_AUTH_FILE (the credentials convention) would become its auth section
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        if self.ca:
            env["SSL_CERT_FILE"] = str(self.ca.ca_cert)  # a mirror's requests to its origin
        with open(self.logfile, "ab") as log:
            # PDEATHSIG fires when the starting *thread* ends: only the main thread's children get it
            # (a test restarting the registry from a timer thread stops it itself)
            main = threading.current_thread() is threading.main_thread()
            self.proc = subprocess.Popen([BINARY, "serve", str(self.config)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent if main else None)
        deadline = time.monotonic() + self.timeout
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self.logfile.read_text(errors="replace").splitlines()[-25:])
                raise RegistryStartError(f"docker-registry on {self.host} did not come up:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill the registry (its storage stays) and reap it."""
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.kill()
        if p is not None:
            p.wait()

    def access_log(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request the registry logged so far."""
        return [(m, path, int(st)) for m, path, st in _ACCESS_RE.findall(self.logfile.read_text(errors="replace"))]

    def data_dir(self) -> Path:
        """The filesystem storage root (blobs under docker/registry/v2/blobs/sha256/xx/<hex>/data)."""
        return self.d / "data"

    def blob_path(self, digest: str) -> Path:
        """Where the blob ``sha256:<hex>`` lies in the storage."""
        hx = digest.split(":", 1)[1]
        return self.d / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / hx[:2] / hx / "data"


def _b64url(b: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


class TokenServer:
    """A bearer-token service for a registry with ``auth.token`` (the distribution token flow):
    ``GET /token?service=..&scope=..`` with basic auth of one of ``users`` answers
    ``{"token": <JWT>}``, an ES256 JWT signed by a key made here (its certificate in the JWT's
    ``x5c`` header and in the registry's ``rootcertbundle``), granting the actions the scope asks
    for. ``lifetime``: seconds a token is valid, counted as Distribution does (it allows 60 s of
    clock skew past ``exp``; the ``exp`` written is shifted so that a token expires ``lifetime``
    seconds after it was issued). ``issued`` counts the tokens handed out. Runs over TLS with the
    server certificate of ``ca`` on 127.0.0.1:``port`` in a daemon thread; :meth:`stop` ends it."""

    LEEWAY = 60  # Distribution 2.8, registry/auth/token: tokens are accepted this long past exp

    def __init__(self, d: Path, port: int, ca: CA, users: dict[str, str], lifetime: float = 300.0):
        import datetime as dt
        import ssl
        import threading as th
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        d.mkdir(parents=True, exist_ok=True)
        self.realm, self.service, self.issuer = f"https://127.0.0.1:{port}/token", "warmctl-test-registry", "warmctl-test-issuer"
        self.users, self.lifetime, self.issued = users, lifetime, 0
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmctl test token signer")])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=2)).sign(self.key, hashes.SHA256()))
        self.der = cert.public_bytes(serialization.Encoding.DER)
        self.cert = d / "token-signer.pem"
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):  # noqa: N802
                import base64
                from urllib.parse import parse_qs, urlparse

                q = parse_qs(urlparse(self.path).query)
                auth = self.headers.get("Authorization", "")
                try:
                    user, _, pw = base64.b64decode(auth.split(" ", 1)[1]).decode().partition(":")
                except (IndexError, ValueError):
                    user, pw = "", ""
                if srv.users.get(user) != pw or not user:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": srv.token(user, q.get("service", [""])[0], q.get("scope", []))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), H)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(ca.cert, ca.key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = th.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def token(self, user: str, service: str, scopes: list[str]) -> str:
        """A signed JWT for ``user`` granting ``scopes`` (``repository:NAME:ACTIONS``)."""
        import uuid

        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        access = []
        for sc in scopes:
            for one in sc.split(" "):
                typ, _, rest = one.partition(":")
                name, _, actions = rest.rpartition(":")
                access.append({"type": typ, "name": name, "actions": [a for a in actions.split(",") if a]})
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": user, "aud": service, "iat": now, "nbf": now - 120, "jti": uuid.uuid4().hex,
                  "exp": now + int(self.lifetime) - self.LEEWAY, "access": access}
        header = {"typ": "JWT", "alg": "ES256", "x5c": [__import__("base64").b64encode(self.der).decode()]}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        self.issued += 1
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class BlobStorage:
    """A plain-HTTP server on 127.0.0.1:``port`` serving the files under ``root`` (a registry's
    filesystem storage) to the clients a :class:`Registry` with ``redirect`` sends there, as
    blob storage behind a registry does: GET and HEAD, single byte ranges (206). ``seen``:
    ``(method, path, status, Authorization header or None)`` of every request."""

    def __init__(self, root: Path, port: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.root, self.port, self.url = Path(root), port, f"http://127.0.0.1:{port}"
        self.seen: list[tuple[str, str, int, str | None]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _serve(self, body: bool) -> None:
                f = outer.root / self.path.split("?")[0].lstrip("/")
                if ".." in self.path or not f.is_file():
                    st, data, extra = 404, b"", {}
                else:
                    data, extra, st = f.read_bytes(), {}, 200
                    rng = self.headers.get("Range", "")
                    if rng.startswith("bytes="):
                        a, _, b = rng[6:].partition("-")
                        lo, hi = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
                        extra["Content-Range"] = f"bytes {lo}-{hi}/{len(data)}"
                        data, st = data[lo:hi + 1], 206
                outer.seen.append((self.command, self.path, st, self.headers.get("Authorization")))
                self.send_response(st)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._serve(True)

            def do_HEAD(self):  # noqa: N802
                self._serve(False)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
