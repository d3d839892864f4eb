#!/bin/sh
# Install the services the store's integration tests start on loopback (idempotent; says what it
# did or skipped). Ceph RGW (S3-compatible) from Debian: tests/test_store_rgw.py starts a one-node
# cluster with tests/rgw_server.py (mon + memstore OSD + radosgw/beast on 127.0.0.1, cephx with
# generated keys, everything under a temp dir) whenever these binaries exist. scripts/test.sh runs
# this script and then requires the RGW tests to run (WARMCTL_REQUIRE_RGW=1).
set -e
say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
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
