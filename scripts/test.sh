#!/usr/bin/env bash
# Run warmctl's whole test suite on a fresh Debian/Ubuntu host, as root: installs what it needs
# (scripts/install.sh, then the test services), then runs pytest -- the end-to-end tests with the
# real vLLM engine and real CRIU and the Ceph RGW tests included (WARMCTL_REQUIRE_RGW=1: they fail
# rather than skip if the ceph binaries are missing). Extra arguments go to pytest.
#
# Two tiers (README.md, "Tests"):
#   bash scripts/test.sh --fast   the developer's loop: every test but the end-to-end ones
#                                 (-m "not e2e": no vLLM engine starts; real CRIU, servers and
#                                 the fake engine still run); under 10 minutes on 2 cores
#   bash scripts/test.sh          the whole suite, e2e included (what CI runs); under 30 minutes
# Either tier runs as pytest sessions side by side, the engine stream and the fast stream (below;
# in the fast tier, the fast stream as two shards); with pytest arguments, or
# WARMCTL_TEST_STREAMS=1, as one session.
#
# --clean-root: also run scripts/demo.sh in a clean Debian 12 root
# (tests/test_clean_root.py, WARMCTL_TEST_CLEAN_ROOT=1): the check before an install change is
# called done. Many minutes; needs the clean-root tool (../shared/tools/clean-root.sh or
# WARMCTL_CLEAN_ROOT_TOOL) and free ports 8000/18000. Only that test:
#   bash scripts/test.sh --clean-root tests/test_clean_root.py
#
# --kubernetes: also run the pod tests on a real kubelet (tests/test_kube_pods*.py and
# tests/test_kube_workloads.py, marker `kubelet`, WARMCTL_TEST_KUBERNETES=1): builds the
# kubelet and installs containerd, runc and the image tools (WARMCTL_KUBE_WITH_KUBELET=1
# scripts/install-kubernetes.sh), then the engine image (deploy/image/build.sh: cached; the
# first build takes many minutes). Only those tests:
#   bash scripts/test.sh --kubernetes tests/test_kube_pods.py
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TIER=()
while [ $# -gt 0 ]; do
  case "$1" in
    --clean-root) export WARMCTL_TEST_CLEAN_ROOT=1; shift ;;
    --kubernetes) export WARMCTL_TEST_KUBERNETES=1 WARMCTL_KUBE_WITH_KUBELET=1; shift ;;
    --fast) TIER=(-m "not e2e"); shift ;;
    *) break ;;
  esac
done
# How many shards the fast stream runs as (below): two in the fast tier, one in the whole suite.
SHARDS=${WARMCTL_TEST_FAST_SHARDS:-$([ ${#TIER[@]} -gt 0 ] && echo 2 || echo 1)}
if ! [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]]; then
  echo "[test] WARMCTL_TEST_FAST_SHARDS=$SHARDS: a whole number, 1 or more" >&2
  exit 2
fi
bash "$REPO/scripts/install.sh"
bash "$REPO/scripts/install-test-services.sh"
# A real Kubernetes control plane for tests/kubecluster.py (built once from Debian's source, then
# cached under /var/cache/warmctl/kubernetes: 15-20 minutes the first time, nothing after).
bash "$REPO/scripts/install-kubernetes.sh"
if [ "${WARMCTL_TEST_KUBERNETES:-0}" = 1 ]; then
  bash "$REPO/deploy/image/build.sh" >/dev/null
fi
export WARMCTL_REQUIRE_RGW=${WARMCTL_REQUIRE_RGW:-1}
export WARMCTL_REQUIRE_REGISTRY=${WARMCTL_REQUIRE_REGISTRY:-1}
export WARMCTL_REQUIRE_KUBERNETES=${WARMCTL_REQUIRE_KUBERNETES:-1}
cd "$REPO"
VENV=${WARMCTL_VENV:-$REPO/.venv}
# Fail fast, before any test: the import contract (the layers of docs/design.md), lint (ruff)
# and types (mypy), all configured in pyproject.toml.
"$VENV/bin/lint-imports" --no-cache
"$VENV/bin/ruff" check warmctl tests benchmarks scripts
"$VENV/bin/python" -m mypy
# The tests' own modules as bytecode too (scripts/install.sh compiles warmctl's): where
# PYTHONDONTWRITEBYTECODE=1 the helper processes would compile what they import each time.
"$VENV/bin/python" -m compileall -q -j 0 tests >/dev/null
# The suite's temporary files (pytest's, under TMPDIR) peak near 15 GiB (the fleet tests' node
# homes); with less free, tests fail on a full disk far from the cause: say so first.
free_kib=$(df -Pk "${TMPDIR:-/tmp}" 2>/dev/null | awk 'NR==2 {print $4}' || true)
if [ -n "$free_kib" ] && [ "$free_kib" -lt $((16 * 1024 * 1024)) ]; then
  echo "[test] warning: $((free_kib / 1024 / 1024)) GiB free under ${TMPDIR:-/tmp}; the whole suite's temporary files need about 16 GiB" >&2
fi
# pytest runs under `tini -s` (scripts/install-test-services.sh says why): the processes the tests
# orphan are reaped at once, as under systemd, not when this host's PID 1 gets to them.
PYTEST=(tini -s -- "$VENV/bin/python" -m pytest -v --durations=15 ${TIER[@]+"${TIER[@]}"})
if [ $# -gt 0 ] || [ "${WARMCTL_TEST_STREAMS:-2}" = 1 ]; then
  exec "${PYTEST[@]}" "$@"
fi
if ! unshare --mount --net --propagation private -- ip link set lo up 2>/dev/null; then
  echo "[test] warning: no mount and network namespace here (unshare --mount --net failed): one session, not two streams" >&2
  exec "${PYTEST[@]}"
fi
# The whole tier as two pytest sessions side by side (tests/conftest.py, WARMCTL_TEST_STREAM):
# the engine stream (files with end-to-end, host-wide or opt-in kubelet/clean-root tests, but not
# the fault matrix, marked fast_stream; the session's engine snapshots are built at its start) in
# the foreground, and the fast stream (every other file) in the background, in mount and network
# namespaces of its own: a private /dev/shm (the engine stream's checks of what is left there see
# only their own files) and a loopback of its own (a restored multi-rank engine binds again the
# dozens of ephemeral ports its ranks' gloo groups listened on: a server of the fast stream that
# took one in between stopped the restore, "port 127.0.0.1:44509 is already in use (by pid 23878,
# ceph-mon)"), and its own temp directory. The fast files mostly wait on their processes and
# bounds (alone they kept 0.6 of the two cores busy): beside the engine stream they cost little
# wall time. Its log is printed once both have ended; the exit status fails if either failed.
# WARMCTL_TEST_STREAMS=1: one session, the fast files first (as with explicit pytest arguments).
# The fast tier runs the fast stream as two shards side by side (WARMCTL_TEST_SHARD=K/N, each file
# in one by its name: tests/conftest.py, shard_of), each in namespaces and a temp directory of its
# own: with no engine to wait for, the one fast stream was the whole tier, 12.3 minutes on the
# 2-core AMD VM of 2026-12-06/07. WARMCTL_TEST_FAST_SHARDS=N sets how many (SHARDS, above).
mkdir -p "$REPO/build"
FAST_PIDS=() FAST_LOGS=() FAST_TMPS=()
for k in $(seq 1 "$SHARDS"); do
  if [ "$SHARDS" = 1 ]; then suffix=; else suffix=-$k; fi
  FAST_TMP=$(mktemp -d "${TMPDIR:-/tmp}/wf.XXXXXX")  # short: Unix socket paths under it must stay within 107 bytes
  FAST_LOG=$REPO/build/test-fast-stream$suffix.log
  (
    export WARMCTL_TEST_STREAM=fast TMPDIR=$FAST_TMP
    if [ "$SHARDS" != 1 ]; then export WARMCTL_TEST_SHARD=$k/$SHARDS; fi
    if [ -n "${WARMCTL_TEST_TIMES:-}" ]; then export WARMCTL_TEST_TIMES=$WARMCTL_TEST_TIMES.fast$suffix; fi
    exec unshare --mount --net --propagation private -- sh -c \
      'ip link set lo up && mount -t tmpfs -o mode=1777 warmctl-test-shm /dev/shm && exec "$@"' sh \
      "${PYTEST[@]}" -o cache_dir="$FAST_TMP/.pytest_cache"
  ) > "$FAST_LOG" 2>&1 &
  FAST_PIDS+=($!) FAST_LOGS+=("$FAST_LOG") FAST_TMPS+=("$FAST_TMP")
done
trap 'kill "${FAST_PIDS[@]}" 2>/dev/null || true' INT TERM
echo "[test] the engine stream below and $SHARDS fast stream(s) beside it; their logs (${FAST_LOGS[*]}) follow it"
engines_rc=0
WARMCTL_TEST_STREAM=engines "${PYTEST[@]}" || engines_rc=$?
fast_rc=0
for i in "${!FAST_PIDS[@]}"; do
  rc=0
  wait "${FAST_PIDS[$i]}" || rc=$?
  echo
  echo "[test] ======== fast stream $((i + 1)) of $SHARDS (exit $rc): ${FAST_LOGS[$i]} ========"
  cat "${FAST_LOGS[$i]}"
  rm -rf "${FAST_TMPS[$i]}"
  if [ "$fast_rc" = 0 ]; then fast_rc=$rc; fi
done
trap - INT TERM
echo "[test] engine stream exit $engines_rc, fast stream exit $fast_rc"
if [ "$engines_rc" != 0 ]; then exit "$engines_rc"; fi
exit "$fast_rc"
