"""Shared helpers for the store tests (imported by tests/test_store*.py). The S3 server
(``moto_endpoint``, ``s3_url``) is tests/conftest.py's: one for the session."""

from __future__ import annotations

from pathlib import Path


from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest
from warmctl.naming.catalog import Catalog, Ref
from warmctl.naming.fleet import entries_to_copy, transfer
from warmctl.store import CHUNK_SIZE, CopyReport, Store

MiB = 1024 * 1024


def write_payload(path: Path, parts: list[tuple[str, int]], seed: int = 0) -> Path:
    """Write a file of ``parts``: ("random"|"zero"|"text", bytes) in order."""
    import random

    rnd = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for kind, n in parts:
            if kind == "random":
                f.write(rnd.randbytes(n))
            elif kind == "zero":
                f.write(bytes(n))
            elif kind == "text":
                words = [b"token", b"engine", b"kv-cache", b"llama", b"vllm", b"page", b"\n"]
                block = b" ".join(rnd.choice(words) for _ in range(12000))  # ~64 KiB
                out = bytearray()
                while len(out) < n:  # vary each block a little so chunks differ
                    out += block + rnd.randbytes(16)
                f.write(bytes(out[:n]))
            else:
                raise ValueError(kind)
    return path


def make_manifest(store: Store, name: str, files: dict[str, Path]) -> Manifest:
    """Add ``files`` (manifest path -> local file) to ``store`` and build a manifest of them."""
    entries = []
    for rel, p in files.items():
        refs = store.add_file(p)
        entries.append(FileEntry(path=rel, size=p.stat().st_size, chunks=refs))
    return Manifest(
        name=name,
        profile_digest="sha256:" + "0" * 64,
        profile={"name": name},
        host={},
        canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
        files=entries,
    )


def snapshot(store: Store, name: str, files: dict[str, Path], tag: str = "latest", signer=None) -> str:
    """add files + put_manifest + a catalog entry ``name:tag`` (signed by ``signer``, a private
    key file, when given); returns the manifest digest."""
    m = make_manifest(store, name, files)
    d = store.put_manifest(m)
    Catalog(store).publish(d, m, tag=tag, signer=signer)
    return d


def push(src: Store, dst: Store, name: str, tag: str = "latest", progress=None) -> CopyReport:
    """Copy the one catalog entry of ``name:tag`` with its data (:mod:`warmctl.naming.fleet`); its report."""
    (c,) = transfer(src, dst, entries_to_copy(src, Ref(name=name, tag=tag)), progress)
    return c.report


pull = push


def tag_of(store: Store, name: str, tag: str = "latest") -> str | None:
    """The manifest digest the catalog of ``store`` names ``name:tag`` (one kind of host), or None."""
    entries = Catalog(store).entries(name, tag)
    return entries[0].manifest if entries else None


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())




assert CHUNK_SIZE >= MiB
