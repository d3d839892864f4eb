"""Who warmctl is to a registry: credentials (the Docker/OCI conventions, :func:`credentials`),
the TLS context (:func:`ssl_context`), and the 401 challenge answered as httpx authentication
(:class:`RegistryAuth`: basic auth, or the bearer-token flow of the distribution spec's token
service; an expired token is fetched again once)."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import threading
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlparse

import httpx

from warmctl.base.errors import HostError
from warmctl.store.backend import TransientBackendError

#: Docker's per-registry certificate directory (``HOST[:PORT]/ca.crt`` below it).
CERTS_D = Path("/etc/docker/certs.d")


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


def ssl_context(registry: str, ca_bundle: Path | None = None, certs_d: Path = CERTS_D) -> ssl.SSLContext:
    """The TLS context for ``registry``: the system's CAs plus ``ca_bundle``, else
    ``certs_d/HOST[:PORT]/ca.crt`` when it exists. Raises :class:`HostError` for an unreadable
    bundle, naming it."""
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


def is_insecure(registry: str, insecure: Iterable[str] = ()) -> bool:
    """Whether ``registry`` (``HOST[:PORT]``) is one of ``insecure`` (spoken to in plain HTTP)."""
    return registry in {h.strip() for h in insecure if h.strip()}


class Login:
    """This process's standing with one registry, shared by every request to it: the
    ``Authorization`` value last obtained (``header``; None before the first challenge) and the
    credentials to answer a challenge with (``creds``; None: anonymous). ``mu`` serialises
    answering, so that concurrent requests refused at once fetch one token, not one each."""

    def __init__(self, registry: str, repo: str, creds: Credentials | None):
        self.registry, self.repo, self.creds = registry, repo, creds
        self.header: str | None = None
        self.mu = threading.Lock()

    def _basic(self) -> str:
        c = self.creds
        assert c is not None
        return "Basic " + base64.b64encode(f"{c.username}:{c.password}".encode()).decode()

    def who(self) -> str:
        """The login, for messages: ``user 'NAME' from FILE``, or that there is none."""
        return (f"user {self.creds.username!r} from {self.creds.source}" if self.creds
                else f"no login in {auth_file()}")

    def challenge(self, client: httpx.Client, www: str, where: str) -> None:
        """Answer the challenge ``www`` (a WWW-Authenticate value): basic auth, or a bearer token
        from the token service it names (a refresh token, else a GET with basic auth or none),
        fetched with ``client``. Raises :class:`HostError` when there is nothing to answer with
        or the token service refuses, :class:`TransientBackendError` when it cannot be reached
        or fails (5xx, 429). ``where``: the request's object and registry, for messages."""
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


class RegistryAuth(httpx.Auth):
    """The registry's 401 challenge as an httpx authentication flow, for one request: the
    ``Authorization`` of ``login`` is sent; a 401 is answered (:meth:`Login.challenge`) and the
    request sent again, twice at most (a login, then a fresh token for one that expired
    meanwhile); still refused, or refused again after basic auth: :class:`HostError` naming the
    login. ``body``: for a request whose body is an iterator, the function that makes it, called
    again for each new attempt (a refused upload is sent again whole). ``where`` names the
    request in messages. Redirects are httpx's (``follow_redirects``): each attempt follows them,
    and httpx drops the ``Authorization`` on a redirect to another origin (blob storage)."""

    def __init__(self, login: Login, client: httpx.Client, where: str, body: Callable[[], Any] | None = None):
        self.login, self.client, self.where, self.body = login, client, where, body

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        login = self.login
        answered = 0
        while True:
            sent = login.header
            if sent:
                request.headers["Authorization"] = sent
            response = yield request
            if response.status_code != 401:
                return
            www = response.headers.get("www-authenticate", "")
            if answered >= 2 or (answered and sent and sent.startswith("Basic")):
                raise HostError(f"{self.where}: the registry refused the credentials ({login.who()}); check them "
                                f"(`docker login {login.registry}`, REGISTRY_AUTH_FILE)")
            with login.mu:
                if login.header == sent:  # not answered by another request meanwhile
                    login.challenge(self.client, www, self.where)
            answered += 1
            if self.body is not None:  # an iterator body is spent: the next attempt gets a fresh one
                request = httpx.Request(request.method, request.url, headers=request.headers, content=self.body())
