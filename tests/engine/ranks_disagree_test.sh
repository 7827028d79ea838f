#!/usr/bin/env bash
# Two ranks started with different configs in one MPMD launch (`mpirun ... : ...`), as a job
# script that builds each rank's config itself might: zest-train fails within seconds on both,
# naming the key and both values, where it used to hang until comm.timeout (stage) or train
# silently, each rank updating its shard with its own value (lr). Issue 34 item 3.
# usage: ranks_disagree_test.sh ZEST_TRAIN MPIRUN SOURCE_ROOT
set -euo pipefail
train=$1 mpirun=$2 src=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# refused KEY OURS THEIRS SED: rank 1's config is the tiny example's with SED applied.
refused() {
  local key=$1 ours=$2 theirs=$3 edit=$4 status=0 start end
  cp "$src/configs/train-tiny.yaml" "$work/a.yaml"
  sed "$edit" "$src/configs/train-tiny.yaml" > "$work/b.yaml"
  start=$(date +%s)
  timeout 60 "$mpirun" --oversubscribe --bind-to none -np 1 "$train" --config "$work/a.yaml" --steps 3 : \
    -np 1 "$train" --config "$work/b.yaml" --steps 3 > "$work/out" 2>&1 || status=$?
  end=$(date +%s)
  cat "$work/out"
  [ "$status" -ne 124 ] || { echo "FAIL ($key): the ranks hung (killed after 60 s)"; exit 1; }
  [ "$status" -ne 0 ] || { echo "FAIL ($key): ranks with different $key trained"; exit 1; }
  grep -q "$key differs between ranks: rank 0 has '$ours', rank 1 has '$theirs'" "$work/out" ||
    { echo "FAIL ($key): no error naming the key and both values"; exit 1; }
  [ $((end - start)) -le 30 ] || { echo "FAIL ($key): took $((end - start)) s"; exit 1; }
  echo "ok: $key refused in $((end - start)) s"
}

refused optimizer.lr 0.003 0.001 's/lr: 3e-3/lr: 1e-3/'
refused stage 2 3 's/^stage: 2/stage: 3/'
refused buckets.reduce 4MiB 1MiB 's/reduce: 4MiB/reduce: 1MiB/'
