#!/usr/bin/env bash
# A rank SIGKILLed in the middle of a stage-3 step: every other rank raises zest's CommError naming
# the dead rank within comm.timeout (3 s) and a bounded grace, instead of hanging; the checkpoint
# saved before the step still loads and trains on.
# usage: watchdog_kill_test.sh WATCHDOG_KILL MPIRUN RANKS
set -euo pipefail
program=$1 mpirun=$2 ranks=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
victim=$((ranks - 1))

# Open MPI's launcher ends the whole job when a rank dies; with recovery enabled it leaves the
# survivors running, which is what a watchdog is for (Slurm: srun --no-kill).
status=0
timeout 120 "$mpirun" --oversubscribe --bind-to none --mca orte_enable_recovery 1 -np "$ranks" \
  "$program" train "$work/ckpt" "$victim" > "$work/train.out" 2>&1 || status=$?
cat "$work/train.out"
[ "$status" -ne 124 ] || { echo "FAIL: the survivors hung (killed after 120 s)"; exit 1; }
fail=0
for ((r = 0; r < victim; ++r)); do
  line=$(grep "^rank $r: CommError after" "$work/train.out" || true)
  [ -n "$line" ] || { echo "FAIL: rank $r did not report a CommError"; fail=1; continue; }
  case "$line" in
    *"rank $victim: gone"*) ;;
    *) echo "FAIL: rank $r's error does not name rank $victim as gone"; fail=1 ;;
  esac
  # 3 s timeout + at most 3 s of grace; the rest is a loaded machine's scheduling.
  seconds=$(sed -n 's/^rank [0-9]*: CommError after \([0-9.]*\) s:.*/\1/p' <<< "$line")
  awk -v s="$seconds" 'BEGIN { exit !(s >= 2.9 && s <= 30) }' ||
    { echo "FAIL: rank $r raised after $seconds s (expected 3 to 30)"; fail=1; }
done
grep -q "saved step 2" "$work/train.out" || { echo "FAIL: no checkpoint was saved"; fail=1; }
((fail == 0)) || exit 1

timeout 120 "$mpirun" --oversubscribe --bind-to none -np "$ranks" "$program" load "$work/ckpt" \
  > "$work/load.out" 2>&1 || { cat "$work/load.out"; echo "FAIL: the checkpoint did not load"; exit 1; }
cat "$work/load.out"
grep -q "loaded step 2, trained step 3" "$work/load.out" || { echo "FAIL: load printed no step 2"; exit 1; }
echo "PASS: $((ranks - 1)) survivors raised CommError naming rank $victim; the checkpoint loads"
