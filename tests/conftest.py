"""Shared fixtures. Tests that need an engine share ONE session-scoped snapshot of ``tiny``.

Environment knobs (for running several suites side by side on one host):
``WARMCTL_TEST_ENGINE_PORT`` (internal engine port, default 18000) and
``WARMCTL_TEST_GATE_PORT`` (public port, default 18080). ``WARMCTL_TEST_KEEP_TMP=1`` keeps each
module's temporary directories after it (by default removed: :func:`_module_tmp_freed`).
At the session's end the terminal summary lists the slowest test files (wall seconds of their
tests' setup, call and teardown, module fixtures included); ``WARMCTL_TEST_TIMES=FILE`` also
writes every file's seconds to FILE (``SECONDS PATH`` lines, slowest first), then every test's
(``SECONDS NODEID`` lines, setup and teardown included, slowest first).

The session's engine snapshots (``tiny``, ``tiny-tp2``, ``tiny-moe-tp2``: two minutes of cold start,
warm-up and checkpoint each on 2 cores) are built ahead, one after another in a background
thread, while the files without end-to-end tests run first (:func:`_session_snapshots_ahead`,
:func:`pytest_collection_modifyitems`); ``WARMCTL_TEST_AHEAD=0`` builds each when a test first
asks for it instead.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
WARMCTL = [sys.executable, "-m", "warmctl"]


#: Wall seconds per test file (setup + call + teardown of its tests), filled as reports arrive.
FILE_SECONDS: dict[str, float] = {}
#: The same per test (node id).
TEST_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration
    TEST_SECONDS[report.nodeid] = TEST_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    rows = sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])
    if out := os.environ.get("WARMCTL_TEST_TIMES"):
        tests = sorted(TEST_SECONDS.items(), key=lambda kv: -kv[1])
        Path(out).write_text("".join(f"{s:9.1f} {p}\n" for p, s in [*rows, *tests]))
    if len(rows) > 1:
        terminalreporter.write_sep("=", f"slowest test files (of {len(rows)}, {sum(FILE_SECONDS.values()):.0f} s in all)")
        for p, s in rows[:20]:
            terminalreporter.write_line(f"{s:9.1f} s  {p}")


def warmctl(*args: str, env: dict[str, str], check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the real ``warmctl`` CLI in a subprocess; on ``check`` failure show its output."""
    r = subprocess.run([*WARMCTL, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"warmctl {' '.join(args)} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    return r


def need_service(missing: str | None, flag: str) -> None:
    """Skip the test when ``missing`` (what is absent, with how to install it) is set, or fail it
    when ``CI`` or ``flag`` (e.g. ``WARMCTL_REQUIRE_RGW``) is ``1``: CI cannot lose a real-server
    test to a missing binary."""
    if not missing:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false") or os.environ.get(flag) == "1":
        pytest.fail(f"{missing} (required: CI or {flag}=1 is set)")
    pytest.skip(missing)


def listening(port: int, timeout_s: float = 0.3) -> bool:
    """Whether a TCP connection to 127.0.0.1:``port`` is accepted within ``timeout_s`` seconds."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_until(cond, timeout_s: float = 20.0) -> bool:
    """Call ``cond()`` every 0.05 s until it is true or ``timeout_s`` seconds pass; returns
    its last value (a test asserts it)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


#: The temp directory, where vLLM binds its ZMQ IPC sockets (``<uuid>``) unless
#: ``VLLM_RPC_BASE_PATH`` says otherwise (warmctl gives each engine its own).
TMP = Path(tempfile.gettempdir())


def _tmp_sockets() -> set[str]:
    """Unix socket files directly in the temp directory, as ``tmp:NAME``."""
    out = set()
    try:
        for e in os.scandir(TMP):
            try:
                if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode):
                    out.add(f"tmp:{e.name}")
            except OSError:
                continue
    except OSError:
        pass
    return out


def shm_names() -> set[str]:
    """Names in ``/dev/shm`` now, and the Unix sockets in the temp directory (``tmp:NAME``)."""
    return set(os.listdir("/dev/shm")) | _tmp_sockets()


def _left(before: set[str]) -> set[str]:
    from warmctl.bench.shm import left_since
    from warmctl.checkpoint.capture import bound_unix_sockets

    bound = bound_unix_sockets()
    return ({f.path.name for f in left_since(before)}
            | {n for n in _tmp_sockets() - before if str(TMP / n[4:]) not in bound})


def shm_leaked(before: set[str]) -> set[str]:
    """/dev/shm files that appeared since ``before`` and that no process uses, and Unix socket
    files that appeared in the temp directory (``tmp:NAME``, vLLM's ZMQ IPC sockets) that no
    socket is bound to, twice 2 s apart: what a run leaked. Files of live processes (other
    engines on a shared host) and another run's passing CRIU files are not counted."""
    import time

    first = _left(before)
    if not first:
        return first
    time.sleep(2)
    return first & _left(before)


def procs_under(d: Path) -> list[psutil.Process]:
    """Live processes (this one aside) whose working directory is ``d`` or below it, or whose
    command line names it: what a home, node or engine run directory ``d`` still has running."""
    d = d.resolve()
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and (Path(p.cwd()).is_relative_to(d) or str(d) in " ".join(p.cmdline())):
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def engine_pids(env: dict[str, str]) -> list[int]:
    """PIDs of the engine processes of ``env``'s home (restored ones too: CRIU restores the
    environment block): their ``VLLM_RPC_BASE_PATH``, which warmctl declares, lies in the home's
    run directory (``WARMCTL_TEST_HOME`` itself never reaches the engine's declared environment)."""
    home = env["WARMCTL_TEST_HOME"] + "/"
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("VLLM_RPC_BASE_PATH", "").startswith(home):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def with_signing(env: dict[str, str], root: Path, *, trust: list[Path], signing_key: Path | None = None) -> dict[str, str]:
    """``env`` (an :func:`isolated_env` in ``root``) as a node that signs what it makes: its own
    signing key (generated into ``root/signing``, or ``signing_key``) named in its config, and
    ``keys_dir`` holding its own public key plus the ``trust`` ones. Returns ``env``."""
    keys = root / "keys"
    keys.mkdir(exist_ok=True)
    if signing_key is None:
        warmctl("keygen", str(root / "signing"), "--name", "node", env=env)
        signing_key = root / "signing" / "node.key"
        shutil.copy(root / "signing" / "node.pub", keys / "node.pub")
    for i, pub in enumerate(trust):
        shutil.copy(pub, keys / f"trusted-{i}.pub")
    cfg = Path(env["WARMCTL_CONFIG"])
    cfg.write_text(cfg.read_text() + f'signing_key = "{signing_key}"\n')
    return env


@pytest.fixture
def fake_clean(fk_env):
    """``warmctl down fake`` in :func:`fk_env` before and after the test, then no process of its
    engines may be left (any left is killed, and the test fails naming it)."""
    warmctl("down", "fake", env=fk_env, check=False)
    yield
    warmctl("down", "fake", env=fk_env, check=False)
    left = procs_under(Path(fk_env["WARMCTL_TEST_HOME"]) / "run")
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {left}"


def engine_tmp_dirs(env: dict[str, str]) -> list[Path]:
    """The engines' own scratch directories (``<home>/run/NAME/tmp``) left in the home of the
    warmctl environment ``env``: none once every engine is down."""
    return sorted((Path(env["WARMCTL_TEST_HOME"]) / "run").glob("*/tmp"))

def read_to_close(s) -> bytes:
    """Every byte the peer sends on socket ``s`` until it closes, resets, or the socket's own
    timeout passes: a raw-socket test's whole answer (the gate's or the agent's)."""
    import socket

    out = b""
    try:
        while got := s.recv(65536):
            out += got
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def stop_process(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """End ``proc``: SIGTERM, then SIGKILL if it has not exited within ``grace_s`` seconds;
    reaped either way (nothing when it has already exited)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_agent_ready(url: str, proc: subprocess.Popen, log_text, timeout_s: float = 60) -> None:
    """Poll ``url``/readyz every 0.1 s until it answers 200; fails with the agent's log
    (``log_text()``) if ``proc`` exits first or ``timeout_s`` (seconds) pass."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, f"agent exited: {log_text()}"
        assert time.monotonic() < deadline, f"agent not ready after {timeout_s:.0f} s: {log_text()}"
        time.sleep(0.1)


@pytest.fixture(scope="session")
def engine_ports() -> tuple[int, int]:
    """(internal engine port, public gate port) used by the shared ``tiny`` profile."""
    return (int(os.environ.get("WARMCTL_TEST_ENGINE_PORT", "18000")),
            int(os.environ.get("WARMCTL_TEST_GATE_PORT", "18080")))


def tiny_profile(engine_port: int, gate_port: int, name: str = "tiny", extra: str = "") -> str:
    """The shipped ``tiny`` profile renamed to ``name``, on the given internal and public ports,
    with ``extra`` TOML appended."""
    text = (REPO / "profiles" / "tiny.toml").read_text()
    text = re.sub(r'(?m)^name = "tiny"', f'name = "{name}"', text)
    text = re.sub(r"(?m)^port = 18000", f"port = {engine_port}", text)
    text = re.sub(r"(?m)^port = 8000", f"port = {gate_port}", text)
    return text + extra


#: The multi-rank profiles the e2e tests snapshot, shipped in ``profiles/``: name -> (internal
#: port in the file, offset of the test's internal port from ``WARMCTL_TEST_ENGINE_PORT``, offset
#: of its ``VLLM_PORT``). Each gets ports of its own, so a session's engines never share one.
RANK_PROFILES = {"tiny-tp2": (18002, 2, 40), "tiny-moe-tp2": (18004, 4, 60)}


def rank_profile(name: str, engine_port: int, gate_port: int) -> str:
    """The shipped multi-rank profile ``name`` (:data:`RANK_PROFILES`) on internal port
    ``engine_port`` + its offset and public port ``gate_port``, with ``VLLM_PORT`` (engine_port +
    its own offset) in its ``[engine.env]``: where vLLM starts looking for ports it picks itself
    (vLLM 0.32's ranks meet through a file store, and their gloo ports are the kernel's choice:
    docs/operations.md, "Ports")."""
    shipped, port_off, vllm_off = RANK_PROFILES[name]
    text = (REPO / "profiles" / f"{name}.toml").read_text()
    text = re.sub(rf"(?m)^port = {shipped}", f"port = {engine_port + port_off}", text)
    text = text.replace('HF_HUB_OFFLINE = "1"', f'HF_HUB_OFFLINE = "1"\nVLLM_PORT = "{engine_port + vllm_off}"')
    return re.sub(r"(?m)^port = 8000", f"port = {gate_port}", text)


def tp2_profile(engine_port: int, gate_port: int) -> str:
    """:func:`rank_profile` of ``tiny-tp2`` (internal port ``engine_port + 2``, ``VLLM_PORT``
    ``engine_port + 40``)."""
    return rank_profile("tiny-tp2", engine_port, gate_port)


def isolated_env(root: Path, engine_port: int, gate_port: int) -> dict[str, str]:
    """Environment for warmctl subprocesses that touches nothing outside ``root``: data dir
    ``root/home``, a config file pointing at it, keys in ``root/keys`` and a ``tiny`` profile on
    the given ports in ``root/profiles``. The process env minus every ``WARMCTL_*`` setting but
    ``WARMCTL_CRIU``, plus ``WARMCTL_CONFIG`` and ``WARMCTL_TEST_HOME`` (the data dir)."""
    home, profiles = root / "home", root / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "tiny.toml").write_text(tiny_profile(engine_port, gate_port))
    cfg = root / "config.toml"
    cfg.write_text(f'home = "{home}"\nprofile_dirs = ["{profiles}"]\nkeys_dir = "{root / "keys"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMCTL_") or k == "WARMCTL_CRIU"}
    env.update({"WARMCTL_CONFIG": str(cfg), "WARMCTL_TEST_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    return env


#: Marks a session-scoped fixture's directory (:func:`session_tmp`): :func:`_module_tmp_freed`
#: leaves it in place. A file, not a module-level set: this module is imported twice (pytest's
#: ``conftest`` and the tests' ``tests.conftest``).
SESSION_MARK = ".warmctl-test-session"


def session_tmp(tmp_path_factory, name: str) -> Path:
    """``tmp_path_factory.mktemp(name)`` for a session-scoped fixture: kept until the session ends."""
    d = tmp_path_factory.mktemp(name)
    (d / SESSION_MARK).touch()
    return d


@pytest.fixture(scope="module", autouse=True)
def _module_tmp_freed(tmp_path_factory):
    """Once a test module is done, remove what its tests and fixtures put under pytest's base
    temporary directory (``tmp_path``, ``tmp_path_factory.mktemp``), except the session
    fixtures' directories. pytest itself keeps every one of them until the session ends: a
    full run reached about 38 GiB by its 85th percent (test_e2e_fleet's homes alone 14 GiB);
    removed per module, the peak was 15 GiB (inside test_e2e_fleet). ``WARMCTL_TEST_KEEP_TMP=1`` keeps
    everything (to look at a failure's files)."""
    base = tmp_path_factory.getbasetemp()
    before = set(os.listdir(base))
    yield
    if os.environ.get("WARMCTL_TEST_KEEP_TMP") == "1":
        return
    for name in set(os.listdir(base)) - before:
        if not (base / name / SESSION_MARK).exists():
            shutil.rmtree(base / name, ignore_errors=True)


@pytest.fixture(scope="session")
def wc_env(tmp_path_factory, engine_ports) -> dict[str, str]:
    """:func:`isolated_env` in a fresh temporary directory, on the test ports."""
    return isolated_env(session_tmp(tmp_path_factory, "warmctl"), *engine_ports)


#: Credentials in the environment of the session's ``warmctl snapshot tiny``, as a publisher
#: with S3 credentials and a Hugging Face token has them: none may reach the engine,
#: a stored byte or the restored engine (test_e2e_main.py checks).
SNAPSHOT_PROBES = {"AWS_ACCESS_KEY_ID": "AKIAPROBE5C2E9A71F0D3", "AWS_SECRET_ACCESS_KEY": "probe-secret-8b1f6e2d94c07a35",
                   "HF_TOKEN": "hf_probe3e7a1c9d50b2f468"}


def _snapshot_tiny(env: dict[str, str]) -> dict:
    """``warmctl snapshot tiny`` in ``env`` with :data:`SNAPSHOT_PROBES` added; :func:`snapshot_once`'s
    dict plus ``shm_before`` (:func:`shm_names` before it)."""
    before = shm_names()
    return {**snapshot_once({**env, **SNAPSHOT_PROBES}, "tiny"), "shm_before": before}


#: The session's engine snapshots: fixture name -> build(wc_env, engine_ports), in the order
#: :func:`_session_snapshots_ahead` builds them.
SESSION_SNAPSHOTS = {
    "tiny_snapshot": lambda env, ports: _snapshot_tiny(env),
    "tp2_snapshot": lambda env, ports: snapshot_once(tp2_env(env, *ports), "tiny-tp2"),
    "moe_snapshot": lambda env, ports: snapshot_once(rank_env(env, "tiny-moe-tp2", *ports), "tiny-moe-tp2"),
}
_AHEAD = pytest.StashKey[dict[str, Future]]()
_AFTER_BUILDS = pytest.StashKey[set[Path]]()


#: ``WARMCTL_TEST_STREAM``: which files this session runs, when scripts/test.sh runs the suite
#: as two pytest sessions side by side. ``engines``: the files with a test of one of these
#: markers (the real engines, the whole pipeline, checks of the whole host, the opt-in kubelet
#: and clean-root tests), on the host's ``/dev/shm`` and loopback, except ``e2e`` tests also
#: marked ``fast_stream`` (:func:`in_engine_stream`); ``fast``: every other file, in mount and
#: network namespaces of its own (a private ``/dev/shm`` and loopback) and its own temp
#: directory. Unset: every file.
ENGINE_STREAM_MARKERS = ("e2e", "host_wide", "kubelet", "clean_root")
STREAMS = ("engines", "fast")
#: ``WARMCTL_TEST_SHARD=K/N`` (1 <= K <= N): of the files this session would run, keep only shard
#: K of N (:func:`shard_of`). scripts/test.sh's fast tier runs the fast stream as two shards side
#: by side, each in namespaces of its own: alone, that stream ran its files one after another
#: at about 0.6 of a core, 12.3 minutes on the 2-core AMD VM of 2026-12-06/07.
SHARD_RE = re.compile(r"([1-9][0-9]*)/([1-9][0-9]*)")


def shard_of(path: str, shards: int) -> int:
    """The shard, 1 to ``shards``, of the test file ``path`` (relative to the repository, e.g.
    ``tests/test_x.py``): from its name's MD5, so a file stays in its shard as others come and go,
    and the split does not depend on which tests ``-m`` or ``-k`` select."""
    return int(hashlib.md5(path.encode()).hexdigest(), 16) % shards + 1


def _shard() -> tuple[int, int] | None:
    """``WARMCTL_TEST_SHARD`` as ``(K, N)``, or None when unset; a usage error when malformed."""
    raw = os.environ.get("WARMCTL_TEST_SHARD", "")
    if not raw:
        return None
    m = SHARD_RE.fullmatch(raw)
    if not m or int(m[1]) > int(m[2]):
        raise pytest.UsageError(f"WARMCTL_TEST_SHARD={raw!r}: K/N with 1 <= K <= N, e.g. 1/2, or unset")
    return int(m[1]), int(m[2])


def in_engine_stream(item) -> bool:
    """Whether ``item`` puts its file in the engine stream: a marker of :data:`ENGINE_STREAM_MARKERS`,
    where ``e2e`` does not count beside ``fast_stream`` (an end-to-end test of the fake engine
    that checks only what is its own: the fault matrix, which on its own would make the engine
    stream the longer by minutes)."""
    marks = {m for m in ENGINE_STREAM_MARKERS if item.get_closest_marker(m)}
    if item.get_closest_marker("fast_stream"):
        marks.discard("e2e")
    return bool(marks)


def pytest_configure(config) -> None:
    """An unknown ``WARMCTL_TEST_STREAM`` or a malformed ``WARMCTL_TEST_SHARD`` is a usage error
    before anything is collected."""
    stream = os.environ.get("WARMCTL_TEST_STREAM", "")
    if stream and stream not in STREAMS:
        raise pytest.UsageError(f"WARMCTL_TEST_STREAM={stream!r}: one of {', '.join(STREAMS)}, or unset")
    _shard()


def pytest_collection_modifyitems(config, items) -> None:
    """Run the files without end-to-end tests first (each file's tests stay together and in
    order): the session's engine snapshots are built meanwhile (:func:`_session_snapshots_ahead`).
    Files with a test marked ``e2e`` or ``host_wide`` (it checks what is left on the whole host:
    an ahead build's engine, dumped and being stored, leaves ``/dev/shm`` files nobody uses for
    tens of seconds) come after the builds. With ``WARMCTL_TEST_STREAM`` (:data:`STREAMS`), only
    that stream's files are kept, the others deselected (a file is in ``engines`` when any of
    its tests is :func:`in_engine_stream`, whatever ``-m`` selects after); with
    ``WARMCTL_TEST_SHARD=K/N``, only the files of shard K (:func:`shard_of`)."""
    stream = os.environ.get("WARMCTL_TEST_STREAM", "")
    keep = [True] * len(items)
    if stream:
        engines = {item.path for item in items if in_engine_stream(item)}
        keep = [(i.path in engines) == (stream == "engines") for i in items]
    if shard := _shard():
        keep = [k and shard_of(i.nodeid.split("::", 1)[0], shard[1]) == shard[0] for k, i in zip(keep, items)]
    if not all(keep):
        config.hook.pytest_deselected(items=[i for i, k in zip(items, keep) if not k])
        items[:] = [i for i, k in zip(items, keep) if k]
    after = config.stash[_AFTER_BUILDS] = {item.path for item in items
                                           if item.get_closest_marker("e2e") or item.get_closest_marker("host_wide")}
    items[:] = [i for i in items if i.path not in after] + [i for i in items if i.path in after]


@pytest.fixture(scope="session", autouse=True)
def _session_snapshots_ahead(request):
    """From the session's first test on, build the engine snapshots (:data:`SESSION_SNAPSHOTS`) that
    the selected tests need, one after another in a background thread; their fixtures wait for
    them (:func:`_session_snapshot`). On 2 cores the fast tests that run meanwhile leave about a
    core idle: the builds (about 5 minutes) cost the whole suite little wall time."""
    wanted = [name for name in SESSION_SNAPSHOTS if any(name in item.fixturenames for item in request.session.items)]
    if not wanted or os.environ.get("WARMCTL_TEST_AHEAD", "1") == "0":
        yield
        return
    env, ports = request.getfixturevalue("wc_env"), request.getfixturevalue("engine_ports")
    pool = ThreadPoolExecutor(1, thread_name_prefix="snapshots-ahead")
    request.config.stash[_AHEAD] = {name: pool.submit(SESSION_SNAPSHOTS[name], env, ports) for name in wanted}
    yield
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module", autouse=True)
def _ahead_builds_done_before_e2e(request) -> None:
    """A file with end-to-end or ``host_wide`` tests starts (its module fixtures included) only once
    every build ahead has ended: no engine of theirs runs beside it (its checks of what is left on
    the host, its ports and its timings stay its own)."""
    if request.node.path in request.config.stash.get(_AFTER_BUILDS, set()):
        for ahead in request.config.stash.get(_AHEAD, {}).values():
            ahead.exception()  # waits; a failed build is raised by its own fixture


def _session_snapshot(request, name: str) -> dict:
    """The session snapshot ``name`` (:data:`SESSION_SNAPSHOTS`): the one built ahead, waited
    for (its failure raised here), or built now."""
    ahead = request.config.stash.get(_AHEAD, {}).get(name)
    if ahead is not None:
        return ahead.result()
    return SESSION_SNAPSHOTS[name](request.getfixturevalue("wc_env"), request.getfixturevalue("engine_ports"))


@pytest.fixture(scope="session")
def tiny_snapshot(request) -> dict:
    """``warmctl snapshot tiny`` run once per session in the session's home (:func:`wc_env`),
    with :data:`SNAPSHOT_PROBES` in its environment. Returns {"digest", "stdout", "stderr",
    "seconds", "shm_left"}: ``shm_left`` = /dev/shm files that appeared since the snapshot began,
    that no process uses and that are still there (:func:`shm_leaked`), looked at when the first
    test asks (the fast tests that may run beside an ahead build clean up their own)."""
    snap = _session_snapshot(request, "tiny_snapshot")
    return {**snap, "shm_left": {n for n in shm_leaked(snap["shm_before"]) if not n.startswith("tmp:")}}


#: tests/fake_vllm.py: run in place of ``vllm`` by :func:`fake_env`'s warmctl.
FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm.py"
#: Offset of the ``fake`` profile's internal and public ports from the session's
#: (``WARMCTL_TEST_ENGINE_PORT``, ``WARMCTL_TEST_GATE_PORT``): never the ``tiny`` engine's.
FAKE_PORT_OFFSET = 6


def fake_profile(engine_port: int, gate_port: int, name: str = "fake", hold: Path | None = None,
                 extra: str = "", tp: int = 1) -> str:
    """A profile named ``name`` whose engine is :data:`FAKE_VLLM` (under :func:`fake_env`), on
    the given internal and public ports: a small warm-up grid and the ``tiny`` profile's canary
    (tokens and logprobs compared bit for bit), with ``extra`` TOML appended. ``hold``: a path
    whose existence holds the engine's canary answers (``FAKE_VLLM_HOLD``, see tests/fake_vllm.py).
    ``tp``: ``--tensor-parallel-size`` (above 1: worker ranks ``Worker_TP0``.., tests/fake_vllm.py)."""
    env = f'\n[engine.env]\nFAKE_VLLM_HOLD = "{hold}"\n' if hold else ""
    tp_args = f', "--tensor-parallel-size", "{tp}"' if tp > 1 else ""
    return f"""name = "{name}"
description = "tests/fake_vllm.py: a two-process stand-in for vLLM (orchestration tests)"

[engine]
model = "fake-model"
served_model_name = "{name}"
port = {engine_port}
startup_timeout_s = 60
args = ["--seed", "0"{tp_args}]
{env}
[gate]
host = "127.0.0.1"
port = {gate_port}

[warmup]
prompt_tokens = [16, 128]
output_tokens = [1, 4]
concurrency = [1, 2]

[canary]
prompts = ["The capital of France is", "Explain what a snapshot is in one sentence."]
max_tokens = 16
logprobs = 5
match = "tokens+logprobs"

[hardware]
gpu_count = 0
""" + extra


def fake_env(root: Path, engine_port: int, gate_port: int, hold: Path | None = None) -> dict[str, str]:
    """:func:`isolated_env` in ``root`` plus the ``fake`` profile (:func:`fake_profile`, on
    ``engine_port``/``gate_port`` + :data:`FAKE_PORT_OFFSET`) and
    ``WARMCTL_TEST_ENGINE_CMD`` (:data:`warmctl.engine.vllm.TEST_ENGINE_ENV`): every engine
    warmctl starts in it is :data:`FAKE_VLLM`. The file ``hold`` (default ``root/hold``; nodes
    that share snapshots need the same profile, so the same path), while it exists, holds the
    engine's canary answers (:func:`fake_profile`). For tests of warmctl's own orchestration
    (kill points, teardown, locks, recovery, agent jobs, restart policy) through the real
    snapshot / up / down pipeline and the real CRIU, in about a second per cold start or restore."""
    import shlex

    from warmctl.engine.vllm import TEST_ENGINE_ENV

    env = isolated_env(root, engine_port, gate_port)
    profiles = Path(env["WARMCTL_CONFIG"]).parent / "profiles"
    (profiles / "fake.toml").write_text(fake_profile(engine_port + FAKE_PORT_OFFSET, gate_port + FAKE_PORT_OFFSET,
                                                     hold=hold or root / "hold"))
    env[TEST_ENGINE_ENV] = shlex.join([sys.executable, str(FAKE_VLLM)])
    return env


@pytest.fixture(scope="session")
def fake_ports(engine_ports) -> tuple[int, int]:
    """(internal, public) port of the ``fake`` profile in :func:`fake_env`."""
    return engine_ports[0] + FAKE_PORT_OFFSET, engine_ports[1] + FAKE_PORT_OFFSET


@pytest.fixture(scope="session")
def fk_env(tmp_path_factory, engine_ports) -> dict[str, str]:
    """:func:`fake_env` in a fresh session directory: the fake engine's home for the session."""
    return fake_env(session_tmp(tmp_path_factory, "warmctl-fake"), *engine_ports)


@pytest.fixture(scope="session")
def fake_snapshot(fk_env) -> dict:
    """``warmctl snapshot fake`` once per session in :func:`fk_env` (:func:`snapshot_once`)."""
    return snapshot_once(fk_env, "fake")


def rank_env(env: dict[str, str], name: str, engine_port: int, gate_port: int) -> dict[str, str]:
    """``env`` (an :func:`isolated_env`) with the multi-rank profile ``name``
    (:func:`rank_profile`) written beside ``tiny``'s; returns a copy of ``env``."""
    profiles = Path(env["WARMCTL_CONFIG"]).parent / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / f"{name}.toml").write_text(rank_profile(name, engine_port, gate_port))
    return dict(env)


def tp2_env(env: dict[str, str], engine_port: int, gate_port: int) -> dict[str, str]:
    """:func:`rank_env` with ``tiny-tp2``."""
    return rank_env(env, "tiny-tp2", engine_port, gate_port)


def snapshot_once(env: dict[str, str], name: str) -> dict:
    """``warmctl snapshot NAME`` in ``env``; {"digest", "stdout", "stderr", "seconds"} (wall
    time of the command). Fails with its output when no digest is printed."""
    import time

    t0 = time.monotonic()
    r = warmctl("snapshot", name, env=env, timeout=1500)
    m = re.search(rf"{re.escape(name)}:latest\s+(sha256:[0-9a-f]{{64}})", r.stdout.replace("\n", " "))
    assert m, f"no digest in snapshot output:\n{r.stdout}\n{r.stderr}"
    return {"digest": m.group(1), "stdout": r.stdout, "stderr": r.stderr, "seconds": time.monotonic() - t0}


@pytest.fixture(scope="session")
def tp2_snapshot(request) -> dict:
    """``warmctl snapshot tiny-tp2`` (tensor parallel 2: two worker ranks) run once per session,
    in the session's home (:func:`snapshot_once`, :func:`_session_snapshot`)."""
    return _session_snapshot(request, "tp2_snapshot")


@pytest.fixture(scope="session")
def moe_snapshot(request) -> dict:
    """``warmctl snapshot tiny-moe-tp2`` (the tiny mixture of experts at tensor parallel 2, no
    expert parallel: the CPU build refuses it) run once per session, in the session's home
    (:func:`snapshot_once`, :func:`_session_snapshot`)."""
    return _session_snapshot(request, "moe_snapshot")


def rank_procs(roles: list[str]) -> dict[str, list[int]]:
    """``{role: [pid, ...]}`` of live processes titled as one of ``roles`` (``VLLM::<role>``,
    :data:`warmctl.checkpoint.layout.RANK_TITLE`; any engine's on this host: the e2e tests run
    one engine at a time)."""
    import psutil

    from warmctl.checkpoint.layout import RANK_TITLE

    out: dict[str, list[int]] = {}
    for p in psutil.process_iter(["cmdline"]):
        m = RANK_TITLE.match((p.info["cmdline"] or [""])[0])
        if m and m.group(1) in roles:
            out.setdefault(m.group(1), []).append(p.pid)
    return out


def up_restore(env: dict[str, str], name: str, *args: str, check: bool = True):
    """``warmctl up NAME --json --cold-start never ARGS``: (the process, its JSON or None when
    it failed)."""
    import json

    r = warmctl("up", name, "--json", "--cold-start", "never", *args, env=env, check=check)
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def ls_row(env: dict[str, str], name: str) -> dict:
    """The one row of ``warmctl ls --json`` in ``env`` for snapshot ``name``."""
    import json

    [row] = [x for x in json.loads(warmctl("ls", "--json", env=env).stdout) if x["name"] == name]
    return row


def node_b_env(root: Path, a_env: dict[str, str], remote: Path, engine_port: int, gate_port: int) -> dict[str, str]:
    """A second node in ``root``: an :func:`isolated_env` with its own home and its own signing
    key (``root/signing/node.key``), trusting the public key of node A's home (``a_env``) only,
    reading the directory remote ``remote`` (``WARMCTL_REMOTE_STORE``)."""
    b = isolated_env(root, engine_port, gate_port)
    (root / "keys").mkdir(exist_ok=True)
    warmctl("keygen", str(root / "signing"), "--name", "node", env=b)
    a_pub = next(Path(a_env["WARMCTL_CONFIG"]).parent.joinpath("keys").glob("local-*.pub"))
    shutil.copy(a_pub, root / "keys" / "a.pub")
    cfg = Path(b["WARMCTL_CONFIG"])
    cfg.write_text(cfg.read_text() + f'signing_key = "{root / "signing" / "node.key"}"\n')
    return dict(b, WARMCTL_REMOTE_STORE=str(remote))


# --- shared services: started once per session, each test on a fresh bucket of its own ----------


@pytest.fixture(scope="session")
def moto_endpoint():
    """A moto S3 server on 127.0.0.1 (a port of :func:`tests.ports.free_port`), one for the
    whole session; yields its endpoint URL. Tests take a fresh bucket on it (:func:`s3_url`),
    never a shared one."""
    from moto.server import ThreadedMotoServer
    from ports import free_port

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_url(moto_endpoint, monkeypatch):
    """A fresh bucket on the moto server; yields ``s3://bucket/snaps`` with the endpoint in env:
    ``$WARMCTL_S3_ENDPOINT`` for the CLI's processes (their ``s3_endpoint`` setting), and
    ``$AWS_ENDPOINT_URL`` for stores opened in this process without settings (S3's own variable,
    read where no ``s3_endpoint`` is passed down)."""
    import uuid

    import boto3

    monkeypatch.setenv("WARMCTL_S3_ENDPOINT", moto_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    bucket = f"warmctl-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/snaps"


@pytest.fixture(scope="session")
def ceph_rgw(tmp_path_factory):
    """A Ceph RGW on 127.0.0.1 (tests/rgw_server.py: mon, memstore OSD, radosgw; about 3 s to
    start and 3 s to stop), one for the whole session; yields (endpoint, access key, secret key)
    of a user. Skipped, or failed under ``CI`` / ``WARMCTL_REQUIRE_RGW=1``, when the ceph
    binaries are missing. Tests take a bucket of their own (:func:`rgw_bucket`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ports import free_port
    from rgw_server import missing_binaries, start_rgw

    missing = missing_binaries()
    need_service(missing and f"ceph binaries missing ({', '.join(missing)}): run scripts/install-test-services.sh",
                 "WARMCTL_REQUIRE_RGW")
    with start_rgw(session_tmp(tmp_path_factory, "ceph"), free_port(), free_port()) as creds:
        yield creds


@pytest.fixture
def rgw_bucket(ceph_rgw):
    """(endpoint, access key, secret key, bucket): a fresh bucket on the session's RGW, emptied
    and removed after the test (the OSD keeps objects in memory for the whole session)."""
    import uuid

    import boto3

    ep, ak, sk = ceph_rgw
    client = boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id=ak, aws_secret_access_key=sk)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield ep, ak, sk, bucket
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=o["Key"])
    client.delete_bucket(Bucket=bucket)


@pytest.fixture
def small_fs(tmp_path):
    """A real 6 MiB tmpfs at ``tmp_path/small`` (a disk that fills up), unmounted after the test;
    the test is skipped, with mount's reason, where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "--lazy", str(mnt)], check=True)


@pytest.fixture(scope="session")
def kube_api():
    """A real Kubernetes API server on 127.0.0.1 (tests/kubecluster.py: etcd + kube-apiserver
    v1.20.2, TLS, Node+RBAC authorization, static tokens for ``admin`` and the warmctl service
    accounts' users; about 4 s to start), one for the whole session. Yields the
    :class:`kubecluster.KubeCluster`: ``server``, ``ca_file``, ``token(user)``,
    ``kubeconfig(path, user)``, ``kubectl(*args, user=...)``, ``request(method, path, ...)``,
    ``service_account_dir(path, user)`` (user names: ``kubecluster.ADMIN``, ``NODE``, ``ENGINE``,
    ``SNAPSHOT``, ``DEFAULT_SA``).
    No controllers, no kubelet: objects are validated, admitted and stored, nothing runs them
    (:func:`kube_controllers` adds the controller-manager). Tests use namespaces and object names
    of their own. Skipped, or failed under ``CI`` / ``WARMCTL_REQUIRE_KUBERNETES=1``, when the
    binaries are missing (scripts/install-kubernetes.sh builds them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kubecluster import KubeCluster, missing

    need_service(missing(), "WARMCTL_REQUIRE_KUBERNETES")
    with KubeCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kube_controllers(kube_api):
    """:func:`kube_api` with kube-controller-manager running (service accounts and their token
    secrets, so pods are admitted; deployments, daemonsets, jobs, garbage collection): yields the
    same cluster object. Started once, on first use; stopped with the cluster."""
    from kubecluster import missing

    need_service(missing(controllers=True), "WARMCTL_REQUIRE_KUBERNETES")
    kube_api.start_controllers()
    return kube_api


@pytest.fixture(scope="session")
def kube_images():
    """The pod tests' image registry (tests/kubenode.py :class:`ImageStore`: Debian's
    ``docker-registry`` on loopback, its storage in the image cache), one for the session."""
    from kubenode import ImageStore, missing

    need_service(missing(), "WARMCTL_REQUIRE_KUBERNETES")
    with ImageStore() as images:
        yield images


#: the OCI layout and tag deploy/image/build.sh wrote each pushed engine image from (by reference)
ENGINE_IMAGE_LAYOUT: dict[str, tuple[Path, str]] = {}


@pytest.fixture(scope="session")
def engine_image(kube_images) -> tuple[str, str]:
    """The project's image (deploy/image/build.sh: the base cached per install recipe, the
    checkout's source on top), pushed to the session's registry once for every kubelet test
    file: (reference, manifest digest)."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "deploy" / "image" / "build.sh")], capture_output=True, text=True,
                       timeout=3600)
    assert r.returncode == 0, f"deploy/image/build.sh exited {r.returncode}:\n{r.stderr[-4000:]}"
    layout, tag = r.stdout.split()[-2:]
    ref = kube_images.push(Path(layout), tag, "warmctl/engine")
    digest = kube_images.digest(ref)
    print(f"\nengine image {ref}@{digest}: built/cached and pushed in {time.monotonic() - t0:.1f} s")
    ENGINE_IMAGE_LAYOUT[ref] = (Path(layout), tag)
    return ref, digest


@pytest.fixture(scope="session")
def kube_node(kube_controllers, kube_images, tmp_path_factory):
    """A real node of :func:`kube_api`'s cluster (tests/kubenode.py :class:`KubeNode`:
    containerd + runc + a kubelet v1.20.2, named and addressed ``127.0.0.1``, ``hostNetwork``
    pods only), Ready, one for the session; at the end its pods are deleted, every container
    killed, everything it mounted unmounted and its directories removed. Skipped, or failed under
    ``CI`` / ``WARMCTL_REQUIRE_KUBERNETES=1``, when a binary is missing
    (``WARMCTL_KUBE_WITH_KUBELET=1 scripts/install-kubernetes.sh`` installs them)."""
    from kubenode import KubeNode

    with KubeNode(kube_controllers, session_tmp(tmp_path_factory, "kube-node"), kube_images) as node:
        yield node


@pytest.fixture(scope="session")
def kube_node2(kube_node, kube_images, tmp_path_factory):
    """A second real node of the same cluster (tests/kubenode.py :class:`KubeNode` named and
    addressed ``127.0.0.2``): its own containerd, kubelet, ports, cgroup root and node
    credentials, and a mount namespace in which the host paths a kubelet writes whatever its
    flags say are its own; it pulls its images from the same registry. Started after, and
    stopped before, :func:`kube_node`; Ready, one for the session."""
    from kubenode import NODE2_NAME, KubeNode

    with KubeNode(kube_node.cluster, session_tmp(tmp_path_factory, "kube-node2"), kube_images,
                  name=NODE2_NAME) as node:
        yield node
