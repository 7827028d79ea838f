#!/usr/bin/env bash
# The MPI tests' main fails fast: a rank's fatal failure ends every rank at once, with the failure
# printed, instead of leaving the others in a collective until meson's timeout.
#   fail_fast_test.sh MPIRUN PROGRAM
set -uo pipefail
mpirun=$1 program=$2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
timeout 60 "$mpirun" --oversubscribe --bind-to none -np 2 "$program" >"$log" 2>&1
rc=$?
seconds=$(($(date +%s) - start))
fail() { echo "FAIL: $*"; cat "$log"; exit 1; }
[ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || fail "the job still ran after 60 s: rank 0 was left in the barrier"
[ "$rc" -ne 0 ] || fail "the job exited 0 although rank 1 failed"
grep -q "rank 1's deliberate failure" "$log" || fail "rank 1's failure message is not in the output"
grep -q "\[rank 1\] a fatal failure: aborting every rank" "$log" || fail "no abort notice from rank 1"
echo "a fatal failure on rank 1 ended the job in ${seconds} s (exit $rc), its message printed"
