"""The peers of `zest bench memory`: what a user would run instead of zest, on the same model, data
and rank count, measured the way zest's rows are.

    zest bench memory --write-peer-inputs DIR            # the model, its initial weights, the batches
    mpirun -np 4 python bench/memory_peers.py DIR --json DIR/peers.json
    mpirun -np 4 zest bench memory --peers DIR/peers.json ...   # one table, JSON, CSV and chart

Rows: torch DDP + AdamW (the plain DDP of the ZeRO paper), FSDP2 `fully_shard` per block
(reshard after forward) + AdamW, and FSDP2 with its CPU offload policy, as given (it pins host
memory, which needs a CUDA driver) and with pin_memory=False (which runs without one). torch runs in fp32 (zest's
default rows keep bf16 parameters and gradients with fp32 master weights: 16 bytes per parameter
under DDP either way). Per row and rank: the bytes of parameters, gradients and optimizer states at
the step's peak, counted from the tensors themselves (storages deduplicated; DTensor local shards
for FSDP2, and FSDP2's unsharded parameters while a block runs) in one more, untimed step, the
peak RSS, the median step time after the first step, and the last step's loss. A peer that fails to run gets a row saying why.

The processes find each other through Open MPI's environment (OMPI_COMM_WORLD_RANK/SIZE) and
MASTER_ADDR/MASTER_PORT (default 127.0.0.1:29517), over gloo.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CharMlp(nn.Module):
    """zest's example character MLP (examples/charlm/char_mlp.hpp), tensor for tensor: the context
    tokens' embeddings concatenated, hidden layers of linear + GELU (erf) or tanh, an output
    projection; one module per zest parameter group, so FSDP2 shards it block by block as zest's
    stage 3 gathers it."""

    def __init__(self, m):
        super().__init__()
        self.context = m["context"]
        self.embed = nn.Embedding(m["vocab"], m["embed"])
        width = m["context"] * m["embed"]
        self.hidden = []
        for i in range(m["layers"]):
            layer = nn.Linear(width, m["hidden"])
            setattr(self, f"hidden{i}", layer)
            self.hidden.append(layer)
            width = m["hidden"]
        self.output = nn.Linear(width, m["vocab"])
        self.activation = F.gelu if m["activation"] == "gelu" else torch.tanh

    def blocks(self):
        return [self.embed, *self.hidden, self.output]

    def forward(self, windows):
        h = self.embed(windows[:, : self.context]).flatten(1)
        for layer in self.hidden:
            h = self.activation(layer(h))
        return F.cross_entropy(self.output(h), windows[:, self.context])


def rank_slice(batch, rank, world):
    """zest's charlm::rank_slice: rank r takes [floor(r*B/world), floor((r+1)*B/world))."""
    return batch * rank // world, batch * (rank + 1) // world


def local_tensor(t):
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors):
    """The bytes of the distinct storages behind `tensors` (views of one bucket count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = local_tensor(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class PeakCounter:
    """Samples parameters, gradients and optimizer states at every block's forward and backward
    (before and after) and around the optimizer step, while `enabled`; keeps the sample with the
    largest sum. Off during the timed steps: sampling walks every tensor, which would slow them."""

    def __init__(self, model, blocks, optimizer_fn):
        self.model = model
        self.sharded = list(model.parameters())  # FSDP2: the DTensors, whatever the module holds now
        self.optimizer_fn = optimizer_fn
        self.peak = (0, 0, 0)
        self.enabled = False
        for block in blocks:
            block.register_forward_pre_hook(lambda *_: self.sample())
            block.register_forward_hook(lambda *_: self.sample())
            block.register_full_backward_pre_hook(lambda *_: self.sample())
            block.register_full_backward_hook(lambda *_: self.sample())

    def sample(self):
        if not self.enabled:
            return
        current = list(self.model.parameters())  # FSDP2 swaps in the unsharded ones while a block runs
        params = storage_bytes(self.sharded + current)
        grads = storage_bytes([p.grad for p in self.sharded + current])
        optimizer = self.optimizer_fn()
        states = [] if optimizer is None else [
            v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        sample = (params, grads, storage_bytes(states))
        if sum(sample) > sum(self.peak):
            self.peak = sample


def rss_field(name):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    # Writing 5 to clear_refs restarts VmHWM from the current resident size (Linux 4.0+), as zest
    # does per row.
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def max_over_ranks(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def run_peer(kind, m, init, batches, rank, world):
    model = CharMlp(m)
    with torch.no_grad():
        at = 0
        named = dict(model.named_parameters())
        for tensor in m["tensors"]:
            p = named[tensor["name"]]
            assert list(p.shape) == tensor["shape"], (tensor["name"], list(p.shape), tensor["shape"])
            p.copy_(torch.from_numpy(init[at:at + p.numel()]).view_as(p))
            at += p.numel()
    blocks = model.blocks()
    if kind == "ddp":
        # gradient_as_bucket_view: .grad are views into DDP's buckets, so the buckets are counted
        # once, as gradients (without it DDP holds the buckets and .grad both).
        trained = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        # CPUOffloadPolicy pins its host copies by default, which needs a CUDA driver: the default
        # row says so on a machine without one, and the pin_memory=False row runs there.
        policy = {"fsdp2": OffloadPolicy(), "fsdp2-offload": CPUOffloadPolicy(),
                  "fsdp2-offload-unpinned": CPUOffloadPolicy(pin_memory=False)}[kind]
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        trained = model
    optimizer = None
    counter = PeakCounter(model, blocks, lambda: optimizer)
    cls = torch.optim.AdamW if m["optimizer"] == "adamw" else torch.optim.Adam
    optimizer = cls(model.parameters(), lr=m["lr"], betas=(m["beta1"], m["beta2"]), eps=m["eps"],
                    weight_decay=m["weight_decay"])
    lo, hi = rank_slice(m["global_batch"], rank, world)

    def step(windows):
        optimizer.zero_grad(set_to_none=True)
        local = trained(windows)
        local.backward()
        counter.sample()
        optimizer.step()
        counter.sample()
        return local

    seconds, loss = [], 0.0
    for s in range(m["steps"]):
        windows = torch.from_numpy(batches[s, lo:hi]).long()
        dist.barrier()
        start = time.perf_counter()
        local = step(windows)
        seconds.append(time.perf_counter() - start)
        # The global batch's mean loss (equal slices: the mean of the ranks' means).
        total = local.detach().clone()
        dist.all_reduce(total)
        loss = total.item() / world
    # The memory at a step's peak, sampled in one more step on the last batch (every step after the
    # first holds the same: optimizer states exist from the first step's end), untimed and after the
    # loss the rows compare.
    counter.enabled = True
    step(torch.from_numpy(batches[m["steps"] - 1, lo:hi]).long())
    return counter.peak, seconds, loss


PEERS = [("torch DDP + AdamW", "ddp"), ("FSDP2 fully_shard + AdamW", "fsdp2"),
         ("FSDP2 + CPUOffloadPolicy + AdamW", "fsdp2-offload"),
         ("FSDP2 + CPUOffloadPolicy(pin_memory=False)", "fsdp2-offload-unpinned")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", help="the directory zest bench memory --write-peer-inputs wrote")
    parser.add_argument("--json", required=True, help="where rank 0 writes the rows (must not exist)")
    args = parser.parse_args()

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # as zest's ranks: 4 ranks share 2 cores here
    # The embedding's inputs are token ids: its full backward hooks fire on its outputs' gradients,
    # which is when they are meant to sample.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if rank == 0 and os.path.exists(args.json):
        sys.exit(f"memory_peers.py: {args.json} exists; it is never overwritten: give a new path")

    with open(os.path.join(args.inputs, "model.json")) as f:
        m = json.load(f)
    init = np.fromfile(os.path.join(args.inputs, "init.f32"), dtype=np.float32)
    window = m["context"] + 1
    batches = np.fromfile(os.path.join(args.inputs, "batches.i32"), dtype=np.int32).reshape(
        m["steps"], m["global_batch"], window)
    params = int(init.size)

    rows = []
    for name, kind in PEERS:
        row = {"name": name, "system": "torch", "error": "", "ranks": world, "params": params}
        dist.barrier()
        reset_peak_rss()
        start_rss = rss_field("VmRSS")
        try:
            peak, seconds, loss = run_peer(kind, m, init, batches, rank, world)
            failed = 0
        except Exception as e:  # the row says why; the other ranks must learn it too
            peak, seconds, loss, failed = (0, 0, 0), [0.0], 0.0, 1
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        if max_over_ranks([failed])[0]:
            row["error"] = row["error"] or "another rank failed (its error is on its stderr)"
            rows.append(row)
            continue
        p, g, o = max_over_ranks(list(peak))
        start, top = max_over_ranks([start_rss, rss_field("VmHWM")])
        rest = sorted(seconds[1:]) or seconds
        row.update(peak_params_bytes=p, peak_grads_bytes=g, peak_optimizer_states_bytes=o,
                   peak_model_state_bytes=p + g + o, start_host_rss_bytes=start, peak_host_rss_bytes=top,
                   step_seconds=statistics.median(rest), final_loss=loss)
        rows.append(row)
    if rank == 0:
        with open(args.json, "x") as f:
            json.dump({"torch": torch.__version__, "peers": rows}, f, indent=1)
        for r in rows:
            print(f"{r['name']}: " + (f"could not run: {r['error']}" if r["error"] else
                  f"{(r['peak_model_state_bytes']) / 2**20:.1f} MiB per rank, {1000 * r['step_seconds']:.1f} ms per "
                  f"step, loss {r['final_loss']:.6f}"))
    # Every rank is done, and rank 0's file is written. Then out without interpreter teardown: in
    # the pinned torch, destroying the gloo group (or letting exit do it) aborts now and then with
    # "terminate called without an active exception" (a thread still joinable), failing the job.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
