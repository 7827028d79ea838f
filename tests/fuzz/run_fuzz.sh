#!/bin/sh
# Runs one libFuzzer target for a bounded time: the committed seed corpus first (every input that
# ever crashed a target is kept there, so it is a regression test), then mutations of it.
# New inputs go to a scratch corpus in the build directory, never into the committed seeds; a
# crash writes its input there too (crash-*, leak-*, timeout-*, oom-*) and fails the test: libFuzzer's
# own error exit status is 77, which Meson reads as "skipped", hence -error_exitcode=1.
# usage: run_fuzz.sh TARGET SEEDS WORK SECONDS
set -eu
target=$1 seeds=$2 work=$3 seconds=$4  # -Dfuzz_seconds, which also sets the test's timeout
mkdir -p "$work/corpus"
exec "$target" -error_exitcode=1 -timeout_exitcode=1 -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 -max_len=4096 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$seeds"
