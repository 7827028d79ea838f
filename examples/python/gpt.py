"""A small GPT (nanoGPT's shape: token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, a head tied to the token embedding) trained on a local text by
characters, with zest in place of torch.optim.AdamW:

    torchrun --nproc_per_node 2 examples/python/gpt.py      # zest, stage 3, 2 ranks (about a minute here)
    mpirun -np 2 python examples/python/gpt.py              # the same, zest's ranks from MPI
    mpirun -np 2 python examples/python/gpt.py --stage 1 --save ckpt
    mpirun -np 4 python examples/python/gpt.py --load ckpt  # resumes on another rank count
    mpirun -np 2 python examples/python/gpt.py --optimizer adamw-ddp   # the same with torch alone
    mpirun -np 2 python examples/python/gpt.py --states int8           # Adam's m and v in int8 (issue 24)
    python examples/python/gpt.py --device cuda --autocast bf16        # on a GPU, bf16 matmuls (issue 33)
    python examples/python/gpt.py --device cuda --optimizer torch      # the same with torch's fused AdamW

The one line that differs from training with torch.optim.AdamW is marked below. Each rank trains
on its slice of every global batch and computes its mean loss, as under DistributedDataParallel;
zest averages the gradients over ranks as DDP does. `--optimizer adamw-ddp` trains the same model
on the same batches with torch's DistributedDataParallel (gloo; nccl on cuda) and torch.optim.AdamW
instead, for comparison (bench/gpt_curves.py draws both); `--optimizer torch` with AdamW alone, in
one process (fused on cuda). `--log FILE` writes rank 0's loss per step and, at the end, tokens per
second per rank and the ranks' peak resident memory, as JSON lines; `--json FILE` the median
tokens per second per rank after the warm-up steps and, on cuda, torch.cuda.max_memory_allocated()
(zest's device memory comes from torch's allocator, so it counts zest's too).

On a GPU (`--device cuda`, one GPU per rank): `--autocast bf16` keeps fp32 parameters and runs the
matmuls in bf16 under torch.autocast (on the cpu too); `--dtype bf16` makes the parameters bf16
(zest: precision.dtype bf16, with fp32 master weights).
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

WARMUP_STEPS = 3  # the first steps allocate memory and choose kernels: not in the median tokens/s


class CausalSelfAttention(nn.Module):
    def __init__(self, embed, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(embed, 3 * embed)
        self.c_proj = nn.Linear(embed, embed)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, embed, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed)
        self.attn = CausalSelfAttention(embed, heads)
        self.ln_2 = nn.LayerNorm(embed)
        self.mlp = nn.Sequential(nn.Linear(embed, 4 * embed), nn.GELU(), nn.Linear(4 * embed, embed))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, context, embed, heads, layers):
        super().__init__()
        self.wte = nn.Embedding(vocab, embed)
        self.wpe = nn.Embedding(context, embed)
        self.blocks = nn.ModuleList(Block(embed, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(embed)
        self.lm_head = nn.Linear(embed, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2 (zest trains it once)
        self.register_buffer("positions", torch.arange(context), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(self.positions[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def batch(data, step, global_batch, context, rank, world):
    """This rank's slice of the global batch of `step`: the same windows on any rank count."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - context - 1, (global_batch,), generator=g)
    per = global_batch // world
    starts = starts[rank * per:(rank + 1) * per]
    windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def unigram_entropy(data):
    """The loss (nats per character) of predicting each character by its frequency alone: a model
    below it has learnt something of the text's order."""
    p = torch.bincount(data).double() / len(data)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", nargs="+", default=["/usr/share/common-licenses/GPL-3"],
                        help="local text files, read as one text")
    parser.add_argument("--config", help="a zest YAML config (default: the dict below)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--global-batch", type=int, default=32, help="windows per step, split across ranks")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--save", help="write a zest checkpoint here at the end")
    parser.add_argument("--load", help="resume from a zest checkpoint (any rank count and stage)")
    parser.add_argument("--optimizer", choices=["zest", "adamw-ddp", "torch"], default="zest",
                        help="adamw-ddp: torch DDP + AdamW; torch: AdamW in one process (fused on cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank")
    parser.add_argument("--autocast", choices=["none", "bf16"], default="none",
                        help="bf16: fp32 parameters, bf16 matmuls under torch.autocast")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the parameters' dtype (zest: precision.dtype, with fp32 master weights)")
    parser.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none",
                        help="zest: where the optimizer states live (nvme: in --offload-path)")
    parser.add_argument("--offload-path", default="", help="a directory for --offload nvme's swap files")
    parser.add_argument("--states", choices=["fp32", "bf16", "int8"], default="fp32",
                        help="zest: how Adam's m and v are stored (optimizer.states, docs/compact-states.md)")
    # --loss-log: the same, for torchrun, whose own parser takes --log as an abbreviation of its options
    parser.add_argument("--log", "--loss-log", dest="log",
                        help="rank 0 writes its loss per step and a summary here (JSON lines)")
    parser.add_argument("--json", help="rank 0 writes the run's figures here (median tokens/s, max_memory_allocated)")
    args = parser.parse_args()
    if args.optimizer != "zest" and (args.save or args.load or args.offload != "none" or args.states != "fp32"):
        parser.error(f"--save, --load, --offload and --states are zest's: leave them out with --optimizer {args.optimizer}")

    # torchrun's ranks, or mpirun's (one process without either); the same with AdamW, which then
    # trains alone.
    torchrun = "LOCAL_RANK" in os.environ and "OMPI_COMM_WORLD_SIZE" not in os.environ
    launcher = {"rank": "RANK", "world": "WORLD_SIZE", "local": "LOCAL_RANK"} if torchrun else \
        {"rank": "OMPI_COMM_WORLD_RANK", "world": "OMPI_COMM_WORLD_SIZE", "local": "OMPI_COMM_WORLD_LOCAL_RANK"}
    rank = int(os.environ.get(launcher["rank"], "0"))
    world = int(os.environ.get(launcher["world"], "1"))
    if args.global_batch % world:
        parser.error(f"--global-batch {args.global_batch} does not split into {world} equal slices")
    if args.optimizer == "torch" and world > 1:
        parser.error(f"--optimizer torch trains in one process, not {world}: use --optimizer adamw-ddp")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU visible (torch.cuda.is_available() is False); use --device cpu")
        # One GPU per rank: the rank's place on its host picks it.
        local = int(os.environ.get(launcher["local"], "0"))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if torchrun or args.optimizer == "adamw-ddp":
        # Under torchrun zest takes its ranks from this group, as DDP does; under mpirun zest's are
        # MPI's, and the group is DDP's alone.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29518")
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast == "bf16"
                else contextlib.nullcontext())

    text = ""
    for path in args.text:
        with open(path, encoding="utf-8") as f:
            text += f.read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    torch.manual_seed(1)  # the same initial weights on every rank, and on every device
    model = GPT(len(chars), args.context, args.embed, args.heads, args.layers).to(device=device, dtype=dtype)
    config = args.config or {
        "stage": args.stage,
        "optimizer": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "stage3": {"persistence_threshold": "1KiB"},  # LayerNorms stay resident, the rest is sharded
    }
    if args.states != "fp32" and not args.config:
        config["optimizer"]["states"] = args.states
    if args.offload != "none" and not args.config:
        config["offload"] = {"optimizer": {"device": args.offload, "path": args.offload_path}}
    if args.dtype != "fp32" and not args.config:
        config["precision"] = {"dtype": args.dtype}
    if device.type == "cuda" and not args.config:
        # All the GPU has: device.memory's default is the cpu device's budget (2GiB), and 0 needs
        # device.type cuda said (the engine follows the parameters' device either way).
        config["device"] = {"type": "cuda", "memory": 0}
    trained = model
    fused = True if device.type == "cuda" else None  # torch's fastest AdamW on a GPU
    if args.optimizer == "zest":
        import zest.torch  # here, not above: torch's runs need no zest

        # opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        opt = zest.torch.Optimizer(model, config)
    elif args.optimizer == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    else:
        trained = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps, eta_min=3e-4)
    start = 0
    if args.load:
        start = opt.load(args.load, sched).steps

    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{params} parameters, {world} ranks, {len(chars)} characters, steps {start}..{args.steps}")
    log = open(args.log, "w") if args.log and rank == 0 else None
    began = time.time()
    step_seconds = []
    for step in range(start, args.steps):
        step_began = time.perf_counter()
        x, y = (t.to(device) for t in batch(train_data, step, args.global_batch, args.context, rank, world))
        with autocast:
            loss = F.cross_entropy(trained(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's time, not the time to queue it
        step_seconds.append(time.perf_counter() - step_began)
        if log:
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} ({time.time() - began:.0f} s)")
    seconds = time.time() - began

    with torch.no_grad(), autocast:
        x, y = (t.to(device) for t in batch(val_data, 0, args.global_batch, args.context, rank, world))
        val = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    measured = step_seconds[WARMUP_STEPS:] if len(step_seconds) > WARMUP_STEPS else step_seconds
    tokens_per_step = args.global_batch // world * args.context
    median_tps = tokens_per_step / statistics.median(measured) if measured else 0.0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if rank == 0:
        print(f"validation loss (rank 0's slice) {val.item():.4f}")
        print(f"tokens/s per rank {median_tps:.0f} (median of {len(measured)} steps after the first "
              f"{len(step_seconds) - len(measured)})"
              + (f", max_memory_allocated {peak / 2**20:.1f} MiB" if peak is not None else ""))
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"optimizer": args.optimizer, "device": str(device), "ranks": world,
                       "stage": opt.config.stage if args.optimizer == "zest" else None, "offload": args.offload,
                       "states": args.states, "dtype": args.dtype, "autocast": args.autocast,
                       "parameters": sum(p.numel() for p in model.parameters()),
                       "steps": len(step_seconds), "median_tokens_per_second_per_rank": median_tps,
                       "max_memory_allocated_bytes": peak, "final_loss": loss.item() if step_seconds else None,
                       "validation_loss": val.item(),
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
                      f, indent=1)
            f.write("\n")
    if log:
        # Rank 0's figures: each rank trains the same number of tokens; the resident peak is rank 0's
        # (the ranks' are alike: the same shard sizes).
        tokens = (args.steps - start) * args.global_batch // world * args.context
        with open("/proc/self/status") as status:
            rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
        log.write(json.dumps({"tokens_per_second_per_rank": tokens / seconds, "peak_rss_bytes": rss,
                              "validation_loss": val.item(), "unigram_entropy": unigram_entropy(train_data),
                              "ranks": world}) + "\n")
        log.close()
    if args.save:
        opt.save(args.save)


if __name__ == "__main__":
    main()
