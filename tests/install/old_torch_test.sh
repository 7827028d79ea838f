#!/usr/bin/env bash
# `meson setup` refuses a libtorch older than 2.0 (zest-torch supports torch 2.x), saying which
# version it found and what to do, instead of failing later in the compiler. The old libtorch is
# a stand-in: a root laid out as a torch wheel's (include/, include/torch/csrc/api/include/, lib/)
# whose torch/version.h says 1.13, as Debian 12's libtorch-dev's does.
# usage: old_torch_test.sh SOURCE_DIR
set -euo pipefail
source=$1
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
api=$stage/torch/include/torch/csrc/api/include
mkdir -p "$api/torch" "$stage/torch/lib"
printf '#define TORCH_VERSION_MAJOR 1\n#define TORCH_VERSION_MINOR 13\n#define TORCH_VERSION_PATCH 1\n' \
  >"$api/torch/version.h"

if meson setup "$stage/build" "$source" -Dtests=false -Dtorch_dir="$stage/torch" >"$stage/setup.log" 2>&1; then
  cat "$stage/setup.log"
  echo "FAIL: meson setup accepted a libtorch 1.13 (-Dtorch_dir=$stage/torch)"
  exit 1
fi
grep -q "is torch 1.13: zest-torch needs torch 2.0 or newer" "$stage/setup.log" || {
  tail -30 "$stage/setup.log"
  echo "FAIL: meson setup failed, but not by refusing the libtorch 1.13 with its message"
  exit 1
}
grep "ERROR:" "$stage/setup.log"
echo "ok: meson setup refuses a libtorch 1.13, saying so"
