#!/usr/bin/env bash
# Installs, builds and runs every test: the release build, then the same tests under
# AddressSanitizer + UndefinedBehaviorSanitizer (skip that with --no-sanitize).
# Ends with one line "N passed, N failed, N skipped"; exits non-zero when any test failed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

sanitize=1
[ "${1:-}" = "--no-sanitize" ] && sanitize=0

builds=("$ZEST_BUILD")
configure_build "$ZEST_BUILD"
if ((sanitize)); then
  builds+=("$ZEST_BUILD-sanitize")
  configure_build "$ZEST_BUILD-sanitize" -Dbuildtype=debugoptimized -Db_sanitize=address,undefined \
    -Db_lundef=false
fi

passed=0 failed=0 skipped=0 status=0
for dir in "${builds[@]}"; do
  echo "== meson test in $dir"
  meson test -C "$dir" --print-errorlogs --num-processes 2 || status=1
  # Meson's own summary: "Ok: N", "Fail: N", "Skipped: N", "Timeout: N", "Unexpected Pass: N".
  log="$dir/meson-logs/testlog.txt"
  count() { awk -v key="$1" -F: '$1 == key { gsub(/ /, "", $2); n = $2 } END { print n + 0 }' "$log"; }
  passed=$((passed + $(count "Ok") + $(count "Expected Fail")))
  failed=$((failed + $(count "Fail") + $(count "Timeout") + $(count "Unexpected Pass")))
  skipped=$((skipped + $(count "Skipped")))
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ "$status" -eq 0 ]
