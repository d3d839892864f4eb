"""Credentials: what looks like one, every secret value warmctl can know on this host, and the
scan that keeps them out of a snapshot.

A snapshot is the engine's whole memory, copied to every node of a fleet and to a shared
bucket; whatever secret the engine holds is published with it. Three lines of defence:

1. the engine's environment is declared, not inherited (:func:`warmctl.engine.vllm.engine_environment`);
2. a profile cannot carry a credential (:func:`profile_problems`, run by profile validation):
   neither by name (the name rule below) nor inside a value (the shape rules, :func:`shape_rules`);
3. before ``snapshot`` stores anything, every byte it would store is scanned for every secret
   value warmctl can know here (:func:`known_secrets`, :func:`scan_files`,
   :func:`refuse_if_found`), all of them in one pass (Hyperscan); a match refuses to publish,
   naming where the secret came from and the file it was found in, never the value.

**The shape rules** (:func:`shape_rules`, :func:`find_shapes`). A value looks like it holds a
credential when it matches one: a URL's ``user:password@`` in any scheme, a PEM private key,
cloud, hub and registry tokens (the expressions of Yelp's detect-secrets plugins, listed in
:data:`_DETECT_SECRETS_RULES`, read from the plugins' source by :func:`plugin_denylist`), and warmctl's own for what those lack (Hugging Face, Docker
Hub and GitHub fine-grained tokens, Google API keys, ``Authorization``/``Bearer`` values and
``Basic`` strings that decode to ``user:password``). What the scan searches for is the secret
*part* (the URL's password, the token), never the whole value.

**The name rule** (:func:`credential_name`). A variable or flag name is split into words at
``_`` and ``-`` (case ignored). It looks like a credential when a word is one of
:data:`CREDENTIAL_WORDS` (``TOKEN``, ``KEY``, ``SECRET``, ``PASSWORD``, ``PASSWD``,
``CREDENTIAL(S)``, ``APIKEY``, ``KEYFILE``, ``AUTH``), except ``TOKEN`` followed by one of
:data:`TOKEN_COUNT_WORDS` (``THRESHOLD``, ``IDS``, ``COUNT``, ...): a count of text tokens,
as in vLLM's ``VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD`` or ``--long-prefill-token-threshold``.
Plurals (``TOKENS``, ``KEYS``) are counts and sets, not credentials (``--max-tokens``).

**Short values** (fewer than :data:`MIN_SECRET_BYTES` = 8 bytes) are not scanned for: such a
value (``1``, ``true``, a port) occurs by chance in any image of gigabytes and protects
nothing as a secret; the scan says how many it skipped.
"""

from __future__ import annotations

import base64
import functools
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from warmctl.base.errors import WarmctlError

if TYPE_CHECKING:
    from warmctl.records.config import Settings

#: Words that make a name look like a credential (see the module doc).
CREDENTIAL_WORDS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS",
                              "APIKEY", "KEYFILE", "AUTH"})
#: ``TOKEN`` followed by one of these counts text tokens (a vLLM knob), it is no credential.
TOKEN_COUNT_WORDS = frozenset({"THRESHOLD", "THRESHOLDS", "IDS", "COUNT", "LIMIT", "BUDGET", "LEN", "LENGTH",
                               "SIZE", "NUM"})
#: Values shorter than this many bytes are not scanned for (module doc).
MIN_SECRET_BYTES = 8
#: A file named by a credential-looking variable (``..._FILE``, ``..._PATH``) is read as a
#: token file when it is at most this many bytes.
MAX_TOKEN_FILE_BYTES = 1 << 16


class SecretInSnapshot(WarmctlError):
    """A secret value warmctl knows was found in a file ``snapshot`` was about to store (or in
    the manifest): nothing was stored. The message names the secret's source and the file,
    never the value."""


def credential_name(name: str) -> bool:
    """Whether the variable or flag ``name`` (``HF_TOKEN``, ``--api-key``) looks like a
    credential by the name rule of the module doc."""
    words = [w for w in re.split(r"[_\-]+", name.upper()) if w]
    for i, w in enumerate(words):
        if w in CREDENTIAL_WORDS:
            if w == "TOKEN" and i + 1 < len(words) and words[i + 1] in TOKEN_COUNT_WORDS:
                continue
            return True
    return False


# --- what a value looks like ----------------------------------------------------------------


@dataclass(frozen=True)
class ShapeRule:
    """A rule that recognises a credential by the shape of a value (not by its variable's
    name): ``name`` (``url-userinfo``), ``what`` it finds (for messages; never the value),
    ``origin`` (the detect-secrets plugin whose expressions it uses, or ``warmctl``),
    ``patterns`` (compiled expressions) and ``parts``, how the secret part of a match is taken
    (:func:`find_shapes`): ``match`` (the groups of at least :data:`MIN_SECRET_BYTES` bytes,
    else the whole match), ``userinfo`` (the password, and ``user:password``), ``pem`` (the
    key's body, :func:`pem_key_values`), ``basic`` (a base64 ``user:password``, and it
    decoded)."""

    name: str
    what: str
    origin: str
    patterns: tuple[re.Pattern, ...] = field(repr=False)
    parts: str = "match"


#: The detect-secrets plugins whose expressions are shape rules: (rule name, what it finds,
#: module, class, how its secret part is taken). Plugins left out: the keyword and entropy
#: heuristics and the public-IP rule (they fire on model revisions, digests and addresses),
#: and the Artifactory, Twilio, Mailchimp, IBM and Softlayer rules (short prefixes of plain
#: words or lower-case hex that model paths and revisions share).
_DETECT_SECRETS_RULES = (
    ("url-userinfo", "a password in a URL (scheme://user:password@host)", "basic_auth", "BasicAuthDetector", "userinfo"),
    ("private-key", "a PEM private key block", "private_key", "PrivateKeyDetector", "pem"),
    ("aws-access-key", "an AWS access key", "aws", "AWSKeyDetector", "match"),
    ("azure-storage-key", "an Azure storage account key", "azure_storage_key", "AzureStorageKeyDetector", "match"),
    ("github-token", "a GitHub token", "github_token", "GitHubTokenDetector", "match"),
    ("gitlab-token", "a GitLab token (also its registry and deploy tokens)", "gitlab_token", "GitLabTokenDetector",
     "match"),
    ("jwt", "a JSON Web Token", "jwt", "JwtTokenDetector", "match"),
    ("npm-token", "an npm token", "npm", "NpmDetector", "match"),
    ("pypi-token", "a PyPI token", "pypi_token", "PypiTokenDetector", "match"),
    ("openai-key", "an OpenAI API key", "openai", "OpenAIDetector", "match"),
    ("slack-token", "a Slack token or webhook", "slack", "SlackDetector", "match"),
    ("stripe-key", "a Stripe key", "stripe", "StripeDetector", "match"),
    ("sendgrid-key", "a SendGrid API key", "sendgrid", "SendGridDetector", "match"),
    ("discord-token", "a Discord bot token", "discord", "DiscordBotTokenDetector", "match"),
    ("telegram-token", "a Telegram bot token", "telegram_token", "TelegramBotTokenDetector", "match"),
    ("square-oauth", "a Square OAuth secret", "square_oauth", "SquareOAuthDetector", "match"),
)
#: warmctl's own shape rules, for what detect-secrets 1.5 has no plugin for:
#: (name, what, expressions, how the secret part is taken).
_WARMCTL_RULES = (
    ("huggingface-token", "a Hugging Face token",
     (r"\b(hf_[A-Za-z0-9]{30,})\b", r"\b(api_org_[A-Za-z0-9]{30,})\b"), "match"),
    ("registry-token", "a container registry token (Docker Hub, GitHub fine-grained)",
     (r"\b(dckr_(?:pat|oat)_[A-Za-z0-9_\-]{20,})", r"\b(github_pat_[A-Za-z0-9_]{22,})"), "match"),
    ("google-api-key", "a Google API key", (r"\b(AIza[0-9A-Za-z_\-]{35})",), "match"),
    ("authorization", "an Authorization header value or Bearer token",
     (r"(?i)\bauthorization\s*[:=]\s*[\"']?(?:(?:bearer|basic|token|digest|negotiate)\s+)?([A-Za-z0-9\-._~+/]{8,}=*)",
      r"(?i)\bbearer\s+([A-Za-z0-9\-._~+/]{8,}=*)"), "match"),
    ("basic-auth", "an HTTP basic-auth string (Basic base64 of user:password)",
     (r"(?i)\bbasic\s+([A-Za-z0-9+/]{8,}={0,2})",), "basic"),
)

#: Expressions warmctl adds to a detect-secrets rule: a URL whose userinfo is ``:password``
#: (no user name; redis and some registries), which BasicAuthDetector's expression needs a user for.
_EXTRA_PATTERNS = {"url-userinfo": (r"://:([^:/?#\[\]@!$&'()*+,;=\s]+)@",)}

_RULES: list[ShapeRule] | None = None


def _plugin_source(module: str) -> Path | None:
    """The source file of ``detect_secrets.plugins.<module>``, found without importing the
    package (None when detect-secrets is not installed as source files)."""
    plugins = _plugins_dir()
    path = None if plugins is None else plugins / f"{module}.py"
    return path if path is not None and path.is_file() else None


@functools.cache
def _plugins_dir() -> Path | None:
    """``detect_secrets/plugins``, looked up once per process (each lookup searches
    ``sys.path``), or None when the package is not found."""
    import importlib.util

    spec = importlib.util.find_spec("detect_secrets")  # a top-level package: found, not run
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "plugins"


def plugin_denylist(module: str, cls: str) -> tuple[re.Pattern, ...] | None:
    """The expressions (``denylist``) of detect-secrets' plugin ``cls`` in
    ``detect_secrets.plugins.<module>``, evaluated from the plugin's source file without
    importing it; None when they cannot be evaluated so (then :func:`shape_rules` imports the
    plugin). Importing any plugin runs the ``detect_secrets`` package, whose scanner imports
    every plugin and ``requests`` (70-90 ms of CPU on the development hosts, on every profile
    load, ``up``'s included); warmctl takes only the expressions. Evaluated: the module's
    top-level assignments and those of the class body up to ``denylist``, each with ``re`` and
    the names assigned before it (an assignment that needs anything else is skipped); the
    result must be a list or tuple of compiled expressions.
    ``tests/test_credentials.py`` checks the expressions equal those of the imported plugins."""
    import ast

    path = _plugin_source(module)
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    ns: dict = {"re": re}

    def assign(stmt: ast.stmt) -> None:
        if not isinstance(stmt, ast.Assign):
            return
        names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        if len(names) != len(stmt.targets):
            return
        try:
            value = eval(compile(ast.Expression(stmt.value), str(path), "eval"), ns)
        except Exception:  # needs a name this evaluation does not have: not an expression's part
            return
        for name in names:
            ns[name] = value

    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == cls:
            for inner in stmt.body:
                assign(inner)
                if isinstance(inner, ast.Assign) and any(getattr(t, "id", None) == "denylist" for t in inner.targets):
                    found = ns.get("denylist")
                    if isinstance(found, (list, tuple)) and found and all(isinstance(x, re.Pattern) for x in found):
                        return tuple(found)
                    return None
            return None
        assign(stmt)
    return None


def shape_rules() -> list[ShapeRule]:
    """Every shape rule, in the order they are tried (detect-secrets' first). The
    detect-secrets plugins' expressions are read from their source on the first call
    (:func:`plugin_denylist`, a few ms), else the plugin is imported (about 80 ms)."""
    global _RULES
    if _RULES is None:
        import importlib

        rules = []
        for name, what, module, cls, parts in _DETECT_SECRETS_RULES:
            denylist = plugin_denylist(module, cls)
            if denylist is None:
                denylist = tuple(getattr(importlib.import_module(f"detect_secrets.plugins.{module}"), cls).denylist)
            extra = tuple(re.compile(e) for e in _EXTRA_PATTERNS.get(name, ()))
            origin = f"detect-secrets {cls}" + (" and warmctl" if extra else "")
            rules.append(ShapeRule(name, what, origin, denylist + extra, parts))
        for name, what, exprs, parts in _WARMCTL_RULES:
            rules.append(ShapeRule(name, what, "warmctl", tuple(re.compile(e) for e in exprs), parts))
        _RULES = rules
    return _RULES


@dataclass(frozen=True)
class ShapeHit:
    """A value matched ``rule``; ``parts`` are its secret parts (what ``snapshot`` scans for;
    never printed). A match can have no part long enough to scan for (a PEM header alone)."""

    rule: ShapeRule
    parts: tuple[str, ...] = field(repr=False, default=())


_PEM_BLOCK = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----(.*?)-----END", re.S)


def _parts(rule: ShapeRule, m: re.Match, text: str) -> list[str]:
    if rule.parts == "userinfo":  # "://user:password@": the password, and user:password
        return [m.group(1), m.group(0)[3:-1]]
    if rule.parts == "pem":
        out: list[str] = []
        for block in _PEM_BLOCK.findall(text.replace("\\n", "\n")):
            out += [v.decode("latin-1") for v in pem_key_values(block)]
        return out
    if rule.parts == "basic":
        try:
            decoded = base64.b64decode(m.group(1), validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            return []
        return [m.group(1), decoded] if ":" in decoded and decoded.isprintable() else []
    groups = [g for g in m.groups() if g and len(g) >= MIN_SECRET_BYTES]
    return groups or [m.group(0)]


def find_shapes(text: str) -> list[ShapeHit]:
    """Every :func:`shape_rules` rule ``text`` matches, each once, with the secret parts of all
    its matches (each at most once). An HTTP ``Basic`` string counts only when it decodes to
    ``user:password``."""
    out = []
    if not text:
        return out
    for rule in shape_rules():
        parts: list[str] = []
        hit = False
        for pat in rule.patterns:
            for m in pat.finditer(text):
                p = _parts(rule, m, text)
                if rule.parts == "basic" and not p:
                    continue
                hit = True
                parts += [x for x in p if x and x not in parts]
        if hit:
            out.append(ShapeHit(rule, tuple(parts)))
    return out


# --- what a profile may not carry -----------------------------------------------------------

_GATE_KEYS = ("the public port's API keys belong to the gate: gate_api_key_file in the config "
              "(one key per line, mode 0600; docs/operations.md); the engine binds loopback only")
_GATE_TLS = "TLS belongs to the gate: gate_tls_cert and gate_tls_key in the config"
_RUNTIME = ("the engine runs offline (HF_HUB_OFFLINE=1): download the model beforehand; a credential the engine "
            "itself needs at start-up is passed by name at run time through engine_env_passthrough in the config "
            "(docs/operations.md), never written into a profile, and `snapshot` refuses to publish an image that holds it")
#: Flags with a specific place to go instead.
_FLAG_HOME = {"--api-key": _GATE_KEYS, "--ssl-keyfile": _GATE_TLS, "--ssl-certfile": _GATE_TLS,
              "--ssl-ca-certs": _GATE_TLS}
_ENV_HOME = {"VLLM_API_KEY": _GATE_KEYS}


_VALUE_HOME = ("a profile is published with every snapshot (its manifest, the catalog's profile record of every "
               "store it reaches) and the engine's memory holds its values: keep the credential out of the profile. "
               "Where it belongs: in a file the engine reads at run time, named by a *_FILE variable (mode 0600, never "
               "in a store), or in warmctl's environment, passed by name with engine_env_passthrough in the node's "
               "config (docs/operations.md, \"Credentials and snapshots\"); `snapshot` still refuses an image that "
               "holds it")
_URL_HOME = "write the URL without user:password@ here; "


def value_problem(field_: str, value: str) -> tuple[str, str] | None:
    """``(field, message)`` when ``value`` matches a shape rule (:func:`find_shapes`): the
    field, the rules it matched and where the credential belongs. Never the value."""
    hits = find_shapes(value)
    if not hits:
        return None
    rules = ", ".join(f"{h.rule.what} (rule {h.rule.name})" for h in hits)
    url = _URL_HOME if any(h.rule.name == "url-userinfo" for h in hits) else ""
    return field_, f"holds {rules}; {url}{_VALUE_HOME}"


def profile_problems(args: Iterable[str], env: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(field, message)`` for every credential a profile's ``engine.args`` / ``engine.env``
    carries: a credential-looking flag (``--api-key``, ``--hf-token``, ``--ssl-keyfile``, also
    as ``--flag=value``) and a credential-looking variable name (``HF_TOKEN``,
    ``AWS_SECRET_ACCESS_KEY``, ``VLLM_API_KEY``), then any other argument or variable whose
    value has the shape of a credential (:func:`find_shapes`: a URL's ``user:password@``, an
    ``Authorization``/``Bearer``/basic-auth string, a PEM private key, a cloud, hub or
    registry token). ``field`` is the dotted profile field (``engine.args.3``,
    ``engine.env.HF_TOKEN``); each message says which rule matched and where the thing belongs
    instead. Never the value."""
    out: list[tuple[str, str]] = []
    args = list(args)
    for i, a in enumerate(args):
        if not a.startswith("--"):
            if i and args[i - 1].startswith("--") and "=" not in args[i - 1] and any(
                    f == f"engine.args.{i - 1}" for f, _ in out):
                continue  # the value of a credential flag already refused
            if p := value_problem(f"engine.args.{i}", a):
                out.append(p)
            continue
        flag = a.split("=", 1)[0]
        if flag in _FLAG_HOME or credential_name(flag):
            out.append((f"engine.args.{i}", f"{flag} carries a credential; a profile is published with every "
                        f"snapshot: {_FLAG_HOME.get(flag, _RUNTIME)}"))
        elif "=" in a and (p := value_problem(f"engine.args.{i}", a.split("=", 1)[1])):
            out.append((p[0], f"the value of {flag} {p[1]}"))
    for k, v in env.items():
        if k in _ENV_HOME or credential_name(k):
            out.append((f"engine.env.{k}", f"{k} names a credential; a profile is published with every snapshot: "
                        f"{_ENV_HOME.get(k, _RUNTIME)}"))
        elif p := value_problem(f"engine.env.{k}", v):
            out.append(p)
    return out


# --- every secret value warmctl can know ----------------------------------------------------


@dataclass(frozen=True)
class Secret:
    """One secret value and where warmctl knows it from (``source``: ``environment variable
    AWS_SECRET_ACCESS_KEY``, ``Hugging Face token file /root/.cache/huggingface/token``).
    ``value`` is never printed."""

    source: str
    value: bytes = field(repr=False)


@dataclass
class KnownSecrets:
    """What :func:`known_secrets` found: the secrets (at least :data:`MIN_SECRET_BYTES` long,
    each value once), the sources consulted, and how many values were too short to scan for."""

    secrets: list[Secret] = field(default_factory=list)
    consulted: list[str] = field(default_factory=list)
    short: int = 0

    def add(self, source: str, value: str | bytes | None) -> None:
        if value is None:
            return
        v = value.encode() if isinstance(value, str) else bytes(value)
        if len(v) < MIN_SECRET_BYTES:
            self.short += bool(v)
            return
        if all(s.value != v for s in self.secrets):
            self.secrets.append(Secret(source, v))


def token_file_values(text: str) -> list[str]:
    """The secret values of a token file: every line, stripped, but blank lines, ``#``
    comments and ``[section]`` headers; of a ``name = value`` (or ``name: value``) line also the
    value alone."""
    out: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("#", "[")):
            continue
        out.append(s)
        m = re.match(r"[\w.\-]+\s*[=:]\s*(.+)$", s)
        if m:
            out.append(m.group(1).strip().strip("\"'"))
    return out


def pem_key_values(text: str) -> list[bytes]:
    """What would betray a PEM private key in memory: the first line of its base64 body (a
    copy of the file) and 32 bytes from the middle of the decoded key (the key as parsed)."""
    body = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("-----") and ":" not in ln]
    if not body:
        return []
    out = [body[0].encode()]
    try:
        der = base64.b64decode("".join(body))
    except ValueError:
        return out
    if len(der) >= 64:
        mid = len(der) // 2
        out.append(der[mid - 16:mid + 16])
    return out


def _read_small(path: Path, limit: int = MAX_TOKEN_FILE_BYTES) -> str | None:
    try:
        st = path.stat()
        if not path.is_file() or st.st_size > limit:
            return None
        return path.read_text(errors="replace")
    except OSError:
        return None


def hf_token_path(environ: Mapping[str, str]) -> Path:
    """The Hugging Face token file huggingface_hub reads: ``$HF_TOKEN_PATH``, else
    ``$HF_HOME/token``, else ``~/.cache/huggingface/token`` (``$XDG_CACHE_HOME`` honoured)."""
    if environ.get("HF_TOKEN_PATH"):
        return Path(environ["HF_TOKEN_PATH"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "token"
    cache = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or "~").expanduser() / ".cache")
    return Path(cache) / "huggingface" / "token"


def s3_credentials(urls: Iterable[str]) -> list[tuple[str, str]]:
    """``(label, value)`` of the S3 credentials boto3 resolves (its default chain, as the S3
    store does: environment, shared files, instance metadata) when one of ``urls`` is an
    ``s3://`` store; [] otherwise or when boto3 finds none."""
    if not any(u.startswith("s3://") for u in urls if u):
        return []
    import boto3

    creds = boto3.session.Session().get_credentials()
    if creds is None:
        return []
    frozen = creds.get_frozen_credentials()
    return [(f"S3 credential ({n}) boto3 resolved for the store", v)
            for n, v in (("access key id", frozen.access_key), ("secret key", frozen.secret_key),
                         ("session token", frozen.token)) if v]


def _file_variable(name: str, value: str) -> bool:
    """Whether the variable ``name`` = ``value`` names a file (``..._FILE``, ``..._PATH``, with
    an absolute, ``~`` or ``.`` path)."""
    return bool(re.search(r"(?:_FILE|_PATH|_FILES|_PATHS)$", name.upper())) and value.startswith(("/", "~", "."))


def add_shapes(out: "KnownSecrets", where: str, text: str) -> None:
    """The secret parts of every shape rule ``text`` matches (:func:`find_shapes`) added to
    ``out``, each with the source ``<what> (rule <name>) in <where>``."""
    for h in find_shapes(text):
        for part in h.parts:
            out.add(f"{h.rule.what} (rule {h.rule.name}) in {where}", part)


def known_secrets(settings: "Settings", environ: Mapping[str, str] | None = None,
                  store_urls: Iterable[str] = (), profile_env: Mapping[str, str] | None = None) -> KnownSecrets:
    """Every secret value warmctl can know on this host (see :class:`KnownSecrets`):

    - credential-looking variables (:func:`credential_name`) of ``environ`` (default: this
      process's environment): their values; a ``..._FILE`` / ``..._PATH`` one naming a small
      file: that file's :func:`token_file_values` instead;
    - the secret part of every value of ``environ`` that has a credential's shape
      (:func:`find_shapes`: a URL's password, a bearer token, a cloud, hub or registry token),
      whatever the variable's name (so a variable passed through to the engine with
      ``engine_env_passthrough`` is covered), and of the text of each small file (at most
      :data:`MAX_TOKEN_FILE_BYTES`) that a ``..._FILE`` / ``..._PATH`` variable of ``environ``
      or of ``profile_env`` (the profile's ``[engine.env]``) names;
    - the S3 credentials boto3 resolves, when the local store, ``remote_store``, the catalog or
      one of ``store_urls`` (a push target) is ``s3://`` (:func:`s3_credentials`);
    - the gate's API keys (``gate_api_key_file``, one per line) and TLS key (``gate_tls_key``,
      :func:`pem_key_values`);
    - the agent's token (``agent_token_file``, else ``<home>/agent/token``);
    - the Hugging Face token file (:func:`hf_token_path`).

    A file that does not exist or cannot be read holds nothing warmctl can know; it is skipped.
    """
    env = os.environ if environ is None else environ
    out = KnownSecrets()
    for k in sorted(env):
        v = env[k]
        add_shapes(out, f"environment variable {k}", v)
        if _file_variable(k, v) and (text := _read_small(Path(v).expanduser())) is not None:
            add_shapes(out, f"the file {v} named by environment variable {k}", text)
        if not credential_name(k) or k == "HF_TOKEN_PATH":  # that file is the Hugging Face token file, below
            continue
        out.consulted.append(f"${k}")
        v = env[k]
        if _file_variable(k, v):
            text = _read_small(Path(v).expanduser())
            for line in token_file_values(text) if text is not None else []:
                out.add(f"the file {v} named by environment variable {k}", line)
            continue
        out.add(f"environment variable {k}", v)
    for k, v in sorted((profile_env or {}).items()):
        if _file_variable(k, v) and (text := _read_small(Path(v).expanduser())) is not None:
            out.consulted.append(v)
            add_shapes(out, f"the file {v} named by the profile's engine.env.{k}", text)
    urls = [str(settings.store_dir), settings.remote_store or "", settings.catalog_url, *store_urls]
    for label, v in s3_credentials(urls):
        out.consulted.append(label)
        out.add(label, v)
    if settings.gate_api_key_file:
        out.consulted.append(str(settings.gate_api_key_file))
        text = _read_small(settings.gate_api_key_file)
        for line in (text or "").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                out.add(f"an API key of the gate's key file {settings.gate_api_key_file}", line.strip())
    if settings.gate_tls_key:
        out.consulted.append(str(settings.gate_tls_key))
        text = _read_small(settings.gate_tls_key)
        for v in pem_key_values(text or ""):
            out.add(f"the gate's TLS key {settings.gate_tls_key}", v)
    agent_token = settings.agent_token_file or settings.home / "agent" / "token"
    out.consulted.append(str(agent_token))
    text = _read_small(agent_token)
    if text and text.strip():
        out.add(f"the agent's token file {agent_token}", text.strip().splitlines()[0].strip())
    hf = hf_token_path(env)
    out.consulted.append(str(hf))
    for line in token_file_values(_read_small(hf) or ""):
        out.add(f"the Hugging Face token file {hf}", line)
    return out


# --- the scan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """``secret`` found in ``where`` (a file's path, or ``the manifest``) at byte ``offset``."""

    secret: Secret
    where: str
    offset: int


#: Bytes of a file searched at once by the ``bytes.find`` fallback (a window; see :func:`scan_file`).
WINDOW = 64 << 20
#: Bytes of a file read at once into the Hyperscan stream (:func:`scan_file`): a piece that
#: stays in the CPU's cache while it is searched.
READ_BYTES = 4 << 20
#: Bytes of a file one worker process scans (:func:`scan_files`), in windows of :data:`WINDOW`.
PART = 512 << 20


def scan_bytes(data, secrets: list[Secret], where: str) -> list[Finding]:
    """Every secret of ``secrets`` in ``data`` (bytes, or an mmap): its first occurrence each."""
    out = []
    for s in secrets:
        i = data.find(s.value)
        if i >= 0:
            out.append(Finding(s, where, i))
    return out


def scan_engine() -> str:
    """The matcher :func:`scan_file` uses: ``hyperscan`` (one pass over the bytes for all the
    secrets, Intel's multi-literal matcher; x86-64), else ``bytes.find`` (one pass per secret,
    where the ``hyperscan`` package is not installed)."""
    try:
        import hyperscan  # noqa: F401
    except ImportError:
        return "bytes.find"
    return "hyperscan"


def _hyperscan_db(secrets: list[Secret]):
    import hyperscan

    db = hyperscan.Database(mode=hyperscan.HS_MODE_STREAM)
    db.compile(expressions=[s.value for s in secrets], ids=list(range(len(secrets))), elements=len(secrets),
               flags=[hyperscan.HS_FLAG_SINGLEMATCH] * len(secrets), literal=True)
    return db


def scan_file(path: Path, secrets: list[Secret], label: str | None = None, start: int = 0,
              end: int | None = None) -> list[Finding]:
    """Every secret of ``secrets`` that starts in bytes ``[start, end)`` of the file ``path``
    (default: the whole file; its first occurrence each). With :func:`scan_engine`
    ``hyperscan``: one pass for all the secrets, the file read in pieces of :data:`READ_BYTES`
    (at most :data:`WINDOW`) into one buffer and fed to one Hyperscan stream (a secret split
    across two reads is matched by the stream's state), up to ``end`` plus the longest secret
    less one byte (a secret that starts before ``end`` and ends after it). Otherwise the file
    is read through a memory map in windows of :data:`WINDOW` bytes, each extended by the
    longest secret and searched for each secret in turn (``bytes.find``). ``label`` names the
    file in findings (default: the path)."""
    if not secrets:
        return []
    where = label or str(path)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        end = size if end is None else min(end, size)
        if start >= end:
            return []
        longest = max(len(s.value) for s in secrets)
        stop = min(size, end + longest - 1)
        if scan_engine() == "hyperscan":
            return _scan_hyperscan(f, secrets, where, start, end, stop)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                mm.madvise(mmap.MADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            found: dict[bytes, Finding] = {}
            pos = start
            while pos < end:
                wstop = min(size, min(end, pos + WINDOW) + longest - 1)
                for s in secrets:
                    if s.value not in found and (i := mm.find(s.value, pos, wstop)) >= 0:
                        found[s.value] = Finding(s, where, i)
                if len(found) == len(secrets):
                    break
                pos += WINDOW
            return list(found.values())


def _scan_hyperscan(f, secrets: list[Secret], where: str, start: int, end: int, stop: int) -> list[Finding]:
    found: dict[int, Finding] = {}

    def on_match(i: int, _from: int, to: int, _flags: int, _ctx: object) -> None:
        at = start + to - len(secrets[i].value)
        if at < end and i not in found:
            found[i] = Finding(secrets[i], where, at)

    buf = bytearray(min(READ_BYTES, WINDOW, stop - start))
    db = _hyperscan_db(secrets)  # held while its stream is open (the stream does not keep it alive)
    with memoryview(buf) as view, db.stream(match_event_handler=on_match) as stream:
        f.seek(start)
        pos = start
        while pos < stop and len(found) < len(secrets):
            n = f.readinto(view[:min(len(buf), stop - pos)])
            if not n:
                break
            stream.scan(view[:n])
            pos += n
    return list(found.values())


def _scan_part(task: tuple[str, str, int, int, list[Secret]]) -> list[Finding]:
    path, label, start, end, secrets = task
    return scan_file(Path(path), secrets, label, start, end)


#: Below this many usable CPUs the scan stays in this process: on the 2-vCPU development VM
#: two worker processes were no faster than one (docs/benchmarks.md, "The secret scan").
MIN_CPUS_FOR_WORKERS = 4


def scan_workers() -> int:
    """Processes :func:`scan_files` uses by default: the CPUs this process may run on (the
    engine is frozen or gone while a snapshot is scanned), or 1 below
    :data:`MIN_CPUS_FOR_WORKERS`."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n >= MIN_CPUS_FOR_WORKERS else 1


def scan_files(files: Iterable[tuple[Path, str]], secrets: list[Secret],
               workers: int | None = None) -> tuple[list[Finding], int]:
    """:func:`scan_file` over ``files`` (``(path on disk, name in findings)``); returns the
    findings (the first occurrence of each secret per file) and the bytes scanned. The files
    are cut into parts of :data:`PART` bytes
    scanned by ``workers`` processes (default :func:`scan_workers`; started with ``spawn``,
    they import only this module) when there is more than one part and more than one worker."""
    files = [(Path(p), label) for p, label in files]
    sizes = [p.stat().st_size for p, _ in files]
    total = sum(sizes)
    tasks = [(str(p), label, off, min(off + PART, size), secrets)
             for (p, label), size in zip(files, sizes) for off in range(0, size, PART)]
    workers = scan_workers() if workers is None else workers
    if not secrets or not tasks:
        return [], total
    if workers > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as ex:
            parts = list(ex.map(_scan_part, tasks))
    else:
        parts = [_scan_part(t) for t in tasks]
    first: dict[tuple[str, bytes], Finding] = {}
    for f in (f for part in parts for f in part):
        k = (f.where, f.secret.value)
        if k not in first or f.offset < first[k].offset:
            first[k] = f
    return list(first.values()), total


def refuse_if_found(findings: list[Finding], what: str) -> None:
    """Raise :class:`SecretInSnapshot` naming every (secret source, file) pair of ``findings``
    (never a value); ``what`` says what was refused (``snapshot tiny``)."""
    if not findings:
        return
    lines = [f"  {f.secret.source}: found in {f.where} (byte {f.offset})" for f in findings]
    raise SecretInSnapshot(
        f"{what}: refused, a secret would be published with it; nothing was stored or pushed:\n" + "\n".join(lines)
        + "\nKeep it out of the engine: the engine's environment is the base list, the profile's [engine.env] and "
          "engine_env_passthrough only (`warmctl profile command` shows it); see docs/operations.md, "
          "\"Credentials and snapshots\".")
