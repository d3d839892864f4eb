"""The gate's secret files: API keys and the TLS certificate pair.

Both are read at start and again on SIGHUP or a change of the files (:meth:`warmctl.gate.server.Gate.reload`);
a key file or private key that group/others may read, or that another user owns, is refused like
OpenSSH refuses such a private key.
"""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

from warmctl.base.errors import HostError


class GateConfigError(HostError):
    """A key, certificate or private-key file the gate was given is missing, unreadable or
    invalid (the message names the file)."""


def private_file_problem(st: os.stat_result) -> str | None:
    """Why a file with status ``st`` may not hold a secret (API keys, a TLS private key), or
    None: like OpenSSH for private keys, it must not be readable, writable or executable by
    group or others (``mode & 0o077``), and must belong to root or to this process's user."""
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o} is open to group or others (0600 or tighter needed)"
    if st.st_uid not in (0, os.geteuid()):
        return f"it belongs to uid {st.st_uid}, not to root or to this user (uid {os.geteuid()})"
    return None


def _check_private(path: Path, what: str, st: os.stat_result | None = None) -> None:
    """Raise :class:`GateConfigError` naming ``what``, ``path``, the problem and its fix if
    ``path`` (status ``st``, else stat'ed here) is not private (:func:`private_file_problem`).
    A file that cannot be stat'ed is left to its reader to report."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            return
    if (why := private_file_problem(st)) is not None:
        fix = f"chmod 600 {path}" if st.st_mode & 0o077 else f"chown {os.geteuid()} {path}"
        raise GateConfigError(f"{what} {path}: {why}; run: {fix}")


def read_keys(path: Path) -> list[bytes]:
    """API keys from ``path``: one per line, surrounding whitespace stripped, blank lines and
    lines starting with ``#`` skipped. Raises :class:`GateConfigError` naming the file if it
    cannot be read, is not private (group/others may read it, or another user owns it:
    :func:`private_file_problem`, checked on the open file), holds no key, or a key contains
    whitespace."""
    try:
        with open(path, "rb") as f:
            _check_private(path, "API key file", os.fstat(f.fileno()))
            text = f.read().decode()
    except OSError as e:
        raise GateConfigError(f"API key file {path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise GateConfigError(f"API key file {path}: not UTF-8 text") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        k = line.strip()
        if not k or k.startswith("#"):
            continue
        if any(c.isspace() for c in k):
            raise GateConfigError(f"API key file {path}, line {n}: a key must not contain whitespace")
        keys.append(k.encode())
    if not keys:
        raise GateConfigError(f"API key file {path}: no key in it (one key per line)")
    return keys


def tls_context(cert: Path, key: Path, into: ssl.SSLContext | None = None) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2+, ALPN ``http/1.1``) holding ``cert`` (PEM chain) and
    ``key`` (PEM). With ``into``, the pair is first checked in a throwaway context and then
    loaded into ``into`` (new handshakes use it, established ones keep theirs). Raises
    :class:`GateConfigError` naming the files if they cannot be read or do not match, or
    naming ``key`` if group/others may read it or another user owns it (:func:`private_file_problem`)."""
    _check_private(key, "TLS private key")

    def load(ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as e:
            raise GateConfigError(f"TLS certificate {cert} / key {key}: {getattr(e, 'strerror', None) or e}") from None

    fresh = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    fresh.minimum_version = ssl.TLSVersion.TLSv1_2
    fresh.set_alpn_protocols(["http/1.1"])
    load(fresh)
    if into is None:
        return fresh
    load(into)
    return into
