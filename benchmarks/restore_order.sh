#!/bin/bash
# Is a node store filled by `warmctl pull` slower to restore from than one `up` filled while
# streaming from the remote? And does the order matter? (docs/benchmarks.md, "Engine pods: a
# pulled store is not slower; the restore that comes second is".)
#
#   bash benchmarks/restore_order.sh [WORKDIR] [ROUNDS]
#
# Makes the `tiny` snapshot once on a publisher home and pushes it to a directory remote (a cold
# start: a minute or two), then for each round, on fresh homes: store A filled by `warmctl pull`,
# store B empty with the remote configured, and `warmctl up tiny --json --cold-start never` on
# A then B, then (fresh again) on B then A, `warmctl down` after each. Prints each `up`'s
# materialize / restore / total seconds (its `timings_s`) and the load average. Ports:
# WARMCTL_TEST_ENGINE_PORT / WARMCTL_TEST_GATE_PORT (default 18000 / 8000). WORKDIR (default a
# new /tmp/warmctl-order-*) is removed at the end unless it was given.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-}  # the Python with warmctl installed: $PYTHON, else the checkout's .venv, else python3
[ -z "$PY" ] && { [ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python || PY=python3; }
W=${1:-}
OWN=0
[ -z "$W" ] && { W=$(mktemp -d /tmp/warmctl-order-XXXXXX); OWN=1; }
ROUNDS=${2:-1}
EPORT=${WARMCTL_TEST_ENGINE_PORT:-18000}
GPORT=${WARMCTL_TEST_GATE_PORT:-8000}
cd "$REPO"

w() { local n=$1; shift; env WARMCTL_CONFIG="$W/$n/config.toml" WARMCTL_REMOTE_STORE="$W/remote" \
        WARMCTL_SIGNING_KEY="$W/signing/warmctl.key" "$PY" -m warmctl "$@"; }
home() {  # a fresh home NAME: the tiny profile on the ports, the publisher's key trusted
    rm -rf "${W:?}/$1"; mkdir -p "$W/$1/profiles" "$W/$1/keys"
    sed -e "s/^port = 18000/port = $EPORT/" -e "s/^port = 8000/port = $GPORT/" profiles/tiny.toml > "$W/$1/profiles/tiny.toml"
    cp "$W/signing/warmctl.pub" "$W/$1/keys/"
    printf 'home = "%s"\nprofile_dirs = ["%s"]\nkeys_dir = "%s"\n' "$W/$1/home" "$W/$1/profiles" "$W/$1/keys" > "$W/$1/config.toml"
}
up() {  # up NAME LABEL: time one restore, then take it down
    w "$1" up tiny --json --cold-start never > "$W/up.json"
    "$PY" -c "import json,sys; t=json.load(open(sys.argv[1]))['timings_s']; print(f\"  {sys.argv[2]:<28} materialize {t['materialize']:5.2f}  restore {t['restore']:5.2f}  total {t['total']:5.2f} s   load {open('/proc/loadavg').read().split()[0]}\")" "$W/up.json" "$2"
    w "$1" down tiny > /dev/null 2>&1
}
pair() {  # pair FIRST SECOND: fresh A (pulled) and B (empty), then up FIRST, up SECOND
    home A; home B
    w A pull tiny > /dev/null
    sync
    up "$1" "$1 ($([ "$1" = A ] && echo pulled || echo streamed)), first"
    up "$2" "$2 ($([ "$2" = A ] && echo pulled || echo streamed)), second"
}

trap 'w A down tiny >/dev/null 2>&1 || true; w B down tiny >/dev/null 2>&1 || true; w pub down tiny >/dev/null 2>&1 || true; [ $OWN = 1 ] && rm -rf "$W"' EXIT
rm -rf "$W/signing" "$W/remote"; mkdir -p "$W/remote"
"$PY" -m warmctl keygen "$W/signing" > /dev/null
home pub
echo "snapshot tiny, pushed to $W/remote (a cold start)..."
w pub snapshot tiny --push > /dev/null 2> "$W/snapshot.log"
w pub down tiny > /dev/null 2>&1 || true
for r in $(seq "$ROUNDS"); do
    echo "round $r:"
    pair A B
    pair B A
done
