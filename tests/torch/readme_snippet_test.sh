#!/usr/bin/env bash
# README's "Using zest from libtorch" program compiles as written against the installed
# zest-torch with nothing but `pkg-config --cflags --libs zest-torch`, and trains on 2 ranks at
# stage 3, leaving a checkpoint.
# usage: readme_snippet_test.sh BUILD_DIR SOURCE_DIR MPIRUN
set -euo pipefail
build=$1 source=$2 mpirun=$3
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

meson install -C "$build" --destdir "$stage/root" --no-rebuild --quiet >/dev/null
pc=$(find "$stage/root" -name zest-torch.pc -print -quit)
[ -n "$pc" ] || { echo "FAIL: zest-torch.pc was not installed"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc")
prefix=$stage/root$(pkg-config --variable=prefix zest-torch)
flags=$(pkg-config --define-variable=prefix="$prefix" --cflags --libs zest-torch)
awk '/^## Using zest from libtorch/ { section = 1 } section && /^```cpp$/ { code = 1; next }
     code && /^```$/ { exit } code' "$source/README.md" > "$stage/snippet.cpp"
[ -s "$stage/snippet.cpp" ] || { echo "FAIL: no C++ program under README's 'Using zest from libtorch'"; exit 1; }
c++ -std=c++20 -Wall -Wextra -Werror "$stage/snippet.cpp" $flags -o "$stage/snippet" ||
  { echo "FAIL: README's libtorch program does not compile"; exit 1; }

cd "$stage"
printf 'stage: 3\ndevice:\n  type: cpu\n  memory: 64MiB\noptimizer:\n  lr: 1e-3\n  threads: 1\n' > zest.yaml
libdir=$(pkg-config --define-variable=prefix="$prefix" --variable=libdir zest-torch)
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$mpirun" --oversubscribe --bind-to none -np 2 -x LD_LIBRARY_PATH ./snippet
[ -f checkpoint/manifest ] || { echo "FAIL: the program left no checkpoint"; ls -la checkpoint || true; exit 1; }
echo "ok: README's libtorch program compiles against the installed zest-torch and trains on 2 ranks"
