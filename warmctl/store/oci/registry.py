"""A small client of the OCI distribution API (v1.1) over httpx, for one repository of one
registry: requests with authentication (:class:`~.auth.RegistryAuth`) and httpx's redirect
handling, every failure translated into warmctl's errors (:meth:`RegistryClient.send`), bounded
metadata reads with a deadline (:meth:`RegistryClient._read_bounded`), and the manifest, blob and
tag operations the backend is built on. docs/store-format.md says why not oras-py.

Every request runs under a total deadline (a :class:`~warmctl.store.backend.TransferClock`; one
of ``remote_deadline_floor_s`` when the caller gives none) that covers the whole request, its
answer's head (status line and headers) and an upload's wait for its answer included: the
client's connections are :class:`_WatchedStream` s, which tell the calling thread's
:class:`_Watch` which socket it waits on, and a watchdog thread
(:class:`~warmctl.store.backend.DeadlineWatchdog`) shuts that socket down at the deadline, so a
registry that answers nothing, or trickles its headers, ends the request there in
:class:`~warmctl.store.backend.RemoteTooSlow` (not at the per-read timeout, which a byte now and
then never lets fire). A connection still being made is bounded by the connect timeout."""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from urllib.parse import quote, urljoin, urlparse

import httpcore
import httpx

from warmctl.base.errors import HostError, IntegrityError
from warmctl.store.backend import (DeadlineWatchdog, ObjectNotFound, TransferBound, TransferClock, TransferWatch,
                                   TransientBackendError)

from .auth import CERTS_D, Login, RegistryAuth, credentials, is_insecure, ssl_context
from .pack import OCI_INDEX, OCI_MANIFEST, _sha

MAX_OCI_MANIFEST = 4 << 20  # the distribution spec's limit registries apply
#: Seconds one metadata read may take in all (the per-byte read timeout is shorter).
READ_DEADLINE = 120.0
#: Bytes of an upload's body handed to the connection at a time (its deadline checked between).
UPLOAD_PIECE = 256 << 10
_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*$")


def parse_url(url: str) -> tuple[str, str]:
    """(``HOST[:PORT]``, repository) of ``oci://HOST[:PORT]/REPOSITORY``. Raises ValueError
    naming what is wrong (no host, no repository, a repository name the spec refuses)."""
    u = urlparse(url)
    if u.scheme != "oci" or not u.netloc:
        raise ValueError(f"store URL {url!r} names no registry (want oci://HOST[:PORT]/REPOSITORY)")
    repo = u.path.strip("/")
    if not repo:
        raise ValueError(f"store URL {url!r} names no repository (want oci://HOST[:PORT]/REPOSITORY)")
    if not _REPO_RE.match(repo):
        raise ValueError(f"store URL {url!r}: repository {repo!r} is not a valid OCI repository name "
                         "(lowercase letters, digits, separators . _ __ -, path components joined by /)")
    return u.netloc, repo


#: OpenSSL's reasons for a TLS handshake answered by something that does not speak TLS (a
#: plain-HTTP server's reply read as a TLS record).
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"})


def _ssl_error(e: BaseException) -> ssl.SSLError | None:
    """The :class:`ssl.SSLError` under httpx's and httpcore's wrappers of ``e`` (each raises
    ``from`` the one below), or None."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None or isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


_tls = threading.local()  # .watch: the _Watch of the request this thread is making, or None


class _Watch(TransferWatch):
    """One request (or body read) under ``clock``'s deadline: the stream it last read or wrote
    (set by :class:`_WatchedStream`)."""

    def __init__(self, clock: TransferClock):
        super().__init__(clock)
        self.stream: _WatchedStream | None = None

    def shut_down(self) -> None:
        if self.stream is not None:
            self.stream.shutdown()


_WATCHDOG = DeadlineWatchdog("warmctl-oci-deadlines")


def _watched(clock: TransferClock) -> AbstractContextManager[TransferWatch]:
    """Run the reads and writes this thread makes in the block under ``clock``'s deadline."""
    return _WATCHDOG.watching(_Watch(clock), _tls)


class _WatchedStream(httpcore.NetworkStream):
    """A connection of the client (httpcore's stream ``inner``) whose every read and write first
    tells the calling thread's :class:`_Watch` that it waits on this socket."""

    def __init__(self, inner: httpcore.NetworkStream):
        self.inner = inner

    def _mark(self) -> None:
        w = getattr(_tls, "watch", None)
        if w is not None:
            with w.mu:
                w.stream = self

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._mark()
        return self.inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._mark()
        self.inner.write(buffer, timeout)

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> "_WatchedStream":
        self._mark()
        return _WatchedStream(self.inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str):
        return self.inner.get_extra_info(info)

    def shutdown(self) -> None:
        """Shut the socket down both ways (the TLS layer left alone: the fd's own shutdown)."""
        sock = self.inner.get_extra_info("socket")
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass


class _WatchedBackend(httpcore.NetworkBackend):
    """httpcore's network backend ``inner`` whose connections are :class:`_WatchedStream` s."""

    def __init__(self, inner: httpcore.NetworkBackend):
        self.inner = inner

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _WatchedStream(self.inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _WatchedStream(self.inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def _watch_connections(client: httpx.Client) -> None:
    """Make every connection ``client`` opens (its transport's and each proxy mount's) a
    :class:`_WatchedStream`. httpx does not take a network backend: its transports' httpcore
    pools are given one. Raises RuntimeError when httpx's layout is not the one known here."""
    for t in [client._transport, *client._mounts.values()]:  # noqa: SLF001 - see above
        if t is None:
            continue
        pool = getattr(t, "_pool", None)
        inner = getattr(pool, "_network_backend", None)
        if not isinstance(inner, httpcore.NetworkBackend):
            raise RuntimeError(f"httpx {httpx.__version__}: its transport {type(t).__name__} holds no httpcore "
                               "network backend where warmctl expects it; the OCI client cannot bound its requests")
        if not isinstance(inner, _WatchedBackend):
            pool._network_backend = _WatchedBackend(inner)  # type: ignore[union-attr]  # noqa: SLF001


class RegistryClient:
    """Repository ``repo`` of registry ``registry`` (``HOST[:PORT]``) over HTTPS (plain HTTP
    when ``registry`` is one of ``insecure``), with the CA of ``ca_bundle``/``certs_d``
    (:func:`~.auth.ssl_context`) and the login the Docker conventions hold for it
    (:func:`~.auth.credentials`). ``connect_timeout``/``read_timeout``: seconds per connect and
    per read; ``read_deadline``: seconds one bounded metadata read may take in all; ``bound``:
    the total deadline of every transfer (:meth:`clock`: ``remote_deadline_floor_s`` + its size
    at ``remote_min_rate_bytes_s``)."""

    def __init__(self, registry: str, repo: str, connect_timeout: float = 5.0, read_timeout: float = 20.0, *,
                 read_deadline: float = READ_DEADLINE, ca_bundle: Path | None = None, certs_d: Path = CERTS_D,
                 insecure: Iterable[str] = (), bound: TransferBound | None = None):
        self.registry, self.repo = registry, repo
        self.read_deadline = read_deadline
        self.bound = bound or TransferBound()
        self.connect_timeout = connect_timeout
        self.certs_d = Path(certs_d)
        self.scheme = "http" if is_insecure(registry, insecure) else "https"
        self.base = f"{self.scheme}://{registry}"
        self.read_timeout = read_timeout
        self.client = httpx.Client(
            verify=ssl_context(registry, ca_bundle, certs_d) if self.scheme == "https" else False,
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=60.0),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
            follow_redirects=False, trust_env=True,
        )
        _watch_connections(self.client)
        self.login = Login(registry, repo, credentials(registry))
        self.have_blobs: set[str] = set()  # blobs known to exist (uploaded or seen by HEAD)

    def location(self) -> str:
        """``oci://HOST[:PORT]/REPO``, for messages."""
        return f"oci://{self.registry}/{self.repo}"

    def url(self, path: str) -> str:
        """The API URL of ``path`` in the repository (``blobs/<digest>``, ``manifests/<ref>``...)."""
        return f"{self.base}/v2/{self.repo}/{path}"

    def clock(self, where: str, size: int, cap: float | None = None) -> TransferClock:
        """The total deadline of a transfer of ``size`` bytes (:attr:`bound`), started now, at
        most ``cap`` seconds."""
        c = self.bound.start(where, size)
        if cap is not None and cap < c.limit:
            c.limit = cap
        return c

    def send(self, method: str, url: str, what: str, *, headers: dict | None = None, content=None,
             stream: bool = False, ok: tuple[int, ...] = (200,), clock: TransferClock | None = None) -> httpx.Response:
        """One request with authentication (:class:`~.auth.RegistryAuth`: a 401 challenge is
        answered, twice at most); a GET or HEAD follows redirects (httpx's handling: a blob
        served from storage elsewhere gets no ``Authorization``). Translates failures (the
        package docstring): a status not in ``ok`` raises. ``content``: bytes, or a function
        returning a fresh iterator of bytes per attempt. ``stream``: the caller reads and closes
        the response. ``what`` names the object in messages. ``clock``: the transfer's total
        deadline (:meth:`clock`): the read and write timeouts are clamped to what is left of it,
        and a timeout once it has passed is :class:`~warmctl.store.backend.RemoteTooSlow`; without
        one, the request (up to its answer's head) gets ``remote_deadline_floor_s``. The deadline
        covers the whole request, its answer's head included (the module docstring)."""
        where = f"{what} at {self.base}"
        again = content if callable(content) else None
        auth = RegistryAuth(self.login, self.client, where, again)
        if clock is None:
            clock = self.clock(where, 0)
        try:
            with _watched(clock) as w:
                request = self.client.build_request(method, url, headers=dict(headers or {}),
                                                    content=content() if again else content)
                t = max(0.01, min(self.read_timeout, clock.left()))  # this request's timeouts (httpx's extension)
                request.extensions["timeout"] = httpx.Timeout(connect=self.connect_timeout, read=t, write=t,
                                                              pool=60.0).as_dict()
                r = self.client.send(request, stream=stream, auth=auth, follow_redirects=method in ("GET", "HEAD"))
        except httpx.TooManyRedirects as e:
            raise HostError(f"{where}: the registry redirects too many times ({e})") from e
        except httpx.HTTPError as e:
            if w.fired or clock.expired():  # the watchdog, or the socket, timed out at the deadline
                # stalled: no answer yet (its head), its body (if any) handed over whole
                raise clock.error(clock.done, "sent" if content is not None else "received",
                                  stalled=content is None or clock.done >= clock.size) from e
            raise self._transport_error(where, e) from e
        if r.status_code in ok:
            return r
        try:
            text = (r.read() if stream else r.content)[:300].decode(errors="replace")
        except httpx.HTTPError:
            text = ""
        r.close()
        raise self._status_error(where, r.status_code, text)

    def _transport_error(self, where: str, e: Exception) -> Exception:
        text = str(e)
        tls = _ssl_error(e)
        if isinstance(e, httpx.ConnectError) and isinstance(tls, ssl.SSLCertVerificationError):
            return HostError(f"{where}: TLS certificate rejected ({text}); install the registry's CA "
                             f"(the oci_ca_bundle setting, $WARMCTL_OCI_CA_BUNDLE, or {self.certs_d / self.registry / 'ca.crt'})")
        if isinstance(e, httpx.ConnectError) and tls is not None and tls.reason in _NOT_TLS:
            return HostError(f"{where}: the registry does not speak TLS ({text}); a plain-HTTP registry must be "
                             f"listed in the oci_insecure setting ($WARMCTL_OCI_INSECURE)")
        if isinstance(e, httpx.TimeoutException):
            return TransientBackendError(f"{where}: no answer in time ({type(e).__name__})")
        if isinstance(e, httpx.ConnectError):
            return TransientBackendError(f"{where}: cannot connect ({text or type(e).__name__})")
        return TransientBackendError(f"{where}: {type(e).__name__}: {text}")

    def _status_error(self, where: str, status: int, body: str) -> Exception:
        code = ""
        try:
            errs = json.loads(body).get("errors") or []
            code = errs[0].get("code", "") if errs else ""
        except (ValueError, AttributeError):
            pass
        label = f"HTTP {status}" + (f" {code}" if code else "")
        if status >= 500 or status in (408, 429):
            return TransientBackendError(f"{where}: {label}")
        if status == 404:
            return ObjectNotFound(where, self.location())
        if status == 401:
            return HostError(f"{where}: {label}: the registry refused the credentials; check them")
        if status == 403:
            return HostError(f"{where}: {label}: access denied to repository {self.repo!r}; check the account's permissions")
        if status == 405 or code == "UNSUPPORTED":
            return HostError(f"{where}: {label}: the registry refuses this operation (deletes need "
                             "storage.delete.enabled in Distribution, or the registry's delete permission)")
        return HostError(f"{where}: {label}" + (f": {body[:200]}" if body and not code else ""))

    def _read_bounded(self, r: httpx.Response, limit: int, what: str, expect: int | None = None,
                      clock: TransferClock | None = None) -> bytes:
        """The body of streamed response ``r``: at most ``limit`` bytes (else IntegrityError), read
        within its total deadline (``clock``, started before the request; else the size it
        announces, else ``expect``, else ``limit``, at :attr:`bound`, at most ``read_deadline``
        seconds; past it :class:`~warmctl.store.backend.RemoteTooSlow`); closes ``r``."""
        where = f"{what} at {self.base}"
        out = bytearray()
        n = r.headers.get("content-length")
        if clock is None:
            size = int(n) if n is not None and n.isdigit() else expect if expect is not None else limit
            clock = self.clock(where, size, self.read_deadline)
        try:
            if n is not None and n.isdigit() and int(n) > limit:
                raise IntegrityError(f"{where}: the registry offers {int(n):,} bytes, more than the {limit:,} allowed for it; refused")
            with _watched(clock) as w:
                for b in r.iter_bytes():
                    out += b
                    if len(out) > limit:
                        raise IntegrityError(f"{where}: the registry sent more than the {limit:,} bytes allowed for it; refused")
                    clock.check(len(out))
            if w.fired:  # the watchdog shut the connection down at the deadline: the body ended early
                raise clock.error(len(out))
        except httpx.HTTPError as e:
            if clock.expired():
                raise clock.error(len(out)) from e
            raise self._transport_error(where, e) from e
        finally:
            r.close()
        if expect is not None and len(out) != expect:
            raise TransientBackendError(f"{where}: body cut short: {len(out)} of {expect} bytes")
        return bytes(out)

    def get_manifest(self, ref: str, what: str) -> tuple[str, dict]:
        """(OCI digest, parsed manifest) of tag or digest ``ref``. Raises ObjectNotFound."""
        clock = self.clock(f"{what} at {self.base}", MAX_OCI_MANIFEST, self.read_deadline)
        r = self.send("GET", self.url(f"manifests/{ref}"), what, headers={"Accept": f"{OCI_MANIFEST}, {OCI_INDEX}"},
                      stream=True, clock=clock)
        data = self._read_bounded(r, MAX_OCI_MANIFEST, what, clock=clock)
        digest = _sha(data)
        if ref.startswith("sha256:") and digest != ref:
            raise IntegrityError(f"{what} at {self.base}: the registry sent a manifest of digest {digest}, not {ref}; refused")
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list):
                raise ValueError("no layers")
        except ValueError as e:
            raise IntegrityError(f"{what} at {self.base}: not an OCI image manifest ({e})") from None
        return digest, doc

    def get_blob(self, digest: str, limit: int, what: str, size: int | None = None) -> bytes:
        clock = self.clock(f"{what} at {self.base}", limit if size is None else size, self.read_deadline)
        r = self.send("GET", self.url(f"blobs/{digest}"), what, stream=True, clock=clock)
        data = self._read_bounded(r, limit, what, size, clock=clock)
        if _sha(data) != digest:
            raise IntegrityError(f"{what}: blob {digest} in {self.location()} is corrupt (its bytes hash to {_sha(data)}); refused")
        return data

    def put_blob(self, digest: str, data, size: int, what: str) -> None:
        """Upload a blob (monolithic: POST, then PUT with the digest) unless it exists.
        ``data``: bytes, or a zero-argument function returning an iterator of bytes."""
        if digest in self.have_blobs:
            return
        try:
            self.send("HEAD", self.url(f"blobs/{digest}"), what).close()
            self.have_blobs.add(digest)
            return
        except ObjectNotFound:
            pass
        r = self.send("POST", self.url("blobs/uploads/"), what, ok=(202,))
        loc = urljoin(self.url("blobs/uploads/"), r.headers.get("location", ""))
        r.close()
        sep = "&" if "?" in loc else "?"
        clock = self.clock(f"{what} at {self.base}", size)

        def timed() -> Iterator[bytes]:
            """The body (``data()`` called now, as each attempt is built), piece by piece,
            within its total deadline."""
            pieces = data() if callable(data) else (data[i:i + UPLOAD_PIECE] for i in range(0, len(data), UPLOAD_PIECE))

            def gen() -> Iterator[bytes]:
                sent = 0
                for b in pieces:
                    clock.check(sent, "sent")
                    yield b
                    sent += len(b)
                clock.check(sent, "sent")

            return gen()

        # a function, not one iterator: a PUT refused for an expired token is sent again, and
        # its body must be whole again (send calls it once per attempt).
        self.send("PUT", f"{loc}{sep}digest={quote(digest)}", what, ok=(201,), content=timed, clock=clock,
                  headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}).close()
        self.have_blobs.add(digest)

    def put_manifest(self, ref: str, doc: dict, what: str) -> str:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        if len(data) > MAX_OCI_MANIFEST:
            raise HostError(f"{what}: the OCI manifest would be {len(data):,} bytes, over the registries' {MAX_OCI_MANIFEST:,}")
        self.send("PUT", self.url(f"manifests/{ref}"), what, ok=(201,), content=data,
                   headers={"Content-Type": OCI_MANIFEST}).close()
        return _sha(data)

    def delete_manifest(self, ref: str, what: str) -> None:
        try:
            r = self.send("HEAD", self.url(f"manifests/{ref}"), what, headers={"Accept": f"{OCI_MANIFEST}, {OCI_INDEX}"})
        except ObjectNotFound:
            return
        digest = r.headers.get("docker-content-digest")
        r.close()
        if not digest:
            digest, _ = self.get_manifest(ref, what)
        try:
            self.send("DELETE", self.url(f"manifests/{digest}"), what, ok=(202, 200)).close()
        except ObjectNotFound:
            pass

    def tags(self) -> list[str]:
        """Every tag of the repository (the paginated tags list; none for a repository not yet
        created)."""
        out: list[str] = []
        url = self.url("tags/list?n=1000")
        while url:
            try:
                r = self.send("GET", url, "list tags", stream=True)
            except ObjectNotFound:
                return out  # NAME_UNKNOWN: nothing pushed yet
            link = r.headers.get("link", "")
            data = self._read_bounded(r, MAX_OCI_MANIFEST, "list tags")
            try:
                out += json.loads(data).get("tags") or []
            except (ValueError, AttributeError):
                raise IntegrityError(f"list tags at {self.base}: not a tags list") from None
            m = re.search(r"<([^>]+)>;\s*rel=\"?next\"?", link)
            url = urljoin(self.base, m.group(1)) if m else ""
        return out
