#!/usr/bin/env bash
# README's manual build starts with a bare `meson setup build --prefix=...`: it configures with no
# other option on this machine (whatever libtorch and CUDA toolkit it has or lacks), and by default
# libzest is a CPU library: the summary says that CUDA is not built, also where nvcc is installed.
# usage: setup_defaults_test.sh SOURCE_DIR
set -euo pipefail
source=$1
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"

if ! meson setup "$stage/build" "$source" --prefix="$stage/prefix" >"$stage/setup.log" 2>&1; then
  tail -30 "$stage/setup.log"
  echo "FAIL: a bare meson setup (README's manual build) does not configure"
  exit 1
fi
summary=$(grep -E '^ +CUDA \+ NCCL' "$stage/setup.log") ||
  { tail -30 "$stage/setup.log"; echo "FAIL: the summary does not say whether CUDA is built"; exit 1; }
echo "$summary"
grep -q ': no ' <<<"$summary" ||
  { echo "FAIL: CUDA is built by default (libzest would link libcudart and libnccl)"; exit 1; }
grep -q 'ZEST_HAVE_CUDA 0' "$stage/build/zest_build_config.h" ||
  { echo "FAIL: the default build has ZEST_HAVE_CUDA set"; exit 1; }
echo "ok: a bare meson setup configures, and builds no CUDA by default$(command -v nvcc >/dev/null && echo ' (nvcc is installed here)')"
