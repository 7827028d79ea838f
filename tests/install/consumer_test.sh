#!/usr/bin/env bash
# Installs the build into a scratch directory and builds a program against it with nothing but
# `pkg-config --cflags --libs zest`, as a trainer would; then runs it.
# usage: consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 source=$2
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

meson install -C "$build" --destdir "$stage" --no-rebuild --quiet >/dev/null
pc=$(find "$stage" -name zest.pc -print -quit)
[ -n "$pc" ] || { echo "FAIL: zest.pc was not installed"; exit 1; }
export PKG_CONFIG_PATH=$(dirname "$pc")
# The .pc file names the install prefix; point it into the scratch directory.
prefix=$stage$(pkg-config --variable=prefix zest)
flags=$(pkg-config --define-variable=prefix="$prefix" --cflags --libs zest)
c++ -std=c++20 "$source/tests/install/consumer.cpp" $flags -o "$stage/consumer"
libdir=$(pkg-config --define-variable=prefix="$prefix" --variable=libdir zest)
# Prepended: the libraries zest links (a prefix of their own, as in scripts/gpu-kit) stay found.
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$stage/consumer"
