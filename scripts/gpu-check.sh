#!/usr/bin/env bash
# GPU check: snapshot and restore a small CUDA PyTorch server (a captured CUDA graph answering
# greedy requests) with warmctl's CRIU + CUDA checkpoint pieces and its weights worker extension
# (weights saved, zeroed before the checkpoint, loaded back in place after restore), and check
# bit-identical output.
#
# For a machine with one NVIDIA GPU (driver 570+; 580+ for GPU remapping) and no network.
# Needs: root; a Python with CUDA PyTorch and psutil (PYTHON, default python3); CRIU 4.2+, either on PATH
# or as the bundle made by scripts/criu-bundle.sh (CRIU_BUNDLE, default ./shared/criu-bundle or
# ./criu-bundle). Prints timings per phase and one JSON result line; finishes in < 5 min.
# --bench: then runs the throughput benchmark (scripts/gpu_bench.py: the pinned copy floor, then
# checkpoint and restore of processes holding 8, 32 and 64 GiB; GPU_BENCH_SIZES_GIB, limit
# GPU_BENCH_TIMEOUT_S=240) in WORKDIR/bench, whatever the check's outcome; --bench-only skips the
# check. Exit 0 when everything run passed.
#   usage: scripts/gpu-check.sh [--bench | --bench-only] [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RUN_CHECK=1 RUN_BENCH=0
case "${1:-}" in
  --bench) RUN_BENCH=1; shift ;;
  --bench-only) RUN_CHECK=0 RUN_BENCH=1; shift ;;
  -*) echo "usage: $0 [--bench | --bench-only] [WORKDIR]" >&2; exit 2 ;;
esac
WORK=${1:-$(mktemp -d /tmp/warmctl-gpu-check.XXXXXX)}
LIMIT=${GPU_CHECK_TIMEOUT_S:-290}
BENCH_LIMIT=${GPU_BENCH_TIMEOUT_S:-240}

say() { printf '[gpu-check] %s\n' "$*"; }
fail() { say "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || fail "CRIU needs root"
command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: no NVIDIA driver"
say "driver: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"

if [ -z "${WARMCTL_CRIU:-}" ]; then
  for b in "${CRIU_BUNDLE:-}" shared/criu-bundle criu-bundle; do
    if [ -n "$b" ] && [ -x "$b/criu" ]; then export WARMCTL_CRIU="$PWD/$b/criu"; break; fi
  done
fi
CRIU=${WARMCTL_CRIU:-$(command -v criu || true)}
# a bundle's AMX permission library (criu-bundle.sh), needed to restore on a CPU with AMX
if [ -z "${WARMCTL_XTILE_PERM_LIB:-}" ] && [ -f "$(dirname "$CRIU")/lib/criu-xtile-perm.so" ]; then
  export WARMCTL_XTILE_PERM_LIB="$(dirname "$CRIU")/lib/criu-xtile-perm.so"
fi
[ -n "$CRIU" ] || fail "no CRIU: build the bundle with scripts/criu-bundle.sh and copy it here"
say "criu: $CRIU ($("$CRIU" --version | head -1))"
"$CRIU" check >/dev/null 2>&1 || { "$CRIU" check || true; fail "criu check failed"; }

"$PYTHON" scripts/gpu_check.py --imports-only || fail "the check's imports fail under $PYTHON (needs torch, psutil)"
[ "$RUN_BENCH" = 0 ] || "$PYTHON" scripts/gpu_bench.py --imports-only || fail "the benchmark's imports fail under $PYTHON"

"$PYTHON" - <<'PY' || fail "$PYTHON has no CUDA PyTorch"
import torch, sys
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(f"[gpu-check] torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

say "work dir: $WORK"
mkdir -p "$WORK"
status=0
if [ "$RUN_CHECK" = 1 ]; then
set +e
# SIGTERM at LIMIT (gpu_check.py turns it into a clean-up: unlock, kill the namespace), SIGKILL
# 30 s later if the clean-up hangs; the check's own waits end 40 s before LIMIT.
timeout -k 30 "$LIMIT" "$PYTHON" scripts/gpu_check.py --work "$WORK" --limit "$LIMIT" | tee "$WORK/result.json"
rc=${PIPESTATUS[0]}
set -e
"$PYTHON" - "$WORK/result.json" <<'PY' || true
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception:
    sys.exit(0)
for k, v in r.get("seconds", {}).items():
    print(f"[gpu-check] {k:>28}: {v:8.3f} s")
print(f"[gpu-check] api={r.get('api')} ranks={r.get('ranks')} gpu_bytes={r.get('gpu_bytes')} image_bytes={r.get('image_bytes')}")
print(f"[gpu-check] weights: {r.get('weights_bytes')} bytes loaded in place at {r.get('weights_load_gb_per_s')} GB/s; zeroed weights changed the answer: {r.get('zeroed_answer_differs')}")
print(f"[gpu-check] cleanup: {r.get('cleanup')}")
print(f"[gpu-check] bit_identical={r.get('bit_identical')} gpu_state_survived={r.get('gpu_state_survived')} error={r.get('error')}")
PY
if [ "$rc" = 0 ]; then say "PASS"; status=0
elif [ "$rc" = 124 ]; then say "FAIL: did not finish within $LIMIT s"; status=1
else say "FAIL: see $WORK (server.log, img/dump.log, restore.log)"; status=1
fi
fi

if [ "$RUN_BENCH" = 1 ]; then
  say "benchmark: $WORK/bench (limit $BENCH_LIMIT s)"
  set +e
  # The same clean-up contract as the check: SIGTERM at the limit, SIGKILL 30 s later.
  timeout -k 30 "$BENCH_LIMIT" "$PYTHON" scripts/gpu_bench.py --work "$WORK/bench" --limit "$BENCH_LIMIT" \
    ${GPU_BENCH_SIZES_GIB:+--sizes "$GPU_BENCH_SIZES_GIB"}
  brc=$?
  set -e
  # gpu_bench.py prints its own last line, [gpu-bench] PASS or FAIL; only a SIGKILL leaves none.
  [ "$brc" = 137 ] && printf '[gpu-bench] FAIL: killed %s s after the limit of %s s\n' 30 "$BENCH_LIMIT"
  [ "$brc" = 0 ] || status=1
fi
exit "$status"
