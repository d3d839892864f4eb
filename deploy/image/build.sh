#!/usr/bin/env bash
# Build warmctl's engine image without Docker: a Debian 12 root made by debootstrap from this
# machine's apt sources, with warmctl installed inside it by the project's own installer
# (scripts/install.sh: CRIU, the CPU build of vLLM, the venv) and tini as PID 1 (it reaps the
# orphans a CRIU restore leaves, docs/kubernetes.md), packed by umoci into an OCI image layout.
#
#   usage: deploy/image/build.sh [--print-layout]
#
# Two layers:
#   base  the root with everything scripts/install.sh installs (about 5 GB, several minutes: the
#         vLLM install dominates). Cached under $WARMCTL_IMAGE_CACHE/<key>/oci, where <key> is a
#         hash of its recipe here, scripts/install.sh, requirements/ and pyproject.toml's
#         [build-system] and [project] tables: built once per
#         change of those, reused otherwise (as scripts/install-kubernetes.sh caches Kubernetes).
#   src   the checkout's warmctl/ and profiles/ on top (the base's editable install imports them
#         from /opt/warmctl), tagged src-<hash of those files>: seconds, redone when they change.
# Prints, last line: "<layout dir> <tag>" (skopeo's source `oci:<layout dir>:<tag>`).
#
# Needs root, debootstrap, umoci, unshare. Environment:
#   WARMCTL_IMAGE_CACHE   cache root (default /var/cache/warmctl/image)
set -euo pipefail
say() { printf '\033[1m[image]\033[0m %s\n' "$*" >&2; }
die() { echo "[image] error: $*" >&2; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${WARMCTL_IMAGE_CACHE:-/var/cache/warmctl/image}
[ "$(id -u)" = 0 ] || die "run as root (debootstrap, the installer inside the root)"
for t in debootstrap umoci unshare; do command -v "$t" >/dev/null || die "$t not found (WARMCTL_KUBE_WITH_KUBELET=1 scripts/install-kubernetes.sh installs it)"; done

# the base's inputs: its recipe (the build_base function below), the installer, the engine's
# requirements and what pip reads from pyproject.toml ([build-system] and [project]: not the lint
# and test settings, which change often and install nothing)
pyproject_install() {
    python3 -c 'import json, sys, tomllib; d = tomllib.load(open(sys.argv[1], "rb"))
print(json.dumps({k: d.get(k) for k in ("build-system", "project")}, sort_keys=True))' "$REPO/pyproject.toml"
}
KEY=$(cd "$REPO" && { sed -n '/^build_base() {/,/^}/p' deploy/image/build.sh; cat scripts/install.sh requirements/*; pyproject_install; } \
    | sha256sum | cut -c1-16)
DIR="$CACHE/$KEY"
OCI="$DIR/oci"
START=$(date +%s)

build_base() {
    local root="$DIR/rootfs" mirror
    rm -rf "$OCI"
    # a root that debootstrap finished is reused (the installer is idempotent: a build stopped
    # half-way resumes where it was)
    if [ ! -f "$root/.debootstrap-done" ]; then
        rm -rf "$root"
        mkdir -p "$root"
        mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
        [ -n "$mirror" ] || mirror=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
        [ -n "$mirror" ] || die "no Debian mirror found in /etc/apt"
        say "base: debootstrap bookworm from $mirror into $root"
        debootstrap --variant=minbase bookworm "$root" "$mirror" >"$DIR/debootstrap.log" 2>&1 \
            || { tail -20 "$DIR/debootstrap.log" >&2; die "debootstrap failed (log: $DIR/debootstrap.log)"; }
        touch "$root/.debootstrap-done"
    fi
    # this machine's package sources and pip configuration, only while installing
    rm -f "$root/etc/apt/sources.list"; mkdir -p "$root/etc/apt/sources.list.d"
    cp /etc/apt/sources.list.d/*.sources "$root/etc/apt/sources.list.d/" 2>/dev/null || true
    [ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$root/etc/apt/" || true
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    local f pipfiles=() pipenv=()
    # this machine's pip settings from the environment too (e.g. PIP_FIND_LINKS: wheels on disk)
    while IFS= read -r f; do pipenv+=("$f"); done < <(env | grep -E '^PIP_' | grep -v '^PIP_CERT=' || true)
    for f in /etc/pip.conf /etc/xdg/pip; do
        [ -e "$f" ] && { mkdir -p "$root$(dirname "$f")"; cp -a "$f" "$root$f"; pipfiles+=("$f"); }
    done
    local hostca=/usr/local/share/warmctl-image/host-ca.crt
    mkdir -p "$root$(dirname "$hostca")"; cp /etc/ssl/certs/ca-certificates.crt "$root$hostca"
    mkdir -p "$root/opt/warmctl"
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - --no-recursion) \
        | tar -xf - -C "$root/opt/warmctl"
    say "base: scripts/install.sh inside the root (WARMCTL_VENV=/opt/warmctl-venv; minutes)"
    # a private mount namespace whose root is the new tree, as on a fresh machine (CRIU's check
    # reads the mount table)
    ROOT=$root PIPENV="${pipenv[*]:-}" unshare --mount --fork /bin/bash -euc '
      mount --make-rprivate /
      mount --bind "$ROOT" "$ROOT"
      b() { mkdir -p "$ROOT$2"; mount --rbind "$1" "$ROOT$2"; }
      b /dev /dev; b /sys /sys
      for d in /opt/wheels /opt/pypi /opt/pypi-more; do [ -d "$d" ] && b "$d" "$d"; done
      cd "$ROOT"; mkdir -p .old-root; pivot_root . .old-root; cd /
      mount -t proc proc /proc
      umount -l /.old-root; rmdir /.old-root
      mount -t tmpfs -o mode=1777 tmpfs /tmp
      exec /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        $PIPENV PIP_CERT='"$hostca"' SSL_CERT_FILE='"$hostca"' WARMCTL_VENV=/opt/warmctl-venv DEBIAN_FRONTEND=noninteractive \
        /bin/bash -euc "bash /opt/warmctl/scripts/install.sh && apt-get install -y -qq --no-install-recommends tini >/dev/null \
          && apt-get clean && rm -rf /var/lib/apt/lists/* /root/.cache"
    ' >"$DIR/install.log" 2>&1 || { tail -30 "$DIR/install.log" >&2; die "scripts/install.sh in the root failed (log: $DIR/install.log)"; }
    for f in "${pipfiles[@]}"; do rm -rf "${root:?}$f"; done
    rm -rf "$root$(dirname "$hostca")" "$root/opt/warmctl/.git" "$root/.debootstrap-done"
    : > "$root/etc/resolv.conf"
    say "base: $(du -sh "$root" | cut -f1) root; packing with umoci (gzip of every file: a few minutes)"
    umoci init --layout "$OCI.tmp"
    umoci new --image "$OCI.tmp:base"
    umoci insert --image "$OCI.tmp:base" --history.created_by "deploy/image/build.sh: debootstrap + scripts/install.sh" "$root" /
    umoci config --image "$OCI.tmp:base" --no-history \
        --config.entrypoint /usr/bin/tini --config.entrypoint -- \
        --config.env PATH=/opt/warmctl-venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --config.env LANG=C.UTF-8 --config.workingdir /opt/warmctl --author "warmctl deploy/image/build.sh"
    mv "$OCI.tmp" "$OCI"
    rm -rf "$root"
    say "base: $OCI ($(du -sh "$OCI" | cut -f1)) in $(( $(date +%s) - START )) s"
}

mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9
if [ -f "$OCI/index.json" ] && umoci stat --image "$OCI:base" >/dev/null 2>&1; then
    say "base: cached in $OCI (key $KEY)"
else
    rm -rf "$OCI.tmp"
    build_base
fi

# the source layer: warmctl/ and profiles/ of the checkout as they are now (committed or not)
SRCHASH=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard -- warmctl profiles \
    | xargs -0 tar -cf - --no-recursion --sort=name --mtime=@0 --owner=0 --group=0 | sha256sum | cut -c1-12)
TAG="src-$SRCHASH"
if umoci stat --image "$OCI:$TAG" >/dev/null 2>&1; then
    say "src: $TAG cached"
else
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard -- warmctl profiles \
        | xargs -0 tar -cf - --no-recursion) | tar -xf - -C "$stage"
    umoci insert --image "$OCI:base" --tag "$TAG.tmp" --opaque "$stage/warmctl" /opt/warmctl/warmctl
    umoci insert --image "$OCI:$TAG.tmp" --opaque "$stage/profiles" /opt/warmctl/profiles
    umoci tag --image "$OCI:$TAG.tmp" "$TAG"
    umoci rm --image "$OCI:$TAG.tmp"
    umoci gc --layout "$OCI"
    say "src: $TAG added in $(( $(date +%s) - START )) s"
fi
echo "$OCI $TAG"
