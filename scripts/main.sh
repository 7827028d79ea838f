#!/usr/bin/env bash
# The main job: installs, builds, and runs the memory benchmark on 4 local ranks of the CPU
# backend: ZeRO stages 0-3 on a real model, memory per rank against plain DDP, and the largest
# model each stage trains within a device budget. Outputs land in build/bench-memory/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

configure_build "$ZEST_BUILD"
out="$ZEST_BUILD/bench-memory"
mkdir -p "$out"
mpirun --oversubscribe --bind-to none -np 4 "$ZEST_BUILD/src/cli/zest" bench memory \
  --json "$out/memory.json" --csv "$out/memory.csv" --chart "$out/memory.svg"
