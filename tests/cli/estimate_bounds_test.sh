#!/bin/sh
# zest estimate's bounds (issue 21): at the documented maxima it finishes in bounded time and
# memory (here under `ulimit -d` of 100 MiB), whatever offload.sub_group says; counts past an int
# (ranks per node x nodes) are refused by name, never wrapped.
# $1: the zest binary.
set -eu

zest=${1:?usage: estimate_bounds_test.sh PATH_TO_ZEST}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

. "$(dirname "$0")/expect.sh"

# The limit is on data (heap and private anonymous mappings: what zest allocates), not on address
# space: a CUDA build maps libcudart and libnccl, hundreds of MiB of address space it never uses
# here. The zest binary links OpenBLAS (for `zest bench memory`), whose idle worker threads spin
# when a limit refuses their malloc arenas; one BLAS thread starts none.
export OPENBLAS_NUM_THREADS=1
limit_kib=$((100 * 1024))

# bounded SECONDS WHAT ARGS...: `zest estimate ARGS` under 100 MiB of data, killed after
# SECONDS; it must succeed.
bounded() {
  seconds=$1
  what=$2
  shift 2
  rc=0
  (ulimit -d "$limit_kib" && exec timeout "$seconds" "$zest" estimate "$@") >"$work/out" 2>"$work/err" || rc=$?
  expect_rc 0 "$what (124: over $seconds s; else out of 100 MiB?)"
}

# --- 10^15 parameters, the largest --params, with the defaults: within 1 s and 100 MiB (on main it
# grew until the OOM killer ended it: a plan entry per 256 MiB sub-group).
bounded 1 "1e15 defaults" --params 1e15
expect_text "$work/out" "(1000000000000000) in 32 layers" "1e15 defaults"

# --- the smallest sub-group (the floor, 768B) at 10^15 parameters, every offload row and the
# config's own (partial, updated ahead): still closed form (on main 1e12 aborted with bad_alloc).
printf 'stage: 3\noffload:\n  sub_group: 768B\n  optimizer: {device: nvme, path: "%s", update_ahead: true}\n  param: {device: nvme, path: "%s"}\n' \
  "$work" "$work" >"$work/floor.yaml"
bounded 1 "1e15 at the sub-group floor" --params 1e15 --config "$work/floor.yaml"
expect_text "$work/out" "offload.sub_group 768B" "1e15 at the sub-group floor"
printf 'stage: 2\noffload:\n  sub_group: 768B\n  optimizer: {device: cpu, ratio: 0.5}\n' >"$work/ratio.yaml"
bounded 1 "1e15 partial offload at the floor" --params 1e15 --config "$work/ratio.yaml"

# --- every maximum at once: layers, ranks per node, and nodes up to the int the world is
# numbered with (10^6 x 2147 = 2,147,000,000 ranks).
bounded 10 "every maximum" --params 1e15 --layers 100000 --ranks-per-node 1000000 --nodes 2147 --config "$work/floor.yaml"
expect_text "$work/out" "1000000 ranks per node x 2147 nodes = 2147000000 ranks" "every maximum"

# --- counts past an int: refused, naming both flags (main printed "1410065408 ranks")
rc=0
"$zest" estimate --params 1e9 --ranks-per-node 100000 --nodes 100000 >"$work/out" 2>"$work/err" || rc=$?
expect_rc 2 "10^10 ranks"
expect_text "$work/err" "--ranks-per-node 100000 x --nodes 100000 = 10000000000 ranks, more than the 2147483647" "10^10 ranks"
grep -q 1410065408 "$work/out" "$work/err" && fail "10^10 ranks: the wrapped count is printed"
rc=0
"$zest" estimate --params 1e9 --layers 100001 >"$work/out" 2>"$work/err" || rc=$?
expect_rc 2 "too many layers"
expect_text "$work/err" "--layers: expected a whole number from 1 to 100000" "too many layers"

# --- a sub-group under its floor is a config error naming the key, the value and the floor
printf 'offload:\n  sub_group: 1\n' >"$work/tiny.yaml"
rc=0
"$zest" estimate --params 1e12 --config "$work/tiny.yaml" >"$work/out" 2>"$work/err" || rc=$?
expect_rc 2 "sub_group: 1"
expect_text "$work/err" "tiny.yaml:2:14: offload.sub_group: expected a size of at least 768B" "sub_group: 1"
expect_text "$work/err" "found '1B'" "sub_group: 1"
printf 'buckets:\n  reduce: 2\n' >"$work/bucket.yaml"
rc=0
"$zest" estimate --params 1e9 --config "$work/bucket.yaml" >"$work/out" 2>"$work/err" || rc=$?
expect_rc 2 "buckets.reduce: 2"
expect_text "$work/err" "bucket.yaml:2:11: buckets.reduce: expected a size of at least 4B" "buckets.reduce: 2"

# --- an empty --config is an error naming it, not the defaults
rc=0
"$zest" estimate --params 1e9 --config '' >"$work/out" 2>"$work/err" || rc=$?
expect_rc 2 "--config ''"
expect_text "$work/err" "--config: the path is empty" "--config ''"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "estimate bounds: all checks passed"
