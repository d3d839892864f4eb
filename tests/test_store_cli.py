"""The store commands (push, pull, verify, gc, du) through typer, on real local and S3 stores."""

from __future__ import annotations

import typer
from test_store_fixtures import chunk_files, snapshot, tag_of, write_payload
from typer.testing import CliRunner

from warmctl.cli import store as store_cli
from warmctl.base.errors import IntegrityError, SnapshotNotFound
from warmctl.naming.catalog import Catalog
from warmctl.store import StoreLocked, open_store
from warmctl.naming.trust import TrustError, generate_keypair

CH = 256 * 1024


def _app() -> typer.Typer:
    app = typer.Typer()
    store_cli.register(app)
    return app


def test_push_pull_verify_gc_du(tmp_path, monkeypatch, s3_url):
    monkeypatch.setenv("WARMCTL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WARMCTL_STORE", raising=False)
    monkeypatch.setenv("WARMCTL_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    kp = generate_keypair(tmp_path / "keys", "publisher")
    monkeypatch.setenv("WARMCTL_KEYS_DIR", str(tmp_path / "keys"))
    f = write_payload(tmp_path / "p.img", [("random", 3 * CH), ("zero", 2 * CH), ("text", CH)])
    home_store = tmp_path / "home" / "store"
    with open_store(home_store, chunk_size=CH) as s:
        d = snapshot(s, "tiny", {"p.img": f}, signer=kp.private)
        snapshot(s, "tiny", {"p.img": f}, tag="unsigned")
    r = CliRunner()
    app = _app()

    res = r.invoke(app, ["push", "tiny", "--to", s3_url])
    assert res.exit_code == 0, res.output
    assert "4/4 chunks copied" in res.output
    assert tag_of(open_store(s3_url), "tiny", "latest") == d

    other = tmp_path / "other"
    res = r.invoke(app, ["pull", "tiny:latest", "--from", s3_url, "--store", str(other)])
    # by default pull fetches only what this host can restore: this synthetic one records no host
    assert isinstance(res.exception, SnapshotNotFound) and "fits this host" in str(res.exception)
    res = r.invoke(app, ["pull", "tiny:latest", "--all", "--from", s3_url, "--store", str(other)])
    assert res.exit_code == 0, res.output
    assert tag_of(open_store(other), "tiny", "latest") == d
    # an unsigned entry is never named locally
    assert r.invoke(app, ["push", "tiny:unsigned", "--to", s3_url]).exit_code == 0
    res = r.invoke(app, ["pull", "tiny:unsigned", "--all", "--from", s3_url, "--store", str(other)])
    assert isinstance(res.exception, TrustError) and "is unsigned" in str(res.exception)
    assert tag_of(open_store(other), "tiny", "unsigned") is None

    res = r.invoke(app, ["verify"])
    assert res.exit_code == 0 and "OK" in res.output, res.output

    res = r.invoke(app, ["du"], env={"COLUMNS": "160"})
    assert res.exit_code == 0 and "tiny:latest" in res.output, res.output

    chunk_files(home_store)[0].write_bytes(b"bad")
    res = r.invoke(app, ["verify", "tiny"])
    assert isinstance(res.exception, IntegrityError) and "corrupt" in res.output

    res = r.invoke(app, ["pull", "ghost", "--from", s3_url])
    assert isinstance(res.exception, SnapshotNotFound)

    res = r.invoke(app, ["gc", "--grace", "0", "--dry-run"])
    assert res.exit_code == 0 and "would remove 0 chunks" in res.output, res.output  # the catalog names it
    with open_store(home_store) as s:
        assert Catalog(s).remove_tag("tiny", "latest") == [d]
        Catalog(s).remove_tag("tiny", "unsigned")
    res = r.invoke(app, ["gc", "--grace", "0", "--dry-run"])
    assert res.exit_code == 0 and "would remove 4 chunks" in res.output, res.output
    res = r.invoke(app, ["gc", "--grace", "0"])
    assert res.exit_code == 0 and "removed 4 chunks" in res.output, res.output
    assert chunk_files(home_store) == []


def test_gc_refuses_during_push(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMCTL_STORE", str(tmp_path / "s"))
    writer = open_store(tmp_path / "s")
    writer.add_file(write_payload(tmp_path / "a", [("random", CH)]))
    res = CliRunner().invoke(_app(), ["gc", "--grace", "0"])
    assert isinstance(res.exception, StoreLocked) and "add_file" in str(res.exception)
    writer.close()


def test_help_mentions_units_and_resume():
    r = CliRunner()
    app = _app()
    assert "only the chunks still missing" in r.invoke(app, ["pull", "--help"]).output
    assert "seconds" in r.invoke(app, ["gc", "--help"]).output
