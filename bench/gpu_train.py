"""A PyTorch GPT on one GPU, trained by torch's optimizers and by zest (issue 33), in two parts:

(a) speed and device memory on one model: torch.optim.AdamW (fused) against zest stage 0, stage 3,
    and stage 3 with the optimizer on the host: tokens/s (the median step after warm-up) and
    torch.cuda.max_memory_allocated(), which counts zest's device memory too (it comes from torch's
    caching allocator);
(b) the largest GPT that trains, for torch AdamW (fused), FSDP2 (fully_shard + CPUOffloadPolicy,
    one rank), zest stage 3 with the optimizer on the host (fp32 and int8 states), and zest stage 3
    with the optimizer and the parameters on the host: the model grows (depth and width together)
    until a trial fails, then bisects, while the time allows; each kind's largest model, its
    tokens/s, and what bounds it (device memory, host memory, or time).

    python bench/gpu_train.py [--budget-s 300] [--parts a,b] [--json FILE]

The model is examples/python/gpt.py's GPT (imported), fp32 parameters under torch.autocast (bf16),
fed random tokens: a fixed batch of sequences, the same data for every kind. Each trial runs in a
subprocess of its own with a timeout, so that a device OOM, a crash or a hang ends that trial
only, and its max_memory_allocated is its own. The whole run keeps within --budget-s: a trial is
not started when the time left is less than it is predicted to take (from the kind's last trial),
and the JSON (written after every trial) says so. A world of one: no MPI, no launcher.

Runs only where a CUDA GPU is visible (scripts/gpu-kit run runs it on the GPU machine); elsewhere it
prints a "skipped" line and exits 0."""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "python"))

VOCAB, SEQ = 50304, 1024  # GPT-2's vocabulary (padded to a multiple of 64) and context
LR = 1e-4

# What each kind trains with. device/host: bytes per parameter it needs there (fp32 parameters,
# gradients and Adam's m and v: 16; int8 m and v: 10; every model is first built on the GPU: 4),
# for the first trial's size and to refuse a trial whose pinned memory would meet the OOM killer
# rather than an error. seconds: a trial's time per parameter until one of the kind has run (a
# guess: taking pinned memory, page by page, and the CPU's Adam are the slow part of the host's
# kinds); like: the kind of part (a) whose trial says more (part (b) runs after it).
KINDS = {
    "torch": dict(label="torch AdamW (fused)", device=18, host=0, seconds=3e-9),  # +2: autocast's bf16 copies
    "fsdp2-offload": dict(label="FSDP2 + CPUOffloadPolicy", device=4, host=16, seconds=25e-9),
    "zest-stage0": dict(label="zest stage 0", device=16, host=0, seconds=3e-9, config={"stage": 0}),
    "zest-stage3": dict(label="zest stage 3", device=16, host=0, seconds=3e-9, config={"stage": 3}),
    "zest-stage3-host": dict(label="zest stage 3, optimizer on the host", device=4, host=16, seconds=20e-9,
                             config={"stage": 3, "offload": {"optimizer": {"device": "cpu"}}}),
    "zest-stage3-host-int8": dict(label="zest stage 3, optimizer on the host, int8 states", device=4, host=10,
                                  seconds=20e-9, like="zest-stage3-host",
                                  config={"stage": 3, "offload": {"optimizer": {"device": "cpu"}},
                                          "optimizer": {"states": "int8"}}),
    "zest-stage3-host-params": dict(label="zest stage 3, optimizer and parameters on the host", device=4, host=20,
                                    seconds=25e-9, like="zest-stage3-host",
                                    config={"stage": 3, "offload": {"optimizer": {"device": "cpu"},
                                                                    "param": {"device": "cpu"}}}),
}
PART_A = dict(kinds=["torch", "zest-stage0", "zest-stage3", "zest-stage3-host"],
              layers=24, embed=1024, batch=8, warmup=3, steps=8)  # GPT-2 medium's shape, 355M parameters
PART_B = dict(kinds=["torch", "fsdp2-offload", "zest-stage3-host", "zest-stage3-host-int8", "zest-stage3-host-params"],
              batch=4, warmup=2, steps=3)
HEAD_DIM = 128
# Widths and depths of the GPT-3 family (Brown et al., table 2.1): a size picks the widest rung it
# reaches and the depth that makes up the rest, so a model grows in depth and width together.
RUNGS = [(768, 12), (1024, 24), (1536, 24), (2048, 24), (2560, 32), (4096, 32), (5120, 40), (6144, 44),
         (8192, 48), (12288, 96)]
STARTUP_S = 8.0  # a trial's fixed cost: Python, torch, CUDA's context
HOST_SHARE = 0.85  # of MemAvailable a trial may plan to take


def gpt_parameters(layers, embed):
    # Per block: attention 4E^2+4E, MLP 8E^2+5E, two LayerNorms 4E; the token embedding is tied
    # to the head; the position embedding and the last LayerNorm.
    return layers * (12 * embed * embed + 13 * embed) + VOCAB * embed + SEQ * embed + 2 * embed


def shape_for(parameters):
    embed, _ = RUNGS[0]
    for width, depth in RUNGS:
        if gpt_parameters(depth, width) <= parameters:
            embed = width
    per_layer = 12 * embed * embed + 13 * embed
    layers = max(1, round((parameters - gpt_parameters(0, embed)) / per_layer))
    return layers, embed


# --- one trial (in its own process) ---------------------------------------------------------------

def trial(spec):
    """Trains spec's model with spec's kind for warmup + steps steps; returns the figures, or what
    stopped it (bound: "device memory", "host memory", or "error")."""
    import torch
    import torch.nn.functional as F
    from gpt import GPT

    kind = KINDS[spec["kind"]]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out = {"parameters": gpt_parameters(spec["layers"], spec["embed"])}
    step_seconds, losses = [], []
    distributed = None
    try:
        torch.manual_seed(0)  # the same weights in every trial of a size
        with torch.device(device):
            model = GPT(VOCAB, SEQ, spec["embed"], spec["embed"] // HEAD_DIM, spec["layers"])
        out["parameters"] = sum(p.numel() for p in model.parameters())
        if spec["kind"] == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        elif spec["kind"] == "fsdp2-offload":
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
            distributed = dist
            mesh = init_device_mesh("cuda", (1,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
            fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
            # The sharded parameters are on the host: torch's fused CPU AdamW steps them there.
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        else:
            import zest.torch

            config = json.loads(json.dumps(kind["config"]))
            # All the GPU has: device.memory's default is the cpu device's budget (2GiB), and 0 needs
            # device.type cuda said (the engine follows the parameters' device either way).
            config["device"] = {"type": "cuda", "memory": 0}
            config.setdefault("optimizer", {}).update(lr=LR, betas=[0.9, 0.95], weight_decay=0.1)
            opt = zest.torch.Optimizer(model, config)
        # The training's peak, not the construction's: every kind builds the whole model on the GPU
        # first (FSDP2 and zest's parameter offload then move it to the host). What is still
        # allocated (the model, zest's buffers and states) counts in the peak from here.
        out["construction_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        g = torch.Generator(device=device).manual_seed(1)
        for _ in range(spec["warmup"] + spec["steps"]):
            began = time.perf_counter()
            data = torch.randint(0, VOCAB, (spec["batch"], SEQ + 1), device=device, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1).float(), data[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize(device)
            step_seconds.append(time.perf_counter() - began)
            losses.append(loss.item())
    except torch.cuda.OutOfMemoryError as e:  # zest.OutOfMemoryError is one too
        return dict(out, ok=False, bound="device memory", error=str(e)[:600], step_seconds=step_seconds)
    except Exception as e:  # noqa: BLE001 (the trial reports what stopped it; the run goes on)
        text = f"{type(e).__name__}: {e}"
        bound = "error"
        if "out of memory" in text.lower():
            pinned = any(word in text.lower() for word in ("pin", "host", "cudahostalloc"))
            bound = "host memory" if pinned else "device memory"
        return dict(out, ok=False, bound=bound, error=text[:600], step_seconds=step_seconds)
    finally:
        if distributed is not None:
            distributed.destroy_process_group()
    measured = step_seconds[spec["warmup"]:]
    return dict(out, ok=True, tokens_per_second=spec["batch"] * SEQ / statistics.median(measured),
                step_seconds=step_seconds, losses=losses,
                max_memory_allocated_bytes=torch.cuda.max_memory_allocated(device), peak_rss_bytes=peak_rss())


def peak_rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the run ----------------------------------------------------------------------------------------

def mem_available():
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def gpu():
    """The GPU's name and memory, from nvidia-smi: the parent keeps no CUDA context of its own,
    which would take device memory from the trials."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                               "--id=0"], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        name, mib = line.rsplit(",", 1)
        return name.strip(), int(mib) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError):
        return "unknown", 80 * 2**30


class Run:
    def __init__(self, args):
        self.deadline = time.monotonic() + args.budget_s
        self.json_path = args.json
        name, memory = gpu()
        import torch
        self.doc = {"gpu": name, "gpu_memory_bytes": memory, "host_memory_available_bytes": mem_available(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "budget_s": args.budget_s,
                    "vocab": VOCAB, "sequence": SEQ, "precision": "fp32 parameters, bf16 autocast"}
        self.began = time.monotonic()

    def left(self):
        return self.deadline - time.monotonic()

    def save(self):
        self.doc["elapsed_s"] = round(time.monotonic() - self.began, 1)
        if self.json_path:
            with open(self.json_path + ".tmp", "w") as f:
                json.dump(self.doc, f, indent=1)
                f.write("\n")
            os.replace(self.json_path + ".tmp", self.json_path)

    def trial(self, kind, layers, embed, batch, warmup, steps, timeout):
        """One trial in a subprocess; its result with wall_s, and bound "time" on a timeout, "crash"
        on a signal (SIGKILL: most likely the OOM killer, i.e. host memory)."""
        spec = dict(kind=kind, layers=layers, embed=embed, batch=batch, warmup=warmup, steps=steps)
        began = time.monotonic()
        print(f"  {kind}: {layers} layers x {embed} ({gpt_parameters(layers, embed) / 1e9:.2f}B), "
              f"timeout {timeout:.0f} s", flush=True)
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--trial",
                                 json.dumps(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            result = dict(ok=False, bound="time", error=f"the trial took over {timeout:.0f} s")
        else:
            lines = [line[len("TRIAL "):] for line in stdout.splitlines() if line.startswith("TRIAL ")]
            if lines:
                result = json.loads(lines[-1])
            elif proc.returncode == -9:
                result = dict(ok=False, bound="host memory", error="killed by SIGKILL (the OOM killer?)")
            else:
                result = dict(ok=False, bound="crash", error=f"exit status {proc.returncode}")
        result.update(spec, wall_s=round(time.monotonic() - began, 1))
        result.setdefault("parameters", gpt_parameters(layers, embed))
        if not result["ok"]:
            result["stderr_tail"] = stderr[-3000:]
        verdict = (f"{result['tokens_per_second']:.0f} tokens/s, max_memory_allocated "
                   f"{result['max_memory_allocated_bytes'] / 2**30:.1f} GiB" if result["ok"]
                   else f"failed: {result['bound']}: {result['error'][:200]}")
        print(f"    {verdict} ({result['wall_s']} s)", flush=True)
        return result

    def part_a(self, share):
        spec = PART_A
        ends = time.monotonic() + share
        results = []
        self.doc["a"] = {"layers": spec["layers"], "embed": spec["embed"], "batch": spec["batch"],
                         "parameters": gpt_parameters(spec["layers"], spec["embed"]), "runs": results}
        print(f"(a) GPT of {spec['layers']} layers x {spec['embed']}, batch {spec['batch']} x {SEQ}", flush=True)
        for n, kind in enumerate(spec["kinds"]):
            left = ends - time.monotonic()
            if left < STARTUP_S * 2:
                results.append(dict(kind=kind, ok=False, bound="time", error="not run: part (a)'s time was spent"))
                continue
            # An equal share of what is left for each kind not yet run, but half a minute at least
            # where there is that much: a trial cut short measures nothing.
            result = self.trial(kind, spec["layers"], spec["embed"], spec["batch"], spec["warmup"], spec["steps"],
                                max(left / (len(spec["kinds"]) - n), min(left, 30.0)))
            results.append(dict(result, label=KINDS[kind]["label"]))
            self.save()

    def part_b(self):
        spec = PART_B
        self.doc["b"] = {"batch": spec["batch"], "kinds": {}}
        print(f"(b) the largest GPT that trains, batch {spec['batch']} x {SEQ}", flush=True)
        kinds = spec["kinds"]
        for n, kind in enumerate(kinds):
            ends = time.monotonic() + self.left() / (len(kinds) - n)
            entry = {"label": KINDS[kind]["label"], "trials": []}
            self.doc["b"]["kinds"][kind] = entry
            self.largest(kind, entry, ends)
            self.save()

    def largest(self, kind, entry, ends):
        """Grows the model (x2) until a trial fails, then bisects between the largest that trained
        and the smallest that failed, until they are within 30% or the kind's time is spent."""
        spec, costs = PART_B, KINDS[kind]
        # The time of the kind's last trial that trained predicts the next one's (in proportion to
        # the parameters, past the fixed cost); before any, part (a)'s trial of the same kind (or
        # of the one it is like), which ran on this machine; else the kind's guess.
        like = costs.get("like", kind)
        last = next((r for r in self.doc.get("a", {}).get("runs", []) if r["kind"] == like and r["ok"]), None)

        def predict(parameters):
            if last is None:
                return STARTUP_S + costs["seconds"] * parameters
            return STARTUP_S + max(0.0, last["wall_s"] - STARTUP_S) * parameters / last["parameters"]

        size = 0.85 * self.doc["gpu_memory_bytes"] / max(costs["device"], 4) / 2
        if costs["host"]:
            size = min(size, 1.0e9)  # pinned memory is slow to take: the time, not memory, bounds the first trials
        # A first trial that fits the kind's time with room to spare, so that something trains
        # (down to part (a)'s model).
        smallest = gpt_parameters(PART_A["layers"], PART_A["embed"])
        while predict(size) > (ends - time.monotonic()) / 1.5 and size / 2 >= smallest:
            size /= 2
        passed, failed = None, None  # (parameters, result)
        while True:
            layers, embed = shape_for(size)
            params = gpt_parameters(layers, embed)
            if passed and params <= passed[0] or failed and params >= failed[0]:
                break  # the shapes between them are exhausted
            left = ends - time.monotonic()
            predicted = predict(params)
            host_need = costs["host"] * params
            if host_need > HOST_SHARE * mem_available():
                result = dict(ok=False, bound="host memory", kind=kind, layers=layers, embed=embed, parameters=params,
                              error=f"not run: needs ~{host_need / 2**30:.0f} GiB of host memory, over "
                                    f"{HOST_SHARE:.0%} of the {mem_available() / 2**30:.0f} GiB available")
            elif predicted > left:
                entry["time"] = (f"a trial of {params / 1e9:.2f}B would take ~{predicted:.0f} s, "
                                 f"{max(0.0, left):.0f} s left")
                break
            else:
                result = self.trial(kind, layers, embed, spec["batch"], spec["warmup"], spec["steps"],
                                    min(left, 2 * predicted + 30))
                last = result if result["ok"] else last
            entry["trials"].append(result)
            if result["ok"]:
                passed = (params, result)
            elif result["bound"] in ("device memory", "host memory", "time"):
                failed = (params, result)
            else:
                break  # an error or a crash is not a bound: reported as it is
            if failed is None:
                size = params * 2
            elif passed is None:
                size = params / 2
                if size < gpt_parameters(1, RUNGS[0][0]):
                    break
            elif failed[0] / passed[0] < 1.3:
                break
            else:
                size = math.sqrt(passed[0] * failed[0])
        entry["largest"] = passed[1] if passed else None
        errors = [t["bound"] for t in entry["trials"] if not t["ok"]]
        entry["bound"] = failed[1]["bound"] if failed else "time" if "time" in entry or not errors else errors[-1]
        details = [f"{failed[0] / 1e9:.2f}B failed: {failed[1].get('error', '')[:300]}"] if failed else []
        if "time" in entry:  # the search was cut short: the largest may be larger
            details.append(entry["time"])
        if details:
            entry["bound_detail"] = "; ".join(details)

    def report(self):
        print()
        if "a" in self.doc:
            a = self.doc["a"]
            print(f"(a) {a['parameters'] / 1e6:.0f}M parameters, batch {a['batch']} x {SEQ}, bf16 autocast, {self.doc['gpu']}")
            torch_run = next((r for r in a["runs"] if r["kind"] == "torch" and r["ok"]), None)
            for r in a["runs"]:
                if not r["ok"]:
                    print(f"  {KINDS[r['kind']]['label']:<52} failed: {r['bound']}")
                    continue
                ratio = (f"  {r['tokens_per_second'] / torch_run['tokens_per_second']:.2f}x torch's tokens/s, "
                         f"{r['max_memory_allocated_bytes'] / torch_run['max_memory_allocated_bytes']:.2f}x its memory"
                         if torch_run else "")
                print(f"  {KINDS[r['kind']]['label']:<52} {r['tokens_per_second']:7.0f} tokens/s "
                      f"{r['max_memory_allocated_bytes'] / 2**30:7.2f} GiB{ratio}")
        if "b" in self.doc:
            print(f"(b) the largest GPT that trains, batch {self.doc['b']['batch']} x {SEQ}, bf16 autocast")
            for kind, entry in self.doc["b"]["kinds"].items():
                best = entry.get("largest")
                at_least = ">= " if entry.get("bound") == "time" else ""
                what = (f"{at_least}{best['parameters'] / 1e9:.2f}B ({best['layers']} x {best['embed']}), "
                        f"{best['tokens_per_second']:.0f} tokens/s" if best else "none trained")
                print(f"  {entry['label']:<52} {what}; bounded by {entry.get('bound')}"
                      + (f" ({entry['bound_detail']})" if entry.get("bound_detail") else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=300.0, help="the whole run's time, in seconds")
    parser.add_argument("--parts", default="a,b", help="a, b or a,b")
    parser.add_argument("--json", help="write the results here (after every trial)")
    parser.add_argument("--trial", help=argparse.SUPPRESS)  # one trial's spec (JSON): the subprocess's job
    args = parser.parse_args()
    if args.trial:
        print("TRIAL " + json.dumps(trial(json.loads(args.trial))), flush=True)
        return 0
    parts = set(args.parts.split(","))
    if not parts or parts - {"a", "b"}:
        parser.error(f"--parts {args.parts}: give a, b or a,b")
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s}: give the run's time in seconds, more than 0")

    import torch
    if not torch.cuda.is_available():
        reason = ("no CUDA GPU (torch.cuda.is_available() is False): this benchmark runs on a GPU machine "
                  "(scripts/gpu-kit run)")
        print(f"gpu_train: skipped: {reason}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": reason}, f)
                f.write("\n")
        return 0

    run = Run(args)
    print(f"gpu_train: {run.doc['gpu']}, {run.doc['gpu_memory_bytes'] / 2**30:.0f} GiB; "
          f"{run.doc['host_memory_available_bytes'] / 2**30:.0f} GiB of host memory available; "
          f"budget {args.budget_s:.0f} s", flush=True)
    if "a" in parts:
        run.part_a(run.left() * (0.5 if "b" in parts else 1.0))
    if "b" in parts:
        run.part_b()
    run.save()
    run.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
