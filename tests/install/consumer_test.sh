#!/usr/bin/env bash
# Installs the build into a scratch directory and builds a program against it with nothing but
# `pkg-config --cflags --libs zest`, as a trainer would; then runs it without LD_LIBRARY_PATH (the
# .pc file's rpath finds libzest) and checks that libzest links CUDA only in a CUDA build.
# usage: consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 source=$2
source "$source/tests/install/no_zest_path.sh"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

meson install -C "$build" --destdir "$stage" --no-rebuild --quiet >/dev/null
pc=$(find "$stage" -name zest.pc -print -quit)
[ -n "$pc" ] || { echo "FAIL: zest.pc was not installed"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc")
# The .pc file names the install prefix; point it into the scratch directory.
prefix=$stage$(pkg-config --variable=prefix zest)
libdir=$(pkg-config --define-variable=prefix="$prefix" --variable=libdir zest)
[ "$(dirname "$pc")" = "$libdir/pkgconfig" ] ||
  { echo "FAIL: zest.pc is in $(dirname "$pc"), not in the libdir's pkgconfig ($libdir/pkgconfig), as README says"; exit 1; }
flags=$(pkg-config --define-variable=prefix="$prefix" --cflags --libs zest)
c++ -std=c++20 "$source/tests/install/consumer.cpp" $flags -o "$stage/consumer"
# Without LD_LIBRARY_PATH to zest, as a user runs it (no_zest_path.sh); and the libzest it loads is
# the one just installed (not another found in the loader's paths).
found=$(no_zest_path ldd "$stage/consumer" | awk '$1 ~ /^libzest\.so/ { print ($3 == "not" ? "" : $3) }')
[ "$found" = "$libdir/libzest.so" ] || {
  echo "FAIL: a program linked by pkg-config --libs zest loads libzest from '${found:-nowhere}', not $libdir"
  echo "      (its flags: $flags)"; no_zest_path ldd "$stage/consumer"; exit 1; }
no_zest_path "$stage/consumer"

# libzest links the CUDA runtime and NCCL only in a build configured for them (-Dcuda=enabled).
needed=$(readelf -d "$libdir/libzest.so" | awk '/NEEDED/ { print $NF }' | tr -d '[]')
if grep -q 'ZEST_HAVE_CUDA 1' "$build/zest_build_config.h"; then cuda=yes; else cuda=no; fi
if [ "$cuda" = no ] && grep -Eq '^lib(cudart|nccl|cuda)\.' <<<"$needed"; then
  echo "FAIL: libzest was built without CUDA but links:" $(grep -E '^lib(cudart|nccl|cuda)\.' <<<"$needed"); exit 1
fi
if [ "$cuda" = yes ] && ! grep -Eq '^libcudart\.' <<<"$needed"; then
  echo "FAIL: libzest was built with CUDA but does not link libcudart"; exit 1
fi

# Installed programs find libzest without LD_LIBRARY_PATH (their rpath is $ORIGIN/../lib...).
zest_bin=$(find "$stage" -path '*/bin/zest' -print -quit)
[ -n "$zest_bin" ] || { echo "FAIL: bin/zest was not installed"; exit 1; }
no_zest_path "$zest_bin" config check "$source/configs/train-tiny.yaml" >/dev/null ||
  { echo "FAIL: the installed zest does not run without LD_LIBRARY_PATH"; exit 1; }

# README's "Using zest from a trainer" snippet compiles as written, against the installed headers:
# its code becomes main's body; the trainer's own parts (model sizes, forward, backward) are stubs.
snippet=$(awk '/^## Using zest from a trainer/ { section = 1 } section && /^```cpp$/ { code = 1; next }
               code && /^```$/ { exit } code' "$source/README.md")
[ -n "$snippet" ] || { echo "FAIL: no C++ snippet under README's 'Using zest from a trainer'"; exit 1; }
{
  echo '#include <cmath>'
  echo '#include <vector>'
  grep '^#include' <<<"$snippet"
  echo 'std::size_t vocab = 64, dim = 8; int steps = 10, warmup = 2; std::vector<float> initial_w1(64);'
  echo 'template <class... A> void forward(A&&...) {}'
  echo 'template <class... A> void backward(A&&...) {}'
  echo 'int main() {'
  grep -v '^#include' <<<"$snippet"
  echo '}'
} >"$stage/snippet.cpp"
c++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -Wno-unused "$stage/snippet.cpp" $flags ||
  { echo "FAIL: README's trainer snippet does not compile (as $stage/snippet.cpp above)"; exit 1; }
echo "ok: the installed library links, a program built by pkg-config and the installed programs run without LD_LIBRARY_PATH, libzest links CUDA: $cuda, README's snippet compiles"
