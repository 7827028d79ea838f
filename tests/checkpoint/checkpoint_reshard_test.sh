#!/usr/bin/env bash
# zest-train resumed from checkpoints across rank counts and stages follows the loss curve of one
# uninterrupted run: np 4 stage 3 saves after step 5, np 2 stage 2 with its optimizer states on NVMe
# loads it and saves after step 9, np 1 stage 0 loads that and stops at step 12; each resumed
# step's loss is within 1e-5 of the reference's. Then saves killed with SIGKILL inside their save window leave the previous checkpoint.
# usage: checkpoint_reshard_test.sh ZEST_TRAIN MPIRUN SOURCE_DIR
set -euo pipefail
train=$1 mpirun=$2 source=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# run NAME RANKS STAGE ARGS...: writes $work/NAME.loss ("step loss" lines); $extra (YAML) is
# appended to the config
extra=""
run() {
  local name=$1 ranks=$2 stage=$3
  shift 3
  sed -e "s/^stage: .*/stage: $stage/" "$source/configs/train-tiny.yaml" > "$work/$name.yaml"
  printf '%s\n' "$extra" >> "$work/$name.yaml"
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
# b keeps its optimizer states in NVMe swap files: loaded into them and saved from them by ranges.
mkdir "$work/swap"
extra=$(printf 'offload:\n  optimizer:\n    device: nvme\n    path: %s' "$work/swap")
run b 2 2 --load "$work/ckpt" --steps 9 --save "$work/ckpt"
extra=""
run c 1 0 --load "$work/ckpt" --steps 12
same a 1 5 || failures=$((failures + 1))
same b 6 9 || failures=$((failures + 1))
same c 10 12 || failures=$((failures + 1))
grep -q "resumed from .* after step 5" "$work/b.out" || { echo "FAIL: b did not resume after step 5"; failures=$((failures + 1)); }

# Crash safety, on a 20M-parameter model so that a save takes long enough to be caught inside:
# a run loads the step-1 checkpoint, trains step 2 and saves over it; its ranks get SIGKILL the
# moment the save's temporary directory appears (then: once rank 1 has begun writing v, its last file). The kill must have landed
# inside the save (the run never said it saved, the temporary directory is there), and the
# checkpoint must still load and hold step 1.
sed -e "s/^stage: .*/stage: 3/; s/memory: 256MiB/memory: 4GiB/; s/hidden: 128/hidden: 3072/; s/layers: 2/layers: 3/" \
  "$source/configs/train-tiny.yaml" > "$work/big.yaml"
"$mpirun" --oversubscribe --bind-to none -np 2 "$train" --config "$work/big.yaml" --steps 1 --save "$work/big" \
  > "$work/big.out" 2>&1 || { echo "FAIL: big"; cat "$work/big.out"; exit 1; }
for moment in "-name big.tmp-*" "-path *big.tmp-*/rank1.v.bin -size +0c"; do
  "$mpirun" --oversubscribe --bind-to none -np 2 "$train" --config "$work/big.yaml" \
    --load "$work/big" --steps 2 --save "$work/big" > "$work/kill.out" 2>&1 &
  pid=$!
  for ((i = 0; i < 6000; i++)); do  # up to 60 s
    set -f  # $moment is find's predicates, its patterns find's
    # shellcheck disable=SC2086
    found=$(find "$work" $moment 2> /dev/null)
    set +f
    [ -n "$found" ] && break
    sleep 0.01
  done
  for rank in $(pgrep -P "$pid" || true); do kill -KILL "$rank" 2>/dev/null || true; done  # the ranks, by id
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  where="a kill at find $moment"
  if grep -q "saved a checkpoint" "$work/kill.out" || ! compgen -G "$work/big.tmp-*" > /dev/null; then
    echo "FAIL: $where did not land inside the save"; cat "$work/kill.out"; failures=$((failures + 1))
  fi
  "$mpirun" --oversubscribe --bind-to none -np 1 "$train" --config "$work/big.yaml" --load "$work/big" --steps 1 \
    > "$work/after-kill.out" 2>&1 || true
  grep -q "resumed from .* after step 1 " "$work/after-kill.out" \
    || { echo "FAIL: after $where, the checkpoint does not load as step 1"; cat "$work/after-kill.out"; failures=$((failures + 1)); }
  rm -rf "$work"/big.tmp-* "$work"/big.old-*  # what a killed save leaves behind
done

[ "$failures" -eq 0 ] && echo "zest-train: resumed across np 4/2/1 and stages 3/2/0 on the uninterrupted loss curve; saves killed inside the save left the previous checkpoint"
exit "$failures"
