#!/usr/bin/env bash
# The main job on a fresh Debian/Ubuntu host, as root: install, snapshot the `tiny` profile
# (cold start, warm-up grid, canary, CRIU dump into the local store), `warmctl up tiny` from that
# snapshot (restore, canary bit for bit, then open port 8000), and ask the restored engine for a
# chat completion on port 8000. The engine keeps serving afterwards: `warmctl down tiny` stops it.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$REPO/scripts/install.sh"
W="${WARMCTL_VENV:-$REPO/.venv}/bin/warmctl"
"$W" down tiny >/dev/null
"$W" snapshot tiny
"$W" up tiny
echo
echo '$ curl -s localhost:8000/v1/chat/completions -d {"model": "tiny", "messages": [...]}'
curl -sS --fail localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
  "model": "tiny", "temperature": 0, "max_tokens": 24,
  "messages": [{"role": "user", "content": "What is the capital of France? One word."}]}' \
  | "${WARMCTL_VENV:-$REPO/.venv}/bin/python" -c 'import json,sys; r=json.load(sys.stdin); print("answer:", repr(r["choices"][0]["message"]["content"]), "| usage:", r["usage"])'
"$W" status
