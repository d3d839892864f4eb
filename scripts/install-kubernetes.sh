#!/usr/bin/env bash
# Build and cache a real Kubernetes control plane for the test cluster (tests/kubecluster.py):
# kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2, from Debian 12's source
# package `kubernetes` with Debian's Go 1.19. Debian ships no Kubernetes server binary and nothing
# newer can be built offline (docs/kubernetes.md, "The test cluster").
#
# Idempotent, as root: when $WARMCTL_KUBE_CACHE/<source version>/bin already holds the binaries it
# says so and does nothing (no apt, no network). Otherwise it
#   1. apt-installs the build and run dependencies (etcd-server, golang-1.19-go, rsync, jq,
#      build-essential, dpkg-dev, golang-github-modern-go-reflect2-dev, kubernetes-client);
#   2. adds deb-src entries for bookworm in their own file (the deb entries are not touched) and
#      runs `apt-get source kubernetes=<version>` (which applies Debian's patches);
#   3. swaps the vendored modern-go/reflect2 1.0.1 for Debian's 1.0.2 (older ones break on Go >= 1.18);
#   4. builds with CGO_ENABLED=0 `make WHAT=...` and /usr/lib/go-1.19/bin first on PATH, with the
#      Go build cache kept under the cache dir (a rebuild reuses it);
#   5. installs the binaries into $WARMCTL_KUBE_CACHE/<source version>/bin and removes the build tree.
# Measured on 2 shared cores: 5-6 minutes cold (make: 288-352 s), 100 s with the Go cache of an
# earlier build (make: 82 s); 2.7 GB of build tree while it runs; 243 MB kept, plus 1.5 GB of Go
# cache (removable: rm -rf $WARMCTL_KUBE_CACHE/gocache).
#
# Environment:
#   WARMCTL_KUBE_CACHE           cache root (default /var/cache/warmctl/kubernetes)
#   WARMCTL_KUBE_SOURCE_VERSION  Debian source version (default below; the cache is keyed by it)
#   WARMCTL_KUBE_WITH_KUBELET=1  also build the kubelet (about 2 more minutes with the Go cache;
#                                not needed by the API tests, which run no pods) and apt-install
#                                what the pod tests run it with: containerd, runc,
#                                containernetworking-plugins (the loopback CNI plugin),
#                                docker-registry (the loopback image registry), skopeo, umoci,
#                                busybox-static (the sandbox image) and debootstrap and tini (the
#                                engine image, deploy/image/build.sh)
set -euo pipefail
say() { printf '\033[1m[install-kubernetes]\033[0m %s\n' "$*"; }
die() { echo "[install-kubernetes] error: $*" >&2; exit 1; }

VERSION=${WARMCTL_KUBE_SOURCE_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}
CACHE=${WARMCTL_KUBE_CACHE:-/var/cache/warmctl/kubernetes}
BIN="$CACHE/$VERSION/bin"
WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler"
NODE_PKGS=""
if [ "${WARMCTL_KUBE_WITH_KUBELET:-0}" = 1 ]; then
    WHAT="$WHAT cmd/kubelet"
    NODE_PKGS="containerd runc containernetworking-plugins docker-registry skopeo umoci busybox-static debootstrap tini"
fi
NEED=""
for w in $WHAT; do NEED="$NEED ${w#cmd/}"; done

have_all() {
    local b
    for b in $NEED; do [ -x "$BIN/$b" ] || return 1; done
    return 0
}
# the runtime dependency of the test cluster, cheap to check on every run
need_etcd() {
    command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]
}
# the node packages (only with WARMCTL_KUBE_WITH_KUBELET=1): all installed?
need_node_pkgs() {
    local p
    for p in $NODE_PKGS; do
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || return 1
    done
    return 0
}

if have_all && need_etcd && need_node_pkgs; then
    say "binaries present in $BIN ($(cd "$BIN" && echo $NEED)); skipped"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "run as root (apt-get install, $CACHE)"
START=$(date +%s)
export DEBIAN_FRONTEND=noninteractive

# 1. packages. kubernetes-client is Debian's kubectl 1.20 (/usr/bin/kubectl is managed by
# alternatives-free dpkg; a kubectl already on the machine from another source is left alone:
# only install the package when no kubectl exists).
PKGS="etcd-server golang-1.19-go rsync jq build-essential dpkg-dev golang-github-modern-go-reflect2-dev $NODE_PKGS"
command -v kubectl >/dev/null 2>&1 || PKGS="$PKGS kubernetes-client"
say "apt: installing $PKGS"
# 2. deb-src, in a file of its own
SRCLIST=/etc/apt/sources.list.d/warmctl-debian-src.sources
if [ ! -f "$SRCLIST" ]; then
    say "apt: adding deb-src entries for bookworm ($SRCLIST)"
    cat > "$SRCLIST" <<'EOF'
# added by warmctl's scripts/install-kubernetes.sh: Debian's kubernetes source package
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $PKGS >/dev/null
need_etcd || die "etcd still missing after installing etcd-server"
need_node_pkgs || die "some of $NODE_PKGS still missing after apt-get install"
[ -x /usr/lib/go-1.19/bin/go ] || die "/usr/lib/go-1.19/bin/go missing after installing golang-1.19-go"
REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
[ -d "$REFLECT2" ] || die "$REFLECT2 missing after installing golang-github-modern-go-reflect2-dev"

if have_all; then
    say "binaries present in $BIN; only the packages were missing: done in $(( $(date +%s) - START )) s"
    exit 0
fi

# 3. the source, patched by apt-get source (dpkg-source -x applies debian/patches/series)
mkdir -p "$CACHE"
BUILD="$CACHE/build-$VERSION"
rm -rf "$BUILD"
mkdir -p "$BUILD"
trap 'rm -rf "$BUILD"' EXIT
say "source: apt-get source kubernetes=$VERSION into $BUILD"
# apt downloads as root here and warns that it is "unsandboxed" (its _apt user may not write the
# directory): left so on purpose, as on machines whose network only root reaches the sandboxed
# download fails
(cd "$BUILD" && apt-get source -qq "kubernetes=$VERSION" >/dev/null) \
    || die "apt-get source kubernetes=$VERSION failed (is the network or the Debian mirror reachable? deb-src entries: $SRCLIST)"
SRC=$(find "$BUILD" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -1)
[ -n "$SRC" ] && [ -f "$SRC/hack/lib/golang.sh" ] || die "no unpacked kubernetes tree under $BUILD"
say "source: $(du -sh "$SRC" | cut -f1) in $SRC; patches: $(grep -cv '^#' "$SRC/debian/patches/series" 2>/dev/null || echo 0) applied"
rm -rf "$SRC/vendor/github.com/modern-go/reflect2"
cp -r "$REFLECT2" "$SRC/vendor/github.com/modern-go/reflect2"
say "source: vendored modern-go/reflect2 replaced by Debian's $(dpkg-query -W -f='${Version}' golang-github-modern-go-reflect2-dev)"

# 4. build
say "build: make WHAT=\"$WHAT\" with $(/usr/lib/go-1.19/bin/go version | cut -d' ' -f3) (about 5 min on 2 cores cold, under 2 with the Go cache)"
# hack/lib/golang.sh forces GOCACHE=_output/local/go/cache: point that at the kept cache
mkdir -p "$CACHE/gocache" "$SRC/_output/local/go"
ln -sfn "$CACHE/gocache" "$SRC/_output/local/go/cache"
BSTART=$(date +%s)
(
    cd "$SRC"
    export PATH=/usr/lib/go-1.19/bin:$PATH
    export GOTOOLCHAIN=local GOFLAGS= GOPROXY=off
    export KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean
    CGO_ENABLED=0 make WHAT="$WHAT"
) > "$CACHE/build-$VERSION.log" 2>&1 || {
    tail -30 "$CACHE/build-$VERSION.log" >&2
    die "build failed after $(( $(date +%s) - BSTART )) s; whole log: $CACHE/build-$VERSION.log"
}
say "build: done in $(( $(date +%s) - BSTART )) s (log: $CACHE/build-$VERSION.log)"

# 5. install and clean up
OUTDIR="$SRC/_output/local/go/bin"
[ -d "$OUTDIR" ] || OUTDIR=$(find "$SRC/_output" -type d -path '*/bin' | head -1)
mkdir -p "$BIN.tmp"
for b in $NEED; do
    [ -x "$OUTDIR/$b" ] || die "build produced no $b under $OUTDIR"
    cp "$OUTDIR/$b" "$BIN.tmp/$b"
done
rm -rf "$BIN"
mv "$BIN.tmp" "$BIN"
"$BIN/kube-apiserver" --version
say "installed $(cd "$BIN" && echo $NEED) into $BIN ($(du -sh "$BIN" | cut -f1)); removing the build tree"
rm -rf "$BUILD"
trap - EXIT
say "done in $(( $(date +%s) - START )) s"
