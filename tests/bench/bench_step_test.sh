#!/usr/bin/env bash
# `zest bench step` on a small model: the offloaded step runs with its states in a swap file in a
# fresh directory, the JSON carries the promised fields with sane values (steps timed, the states
# on disk at 12 bytes per parameter, a disk-bound limit from measured bandwidths, resident memory
# read, the backward stand-in timed with the --bucket given), a bad argument is refused with exit 2,
# and the swap file is gone afterwards; --optimizer-on-device runs without a disk, with the
# --allgather given.
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
if ls "$work"/*.swap > /dev/null 2>&1; then echo "FAIL: a swap file was left behind"; ls -l "$work"; exit 1; fi
# The states on the device: no path, no disk, the --allgather given.
"$zest" bench step --optimizer-on-device --params 2e5 --steps 2 --allgather 1 --json > "$work/device.json"
python3 - "$work/device.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
problems = []
if r["optimizer_on_device"] is not True: problems.append(f"optimizer_on_device {r['optimizer_on_device']}")
if r["nvme_bytes"] != 0: problems.append(f"nvme_bytes {r['nvme_bytes']} with the states on the device")
if r["allgather_bucket_bytes"] != 1: problems.append(f"allgather_bucket_bytes {r['allgather_bucket_bytes']} for --allgather 1")
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
