#!/bin/sh
# zest config check: exit codes and output for a valid file, an invalid file and bad usage.
# $1: the zest binary. ZEST_TEST_DATA: the tests/ source directory (set by tests/meson.build).
set -eu

zest=${1:?usage: config_check_test.sh PATH_TO_ZEST}
data=${ZEST_TEST_DATA:?ZEST_TEST_DATA must name the tests/ source directory}
cases="$data/config/cases"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

. "$(dirname "$0")/expect.sh"

# --- a valid file: "FILE: valid", then the resolved config, exit 0
valid="$cases/full.yaml"
run config check "$valid"
expect_rc 0 "valid file"
[ "$(head -n 1 "$work/out")" = "$valid: valid" ] ||
  fail "valid file: first line is '$(head -n 1 "$work/out")', expected '$valid: valid'"
expect_line "$work/out" "stage: 3" "valid file"
expect_line "$work/out" "  memory: 4GiB" "valid file"
expect_line "$work/out" "  betas: [0.8, 0.95]" "valid file"
[ ! -s "$work/err" ] || fail "valid file: unexpected stderr: $(cat "$work/err")"

# The printed config is itself valid and prints the same again.
tail -n +2 "$work/out" >"$work/resolved.yaml"
run config check "$work/resolved.yaml"
expect_rc 0 "resolved config"
tail -n +2 "$work/out" | cmp -s - "$work/resolved.yaml" ||
  fail "resolved config does not print back unchanged"

# An empty file is every default, with loss scaling resolved for fp32.
: >"$work/empty.yaml"
run config check "$work/empty.yaml"
expect_rc 0 "empty file"
expect_line "$work/out" "    dynamic: false" "empty file"
expect_line "$work/out" "  memory: 2GiB" "empty file"

# --- a deprecated key (offload.optimizer.overlap, update_ahead's old name): valid, the resolved
# config under the new name, and one warning on stderr naming both and the removal
printf 'stage: 2\noffload:\n  optimizer: {device: cpu, overlap: true}\n' >"$work/old_name.yaml"
run config check "$work/old_name.yaml"
expect_rc 0 "deprecated key"
expect_line "$work/out" "    update_ahead: true" "deprecated key"
! grep -q "overlap:" "$work/out" || fail "deprecated key: the resolved config writes the old name"
expect_line "$work/err" "zest: warning: $work/old_name.yaml:3:37: offload.optimizer.overlap: deprecated: renamed \
offload.optimizer.update_ahead; the old name is read as the new one for now and will be removed in a later release" \
  "deprecated key"
[ "$(wc -l <"$work/err")" -eq 1 ] || fail "deprecated key: expected one line on stderr: $(cat "$work/err")"
# Both names: a problem naming both, exit 2.
printf 'stage: 2\noffload:\n  optimizer: {device: cpu, overlap: true, update_ahead: true}\n' >"$work/both.yaml"
run config check "$work/both.yaml"
expect_rc 2 "both names"
expect_text "$work/err" "both offload.optimizer.overlap and offload.optimizer.update_ahead are set" "both names"

# --- an invalid file: each problem on its own line, then the count, exit 2
invalid="$cases/out_of_range.yaml"
run config check "$invalid"
expect_rc 2 "invalid file"
expect_line "$work/err" "$invalid:1:8: stage: expected an integer from 0 to 3, found '4'" "invalid file"
expect_line "$work/err" "$invalid:22:16: io.queue_depth: expected an integer from 1 to 4096, found '4097'" "invalid file"
expect_line "$work/err" "17 problems in $invalid" "invalid file"
[ "$(wc -l <"$work/err")" -eq 18 ] || fail "invalid file: expected 17 problem lines and a count"
[ ! -s "$work/out" ] || fail "invalid file: unexpected stdout: $(cat "$work/out")"

run config check "$cases/nccl_with_cpu.yaml"
expect_rc 2 "one problem"
expect_line "$work/err" "1 problem in $cases/nccl_with_cpu.yaml" "one problem"

run config check "$cases/syntax_error.yaml"
expect_rc 2 "syntax error"
expect_text "$work/err" "$cases/syntax_error.yaml:5:8: YAML syntax error" "syntax error"

run config check "$work/does-not-exist.yaml"
expect_rc 2 "missing file"
expect_text "$work/err" "$work/does-not-exist.yaml: cannot read the config file: No such file or directory" "missing file"

# --- files that would block or never end are refused at once (timeout: a hang fails, not stalls)
mkfifo "$work/fifo.yaml"
rc=0
timeout 10 "$zest" config check "$work/fifo.yaml" >"$work/out" 2>"$work/err" || rc=$?
expect_rc 2 "FIFO"
expect_text "$work/err" "$work/fifo.yaml: cannot read the config file: it is a FIFO, not a regular file" "FIFO"
rc=0
# Bounded by time, not by `ulimit -v` (AddressSanitizer reserves terabytes of address space): the
# reader must refuse a device at once; an unbounded read would grow until timeout kills it.
(timeout 5 "$zest" config check /dev/zero) >"$work/out" 2>"$work/err" || rc=$?
expect_rc 2 "/dev/zero"
expect_text "$work/err" "/dev/zero: cannot read the config file: it is a character device" "/dev/zero"

# --- values the engine cannot run are refused, whatever their type allows
printf 'optimizer:\n  threads: 10000000\n' >"$work/threads.yaml"
run config check "$work/threads.yaml"
expect_rc 2 "10^7 threads"
expect_line "$work/err" "$work/threads.yaml:2:12: optimizer.threads: expected an integer from 0 to 1024, found '10000000'" "10^7 threads"

# --- a trainer's own sections: valid, listed as not checked (the README's trainer config)
train_config="$data/../configs/train-tiny.yaml"
run config check "$train_config"
expect_rc 0 "trainer config"
expect_line "$work/err" "$train_config: not checked (the program's own sections): model, train" "trainer config"

# --- usage
run config check
expect_rc 2 "no FILE"
expect_text "$work/err" "usage: zest config check FILE" "no FILE"

run config check "$valid" "$valid"
expect_rc 2 "two FILEs"
expect_text "$work/err" "usage: zest config check FILE" "two FILEs"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "config check: all checks passed"
