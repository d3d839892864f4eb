"""OCI registry backend: a store kept in one repository of a registry, ``oci://HOST[:PORT]/REPO``.

The layout (specified in docs/store-format.md, section 8, "OCI registries") maps the store's
flat key namespace onto what the OCI distribution spec v1.1 offers (blobs by sha256 digest,
manifests, tags), so that registries, their garbage collectors and pull-through mirrors handle
a snapshot like any artifact:

- ``manifests/sha256/<hex>``: a **snapshot artifact**, an OCI image manifest with
  ``artifactType`` :data:`SNAPSHOT_TYPE`, tagged ``manifest-<hex>``. Its first layer is
  warmctl's manifest itself (so the blob digest *is* the warmctl manifest digest); the other
  layers are the **packs** holding the snapshot's chunks, each followed by its **pack index**.
- ``chunks/<algo>/<xx>/<hex>``: a byte range of a pack. A pack is a blob of concatenated chunk
  objects (zstd frames) of at most ``pack_bytes`` (the ``oci_pack_bytes`` setting, default
  :data:`PACK_BYTES`); its
  index (JSON) maps each chunk digest to ``[offset, length]``. Chunks are read back with
  ranged GETs. A new snapshot lists the packs that hold the chunks it needs, existing ones
  included, so chunk-level dedup works across snapshots and only packs of new chunks are
  uploaded.
- every other key (``config``, ``catalog/...``, ``signatures/...``, ``locks/...``): a small
  **object artifact** (``artifactType`` :data:`OBJECT_TYPE`, one layer holding the bytes, the
  key in the annotation :data:`KEY_ANNOTATION`) under a tag derived from the key
  (:func:`object_tag`): catalog entries get readable tags (``<name>.<tag>.<hash>``).

Chunk saves are buffered: a chunk goes into an open pack (a temporary file; up to
:data:`OPEN_PACKS` fill in parallel) and the pack is uploaded when full, or when a manifest is
saved (every pack it needs is uploaded before the artifact that names it), so the write order
holds: a crash leaves at worst unreferenced blobs, which the registry's own garbage collection
removes. Pack uploads are retried as a whole (a fresh upload session each time).

Protocol: a small client over httpx (docs/store-format.md says why not oras-py). HTTPS always,
plain HTTP only for registries listed in ``insecure`` (the ``oci_insecure`` setting,
``$WARMCTL_OCI_INSECURE``: ``host:port``, comma separated). CA bundle: ``ca_bundle`` (the
``oci_ca_bundle`` setting, ``$WARMCTL_OCI_CA_BUNDLE``), else ``CERTS_D/HOST[:PORT]/ca.crt``
(``certs_d``: the ``oci_certs_d`` setting, default ``/etc/docker/certs.d``), else the system's. Credentials: the Docker/OCI
conventions (``$REGISTRY_AUTH_FILE``, else ``$DOCKER_CONFIG/config.json``, else
``~/.docker/config.json``: ``auths[HOST[:PORT]]`` ``auth`` / ``username`` + ``password`` /
``identitytoken``); both the bearer-token flow and basic auth; an expired token is fetched
again once.

Every failure becomes :class:`TransientBackendError` (connection refused/reset, timeouts, 5xx,
408, 429, a body cut short), :class:`ObjectNotFound` (404), or :class:`HostError`, one line
naming the registry, the object and what to check (credentials refused, TLS certificate
rejected, deletes disabled, other 4xx). :class:`~warmctl.store.RetryingBackend` (``open_store``
wraps this backend in it) decides how long an outage is survived.

Reads of metadata (OCI manifests, pack indexes, small objects, warmctl manifests) are bounded
(:data:`MAX_OCI_MANIFEST`, :data:`MAX_INDEX`, :data:`MAX_OBJECT`, :data:`MAX_MANIFEST`) and
each read has a deadline (``read_deadline``: the ``oci_read_deadline_s`` setting, default
:data:`READ_DEADLINE`); a registry that sends more, or sends it too
slowly, is refused with an error naming the object.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import ssl
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote, urlencode, urljoin, urlparse

import httpx

from warmctl.errors import HostError, IntegrityError
from warmctl.store.backend import Backend, BackendProperties, ObjectInfo, ObjectNotFound, TransientBackendError
from warmctl.store.layout import _digest_from_chunk_key, chunk_key

log = logging.getLogger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB = b"{}"
#: artifactType of a snapshot (warmctl manifest + packs)
SNAPSHOT_TYPE = "application/vnd.warmctl.snapshot.v1"
#: artifactType of one small store object (catalog entry, signature, lock, config)
OBJECT_TYPE = "application/vnd.warmctl.object.v1"
MANIFEST_LAYER = "application/vnd.warmctl.manifest.v1+json"
PACK_LAYER = "application/vnd.warmctl.pack.v1"
INDEX_LAYER = "application/vnd.warmctl.pack-index.v1+json"
OBJECT_LAYER = "application/vnd.warmctl.object.v1"
KEY_ANNOTATION = "vnd.warmctl.key"
MANIFEST_ANNOTATION = "vnd.warmctl.manifest"
INDEX_ANNOTATION = "vnd.warmctl.pack.index"
CREATED = "org.opencontainers.image.created"

#: Largest pack (bytes): 1 GiB keeps a 647 GiB snapshot at ~650 packs (an OCI manifest of
#: ~0.3 MiB, docs/store-format.md) and a pack's re-upload after a failure short.
PACK_BYTES = 1 << 30
#: Packs filled (and uploaded) in parallel by one writer.
OPEN_PACKS = 4
MAX_OCI_MANIFEST = 4 << 20  # the distribution spec's limit registries apply
MAX_INDEX = 16 << 20  # a 1 GiB pack of 4 MiB chunks has a ~30 KiB index
MAX_OBJECT = 4 << 20  # catalog entries, signatures, locks: a few KiB
MAX_MANIFEST = 256 << 20  # warmctl manifests: ~15 MiB for 647 GiB
#: Seconds one metadata read may take in all (the per-byte read timeout is shorter).
READ_DEADLINE = 120.0
#: Docker's per-registry certificate directory (``HOST[:PORT]/ca.crt`` below it).
CERTS_D = Path("/etc/docker/certs.d")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


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


def _h(s: str, n: int) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:n]


def object_tag(key: str) -> str:
    """The tag of the small object ``key``: ``<name>.<tag>.<h16>`` for a catalog entry and
    ``<name>.profile.<h16>`` for a profile when that fits in 128 characters (so a registry's UI
    lists snapshots by name), ``sig-<manifest hex>-<h16>`` for a signature,
    ``lock-<h32>``, ``config``, else ``obj-<h48>``; ``<hN>``: the first N hex digits of the
    key's sha256 (the key itself is in the artifact's annotation and checked on read)."""
    parts = key.split("/")
    if key == "config":
        return "config"
    if parts[0] == "catalog" and len(parts) in (3, 4):
        label = ".".join(parts[1:-1] + ([parts[3].split("-")[-1][:12]] if len(parts) == 4 else ["profile"]))
        tag = f"{label}.{_h(key, 16)}"
        if len(tag) <= 128 and _TAG_RE.match(tag):
            return tag
        return f"cat-{_h(key, 48)}"
    if parts[0] == "signatures" and len(parts) == 4 and _HEX64.match(parts[2]):
        return f"sig-{parts[2]}-{_h(key, 16)}"
    if parts[0] == "locks":
        return f"lock-{_h(key, 32)}"
    return f"obj-{_h(key, 48)}"


def _tag_may_hold(tag: str, prefix: str) -> bool:
    """False when the object under ``tag`` cannot have a key starting with ``prefix`` (a cheap
    filter before reading the artifact; True may still be a non-match)."""
    if tag.startswith("manifest-"):
        return False
    if tag == "config":
        return "config".startswith(prefix)
    parts = prefix.split("/")
    top = parts[0]
    if len(parts) == 1:
        return True
    if top == "catalog":
        if tag.startswith(("sig-", "lock-", "obj-")) or tag == "config":
            return False
        if tag.startswith("cat-") or len(parts) < 3 or not parts[1]:
            return True
        return tag.startswith(parts[1] + ".")  # a readable catalog tag begins with the name
    if top == "signatures":
        if not tag.startswith("sig-"):
            return False
        return len(parts) < 4 or tag.startswith(f"sig-{parts[2]}-")
    if top == "locks":
        return tag.startswith("lock-")
    return tag.startswith("obj-")


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _mtime(s: str | None) -> float:
    if not s:
        return 0.0
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _sha(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _desc(media: str, digest: str, size: int, annotations: dict | None = None) -> dict:
    d = {"mediaType": media, "digest": digest, "size": size}
    if annotations:
        d["annotations"] = annotations
    return d


EMPTY_DESC = _desc(EMPTY_TYPE, _sha(EMPTY_BLOB), len(EMPTY_BLOB))


def pack_index(pack: str, created: str, chunks: dict[str, tuple[int, int]]) -> bytes:
    """The index blob of ``pack``: JSON ``{"format": 1, "kind": "warmctl-pack-index", "pack",
    "created", "chunks": [[chunk digest, offset, length], ...]}`` (offsets and lengths in bytes
    of the pack, sorted by digest)."""
    return json.dumps({"format": 1, "kind": "warmctl-pack-index", "pack": pack, "created": created,
                       "chunks": [[d, off, n] for d, (off, n) in sorted(chunks.items())]}, separators=(",", ":")).encode()


def snapshot_artifact(digest: str, size: int, name: str, created: str, packs: list[tuple[str, int, str, int]]) -> dict:
    """The OCI image manifest of a snapshot: warmctl manifest ``digest`` (``size`` bytes) as the
    first layer, then each of ``packs`` (``(pack digest, pack bytes, index digest, index bytes)``)
    as its index layer followed by the pack layer, which names its index in an annotation."""
    layers = [_desc(MANIFEST_LAYER, digest, size, {"org.opencontainers.image.title": name})]
    for pd, psize, idx, isize in packs:
        layers.append(_desc(INDEX_LAYER, idx, isize))
        layers.append(_desc(PACK_LAYER, pd, psize, {INDEX_ANNOTATION: idx}))
    return {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": SNAPSHOT_TYPE, "config": EMPTY_DESC,
            "layers": layers, "annotations": {CREATED: created, MANIFEST_ANNOTATION: digest, "org.opencontainers.image.title": name}}


# -- credentials and TLS


def auth_file() -> Path:
    """Where registry credentials are read from: ``$REGISTRY_AUTH_FILE``, else
    ``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``."""
    if os.environ.get("REGISTRY_AUTH_FILE"):
        return Path(os.environ["REGISTRY_AUTH_FILE"])
    if os.environ.get("DOCKER_CONFIG"):
        return Path(os.environ["DOCKER_CONFIG"]) / "config.json"
    return Path.home() / ".docker" / "config.json"


@dataclass(frozen=True)
class Credentials:
    """A registry login: ``username``/``password``, or an ``identitytoken`` (an OAuth2 refresh
    token, used in the bearer flow); ``source``: the file it came from, for messages."""

    username: str | None
    password: str | None
    identitytoken: str | None
    source: str


def credentials(registry: str) -> Credentials | None:
    """The credentials :func:`auth_file` holds for ``registry`` (``HOST[:PORT]``; an entry
    written as ``https://HOST[:PORT]`` or with a path matches too), or None. Raises
    :class:`HostError` for an auth file that is not valid JSON (naming it)."""
    p = auth_file()
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise HostError(f"registry credentials file {p} is unreadable: {e}") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return None
    for k, v in auths.items():
        host = urlparse(k).netloc if "://" in k else k.split("/")[0]
        if host != registry or not isinstance(v, dict):
            continue
        user, pw = v.get("username"), v.get("password")
        if v.get("auth"):
            try:
                user, _, pw = base64.b64decode(v["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise HostError(f"registry credentials file {p}: auths[{k!r}].auth is not base64 of user:password") from None
        return Credentials(user, pw, v.get("identitytoken"), str(p))
    return None


def _ssl_context(registry: str, ca_bundle: Path | None = None, certs_d: Path = CERTS_D) -> ssl.SSLContext:
    bundle = str(ca_bundle) if ca_bundle else None
    if not bundle:
        d = Path(certs_d) / registry / "ca.crt"
        bundle = str(d) if d.is_file() else None
    ctx = ssl.create_default_context()
    if bundle:
        try:
            ctx.load_verify_locations(bundle)
        except (OSError, ssl.SSLError) as e:
            raise HostError(f"CA bundle {bundle} for registry {registry} is unreadable: {e}") from None
    return ctx


def _insecure(registry: str, insecure: Iterable[str] = ()) -> bool:
    return registry in {h.strip() for h in insecure if h.strip()}


# -- the client


class _Auth:
    """The Authorization header for the registry, from a 401 challenge (basic or bearer)."""

    def __init__(self, registry: str, repo: str, creds: Credentials | None):
        self.registry, self.repo, self.creds = registry, repo, creds
        self.header: str | None = None
        self.mu = threading.Lock()

    def _basic(self) -> str:
        c = self.creds
        return "Basic " + base64.b64encode(f"{c.username}:{c.password}".encode()).decode()

    def challenge(self, client: httpx.Client, www: str, where: str) -> None:
        """Answer the challenge ``www`` (a WWW-Authenticate value); raises HostError when there is
        nothing to answer with or the token service refuses."""
        scheme, _, rest = www.partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        src = str(auth_file())
        if scheme.lower() == "basic":
            if self.creds is None or self.creds.username is None:
                raise HostError(f"{where}: the registry wants a login and {src} has none for {self.registry} "
                                f"(run `docker login {self.registry}` or set REGISTRY_AUTH_FILE)")
            self.header = self._basic()
            return
        if scheme.lower() != "bearer" or "realm" not in params:
            raise HostError(f"{where}: unsupported authentication challenge {www!r}")
        scope = params.get("scope") or f"repository:{self.repo}:pull,push,delete"
        q = {"service": params.get("service", ""), "scope": scope}
        headers = {}
        if self.creds is not None and self.creds.identitytoken:
            try:
                r = client.post(params["realm"], data={"grant_type": "refresh_token", "refresh_token": self.creds.identitytoken,
                                                       "service": q["service"], "scope": scope, "client_id": "warmctl"})
            except httpx.HTTPError as e:
                raise TransientBackendError(f"{where}: token service {params['realm']} unreachable: {e}") from e
        else:
            if self.creds is not None and self.creds.username is not None:
                headers["Authorization"] = self._basic()
            try:
                r = client.get(params["realm"] + ("&" if "?" in params["realm"] else "?") + urlencode(q), headers=headers)
            except httpx.HTTPError as e:
                raise TransientBackendError(f"{where}: token service {params['realm']} unreachable: {e}") from e
        if r.status_code >= 500 or r.status_code == 429:
            raise TransientBackendError(f"{where}: token service {params['realm']} answered HTTP {r.status_code}")
        if r.status_code != 200:
            who = f"user {self.creds.username!r} from {self.creds.source}" if self.creds and self.creds.username else f"no login ({src} has none for {self.registry})"
            raise HostError(f"{where}: the registry's token service refused {who}: HTTP {r.status_code}; check the credentials")
        try:
            doc = r.json()
            token = doc.get("token") or doc["access_token"]
        except (ValueError, KeyError, AttributeError):
            raise HostError(f"{where}: token service {params['realm']} sent no token") from None
        self.header = f"Bearer {token}"


class OCIBackend(Backend):
    """A store in repository ``repo`` of registry ``registry`` (``HOST[:PORT]``); see the module
    docstring for the layout, protocol and errors. ``pack_bytes``: largest pack (bytes, default
    :data:`PACK_BYTES`); ``read_deadline``: seconds one metadata read may take in all;
    ``ca_bundle``/``certs_d``: where the registry's CA is found; ``insecure``: registries
    (``host:port``) spoken to in plain HTTP. :func:`warmctl.store.open_backend` passes the
    ``oci_*`` settings."""

    properties = BackendProperties(local=False, prefetch=False, workers=16)

    def __init__(self, registry: str, repo: str, pack_bytes: int | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 20.0, *, read_deadline: float = READ_DEADLINE, ca_bundle: Path | None = None,
                 certs_d: Path = CERTS_D, insecure: Iterable[str] = ()):
        self.registry, self.repo = registry, repo
        self.pack_bytes = pack_bytes or PACK_BYTES
        self.read_deadline = read_deadline
        self.certs_d = Path(certs_d)
        self.scheme = "http" if _insecure(registry, insecure) else "https"
        self.base = f"{self.scheme}://{registry}"
        self.read_timeout = read_timeout
        self.client = httpx.Client(
            verify=_ssl_context(registry, ca_bundle, certs_d) if self.scheme == "https" else False,
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=60.0),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
            follow_redirects=False, trust_env=True,
        )
        self.auth = _Auth(registry, repo, credentials(registry))
        self._mu = threading.Lock()
        self._chunks: dict[str, tuple[str, int, int]] = {}  # chunk digest -> (pack, offset, length)
        self._packs: dict[str, _Pack] = {}  # pack digest -> its index (uploaded packs)
        self._artifacts: dict[str, _Artifact] = {}  # warmctl manifest digest -> its artifact
        self._scanned = False
        self._scan_mu = threading.Lock()
        self._open: list[_OpenPack] = []  # packs being filled (free ones)
        self._filling: dict[str, _OpenPack] = {}  # chunk digest -> the open/full pack holding it
        self._full: list[_OpenPack] = []  # full, not yet uploaded
        self._open_sem = threading.BoundedSemaphore(OPEN_PACKS)
        self._have_blobs: set[str] = set()
        self._ranged: set[str] = set()  # packs read at least once (see _ranged_get)
        self._probing: dict[str, threading.Lock] = {}

    def __repr__(self) -> str:
        return f"OCIBackend({self.location()!r})"

    # -- naming

    def location(self, key: str = "") -> str:
        base = f"oci://{self.registry}/{self.repo}"
        if not key:
            return base
        d = _digest_from_chunk_key(key)
        if d is not None and d in self._chunks:
            pack, off, n = self._chunks[d]
            return f"{base}/{key} (pack blob {pack}, bytes {off}-{off + n - 1})"
        if key.startswith("manifests/sha256/"):
            return f"{base}:manifest-{key.rsplit('/', 1)[1]}"
        if d is None and not key.endswith("/"):
            return f"{base}:{object_tag(key)} ({key})"
        return f"{base}/{key}"

    def endpoint(self) -> str:
        return self.base

    # -- HTTP

    def _url(self, path: str) -> str:
        return f"{self.base}/v2/{self.repo}/{path}"

    def _send(self, method: str, url: str, what: str, *, headers: dict | None = None, content=None,
              stream: bool = False, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        """One request with authentication (a 401 challenge is answered, twice at most: a login,
        then a fresh token for an expired one); translates failures (module docstring).
        ``content``: bytes, or a function returning a fresh iterator of bytes per attempt.
        ``stream``: the caller reads and closes the response."""
        where = f"{what} at {self.base}"
        answered = 0
        while True:
            h = dict(headers or {})
            sent = self.auth.header
            if sent:
                h["Authorization"] = sent
            try:
                body = content() if callable(content) else content
                r = self.client.send(self.client.build_request(method, url, headers=h, content=body), stream=stream)
            except httpx.HTTPError as e:
                raise self._transport_error(where, e) from e
            if r.status_code == 401:
                www = r.headers.get("www-authenticate", "")
                r.close()
                if answered >= 2 or (answered and sent and sent.startswith("Basic")):
                    who = (f"user {self.auth.creds.username!r} from {self.auth.creds.source}" if self.auth.creds
                           else f"no login in {auth_file()}")
                    raise HostError(f"{where}: the registry refused the credentials ({who}); check them "
                                    f"(`docker login {self.registry}`, REGISTRY_AUTH_FILE)")
                with self.auth.mu:
                    if self.auth.header == sent:  # not answered by another thread meanwhile
                        self.auth.challenge(self.client, www, where)
                answered += 1
                continue
            if r.status_code in (301, 302, 303, 307, 308) and method in ("GET", "HEAD"):
                loc = urljoin(url, r.headers.get("location", ""))
                r.close()
                try:  # a redirect to blob storage: the registry's Authorization does not travel there
                    r = self.client.send(self.client.build_request(method, loc, headers=dict(headers or {})), stream=stream)
                except httpx.HTTPError as e:
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
        if isinstance(e, httpx.ConnectError) and ("CERTIFICATE_VERIFY_FAILED" in text or "certificate" in text.lower()):
            return HostError(f"{where}: TLS certificate rejected ({text}); install the registry's CA "
                             f"(the oci_ca_bundle setting, $WARMCTL_OCI_CA_BUNDLE, or {self.certs_d / self.registry / 'ca.crt'})")
        if isinstance(e, httpx.ConnectError) and ("WRONG_VERSION_NUMBER" in text or "record layer" in text):
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

    def _read_bounded(self, r: httpx.Response, limit: int, what: str, expect: int | None = None) -> bytes:
        """The body of streamed response ``r``: at most ``limit`` bytes (else IntegrityError), read
        within ``read_deadline`` seconds (else TransientBackendError); closes ``r``."""
        where = f"{what} at {self.base}"
        deadline = time.monotonic() + self.read_deadline
        out = bytearray()
        try:
            n = r.headers.get("content-length")
            if n is not None and n.isdigit() and int(n) > limit:
                raise IntegrityError(f"{where}: the registry offers {int(n):,} bytes, more than the {limit:,} allowed for it; refused")
            for b in r.iter_bytes():
                out += b
                if len(out) > limit:
                    raise IntegrityError(f"{where}: the registry sent more than the {limit:,} bytes allowed for it; refused")
                if time.monotonic() > deadline:
                    raise TransientBackendError(f"{where}: not read within {self.read_deadline:g} s")
        except httpx.HTTPError as e:
            raise self._transport_error(where, e) from e
        finally:
            r.close()
        if expect is not None and len(out) != expect:
            raise TransientBackendError(f"{where}: body cut short: {len(out)} of {expect} bytes")
        return bytes(out)

    def _get_manifest(self, ref: str, what: str) -> tuple[str, dict]:
        """(OCI digest, parsed manifest) of tag or digest ``ref``. Raises ObjectNotFound."""
        r = self._send("GET", self._url(f"manifests/{ref}"), what, headers={"Accept": f"{OCI_MANIFEST}, {OCI_INDEX}"}, stream=True)
        data = self._read_bounded(r, MAX_OCI_MANIFEST, what)
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

    def _get_blob(self, digest: str, limit: int, what: str, size: int | None = None) -> bytes:
        r = self._send("GET", self._url(f"blobs/{digest}"), what, stream=True)
        data = self._read_bounded(r, limit, what, size)
        if _sha(data) != digest:
            raise IntegrityError(f"{what}: blob {digest} in {self.location()} is corrupt (its bytes hash to {_sha(data)}); refused")
        return data

    def _put_blob(self, digest: str, data, size: int, what: str) -> None:
        """Upload a blob (monolithic: POST, then PUT with the digest) unless it exists.
        ``data``: bytes, or a zero-argument function returning an iterator of bytes."""
        if digest in self._have_blobs:
            return
        try:
            self._send("HEAD", self._url(f"blobs/{digest}"), what).close()
            self._have_blobs.add(digest)
            return
        except ObjectNotFound:
            pass
        r = self._send("POST", self._url("blobs/uploads/"), what, ok=(202,))
        loc = urljoin(self._url("blobs/uploads/"), r.headers.get("location", ""))
        r.close()
        sep = "&" if "?" in loc else "?"
        # ``data`` itself, not one iterator of it: a PUT refused for an expired token is sent
        # again, and its body must be whole again (_send calls a function once per attempt).
        self._send("PUT", f"{loc}{sep}digest={quote(digest)}", what, ok=(201,), content=data,
                   headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}).close()
        self._have_blobs.add(digest)

    def _put_manifest(self, ref: str, doc: dict, what: str) -> str:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        if len(data) > MAX_OCI_MANIFEST:
            raise HostError(f"{what}: the OCI manifest would be {len(data):,} bytes, over the registries' {MAX_OCI_MANIFEST:,}")
        self._send("PUT", self._url(f"manifests/{ref}"), what, ok=(201,), content=data,
                   headers={"Content-Type": OCI_MANIFEST}).close()
        return _sha(data)

    def _delete_manifest(self, ref: str, what: str) -> None:
        try:
            r = self._send("HEAD", self._url(f"manifests/{ref}"), what, headers={"Accept": f"{OCI_MANIFEST}, {OCI_INDEX}"})
        except ObjectNotFound:
            return
        digest = r.headers.get("docker-content-digest")
        r.close()
        if not digest:
            digest, _ = self._get_manifest(ref, what)
        try:
            self._send("DELETE", self._url(f"manifests/{digest}"), what, ok=(202, 200)).close()
        except ObjectNotFound:
            pass

    def tags(self) -> list[str]:
        """Every tag of the repository (the paginated tags list; none for a repository not yet
        created)."""
        out: list[str] = []
        url = self._url("tags/list?n=1000")
        while url:
            try:
                r = self._send("GET", url, "list tags", stream=True)
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

    # -- snapshots, packs and chunks

    def _artifact(self, hexd: str, doc: dict | None = None) -> "_Artifact":
        """The artifact of manifest ``sha256:<hexd>`` (read and remembered). Raises ObjectNotFound."""
        digest = f"sha256:{hexd}"
        with self._mu:
            a = self._artifacts.get(digest)
        if a is not None:
            return a
        what = f"snapshot artifact {self.registry}/{self.repo}:manifest-{hexd}"
        try:
            oci, doc = self._get_manifest(f"manifest-{hexd}", what)
        except ObjectNotFound:
            raise ObjectNotFound(f"manifests/sha256/{hexd}", self.location(f"manifests/sha256/{hexd}")) from None
        layers = doc["layers"]
        if not layers or layers[0].get("digest") != digest:
            raise IntegrityError(f"{what}: its first layer is not manifest {digest}; refused")
        packs = {}
        sizes = {x.get("digest"): x.get("size") for x in layers if isinstance(x, dict) and x.get("mediaType") == INDEX_LAYER}
        for i, lay in enumerate(layers):
            if isinstance(lay, dict) and lay.get("mediaType") == PACK_LAYER:
                idx = (lay.get("annotations") or {}).get(INDEX_ANNOTATION)
                isize = sizes.get(idx)
                if not isinstance(idx, str) or not isinstance(isize, int):
                    raise IntegrityError(f"{what}: pack {lay.get('digest')} (layer {i}) names no index layer; refused")
                packs[lay["digest"]] = (idx, isize, int(lay.get("size", 0)))
        a = _Artifact(oci, int(layers[0].get("size", 0)), _mtime((doc.get("annotations") or {}).get(CREATED)), packs)
        with self._mu:
            self._artifacts[digest] = a
        return a

    def _load_index(self, pack: str, idx: str, isize: int, psize: int) -> None:
        with self._mu:
            if pack in self._packs:
                return
        what = f"index {idx} of pack {pack}"
        try:
            doc = json.loads(self._get_blob(idx, MAX_INDEX, what, isize))
            chunks = {c[0]: (int(c[1]), int(c[2])) for c in doc["chunks"]}
            created = _mtime(doc.get("created"))
            if doc.get("pack") != pack:
                raise ValueError(f"it indexes {doc.get('pack')}")
        except ObjectNotFound:
            raise IntegrityError(f"{what} is missing from {self.location()} (the snapshot artifact names it); "
                                 "the snapshot is incomplete") from None
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise IntegrityError(f"{what} in {self.location()} is unreadable: {e}") from None
        for d, (off, n) in chunks.items():
            if off < 0 or n <= 0 or off + n > psize:
                raise IntegrityError(f"{what}: chunk {d} at bytes {off}+{n} lies outside the {psize}-byte pack; refused")
        with self._mu:
            self._packs[pack] = _Pack(pack, psize, idx, isize, created, chunks)
            for d, (off, n) in chunks.items():
                self._chunks.setdefault(d, (pack, off, n))

    def _load_artifact_indexes(self, a: "_Artifact") -> None:
        todo = [(p, i, s, ps) for p, (i, s, ps) in a.packs.items() if p not in self._packs]
        if not todo:
            return
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda t: self._load_index(*t), todo))

    def _scan(self) -> None:
        """Read every snapshot artifact of the repository and its pack indexes (once)."""
        with self._scan_mu:
            if self._scanned:
                return
            hexes = [t[len("manifest-"):] for t in self.tags() if t.startswith("manifest-") and _HEX64.match(t[9:])]

            def one(h: str) -> None:
                try:
                    self._load_artifact_indexes(self._artifact(h))
                except ObjectNotFound:
                    pass  # removed meanwhile

            with ThreadPoolExecutor(8) as ex:
                list(ex.map(one, hexes))
            self._scanned = True

    def _locate(self, digest: str) -> tuple[str, int, int] | None:
        loc = self._chunks.get(digest)
        if loc is None and not self._scanned:
            self._scan()
            loc = self._chunks.get(digest)
        return loc

    def _save_chunk(self, digest: str, data: bytes | memoryview) -> None:
        with self._mu:
            known = digest in self._filling or digest in self._chunks
        if not known:
            self._open_sem.acquire()
            try:
                with self._mu:
                    p = self._open.pop() if self._open else None
                if p is None:
                    p = _OpenPack()
                with self._mu:
                    if digest in self._filling:  # another thread saved it meanwhile
                        self._open.append(p)
                        p = None
                if p is not None:
                    p.add(digest, data)
                    with self._mu:
                        self._filling[digest] = p
                        (self._full if p.size >= self.pack_bytes else self._open).append(p)
            finally:
                self._open_sem.release()
        self._upload_full()

    def _upload_full(self, everything: bool = False) -> None:
        """Upload the full packs (with ``everything``, the open ones too) and their indexes."""
        while True:
            with self._mu:
                if everything and self._open:
                    self._full.extend(self._open)
                    self._open.clear()
                if not self._full:
                    return
                p = self._full.pop()
            try:
                self._upload_pack(p)
            except BaseException:
                with self._mu:
                    self._full.append(p)  # a retry uploads it again
                raise

    def _upload_pack(self, p: "_OpenPack") -> None:
        digest, size = p.digest(), p.size
        what = f"upload pack {digest} ({size:,} bytes, {len(p.chunks)} chunks)"
        self._put_blob(digest, p.reader, size, what)
        created = _now_iso()
        index = pack_index(digest, created, p.chunks)
        idx = _sha(index)
        self._put_blob(idx, index, len(index), f"upload index of pack {digest}")
        with self._mu:
            self._packs[digest] = _Pack(digest, size, idx, len(index), _mtime(created), dict(p.chunks))
            for d, (off, n) in p.chunks.items():
                self._chunks[d] = (digest, off, n)
                self._filling.pop(d, None)
        p.close()

    def _save_manifest(self, hexd: str, data: bytes | memoryview) -> None:
        from warmctl.manifest import Manifest
        from warmctl.store import chunks as ck

        digest = f"sha256:{hexd}"
        data = bytes(data)
        what = f"push snapshot artifact manifest-{hexd}"
        if _sha(data) != digest:
            raise IntegrityError(f"{what}: the bytes given hash to {_sha(data)}, not {digest}")
        try:
            m = Manifest.from_bytes(data)
        except ValueError as e:
            raise IntegrityError(f"{what}: not a manifest: {e}") from None
        self._upload_full(everything=True)  # every pack this writer filled, before naming them
        packs: dict[str, None] = {}
        missing = []
        for f in m.files:
            for c in f.chunks:
                if ck.is_zero_chunk(c.digest, c.size):
                    continue
                loc = self._locate(c.digest)
                if loc is None:
                    missing.append(c.digest)
                else:
                    packs[loc[0]] = None
        if missing:
            raise IntegrityError(f"{what}: {len(missing)} chunk(s) are in no pack of {self.location()}: {', '.join(missing[:5])}")
        self._put_blob(digest, data, len(data), what)
        self._put_blob(EMPTY_DESC["digest"], EMPTY_BLOB, len(EMPTY_BLOB), what)
        created = _now_iso()
        doc = snapshot_artifact(digest, len(data), m.name, created,
                                [(pd, self._packs[pd].size, self._packs[pd].index, self._packs[pd].index_size) for pd in packs])
        oci = self._put_manifest(f"manifest-{hexd}", doc, what)
        with self._mu:
            self._artifacts[digest] = _Artifact(oci, len(data), _mtime(created),
                                                {pd: (self._packs[pd].index, self._packs[pd].index_size, self._packs[pd].size) for pd in packs})

    # -- small objects

    def _object(self, key: str) -> tuple[str, dict]:
        tag = object_tag(key)
        oci, doc = self._get_manifest(tag, f"object {key} (tag {tag})")
        ann = doc.get("annotations") or {}
        if ann.get(KEY_ANNOTATION) != key or len(doc["layers"]) != 1:
            raise IntegrityError(f"{self.location(key)}: the artifact under tag {tag} holds {ann.get(KEY_ANNOTATION)!r}, not {key!r}; refused")
        return oci, doc

    def _save_object(self, key: str, data: bytes | memoryview) -> None:
        data = bytes(data)
        digest = _sha(data)
        tag = object_tag(key)
        what = f"save {key} (tag {tag})"
        self._put_blob(digest, data, len(data), what)
        self._put_blob(EMPTY_DESC["digest"], EMPTY_BLOB, len(EMPTY_BLOB), what)
        try:
            old, _ = self._object(key)
        except ObjectNotFound:
            old = None
        doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": OBJECT_TYPE, "config": EMPTY_DESC,
               "layers": [_desc(OBJECT_LAYER, digest, len(data))],
               "annotations": {KEY_ANNOTATION: key, CREATED: _now_iso()}}
        new = self._put_manifest(tag, doc, what)
        if old and old != new:  # the replaced version, now untagged
            try:
                self._send("DELETE", self._url(f"manifests/{old}"), what, ok=(202, 200)).close()
            except (ObjectNotFound, HostError):
                pass

    # -- the Backend interface

    def save(self, key: str, data: bytes | memoryview) -> None:
        d = _digest_from_chunk_key(key)
        if d is not None:
            return self._save_chunk(d, data)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            return self._save_manifest(key[17:], data)
        return self._save_object(key, data)

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        d = _digest_from_chunk_key(key)
        if d is not None:
            return self._load_chunk(key, d, offset, length)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            a = self._artifact(key[17:])
            data = self._get_blob(f"sha256:{key[17:]}", MAX_MANIFEST, f"manifest {key[17:][:12]}", a.size)
            self._load_artifact_indexes(a)
        else:
            _, doc = self._object(key)
            layer = doc["layers"][0]
            data = self._get_blob(layer["digest"], MAX_OBJECT, self.location(key), layer.get("size"))
        if length is not None or offset:
            return data[offset: None if length is None else offset + length]
        return data

    def _load_chunk(self, key: str, d: str, offset: int, length: int | None) -> bytes:
        with self._mu:
            p = self._filling.get(d)
        if p is not None:
            off, n = p.chunks[d]
            return p.read(off + offset, (n - offset) if length is None else min(length, n - offset))
        loc = self._locate(d)
        if loc is None:
            raise ObjectNotFound(key, self.location(key))
        pack, off, n = loc
        start = off + offset
        want = (n - offset) if length is None else min(length, n - offset)
        if want <= 0:
            return b""
        with self._mu:
            first = None if pack in self._ranged else self._probing.setdefault(pack, threading.Lock())
        if first is None:
            return self._ranged_get(key, d, pack, start, want, False)
        with first:  # the first read of a pack: alone (see _ranged_get)
            if pack in self._ranged:
                first = None
            else:
                data = self._ranged_get(key, d, pack, start, want, True)
                with self._mu:
                    self._ranged.add(pack)
                return data
        return self._ranged_get(key, d, pack, start, want, False)

    def _ranged_get(self, key: str, d: str, pack: str, start: int, want: int, first: bool) -> bytes:
        """Bytes ``[start, start+want)`` of blob ``pack`` (chunk ``d``), by a ranged GET.

        A registry answers 206 with the range. A pull-through mirror that does not hold the pack
        yet (Distribution's proxy, for one) ignores the Range and streams the whole blob from its
        origin while keeping it: with ``first`` (the first read of this pack by this process,
        which other readers of the pack wait for) such a body is read to its end, so the mirror
        finishes its copy and the origin serves the pack once; the later reads get ranges from the
        mirror. Without ``first``, a whole-blob answer is read only up to the range wanted."""
        what = f"load chunk {d} from pack {pack}"
        try:
            r = self._send("GET", self._url(f"blobs/{pack}"), what, stream=True, ok=(200, 206),
                           headers={"Range": f"bytes={start}-{start + want - 1}"})
        except ObjectNotFound:
            raise ObjectNotFound(key, self.location(key)) from None
        where = f"{what} at {self.base}"
        try:
            if r.status_code == 206:
                cr = r.headers.get("content-range", "")
                if not cr.startswith(f"bytes {start}-"):
                    raise TransientBackendError(f"{where}: asked for bytes {start}- but got range {cr!r}")
                data = r.read()
            else:  # the Range was ignored (a pull-through mirror filling its cache): skip to ours
                out, pos = bytearray(), 0
                for b in r.iter_bytes():
                    if pos + len(b) > start and len(out) < want:
                        out += b[max(0, start - pos): start + want - pos]
                    pos += len(b)
                    if len(out) >= want and not first:
                        break
                data = bytes(out[:want])
        except httpx.HTTPError as e:
            raise self._transport_error(where, e) from e
        finally:
            r.close()
        if len(data) != want:
            raise TransientBackendError(f"{where}: body cut short: {len(data)} of {want} bytes")
        if first and r.status_code == 200:
            self._wait_cached(pack)
        return data

    def _wait_cached(self, pack: str, limit: float = 30.0) -> None:
        """After a whole-blob answer to the first read of ``pack`` (a pull-through mirror that did
        not hold it), wait until the mirror answers a 1-byte range (206: its copy is committed),
        for up to ``limit`` seconds, so that the reads waiting for this pack do not each make the
        mirror fetch it from its origin again. Each probe that comes too early costs the origin
        one cut-short fetch; the probes start after 0.25 s and back off to 2 s."""
        delay, deadline = 0.25, time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(2.0, delay * 2)
            try:
                r = self._send("GET", self._url(f"blobs/{pack}"), f"probe pack {pack}", stream=True, ok=(200, 206),
                               headers={"Range": "bytes=0-0"})
                st = r.status_code
                r.close()
            except (TransientBackendError, ObjectNotFound):
                return  # the reads themselves will say what is wrong
            if st == 206:
                return
        log.debug("pack %s: the registry still answers whole blobs after %g s", pack, limit)

    def stat(self, key: str) -> ObjectInfo:
        d = _digest_from_chunk_key(key)
        if d is not None:
            with self._mu:
                p = self._filling.get(d)
            if p is not None:
                return ObjectInfo(key, p.chunks[d][1], time.time())
            loc = self._locate(d)
            if loc is None:
                raise ObjectNotFound(key, self.location(key))
            pk = self._packs[loc[0]]
            return ObjectInfo(key, loc[2], pk.created)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            a = self._artifact(key[17:])
            return ObjectInfo(key, a.size, a.created)
        _, doc = self._object(key)
        return ObjectInfo(key, int(doc["layers"][0].get("size", 0)), _mtime((doc.get("annotations") or {}).get(CREATED)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        out: list[ObjectInfo] = []
        if "chunks/".startswith(prefix) or prefix.startswith("chunks/"):
            self._scan()
            with self._mu:
                items = [(d, loc) for d, loc in self._chunks.items()]
            for d, (pack, _, n) in items:
                k = chunk_key(d)
                if k.startswith(prefix):
                    out.append(ObjectInfo(k, n, self._packs[pack].created))
        tags = self.tags()
        if "manifests/".startswith(prefix) or prefix.startswith("manifests/"):
            for t in tags:
                if t.startswith("manifest-") and _HEX64.match(t[9:]) and f"manifests/sha256/{t[9:]}".startswith(prefix):
                    try:
                        a = self._artifact(t[9:])
                    except ObjectNotFound:
                        continue
                    out.append(ObjectInfo(f"manifests/sha256/{t[9:]}", a.size, a.created))
        cands = [t for t in tags if _tag_may_hold(t, prefix)]

        def one(t: str) -> ObjectInfo | None:
            try:
                _, doc = self._get_manifest(t, f"object under tag {t}")
            except ObjectNotFound:
                return None
            ann = doc.get("annotations") or {}
            key = ann.get(KEY_ANNOTATION)
            if doc.get("artifactType") != OBJECT_TYPE or not isinstance(key, str) or not key.startswith(prefix):
                return None
            if object_tag(key) != t:
                log.warning("ignoring %s:%s: it claims key %r, whose tag is %s", self.location(), t, key, object_tag(key))
                return None
            return ObjectInfo(key, int(doc["layers"][0].get("size", 0)), _mtime(ann.get(CREATED)))

        with ThreadPoolExecutor(8) as ex:
            out += [o for o in ex.map(one, cands) if o is not None]
        return iter(out)

    def remove(self, key: str) -> None:
        d = _digest_from_chunk_key(key)
        if d is not None:
            return self._remove_chunk(d)
        if key.startswith("manifests/sha256/") and _HEX64.match(key[17:]):
            try:  # its packs stay known, so that gc can free the chunks no other snapshot uses
                self._load_artifact_indexes(self._artifact(key[17:]))
            except (ObjectNotFound, IntegrityError):
                pass
            self._delete_manifest(f"manifest-{key[17:]}", f"remove snapshot artifact manifest-{key[17:]}")
            with self._mu:
                self._artifacts.pop(f"sha256:{key[17:]}", None)
            return
        self._delete_manifest(object_tag(key), f"remove {key} (tag {object_tag(key)})")

    def _remove_chunk(self, d: str) -> None:
        """Forget chunk ``d``; once no chunk of its pack is left, delete the pack and its index
        blob (a pack shared with a live snapshot keeps its dead chunks: see docs)."""
        self._scan()
        with self._mu:
            loc = self._chunks.pop(d, None)
            if loc is None:
                return
            pack = self._packs.get(loc[0])
            if pack is None:
                return
            pack.live.discard(d)
            if pack.live or any(loc[0] in a.packs for a in self._artifacts.values()):
                return
        for blob in (pack.digest, pack.index):
            try:
                self._send("DELETE", self._url(f"blobs/{blob}"), f"remove pack blob {blob}", ok=(202, 200)).close()
            except ObjectNotFound:
                pass
            self._have_blobs.discard(blob)

    def close(self) -> None:
        with self._mu:
            pend = self._open + self._full
            self._open, self._full = [], []
            self._filling.clear()
        for p in pend:  # chunks no manifest named: never uploaded, like a killed writer's
            p.close()
        self.client.close()


@dataclass
class _Artifact:
    oci_digest: str
    size: int  # bytes of the warmctl manifest
    created: float
    packs: dict[str, tuple[str, int, int]]  # pack -> (index digest, index size, pack size)


@dataclass
class _Pack:
    digest: str
    size: int
    index: str
    index_size: int
    created: float
    chunks: dict[str, tuple[int, int]]
    live: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.live = set(self.chunks)


class _OpenPack:
    """A pack being filled: chunk objects appended to a temporary file, hashed as they come."""

    def __init__(self) -> None:
        self.f = tempfile.TemporaryFile(prefix="warmctl-pack-")
        self.sha = hashlib.sha256()
        self.size = 0
        self.chunks: dict[str, tuple[int, int]] = {}

    def add(self, digest: str, data: bytes | memoryview) -> None:
        n = len(data)
        os.pwrite(self.f.fileno(), data, self.size)
        self.sha.update(data)
        self.chunks[digest] = (self.size, n)
        self.size += n

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()

    def read(self, off: int, n: int) -> bytes:
        return os.pread(self.f.fileno(), n, off)

    def reader(self) -> Iterator[bytes]:
        off = 0
        while off < self.size:
            b = os.pread(self.f.fileno(), min(8 << 20, self.size - off), off)
            if not b:
                raise OSError(f"pack spool file shrank at byte {off}")
            off += len(b)
            yield b

    def close(self) -> None:
        self.f.close()
