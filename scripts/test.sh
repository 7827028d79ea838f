#!/usr/bin/env bash
# Installs, builds and runs every test: the release build, then the same tests under
# AddressSanitizer + UndefinedBehaviorSanitizer but for the libtorch adapter, CUDA, the benchmarks
# and the simulated hosts (--sanitize-all: those too; --no-sanitize: none), then each libFuzzer
# target for a bounded time (tests/fuzz, a clang build).
# --tsan adds a ThreadSanitizer build ($ZEST_BUILD-tsan) running the 'tsan' suite: the streams,
# the MPI communicator and its watchdog, the CPU Adam, the offload stores and the engine on 1 and
# 2 ranks (tests/tsan.supp explains the few third-party frames it suppresses).
# Ends with what was skipped and why (scripts/skip_reasons.py), then one line "N passed, N failed,
# N skipped" (meson's tests) with the number of GoogleTest cases skipped inside passing tests
# and pytest cases (listed above it, by reason); exits non-zero
# when any test failed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

sanitize=1 sanitize_all=0 tsan=0
for arg in "$@"; do
  case "$arg" in
    --no-sanitize) sanitize=0 ;;
    --sanitize-all) sanitize_all=1 ;;
    --tsan) tsan=1 ;;
    *) echo "usage: $0 [--no-sanitize] [--sanitize-all] [--tsan]" >&2; exit 2 ;;
  esac
done

passed=0 failed=0 skipped=0 skipped_cases=0 status=0 skip_report=""
# run_tests DIR [meson test options...]: runs DIR's tests and adds them to the counts.
run_tests() {
  local dir=$1
  shift
  # The time so far, so that CI's log shows where its minutes go (it is kept under ~45).
  echo "== meson test in $dir $* (${SECONDS}s after the start)"
  meson test -C "$dir" --print-errorlogs --num-processes 2 "$@" || status=1
  # Meson's own summary: "Ok: N", "Fail: N", "Skipped: N", "Timeout: N", "Unexpected Pass: N".
  log="$dir/meson-logs/testlog.txt"
  count() { awk -v key="$1" -F: '$1 == key { gsub(/ /, "", $2); n = $2 } END { print n + 0 }' "$log"; }
  passed=$((passed + $(count "Ok") + $(count "Expected Fail")))
  failed=$((failed + $(count "Fail") + $(count "Timeout") + $(count "Unexpected Pass")))
  skipped=$((skipped + $(count "Skipped")))
  skip_report+=$(python3 "$ZEST_ROOT/scripts/skip_reasons.py" "$dir/meson-logs/testlog.json")$'\n'
  skipped_cases=$((skipped_cases + $(python3 "$ZEST_ROOT/scripts/skip_reasons.py" --cases "$dir/meson-logs/testlog.json")))
}

# The tests build the libtorch adapter against the pinned torch (python/requirements.txt). The
# library as users build it (-O3), the test programs at -O1 (-Dtests_optimization): a test's
# translation unit compiles in two thirds of its -O3 time, and the tests' time runs in the library.
zest_python_env
configure_build "$ZEST_BUILD" -Dtorch_dir="$ZEST_TORCH_DIR" -Dtests_optimization=1
run_tests "$ZEST_BUILD"
if ((sanitize)); then
  # Without the libtorch adapter, and without the benchmarks and the simulated-host runs, whose code
  # the engine's tests cover: the release build runs those, and CI's time goes to what sanitizers
  # find (the adapter's translation units are the slowest to build under ASan, and the benchmarks
  # the slowest to run). scripts/test.sh --sanitize-all keeps them.
  # -O1 with line tables only (-g1: reports keep file:line): the build takes about half the CPU
  # time of -O2 -g, which was half of CI's time; AddressSanitizer's own advice is -O1. The test
  # programs at -O0 (-Dtests_optimization): they were two thirds of the build's CPU time and half
  # that at -O0, while the library, where the tests' time goes, keeps -O1 (all at -O0, the tests
  # ran twice as long and the build saved about as much).
  sanitize_options=(-Doptimization=1 -Dtests_optimization=0 -Ddebug=false -Dcpp_args=-g1
                    -Db_sanitize=address,undefined -Db_lundef=false)
  if ((sanitize_all)); then
    configure_build "$ZEST_BUILD-sanitize" "${sanitize_options[@]}" -Dtorch_dir="$ZEST_TORCH_DIR"
    run_tests "$ZEST_BUILD-sanitize"
  else
    # Without CUDA too: with no GPU its tests skip, so its sanitized objects (nvcc's kernels, the
    # CUDA device and its tests: ~270 of the build's ~3300 CPU seconds) bought nothing; the
    # release build still compiles every CUDA source, and the no-CUDA build is a configuration
    # users have.
    # Without the benchmarks' sources (-Dbench=false), whose suite this run skips: their JSON
    # documents (nlohmann-json) cost 15-65 CPU seconds per file under the sanitizers.
    ZEST_CUDA_OPTION=-Dcuda=disabled configure_build "$ZEST_BUILD-sanitize" "${sanitize_options[@]}" -Dtorch=disabled \
      -Dbench=false
    run_tests "$ZEST_BUILD-sanitize" --no-suite bench --no-suite multihost
  fi
fi
if ((tsan)); then
  configure_build "$ZEST_BUILD-tsan" -Dbuildtype=debugoptimized -Db_sanitize=thread -Db_lundef=false \
    -Dtorch_dir="$ZEST_TORCH_DIR"
  run_tests "$ZEST_BUILD-tsan" --suite tsan
fi

# The libFuzzer targets (tests/fuzz), each run for a bounded time (-Dfuzz_seconds, 30 s) from its
# seed corpus, in their own clang build with ASan+UBSan; only the targets are built there.
fuzz_build="$ZEST_BUILD-fuzz"
if [ ! -f "$fuzz_build/build.ninja" ]; then
  CXX=clang++-14 meson setup "$fuzz_build" "$ZEST_ROOT" -Dfuzz=true -Dtests=false -Dcuda=disabled \
    -Dbuildtype=debugoptimized -Db_sanitize=address,undefined -Db_lundef=false
fi
fuzz_targets=()
for source in "$ZEST_ROOT"/tests/fuzz/*_fuzz.cpp; do
  fuzz_targets+=("tests/fuzz/$(basename "$source" .cpp)")
done
ninja -C "$fuzz_build" "${fuzz_targets[@]}"
run_tests "$fuzz_build" --suite fuzz --no-rebuild
# What was skipped and why (a skipped test's reason; GoogleTest cases skipped inside tests that
# passed, by reason), then the closing line.
echo "== skipped, and why"
printf '%s' "$skip_report" | grep -v '^$' || echo "  nothing"
echo "== ${SECONDS}s in all"
echo "$passed passed, $failed failed, $skipped skipped; inside the tests that passed, $skipped_cases GoogleTest or pytest case(s) skipped (reasons above)"
[ "$failed" -eq 0 ] && [ "$status" -eq 0 ]
