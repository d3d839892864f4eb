#!/usr/bin/env bash
# Run warmctl's whole test suite on a fresh Debian/Ubuntu host, as root: installs what it needs
# (scripts/install.sh, then the test services), then runs pytest -- the end-to-end tests with the
# real vLLM engine and real CRIU included. Extra arguments go to pytest (e.g. -m "not e2e").
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$REPO/scripts/install.sh"
if [ -f "$REPO/scripts/install-test-services.sh" ]; then bash "$REPO/scripts/install-test-services.sh"; fi
cd "$REPO"
exec "${WARMCTL_VENV:-$REPO/.venv}/bin/python" -m pytest -v --durations=15 "$@"
