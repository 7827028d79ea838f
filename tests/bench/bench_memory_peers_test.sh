#!/usr/bin/env bash
# The memory benchmark's peers (bench/memory_peers.py) beside zest's rows, as the main job runs
# them: every peer row is present, in the table, JSON, CSV and chart; a row that ran has its
# categories counted from its tensors consistently (DDP: 4 bytes per parameter of fp32 parameters
# and of gradients, 8 of AdamW states; FSDP2: a quarter of those on 4 ranks, plus what a running
# block holds unsharded) and the same loss as torch DDP, as has every zest row; a row that did
# not run says why and carries no figures; peers of another model are refused. Not their timings.
# usage: bench_memory_peers_test.sh ZEST MPIRUN PYTHON SOURCE_ROOT
set -euo pipefail
zest=$1 mpirun=$2 python=$3 src=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

size=(--params 200000 --steps 3)
mkdir "$work/inputs"
"$zest" bench memory --write-peer-inputs "$work/inputs" "${size[@]}" > /dev/null
export MASTER_PORT
MASTER_PORT=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$mpirun" --oversubscribe --bind-to none -np 4 -x MASTER_PORT "$python" "$src/bench/memory_peers.py" \
  "$work/inputs" --json "$work/peers.json" > "$work/peers.out" 2>&1 || { cat "$work/peers.out"; exit 1; }
"$mpirun" --oversubscribe --bind-to none -np 4 "$zest" bench memory "${size[@]}" --no-fit --peers "$work/peers.json" \
  --json "$work/m.json" --csv "$work/m.csv" --chart "$work/m.svg" > "$work/out.txt" 2>&1 || { cat "$work/out.txt"; exit 1; }

"$python" - "$work" <<'PY'
import csv, json, sys
work = sys.argv[1]
records = {r["name"]: r for r in json.load(open(f"{work}/m.json"))["records"]}
peers = ["torch DDP + AdamW", "FSDP2 fully_shard + AdamW", "FSDP2 + CPUOffloadPolicy + AdamW",
         "FSDP2 + CPUOffloadPolicy(pin_memory=False)"]
problems = [f"no row '{name}'" for name in peers if name not in records]
table = open(f"{work}/out.txt").read()
chart = open(f"{work}/m.svg").read()
csv_rows = {row["name"]: row for row in csv.DictReader(open(f"{work}/m.csv"))}
for name in peers:
    if name not in records:
        continue
    r = records[name]
    if r["system"] != "torch": problems.append(f"{name}: system {r['system']}")
    if name not in table or name not in chart or name not in csv_rows:
        problems.append(f"{name}: missing from the table, the chart or the CSV")
    if r["error"]:
        if r["peak_device_bytes"] or r["final_loss"]: problems.append(f"{name}: failed ({r['error']}) yet has figures")
        if "could not run: " + r["error"] not in table: problems.append(f"{name}: the table does not say why it failed")
        continue
    n, p, g, o = r["params"], r["peak_params_bytes"], r["peak_grads_bytes"], r["peak_optimizer_states_bytes"]
    if r["peak_device_bytes"] != p + g + o: problems.append(f"{name}: total {r['peak_device_bytes']} != {p}+{g}+{o}")
    if name.startswith("torch DDP"):
        if p != 4 * n or g != 4 * n: problems.append(f"{name}: params {p} / grads {g} bytes, expected {4 * n} each")
        if not 8 * n <= o <= 8 * n + 8 * 64: problems.append(f"{name}: AdamW states {o} bytes, expected 8 x {n} (+ step counters)")
    else:  # a quarter of each on 4 ranks (shards padded); parameters and gradients also hold what the
        # running blocks have unsharded (a block is under a quarter of this model)
        if not n <= p < 2 * n: problems.append(f"{name}: params {p} bytes, expected a shard of {4 * n} plus running blocks")
        if not n <= g < 2 * n: problems.append(f"{name}: grads {g} bytes, expected a shard of {4 * n} plus a running block's")
        if not 2 * n <= o <= 2 * n + 8192: problems.append(f"{name}: AdamW states {o} bytes, expected a quarter of {8 * n}")
    if r["step_seconds"] <= 0 or r["peak_host_rss_bytes"] <= 0: problems.append(f"{name}: no step time or RSS")
for name, r in records.items():
    if not r["error"] and r["loss_matches_torch_ddp"] is not True:
        problems.append(f"{name}: loss {r['final_loss']} differs from torch DDP's ({r['loss_difference_to_torch_ddp']})")
if "loss = torch DDP" not in table: problems.append("the table has no 'loss = torch DDP' column")
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
print(f"{len(peers)} peer rows beside {len(records) - len(peers)} zest rows; every loss equals torch DDP's")
PY

# Peers of another model are refused, naming the mismatch.
rc=0
"$zest" bench memory --params 100000 --steps 3 --no-fit --peers "$work/peers.json" --json "$work/x.json" \
  --csv "$work/x.csv" --chart "$work/x.svg" > "$work/refused.txt" 2>&1 || rc=$?
[ "$rc" -eq 1 ] && grep -q "with the same --params and ranks" "$work/refused.txt" ||
  { echo "FAIL: peers of another model: exit $rc"; cat "$work/refused.txt"; exit 1; }
echo "bench memory peers: all checks passed"
