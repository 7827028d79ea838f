#!/usr/bin/env bash
# A real run to look at (bench/gpt_curves.py): examples/python/gpt.py on real text with torch DDP +
# AdamW and with zest at stages 1-3 and offloaded, 2 ranks, 800 steps; the loss curves in
# build/gpt-curves/gpt-curves.svg. Makes the pinned PyTorch environment (once per machine) and
# the Python package (into the build directory, sharing the python_package test's build) first. About 10 minutes on 2 cores.
# `--states`: torch DDP and zest stage 2 with Adam's m and v in fp32, bf16 and int8 instead (issue 24),
# each held to the fp32 states' final loss; the chart in build/gpt-curves/compact-states-curves.svg.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
zest_python_env
site="$ZEST_BUILD/python-site"
"$ZEST_VENV/bin/python" -m pip install --quiet --no-build-isolation --no-deps --no-index --target "$site" \
  --upgrade --config-settings=build-dir="$ZEST_BUILD/tests/python/python-build" "$ZEST_ROOT"
PYTHONPATH="$site" exec "$ZEST_VENV/bin/python" "$ZEST_ROOT/bench/gpt_curves.py" "$ZEST_BUILD/gpt-curves" "$@"
