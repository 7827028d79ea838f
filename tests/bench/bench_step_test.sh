#!/usr/bin/env bash
# `zest bench step` on a small model: the offloaded step runs with its states in a swap file in a
# fresh directory, the JSON carries the promised fields with sane values (steps timed, the states
# on disk at 12 bytes per parameter, a disk-bound limit from measured bandwidths, resident memory
# read, the backward stand-in timed with the --bucket given), a bad argument is refused with exit 2,
# and the swap file is gone afterwards; --optimizer-on-device runs without a disk, with the
# --allgather given. --update-ahead runs its two engines (offload.optimizer.update_ahead false and
# true) on NVMe and in pinned host memory: each one's exposed step is timed --steps times, the ratio
# is of their medians, the parameters stay bit-identical, the swap directories are removed
# afterwards, and --optimizer-on-device or a swap directory that exists is refused. (The ratio is
# not held to its goal here.) --trace FILE holds both engines' timed steps and nothing from before
# them (the bandwidth test, the weights set); an existing FILE is refused before any work and left
# as it was.
# usage: bench_step_test.sh ZEST DIR   (DIR: where the temporary swap directory goes, e.g. the build dir)
set -euo pipefail
zest=$1
work=$(mktemp -d "$2/zest-bench-step-XXXXXX")
trap 'rm -rf "$work"' EXIT

"$zest" bench step --path "$work" --params 2e6 --steps 2 --io-size 0.125 --reps 1 --bucket 1MiB --json > "$work/out.json"
python3 - "$work/out.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ["params", "step_seconds", "step_samples", "disk_bound_seconds", "ratio", "nvme_bytes",
        "bytes_read_per_step", "bytes_written_per_step", "write_bytes_per_s", "read_bytes_per_s",
        "peak_rss_bytes", "rss_bytes", "offload_pinned_bytes", "reduce_bucket_bytes", "backward_seconds",
        "backward_plus_step_seconds"]
problems = [f"no {k}" for k in keys if k not in r]
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
if r["params"] != 2000000: problems.append(f"params {r['params']}")
if len(r["step_samples"]) != 2 or not all(s > 0 for s in r["step_samples"]):
    problems.append(f"step samples {r['step_samples']}")
# master, m and v in fp32 for every parameter (and a little padding) live in the swap file.
if not 12 * r["params"] <= r["nvme_bytes"] < 13 * r["params"]:
    problems.append(f"nvme_bytes {r['nvme_bytes']} for {r['params']} params")
expected = r["bytes_read_per_step"] / r["read_bytes_per_s"] + r["bytes_written_per_step"] / r["write_bytes_per_s"]
if not r["disk_bound_seconds"] > 0 or abs(r["disk_bound_seconds"] - expected) > 1e-3 * expected + 1e-4:
    problems.append(f"disk_bound_seconds {r['disk_bound_seconds']}, bytes over bandwidths give {expected}")
if abs(r["ratio"] - r["disk_bound_seconds"] / r["step_seconds"]) > 0.01 * r["ratio"] + 1e-3:
    problems.append(f"ratio {r['ratio']} is not disk_bound_seconds / step_seconds")
if not r["peak_rss_bytes"] >= r["rss_bytes"] > 0: problems.append(f"rss {r['rss_bytes']} peak {r['peak_rss_bytes']}")
if not r["offload_pinned_bytes"] > 0: problems.append("no pinned slots for the offloaded states")
if r["reduce_bucket_bytes"] != 1 << 20: problems.append(f"reduce_bucket_bytes {r['reduce_bucket_bytes']} for --bucket 1MiB")
if not r["backward_plus_step_seconds"] > r["backward_seconds"] > 0:
    problems.append(f"backward {r['backward_seconds']} s, with step() {r['backward_plus_step_seconds']} s")
if not r["grad_norm"] > 0: problems.append(f"grad_norm {r['grad_norm']}: the gradients did not arrive")
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
print(f"bench step: {r['step_seconds']:.4f} s per step, ratio {r['ratio']:.2f} to the disk-bound limit")
PY
if ls -d "$work"/zest-* > /dev/null 2>&1; then echo "FAIL: a swap directory was left behind"; ls -lR "$work"; exit 1; fi
# --states: one engine per format after one bandwidth test, each its own JSON object; the swap file
# holds the format's bytes (24, 16 and about 12.3 per parameter moved per step), and each reports
# its speed-up over the first. A format named twice or unknown is refused.
"$zest" bench step --path "$work" --params 2e6 --steps 2 --io-size 0.125 --reps 1 --states fp32,bf16,int8 --json \
  > "$work/states.json"
python3 - "$work/states.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
decoder, runs, at = json.JSONDecoder(), [], 0
while at < len(text.rstrip()):
    r, at = decoder.raw_decode(text, at)
    runs.append(r)
    while at < len(text) and text[at].isspace(): at += 1
problems = []
if [r["states"] for r in runs] != ["fp32", "bf16", "int8"]: problems.append(f"states {[r['states'] for r in runs]}")
for r, per in zip(runs, [24.0, 16.0, 12.25]):
    got = r["disk_bytes_per_param_per_step"]
    if not per <= got < per * 1.02: problems.append(f"{r['states']}: {got} disk bytes per parameter per step, expected {per}")
    if r["write_bytes_per_s"] != runs[0]["write_bytes_per_s"]: problems.append("the bandwidth was measured again")
    if abs(r["speedup_over_fp32"] - runs[0]["step_seconds"] / r["step_seconds"]) > 0.01 * r["speedup_over_fp32"] + 1e-3:
        problems.append(f"{r['states']}: speedup {r['speedup_over_fp32']}")
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
PY
for bad in fp32,fp32 fp8; do
  if "$zest" bench step --path "$work" --states "$bad" > "$work/bad.txt" 2>&1; then echo "FAIL: --states $bad accepted"; exit 1; fi
  grep -q -- "--states" "$work/bad.txt" || { echo "FAIL: --states $bad refused without naming it"; cat "$work/bad.txt"; exit 1; }
done
# The states on the device: no path, no disk, the --allgather given.
"$zest" bench step --optimizer-on-device --params 2e5 --steps 2 --allgather 4 --json > "$work/device.json"
python3 - "$work/device.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
problems = []
if r["optimizer_on_device"] is not True: problems.append(f"optimizer_on_device {r['optimizer_on_device']}")
if r["nvme_bytes"] != 0: problems.append(f"nvme_bytes {r['nvme_bytes']} with the states on the device")
if r["allgather_bucket_bytes"] != 4: problems.append(f"allgather_bucket_bytes {r['allgather_bucket_bytes']} for --allgather 4")
if not r["step_seconds"] > 0 or not r["grad_norm"] > 0: problems.append(f"step {r['step_seconds']} s, grad_norm {r['grad_norm']}")
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
print(f"bench step on the device: {r['step_seconds']:.4f} s per step")
PY
set +e
"$zest" bench step --path "$work" --params many > "$work/bad.txt" 2>&1
rc=$?
set -e
[ "$rc" -eq 2 ] || { echo "FAIL: --params many exited $rc, expected 2"; cat "$work/bad.txt"; exit 1; }
grep -q -- "--params: expected a whole count from 1 to 1000000000000" "$work/bad.txt" || { echo "FAIL: no usage message"; cat "$work/bad.txt"; exit 1; }

# --update-ahead: two engines, on NVMe (their swap directories made in $work, then removed) and in
# pinned host memory (--backward auto there: as long as today's warm-up step).
check_update_ahead() {  # check_update_ahead JSON nvme|host
  python3 - "$1" "$2" <<'PY'
import json, sys
r, where = json.load(open(sys.argv[1])), sys.argv[2]
keys = ["update_ahead", "backward_seconds", "exposed_seconds_today", "exposed_seconds_update_ahead",
        "exposed_samples_today", "exposed_samples_update_ahead", "exposed_ratio", "target_exposed_ratio",
        "identical", "nvme_bytes", "nvme_bytes_update_ahead", "offload_pinned_bytes", "offload_pinned_bytes_update_ahead"]
problems = [f"no {k}" for k in keys if k not in r]
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
if r["update_ahead"] is not True: problems.append(f"update_ahead {r['update_ahead']}")
if r["identical"] is not True: problems.append("the two engines ended with different parameters")
for name in ("today", "update_ahead"):
    samples = r["exposed_samples_" + name]
    if len(samples) != r["steps"] or not all(s > 0 for s in samples):
        problems.append(f"exposed samples {name} {samples} for {r['steps']} steps")
expected = r["exposed_seconds_update_ahead"] / r["exposed_seconds_today"]
if abs(r["exposed_ratio"] - expected) > 0.01 * expected + 1e-3:
    problems.append(f"exposed_ratio {r['exposed_ratio']}, the medians give {expected}")
if r["target_exposed_ratio"] != 0.25: problems.append(f"target_exposed_ratio {r['target_exposed_ratio']}")
if not r["offload_pinned_bytes_update_ahead"] > 0: problems.append("no pinned memory for the engine that updates ahead")
if where == "nvme":
    if r["backward_seconds"] != 0.05: problems.append(f"backward_seconds {r['backward_seconds']} for --backward 0.05")
    if not 12 * r["params"] <= r["nvme_bytes"] <= r["nvme_bytes_update_ahead"]:
        problems.append(f"nvme_bytes {r['nvme_bytes']}, updating ahead {r['nvme_bytes_update_ahead']}")
    if not r["disk_bound_seconds"] > 0: problems.append(f"disk_bound_seconds {r['disk_bound_seconds']}")
else:
    if r["optimizer_on_host"] is not True or r["nvme_bytes"] != 0 or r["nvme_bytes_update_ahead"] != 0:
        problems.append(f"optimizer_on_host {r['optimizer_on_host']}, nvme_bytes {r['nvme_bytes']}")
    if not r["backward_seconds"] > 0: problems.append(f"backward auto gave {r['backward_seconds']} s")
if problems:
    print("FAIL:\n  " + "\n  ".join(problems)); sys.exit(1)
print(f"bench step --update-ahead ({where}): exposed step {r['exposed_seconds_today']:.4f} s today, "
      f"{r['exposed_seconds_update_ahead']:.4f} s ahead, ratio {r['exposed_ratio']:.2f}")
PY
}
"$zest" bench step --path "$work" --update-ahead --params 2e6 --steps 2 --io-size 0.125 --reps 1 --backward 0.05 \
  --json --trace "$work/trace.json" > "$work/update_ahead.json"
check_update_ahead "$work/update_ahead.json" nvme
python3 - "$work/trace.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
count = lambda name: sum(1 for e in spans if e["name"] == name)
problems = []
# Warm-up and 2 timed steps of each engine: 6 steps, 6 backward stand-ins.
if count("step") != 6 or count("backward stand-in") != 6:
    problems.append(f"{count('step')} steps and {count('backward stand-in')} backward stand-ins, expected 6 each")
for name in ("gradient hand-off", "reduce", "update ahead", "commit updates ahead", "adam update", "nvme read", "nvme write"):
    if count(name) == 0: problems.append(f"no '{name}' span")
first = min(e["ts"] for e in spans if e["name"] == "backward stand-in")
early = [e for e in spans if e["ts"] < first]
if early: problems.append(f"{len(early)} spans from before the timed steps, e.g. {early[0]}")
if doc["otherData"]["dropped_events"] != 0: problems.append(f"dropped {doc['otherData']}")
if problems:
    print("FAIL: --trace:\n  " + "\n  ".join(problems)); sys.exit(1)
print(f"bench step --trace: {len(spans)} spans")
PY
cp "$work/trace.json" "$work/trace.copy"
set +e
"$zest" bench step --path "$work" --update-ahead --params 2e5 --io-size 0.01 --reps 1 --trace "$work/trace.json" \
  > "$work/exists.txt" 2>&1
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "FAIL: --trace to an existing file exited $rc, expected 1"; cat "$work/exists.txt"; exit 1; }
grep -q -- "--trace '$work/trace.json': the file exists" "$work/exists.txt" || { echo "FAIL: no message"; cat "$work/exists.txt"; exit 1; }
cmp -s "$work/trace.json" "$work/trace.copy" || { echo "FAIL: the existing trace was changed"; exit 1; }
for d in zest-bench-today zest-bench-update-ahead; do
  [ ! -e "$work/$d" ] || { echo "FAIL: $work/$d was left behind"; ls -lR "$work"; exit 1; }
done
"$zest" bench step --update-ahead --optimizer-on-host --params 2e6 --steps 2 --json > "$work/update_ahead-host.json"
check_update_ahead "$work/update_ahead-host.json" host
set +e
"$zest" bench step --update-ahead --optimizer-on-device --params 2e5 > "$work/bad.txt" 2>&1
rc=$?
set -e
[ "$rc" -eq 2 ] || { echo "FAIL: --update-ahead --optimizer-on-device exited $rc, expected 2"; cat "$work/bad.txt"; exit 1; }
grep -q -- "--update-ahead needs the whole optimizer offloaded" "$work/bad.txt" || { echo "FAIL: no usage message"; cat "$work/bad.txt"; exit 1; }
# A swap directory that exists is not the bench's: refused (exit 1) and left as it was.
mkdir "$work/zest-bench-update-ahead"
set +e
"$zest" bench step --path "$work" --update-ahead --params 2e5 --io-size 0.01 --reps 1 > "$work/exists.txt" 2>&1
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "FAIL: --update-ahead with zest-bench-update-ahead there exited $rc, expected 1"; cat "$work/exists.txt"; exit 1; }
grep -q "zest-bench-update-ahead exists" "$work/exists.txt" || { echo "FAIL: no message"; cat "$work/exists.txt"; exit 1; }
[ -d "$work/zest-bench-update-ahead" ] && [ ! -e "$work/zest-bench-today" ] || { echo "FAIL: directories after the refusal"; ls -l "$work"; exit 1; }
