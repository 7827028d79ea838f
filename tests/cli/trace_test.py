#!/usr/bin/env python3
"""zest-train --trace FILE on 4 ranks, the optimizer offloaded to NVMe and updated ahead of the
step during backward (offload.optimizer.update_ahead): the file is one JSON document (a Chrome trace) holding
every rank's events on named lanes, the NVMe reads and writes, the reductions, the updates ahead
and the all-gather, and on some rank an update ahead or a reduction runs while that rank's
backward does (the overlap can be seen). An existing FILE is refused before any work and left as
it was, and a refused run leaves nothing of its own behind.

usage: trace_test.py ZEST_TRAIN MPIRUN SOURCE_ROOT
"""
import json
import os
import subprocess
import sys
import tempfile

TRAIN, MPIRUN, SOURCE = sys.argv[1:4]
failures = []


def check(condition, what):
    if not condition:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)
    return condition


def train(work, config, trace, ranks=4):
    command = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), TRAIN, "--config", config,
               "--steps", "6", "--trace", trace]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=work, stdin=subprocess.DEVNULL)


def overlapping(a, b):
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


with tempfile.TemporaryDirectory() as work:
    swap = os.path.join(work, "swap")
    os.mkdir(swap)
    config = os.path.join(work, "update_ahead.yaml")
    with open(os.path.join(SOURCE, "configs", "train-tiny.yaml")) as tiny, open(config, "w") as out:
        # Small buckets and sub-groups: several reductions during backward, several NVMe transfers.
        out.write(tiny.read().replace("  reduce: 4MiB", "  reduce: 32KiB"))
        out.write("offload:\n  optimizer: {device: nvme, path: %s, update_ahead: true}\n  sub_group: 16KiB\n" % swap)

    trace = os.path.join(work, "step.json")
    run = train(work, config, trace)
    check(run.returncode == 0, "zest-train --trace on 4 ranks: exit %d\n%s" % (run.returncode, run.stderr))
    check("wrote the trace of 4 rank(s) to" in run.stdout, "zest-train says where the trace went:\n" + run.stdout)
    try:
        with open(trace) as f:
            doc = json.load(f)
    except (OSError, ValueError) as error:
        check(False, "the trace is not one JSON document: %s" % error)
        doc = {"traceEvents": [], "otherData": {}}

    events = doc["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    check({e["pid"] for e in spans} == {0, 1, 2, 3}, "events of ranks %s, not 0-3" % sorted({e["pid"] for e in spans}))
    check(doc["otherData"].get("ranks") == 4 and doc["otherData"].get("dropped_events") == 0,
          "otherData: %s" % doc["otherData"])
    for e in spans:
        if not check((e["pid"], e["tid"]) in lanes, "span on an unnamed lane: %s" % e):
            break
    lane_of = lambda e: lanes.get((e["pid"], e["tid"]), "?")
    for rank in range(4):
        mine = [e for e in spans if e["pid"] == rank]
        names = {e["name"] for e in mine}
        for name in ("step", "forward + backward", "gradient hand-off", "reduce", "update ahead",
                     "commit updates ahead", "all-gather", "nvme read", "nvme write"):
            check(name in names, "rank %d: no '%s' span (has %s)" % (rank, name, sorted(names)))
        for name, lane in (("reduce", "comm stream"), ("update ahead", "update ahead"),
                           ("forward + backward", "backward"), ("step", "host")):
            check(all(lane_of(e) == lane for e in mine if e["name"] == name), "rank %d: '%s' not on '%s'" % (rank, name, lane))
        check(all(lane_of(e).startswith("nvme ") for e in mine if e["name"].startswith("nvme")),
              "rank %d: a transfer off the nvme lanes" % rank)

    # The overlap: work of the step that runs while the same rank is still in backward.
    backward = [e for e in spans if e["name"] == "forward + backward"]
    ahead = [e for e in spans if e["name"] in ("update ahead", "reduce")]
    seen = [(a["pid"], a["name"]) for a in ahead for b in backward if a["pid"] == b["pid"] and overlapping(a, b)]
    check(len(seen) > 0, "no update ahead or reduction overlaps a backward of its rank")
    print("overlapping backward: %d reductions, %d updates ahead" %
          (sum(1 for _, n in seen if n == "reduce"), sum(1 for _, n in seen if n == "update ahead")))

    # An existing file: refused before any work, on every rank, and left as it was.
    with open(trace, "w") as f:
        f.write("the user's")
    run = train(work, config, trace)
    check(run.returncode != 0, "an existing --trace file was accepted")
    check("--trace" in run.stderr and "exists" in run.stderr and "remove it or name another" in run.stderr,
          "the refusal names the flag and the fix:\n" + run.stderr)
    check("step " not in run.stdout, "the refused run trained:\n" + run.stdout)
    with open(trace) as f:
        check(f.read() == "the user's", "the existing file was changed")
    check(sorted(os.listdir(work)) == ["step.json", "swap", "update_ahead.yaml"],
          "left behind: %s" % sorted(os.listdir(work)))
    check(os.listdir(swap) == [], "left in the swap directory: %s" % os.listdir(swap))

if failures:
    print("%d check(s) failed" % len(failures), file=sys.stderr)
    sys.exit(1)
print("ok")
