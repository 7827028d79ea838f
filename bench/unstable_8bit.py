"""8-bit optimizer states on an unstable model (issue 35, item 4): zest's int8 states beside
torchao's AdamW8bit, both beside fp32 AdamW, over several seeds, each optimizer training its own copy.

    python bench/unstable_8bit.py [--seeds 1 2 3] [--steps 20] [--json FILE]

(PYTHONPATH holding the zest package, as scripts/gpt-curves.sh installs it, and torchao: `pip
install torchao`, 0.18.0 here.)

The model is a torch twin of zest-train's unstable case in bench/RESULTS.md (issue 35): the same
shape and initialisation rule as examples/charlm/char_mlp.cpp (8 characters of context, 16-wide
embeddings concatenated, 24 hidden layers of width 640 with exact GELU, a linear output; weights
uniform with std gain / sqrt(fan_in), gain sqrt(2), 0.1 for the output, embeddings std 1, biases
0), trained on windows of the GPL-3 text with a global batch of 64 at lr 1e-3 without warm-up,
AdamW's betas (0.9, 0.999), eps 1e-8, weight decay 0.01. Its random numbers are torch's (not
zest-train's counter hash), so its curves are a twin's, not zest-train's own; its parameters are
fp32 (zest-train's case has bf16 ones), so "zest int8 + bf16 master" (bf16 parameters only) is not
among its runs.

Runs, each from the same weights on the same batches, computing its own gradients (so differences
feed back through the loss, as in training): torch AdamW (fp32 states), torchao AdamW8bit (its
defaults: blocks of 256, tensors under 4096 elements or not a multiple of 256 kept in fp32), zest
with fp32, bf16 and int8 states (stage 1, one rank: every tensor's states in the format, int8 in
blocks of 64). Prints each run's loss at chosen steps and whether it diverged (a last loss above
the first, or not finite), and for torchao how many elements' v decodes to 0 while m does not after
each of the first steps (their next update is about m / eps).
"""

import argparse
import json
import math
import os
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import zest.torch

CONTEXT, EMBED, HIDDEN, LAYERS, BATCH, LR = 8, 16, 640, 24, 64, 1e-3
TEXT = "/usr/share/common-licenses/GPL-3"


class CharMlp(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, EMBED)
        widths = [CONTEXT * EMBED] + [HIDDEN] * LAYERS
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.output = nn.Linear(HIDDEN, vocab)
        with torch.no_grad():
            # char_mlp.cpp's rule: uniform, std gain / sqrt(fan_in); embeddings std 1; biases 0.
            for weight, gain in [(self.embed.weight, None)] + [(h.weight, math.sqrt(2)) for h in self.hidden] + \
                    [(self.output.weight, 0.1)]:
                std = 1.0 if gain is None else gain / math.sqrt(weight.shape[1])
                weight.uniform_(-std * math.sqrt(3), std * math.sqrt(3))
            for layer in list(self.hidden) + [self.output]:
                layer.bias.zero_()

    def forward(self, tokens):
        x = self.embed(tokens).flatten(1)
        for layer in self.hidden:
            x = F.gelu(layer(x))
        return self.output(x)


def batches(data, seed, steps):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=g)
        windows = torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()])
        yield windows[:, :-1], windows[:, -1]


def make_optimizer(name, model):
    if name == "torch AdamW fp32":
        return torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    if name == "torchao AdamW8bit":
        from torchao.optim import AdamW8bit
        return AdamW8bit(model.parameters(), lr=LR)
    states = name.split()[1]  # "zest int8" -> int8
    return zest.torch.Optimizer(model, {"stage": 1, "optimizer": {"lr": LR, "states": states, "threads": 1}})


def zero_point_count(opt):
    """torchao's states after a step: the elements whose v decodes to 0 while m does not (their next
    update is about m / eps, unbounded: the "zero-point problem" of low-bit second moments)."""
    count = 0
    for state in opt.state.values():
        if "exp_avg" not in state:
            continue
        m, v = (state[k].dequantize() if hasattr(state[k], "dequantize") else state[k] for k in ("exp_avg", "exp_avg_sq"))
        count += int(((v == 0) & (m != 0)).sum())
    return count


def train(name, vocab, data, seed, steps):
    """The run's loss per step and, for torchao, zero_point_count after each step."""
    torch.manual_seed(seed)
    model = CharMlp(vocab)
    opt = make_optimizer(name, model)
    losses, zero_points = [], []
    for x, y in batches(data, seed, steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if name.startswith("torchao"):
            zero_points.append(zero_point_count(opt))
    if hasattr(opt, "close"):
        opt.close()
    return losses, zero_points


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", nargs="+", default=["torch AdamW fp32", "torchao AdamW8bit", "zest fp32",
                                                      "zest bf16", "zest int8"])
    parser.add_argument("--json", help="every run's loss per step")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    results = {}
    shown = sorted({s for s in (1, 3, 5, 8, 12, 16, args.steps) if s <= args.steps})
    print(f"{sum(p.numel() for p in CharMlp(len(chars)).parameters())} parameters; loss at steps {shown}")
    for seed in args.seeds:
        for name in args.runs:
            losses, zero_points = train(name, len(chars), data, seed, args.steps)
            results.setdefault(name, {})[seed] = losses
            diverged = not math.isfinite(losses[-1]) or losses[-1] > losses[0]
            print(f"seed {seed} {name:18s} " + " ".join(f"{losses[s - 1]:7.3f}" for s in shown) +
                  ("  DIVERGED" if diverged else ""), flush=True)
            if zero_points:
                print(f"  {name}: elements with v decoded to 0 and m not, after steps 1-4: {zero_points[:4]}")
    print(f"\nlast loss (step {args.steps}) per seed:")
    for name in args.runs:
        last = [results[name][s][-1] for s in args.seeds]
        print(f"{name:18s} " + " ".join(f"{x:7.3f}" for x in last) + f"   median {statistics.median(last):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "seeds": args.seeds, "losses": results}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
