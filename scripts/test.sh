#!/usr/bin/env bash
# Run warmctl's whole test suite on a fresh Debian/Ubuntu host, as root: installs what it needs
# (scripts/install.sh, then the test services), then runs pytest -- the end-to-end tests with the
# real vLLM engine and real CRIU and the Ceph RGW tests included (WARMCTL_REQUIRE_RGW=1: they fail
# rather than skip if the ceph binaries are missing). Extra arguments go to pytest (e.g. -m "not e2e").
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$REPO/scripts/install.sh"
bash "$REPO/scripts/install-test-services.sh"
export WARMCTL_REQUIRE_RGW=${WARMCTL_REQUIRE_RGW:-1}
cd "$REPO"
exec "${WARMCTL_VENV:-$REPO/.venv}/bin/python" -m pytest -v --durations=15 "$@"
