#!/usr/bin/env bash
# The main job: installs, builds, and runs zest on 4 local ranks of the CPU backend.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

configure_build "$ZEST_BUILD"
mpirun --oversubscribe --bind-to none -np 4 \
  "$ZEST_BUILD/src/cli/zest" smoke --config "$ZEST_ROOT/configs/smoke.yaml"
