"""The main job end to end, with real CRIU and the real vLLM engine (CPU build) on ``tiny``.

One session snapshot (``tiny_snapshot``) serves every test here; each test brings the engine
up from it and down again. Order matters only for speed, not correctness.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from tests.conftest import SNAPSHOT_PROBES, WARMCTL, engine_pids, listening, shm_leaked, shm_names, warmctl

from warmctl.checkpoint import affinity
from warmctl.checkpoint.imagecache import ImageCache, entry_name
from warmctl.naming.catalog import Catalog
from warmctl.records.config import load_settings
from warmctl.base.errors import HostError
from warmctl.records.manifest import Manifest
from warmctl.store import chunk_key, open_store
from warmctl.store.chunks import is_zero_chunk

pytestmark = pytest.mark.e2e


def _settings(env):
    old = os.environ.get("WARMCTL_CONFIG")
    os.environ["WARMCTL_CONFIG"] = env["WARMCTL_CONFIG"]
    try:
        return load_settings()
    finally:
        if old is None:
            os.environ.pop("WARMCTL_CONFIG")
        else:
            os.environ["WARMCTL_CONFIG"] = old


@pytest.fixture(autouse=True)
def _down_after(wc_env):
    """Whatever a test leaves up (a failed assertion mid-test), the next one starts clean."""
    yield
    warmctl("down", "tiny", env=wc_env, check=False)


def _completion(port: int, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 3,
        "return_token_ids": True, "ignore_eos": True})
    r.raise_for_status()
    c = r.json()["choices"][0]
    return {"ids": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"]}


PROMPTS = ["The capital of France is", "Name three fruits.", "Water boils at"]



def test_snapshot_reports_phases(tiny_snapshot, wc_env):
    s = _settings(wc_env)
    store = open_store(s.store_dir)
    m = store.get_manifest(tiny_snapshot["digest"])
    names = {p.name for p in m.phases}
    assert {"weights", "torch_compile", "cold_start", "warmup", "canary_record", "criu_dump", "zero_pages",
            "store"} <= names
    assert "total" not in names  # launch to healthy is cold_start; "total" is up's own sum
    # the image's all-zero anonymous pages were left out (warmctl.checkpoint.zeropages): before,
    # 1.0 of tiny's 2.3 GiB of pages were zero, many whole chunks of them; now none is
    pages = [(f.path, c) for f in m.files if f.role == "image" and f.path.startswith("pages-") for c in f.chunks]
    assert pages and not [p for p, c in pages if is_zero_chunk(c.digest, c.size)], len(pages)
    assert next(p.seconds for p in m.phases if p.name == "torch_compile") > 0
    roles = {f.role for f in m.files}
    assert {"image", "shm"} <= roles
    assert m.canary.completions and all(len(c.token_ids) == m.canary.max_tokens for c in m.canary.completions)
    # nothing of the snapshot's engine is left running or in /dev/shm (semaphores included)
    assert not any(f.path in shm_names() for f in m.files if f.role == "shm")
    assert tiny_snapshot["shm_left"] == set()
    # which digest is which: the profile's at the start, the snapshot's at the end
    prof = m.profile_digest[:19]
    assert f"(profile {prof})" in " ".join(tiny_snapshot["stderr"].split()), tiny_snapshot["stderr"]
    assert f"{tiny_snapshot['digest']} (the snapshot's digest;" in " ".join(tiny_snapshot["stdout"].split())
    # a one-rank engine records its layout too: world size 1, its one rank (the CPU build's
    # VLLM::Worker process at TP1) with its namespace PID and bound CPUs; ls shows it
    lay = m.restore.layout
    assert lay is not None and (lay.tp, lay.pp, lay.dp, lay.ep, lay.world_size) == (1, 1, 1, 1, 1)
    [rank] = lay.ranks
    assert rank.rank == 0 and rank.role in ("Worker", "EngineCore") and rank.nspid > 1
    assert lay.network_lock is None and lay.listen == []  # no rank-to-rank connection to lock
    if len(os.sched_getaffinity(0)) >= 2:
        assert rank.cpus, "the one rank's bound CPUs were not recorded"
    [row] = [x for x in json.loads(warmctl("ls", "--json", env=wc_env).stdout)
             if x["name"] == "tiny" and x["digest"] == tiny_snapshot["digest"]]
    assert row["layout"]["world_size"] == 1 and row["layout"]["ranks"][0]["role"] == rank.role
    assert f"TP1 ({rank.role} ns-pid {rank.nspid}" in warmctl("ls", env=wc_env).stdout


def test_no_credential_of_the_snapshot_environment_is_stored(tiny_snapshot, wc_env):
    """The session snapshot ran with S3 credentials and a Hugging Face token in its environment
    (SNAPSHOT_PROBES): not one stored byte holds them. Every file of the manifest is read back
    chunk by chunk, decompressed and verified (a value across a chunk boundary counts), and every
    object of the store (manifests, signatures, catalog, chunks as stored) is read raw."""
    s = _settings(wc_env)
    store = open_store(s.store_dir)
    probes = [v.encode() for v in SNAPSHOT_PROBES.values()]
    m = store.get_manifest(tiny_snapshot["digest"])
    assert "secret_scan" in {p.name for p in m.phases}
    assert "secret scan:" in tiny_snapshot["stdout"] + tiny_snapshot["stderr"]
    nbytes = 0
    for f in m.files:
        tail = b""
        for c in f.chunks:
            data = tail + store.load_chunk(c, f.path)
            nbytes += c.size
            assert not [p for p in probes if p in data], f"a credential in {f.path}"
            tail = data[-64:]
    assert nbytes == sum(f.size for f in m.files if not f.hardlink_to) > 2**20
    objects = [p for p in s.store_dir.rglob("*") if p.is_file()]
    assert len(objects) > 10
    for p in objects:
        data = p.read_bytes()
        assert not [x for x in probes if x in data], f"a credential in {p}"


def test_up_restore_serves_same_output_as_cold(tiny_snapshot, wc_env, engine_ports):
    """Cold path (empty tag) and restore path give bit-identical greedy output."""
    _, gate = engine_ports
    shm0 = shm_names()
    # cold path: a tag with no snapshot -> up says why and cold-starts from the profile
    r = warmctl("up", "tiny:none", "--json", env=wc_env, timeout=900)
    res = json.loads(r.stdout)
    assert res["source"] == "cold" and not res["already_up"] and "no snapshot tiny:none" in res["reason"]
    assert res["path"] == "cold"  # the field older clients read
    t = res["timings_s"]  # total: the sum of up's own phases (not the engine's launch-to-healthy)
    assert t["total"] == pytest.approx(sum(t.get(k, 0) for k in ("catalog", "cold_start", "warmup", "canary_record", "gate")))
    assert t["total"] > t["cold_start"] >= t["torch_compile"]
    cold = [_completion(gate, p) for p in PROMPTS]
    warmctl("down", "tiny", env=wc_env)
    assert not listening(gate)
    assert not (left := shm_leaked(shm0)), f"down of a cold engine left {left} in /dev/shm"

    r = warmctl("up", "tiny", "--json", env=wc_env)
    res = json.loads(r.stdout)
    assert res["source"] == "restore" and res["snapshot"] == tiny_snapshot["digest"]
    assert {"materialize", "restore", "health", "canary", "gate", "total"} <= set(res["timings_s"])
    t = res["timings_s"]
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))
    # vLLM's CPU build bound its compute thread at the cold start; CRIU restores no affinity,
    # up put it back: every thread recorded in the manifest is on its recorded CPUs again
    m = open_store(_settings(wc_env).store_dir).get_manifest(tiny_snapshot["digest"])
    if len(os.sched_getaffinity(0)) >= 2:  # with one CPU there is nothing to bind to
        assert m.restore.cpu_affinity, "the snapshot recorded no bound thread of the engine"
    root = json.loads(warmctl("status", "tiny", "--json", env=wc_env).stdout)[0]["root_pid"]
    now = affinity.record(root)
    for cpus, threads in m.restore.cpu_affinity.items():
        assert set(threads) <= set(now.get(cpus, ())), f"bound at snapshot: {m.restore.cpu_affinity}; now: {now}"
    restored = [_completion(gate, p) for p in PROMPTS]
    assert restored == cold
    # the credentials in snapshot's environment (SNAPSHOT_PROBES) are nowhere in the restored
    # tree's environment: it is the declared one the manifest records by name
    tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    for p in tree:
        environ = open(f"/proc/{p.pid}/environ", "rb").read()
        for k, v in SNAPSHOT_PROBES.items():
            assert k.encode() + b"=" not in environ and v.encode() not in environ, (p.pid, k)
    assert m.restore.engine_env["PATH"] == "base" and m.restore.engine_env["VLLM_CPU_KVCACHE_SPACE"] == "profile"
    assert m.restore.engine_env["HF_HUB_OFFLINE"] == "profile" and m.restore.engine_env["PYTHONUNBUFFERED"] == "warmctl"
    assert not set(SNAPSHOT_PROBES) & set(m.restore.engine_env)
    # chat completion on the public port
    chat = httpx.post(f"http://127.0.0.1:{gate}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France? One word."}],
        "max_tokens": 8, "temperature": 0})
    assert chat.status_code == 200, chat.text
    answer = chat.json()["choices"][0]["message"]["content"]
    assert answer.strip() and chat.json()["usage"]["completion_tokens"] >= 1, chat.text
    # up again changes nothing
    again = json.loads(warmctl("up", "tiny", "--json", env=wc_env).stdout)
    assert again["already_up"] and again["source"] == "restore" and again["path"] == "already-up"
    st = json.loads(warmctl("status", "tiny", "--json", env=wc_env).stdout)[0]
    assert st["phase"] == "serving" and st["healthy"] and st["gate_alive"]
    assert st["layout"] == "TP1" and list(st["ranks"]) == [m.restore.layout.ranks[0].role]  # checked after the restore

    shm_before_down = shm_names()
    warmctl("down", "tiny", env=wc_env)
    assert not listening(gate)
    m = open_store(_settings(wc_env).store_dir).get_manifest(tiny_snapshot["digest"])
    assert not ({f.path for f in m.files if f.role == "shm"} & shm_names())
    assert not shm_leaked(shm_before_down)

    # a second up from the same snapshot after down works too, from the image the first one
    # verified and kept (not rewritten: same inodes), and leaves it in place
    entry = ImageCache.for_settings(_settings(wc_env)).root / entry_name(tiny_snapshot["digest"])
    kept = {p.name: p.stat().st_ino for p in (entry / "images").iterdir()}
    assert kept and (entry / "verified.json").is_file()
    res2 = json.loads(warmctl("up", "tiny", "--json", env=wc_env).stdout)
    assert res2["source"] == "restore"
    assert {p.name: p.stat().st_ino for p in (entry / "images").iterdir()} == kept
    assert [_completion(gate, p) for p in PROMPTS] == cold
    warmctl("down", "tiny", env=wc_env)
    assert (entry / "verified.json").is_file()

    # keep no image (image_cache_bytes = 0) and `up -q`: the image is written into the
    # run directory, restored from (the canary and the completions match) and removed; stdout
    # is the serving line alone, no progress on stderr
    shutil.rmtree(entry)
    none = {**wc_env, "WARMCTL_IMAGE_CACHE_BYTES": "0"}
    r = warmctl("up", "tiny", "-q", env=none)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serving tiny on http://") and lines[0].endswith(f":{gate}/v1"), r.stdout
    assert "ok materialize" not in r.stderr and "not kept" not in r.stderr, r.stderr
    assert [_completion(gate, p) for p in PROMPTS] == cold
    assert not entry.exists() and not (_settings(wc_env).run_dir / "tiny" / "unkept-image").exists()
    warmctl("down", "tiny", env=wc_env)


def test_corrupt_chunk_is_refused_and_named(tiny_snapshot, wc_env, engine_ports):
    s = _settings(wc_env)
    store = open_store(s.store_dir)
    m = store.get_manifest(tiny_snapshot["digest"])
    # the largest stored (non-zero) chunk of a page image
    chunk, path = max(((c, s.store_dir / chunk_key(c.digest)) for f in m.files if f.role == "image"
                       for c in f.chunks if (s.store_dir / chunk_key(c.digest)).is_file()),
                      key=lambda cp: cp[0].size)
    original = path.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(flipped))
    # the first up after a pull: no verified image kept yet, so every chunk is read (a kept
    # image, verified when it was written, would not read the store at all)
    cache = ImageCache.for_settings(s)
    for e in cache.entries():
        shutil.rmtree(e.path)
    try:
        shm0 = shm_names()
        r = warmctl("up", "tiny", env=wc_env, check=False)
        assert r.returncode != 0
        assert chunk.digest.split(":")[1][:16] in (r.stderr + r.stdout)
        assert cache.entries() == [] and not list(cache.root.glob(".partial-*"))  # nothing half-written kept
        assert not listening(engine_ports[1])
        assert not shm_leaked(shm0)
        assert json.loads(warmctl("status", "--json", env=wc_env).stdout) == []
    finally:
        path.write_bytes(original)


def test_altered_canary_is_refused_port_never_opens(tiny_snapshot, wc_env, engine_ports):
    s = _settings(wc_env)
    store = open_store(s.store_dir)
    m = store.get_manifest(tiny_snapshot["digest"])
    data = m.model_dump(mode="json")
    data["canary"]["completions"][0]["logprobs"][3] += 1e-6
    bad = Manifest.model_validate(data)
    digest = store.put_manifest(bad)
    # signed with this host's trusted key: only the canary can catch it
    Catalog(store).publish(digest, bad, tag="tampered", signer=s.home / "keys" / "local.key")

    opened = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if listening(engine_ports[1]):
                opened.append(time.time())
            time.sleep(0.02)

    t = threading.Thread(target=watch)
    t.start()
    shm0 = shm_names()
    try:
        r = warmctl("up", "tiny:tampered", env=wc_env, check=False)
    finally:
        stop.set()
        t.join()
    out = r.stderr + r.stdout
    assert r.returncode == 3, out
    assert "canary mismatch" in out and "position 3" in out
    assert not opened, "public port accepted a connection before/without a passing canary"
    assert json.loads(warmctl("status", "--json", env=wc_env).stdout) == []
    assert not shm_leaked(shm0)
    assert engine_pids(wc_env) == []
    Catalog(store).remove("tiny", "tampered", digest)




def test_public_port_taken_fails_before_restore(tiny_snapshot, wc_env, engine_ports):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", engine_ports[1]))
        s.listen()
        r = warmctl("up", "tiny", env=wc_env, check=False)
    out = r.stderr + r.stdout
    assert r.returncode != 0
    assert f"public port 127.0.0.1:{engine_ports[1]} is already in use" in out.replace("\n", " ")
    assert "materialize" not in out and "restore" not in out.split("error")[0]
    assert json.loads(warmctl("status", "--json", env=wc_env).stdout) == []


def test_up_with_a_key_file_guards_the_public_port_and_down_drains(tiny_snapshot, wc_env, engine_ports, tmp_path):
    """Seed 003's ``--api-key`` as warmctl expresses it: the profile plus a key file. Through
    the public port the key is required, the control routes are refused; ``status`` says so;
    ``down`` during a streaming completion lets it finish before the engine stops."""
    engine, gate = engine_ports
    keys = tmp_path / "api-keys"
    keys.write_text("sk-e2e-one\nsk-e2e-two\n")
    keys.chmod(0o600)
    env = {**wc_env, "WARMCTL_GATE_DRAIN_S": "300"}  # the drain below waits for ~7.9 MB per stream
    res = json.loads(warmctl("up", "tiny", "--json", "--api-key-file", str(keys), env=env).stdout)
    assert res["source"] == "restore"
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"http://127.0.0.1:{gate}/v1/completions", json=body, timeout=60).status_code == 401
    for k in ("sk-e2e-one", "sk-e2e-two"):
        r = httpx.post(f"http://127.0.0.1:{gate}/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {k}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    for path in ("/collective_rpc", "/sleep", "/reset_prefix_cache"):
        assert httpx.post(f"http://127.0.0.1:{gate}{path}", json={}, timeout=10,
                          headers={"Authorization": "Bearer sk-e2e-one"}).status_code == 403
    assert httpx.get(f"http://127.0.0.1:{gate}/health", timeout=10).status_code == 200
    # the allow list against the installed engine's own route table: the gate read vLLM's
    # /openapi.json and logged which routes stay closed; each of those is refused by the gate
    gate_log = _settings(wc_env).run_dir / "tiny" / "gate.log"
    deadline = time.monotonic() + 30
    while not (report := [x for x in gate_log.read_text().splitlines() if "the engine serves" in x]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert report and "stay closed" in report[-1], report
    closed = report[-1].rsplit(": ", 1)[-1].split()
    assert "/v1/completions" not in closed and "/v1/chat/completions" not in closed and "/v1/models" not in closed
    for path in closed:
        if "{" not in path:
            assert httpx.post(f"http://127.0.0.1:{gate}{path}", json={}, timeout=10, headers={
                "Authorization": "Bearer sk-e2e-one"}).status_code in (403, 404), path
    assert "sk-e2e" not in json.dumps(json.loads(open(_settings(wc_env).run_dir / "tiny" / "state.json").read()))
    st = json.loads(warmctl("status", "tiny", "--json", env=wc_env).stdout)[0]
    assert st["gate_api_key"] is True and st["gate_tls"] is False

    # The streams stay provably in flight while `down` runs: each client stops reading after its
    # first chunk until the gate has begun draining. The gate counts a response finished once it
    # has read it from the engine, and it reads on only as fast as it can write to the client,
    # so it can be ahead of the client by at most the client's receive buffer (fixed here, which
    # stops its autotuning; the kernel doubles it), its own send buffer (autotuned up to
    # tcp_wmem's maximum), its write buffer and one read: each stream (14 choices x 1000 tokens
    # with 20 logprobs, ~7.9 MB; 8 choices gave 4.5 MB, too close to the bound) is longer than
    # that, and the test checks it was. Only then do the clients read on, to [DONE].
    n, rcvbuf = 3, 64 * 1024
    ahead = int(open("/proc/sys/net/ipv4/tcp_wmem").read().split()[2]) + 2 * rcvbuf + 2**20  # bytes, an upper bound
    streams: list[list[str]] = [[] for _ in range(n)]
    after = [0] * n  # bytes read once `down` had begun draining
    errors: list[BaseException] = []
    started = [threading.Event() for _ in range(n)]
    release = threading.Event()

    def stream(i: int) -> None:
        transport = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)])
        try:
            with httpx.Client(transport=transport, timeout=300) as client, client.stream(
                    "POST", f"http://127.0.0.1:{gate}/v1/completions", headers={"Authorization": "Bearer sk-e2e-two"},
                    json={**body, "max_tokens": 1000, "stream": True, "ignore_eos": True, "logprobs": 20, "n": 14,
                          "temperature": 1.0, "seed": i}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    streams[i].append(line)
                    if release.is_set():
                        after[i] += len(line) + 2
                    else:
                        started[i].set()
                        release.wait(120)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started), errors
    gate_log = _settings(wc_env).run_dir / "tiny" / "gate.log"  # earlier tests' gates wrote to it too
    start = gate_log.stat().st_size

    def log() -> str:
        with open(gate_log) as f:
            f.seek(start)
            return f.read()

    down = subprocess.Popen([*WARMCTL, "down", "tiny"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while "draining" not in log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"draining {n} connection(s)" in log(), log()
        assert not listening(gate)  # the listener is closed while the streams are open
        time.sleep(1.0)  # a gate holding only finished responses closes them within 50 ms
        assert "gate: closed" not in log() and down.poll() is None
    finally:
        release.set()
        for t in threads:
            t.join(300)
        out, _ = down.communicate(timeout=300)
    assert down.returncode == 0, out
    assert not errors and all(s and s[-1] == "data: [DONE]" for s in streams), errors
    # every stream was still unfinished at the gate when the drain began, and ended with [DONE]
    assert all(a > ahead for a in after), (after, ahead)
    assert "gate: closed" in log()
    assert not listening(gate) and not listening(engine)


def test_a_required_file_rewritten_with_the_same_size_is_refused_and_named(tiny_snapshot, wc_env, engine_ports, tmp_path):
    """Every required file (the venv's and the OS's libraries the engine maps)
    has a content digest in the manifest; a file rewritten in place with other bytes of the
    same size makes `up` refuse, naming it, before anything is written.

    The shared venv must not be altered (other suites restore from it), so the rewritten file is
    one added to the session snapshot's required files (a copy of a real venv library, re-signed
    with this host's key): `up` runs the one check every required file goes through."""
    s = _settings(wc_env)
    store = open_store(s.store_dir)
    m = store.get_manifest(tiny_snapshot["digest"])
    req, digests = m.restore.required_files, m.restore.required_digests
    assert len(req) > 50 and set(digests) == set(req)  # every mapped venv/OS file has its digest
    assert all(d.startswith(("blake3:", "sha256:")) for d in digests.values())
    src = min((p for p in req if p.endswith(".so") and 4096 < req[p] < 2**20), key=req.get)
    lib = tmp_path / "venv-copy" / os.path.basename(src)
    lib.parent.mkdir()
    shutil.copyfile(src, lib)
    from warmctl.checkpoint.filedigest import hash_file

    data = m.model_dump(mode="json")
    data["restore"]["required_files"][str(lib)] = lib.stat().st_size
    data["restore"]["required_digests"][str(lib)] = hash_file(lib, digests[src].split(":")[0])
    assert data["restore"]["required_digests"][str(lib)] == digests[src]  # the copy has the library's digest
    changed = Manifest.model_validate(data)
    digest = store.put_manifest(changed)
    Catalog(store).publish(digest, changed, tag="libcheck", signer=s.home / "keys" / "local.key")
    size = lib.stat().st_size
    with open(lib, "r+b") as f:  # rewritten in place: other bytes, the same size
        f.seek(size // 2)
        b = f.read(16)
        f.seek(size // 2)
        f.write(bytes(x ^ 0xFF for x in b))
    assert lib.stat().st_size == size
    shm0 = shm_names()
    try:
        r = warmctl("up", "tiny:libcheck", env=wc_env, check=False)
        out = (r.stderr + r.stdout).replace("\n", " ")
        assert r.returncode == HostError.exit_code, out
        assert f"{lib}: content differs (same size, {size} bytes" in " ".join(out.split())
        assert "1 file(s)" in out and src not in out  # only the changed file is named
        assert re.search(r"failed materialize\b", out) and not re.search(r"(ok|failed) restore\b", out)
        assert json.loads(warmctl("status", "--json", env=wc_env).stdout) == []
        assert not listening(engine_ports[1]) and not shm_leaked(shm0)
    finally:
        Catalog(store).remove("tiny", "libcheck", digest)
