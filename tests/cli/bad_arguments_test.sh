#!/bin/sh
# The bad command-line values users found, in every program: each exits 2 at once (under a
# timeout, so a value that once spun forever or ran the whole benchmark fails instead of hanging)
# with a message naming the flag and the accepted range.
# $1: the zest binary, $2: zest-train.
set -eu

zest=${1:?usage: bad_arguments_test.sh PATH_TO_ZEST PATH_TO_ZEST_TRAIN}
zest_train=${2:?usage: bad_arguments_test.sh PATH_TO_ZEST PATH_TO_ZEST_TRAIN}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # the benchmarks' default outputs land here, if anything ran

. "$(dirname "$0")/expect.sh"

# refused PROGRAM EXPECTED_TEXT ARGS...: exits 2 within 10 s, stderr holds EXPECTED_TEXT, and no
# output file was written.
refused() {
  program=$1
  expected=$2
  shift 2
  # Built without the benchmarks (-Dbench=false), each refuses every call saying how to get it.
  if [ "${ZEST_BENCH:-built}" = absent ] && [ "$1" = bench ]; then expected="-Dbench=true"; fi
  rc=0
  timeout 10 "$program" "$@" >"$work/out" 2>"$work/err" || rc=$?
  expect_rc 2 "$(basename "$program") $*"
  expect_text "$work/err" "$expected" "$(basename "$program") $*"
  [ ! -e "$work/zest-memory.json" ] || fail "$(basename "$program") $*: the benchmark ran"
}

params="--params: expected a whole count from 1000 to 1000000000 (e.g. 4000000, 350M, 7B, 1.5e9)"
refused "$zest" "$params, found '-5'" bench memory --params -5
refused "$zest" "$params, found '1e19'" bench memory --params 1e19
refused "$zest" "$params, found 'nan'" bench memory --params nan
refused "$zest" "$params, found 'abc'" bench memory --params abc
refused "$zest" "--steps: expected a whole number from 2 to 1000000, found '1'" bench memory --steps 1
refused "$zest" "--device-memory: expected a size from 16MiB to 1TiB (e.g. 4096, 512KiB, 1.5GiB), found '1KiB'" \
  bench memory --device-memory 1KiB
refused "$zest" "--json: the directory '/nonexistent' does not exist; create it first" bench memory --json /nonexistent/x
refused "$zest" "--chart: '$work' is a directory; give a file path" bench memory --chart "$work"
refused "$zest" "--csv: '/dev/null' is not a regular file" bench memory --csv /dev/null
refused "$zest" "--nvme-path: directory '$work/none' does not exist" bench memory --nvme-path "$work/none"
refused "$zest" "--params needs a value" bench memory --params

refused "$zest" "--size: expected a number from 0.001 to 16384, found '1e30'" bench io --path "$work" --size 1e30
refused "$zest" "--size: expected a number from 0.001 to 16384, found '-1'" bench io --path "$work" --size -1
refused "$zest" "--reps: expected a whole number from 1 to 1000, found '0'" bench io --path "$work" --reps 0
refused "$zest" "--block-size: expected a size from 4KiB to 1GiB" bench io --path "$work" --block-size 3KiB
refused "$zest" "--path: directory '$work/none' does not exist" bench io --path "$work/none"
printf 'io:\n  queue_depth: 0\n' >"$work/bad.yaml"
refused "$zest" "$work/bad.yaml:2:16: io.queue_depth: expected an integer from 1 to 4096, found '0'" \
  bench io --path "$work" --config "$work/bad.yaml"

refused "$zest" "--threads: expected a whole number from 1 to 1024, found '10000000'" bench adam --threads 10000000
refused "$zest" "--params: expected a whole count from 1 to 100000000000" bench adam --params 1e19
refused "$zest" "--reps: expected a whole number from 1 to 1000, found '3x'" bench adam --reps 3x
refused "$zest" "unknown --states 'fp8'" bench adam --states fp8
refused "$zest" "--states bf16|int8 measures the cpu Adam (--device cpu)" bench adam --states int8 --device cuda
refused "$zest" "--master bf16 goes with compact moments" bench adam --master bf16
refused "$zest" "unknown --master 'fp8'" bench adam --master fp8 --states int8
refused "$zest" "--ahead measures the cpu Adam" bench adam --ahead --device cuda

refused "$zest" "--steps: expected a whole number from 1 to 1000000, found '-1'" bench step --path "$work" --steps -1
refused "$zest" "--io-size: expected a number from 0.001 to 16384, found 'nan'" bench step --path "$work" --io-size nan
refused "$zest" "--buffers: expected a whole number from 2 to 64, found '1000'" bench step --path "$work" --buffers 1000
refused "$zest" "--path: directory '$work/none' does not exist" bench step --path "$work/none"
refused "$zest" "device.memory: 16MiB cannot hold the buckets" \
  bench step --path "$work" --device-memory 16MiB --bucket 64MiB

refused "$zest" "--params: expected a whole count" estimate --params -5
# consolidate's OUT and zest-train's --save targets: tests/cli/checkpoint_safety_test.sh.

refused "$zest_train" "--steps: expected a whole number from 0 to 1000000000, found '-1'" --config x.yaml --steps -1
refused "$zest_train" "--steps: expected a whole number from 0 to 1000000000, found 'ten'" --config x.yaml --steps ten
refused "$zest_train" "--config FILE is required" --steps 3
# Two outputs at one path: a trace file where the checkpoint goes lost the run at its save (issue 34).
refused "$zest_train" "--save and --trace name the same path 'out'" --config x.yaml --save out --trace out
refused "$zest_train" "--save and --trace name the same path './out/'" --config x.yaml --save out --trace ./out/

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "bad arguments: all checks passed"
