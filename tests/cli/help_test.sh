#!/bin/sh
# Every command and subcommand answers --help (and -h) with its usage on stdout and exit 0, and
# refuses an unknown option (or subcommand) with its usage on stderr and exit 2, before any work.
# usage: help_test.sh ZEST ZEST_TRAIN [ZEST_GPT]
set -eu
zest=${1:?usage: help_test.sh ZEST ZEST_TRAIN [ZEST_GPT]}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# check NAME COMMAND...: COMMAND --help, -h and --no-such-option.
check() {
  name=$1
  shift
  for flag in --help -h; do
    rc=0
    timeout 30 "$@" "$flag" >"$work/out" 2>"$work/err" </dev/null || rc=$?
    [ "$rc" -eq 0 ] || fail "$name $flag: exit $rc: $(head -3 "$work/err")"
    grep -q "^usage: " "$work/out" || fail "$name $flag: no usage on stdout"
  done
  rc=0
  timeout 30 "$@" --no-such-option >"$work/out" 2>"$work/err" </dev/null || rc=$?
  [ "$rc" -eq 2 ] || fail "$name --no-such-option: exit $rc, expected 2"
  grep -q "usage: " "$work/err" || fail "$name --no-such-option: no usage on stderr: $(head -3 "$work/err")"
  grep -q -- "--no-such-option" "$work/err" || fail "$name --no-such-option: the error does not name it"
}

check "zest" "$zest"
for sub in "config" "config check" "smoke" "estimate" "checkpoint" "checkpoint inspect" \
           "checkpoint consolidate" "bench"; do
  # shellcheck disable=SC2086 # the subcommand's words
  check "zest $sub" "$zest" $sub
done
for bench in adam io memory step; do
  if [ "${ZEST_BENCH:-built}" = absent ]; then
    # Configured with -Dbench=false: each benchmark refuses (exit 2), saying how to get it.
    rc=0
    timeout 30 "$zest" bench "$bench" --help >"$work/out" 2>"$work/err" </dev/null || rc=$?
    [ "$rc" -eq 2 ] || fail "zest bench $bench without benchmarks built: exit $rc, expected 2"
    grep -q -- "-Dbench=true" "$work/err" || fail "zest bench $bench without benchmarks built: no word of -Dbench=true"
  else
    check "zest bench $bench" "$zest" bench "$bench"
  fi
done
shift
for program in "$@"; do
  check "$(basename "$program")" "$program"
done

[ "$failures" -eq 0 ] || exit 1
echo "--help: every command answered; every unknown option refused with the usage"
