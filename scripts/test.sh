#!/usr/bin/env bash
# Run warmctl's whole test suite on a fresh Debian/Ubuntu host, as root: installs what it needs
# (scripts/install.sh, then the test services), then runs pytest -- the end-to-end tests with the
# real vLLM engine and real CRIU and the Ceph RGW tests included (WARMCTL_REQUIRE_RGW=1: they fail
# rather than skip if the ceph binaries are missing). Extra arguments go to pytest (e.g. -m "not e2e").
#
# --clean-root (first argument): also run scripts/demo.sh in a clean Debian 12 root
# (tests/test_clean_root.py, WARMCTL_TEST_CLEAN_ROOT=1): the check before an install change is
# called done. Many minutes; needs the clean-root tool (../shared/tools/clean-root.sh or
# WARMCTL_CLEAN_ROOT_TOOL) and free ports 8000/18000. Only that test:
#   bash scripts/test.sh --clean-root tests/test_clean_root.py
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "${1:-}" = "--clean-root" ]; then shift; export WARMCTL_TEST_CLEAN_ROOT=1; fi
bash "$REPO/scripts/install.sh"
bash "$REPO/scripts/install-test-services.sh"
export WARMCTL_REQUIRE_RGW=${WARMCTL_REQUIRE_RGW:-1}
export WARMCTL_REQUIRE_REGISTRY=${WARMCTL_REQUIRE_REGISTRY:-1}
cd "$REPO"
VENV=${WARMCTL_VENV:-$REPO/.venv}
# Fail fast, before any test: the import contract (the layers of docs/design.md), lint (ruff)
# and types (mypy), all configured in pyproject.toml.
"$VENV/bin/lint-imports" --no-cache
"$VENV/bin/ruff" check warmctl tests benchmarks scripts
"$VENV/bin/python" -m mypy
# The suite's temporary files (pytest's, under TMPDIR) peak near 15 GiB (the fleet tests' node
# homes); with less free, tests fail on a full disk far from the cause: say so first.
free_kib=$(df -Pk "${TMPDIR:-/tmp}" 2>/dev/null | awk 'NR==2 {print $4}' || true)
if [ -n "$free_kib" ] && [ "$free_kib" -lt $((16 * 1024 * 1024)) ]; then
  echo "[test] warning: $((free_kib / 1024 / 1024)) GiB free under ${TMPDIR:-/tmp}; the whole suite's temporary files need about 16 GiB" >&2
fi
exec "$VENV/bin/python" -m pytest -v --durations=15 "$@"
