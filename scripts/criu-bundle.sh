#!/usr/bin/env bash
# Make a self-contained, relocatable CRIU directory for a machine without network (the GPU
# check machine): the criu binary, every shared library it loads (glibc and the dynamic loader
# included) and a wrapper that runs it through the bundled loader, so it does not depend on the
# target's libraries or glibc version.
#
#   usage: scripts/criu-bundle.sh [CRIU_BINARY] [OUT_DIR]
#          (defaults: $WARMCTL_CRIU, criu on PATH or /usr/local/sbin/criu; ./criu-bundle)
#   then:  copy OUT_DIR to the target (e.g. as shared/criu-bundle next to the checkout) and
#          run OUT_DIR/criu check  (or: export WARMCTL_CRIU=$PWD/OUT_DIR/criu)
#
# Layout: OUT_DIR/criu (wrapper), OUT_DIR/bin/criu (the real binary), OUT_DIR/lib/*.so*,
# OUT_DIR/MANIFEST (source path, version, sha256 of every file).
# Caveat: run through the loader, /proc/self/exe of CRIU is the loader; CRIU's dump/restore
# do not re-exec themselves (only `criu swrk`, which warmctl does not use). `criu check` on the
# target is the test; gpu-check.sh runs it first.
set -euo pipefail
SRC=${1:-${WARMCTL_CRIU:-$(command -v criu || echo /usr/local/sbin/criu)}}
OUT=${2:-criu-bundle}
[ -x "$SRC" ] || { echo "no CRIU binary at $SRC" >&2; exit 1; }
rm -rf "$OUT"; mkdir -p "$OUT/bin" "$OUT/lib"
cp -L "$SRC" "$OUT/bin/criu"
LOADER=""
while read -r line; do
  # lines: "libx.so.1 => /path/libx.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
  path=$(echo "$line" | sed -n 's/.*=> \(\/[^ ]*\).*/\1/p')
  [ -z "$path" ] && path=$(echo "$line" | sed -n 's/^\s*\(\/[^ ]*\) (0x.*/\1/p')
  [ -z "$path" ] && continue
  cp -L "$path" "$OUT/lib/"
  case "$(basename "$path")" in ld-linux*|ld-musl*) LOADER=$(basename "$path");; esac
done < <(ldd "$SRC")
[ -n "$LOADER" ] || { echo "could not find the dynamic loader of $SRC" >&2; exit 1; }
cat > "$OUT/criu" <<WRAP
#!/bin/sh
# CRIU from a relocatable bundle (scripts/criu-bundle.sh): bundled loader and libraries.
D=\$(cd "\$(dirname "\$0")" && pwd)
exec "\$D/lib/$LOADER" --library-path "\$D/lib" "\$D/bin/criu" "\$@"
WRAP
chmod +x "$OUT/criu"
# The AMX permission library (warmctl/checkpoint/xtile_perm.c, built by scripts/install.sh):
# restores on a CPU with AMX need it preloaded into CRIU; gpu-check.sh points
# WARMCTL_XTILE_PERM_LIB at the bundle's copy.
XTILE=${WARMCTL_XTILE_PERM_LIB:-/usr/local/lib/warmctl/criu-xtile-perm.so}
if [ -f "$XTILE" ]; then cp -L "$XTILE" "$OUT/lib/criu-xtile-perm.so"
else echo "note: no $XTILE (scripts/install.sh builds it): the bundle cannot restore on a CPU with AMX" >&2; fi
{
  echo "source: $SRC"
  echo "version: $("$OUT/criu" --version | tr '\n' ' ')"
  echo "built-on: $(uname -srm), $(ldd --version | head -1)"
  (cd "$OUT" && find . -type f ! -name MANIFEST -print0 | sort -z | xargs -0 sha256sum)
} > "$OUT/MANIFEST"
echo "bundle: $OUT ($(du -sh "$OUT" | cut -f1)); $("$OUT/criu" --version | head -1)"
