#!/usr/bin/env bash
# A test this build cannot run: says why, and exits 77, which meson counts as skipped.
echo "SKIP: $*"
exit 77
