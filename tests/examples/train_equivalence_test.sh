#!/usr/bin/env bash
# zest-train's loss curve is the same for every rank count and stage (the data order depends on seed
# and step alone), within fp32 tolerance of the single-process stage-0 run, and the loss falls.
# usage: train_equivalence_test.sh ZEST_TRAIN MPIRUN SOURCE_DIR
set -euo pipefail
train=$1 mpirun=$2 source=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# run NAME RANKS STAGE ACCUMULATION CLIP: writes $work/NAME.loss ("step loss" lines)
run() {
  local name=$1 ranks=$2 stage=$3 accumulation=$4 clip=$5
  sed -e "s/^stage: .*/stage: $stage/" "$source/configs/train-tiny.yaml" > "$work/$name.yaml"
  printf 'gradient_accumulation_steps: %s\ngradient_clipping: %s\n' "$accumulation" "$clip" >> "$work/$name.yaml"
  "$mpirun" --oversubscribe --bind-to none -np "$ranks" "$train" --config "$work/$name.yaml" --steps 20 \
    > "$work/$name.out"
  awk '$1 == "step" { print $2, $4 }' "$work/$name.out" > "$work/$name.loss"
  [ "$(wc -l < "$work/$name.loss")" -eq 20 ] || { echo "FAIL: $name printed no loss curve"; cat "$work/$name.out"; exit 1; }
}

# same REFERENCE NAME: every step's loss within 1e-5 relative
same() {
  paste "$work/$1.loss" "$work/$2.loss" | awk -v a="$1" -v b="$2" '
    { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 > 1 ? $2 : 1)
      if (r > 1e-5) { printf "FAIL: %s vs %s at step %d: %s vs %s\n", a, b, $1, $2, $4; bad = 1 } }
    END { exit bad }'
}

failures=0
for accumulation_clip in "1 0" "2 0" "1 0.5"; do
  set -- $accumulation_clip
  ref="ref-acc$1-clip$2"
  run "$ref" 1 0 "$1" "$2"
  for ranks in 1 2 4; do
    for stage in 0 1 2 3; do
      [ "$ranks" = 1 ] && [ "$stage" = 0 ] && continue
      name="np$ranks-stage$stage-acc$1-clip$2"
      run "$name" "$ranks" "$stage" "$1" "$2"
      same "$ref" "$name" || failures=$((failures + 1))
    done
  done
done
# The loss must fall: the mean of the last 5 steps well below the first step's.
awk 'NR == 1 { first = $2 } NR > 15 { sum += $2 } END { if (sum / 5 > first - 0.5) { print "FAIL: loss did not fall"; exit 1 } }' \
  "$work/ref-acc1-clip0.loss" || failures=$((failures + 1))
[ "$failures" -eq 0 ] && echo "zest-train: 33 runs, identical loss curves, loss falls"
exit "$failures"
