"""Damage to a stored object, as the fault tests inject it (tests/test_fault_matrix.py,
tests/test_damaged_remote.py): :func:`damaged` returns the bytes a damaged copy holds."""

from __future__ import annotations


def flip_middle(data: bytes) -> bytes:
    """``data`` with one bit of its middle byte flipped."""
    b = bytearray(data)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


def damaged(data: bytes, fault: str, other: bytes = b"") -> bytes:
    """``data`` after ``fault``: ``flip`` (:func:`flip_middle`), ``truncate`` (cut to half its
    length) or ``swap`` (``other``: another object's bytes). Raises ValueError for another fault."""
    if fault == "flip":
        return flip_middle(data)
    if fault == "truncate":
        return data[: len(data) // 2]
    if fault == "swap":
        return other
    raise ValueError(f"not a damage to bytes: {fault!r}")
