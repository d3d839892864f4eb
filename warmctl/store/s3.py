"""S3 backend (boto3): objects as ``s3://BUCKET/PREFIX/KEY``.

Credentials come from boto3's usual chain (environment, shared config/credentials files,
instance profile). The endpoint of an S3-compatible server (Ceph RGW, MinIO, moto) comes from
the ``endpoint_url`` argument (:func:`warmctl.store.open_backend` passes the ``s3_endpoint``
setting, ``$WARMCTL_S3_ENDPOINT``), else ``$AWS_ENDPOINT_URL``; with a
custom endpoint, path-style addressing is used. Large objects are uploaded with multipart
upload; loads are ranged GETs whose length is checked.

Every failure of the S3 client becomes one of (see :meth:`S3Backend._err`):

- :class:`TransientBackendError`: connection refused/reset/closed, DNS failure (an endpoint
  behind a restarting load balancer), connect/read timeout, HTTP proxy unreachable, a body
  cut short (fewer bytes than Content-Length or the requested range), HTTP 5xx, 408, 429,
  ``SlowDown``/``Throttling``/``RequestTimeout``/``InternalError``/``ServiceUnavailable``;
- :class:`ObjectNotFound` for 404 / ``NoSuchKey``;
- :class:`HostError` (permanent, one line naming the endpoint, the object and what to check)
  for everything else: no such bucket, access refused (403, ``InvalidAccessKeyId``,
  ``SignatureDoesNotMatch``, expired token), no credentials, clock skew, TLS certificate
  rejected, other 4xx.

botocore's own retries are off and its timeouts short (connect 5 s, read 20 s without a
byte). Every load and save also has a total deadline (``bound``, a :class:`TransferBound`:
the ``remote_deadline_floor_s`` + the object's size at ``remote_min_rate_bytes_s``): a body is
read piece by piece as it arrives, with the socket's timeout clamped to what is left of the
deadline, and an upload's body is handed over piece by piece, so a server that trickles (a
byte every 19 s keeps a 20 s read timeout from ever firing) ends in :class:`RemoteTooSlow`
naming the object, the endpoint, the bytes moved and the seconds waited. The deadline covers
the whole request, its head (status line and headers) and an upload's wait for its answer
included: a watchdog thread (:class:`~warmctl.store.backend.DeadlineWatchdog`) shuts down the connection of a request still
running at its deadline, so a server that answers nothing, or trickles its headers, ends the
request at the deadline too (``stat``, ``list`` pages and ``remove`` move no body: their
deadline is ``remote_deadline_floor_s``). A request whose connection is still being made is
bounded by the connect timeout.
The outage window of :class:`warmctl.store.RetryingBackend` (which ``open_store``
wraps around this backend) is the one place that decides how long an outage is survived.
"""

from __future__ import annotations

import http.client
import io
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from urllib.parse import urlparse


from warmctl.base.errors import HostError
from warmctl.store.backend import (Backend, BackendProperties, DeadlineWatchdog, ObjectInfo, ObjectNotFound, RemoteTooSlow, TransferBound,
                                   TransferClock, TransferWatch, TransientBackendError, too_large)

#: Bytes asked of the socket per read of a body (a read returns what has arrived, up to this).
READ_PIECE = 1 << 20

#: S3 error codes worth retrying (any HTTP status >= 500 is retried too).
TRANSIENT_CODES = frozenset({
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "OperationAborted",
    "408",
    "429",
})
#: Error codes that mean the credentials or the policy refuse the request.
ACCESS_CODES = frozenset({
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "AccountProblem",
})
_CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_DNS_HINTS = ("name or service not known", "nodename nor servname", "temporary failure in name resolution",
              "no address associated", "failed to resolve", "nameresolutionerror", "getaddrinfo")


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e``, what it wraps (botocore's ``error`` field), its causes and contexts."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        inner = getattr(x, "kwargs", {}).get("error") if isinstance(getattr(x, "kwargs", None), dict) else None
        for y in (inner, x.__cause__, x.__context__, getattr(x, "reason", None)):
            if isinstance(y, BaseException):
                todo.append(y)


def s3_endpoint_from_env() -> str | None:
    """``$AWS_ENDPOINT_URL`` (AWS's own variable, as its SDKs read it), or None. warmctl's
    ``$WARMCTL_S3_ENDPOINT`` is the ``s3_endpoint`` setting, passed in as ``endpoint_url``."""
    return os.environ.get("AWS_ENDPOINT_URL") or None


def _load_sdk() -> None:
    """Import boto3, botocore and urllib3 into this module on first use, not at import: they
    cost ~130 ms, and every CLI command imports the store package (``warmctl up``
    from a local store never needs them)."""
    global boto3, botocore, bx, urllib3, _POOLS
    import boto3
    import botocore.awsrequest
    import botocore.config
    import botocore.exceptions as bx
    import urllib3.exceptions

    if _POOLS is None:
        _POOLS = {"http": _watched_pool(botocore.awsrequest.AWSHTTPConnectionPool),
                  "https": _watched_pool(botocore.awsrequest.AWSHTTPSConnectionPool)}


#: what the calling thread's request runs under (a :class:`_Watch`), read by the connections
_tls = threading.local()
#: botocore's connection pools, their connections telling the running watch which they are
_POOLS: dict[str, type] | None = None


def _watched_pool(pool: type) -> type:
    """A subclass of botocore's connection pool ``pool`` whose connections, on each request,
    hand themselves to the calling thread's :class:`_Watch` (so its watchdog can shut down the
    socket the request waits on)."""

    class Conn(pool.ConnectionCls):
        def request(self, *a, **kw):  # urllib3's entry for one request on this connection
            w = getattr(_tls, "watch", None)
            self._warmctl_watch = w
            if w is not None:
                w.conn = self
            return super().request(*a, **kw)

    return type(f"Watched{pool.__name__}", (pool,), {"ConnectionCls": Conn})


class _Watch(TransferWatch):
    """One transfer under its :class:`TransferClock`: the connection its current request uses
    (set by the connection)."""

    def __init__(self, clock: TransferClock):
        super().__init__(clock)
        self.conn = None

    def shut_down(self) -> None:
        sock = getattr(self.conn, "sock", None)
        if sock is not None and getattr(self.conn, "_warmctl_watch", None) is self:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_WATCHDOG = DeadlineWatchdog("warmctl-s3-deadlines")


def _watched(clock: TransferClock) -> AbstractContextManager[TransferWatch]:
    """Run the requests made in this block (this thread) under ``clock``'s deadline."""
    return _WATCHDOG.watching(_Watch(clock), _tls)


class S3Backend(Backend):
    """Objects in ``bucket`` under ``prefix`` (no leading/trailing slash needed).

    ``max_connections``: HTTP connection pool size (match the store's parallelism).
    ``multipart_threshold``/``part_size``: bytes; objects at least the threshold are sent with
    multipart upload in parts of ``part_size`` (>= 5 MiB, S3's minimum except the last part).
    ``connect_timeout``/``read_timeout``: seconds to establish a connection / to wait for the
    next bytes of an answer; each bounds one attempt. ``bound``: the total deadline of each
    load and save (module docstring; default :class:`TransferBound`'s).
    Raises :class:`HostError` when the endpoint URL is malformed.
    """

    properties = BackendProperties(local=False, prefetch=False, workers=16)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        max_connections: int = 32,
        multipart_threshold: int = 64 * 1024 * 1024,
        part_size: int = 16 * 1024 * 1024,
        connect_timeout: float = 5.0,
        read_timeout: float = 20.0,
        bound: TransferBound | None = None,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url or s3_endpoint_from_env()
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.bound = bound or TransferBound()
        _load_sdk()
        cfg = botocore.config.Config(
            max_pool_connections=max_connections,
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            s3={"addressing_style": "path"} if self.endpoint_url else {},
            # Chunks carry their own digests; skip the SDK's extra CRCs (CPU, and some
            # S3-compatible servers reject them).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session()
        try:
            self.client = session.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=region or session.region_name or "us-east-1",
                config=cfg,
            )
        except ValueError as e:  # botocore: "Invalid endpoint: ..."
            src = "$AWS_ENDPOINT_URL" if endpoint_url is None else "the s3_endpoint setting"
            raise HostError(f"S3 endpoint {self.endpoint_url!r} (from {src}) is not a valid URL: {e}") from None
        # the connections of this client tell the watchdog which socket a request waits on
        # (the dict is shared with botocore's pool managers)
        self.client._endpoint.http_session._pool_classes_by_scheme.update(_POOLS)

    def __repr__(self) -> str:
        return f"S3Backend({self.location()!r}, endpoint={self.endpoint_url!r})"

    def location(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def endpoint(self) -> str:
        """The URL requests go to (the custom endpoint, or AWS's regional one)."""
        return self.client.meta.endpoint_url

    def _reason(self, e: BaseException) -> tuple[bool, str]:
        """(transient?, a short reason) for a transport-level failure."""
        text = " ".join(str(x) for x in _chain(e)).lower()
        if isinstance(e, bx.SSLError):
            if "certificate" in text or "hostname" in text:
                return False, f"TLS certificate rejected ({e}); check the endpoint's certificate or AWS_CA_BUNDLE"
            return True, f"TLS connection failed: {e}"
        if isinstance(e, bx.ProxyConnectionError):
            return True, f"cannot connect through the HTTP proxy ({e})"
        if isinstance(e, bx.ConnectTimeoutError):
            return True, f"connect timed out after {self.connect_timeout:g} s"
        if isinstance(e, bx.ReadTimeoutError) or any(isinstance(x, (socket.timeout, TimeoutError)) for x in _chain(e)):
            return True, f"no answer for {self.read_timeout:g} s (read timeout)"
        if any(isinstance(x, socket.gaierror) for x in _chain(e)) or any(h in text for h in _DNS_HINTS):
            host = urlparse(self.endpoint()).hostname
            return True, f"cannot resolve host {host!r} (DNS)"
        if any(isinstance(x, ConnectionRefusedError) for x in _chain(e)) or "connection refused" in text:
            return True, "connection refused"
        if isinstance(e, bx.EndpointConnectionError):
            return True, f"cannot connect ({e})"
        if isinstance(e, bx.IncompleteReadError):
            return True, f"body cut short ({e})"
        if isinstance(e, (bx.ResponseStreamingError, http.client.IncompleteRead, urllib3.exceptions.ProtocolError)):
            return True, f"connection broke while reading the body ({e})"
        if isinstance(e, bx.ConnectionClosedError) or any(isinstance(x, ConnectionResetError) for x in _chain(e)):
            return True, "connection closed before a complete answer"
        return True, f"{type(e).__name__}: {e}"

    def _err(self, op: str, key: str, e: Exception) -> Exception:
        """Translate a boto3/botocore/urllib3/socket failure of ``op`` on ``key`` (see the
        module docstring for the classes). Anything not from the S3 client is returned as is."""
        where = f"{op} {self.location(key)} at {self.endpoint()}"
        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            msg = str(err.get("Message", "") or "")
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            label = f"HTTP {status} {code}".strip() if status and code != str(status) else (code or f"HTTP {status}")
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(key, self.location(key))
            if code == "NoSuchBucket":
                return HostError(f"{where}: bucket {self.bucket!r} does not exist; check the bucket in the store URL and the endpoint")
            if code in TRANSIENT_CODES or status >= 500 or status in (408, 429):
                return TransientBackendError(f"{where}: {label}" + (f" ({msg})" if msg else ""))
            if code in ACCESS_CODES or status == 403:
                return HostError(
                    f"{where}: access refused ({label}); check the credentials (AWS_ACCESS_KEY_ID/"
                    "AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket policy"
                )
            if code == "RequestTimeTooSkewed":
                return HostError(f"{where}: this host's clock differs from the server's ({code}); fix the clock (NTP)")
            return HostError(f"{where}: {label}" + (f": {msg}" if msg else ""))
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
            return HostError(f"{where}: no usable S3 credentials ({e}); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
        transport = (
            bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError, urllib3.exceptions.HTTPError,
            http.client.HTTPException, OSError,
        )
        if isinstance(e, transport):
            transient, reason = self._reason(e)
            return (TransientBackendError if transient else HostError)(f"{where}: {reason}")
        if isinstance(e, bx.BotoCoreError):
            return HostError(f"{where}: {type(e).__name__}: {e}")
        return e

    def save(self, key: str, data: bytes | memoryview) -> None:
        k = self.prefix + key
        if not isinstance(data, bytes):
            data = bytes(data)  # boto3 wants bytes (a view may be a memory map of a local object)
        clock = self.bound.start(f"save {self.location(key)} at {self.endpoint()}", len(data))
        with _watched(clock) as w:
            try:
                if len(data) < self.multipart_threshold:
                    self.client.put_object(Bucket=self.bucket, Key=k, Body=_TimedBody(data, clock))
                    return
                self._multipart(k, data, clock)
            except RemoteTooSlow:
                raise
            except Exception as e:  # noqa: BLE001 - translated
                if w.fired or clock.expired():  # the watchdog, or the socket, timed out at the deadline
                    # stalled: the whole body handed over, the answer never came
                    raise clock.error(clock.done, "sent", stalled=clock.done >= len(data)) from e
                raise self._err("save", key, e) from e

    def _multipart(self, k: str, data: bytes, clock: TransferClock) -> None:
        up = self.client.create_multipart_upload(Bucket=self.bucket, Key=k)
        uid = up["UploadId"]
        try:
            parts = []
            view = memoryview(data)
            for i, off in enumerate(range(0, len(data), self.part_size), start=1):
                body = _TimedBody(view[off : off + self.part_size].tobytes(), clock, off)
                r = self.client.upload_part(Bucket=self.bucket, Key=k, UploadId=uid, PartNumber=i, Body=body)
                parts.append({"PartNumber": i, "ETag": r["ETag"]})
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=k, UploadId=uid, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=uid)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
            raise

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        kw = {}
        if length is not None:
            if length == 0:
                self.stat(key)
                return b""
            kw["Range"] = f"bytes={offset}-{offset + length - 1}"
        elif offset:
            kw["Range"] = f"bytes={offset}-"
        try:
            r, data = self._get(key, kw, None, length or 0)
        except (RemoteTooSlow, ObjectNotFound):
            raise
        except Exception as e:  # noqa: BLE001 - translated
            raise self._err("load", key, e) from e
        return self._check_length(key, r, data, offset, length if "Range" in kw else None, "Range" in kw)

    def load_into(self, key: str, buf: bytearray, limit: int | None = None) -> memoryview:
        """The object's bytes; with ``limit``, one ranged GET of at most ``limit + 1`` bytes
        whose ``Content-Range`` total (or ``Content-Length``, when the server ignored the
        range) says the object's size: larger than ``limit`` raises IntegrityError, having
        read no more than that."""
        if limit is None:
            return memoryview(self.load(key))
        try:
            r, data = self._get(key, {"Range": f"bytes=0-{limit}"}, limit + 1, limit + 1)
        except (RemoteTooSlow, ObjectNotFound):
            raise
        except Exception as e:  # noqa: BLE001 - translated
            if ((getattr(e, "response", None) or {}).get("Error") or {}).get("Code") == "InvalidRange":
                return memoryview(b"")  # an empty object has no byte 0
            raise self._err("load", key, e) from e
        status = r.get("ResponseMetadata", {}).get("HTTPStatusCode", 200)
        m = _CONTENT_RANGE_RE.match(r.get("ContentRange") or "")
        total = int(m.group(3)) if status == 206 and m and m.group(3) != "*" else int(r.get("ContentLength", len(data)))
        if total > limit or len(data) > limit:
            raise too_large(self.location(key), max(total, len(data)), limit, "object")
        if len(data) != total:
            raise TransientBackendError(f"load {self.location(key)} at {self.endpoint()}: body cut short: "
                                        f"{len(data)} of {total} bytes")
        return memoryview(data)

    def _get(self, key: str, kw: dict, most: int | None, expect: int) -> tuple[dict, bytes]:
        """(GET answer, its body: at most ``most`` bytes, else all) of ``key`` with the extra
        arguments ``kw``, within the total deadline of ``expect`` bytes until the answer's head
        has come, then of its ``Content-Length``: the body is read as it arrives, the socket's
        timeout clamped to what is left of the deadline, and the watchdog shuts the connection
        down at the deadline whatever the request waits on. Raises :class:`RemoteTooSlow` past
        the deadline; the client's exceptions otherwise."""
        what = f"load {self.location(key)} at {self.endpoint()}"
        t0 = time.monotonic()
        clock = self.bound.start(what, expect, t0)
        with _watched(clock) as w:
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key, **kw)
            except Exception as e:  # noqa: BLE001 - a head that never came is the deadline's
                if w.fired or clock.expired():
                    raise clock.error(0, stalled=True) from e
                raise
            size = int(r.get("ContentLength") or 0)
            if most is not None:
                size = min(size, most)
            w.clock = clock = self.bound.start(what, size, t0)
            _WATCHDOG.arm(w)
            body = r["Body"]
            raw = getattr(body, "_raw_stream", None)  # urllib3's response: read1 returns what has arrived
            read1 = getattr(raw, "read1", None)
            out = bytearray()
            try:
                while most is None or len(out) < most:
                    clock.check(len(out))
                    want = READ_PIECE if most is None else min(READ_PIECE, most - len(out))
                    try:
                        body.set_socket_timeout(max(0.01, min(self.read_timeout, clock.left())))
                    except (AttributeError, OSError):
                        pass
                    try:
                        piece = read1(want) if read1 is not None else body.read(want)
                    except Exception as e:  # noqa: BLE001 - a timeout at the deadline is the deadline's
                        if w.fired or clock.expired():
                            raise clock.error(len(out)) from e
                        raise
                    if not piece:
                        break
                    out += piece
                if w.fired:  # the connection shut down under a read: the body ended early
                    raise clock.error(len(out))
            finally:
                body.close()
        return r, bytes(out)

    def _check_length(self, key: str, r: dict, data: bytes, offset: int, length: int | None, ranged: bool) -> bytes:
        """The body of GET answer ``r`` if it has the length asked for; a server that ignored
        the Range header (200, whole object) is sliced here. Raises
        :class:`TransientBackendError` for a short body."""
        status = r.get("ResponseMetadata", {}).get("HTTPStatusCode", 200)
        where = f"load {self.location(key)} at {self.endpoint()}"
        if ranged and status == 200:  # Range ignored: the whole object came back
            expect = r.get("ContentLength", len(data))
            if len(data) != expect:
                raise TransientBackendError(f"{where}: body cut short: {len(data)} of {expect} bytes")
            return data[offset : None if length is None else offset + length]
        if ranged:
            m = _CONTENT_RANGE_RE.match(r.get("ContentRange") or "")
            if m is None or int(m.group(1)) != offset:
                raise TransientBackendError(f"{where}: asked for bytes {offset}- but got range {r.get('ContentRange')!r}")
            end, total = int(m.group(2)), None if m.group(3) == "*" else int(m.group(3))
            want_end = offset + length - 1 if length is not None else None
            if total is not None:
                want_end = total - 1 if want_end is None else min(want_end, total - 1)
            expect = (end if want_end is None else want_end) - offset + 1
        else:
            expect = r.get("ContentLength", len(data))
        if len(data) != expect:
            raise TransientBackendError(f"{where}: body cut short: {len(data)} of {expect} bytes (offset {offset})")
        return data

    @contextmanager
    def _small(self, op: str, key: str) -> Iterator[None]:
        """Run one request that moves no body (``op`` on ``key``) within ``remote_deadline_floor_s``,
        translating its failures (:meth:`_err`)."""
        clock = self.bound.start(f"{op} {self.location(key)} at {self.endpoint()}", 0)
        with _watched(clock) as w:
            try:
                yield
            except Exception as e:  # noqa: BLE001 - translated
                if w.fired or clock.expired():
                    raise clock.error(0, stalled=True) from e
                raise self._err(op, key, e) from e

    def stat(self, key: str) -> ObjectInfo:
        with self._small("stat", key):
            r = self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        return ObjectInfo(key, r["ContentLength"], r["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        n = len(self.prefix)
        kw: dict = {}
        while True:  # one page per request, each within its own deadline
            with self._small("list", prefix):
                page = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + prefix, **kw)
            for o in page.get("Contents", []):
                yield ObjectInfo(o["Key"][n:], o["Size"], o["LastModified"].timestamp())
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            kw = {"ContinuationToken": token}

    def remove(self, key: str) -> None:
        try:
            with self._small("remove", key):
                self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)
        except ObjectNotFound:
            pass

    def close(self) -> None:
        self.client.close()


class _TimedBody(io.BytesIO):
    """An upload's body (``data``, at byte ``offset`` of the object) that the HTTP client reads
    piece by piece: each read first checks ``clock`` (:class:`TransferClock`), so a server that
    takes the body too slowly ends the upload in :class:`RemoteTooSlow`."""

    def __init__(self, data: bytes, clock: TransferClock, offset: int = 0):
        super().__init__(data)
        self.clock, self.offset = clock, offset

    def read(self, n: int | None = -1) -> bytes:
        self.clock.check(self.offset + self.tell(), "sent")
        return super().read(n)
