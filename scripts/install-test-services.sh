#!/bin/sh
# Install the services the store's integration tests start on loopback (idempotent; says what it
# did or skipped). Ceph RGW (S3-compatible) from Debian: tests/test_store_rgw.py starts a one-node
# cluster with tests/rgw_server.py (mon + memstore OSD + radosgw/beast on 127.0.0.1, cephx with
# generated keys, everything under a temp dir) whenever these binaries exist. scripts/test.sh runs
# this script and then requires the RGW tests to run (WARMCTL_REQUIRE_RGW=1).
set -e
say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
# debian_tool COMMAND PACKAGE WHY VERSION-COMMAND: installs Debian's PACKAGE when COMMAND is missing
debian_tool() {
    if command -v "$1" >/dev/null 2>&1; then
        say "test services: $1 present ($($4 2>&1 | head -1)); skipped"
        return
    fi
    say "test services: installing Debian's $2 ($3)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$2" >/dev/null
    command -v "$1" >/dev/null 2>&1 || { echo "[install] error: $1 still missing after installing the package" >&2; exit 1; }
    say "test services: installed $($4 2>&1 | head -1)"
}
bins="radosgw ceph-mon ceph-osd radosgw-admin ceph ceph-authtool monmaptool"
missing=""
for b in $bins; do
    command -v "$b" >/dev/null 2>&1 || missing="$missing $b"
done
if [ -n "$missing" ]; then
    say "test services: installing Debian's Ceph (radosgw ceph-mon ceph-osd ceph-common); missing:$missing"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends radosgw ceph-mon ceph-osd ceph-common ceph-base >/dev/null
    for b in $bins; do
        command -v "$b" >/dev/null 2>&1 || { echo "[install] error: $b still missing after installing the Ceph packages" >&2; exit 1; }
    done
    say "test services: installed $(radosgw --version | cut -d' ' -f1-3)"
else
    say "test services: Ceph binaries present ($(radosgw --version | cut -d' ' -f1-3)); skipped"
fi
# Distribution 2.8 (Debian's docker-registry, the OCI registry): tests/test_store_oci.py starts one
# on loopback with tests/registry_server.py (htpasswd auth, TLS from a CA made by the test, a
# second instance as a pull-through mirror) whenever the binary exists; scripts/test.sh requires
# those tests to run (WARMCTL_REQUIRE_REGISTRY=1). The package's own systemd service is not used.
if ! command -v docker-registry >/dev/null 2>&1; then
    say "test services: installing Debian's docker-registry (Distribution 2.8)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends docker-registry >/dev/null
    # the tests start their own instances; the package's service (:5000) is not wanted
    if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true; fi
    command -v docker-registry >/dev/null 2>&1 || { echo "[install] error: docker-registry still missing after installing the package" >&2; exit 1; }
    say "test services: installed $(docker-registry --version 2>&1 | head -1)"
else
    say "test services: docker-registry present ($(docker-registry --version 2>&1 | head -1)); skipped"
fi
# tini (Debian's): scripts/test.sh runs pytest under `tini -s`, a child subreaper that reaps every
# orphaned process at once, as systemd does on a fleet node. Without it, processes the tests
# orphan (a killed engine's children, CRIU's restored trees) are reaped by this host's PID 1,
# which on some machines (a Firecracker VM's init) reaps only every second or two: measured,
# tests/test_engine_run.py took 15.6 s instead of 0.6 s, each teardown waiting on its zombies.
debian_tool tini tini "the suite's reaper of orphaned processes" "tini --version"
# valgrind (Debian's): tests/test_startup_imports.py counts the instructions of `up`'s start-up
# under its callgrind (benchmarks/up_imports.py --instructions), the same on any host and load.
debian_tool valgrind valgrind "instruction counts of up's start-up" "valgrind --version"
