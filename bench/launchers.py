"""zest's step over a torch.distributed gloo group against the same step over MPI, in the same
processes at the same moment (issue 37's goal: within 1.15x).

    mpirun --oversubscribe -np 2 python bench/launchers.py [--stages 2 3] [--trials 5] [--json FILE]

Every rank makes the default gloo group (MASTER_ADDR/MASTER_PORT, set here for one host), then for
each trial and stage trains a fresh copy of one model for --steps steps twice, alternating the
order: once with zest's ranks from MPI (comm.backend: mpi), once from the group
(process_group=dist.group.WORLD). The first --warmup steps of each run are not timed. Rank 0
prints, per stage, the median step time of each and their ratio (group / MPI) with the spread of
the per-trial ratios; the losses of the two runs are checked to be identical (2 ranks: a sum of two
is the same in any order). Wire bytes need no measuring: zest counts them above the backend
(CountingCommunicator), by the same collectives, so they are the same by construction.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import zest.torch


def model(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def run(stage, group, args, rank, world):
    net = model(args.width, args.depth)
    cfg = {"stage": stage, "optimizer": {"lr": 1e-3}, "comm": {"backend": "auto" if group else "mpi"}}
    opt = zest.torch.Optimizer(net, cfg, process_group=group)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    opt.close()
    return statistics.median(times), losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", help="rank 0 writes the figures here")
    args = parser.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for stage in args.stages:
        ratios, mpi_times, group_times = [], [], []
        for trial in range(args.trials):
            order = [None, dist.group.WORLD] if trial % 2 == 0 else [dist.group.WORLD, None]
            timed = {}
            for group in order:
                timed["group" if group else "mpi"] = run(stage, group, args, rank, world)
            assert timed["group"][1] == timed["mpi"][1] or world > 2, "the two runs' losses differ"
            mpi_times.append(timed["mpi"][0])
            group_times.append(timed["group"][0])
            ratios.append(timed["group"][0] / timed["mpi"][0])
        results[stage] = {
            "mpi_step_ms": 1e3 * statistics.median(mpi_times),
            "group_step_ms": 1e3 * statistics.median(group_times),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        }
        if rank == 0:
            r = results[stage]
            print(f"stage {stage}, {world} ranks, {sum(p.numel() for p in model(args.width, args.depth).parameters())} "
                  f"parameters: MPI {r['mpi_step_ms']:.1f} ms, gloo group {r['group_step_ms']:.1f} ms per step; "
                  f"group/MPI {r['ratio_median']:.3f} (trials {r['ratio_min']:.3f}..{r['ratio_max']:.3f})", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": world, "args": vars(args), "stages": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
