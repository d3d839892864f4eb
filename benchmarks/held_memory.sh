#!/bin/bash
# Run a command with this guest's freed memory held for a while instead of handed back to the
# hypervisor at once, then put the setting back (docs/benchmarks.md, "Where a restore's seconds go
# on this VM").
#
#   bash benchmarks/held_memory.sh [--warm GIB] [--hold-ms MS] -- COMMAND [ARGS...]
#
# This project's test machines are Firecracker guests with free page reporting (virtio-balloon,
# /sys/module/page_reporting): memory the guest frees goes back to the host after `min_free_ms`
# (0 here: at once), and the next touch of such a page costs a hypervisor fault, 64k-120k pages/s
# measured here against 380k-500k for a page the guest kept (benchmarks/held_memory.sh's own
# --warm touch prints its rate). A restore faults in about 0.65 million pages of `tiny`, so
# whether its memory was handed back moved one raw `criu restore` from 1.6 to 9.6 s. Bare-metal
# GPU nodes have no such reporting. Holding freed memory for MS milliseconds (default 60000, the
# largest this kernel takes) makes every side of a side-by-side run pay the same, bare-metal-like
# cost; --warm GIB first touches GIB of fresh memory once (default 0), so that memory is the
# guest's again before the command starts (slow: up to 10 s per GiB at busy hours).
#
# The guest's parameter is put back to what it was when the command ends, fails or is
# interrupted. Without /sys/module/page_reporting/parameters/min_free_ms (another kernel, bare
# metal) the command runs unchanged. Needs root.
set -euo pipefail
WARM=0
HOLD=60000
while [ $# -gt 0 ]; do
    case $1 in
        --warm) WARM=$2; shift 2 ;;
        --hold-ms) HOLD=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "held_memory.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "held_memory.sh: no command given (held_memory.sh [--warm GIB] -- COMMAND ...)" >&2; exit 2; }
KNOB=/sys/module/page_reporting/parameters/min_free_ms
if [ ! -w "$KNOB" ]; then
    echo "held_memory.sh: no $KNOB here: running the command as it is" >&2
    exec "$@"
fi
WAS=$(cat "$KNOB")
trap 'echo "$WAS" > "$KNOB"' EXIT
echo "$HOLD" > "$KNOB" || { echo "held_memory.sh: this kernel refused min_free_ms=$HOLD" >&2; exit 2; }
echo "held_memory.sh: freed guest memory held ${HOLD} ms (was ${WAS}); put back at the end" >&2
if [ "$WARM" != 0 ]; then
    python3 - "$WARM" <<'PY'
import mmap, sys, time
n = int(float(sys.argv[1]) * 2**30)
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
t = time.perf_counter()
for off in range(0, n, 4096):
    m[off] = 1
dt = time.perf_counter() - t
print(f"held_memory.sh: touched {n / 2**30:.1f} GiB of fresh memory in {dt:.1f} s ({n / 4096 / dt / 1e3:.0f}k pages/s)",
      file=sys.stderr, flush=True)
PY
fi
"$@"
