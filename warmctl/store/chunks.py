"""Chunk encoding: digest, zero detection, compression. See ``docs/store-format.md``.

A chunk is a run of at most :data:`CHUNK_SIZE` bytes of a file, cut at fixed offsets. Its
digest is taken over the *uncompressed* bytes and written ``<algorithm>:<hex>``; new chunks
use :data:`DIGEST_ALGORITHM` (BLAKE3, 256-bit), readers also accept ``sha256:``. The stored
object is one zstd frame (level :data:`ZSTD_LEVEL`, content size in the frame header).

A chunk whose bytes are all zero is never stored: its digest is the ordinary digest of
``size`` zero bytes, and readers recognise it by comparing with :func:`zero_digest`.
"""

from __future__ import annotations

import hashlib
import threading
from functools import lru_cache

import zstandard

try:  # BLAKE3 is ~2x SHA-256 per core here (docs/benchmarks.md); SHA-256 stays readable.
    import blake3 as _blake3
except ImportError:  # pragma: no cover - blake3 is a declared dependency
    _blake3 = None

#: Store format version, written to ``config`` at the store root.
STORE_FORMAT = 1
#: Fixed chunk size in bytes (last chunk of a file may be shorter).
CHUNK_SIZE = 4 * 1024 * 1024
#: Digest algorithm for new chunks.
DIGEST_ALGORITHM = "blake3" if _blake3 is not None else "sha256"
#: zstd compression level for new chunks.
ZSTD_LEVEL = -1
#: Algorithms a reader accepts.
ALGORITHMS = ("blake3", "sha256")

_tls = threading.local()


def hash_bytes(data: bytes | memoryview, algorithm: str = DIGEST_ALGORITHM) -> str:
    """``<algorithm>:<hex>`` of ``data``. Raises ValueError for an unknown algorithm."""
    if algorithm == "blake3":
        if _blake3 is None:
            raise ValueError("blake3 digests need the 'blake3' package (pip install blake3)")
        return "blake3:" + _blake3.blake3(data).hexdigest()
    if algorithm == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def hasher(algorithm: str = DIGEST_ALGORITHM):
    """An incremental hash object (``update``, ``hexdigest``) for ``algorithm``."""
    if algorithm == "blake3":
        if _blake3 is None:
            raise ValueError("blake3 digests need the 'blake3' package (pip install blake3)")
        return _blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def split_digest(digest: str) -> tuple[str, str]:
    """``"blake3:ab.."`` -> ``("blake3", "ab..")``. Raises ValueError when malformed."""
    algo, sep, hexpart = digest.partition(":")
    if not sep or algo not in ALGORITHMS or len(hexpart) != 64 or not _is_hex(hexpart):
        raise ValueError(f"malformed digest {digest!r} (want '<blake3|sha256>:<64 hex>')")
    return algo, hexpart


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return s == s.lower()


def verify_bytes(data: bytes | memoryview, digest: str) -> bool:
    """True when ``data`` hashes to ``digest`` (with the digest's own algorithm)."""
    algo, _ = split_digest(digest)
    return hash_bytes(data, algo) == digest


_ZEROS = bytes(CHUNK_SIZE)


def is_zero(data: bytes | memoryview) -> bool:
    """True when every byte of ``data`` is zero (~10 GB/s: a memcmp against a zero buffer)."""
    if isinstance(data, memoryview):
        data = data.tobytes()
    n = len(data)
    return data == (_ZEROS if n == CHUNK_SIZE else bytes(n))


@lru_cache(maxsize=64)
def zero_digest(size: int, algorithm: str = DIGEST_ALGORITHM) -> str:
    """Digest of ``size`` zero bytes (cached)."""
    return hash_bytes(bytes(size), algorithm)


def is_zero_chunk(digest: str, size: int) -> bool:
    """True when ``digest`` names ``size`` zero bytes: such chunks are never stored."""
    algo, _ = split_digest(digest)
    return zero_digest(size, algo) == digest


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_tls, "cctx", None)
    if c is None:
        c = _tls.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstandard.ZstdDecompressor()
    return d


def compress(data: bytes | memoryview) -> bytes:
    """One zstd frame holding ``data`` (content size recorded in the frame header)."""
    return _cctx().compress(data)


def frame_bound(size: int) -> int:
    """The most bytes a chunk object holding ``size`` bytes may have: zstd's compress bound
    (``ZSTD_COMPRESSBOUND``: ``size + size/256`` plus a margin for small inputs) and room for
    the frame header and checksum. A larger object is refused unread (a chunk padded
    with gigabytes after its frame)."""
    return size + (size >> 8) + (((128 << 10) - size) >> 11 if size < (128 << 10) else 0) + 1024


def decompress_into(blob: bytes | bytearray | memoryview, out: bytearray | memoryview, size: int) -> memoryview:
    """Decompress one chunk object, expected to hold ``size`` bytes, into ``out[:size]``
    (no allocation: the caller reuses ``out``); returns that view.

    Raises ValueError when the frame is damaged, truncated or holds a different number of
    bytes (the frame header's content size, when present, must say ``size``).
    """
    view = memoryview(out)[:size]
    if len(view) != size:
        raise ValueError(f"output buffer of {len(out)} bytes is smaller than the chunk ({size})")
    try:
        declared = zstandard.frame_content_size(blob)
        if declared >= 0 and declared != size:
            raise ValueError(f"frame says {declared} bytes, expected {size}")
        # across frames: whatever follows the frame is read too, so trailing bytes (another
        # frame, zeros, garbage) are an error, not ignored (a chunk object is exactly its frame)
        reader = _dctx().stream_reader(blob, read_size=max(1, len(blob)), read_across_frames=True)
        got = 0
        while got < size:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
    except zstandard.ZstdError as e:
        raise ValueError(f"not a valid zstd frame ({e})") from None
    if got == size:
        try:
            if reader.read(1):
                got += 1
        except zstandard.ZstdError:
            raise ValueError("bytes follow the zstd frame (a chunk object is exactly one frame)") from None
    if got != size:
        raise ValueError(f"decompressed to {'more than ' if got > size else ''}{min(got, size)} bytes, expected {size}")
    return view


def decompress(blob: bytes, size: int) -> bytes:
    """Decompress one chunk object expected to hold ``size`` bytes.

    Raises ValueError when the frame is damaged or holds a different number of bytes.
    """
    try:
        out = _dctx().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a valid zstd frame ({e})") from None
    if len(out) != size:
        raise ValueError(f"decompressed to {len(out)} bytes, expected {size}")
    return out
