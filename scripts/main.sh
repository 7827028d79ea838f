#!/usr/bin/env bash
# The main job: installs, builds, and runs the memory benchmark on 4 local ranks of the CPU
# backend: ZeRO stages 0-3 on a real model, memory per rank against plain DDP, and the largest
# model each stage trains within a device budget; beside zest's rows, what a user would run
# instead on the same model, batches and ranks (torch DDP, FSDP2: bench/memory_peers.py, in the
# pinned PyTorch environment scripts/python-env.sh makes once per machine). Outputs land in
# build/bench-memory/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
zest_python_env

configure_build "$ZEST_BUILD"
out="$ZEST_BUILD/bench-memory"
mkdir -p "$out"
# The peers' inputs and results are this run's: a fresh directory each time.
peers=$(mktemp -d "$out/peers.XXXXXX")
trap 'rm -rf "$peers"' EXIT
"$ZEST_BUILD/src/cli/zest" bench memory --write-peer-inputs "$peers"
MASTER_PORT=$("$ZEST_VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mpirun --oversubscribe --bind-to none -np 4 -x MASTER_PORT="$MASTER_PORT" \
  "$ZEST_VENV/bin/python" "$ZEST_ROOT/bench/memory_peers.py" "$peers" --json "$peers/peers.json"
mpirun --oversubscribe --bind-to none -np 4 "$ZEST_BUILD/src/cli/zest" bench memory --peers "$peers/peers.json" \
  --json "$out/memory.json" --csv "$out/memory.csv" --chart "$out/memory.svg"
