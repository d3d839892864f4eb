"""Stale snapshots are named: when a profile changes, ``warmctl ls``, ``warmctl
status``, ``warmctl profile diff``, ``up`` (its reason to cold-start), ``snapshot`` (before it
starts) and ``GET /v1/snapshots`` (real uvicorn) say the snapshot was made from another version of
the profile and which fields changed. No engine: the snapshot is a signed manifest in a real
local store that embeds the shipped ``tiny`` profile, as ``snapshot`` writes it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from test_profile_cli import home, wc  # noqa: F401 (fixture)
from warmctl.naming.catalog import Catalog
from warmctl.records.config import Settings
from warmctl.host import fingerprint
from warmctl.records.manifest import CanaryRecord, FileEntry, Manifest
from warmctl.records.profile import PROFILES_DIR, Profile, diff_profiles, load_profile_file
from warmctl.records.progress import Reporter
from warmctl.records.state import EngineState, save as save_state
from warmctl.store import open_store
from warmctl.naming.trust import generate_keypair


def _publish_tiny(root: Path, prof: Profile | None = None) -> tuple[str, Manifest, Path]:
    """A signed local-store snapshot of ``tiny`` for this host, embedding the shipped profile
    (or ``prof``) as ``snapshot`` does; the keys dir trusts its key. Returns (digest,
    manifest, keys dir)."""
    prof = prof or load_profile_file(PROFILES_DIR / "tiny.toml")
    store = open_store(root / "home" / "store")
    payload = root / "pages-1.img"
    payload.write_bytes(random.Random(1).randbytes(40_000))
    m = Manifest(name="tiny", profile_digest=prof.digest(), profile=prof.model_dump(mode="json"),
                 host=fingerprint().model_dump(mode="json"),
                 canary=CanaryRecord(match="tokens", max_tokens=1, logprobs=0, completions=[]),
                 files=[FileEntry(path="pages-1.img", size=payload.stat().st_size, chunks=store.add_file(payload))])
    d = store.put_manifest(m)
    kp = generate_keypair(root / "signer")
    keys = root / "home" / "keys"
    keys.mkdir(parents=True)
    (keys / "signer.pub").write_bytes(kp.public.read_bytes())
    Catalog(store).publish(d, m, signer=kp.private)
    store.close()
    return d, m, keys


class _Lines(Reporter):
    def __init__(self):
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)


def test_stale_snapshot_is_named_by_ls_status_diff_up_snapshot_and_the_agent(home):
    env, root = home
    none = wc("profile", "diff", "tiny", env=env)  # nothing to compare with yet: not found (4), not "differ" (1)
    assert none.returncode == 4 and "no snapshot of tiny in" in none.stderr, none.stderr
    d, m, keys = _publish_tiny(root)
    settings = Settings(home=root / "home", keys_dir=keys, profile_dirs=[root / "profiles"])

    # Unchanged: nothing to say, diff exits 0.
    ls = wc("ls", env={**env, "COLUMNS": "200"})
    assert ls.returncode == 0 and "tiny:latest" in ls.stdout and "another version" not in ls.stdout + ls.stderr
    same = wc("profile", "diff", "tiny", env=env)
    assert same.returncode == 0 and "same profile" in same.stdout, same.stdout + same.stderr

    # The operator changes the profile (two fields).
    mine = root / "profiles" / "tiny.toml"
    mine.write_text((PROFILES_DIR / "tiny.toml").read_text().replace("concurrency = [1, 4]", "concurrency = [1, 8]")
                    .replace("max_tokens = 16", "max_tokens = 12"))
    assert [c[0] for c in diff_profiles(m.profile, load_profile_file(mine))] == ["canary.max_tokens", "warmup.concurrency"]
    want = "warmup.concurrency: [1, 4] -> [1, 8]"

    ls = wc("ls", env={**env, "COLUMNS": "60"})
    assert ls.returncode == 0, ls.stderr
    note = next(ln for ln in ls.stderr.splitlines() if "another version" in ln)  # one whole line
    assert note.startswith(f"tiny:latest ({d[:19]}) was made from another version of profile tiny ({mine})")
    assert "canary.max_tokens: 16 -> 12" in note and want in note
    js = json.loads(wc("ls", "--json", env=env).stdout)[0]["profile"]
    assert js["current"] is False and js["profile_file"] == str(mine)
    assert {"field": "warmup.concurrency", "snapshot": [1, 4], "profile": [1, 8]} in js["changes"]

    diff = wc("profile", "diff", "tiny", env=env)
    assert diff.returncode == 1, diff.stderr
    assert f"--- tiny:latest {d}" in diff.stdout and want in diff.stdout.splitlines()
    dj = json.loads(wc("profile", "diff", "tiny", "--json", env=env).stdout)
    assert dj["same"] is False and dj["snapshot_digest"] == d and len(dj["changes"]) == 2

    # up: the reason it cold-starts names the fields (the catalog's choice, signature checked).
    from warmctl.pipelines.lifecycle import _find_snapshot

    found = _find_snapshot("tiny", settings, _Lines(), "latest", None, load_profile_file(mine), False)
    try:
        assert found.manifest is None and found.digest == d
        assert found.reason.startswith(f"snapshot tiny:latest ({d[:19]}) was made from another version of profile tiny")
        assert want in found.reason
    finally:
        found.close()

    # snapshot: says what changed before it starts (and nothing when the profile is the same).
    from warmctl.pipelines.snapshot import _report_drift

    rep = _Lines()
    _report_drift(load_profile_file(mine), settings, "latest", rep)
    assert len(rep.lines) == 1 and "the snapshot it replaces, tiny:latest" in rep.lines[0] and want in rep.lines[0]
    rep = _Lines()
    _report_drift(load_profile_file(PROFILES_DIR / "tiny.toml"), settings, "latest", rep)
    assert rep.lines == []

    # status: an engine restored from that snapshot (recorded; its processes are gone).
    save_state(settings.run_dir, EngineState(name="tiny", phase="serving", source="restore", manifest_digest=d,
                                             profile_digest=m.profile_digest, internal_port=1, public_host="127.0.0.1",
                                             public_port=1, served_model_name="tiny", log_path=str(root / "log")))
    st = wc("status", env={**env, "COLUMNS": "60"})
    assert f"engine tiny (snapshot {d[:19]}) was made from another version of profile tiny" in st.stderr, st.stderr
    sj = json.loads(wc("status", "--json", env=env).stdout)[0]["profile"]
    assert sj["current"] is False and {c["field"] for c in sj["changes"]} == {"warmup.concurrency", "canary.max_tokens"}

    # GET /v1/snapshots on the agent (real uvicorn on a socket bound to port 0), with this home's settings.
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from warmctl.agent import create_app

    app = create_app(Settings(home=root / "home", keys_dir=keys, profile_dirs=[root / "profiles"]), "t0ken-for-tests")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        r = httpx.get(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/snapshots",
                      headers={"Authorization": "Bearer t0ken-for-tests"}, timeout=10)
        assert r.status_code == 200, r.text
        (view,) = r.json()
        assert view["digest"] == d and view["profile_current"] is False
        assert {"field": "canary.max_tokens", "snapshot": 16, "profile": 12} in view["profile_changes"]
        # a name whose manifest cannot be read is still listed (not a 500), without its layout
        (root / "home" / "store" / "manifests" / "sha256" / d.split(":", 1)[1]).unlink()
        r = httpx.get(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/snapshots",
                      headers={"Authorization": "Bearer t0ken-for-tests"}, timeout=10)
        assert r.status_code == 200, r.text
        (view,) = r.json()
        assert view["digest"] == d and view["layout"] is None, view
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
