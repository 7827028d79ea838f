#!/usr/bin/env bash
# `zest bench memory` on 4 ranks: every stage trains, the records carry the promised fields, the
# sharded stages use less memory than DDP in the order the ZeRO formulas say, each within 5% of its
# formula, with the same loss as DDP; the chart is an SVG.
# usage: bench_memory_test.sh ZEST MPIRUN
set -euo pipefail
zest=$1 mpirun=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$mpirun" --oversubscribe --bind-to none -np 4 "$zest" bench memory --params 1e6 --steps 3 \
  --device-memory 64MiB --json "$work/m.json" --csv "$work/m.csv" --chart "$work/m.svg" > "$work/out.txt"
grep -q "largest model that trains within 64 MiB" "$work/out.txt" || { echo "FAIL: no fit table"; cat "$work/out.txt"; exit 1; }
grep -q "^<svg" "$work/m.svg" || { echo "FAIL: the chart is not an SVG"; exit 1; }
[ "$(wc -l < "$work/m.csv")" -eq 5 ] || { echo "FAIL: the CSV does not hold 4 records"; exit 1; }
python3 - "$work/m.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
records = {r["stage"]: r for r in data["records"]}
keys = ["stage", "offload_optimizer", "offload_param", "ranks", "params", "peak_device_bytes",
        "peak_host_pinned_bytes", "nvme_bytes", "ratio_to_ddp", "formula_bytes",
        "step_time_ratio_to_ddp", "loss_matches_ddp"]
problems = []
for stage, r in records.items():
    problems += [f"stage {stage}: no {k}" for k in keys if k not in r]
    if r["ranks"] != 4: problems.append(f"stage {stage}: ranks {r['ranks']}")
    if abs(r["formula_deviation"]) > 0.05: problems.append(f"stage {stage}: {r['formula_deviation']:+.3f} off the formula")
    if not r["loss_matches_ddp"]: problems.append(f"stage {stage}: loss differs from DDP")
ratios = [records[s]["ratio_to_ddp"] for s in range(4)]
if not (ratios[0] == 1 and ratios[0] > ratios[1] > ratios[2] > ratios[3]):
    problems.append(f"ratios to DDP not decreasing with the stage: {ratios}")
fits = [f["params"] for f in data["largest_model_that_fits"]]
if len(fits) != 4 or not fits[3] > fits[0]:
    problems.append(f"stage 3 does not fit a larger model than DDP: {fits}")
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
print(f"bench memory: ratios to DDP {[round(x, 3) for x in ratios]}, largest models {fits}")
PY
