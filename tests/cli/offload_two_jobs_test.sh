#!/bin/sh
# Two jobs on one offload directory: two zest-train runs started together, each keeping its
# optimizer states (and, the second, its stage-3 parameters) on NVMe in the same `path`, train each
# to its own single-run bits: the checkpoint each saves is byte for byte the one it saves running
# alone, and so are its printed losses. (Before issue 21 the second's swap file took the first's
# name: both exited 0 with wrong losses.) A file of the user's in that directory is left as it was,
# and when both are done the directory holds nothing of theirs.
# usage: offload_two_jobs_test.sh ZEST_TRAIN SOURCE_ROOT
set -eu

zest_train=${1:?usage: offload_two_jobs_test.sh ZEST_TRAIN SOURCE_ROOT}
source_root=${2:?}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

. "$(dirname "$0")/expect.sh"

shared="$work/shared"
mkdir "$shared"
echo "a neighbour's notes" >"$shared/notes.txt"
cp "$shared/notes.txt" "$work/notes.copy"

# config NAME STAGE PARAM_DEVICE LR: train-tiny with its states in $shared, sub-groups of 16 KiB
# (many per step, so the swap files are read and written throughout).
config() {
  sed -e "s/^stage: .*/stage: $2/" -e "s/^  lr: .*/  lr: $4/" "$source_root/configs/train-tiny.yaml" >"$work/$1.yaml"
  cat >>"$work/$1.yaml" <<YAML
offload:
  optimizer: {device: nvme, path: $shared}
  param: {device: $3, path: $( [ "$3" = nvme ] && echo "$shared" || echo '""')}
  sub_group: 16KiB
YAML
}
config a 2 none 3e-3
config b 3 nvme 1e-3

# train NAME RUN: NAME's config, 150 steps, saved to $work/NAME-RUN; output in $work/NAME-RUN.out.
train() {
  timeout 120 "$zest_train" --config "$work/$1.yaml" --steps 150 --save "$work/$1-$2" \
    >"$work/$1-$2.out" 2>"$work/$1-$2.err" </dev/null
}

for job in a b; do
  train $job alone || { fail "$job alone: exit $?: $(cat "$work/$job-alone.err")"; }
done
train a together & pid_a=$!
train b together & pid_b=$!
wait $pid_a || fail "a beside b: exit $?: $(cat "$work/a-together.err")"
wait $pid_b || fail "b beside a: exit $?: $(cat "$work/b-together.err")"

for job in a b; do
  grep "^step " "$work/$job-alone.out" >"$work/$job-alone.steps" || fail "$job alone printed no step"
  grep "^step " "$work/$job-together.out" >"$work/$job-together.steps" || true
  cmp -s "$work/$job-alone.steps" "$work/$job-together.steps" ||
    fail "$job: its losses beside the other job differ from its own run's:
$(diff "$work/$job-alone.steps" "$work/$job-together.steps" | head -6)"
  for file in $(cd "$work/$job-alone" && ls); do
    cmp -s "$work/$job-alone/$file" "$work/$job-together/$file" ||
      fail "$job: its checkpoint's $file beside the other job differs from its own run's"
  done
done
# The two jobs did differ (else this test could not tell them apart).
cmp -s "$work/a-alone.steps" "$work/b-alone.steps" && fail "the two jobs printed the same losses: they cannot be told apart"

cmp -s "$shared/notes.txt" "$work/notes.copy" || fail "the neighbour's notes.txt was changed"
[ "$(ls -A "$shared")" = "notes.txt" ] || fail "the offload directory holds, after both jobs: $(ls -A "$shared")"

if [ "$failures" -gt 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "two jobs on one offload directory: each trained to its own bits; the directory holds only the user's file"
