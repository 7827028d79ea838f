#!/usr/bin/env bash
# The CPU Adam kernel source at a base revision against the working tree's, in one program
# (bench/kernel_ab.cpp): same arrays, interleaved rounds, so a change to the kernel is measured as a
# same-run ratio on a noisy machine.
#
#   bench/kernel_ab.sh BASE_REV [--isa avx512|avx2] [--states int8|bf16] [--params N] [--rounds R]
#
# Compiles with the flags of src/optim/meson.build (-O3 as the release build, -ffp-contract=off, the
# ISA's -m flags) into a temporary directory; needs g++ and the repository's headers only.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage="usage: bench/kernel_ab.sh BASE_REV [--isa avx512|avx2] [--states int8|bf16] [--params N] [--rounds R]"
die() { echo "kernel_ab: $*" >&2; echo "$usage" >&2; exit 2; }
[ $# -ge 1 ] || die "BASE_REV is required"
base=$1
shift
isa=avx512 states=int8 params=20000000 rounds=15
while [ $# -gt 0 ]; do
  case $1 in
    --isa) isa=${2:?}; shift 2 ;;
    --states) states=${2:?}; shift 2 ;;
    --params) params=${2:?}; shift 2 ;;
    --rounds) rounds=${2:?}; shift 2 ;;
    *) die "unexpected argument '$1'" ;;
  esac
done
case $isa in
  avx512) flags=(-mavx512f -mavx512bw -mavx512vl -mavx512dq -mf16c) ;;
  avx2) flags=(-mavx2 -mfma -mf16c) ;;
  *) die "--isa takes avx512 or avx2, not '$isa'" ;;
esac
git -C "$root" rev-parse --verify --quiet "$base^{commit}" > /dev/null || die "'$base' is not a revision"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The base's whole src/ and include/, so its kernel compiles with its own headers (compact_math.hpp
# and the rest); kernel_ab.cpp calls both through the working tree's CompactAdamRange, which the
# two revisions must therefore share.
mkdir "$work/base"
git -C "$root" archive "$base" src include | tar -x -C "$work/base"
flags+=(-O3 -std=c++20 -ffp-contract=off)
pids=()
g++ "${flags[@]}" -I"$work/base/src" -I"$work/base/include" -DZEST_ADAM_ISA_NS=base_ns \
  -c "$work/base/src/optim/adam_kernels.cpp" -o "$work/base.o" & pids+=($!)
g++ "${flags[@]}" -I"$root/src" -I"$root/include" -DZEST_ADAM_ISA_NS=work_ns \
  -c "$root/src/optim/adam_kernels.cpp" -o "$work/work.o" & pids+=($!)
g++ -O3 -std=c++20 -I"$root/src" -I"$root/include" -c "$root/bench/kernel_ab.cpp" -o "$work/main.o" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || die "compiling failed (above)"; done
g++ "$work/main.o" "$work/base.o" "$work/work.o" -o "$work/kernel_ab"
echo "kernel_ab: $base against the working tree, $isa" >&2
"$work/kernel_ab" "$states" "$params" "$rounds"
