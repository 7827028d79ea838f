#!/bin/sh
# One notion of a valid config (issue 21): every shipped example config (configs/*.yaml) passes
# every command that takes a config: `zest config check` (alone and as the program that reads it),
# `zest estimate --config`, `zest smoke --config` and the program itself (zest-train, or zest-gpt
# where it is built); a top-level key the programs refuse is refused by `zest config check` too;
# empty paths are errors naming the flag.
# $1: zest, $2: zest-train, $3: zest-gpt or "" (built with torch only). ZEST_TEST_DATA: tests/.
set -eu

zest=${1:?usage: example_configs_test.sh ZEST ZEST_TRAIN [ZEST_GPT]}
zest_train=${2:?usage: example_configs_test.sh ZEST ZEST_TRAIN [ZEST_GPT]}
zest_gpt=${3:-}
data=${ZEST_TEST_DATA:?ZEST_TEST_DATA must name the tests/ source directory}
configs="$data/../configs"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1

. "$(dirname "$0")/expect.sh"

# runp PROGRAM ARGS...: as run, for another binary.
runp() {
  rc=0
  program=$1
  shift
  "$program" "$@" >"$work/out" 2>"$work/err" || rc=$?
}

# The program that reads each config: zest-gpt's has model.heads; every other is zest-train's.
program_of() {
  if grep -q '^  heads:' "$1"; then echo zest-gpt; else echo zest-train; fi
}

count=0
for config in "$configs"/*.yaml; do
  name=$(basename "$config")
  program=$(program_of "$config")
  count=$((count + 1))
  run config check "$config"
  expect_rc 0 "config check $name"
  run config check "$config" --program "$program"
  expect_rc 0 "config check $name --program $program"
  run estimate --params 1e9 --config "$config"
  expect_rc 0 "estimate --config $name"
  # A CUDA config runs where a GPU is; here its device cannot start, which is not the config's fault.
  if grep -q '^  type: cuda' "$config"; then
    echo "$name: device cuda, not run (no GPU needed for the checks above)"
    continue
  fi
  run smoke --config "$config"
  expect_rc 0 "smoke --config $name"
  if [ "$program" = zest-train ]; then
    runp "$zest_train" --config "$config" --steps 1
    expect_rc 0 "zest-train --config $name"
  elif [ -n "$zest_gpt" ]; then
    runp "$zest_gpt" --config "$config" --steps 1
    expect_rc 0 "zest-gpt --config $name"
  else
    echo "$name: zest-gpt not built (-Dtorch=disabled), not run"
  fi
done
[ "$count" -ge 5 ] || fail "found $count configs in $configs, expected the 5 shipped ones"

# --- top-level keys the programs refuse: config check refuses them too, at the same place.
for key in STAGE sta gradient_accumulation; do
  printf 'stage: 1\n%s: 2\n' "$key" >"$work/$key.yaml"
  runp "$zest_train" --config "$work/$key.yaml" --steps 1
  expect_rc 2 "zest-train refuses $key:"
  cp "$work/err" "$work/train.err"
  run config check "$work/$key.yaml"
  expect_rc 2 "config check refuses $key:"
  expect_text "$work/err" "$work/$key.yaml:2:1: $key: " "config check refuses $key:"
  expect_text "$work/train.err" "$work/$key.yaml:2:1: $key: " "zest-train refuses $key:"
  run estimate --params 1e9 --config "$work/$key.yaml"
  expect_rc 2 "estimate refuses $key:"
done
# A key inside a program's section: the program refuses it, and so does config check as that program.
printf 'train:\n  step: 3\n' >"$work/train-key.yaml"
runp "$zest_train" --config "$work/train-key.yaml" --steps 1
expect_rc 2 "zest-train refuses train.step"
run config check "$work/train-key.yaml" --program zest-train
expect_rc 2 "config check --program zest-train refuses train.step"
expect_text "$work/err" "train-key.yaml:2:3: train.step: unknown key" "config check --program zest-train refuses train.step"

# --- empty paths: an error naming the flag, before any work (main saved nothing, trained from
# scratch, and exited 0)
for flag in --save --load --config; do
  if [ "$flag" = --config ]; then set -- --config ''; else set -- --config "$configs/train-tiny.yaml" "$flag" ''; fi
  runp "$zest_train" "$@" --steps 1
  expect_rc 2 "zest-train $flag ''"
  expect_text "$work/err" "$flag: the path is empty" "zest-train $flag ''"
done
if [ -n "$zest_gpt" ]; then
  for flag in --save --load --dump; do
    runp "$zest_gpt" --config "$configs/gpt-tiny.yaml" "$flag" '' --steps 1
    expect_rc 2 "zest-gpt $flag ''"
    expect_text "$work/err" "$flag: the path is empty" "zest-gpt $flag ''"
  done
fi
run smoke --config ''
expect_rc 2 "smoke --config ''"
expect_text "$work/err" "--config: the path is empty" "smoke --config ''"
run config check ''
expect_rc 2 "config check ''"
expect_text "$work/err" "FILE is empty" "config check ''"
printf 'stage: 2\noffload:\n  optimizer: {device: nvme, path: ""}\n' >"$work/empty-path.yaml"
run config check "$work/empty-path.yaml"
expect_rc 2 "offload path ''"
expect_text "$work/err" "offload.optimizer.path" "offload path ''"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "example configs: all checks passed"
