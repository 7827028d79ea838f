#!/usr/bin/env bash
# zest-train resumed from checkpoints across rank counts and stages follows the loss curve of one
# uninterrupted run: np 4 stage 3 saves after step 5, np 2 stage 2 loads it and saves after step 9,
# np 1 stage 0 loads that and stops at step 12; each resumed step's loss is within 1e-5 of the
# reference's. Then a save killed with SIGKILL at some point must leave a checkpoint that loads.
# usage: checkpoint_reshard_test.sh ZEST_TRAIN MPIRUN SOURCE_DIR
set -euo pipefail
train=$1 mpirun=$2 source=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# run NAME RANKS STAGE ARGS...: writes $work/NAME.loss ("step loss" lines)
run() {
  local name=$1 ranks=$2 stage=$3
  shift 3
  sed -e "s/^stage: .*/stage: $stage/" "$source/configs/train-tiny.yaml" > "$work/$name.yaml"
  "$mpirun" --oversubscribe --bind-to none -np "$ranks" "$train" --config "$work/$name.yaml" "$@" \
    > "$work/$name.out" 2>&1 || { echo "FAIL: $name"; cat "$work/$name.out"; exit 1; }
  awk '$1 == "step" { print $2, $4 }' "$work/$name.out" > "$work/$name.loss"
}

# same NAME FIRST LAST: steps FIRST..LAST of NAME within 1e-5 relative of the reference
same() {
  local lines
  lines=$(awk -v f="$2" -v l="$3" '$1 >= f && $1 <= l' "$work/$1.loss" | wc -l)
  [ "$lines" -eq $(($3 - $2 + 1)) ] || { echo "FAIL: $1 printed $lines losses for steps $2..$3"; cat "$work/$1.out"; return 1; }
  awk -v f="$2" -v l="$3" -v name="$1" '
    NR == FNR { want[$1] = $2; next }
    $1 >= f && $1 <= l { d = $2 - want[$1]; if (d < 0) d = -d; r = d / (want[$1] > 1 ? want[$1] : 1)
      if (r > 1e-5) { printf "FAIL: %s at step %d: %s, uninterrupted %s\n", name, $1, $2, want[$1]; bad = 1 } }
    END { exit bad }' "$work/ref.loss" "$work/$1.loss"
}

failures=0
run ref 1 0 --steps 12
run a 4 3 --steps 5 --save "$work/ckpt"
run b 2 2 --load "$work/ckpt" --steps 9 --save "$work/ckpt"
run c 1 0 --load "$work/ckpt" --steps 12
same a 1 5 || failures=$((failures + 1))
same b 6 9 || failures=$((failures + 1))
same c 10 12 || failures=$((failures + 1))
grep -q "resumed from .* after step 5" "$work/b.out" || { echo "FAIL: b did not resume after step 5"; failures=$((failures + 1)); }

# Crash safety: saves over the step-9 checkpoint killed with SIGKILL at several moments; after each,
# the checkpoint directory must load (holding step 9 or the killed run's step 10) and train on.
for delay in 0.3 0.6 0.9 1.2; do
  sed -e "s/^stage: .*/stage: 3/" "$source/configs/train-tiny.yaml" > "$work/kill.yaml"
  "$mpirun" --oversubscribe --bind-to none -np 2 "$train" --config "$work/kill.yaml" \
    --load "$work/ckpt" --steps 10 --save "$work/ckpt" > "$work/kill.out" 2>&1 &
  pid=$!
  sleep "$delay"
  for rank in $(pgrep -P "$pid" || true); do kill -KILL "$rank" 2>/dev/null || true; done  # the ranks, by id
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  run "after-kill" 1 0 --load "$work/ckpt" --steps 12
  grep -Eq "resumed from .* after step (9|10)" "$work/after-kill.out" \
    || { echo "FAIL: after a kill at ${delay}s"; cat "$work/after-kill.out"; failures=$((failures + 1)); }
  rm -rf "$work"/ckpt.tmp-* "$work"/ckpt.old-*  # what a killed save leaves behind
done

[ "$failures" -eq 0 ] && echo "zest-train: resumed across np 4/2/1 and stages 3/2/0 on the uninterrupted loss curve; killed saves left loadable checkpoints"
exit "$failures"
