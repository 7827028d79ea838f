#!/usr/bin/env bash
# The Python package's tests, as meson's suite `python` runs them:
#   run_tests.sh SOURCE_ROOT BUILD_DIR PYTHON MPIRUN
# pip-installs the package from SOURCE_ROOT with PYTHON (--no-build-isolation: the environment
# already has torch and meson-python) into BUILD_DIR/python-site, keeping meson-python's build
# directory in BUILD_DIR/python-build so that a rerun rebuilds only what changed, then runs pytest
# under mpirun at 2, 4 and 1 ranks (-rs: each skipped case's reason, such as the cuda cases' where no
# GPU is visible or the world is larger than one). The three runs share one directory: each resumes the
# checkpoint the previous one saved (2 -> 2, 2 -> 4, 4 -> 1 ranks). Last, README's example
# (examples/python/gpt.py, smaller and shorter) saves at 2 ranks and resumes at 1.
set -euo pipefail
src=$1 build=$2 python=$3 mpirun=$4

site=$build/python-site
rm -rf "$site"
"$python" -m pip install --quiet --no-build-isolation --no-deps --no-index --target "$site" \
  --config-settings=build-dir="$build/python-build" "$src"

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
