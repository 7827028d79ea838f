"""zest's Python optimizer against torch's fused AdamW on a GPT, in one program at the same moment
(issue 35, item 5): at one rank the time of step() alone and of a whole iteration; at two ranks the
whole iteration against DistributedDataParallel + fused AdamW.

    python bench/python_step.py [--rounds 3] [--steps 25] [--json FILE]      # one rank
    torchrun --nproc_per_node 2 bench/python_step.py [--rounds 3]            # two ranks: zest over gloo
    mpirun -np 2 python bench/python_step.py [--rounds 3]                    # two ranks: zest over MPI

(PYTHONPATH holding the zest package, as scripts/gpt-curves.sh installs it.)

The model is examples/python/gpt.py's GPT (default: 6 layers of width 384, 6 heads, context 64,
65 characters: 10.7M parameters) on random tokens; fp32 parameters, fp32 states. Two copies start
from the same weights: one trained by zest (`zest.torch.Optimizer`, stage --stage, average
gradients as DDP does), one by `torch.optim.AdamW(fused=True)` (wrapped in DDP over gloo at two
ranks; under torchrun zest takes its ranks from the same group, under mpirun from MPI). Each round
runs --warmup untimed then --steps timed iterations of each, alternating which goes first; an
iteration is forward, backward, step(), zero_grad(). Rank 0 prints the medians of each round and
the ratio zest / torch per round; the ratios' median and spread are the figures (same-run ratios:
this machine's absolute speed varies from day to day). The two copies' last losses are printed:
they must stay close (the same AdamW; sums in another order).
"""

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zest.torch

HERE = pathlib.Path(__file__).resolve().parent
VOCAB = 65
LR, BETAS, WD = 3e-3, (0.9, 0.95), 0.1


def gpt_class():
    spec = importlib.util.spec_from_file_location("gpt_example", HERE.parent / "examples" / "python" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT


def batch(step, per_rank, context, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (per_rank, context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class Trainer:
    """One model and its optimizer; run() times a round of iterations."""

    def __init__(self, name, forward, opt):
        self.name, self.forward, self.opt = name, forward, opt
        self.step_count, self.loss = 0, None

    def iterate(self, args, rank):
        """One iteration; returns its step() time and its whole time."""
        x, y = batch(self.step_count, args.batch, args.context, rank)
        self.step_count += 1
        began = time.perf_counter()
        loss = F.cross_entropy(self.forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        stepping = time.perf_counter()
        self.opt.step()
        stepped = time.perf_counter()
        self.opt.zero_grad()
        ended = time.perf_counter()
        self.loss = loss.item()
        return stepped - stepping, ended - began

    def run(self, args, rank):
        """--warmup untimed iterations, then --steps timed: the median step() and iteration times."""
        for _ in range(args.warmup):
            self.iterate(args, rank)
        steps, iterations = zip(*(self.iterate(args, rank) for _ in range(args.steps)))
        return statistics.median(steps), statistics.median(iterations)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25, help="timed iterations per round and optimizer")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before each round's timed ones")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="zest's optimizer.threads (0: its default)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embed", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="windows per rank and iteration")
    parser.add_argument("--json", help="rank 0 writes every round's figures here")
    args = parser.parse_args()

    # torchrun's ranks (zest over the gloo group DDP uses), or mpirun's (zest over MPI, DDP over gloo).
    mpi = "OMPI_COMM_WORLD_SIZE" in os.environ
    world = int(os.environ["OMPI_COMM_WORLD_SIZE" if mpi else "WORLD_SIZE"]) if mpi or "WORLD_SIZE" in os.environ else 1
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK" if mpi else "RANK", "0"))
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    GPT = gpt_class()
    torch.manual_seed(1)
    zest_model = GPT(VOCAB, args.context, args.embed, args.heads, args.layers)
    torch_model = GPT(VOCAB, args.context, args.embed, args.heads, args.layers)
    torch_model.load_state_dict(zest_model.state_dict())
    optimizer = {"lr": LR, "betas": list(BETAS), "weight_decay": WD}
    if args.threads:
        optimizer["threads"] = args.threads
    zest_opt = zest.torch.Optimizer(zest_model, {"stage": args.stage, "optimizer": optimizer,
                                                 "comm": {"backend": "mpi" if mpi else "auto"}})
    torch_forward = nn.parallel.DistributedDataParallel(torch_model) if world > 1 else torch_model
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    peer = "DDP + fused AdamW" if world > 1 else "fused AdamW"
    trainers = [Trainer("zest", zest_model, zest_opt), Trainer(peer, torch_forward, torch_opt)]

    rounds = []
    for r in range(args.rounds):
        order = trainers if r % 2 == 0 else trainers[::-1]
        times = {t.name: t.run(args, rank) for t in order}
        (zs, zi), (ts, ti) = times["zest"], times[peer]
        rounds.append({"zest_step_s": zs, "zest_iteration_s": zi, "peer_step_s": ts, "peer_iteration_s": ti,
                       "step_ratio": zs / ts, "iteration_ratio": zi / ti})
        if rank == 0:
            print(f"round {r}: step() zest {zs * 1e3:.1f} ms, {peer} {ts * 1e3:.1f} ms ({zs / ts:.2f}x); "
                  f"iteration zest {zi * 1e3:.1f} ms, {peer} {ti * 1e3:.1f} ms ({zi / ti:.2f}x)", flush=True)

    def spread(key):
        values = sorted(x[key] for x in rounds)
        return statistics.median(values), values[0], values[-1]

    params = sum(p.numel() for p in zest_model.parameters())
    if rank == 0:
        launch = "one process" if world == 1 else "zest over MPI" if mpi else "zest over the gloo group"
        print(f"{params} parameters, {world} rank(s) ({launch}), "
              f"stage {args.stage}, {args.steps} timed iterations x {args.rounds} rounds")
        for key, what in (("step_ratio", "step()"), ("iteration_ratio", "iteration")):
            med, lo, hi = spread(key)
            print(f"{what}: zest / {peer} median {med:.2f}x (rounds {lo:.2f}-{hi:.2f})")
        print(f"last loss: zest {trainers[0].loss:.4f}, {peer} {trainers[1].loss:.4f}")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"parameters": params, "ranks": world, "stage": args.stage, "peer": peer,
                       "args": vars(args), "rounds": rounds,
                       "losses": {"zest": trainers[0].loss, "peer": trainers[1].loss}}, f, indent=1)
            f.write("\n")
    zest_opt.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
