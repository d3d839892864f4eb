"""Credentials: what looks like one, every secret value warmctl can know on this host, and the
scan that keeps them out of a snapshot.

A snapshot is the engine's whole memory, copied to every node of a fleet and to a shared
bucket; whatever secret the engine holds is published with it. Three lines of defence:

1. the engine's environment is declared, not inherited (:func:`warmctl.engine.vllm.engine_environment`);
2. a profile cannot carry a credential (:func:`profile_problems`, run by profile validation);
3. before ``snapshot`` stores anything, every byte it would store is scanned for every secret
   value warmctl can know here (:func:`known_secrets`, :func:`scan_files`,
   :func:`refuse_if_found`); a match refuses to publish, naming where the secret came from and
   the file it was found in, never the value.

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
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from warmctl.errors import WarmctlError

if TYPE_CHECKING:
    from warmctl.config import Settings

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


def profile_problems(args: Iterable[str], env: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(field, message)`` for every credential a profile's ``engine.args`` / ``engine.env``
    carries: a credential-looking flag (``--api-key``, ``--hf-token``, ``--ssl-keyfile``, also
    as ``--flag=value``) and a credential-looking variable name (``HF_TOKEN``,
    ``AWS_SECRET_ACCESS_KEY``, ``VLLM_API_KEY``). ``field`` is the dotted profile field
    (``engine.args.3``, ``engine.env.HF_TOKEN``); each message says where the thing belongs
    instead. Never the value."""
    out: list[tuple[str, str]] = []
    for i, a in enumerate(args):
        if not a.startswith("--"):
            continue
        flag = a.split("=", 1)[0]
        if flag in _FLAG_HOME or credential_name(flag):
            out.append((f"engine.args.{i}", f"{flag} carries a credential; a profile is published with every "
                        f"snapshot: {_FLAG_HOME.get(flag, _RUNTIME)}"))
    for k in env:
        if k in _ENV_HOME or credential_name(k):
            out.append((f"engine.env.{k}", f"{k} names a credential; a profile is published with every snapshot: "
                        f"{_ENV_HOME.get(k, _RUNTIME)}"))
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


def known_secrets(settings: "Settings", environ: Mapping[str, str] | None = None,
                  store_urls: Iterable[str] = ()) -> KnownSecrets:
    """Every secret value warmctl can know on this host (see :class:`KnownSecrets`):

    - credential-looking variables (:func:`credential_name`) of ``environ`` (default: this
      process's environment): their values; a ``..._FILE`` / ``..._PATH`` one naming a small
      file: that file's :func:`token_file_values` instead;
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
        if not credential_name(k) or k == "HF_TOKEN_PATH":  # that file is the Hugging Face token file, below
            continue
        out.consulted.append(f"${k}")
        v = env[k]
        if re.search(r"(?:_FILE|_PATH|_FILES|_PATHS)$", k.upper()) and v.startswith(("/", "~", ".")):
            text = _read_small(Path(v).expanduser())
            for line in token_file_values(text) if text is not None else []:
                out.add(f"the file {v} named by environment variable {k}", line)
            continue
        out.add(f"environment variable {k}", v)
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


#: Bytes of a file searched at once (a window; windows overlap by the longest secret).
WINDOW = 64 << 20
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


def scan_file(path: Path, secrets: list[Secret], label: str | None = None, start: int = 0,
              end: int | None = None) -> list[Finding]:
    """Every secret of ``secrets`` that starts in bytes ``[start, end)`` of the file ``path``
    (default: the whole file; its first occurrence each), read through a memory map in windows
    of :data:`WINDOW` bytes that overlap by the longest secret, each window searched for every
    secret (``bytes.find``: a two-way search, memchr fast) while it is hot in the cache.
    ``label`` names the file in findings (default: the path)."""
    if not secrets:
        return []
    where = label or str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        end = size if end is None else min(end, size)
        if start >= end:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                mm.madvise(mmap.MADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            longest = max(len(s.value) for s in secrets)
            found: dict[bytes, Finding] = {}
            pos = start
            while pos < end:
                stop = min(size, min(end, pos + WINDOW) + longest - 1)
                for s in secrets:
                    if s.value not in found and (i := mm.find(s.value, pos, stop)) >= 0:
                        found[s.value] = Finding(s, where, i)
                if len(found) == len(secrets):
                    break
                pos += WINDOW
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
    findings (the first occurrence of each secret per file) and the bytes scanned. Each secret
    costs one pass over the bytes, so the files are cut into parts of :data:`PART` bytes
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
