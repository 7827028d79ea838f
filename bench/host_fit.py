#!/usr/bin/env python3
"""The largest model whose memory fits a host budget, by `zest estimate`, for each optimizer
states form (issue 24's host-memory goal): a bisection over --params on the rows of the
offloaded optimizer (offload.optimizer.device: cpu), one rank.

Two readings of "fits":
  pinned  the estimate's pinned host memory alone (a GPU machine: the parameters and gradients
          live on the GPU, the host holds the offloaded states and their buffers);
  all     pinned + device (the cpu backend: the "device" is host memory too, as on this machine).

usage: host_fit.py ZEST BUDGET_GIB [--layers L]   (prints a Markdown table)"""
import argparse
import re
import subprocess
import tempfile

FORMS = [("fp32", "fp32", None), ("bf16", "bf16", None), ("int8", "int8", None),
         ("int8 + bf16 master", "int8", "bf16")]
ROWS = ["stage 1, optimizer cpu", "stage 2, optimizer cpu"]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def size(text):
    number, unit = text.split()
    return float(number) * UNITS[unit]


def estimate(zest, params, layers, states, master, tmp_config):
    args = [zest, "estimate", "--params", str(params), "--layers", str(layers), "--dtype", "bf16", "--states", states]
    if master:
        args += ["--config", tmp_config]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = {}
    for row in ROWS:
        line = next(l for l in out.splitlines() if l.startswith(row + " "))
        cells = re.findall(r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)", line)
        rows[row] = {"device": size(cells[0]), "pinned": size(cells[5])}
    return rows


def largest(zest, budget, layers, states, master, row, reading, tmp_config):
    lo, hi = layers, 10 ** 13
    while hi - lo > max(1, lo // 1000):  # 0.1%
        mid = (lo + hi) // 2
        r = estimate(zest, mid, layers, states, master, tmp_config)[row]
        need = r["pinned"] + (r["device"] if reading == "all" else 0)
        lo, hi = (mid, hi) if need <= budget else (lo, mid)
    return lo


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("zest")
    parser.add_argument("budget_gib", type=float)
    parser.add_argument("--layers", type=int, default=32)
    a = parser.parse_args()
    budget = a.budget_gib * (1 << 30)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cfg:
        cfg.write("optimizer:\n  master: bf16\n  states: int8\nprecision:\n  dtype: bf16\n")
        cfg.flush()
        print(f"| row | reading | " + " | ".join(f for f, _, _ in FORMS) + " | int8 / fp32 | int8 + bf16 master / fp32 |")
        print("|---|---|" + "---:|" * (len(FORMS) + 2))
        for row in ROWS:
            for reading in ("pinned", "all"):
                fits = [largest(a.zest, budget, a.layers, s, m, row, reading, cfg.name) for _, s, m in FORMS]
                cells = " | ".join(f"{n / 1e9:.3f}B" for n in fits)
                print(f"| {row} | {reading} | {cells} | {fits[2] / fits[0]:.2f} | {fits[3] / fits[0]:.2f} |")


if __name__ == "__main__":
    main()
