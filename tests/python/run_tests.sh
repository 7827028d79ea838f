#!/usr/bin/env bash
# The Python package's tests, as meson's suite `python` runs them:
#   run_tests.sh SOURCE_ROOT BUILD_DIR PYTHON MPIRUN
# pip-installs the package from SOURCE_ROOT with PYTHON (--no-build-isolation: the environment
# already has torch and meson-python) into BUILD_DIR/python-site, keeping meson-python's build
# directory in BUILD_DIR/python-build so that a rerun rebuilds only what changed, then runs pytest
# under mpirun at 2, 4 and 1 ranks (-rs: each skipped case's reason, such as the cuda cases' where no
# GPU is visible or the world is larger than one). The three runs share one directory: each resumes the
# checkpoint the previous one saved (2 -> 2, 2 -> 4, 4 -> 1 ranks). Then the equality suite and
# test_launch.py under torchrun at 2, 4 and 1 ranks (zest over the default gloo group), and gpt.py
# under torchrun and mpirun with the same losses bit for bit; README's example (examples/python/gpt.py,
# smaller and shorter) saves at 2 ranks and resumes at 1; last, zest.lightning's checks.
set -euo pipefail
src=$1 build=$2 python=$3 mpirun=$4

site=$build/python-site
rm -rf "$site"
# Without a GPU the package leaves CUDA out: its cuda cases skip there, and the build with CUDA
# compiles the same kernels and adapter sources the release build has compiled (~60 CPU seconds).
setup_args=()
if ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  setup_args=(--config-settings=setup-args=-Dcuda=disabled)
fi
"$python" -m pip install --quiet --no-build-isolation --no-deps --no-index --target "$site" \
  --config-settings=build-dir="$build/python-build" "${setup_args[@]}" "$src"

shared=$(mktemp -d "${TMPDIR:-/tmp}/zest-python-test.XXXXXX")
trap 'rm -rf "$shared"' EXIT
export PYTHONPATH=$site ZEST_TEST_SHARED=$shared
previous=
for np in 2 4 1; do
  export MASTER_PORT
  MASTER_PORT=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  export ZEST_TEST_RESUME_FROM=${previous:-$np}
  echo "== $np ranks (resuming the checkpoint of $ZEST_TEST_RESUME_FROM ranks)"
  # Each rank writes its own report; rank 0's goes to the test's output, the others' only on failure.
  "$mpirun" --oversubscribe --bind-to none -np "$np" \
    -x PYTHONPATH -x ZEST_TEST_SHARED -x MASTER_PORT -x ZEST_TEST_RESUME_FROM \
    sh -c 'cd "$0" && exec "$1" -m pytest -q -rs -p no:cacheprovider --color=no -o console_output_style=classic \
             > "$2/pytest-np$3-rank$OMPI_COMM_WORLD_RANK.log" 2>&1' \
    "$src/tests/python" "$python" "$shared" "$np" || {
      for log in "$shared"/pytest-np"$np"-rank*.log; do echo "--- $log"; cat "$log"; done
      exit 1
    }
  cat "$shared/pytest-np$np-rank0.log"
  previous=$np
done

# The equality suite, compact states and the choice of ranks under torchrun: zest takes the ranks
# of the default gloo group conftest makes (torchrun's env://). The checkpoints chain on: the first
# torchrun run (2 ranks) resumes the one mpirun's last run saved (1 rank), and so on (2 -> 4 -> 1).
torchrun=$(dirname "$python")/torchrun
for np in 2 4 1; do
  echo "== torchrun, $np ranks (resuming the checkpoint of $previous ranks)"
  rdzv=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  (cd "$src/tests/python" && ZEST_TEST_RESUME_FROM=$previous timeout 600 "$torchrun" --nproc_per_node "$np" \
     --master_addr 127.0.0.1 --master_port "$rdzv" --log-dir "$shared/torchrun-np$np" --redirects 3 \
     -m pytest -q -rs -p no:cacheprovider --color=no -o console_output_style=classic \
     test_equivalence.py test_compact_states.py test_launch.py) || {
      find "$shared/torchrun-np$np" -name '*.log' -exec sh -c 'echo "--- $1"; cat "$1"' _ {} \;
      exit 1
    }
  cat "$(find "$shared/torchrun-np$np" -path '*/0/stdout.log' | head -1)"
  previous=$np
done

echo "== examples/python/gpt.py under torchrun and under mpirun, 2 ranks: the same losses, bit for bit"
MASTER_PORT=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
timeout 300 "$torchrun" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$MASTER_PORT" \
  "$src/examples/python/gpt.py" --context 32 --embed 32 --layers 2 --global-batch 8 --steps 10 \
  --loss-log "$shared/gpt-torchrun.jsonl" > /dev/null
"$mpirun" --oversubscribe --bind-to none -np 2 -x PYTHONPATH "$python" "$src/examples/python/gpt.py" \
  --context 32 --embed 32 --layers 2 --global-batch 8 --steps 10 --log "$shared/gpt-mpirun.jsonl" > /dev/null
"$python" - "$shared" <<'PY'
import json, sys
losses = {name: [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/gpt-{name}.jsonl") if '"loss"' in l]
          for name in ("torchrun", "mpirun")}
assert len(losses["torchrun"]) == 10 and losses["torchrun"] == losses["mpirun"], losses
print("torchrun and mpirun: the same 10 losses, bit for bit")
PY

echo "== examples/python/gpt.py: 2 ranks, stage 3, saved; resumed on 1 rank at stage 1"
gpt=("$python" "$src/examples/python/gpt.py" --context 32 --embed 32 --layers 2 --global-batch 8)
"$mpirun" --oversubscribe --bind-to none -np 2 -x PYTHONPATH "${gpt[@]}" --steps 20 --save "$shared/gpt-ckpt"
"$mpirun" --oversubscribe --bind-to none -np 1 -x PYTHONPATH "${gpt[@]}" --steps 30 --stage 1 --load "$shared/gpt-ckpt" \
  --json "$shared/gpt-resumed.json" | tee "$shared/gpt-resumed.log"
grep -q "steps 20..30" "$shared/gpt-resumed.log"
grep -q "^validation loss" "$shared/gpt-resumed.log"
grep -q "^tokens/s per rank" "$shared/gpt-resumed.log"
"$python" - "$shared/gpt-resumed.json" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))
assert run["steps"] == 10 and run["median_tokens_per_second_per_rank"] > 0, run
assert run["device"] == "cpu" and run["max_memory_allocated_bytes"] is None and run["stage"] == 1, run
PY

echo "== examples/python/gpt.py: torch DDP + AdamW and zest stage 3 (optimizer on cpu), 2 ranks, same losses"
# bench/gpt_curves.py's claim, in small: the two curves coincide within fp32 noise.
for run in "adamw-ddp --optimizer adamw-ddp" "zest --stage 3 --offload cpu"; do
  set -- $run
  name=$1; shift
  MASTER_PORT=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$mpirun" --oversubscribe --bind-to none -np 2 -x PYTHONPATH -x MASTER_PORT "${gpt[@]}" --steps 20 \
    --log "$shared/gpt-$name.jsonl" "$@" > /dev/null
done
"$python" - "$shared" <<'PY'
import json, sys
runs = {name: [json.loads(l) for l in open(f"{sys.argv[1]}/gpt-{name}.jsonl")] for name in ("adamw-ddp", "zest")}
losses = {name: [l["loss"] for l in lines if "loss" in l] for name, lines in runs.items()}
summary = runs["zest"][-1]
assert len(losses["zest"]) == len(losses["adamw-ddp"]) == 20, {k: len(v) for k, v in losses.items()}
worst = max(abs(a - b) for a, b in zip(losses["zest"], losses["adamw-ddp"]))
assert worst <= 1e-4, f"zest's loss curve leaves torch DDP + AdamW's by {worst}"
assert losses["zest"][-1] < losses["zest"][0] - 0.5, "the example did not learn"
assert summary["tokens_per_second_per_rank"] > 0 and summary["peak_rss_bytes"] > 0 and summary["ranks"] == 2, summary
print(f"the loss curves agree within {worst:.1e} over 20 steps")
PY

echo "== zest.lightning: every zest strategy against strategy=\"ddp\" + AdamW at 2 devices; a checkpoint resumed on 1"
# Lightning starts its ranks itself (checks.py launches tests/python/lightning/train.py), so these
# checks run outside mpirun and torchrun, without the launchers' variables, and without the suite's
# conftest (--confcutdir), whose process group is the launchers'.
(unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK ZEST_TEST_RESUME_FROM
 timeout 600 "$python" -m pytest -q -rs -p no:cacheprovider --color=no -o console_output_style=classic \
   --confcutdir "$src/tests/python/lightning" --basetemp "$shared/lightning" "$src/tests/python/lightning/checks.py")
