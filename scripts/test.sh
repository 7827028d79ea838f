#!/usr/bin/env bash
# Installs, builds and runs every test: the release build, then the same tests under
# AddressSanitizer + UndefinedBehaviorSanitizer (skip that with --no-sanitize).
# --tsan adds a ThreadSanitizer build ($ZEST_BUILD-tsan) running the 'tsan' suite: the streams,
# the MPI communicator and its watchdog, the CPU Adam, the offload stores and the engine on 1 and
# 2 ranks (tests/tsan.supp explains the few third-party frames it suppresses).
# Ends with one line "N passed, N failed, N skipped"; exits non-zero when any test failed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

sanitize=1 tsan=0
for arg in "$@"; do
  case "$arg" in
    --no-sanitize) sanitize=0 ;;
    --tsan) tsan=1 ;;
    *) echo "usage: $0 [--no-sanitize] [--tsan]" >&2; exit 2 ;;
  esac
done

# builds[i] runs the meson test arguments in suites[i].
builds=("$ZEST_BUILD") suites=("")
configure_build "$ZEST_BUILD"
if ((sanitize)); then
  builds+=("$ZEST_BUILD-sanitize") suites+=("")
  configure_build "$ZEST_BUILD-sanitize" -Dbuildtype=debugoptimized -Db_sanitize=address,undefined \
    -Db_lundef=false
fi
if ((tsan)); then
  builds+=("$ZEST_BUILD-tsan") suites+=("--suite tsan")
  configure_build "$ZEST_BUILD-tsan" -Dbuildtype=debugoptimized -Db_sanitize=thread -Db_lundef=false
fi

passed=0 failed=0 skipped=0 status=0
for i in "${!builds[@]}"; do
  dir=${builds[$i]}
  echo "== meson test ${suites[$i]} in $dir"
  # shellcheck disable=SC2086 # suites[i] is a list of words
  meson test -C "$dir" ${suites[$i]} --print-errorlogs --num-processes 2 || status=1
  # Meson's own summary: "Ok: N", "Fail: N", "Skipped: N", "Timeout: N", "Unexpected Pass: N".
  log="$dir/meson-logs/testlog.txt"
  count() { awk -v key="$1" -F: '$1 == key { gsub(/ /, "", $2); n = $2 } END { print n + 0 }' "$log"; }
  passed=$((passed + $(count "Ok") + $(count "Expected Fail")))
  failed=$((failed + $(count "Fail") + $(count "Timeout") + $(count "Unexpected Pass")))
  skipped=$((skipped + $(count "Skipped")))
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ "$status" -eq 0 ]
