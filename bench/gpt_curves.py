"""A real run to look at: examples/python/gpt.py trained on real text with torch DDP + AdamW and
with zest at stages 1-3 and with its optimizer offloaded, the same model, initial weights and
batches on 2 ranks; the loss curves in one chart, tokens per second per rank and peak memory per
rank in a table. With --states, instead: torch DDP and zest stage 2 with Adam's m and v stored as
fp32, bf16 and int8 (optimizer.states, docs/compact-states.md), each compact run measured against
the fp32 states' run (issue 24's bar: within 2% of its final loss).

    scripts/gpt-curves.sh              # makes the environment and the package, then runs this
    scripts/gpt-curves.sh --states     # the compact states' runs: compact-states-curves.svg

The text: every license in /usr/share/common-licenses (about 250 KB of English prose), shipped by
Debian's essential package base-files, so it is on every Debian system and nothing is downloaded.

usage: gpt_curves.py OUT_DIR [--steps N] [--states] [-- extra gpt.py arguments]
Writes OUT_DIR/gpt-curves.svg, gpt-curves.json (with --states: compact-states-curves.svg and
.json) and each run's log; prints the table.
"""

import argparse
import glob
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GPT = os.path.join(HERE, "..", "examples", "python", "gpt.py")
TEXTS = sorted(p for p in glob.glob("/usr/share/common-licenses/*") if not os.path.islink(p))

RUNS = [  # (name, gpt.py arguments); the first is the reference
    ("torch DDP + AdamW", ["--optimizer", "adamw-ddp"]),
    ("zest stage 1", ["--stage", "1"]),
    ("zest stage 2", ["--stage", "2"]),
    ("zest stage 3", ["--stage", "3"]),
    ("zest stage 3 + offload optimizer cpu", ["--stage", "3", "--offload", "cpu"]),
    ("zest stage 2 + offload optimizer nvme", ["--stage", "2", "--offload", "nvme"]),
]
STATES_RUNS = [  # --states: the reference first, then fp32 states, the run the compact ones are held to
    ("torch DDP + AdamW", ["--optimizer", "adamw-ddp"]),
    ("zest stage 2 states fp32", ["--stage", "2"]),
    ("zest stage 2 states bf16", ["--stage", "2", "--states", "bf16"]),
    ("zest stage 2 states int8", ["--stage", "2", "--states", "int8"]),
]
COLORS = ["#000000", "#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return str(s.getsockname()[1])


def run(name, extra, out, steps, mpirun, ranks, more):
    log = os.path.join(out, name.replace(" ", "_").replace("+", "plus") + ".jsonl")
    if "nvme" in extra:
        swap = os.path.join(out, "swap")
        os.makedirs(swap, exist_ok=True)
        extra = extra + ["--offload-path", swap]
    env = dict(os.environ, MASTER_PORT=free_port())
    command = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), "-x", "MASTER_PORT", "-x", "PYTHONPATH",
               sys.executable, GPT, "--steps", str(steps), "--log", log, "--text", *TEXTS, *extra, *more]
    print(f"== {name}: gpt.py {' '.join(extra + more)}", flush=True)
    subprocess.run(command, check=True, env=env)
    lines = [json.loads(line) for line in open(log)]
    return {"name": name, "losses": [l["loss"] for l in lines if "loss" in l], **lines[-1]}


def svg(results, entropy, steps, title_states=False, difference_to=None):
    """Loss against step, one polyline per run, the unigram entropy as a dashed line. With
    difference_to (a run's index), a second panel below: each run's loss minus that run's, as a
    moving average of 25 steps (one batch's loss is noisy; the runs see the same batches)."""
    left, top, width, height = 70, 40, 640, 360
    below = 300 if difference_to is not None else 0
    high = max(max(r["losses"]) for r in results)
    low = min(min(r["losses"]) for r in results + [{"losses": [entropy]}])
    low = max(0.0, low - 0.1)
    x = lambda i: left + width * i / max(1, steps - 1)
    y = lambda v: top + height * (high - v) / (high - low)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 340}" height="{top + height + 60 + below}" '
             'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left}" y="22" font-size="16">examples/python/gpt.py on base-files\' licenses, 2 ranks: '
             'training loss (rank 0\'s slice)' + (', Adam states fp32 / bf16 / int8' if title_states else '')
             + '</text>']
    for t in range(6):  # grid
        v = low + (high - low) * t / 5
        parts.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + width}" y2="{y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for t in range(5):
        i = (steps - 1) * t // 4
        parts.append(f'<text x="{x(i):.1f}" y="{top + height + 16}" text-anchor="middle">{i}</text>')
    parts.append(f'<text x="{left + width / 2}" y="{top + height + 36}" text-anchor="middle">step</text>')
    parts.append(f'<text x="16" y="{top + height / 2}" transform="rotate(-90 16 {top + height / 2})" '
                 'text-anchor="middle">loss (nats per character)</text>')
    parts.append(f'<line x1="{left}" y1="{y(entropy):.1f}" x2="{left + width}" y2="{y(entropy):.1f}" '
                 f'stroke="#888" stroke-dasharray="6 4"/>')
    for k, r in enumerate(results):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(r["losses"]))
        # The reference wide and underneath: where zest's curves coincide with it, it shows as their edge.
        parts.append(f'<polyline fill="none" stroke="{COLORS[k % len(COLORS)]}" stroke-width="{3 if k == 0 else 1}" '
                     f'points="{points}"/>')
    for k, r in enumerate(results + [{"name": f"unigram entropy {entropy:.3f}"}]):
        ly = top + 10 + 18 * k
        dash = ' stroke-dasharray="6 4"' if k == len(results) else ""
        color = "#888" if k == len(results) else COLORS[k % len(COLORS)]
        parts.append(f'<line x1="{left + width + 20}" y1="{ly}" x2="{left + width + 44}" y2="{ly}" stroke="{color}" '
                     f'stroke-width="2"{dash}/><text x="{left + width + 50}" y="{ly + 4}">{r["name"]}</text>')
    if difference_to is not None:
        parts += difference_panel(results, difference_to, steps, left, top + height + 80, width, below - 80, x)
    return "\n".join(parts + ["</svg>"]) + "\n"


def difference_panel(results, reference, steps, left, top, width, height, x, window=25):
    ref = results[reference]["losses"]
    smooth = []
    for r in results:
        d = [a - b for a, b in zip(r["losses"], ref)]
        smooth.append([sum(d[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(d))])
    bound = max(1e-3, max(abs(v) for s in smooth for v in s)) * 1.1
    y = lambda v: top + height * (bound - v) / (2 * bound)
    parts = [f'<text x="{left}" y="{top - 8}" font-size="13">loss minus {results[reference]["name"]}\'s, '
             f'moving average of {window} steps</text>']
    for t in range(5):
        v = -bound + 2 * bound * t / 4
        parts.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + width}" y2="{y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:+.3f}</text>')
    for t in range(5):
        i = (steps - 1) * t // 4
        parts.append(f'<text x="{x(i):.1f}" y="{top + height + 16}" text-anchor="middle">{i}</text>')
    for k, d in enumerate(smooth):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(d))
        parts.append(f'<polyline fill="none" stroke="{COLORS[k % len(COLORS)]}" stroke-width="{3 if k == 0 else 1}" '
                     f'points="{points}"/>')
    return parts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--states", action="store_true",
                        help="run torch DDP and zest stage 2 with fp32, bf16 and int8 optimizer states instead")
    parser.add_argument("more", nargs="*", help="further gpt.py arguments (after --)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    runs = STATES_RUNS if args.states else RUNS
    results = [run(name, extra, args.out, args.steps, args.mpirun, args.ranks, args.more) for name, extra in runs]
    if args.states:
        return report_states(results, args)
    reference = results[0]["losses"]
    entropy = results[0]["unigram_entropy"]
    print(f"\nunigram entropy of the training text: {entropy:.4f} nats per character")
    print(f"{'run':40s} {'final loss':>10s} {'max |loss - DDP|':>17s} {'tokens/s/rank':>14s} {'peak RSS MiB':>13s}")
    for r in results:
        r["max_difference_to_ddp"] = max(abs(a - b) for a, b in zip(r["losses"], reference))
        print(f"{r['name']:40s} {r['losses'][-1]:10.4f} {r['max_difference_to_ddp']:17.2e} "
              f"{r['tokens_per_second_per_rank']:14.0f} {r['peak_rss_bytes'] / 2**20:13.1f}")
    with open(os.path.join(args.out, "gpt-curves.svg"), "w") as f:
        f.write(svg(results, entropy, args.steps))
    with open(os.path.join(args.out, "gpt-curves.json"), "w") as f:
        json.dump({"texts": TEXTS, "steps": args.steps, "ranks": args.ranks, "runs": results}, f, indent=1)
    print(f"\nwrote {args.out}/gpt-curves.svg and gpt-curves.json")


def report_states(results, args):
    """--states: each run against the fp32 states' run (results[1]): the final loss's relative
    difference, the largest distance between the curves, and, less noisy than one batch's loss,
    the mean of the last 50 steps' losses and the validation loss."""
    fp32 = results[1]
    entropy = results[0]["unigram_entropy"]
    print(f"\nunigram entropy of the training text: {entropy:.4f} nats per character")
    print(f"{'run':28s} {'final loss':>10s} {'vs fp32':>8s} {'max |loss - fp32|':>18s} {'last 50 mean':>12s} "
          f"{'vs fp32':>8s} {'val loss':>8s} {'tokens/s/rank':>14s}")
    tail = lambda r: sum(r["losses"][-50:]) / len(r["losses"][-50:])
    for r in results:
        r["relative_to_fp32_states"] = r["losses"][-1] / fp32["losses"][-1] - 1
        r["max_difference_to_fp32_states"] = max(abs(a - b) for a, b in zip(r["losses"], fp32["losses"]))
        r["last_50_mean"] = tail(r)
        r["last_50_mean_relative_to_fp32_states"] = tail(r) / tail(fp32) - 1
        print(f"{r['name']:28s} {r['losses'][-1]:10.4f} {100 * r['relative_to_fp32_states']:+7.2f}% "
              f"{r['max_difference_to_fp32_states']:18.2e} {r['last_50_mean']:12.4f} "
              f"{100 * r['last_50_mean_relative_to_fp32_states']:+7.2f}% {r['validation_loss']:8.4f} "
              f"{r['tokens_per_second_per_rank']:14.0f}")
    for r in results[2:]:
        within = abs(r["relative_to_fp32_states"]) <= 0.02
        print(f"{r['name']}: final loss {'within' if within else 'NOT within'} 2% of fp32 states'")
    with open(os.path.join(args.out, "compact-states-curves.svg"), "w") as f:
        f.write(svg(results, entropy, args.steps, title_states=True, difference_to=1))
    with open(os.path.join(args.out, "compact-states-curves.json"), "w") as f:
        json.dump({"texts": TEXTS, "steps": args.steps, "ranks": args.ranks, "runs": results}, f, indent=1)
    print(f"\nwrote {args.out}/compact-states-curves.svg and compact-states-curves.json")


if __name__ == "__main__":
    main()
