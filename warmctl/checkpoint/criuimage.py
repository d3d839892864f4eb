"""CRIU's image files and the few pieces of the protobuf wire format warmctl reads them with.

An image file (CRIU's ``criu/include/image.h``, ``magic.h``) starts with two 32-bit magics, then
protobuf messages (CRIU's ``images/*.proto``), each after its 32-bit little-endian length; the
image-streamer protocol's requests are protobuf messages too (wire format:
https://protobuf.dev/programming-guides/encoding/). warmctl touches only a few fields of a few
messages (a pagemap's entries, an mm's VMAs, the mount points' external keys, a streamer
request's file name), so it decodes them here instead of carrying CRIU's generated classes.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Iterable

from warmctl.base.errors import CheckpointError

#: a varint is at most 10 bytes (64 bits, 7 per byte)
_MAX_SHIFT = 63


def varint(b: bytes, i: int) -> tuple[int, int]:
    """The unsigned varint at byte ``i`` of ``b`` and the index after it. Raises ValueError if it
    runs past ``b`` or past 64 bits."""
    v = shift = 0
    while True:
        if i >= len(b):
            raise ValueError("a varint runs past the message")
        if shift > _MAX_SHIFT:
            raise ValueError("a varint longer than 64 bits")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return v, i


def fields(m: bytes) -> dict[int, list[Any]]:
    """A message's fields by number, each a list in the order met: varints as ints, the other
    wire types (length-delimited, 64-bit, 32-bit) as their bytes (``Any``: which one a field
    holds is the caller's schema). Raises ValueError for a group
    (wire types 3, 4), an unknown wire type or a field that runs past ``m``."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(m):
        key, i = varint(m, i)
        num, wire = key >> 3, key & 7
        v: int | bytes
        if wire == 0:
            v, i = varint(m, i)
        else:
            if wire == 2:
                n, i = varint(m, i)
            elif wire in (1, 5):
                n = 8 if wire == 1 else 4
            else:
                raise ValueError(f"field {num}: wire type {wire}")
            if i + n > len(m):
                raise ValueError(f"field {num}: {n} bytes at byte {i} run past the {len(m)}-byte message")
            v, i = m[i:i + n], i + n
        out.setdefault(num, []).append(v)
    return out


def uvarint(v: int) -> bytes:
    """``v`` (>= 0) as a varint."""
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if not v:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def varint_field(num: int, v: int) -> bytes:
    """Field ``num`` holding the varint ``v`` (wire type 0)."""
    return uvarint(num << 3) + uvarint(v)


def records(path: Path) -> tuple[bytes, list[bytes]]:
    """An image file's two magics (8 bytes) and its records (each a message's bytes). Raises
    :class:`CheckpointError` naming ``path`` if it is too short or a record runs past its end,
    OSError if it cannot be read."""
    b = path.read_bytes()
    if len(b) < 8:
        raise CheckpointError(f"{path}: {len(b)} bytes, too short for a CRIU image")
    recs, i = [], 8
    while i < len(b):
        if i + 4 > len(b):
            raise CheckpointError(f"{path}: a record's length cut short at byte {i}")
        (n,) = struct.unpack_from("<I", b, i)
        if i + 4 + n > len(b):
            raise CheckpointError(f"{path}: a {n}-byte record at byte {i} runs past the end")
        recs.append(b[i + 4:i + 4 + n])
        i += 4 + n
    return b[:8], recs


def record(m: bytes) -> bytes:
    """The message ``m`` framed as an image file's record."""
    return struct.pack("<I", len(m)) + m


def external_mounts(images_dir: Path) -> list[str]:
    """:func:`mount_keys` of the ``mountpoints-*.img`` files in ``images_dir``: empty for an
    image of a tree without a mount namespace of its own."""
    return mount_keys(sorted(images_dir.glob("mountpoints-*.img")))


def mount_keys(paths: Iterable[Path]) -> list[str]:
    """The keys of the external mounts (``mnt_entry.ext_key``, field 18 of CRIU's
    ``images/mnt.proto``) in the mount images ``paths``, in order, each once: what a restore
    must give with ``--external mnt[KEY]:PATH``. Raises :class:`CheckpointError` for a file that
    is not a mount image, OSError for one that cannot be read."""
    keys: dict[str, None] = {}
    for path in paths:
        for rec in records(path)[1]:
            try:
                for key in fields(rec).get(18, []):
                    keys.setdefault(key.decode(), None)
            except (ValueError, AttributeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: not a CRIU mount image this version reads ({e!r})") from e
    return list(keys)


#: ``remap_type`` LINKED (CRIU's ``images/remap-file-path.proto``): an unlinked file the dump
#: made reachable under a new name, ``link_remap.N`` in its directory (``--link-remap``)
_REMAP_LINKED = 0
#: ``fd_types`` REG (``images/fdinfo.proto``): a ``file_entry`` holding a ``reg_file_entry``
_FD_REG = 1


def linked_remaps(images_dir: Path) -> list[tuple[str, str]]:
    """``(link, original)`` absolute paths (as the dumped tree saw them) of every unlinked file
    the dump linked as ``link_remap.N``: the ``remap_file_path_entry`` records of
    ``remap-fpath.img`` of type LINKED, their ``orig_id`` and ``remap_id`` looked up among the
    ``reg_file_entry`` records (``id`` field 1, ``name`` field 6) of ``files.img`` (CRIU >= 3.x).
    A restore re-links each original from its link, so a link missing then fails it. Empty when
    the image has neither file. Raises :class:`CheckpointError` for a file that is not such an
    image, OSError for one that cannot be read."""
    remap, files = images_dir / "remap-fpath.img", images_dir / "files.img"
    if not remap.exists() or not files.exists():
        return []
    try:
        names: dict[int, str] = {}
        for rec in records(files)[1]:
            f = fields(rec)
            if f.get(1) == [_FD_REG] and 3 in f:
                reg = fields(f[3][0])
                names[reg[1][0]] = reg[6][0].decode(errors="surrogateescape")
        out = []
        for rec in records(remap)[1]:
            f = fields(rec)
            if f.get(3, [_REMAP_LINKED])[0] == _REMAP_LINKED:
                out.append((names[f[2][0]], names[f[1][0]]))
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{images_dir}: a link remap this version cannot read ({e!r})") from e
    return out
