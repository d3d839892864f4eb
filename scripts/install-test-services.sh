#!/bin/sh
# Install the services the store's integration tests start on loopback (idempotent).
# Ceph RGW (S3-compatible) from Debian: tests/test_store_rgw.py starts a one-node cluster
# (mon + memstore OSD, auth none) and radosgw (beast on 127.0.0.1) when these binaries exist.
set -e
need=""
for b in radosgw ceph-mon ceph-osd radosgw-admin ceph; do
    command -v "$b" >/dev/null 2>&1 || need=1
done
if [ -n "$need" ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends radosgw ceph-mon ceph-osd ceph-common
fi
radosgw --version
