#!/usr/bin/env python3
"""Draws one step of a zest trace (--trace FILE: Chrome trace JSON) as an SVG: one block of rows
per rank, one row per lane (backward, host, comm stream, update ahead, nvme read/write, ...), each
span a rectangle from its begin to its end, nested spans drawn inside their parent. Python's
standard library only.

usage: trace_svg.py TRACE OUT.svg [--step N]
  --step N: the N-th step of rank 0 (default: the last), from the end of the step before it (its
  micro-batches' forward and backward) to the end of step N on every rank.
"""
import argparse
import json
import sys
from xml.sax.saxutils import escape

COLOURS = {
    "forward + backward": "#c6dbef", "backward stand-in": "#c6dbef", "gradient hand-off": "#3182bd",
    "reduce": "#e6550d", "all-gather": "#e7298a",
    "update ahead": "#31a354", "wait for write": "#c7e9c0",
    "nvme read": "#756bb1", "nvme write": "#bcbddc",
    "step": "#f0f0f0", "wait for reductions": "#bdbdbd", "optimizer step": "#d9d9d9",
    "settle updates ahead": "#fdd0a2", "commit updates ahead": "#fd8d3c",
    "sub-group": "#e5f5e0", "adam update": "#74c476", "wait for uploads and writes": "#cccccc",
    "upload parameters": "#66c2a5",
}
WIDTH, LEFT, ROW, GAP, TOP = 1100, 130, 18, 10, 40


def window(spans, step):
    """Step `step` (1-based; None: the last) of every rank: from the earliest end of a rank's step
    before it (where its forward and backward begin) to the latest end of a rank's step itself."""
    steps = {}
    for e in sorted((e for e in spans if e["name"] == "step"), key=lambda e: e["ts"]):
        steps.setdefault(e["pid"], []).append(e)
    count = min((len(s) for s in steps.values()), default=0)
    if count == 0:
        sys.exit("trace_svg.py: a rank of the trace has no 'step' span")
    n = count if step is None else step
    if not 1 <= n <= count:
        sys.exit("trace_svg.py: --step %d: the trace has steps 1-%d" % (n, count))
    end_of = lambda e: e["ts"] + e["dur"]
    begin = min(end_of(s[n - 2]) for s in steps.values()) if n >= 2 else min(e["ts"] for e in spans)
    return n, begin, max(end_of(s[n - 1]) for s in steps.values())


def depths(row):
    """Nesting depth of each span of one lane (spans sorted by begin)."""
    stack, out = [], []
    for e in row:
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        out.append(len(stack))
        stack.append(e["ts"] + e["dur"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("out")
    parser.add_argument("--step", type=int)
    a = parser.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    n, begin, end = window(spans, a.step)
    scale = (WIDTH - LEFT - 20) / max(end - begin, 1.0)
    x = lambda ts: LEFT + (min(max(ts, begin), end) - begin) * scale

    body, y = [], TOP
    for pid in sorted({e["pid"] for e in spans}):
        body.append('<text x="6" y="%d" font-weight="bold">rank %d</text>' % (y + 13, pid))
        y += ROW
        for tid in sorted(t for p, t in lanes if p == pid):
            row = sorted((e for e in spans if e["pid"] == pid and e["tid"] == tid
                          and e["ts"] < end and e["ts"] + e["dur"] > begin), key=lambda e: (e["ts"], -e["dur"]))
            if not row:
                continue
            body.append('<text x="16" y="%d">%s</text>' % (y + 13, escape(lanes[(pid, tid)])))
            body.append('<rect x="%d" y="%d" width="%d" height="%d" fill="#fafafa"/>' % (LEFT, y, WIDTH - LEFT - 20, ROW - 2))
            for e, depth in zip(row, depths(row)):
                inset = min(depth, 3) * 3
                x0, x1 = x(e["ts"]), x(e["ts"] + e["dur"])
                label = "%s%s: %.3f ms" % (e["name"], " n=%d" % e["args"]["n"] if "args" in e else "", e["dur"] / 1000)
                body.append('<rect x="%.2f" y="%d" width="%.2f" height="%d" fill="%s" stroke="#555" stroke-width="0.3">'
                            '<title>%s</title></rect>' % (x0, y + inset, max(x1 - x0, 0.6), ROW - 2 - 2 * inset,
                                                          COLOURS.get(e["name"], "#999"), escape(label)))
            y += ROW
        y += GAP

    # The time axis, in ms from the window's begin.
    span_ms = (end - begin) / 1000
    tick = next(t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 1e9) if span_ms / t <= 12)
    axis, t = [], 0.0
    while t <= span_ms + 1e-9:
        px = LEFT + t * 1000 * scale
        axis.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>' % (px, TOP - 4, px, y))
        axis.append('<text x="%.1f" y="%d" text-anchor="middle" fill="#555">%g ms</text>' % (px, TOP - 8, round(t, 3)))
        t += tick
    legend, lx = [], LEFT
    used = [name for name in COLOURS if any(e["name"] == name for e in spans)]
    ly = y + 6
    for name in used:
        w = 14 + 7 * len(name)
        if lx + w > WIDTH:
            lx, ly = LEFT, ly + ROW
        legend.append('<rect x="%d" y="%d" width="10" height="10" fill="%s" stroke="#555" stroke-width="0.3"/>'
                      '<text x="%d" y="%d">%s</text>' % (lx, ly, COLOURS[name], lx + 13, ly + 9, escape(name)))
        lx += w + 10
    height = ly + ROW + 6
    title = "zest trace: step %d of %s (%.2f ms shown)" % (n, a.trace.split("/")[-1], span_ms)
    svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">'
           % (WIDTH, height), '<rect width="100%" height="100%" fill="white"/>',
           '<text x="6" y="14" font-size="13">%s</text>' % escape(title)] + axis + body + legend + ["</svg>"]
    with open(a.out, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
