"""`zest bench adam --peers` on a tiny size: DeepSpeed's CPU Adam and torch's AdamW get their rows
at every thread count, self-consistent (positive timings of the same parameter count; rates,
roofline ratios and zest's ratio to each agree with the medians), and each peer's parameters after
the bench's check (5 steps on the same inputs) equal zest's CPU Adam's within fp32 tolerance. A
Python without torch or DeepSpeed, or no Python named, fails saying how to make the environment;
with int8 states, a bf16 master and --ahead the rows and ratios stay consistent (bandwidth shares);
without --peers the output is as before. Timings are not judged here.

usage: bench_adam_peers_test.py ZEST PYTHON   (PYTHON: of scripts/python-env.sh's environment)
"""
import json
import os
import re
import subprocess
import sys
import tempfile

zest, python = sys.argv[1:]
PEERS = ["DeepSpeed CPU Adam", "torch AdamW (foreach)", "torch AdamW (fused)"]
PARAMS = 20000
problems = []


def run(*args, env=None):
    return subprocess.run([zest, "bench", "adam", *args], capture_output=True, text=True, timeout=240,
                          env=env)


def close(a, b, rel=2e-3):  # the figures are printed with 4 to 6 digits
    return abs(a - b) <= rel * max(abs(a), abs(b))


# --- JSON: one object per thread count, 1 and all
r = run("--peers", "--python", python, "--params", str(PARAMS), "--reps", "3", "--json")
if r.returncode != 0:
    sys.exit(f"FAIL: --peers --json exited {r.returncode}\n{r.stderr}")
rows = [json.loads(line) for line in r.stdout.splitlines()]
threads = [o["threads"] for o in rows]
if threads[0] != 1 or len(rows) != len(set(threads)) or not 1 <= len(rows) <= 2:
    problems.append(f"thread counts {threads}: expected 1 and all")
for o in rows:
    t = o["threads"]
    if o["params"] != PARAMS or o["median_s"] <= 0 or o["roofline_median_s"] <= 0:
        problems.append(f"{t} threads: zest's params {o['params']}, medians {o['median_s']}, {o['roofline_median_s']}")
    if not close(o["params_per_s"], PARAMS / o["median_s"]):
        problems.append(f"{t} threads: zest's rate {o['params_per_s']} is not params / median")
    if [p["name"] for p in o["peers"]] != PEERS:
        problems.append(f"{t} threads: peers {[p['name'] for p in o['peers']]}")
    for p in o["peers"]:
        name = f"{t} threads, {p['name']}"
        if "error" in p:
            # Only fused AdamW may be missing (a torch without it on CPU), and then it says why.
            if p["name"] != "torch AdamW (fused)" or not p["error"]:
                problems.append(f"{name}: not run: {p['error']!r}")
            continue
        if p["params"] != PARAMS or not p["median_s"] > 0 or not p["spread"] >= 0:
            problems.append(f"{name}: params {p['params']}, median {p['median_s']}, spread {p['spread']}")
            continue
        if not close(p["params_per_s"], PARAMS / p["median_s"]):
            problems.append(f"{name}: rate {p['params_per_s']} is not params / median {p['median_s']}")
        if not close(p["roofline_ratio"], p["params_per_s"] / o["roofline_params_per_s"], 5e-3):
            problems.append(f"{name}: roofline ratio {p['roofline_ratio']}")
        if not close(p["zest_ratio"], p["median_s"] / o["median_s"], 5e-3):
            problems.append(f"{name}: zest's ratio {p['zest_ratio']} is not its median over zest's")
        # The same update as zest's: 5 steps of AdamW (weight decay 0.01) on 40009 parameters.
        if not 0 <= p["check_max_abs_diff"] <= 4e-6:
            problems.append(f"{name}: parameters differ from zest's by {p['check_max_abs_diff']}")

# --- the table: the peers' rows beside zest's, with the same columns
r = run("--peers", "--python", python, "--params", str(PARAMS), "--reps", "1", "--threads", "1")
if r.returncode != 0:
    sys.exit(f"FAIL: --peers exited {r.returncode}\n{r.stderr}")
out = r.stdout
ours = re.search(r"^  ours +(\S+) params/s", out, re.M)
if not ours or f"{PARAMS} params, 1 thread(s)" not in out or out.count("cpu adam fp32") != 1:
    problems.append(f"table: no zest row at 1 thread:\n{out}")
for name in PEERS:
    m = re.search(r"^  " + re.escape(name) + r" +(\S+) params/s +(\S+) GB/s +(\S+) of roofline +"
                  r"spread (\S+)% +zest (\S+)x$", out, re.M)
    if m is None:
        if not (name == "torch AdamW (fused)" and re.search(r"^  torch AdamW \(fused\) +not run: \S", out, re.M)):
            problems.append(f"table: no row '{name}':\n{out}")
        continue
    pps, gbs, _, _, ratio = (float(x) for x in m.groups())
    # GB/s and zest's ratio are printed with 2 decimals, the rates with 4 digits.
    if not (pps > 0 and abs(gbs - pps * 28 / 1e9) <= 0.006 + 1e-3 * gbs and ours
            and abs(ratio - float(ours[1]) / pps) <= 0.006 + 1e-3 * ratio):
        problems.append(f"table: row '{name}' is inconsistent: {m[0]!r}")
if not re.search(r"^peers: torch:\S+ deepspeed:\S+; AdamW, weight decay 0.01;", out, re.M):
    problems.append(f"table: no peers line:\n{out}")

# --- without the environment: a clear failure naming the fix
with tempfile.TemporaryDirectory() as tmp:
    bare = os.path.join(tmp, "python3")  # a Python without site-packages: no torch, no deepspeed
    with open(bare, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -S -E \"$@\"\n")
    os.chmod(bare, 0o755)
    env = {k: v for k, v in os.environ.items() if k != "ZEST_VENV"}
    for args in (["--python", bare], ["--python", os.path.join(tmp, "none")], []):
        r = run("--peers", "--params", "1000", *args, env=env)
        if r.returncode != 1 or "scripts/python-env.sh" not in r.stderr:
            problems.append(f"--peers {' '.join(args)}: exit {r.returncode}, expected 1 naming "
                            f"scripts/python-env.sh:\n{r.stderr}")

# --- the peers are timed in fp32 on the cpu: other modes are refused as usage errors
for args in (["--mode", "bf16-grad"], ["--device", "cuda"]):
    r = run("--peers", "--python", python, *args)
    if r.returncode != 2 or "--peers measures the cpu Adam in fp32" not in r.stderr:
        problems.append(f"--peers {' '.join(args)}: exit {r.returncode}, expected 2:\n{r.stderr}")

# --- compact states beside the peers (their rows stay fp32: 28 bytes a parameter), a bf16 master
# (its share of the roofline by bandwidth: 12.25 bytes against the roofline kernel's 16.25) and
# the update ahead (its rate against the step in place, same bytes)
r = run("--peers", "--python", python, "--params", str(PARAMS), "--reps", "2", "--threads", "1", "--states",
        "int8", "--master", "bf16", "--ahead", "--json")
if r.returncode != 0:
    sys.exit(f"FAIL: --peers --states int8 --master bf16 --ahead exited {r.returncode}\n{r.stderr}")
o = json.loads(r.stdout)
if (o["states"], o["master"], o["bytes_per_param"], o["roofline_bytes_per_param"]) != ("int8", "bf16", 12.25, 16.25):
    problems.append(f"compact: states {o['states']}, master {o['master']}, bytes {o['bytes_per_param']}, "
                    f"roofline bytes {o['roofline_bytes_per_param']}")
if not close(o["roofline_ratio"], o["params_per_s"] * 12.25 / (o["roofline_params_per_s"] * 16.25), 5e-3):
    problems.append(f"compact: roofline ratio {o['roofline_ratio']} is not the bandwidth share")
if not (o["ahead_params_per_s"] > 0 and close(o["ahead_ratio"], o["ahead_params_per_s"] / o["params_per_s"], 5e-3)):
    problems.append(f"compact: ahead {o['ahead_params_per_s']}, ratio {o['ahead_ratio']}")
for p in o["peers"]:
    if "error" in p:
        continue
    if not close(p["roofline_ratio"], p["params_per_s"] * 28 / (o["roofline_params_per_s"] * 16.25), 5e-3) or \
            not close(p["zest_ratio"], p["median_s"] / (PARAMS / o["params_per_s"]), 5e-3):
        problems.append(f"compact: {p['name']}: roofline ratio {p['roofline_ratio']}, zest's {p['zest_ratio']}")

# --- without --peers: zest's three rows, nothing else
r = run("--params", "1000", "--reps", "1")
lines = [line.split()[0] for line in r.stdout.splitlines()[1:]]
if r.returncode != 0 or lines != ["ours", "roofline", "scalar", "spread"]:
    problems.append(f"without --peers: exit {r.returncode}:\n{r.stdout}")

if problems:
    print("FAIL:\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"ok: peers' rows at {threads} threads, consistent; their updates equal zest's "
      f"(largest difference {max(p.get('check_max_abs_diff', 0) for p in rows[0]['peers']):.2g})")
