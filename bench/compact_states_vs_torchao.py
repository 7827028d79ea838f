"""zest's int8 optimizer states against torchao's 8-bit AdamW (torchao.optim.AdamW8bit), both
measured against torch.optim.AdamW with fp32 states, on the CPU in one process (issue 24).

    mpirun --oversubscribe --bind-to none -np 1 python bench/compact_states_vs_torchao.py [--steps 200]

(PYTHONPATH holding the zest package, as scripts/gpt-curves.sh installs it; torchao from PyPI in
the same environment: `pip install torchao`.)

The model: three Linear layers (64 -> 128 -> 128 -> 16, tanh between) whose weights have 8192 and
16384 elements, so torchao quantizes them (it keeps a tensor in fp32 below 4096 elements or when
its size is not a multiple of its block, 256: the last weight, 2048 elements, and the biases stay
fp32 there; zest quantizes every tensor in blocks of 64). Every optimizer starts from the same
weights and is given the same gradients: those of the fp32 AdamW run (a regression on a fixed
random teacher, one fresh batch per step), handed to zest through backward of sum(p * g), which
makes exactly g. So the differences below are the optimizers' alone (--own-gradients: each
optimizer computes its own gradients on the same batches instead, which lets differences feed
back through the loss).

Runs: torch AdamW (fp32, foreach=False), zest fp32 states (stage 0: the same arithmetic in zest's
kernel, the fp32 noise floor), zest int8 states, torchao AdamW8bit (block 256, its defaults), and
torchao AdamW8bit with block_size=64 (zest's block; it then quantizes the same tensors as before).
Prints, at chosen steps, the max and mean |difference| of all parameters and of the tensors
torchao quantizes, in absolute terms and in units of lr (one Adam step moves an element by at
most about lr); --json FILE writes every step.
"""

import argparse
import json
import os

import torch
from torch import nn

import zest.torch

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
BATCH = 32


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 16))


def teacher_batch(step):
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, 64, generator=g)
    torch.manual_seed(123)
    teacher = torch.randn(64, 16) / 8
    y = torch.sin(x @ teacher) + 0.1 * torch.randn(BATCH, 16, generator=g)
    return x, y


def loss_of(model, step):
    x, y = teacher_batch(step)
    return nn.functional.mse_loss(model(x), y)


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def train_torch(opt_of, steps, grads=None, record_grads=False):
    """torch AdamW or torchao: returns parameters after each step (and the gradients used)."""
    model = make()
    opt = opt_of(model)
    trajectory, used = [], []
    for step in range(steps):
        opt.zero_grad()
        if grads is None:
            loss_of(model, step).backward()
        else:
            for p, g in zip(model.parameters(), grads[step]):
                p.grad = g.clone()
        if record_grads:
            used.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        trajectory.append(snapshot(model))
    return trajectory, used


def train_zest(states, steps, grads=None):
    model = make()
    config = {"stage": 0, "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                                        "states": states, "threads": 1}}
    opt = zest.torch.Optimizer(model, config)
    assert f"states: {states}" in opt.config.to_yaml()
    trajectory = []
    for step in range(steps):
        if grads is None:
            loss_of(model, step).backward()
        else:  # d/dp sum(p * g) = g exactly
            sum((p * g).sum() for p, g in zip(model.parameters(), grads[step])).backward()
        opt.step()
        opt.zero_grad()
        trajectory.append([t.clone() for t in opt.full_parameters().values()])
    opt.close()
    return trajectory


def diff(a, b, which):
    d = torch.cat([(x - y).abs().flatten() for k, (x, y) in enumerate(zip(a, b)) if k in which])
    return d.max().item(), d.mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--own-gradients", action="store_true",
                        help="each optimizer computes its gradients on the same batches (default: the fp32 run's)")
    parser.add_argument("--json", help="write every step's figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from torchao.optim import AdamW8bit
    import torchao

    reference, grads = train_torch(
        lambda m: torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False),
        args.steps, record_grads=True)
    feed = None if args.own_gradients else grads
    ao_opt = {}

    def make_ao(m):
        ao_opt["opt"] = AdamW8bit(m.parameters(), lr=torch.tensor(LR), betas=BETAS, eps=EPS, weight_decay=WD)
        return ao_opt["opt"]

    torchao_run, _ = train_torch(make_ao, args.steps, grads=feed)
    torchao_64, _ = train_torch(lambda m: AdamW8bit(m.parameters(), lr=torch.tensor(LR), betas=BETAS, eps=EPS,
                                                    weight_decay=WD, block_size=64), args.steps, grads=feed)
    state = ao_opt["opt"].state
    params = list(make().parameters())
    names = [n for n, _ in make().named_parameters()]
    quantized = {k for k, p in enumerate(ao_opt["opt"].param_groups[0]["params"])
                 if type(state[p]["exp_avg"]).__name__ == "OptimState8bit"}
    zest_fp32 = train_zest("fp32", args.steps, feed)
    zest_int8 = train_zest("int8", args.steps, feed)

    everything = set(range(len(params)))
    print(f"torch {torch.__version__}, torchao {torchao.__version__}; AdamW lr {LR} betas {BETAS} eps {EPS} "
          f"weight decay {WD}; {'own' if args.own_gradients else 'the fp32 run'}'s gradients")
    print("tensors torchao quantizes (the rest it keeps in fp32): "
          + ", ".join(f"{names[k]} ({params[k].numel()})" for k in sorted(quantized)))
    print("fp32 there: " + ", ".join(f"{names[k]} ({params[k].numel()})" for k in sorted(everything - quantized)))
    pairs = [("zest fp32 - torch", zest_fp32, reference), ("zest int8 - torch", zest_int8, reference),
             ("torchao 8bit - torch", torchao_run, reference), ("zest int8 - torchao", zest_int8, torchao_run),
             ("torchao block 64 - torch", torchao_64, reference)]
    rows = []
    for step in range(args.steps):
        row = {"step": step + 1}
        for name, a, b in pairs:
            row[name] = {"all": diff(a[step], b[step], everything), "quantized": diff(a[step], b[step], quantized)}
        rows.append(row)
    shown = sorted({s for s in (1, 2, 5, 10, 20, 50, 100, 150, 200, args.steps) if s <= args.steps})
    for part in ("all", "quantized"):
        print(f"\n{'every tensor' if part == 'all' else 'the tensors torchao quantizes'}: max / mean |difference| "
              f"(in units of lr = {LR})")
        print(f"{'step':>5s} " + " ".join(f"{name:>25s}" for name, _, _ in pairs))
        for s in shown:
            row = rows[s - 1]
            print(f"{s:5d} " + " ".join(f"{row[n][part][0] / LR:12.3e} / {row[n][part][1] / LR:10.3e}"
                                        for n, _, _ in pairs))
    drift = max(abs(a - b).max().item() for a, b in zip(reference[-1], make().parameters()))
    print(f"\nthe largest distance any element of torch's run moved from its start in {args.steps} steps: "
          f"{drift:.4g} ({drift / LR:.1f} lr)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "own_gradients": args.own_gradients, "quantized_by_torchao":
                       [names[k] for k in sorted(quantized)], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
