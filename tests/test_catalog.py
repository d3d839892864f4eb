"""Catalog: fingerprint matching (table-driven), publish/list on the real store (local and a moto
S3 server on loopback), resolve = select + verify, and the catalog CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from warmctl.naming.catalog import (
    IGNORED_CPU_FLAGS,
    Catalog,
    CatalogEntry,
    CatalogError,
    Rejection,
    compat_key,
    select,
)
from warmctl.base.errors import SnapshotNotFound
from warmctl.host import CpuInfo, GpuInfo, HostFingerprint, fingerprint
from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest, RestoreInfo
from warmctl.store import Store, open_store
from warmctl.naming.trust import TrustError, generate_keypair

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
FLAGS = ["avx", "avx2", "avx512f", "fma", "hypervisor", "sse2"]


def host(**kw) -> HostFingerprint:
    """A synthetic GPU host: 2 x H100, driver 550.54.15, criu 4.2.1, vllm 0.6.3."""
    n = kw.pop("gpus", 2)
    model = kw.pop("model", H100)
    base = dict(
        hostname="node",
        arch="x86_64",
        kernel="6.8.0",
        cpu=CpuInfo(model="Xeon", vendor="GenuineIntel", count=64, flags=kw.pop("flags", FLAGS)),
        gpus=[GpuInfo(index=i, name=model, memory_bytes=80 << 30, uuid=f"GPU-{i}") for i in range(n)],
        gpu_reason=None if n else "NVML unavailable: NVML Shared Library Not Found",
        driver_version="550.54.15" if n else None,
        cuda_driver_version="12.4" if n else None,
        criu_version="4.2.1",
        engine_version="0.6.3",
        env_digest="sha256:" + "e" * 64,
    )
    base.update(kw)
    return HostFingerprint(**base)


def entry(fp: HostFingerprint, n: int, created_min: int = 0) -> CatalogEntry:
    return CatalogEntry(
        name="tiny", tag="latest", manifest=f"sha256:{n:064x}",
        created=datetime(2025, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=created_min),
        published=datetime(2025, 1, 1, tzinfo=timezone.utc), profile_digest="sha256:" + "0" * 64, size=1,
        host=fp.model_dump(mode="json"), compat=compat_key(fp.model_dump(mode="json")),
    )


# ----------------------------------------------------------------------------- matching table

CASES = [
    # (id, snapshot fingerprint, host fingerprint, expected rule or None when it fits)
    ("exact match", host(), host(), None),
    ("host has extra cpu flags", host(), host(flags=FLAGS + ["avx512bw"]), None),
    ("host lacks only an ignored flag", host(), host(flags=[f for f in FLAGS if f != "hypervisor"]), None),
    ("different hostname, kernel, uuids", host(), host(hostname="other", kernel="6.9.1"), None),
    ("newer criu, same major", host(), host(criu_version="4.3"), None),
    ("driver mismatch", host(), host(driver_version="550.90.07"), "driver"),
    ("gpu count mismatch", host(), host(gpus=1), "gpu count"),
    ("gpu model mismatch", host(), host(model=H200), "gpu model"),
    ("missing cpu feature", host(), host(flags=[f for f in FLAGS if f != "avx512f"]), "cpu"),
    ("arch mismatch", host(), host(arch="aarch64"), "arch"),
    ("gpu snapshot, host without gpu", host(), host(gpus=0), "gpu"),
    ("cpu snapshot, host with gpus", host(gpus=0), host(), "gpu"),
    ("cpu snapshot, cpu host", host(gpus=0), host(gpus=0), None),
    ("criu absent on host", host(), host(criu_version=None), "criu"),
    ("criu older on host", host(), host(criu_version="4.1"), "criu"),
    ("criu other major", host(), host(criu_version="5.0"), "criu"),
    ("engine version", host(), host(engine_version="0.6.4"), "engine"),
    ("environment digest", host(), host(env_digest="sha256:" + "f" * 64), "environment"),
    # Several differences: the first rule in order is the one reason.
    ("first failing rule wins", host(), host(gpus=1, driver_version="1.0", engine_version="9"), "gpu count"),
]


@pytest.mark.parametrize(("snap", "fp", "rule"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matching_rules(snap, fp, rule):
    e = entry(snap, 1)
    chosen, rejections = select([e], fp)
    if rule is None:
        assert chosen is e and rejections == []
    else:
        assert chosen is None
        assert rejections == [Rejection(digest=e.manifest, rule=rule, reason=rejections[0].reason)]
        assert rejections[0].reason  # one non-empty sentence


def test_reasons_name_both_values():
    cases = {
        "driver": (host(), host(driver_version="550.90.07"), ["550.54.15", "550.90.07"]),
        "gpu count": (host(), host(gpus=1), ["2", "1"]),
        "cpu": (host(), host(flags=["sse2"]), ["avx", "avx2", "avx512f", "fma"]),
        "gpu": (host(), host(gpus=0), ["2 x " + H100, "no GPU", "NVML"]),
    }
    for rule, (snap, fp, words) in cases.items():
        _, [r] = select([entry(snap, 1)], fp)
        assert r.rule == rule
        for w in words:
            assert w in r.reason, (rule, w, r.reason)
    _, [r] = select([entry(host(), 1)], host(flags=["sse2"]))
    assert "hypervisor" not in r.reason and "sse2" not in r.reason.split("lacks")[1].split(",")[0]


def test_driver_major_policy():
    snap, fp = host(), host(driver_version="550.90.07")
    assert select([entry(snap, 1)], fp, driver="major")[0] is not None
    assert select([entry(snap, 1)], host(driver_version="570.1"), driver="major")[1][0].rule == "driver"


def test_several_candidates_newest_fitting_wins_and_each_reject_has_one_reason():
    fp = host()
    old_fit = entry(host(), 1, created_min=0)
    new_fit = entry(host(hostname="b"), 2, created_min=10)
    newest_wrong_driver = entry(host(driver_version="535.1"), 3, created_min=20)
    h200 = entry(host(model=H200, gpus=8), 4, created_min=5)
    chosen, rejections = select([old_fit, newest_wrong_driver, new_fit, h200], fp)
    assert chosen is new_fit
    assert [(r.digest, r.rule) for r in rejections] == [(newest_wrong_driver.manifest, "driver"), (h200.manifest, "gpu model")]
    chosen, rejections = select([newest_wrong_driver, h200], host(gpus=1))
    assert chosen is None and [r.rule for r in rejections] == ["gpu count", "gpu model"]
    assert select([], fp) == (None, [])


def test_unreadable_fingerprint_and_manifests_as_candidates():
    bad = entry(host(), 1).model_copy(update={"host": {"arch": "x86_64"}})
    future = entry(host(), 2).model_copy(update={"host": {**host().model_dump(mode="json"), "format": 99}})
    chosen, rej = select([bad, future], host())
    assert chosen is None and [r.rule for r in rej] == ["fingerprint", "fingerprint"] and "99" in rej[1].reason
    m = Manifest(name="tiny", profile_digest="sha256:" + "0" * 64, profile={}, host=host().model_dump(mode="json"),
                 canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]), files=[])
    assert select([m], host())[0] is m
    assert select([m], host(gpus=1))[1][0].digest == m.digest()


def test_ignored_flags_are_not_instructions():
    assert {"avx", "avx2", "avx512f", "sse2", "aes", "sha_ni", "fma"}.isdisjoint(IGNORED_CPU_FLAGS)
    assert compat_key(host().model_dump(mode="json")) == compat_key(host(hostname="x", kernel="7").model_dump(mode="json"))
    assert compat_key(host().model_dump(mode="json")) != compat_key(host(driver_version="1").model_dump(mode="json"))


# ----------------------------------------------------------------------------- the catalog on a real store


def publish_snapshot(store: Store, tmp: Path, fp: HostFingerprint, seed: int, name: str = "tiny", **kw) -> tuple[str, Manifest]:
    p = tmp / f"payload-{seed}.img"
    p.write_bytes(random.Random(seed).randbytes(50_000))
    m = Manifest(name=name, profile_digest="sha256:" + f"{seed:064x}", profile={"name": name, "seed": seed},
                 host=fp.model_dump(mode="json"),
                 canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
                 files=[FileEntry(path="pages-1.img", size=p.stat().st_size, chunks=store.add_file(p))], **kw)
    return store.put_manifest(m), m


@pytest.fixture
def keys(tmp_path):
    kp = generate_keypair(tmp_path / "signer")
    d = tmp_path / "trusted"
    d.mkdir()
    (d / "signer.pub").write_bytes(kp.public.read_bytes())
    return kp, d


def exercise_catalog(store: Store, tmp: Path, keys) -> None:
    """Publish for three host kinds (one twice) and read it all back through a fresh handle."""
    kp, keys_dir = keys
    cat = Catalog(store)
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    d_h100, m_h100 = publish_snapshot(store, tmp, host(), 1, created=t0)
    d_h200, m_h200 = publish_snapshot(store, tmp, host(model=H200, gpus=1), 2, created=t0)
    d_cpu, m_cpu = publish_snapshot(store, tmp, host(gpus=0), 3, created=t0)
    e1 = cat.publish(d_h100, m_h100, signer=kp.private)
    assert e1.signed_by == [kp.key_id] and e1.size == 50_000
    cat.publish(d_h200, m_h200, signer=kp.private)
    cat.publish(d_cpu, m_cpu)  # unsigned
    d_h100b, m_h100b = publish_snapshot(store, tmp, host(hostname="rebuilt"), 4, created=t0 + timedelta(hours=1))
    cat.publish(d_h100b, m_h100b, signer=kp.private)  # same kind of host: replaces d_h100
    cat.publish(d_h200, m_h200, tag="stable", signer=kp.private)

    fresh = Catalog(open_store(store.location))
    assert fresh.names() == ["tiny"]
    assert fresh.tags("tiny") == ["latest", "stable"]
    latest = fresh.entries("tiny")
    assert [e.manifest for e in latest] == [d_h100b, *sorted([d_h200, d_cpu], reverse=True)]
    assert {e.manifest for e in fresh.entries("tiny", "stable")} == {d_h200}
    assert fresh.referenced_manifests() == {d_h100b, d_h200, d_cpu}
    assert fresh.profile("tiny")["profile"] == {"name": "tiny", "seed": 2}  # the last published
    assert not fresh.backend.exists("tags/tiny/latest")  # the catalog is the only naming layer
    assert fresh.entries("nothing") == [] and fresh.profile("nothing") is None

    # up on an H100 host: the rebuilt snapshot, signed, with the others rejected for one reason each.
    r = fresh.resolve("tiny", host(), keys_dir)
    assert r.entry.manifest == d_h100b and r.verification.trusted and r.manifest == m_h100b
    assert sorted((x.digest, x.rule) for x in r.rejections) == sorted([(d_h200, "gpu model"), (d_cpu, "gpu")])
    # up on a host that fits nothing: every candidate and its reason in the error.
    with pytest.raises(SnapshotNotFound) as e:
        fresh.resolve("tiny", host(gpus=4, model=H200), keys_dir)
    msg = str(e.value)
    assert "none of the 3 snapshot(s) of tiny:latest fits" in msg
    for d in (d_h100b, d_h200, d_cpu):
        assert d in msg
    assert "GPU count 1" in msg and "GPU model 2 x" in msg
    # The CPU-only snapshot fits a CPU host but is unsigned: refused, unless insecure.
    with pytest.raises(TrustError, match="unsigned"):
        fresh.resolve("tiny", host(gpus=0), keys_dir)
    r = fresh.resolve("tiny", host(gpus=0), keys_dir, insecure=True)
    assert r.entry.manifest == d_cpu and r.verification.insecure and "INSECURE" in r.verification.warning
    with pytest.raises(SnapshotNotFound, match="no snapshot tiny:nope"):
        fresh.resolve("tiny", host(), keys_dir, tag="nope")
    assert fresh.remove("tiny", "stable", d_h200) and fresh.tags("tiny") == ["latest"]


def test_catalog_on_local_store(tmp_path, keys):
    store = open_store(tmp_path / "store")
    exercise_catalog(store, tmp_path, keys)
    # The layout is the documented one.
    root = tmp_path / "store"
    assert (root / "catalog" / "tiny" / "profile.json").is_file()
    assert len(list((root / "catalog" / "tiny" / "latest").glob("sha256-*.json"))) == 3


@pytest.fixture(scope="module")
def s3_url(moto_endpoint):
    """A bucket on the session's moto server, reached through ``AWS_ENDPOINT_URL`` (the AWS
    SDK's own variable, not ``WARMCTL_S3_ENDPOINT``) for this module."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL"]}
    os.environ.update(env)
    os.environ["AWS_ENDPOINT_URL"] = moto_endpoint
    import boto3

    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket="warm")
    yield "s3://warm/catalog-test"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.s3
def test_catalog_published_to_and_read_from_s3(s3_url, tmp_path, keys):
    store = open_store(s3_url)
    exercise_catalog(store, tmp_path, keys)
    keys_listed = {o.key for o in store.backend.list("")}
    assert any(k.startswith("catalog/tiny/latest/sha256-") for k in keys_listed)
    assert any(k.startswith("signatures/sha256/") for k in keys_listed)
    store.close()


def test_publish_refuses_bad_input(tmp_path, keys):
    store = open_store(tmp_path / "store")
    cat = Catalog(store)
    d, m = publish_snapshot(store, tmp_path, host(), 1)
    with pytest.raises(CatalogError, match="manifest digest is"):
        cat.publish("sha256:" + "0" * 64, m)
    other = m.model_copy(update={"restore": RestoreInfo(cwd="/elsewhere")})
    with pytest.raises(CatalogError, match="not readable from the store .*push it first"):
        cat.publish(other.digest(), other)
    with pytest.raises(CatalogError, match="tag '../x'"):
        cat.publish(d, m, tag="../x")
    assert cat.names() == []


def test_resolve_refuses_entry_that_contradicts_its_signed_manifest(tmp_path, keys):
    kp, keys_dir = keys
    store = open_store(tmp_path / "store")
    cat = Catalog(store)
    d, m = publish_snapshot(store, tmp_path, host(model=H200, gpus=1), 1)
    e = cat.publish(d, m, signer=kp.private)
    # Someone rewrites the (unsigned) entry to claim it fits H100 hosts.
    forged = e.model_copy(update={"host": host().model_dump(mode="json")})
    key = f"catalog/tiny/latest/sha256-{d.split(':')[1]}.json"
    store.backend.save(key, forged.model_dump_json().encode())
    with pytest.raises(TrustError, match="signed manifest's host does not fit: GPU model"):
        cat.resolve("tiny", host(), keys_dir)
    # ... or points another name at this signed manifest.
    store.backend.save(f"catalog/other/latest/sha256-{d.split(':')[1]}.json",
                       forged.model_copy(update={"name": "other"}).model_dump_json().encode())
    with pytest.raises(TrustError, match="points at manifest .* of 'tiny'"):
        cat.resolve("other", host(), keys_dir)


# ----------------------------------------------------------------------------- CLI


def test_cli_catalog_ls_and_show(tmp_path, keys):
    kp, keys_dir = keys
    store = open_store(tmp_path / "store")
    cat = Catalog(store)
    here = fingerprint()
    d_here, m_here = publish_snapshot(store, tmp_path, here, 1)
    d_gpu, m_gpu = publish_snapshot(store, tmp_path, host(), 2)
    cat.publish(d_here, m_here, signer=kp.private)
    cat.publish(d_gpu, m_gpu)
    store.close()
    import typer
    from typer.testing import CliRunner

    from warmctl.cli.catalog import register

    app = typer.Typer()
    register(app)
    (tmp_path / "none.toml").write_text("")
    env = {"COLUMNS": "250", "WARMCTL_CATALOG": str(tmp_path / "store"), "WARMCTL_KEYS_DIR": str(keys_dir),
           "WARMCTL_CONFIG": str(tmp_path / "none.toml")}
    runner = CliRunner()

    def cli(*args: str):
        return runner.invoke(app, list(args), env=env)

    ls = cli("catalog", "ls", "--json")
    assert ls.exit_code == 0, ls.output
    assert {e["manifest"] for e in json.loads(ls.stdout)} == {d_here, d_gpu}
    ls_h = cli("catalog", "ls")
    assert ls_h.exit_code == 0 and "2 x " + H100 in ls_h.stdout and "no GPU" in ls_h.stdout

    show = cli("catalog", "show", "tiny", "--json")
    assert show.exit_code == 0, show.output
    data = json.loads(show.stdout)
    assert data["chosen"] == d_here
    by = {e["manifest"]: e for e in data["entries"]}
    assert by[d_here]["fits"] and by[d_here]["signature"] == f"trusted (key {kp.key_id})"
    assert not by[d_gpu]["fits"] and by[d_gpu]["signature"] == "unsigned"
    assert "no GPU" in by[d_gpu]["rejection"]
    missing = cli("catalog", "show", "nope")
    assert missing.exit_code == 4 and "nothing published" in missing.stdout
    kg = cli("keygen", str(tmp_path / "newkeys"), "--name", "ci")
    assert kg.exit_code == 0 and (tmp_path / "newkeys" / "ci.key").stat().st_mode & 0o777 == 0o600
    again = cli("keygen", str(tmp_path / "newkeys"), "--name", "ci")
    assert isinstance(again.exception, TrustError) and "already exists" in str(again.exception)

    # Once through the installed console script (error handling and exit codes of the real entry point).
    exe = str(Path(sys.executable).parent / "warmctl")
    human = subprocess.run([exe, "catalog", "show", "tiny"], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=60)
    assert human.returncode == 0, human.stderr
    assert "fits this host (chosen)" in human.stdout and "rejected (gpu)" in human.stdout
    again = subprocess.run([exe, "keygen", str(tmp_path / "newkeys"), "--name", "ci"], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=60)
    assert again.returncode == TrustError.exit_code and "already exists" in again.stderr
