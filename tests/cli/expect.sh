# Shared by the CLI test scripts: run the command under test and check what it did. The sourcing
# script sets $zest (the binary) and $work (a scratch directory), and reports $failures at the end.
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# Runs zest with the given arguments; sets $rc, and leaves stdout/stderr in $work/out, $work/err.
run() {
  rc=0
  "$zest" "$@" >"$work/out" 2>"$work/err" || rc=$?
}

expect_rc() {
  [ "$rc" -eq "$1" ] || fail "$2: exit code $rc, expected $1; stderr: $(cat "$work/err")"
}

# expect_line FILE TEXT WHAT: FILE holds a line equal to TEXT.
expect_line() {
  grep -qxF -- "$2" "$1" || fail "$3: no line '$2' in $(basename "$1"):
$(cat "$1")"
}

# expect_text FILE TEXT WHAT: FILE contains TEXT somewhere.
expect_text() {
  grep -qF -- "$2" "$1" || fail "$3: '$2' not in $(basename "$1"):
$(cat "$1")"
}
