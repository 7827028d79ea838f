#!/usr/bin/env bash
# README's "Using zest from libtorch" program compiles as written against the installed
# zest-torch with nothing but `pkg-config --cflags --libs zest-torch`, and trains on 2 ranks at
# stage 3 without LD_LIBRARY_PATH (the .pc files' rpaths find zest-torch, zest and libtorch),
# leaving a checkpoint.
# usage: readme_snippet_test.sh BUILD_DIR SOURCE_DIR MPIRUN
set -euo pipefail
build=$1 source=$2 mpirun=$3
source "$source/tests/install/no_zest_path.sh"
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

# The libraries it loads without LD_LIBRARY_PATH are the ones just installed, and libtorch's.
libdir=$(pkg-config --define-variable=prefix="$prefix" --variable=libdir zest-torch)
libs=$(no_zest_path ldd "$stage/snippet")
for lib in libzest-torch.so libzest.so; do
  found=$(awk -v lib="$lib" '$1 == lib { print ($3 == "not" ? "" : $3) }' <<<"$libs")
  [ "$found" = "$libdir/$lib" ] || {
    echo "FAIL: a program linked by pkg-config --libs zest-torch loads $lib from '${found:-nowhere}', not $libdir"
    echo "      (its flags: $flags)"; echo "$libs"; exit 1; }
done
if grep -q 'not found' <<<"$libs"; then
  echo "FAIL: without LD_LIBRARY_PATH the program does not find:"; grep 'not found' <<<"$libs"; exit 1
fi

# So does the installed zest-gpt, which links libtorch itself.
gpt=$(find "$stage/root" -path '*/bin/zest-gpt' -print -quit)
[ -n "$gpt" ] || { echo "FAIL: bin/zest-gpt was not installed"; exit 1; }
if no_zest_path ldd "$gpt" | grep -q 'not found'; then
  echo "FAIL: without LD_LIBRARY_PATH the installed zest-gpt does not find:"
  no_zest_path ldd "$gpt" | grep 'not found'; exit 1
fi

cd "$stage"
printf 'stage: 3\ndevice:\n  type: cpu\n  memory: 64MiB\noptimizer:\n  lr: 1e-3\n  threads: 1\n' > zest.yaml
no_zest_path "$mpirun" --oversubscribe --bind-to none -np 2 ./snippet
[ -f checkpoint/manifest ] || { echo "FAIL: the program left no checkpoint"; ls -la checkpoint || true; exit 1; }
echo "ok: README's libtorch program compiles against the installed zest-torch and trains on 2 ranks without LD_LIBRARY_PATH"
