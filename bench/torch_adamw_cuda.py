"""torch.optim.AdamW on one CUDA GPU, the peer of `zest bench adam --device cuda`.

Times optimizer.step() over one fp32 tensor of --params values (fused and foreach kernels) and
prints one JSON line per implementation: parameters per second, the median of --reps steps after
two warm-ups, with their spread. Run on a GPU machine next to zest's figure (scripts/gpu-kit does).
"""
import argparse
import json
import statistics

import torch


def time_step(params: int, reps: int, **impl) -> list[float]:
    p = torch.zeros(params, device="cuda", requires_grad=True)
    p.grad = torch.full_like(p, 0.5)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **impl)
    for _ in range(2):
        opt.step()
    seconds = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e8)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_adamw_cuda.py: torch sees no CUDA GPU")
    n = int(args.params)
    for name, impl in (("torch AdamW fused", {"fused": True}), ("torch AdamW foreach", {"foreach": True})):
        s = time_step(n, args.reps, **impl)
        print(json.dumps({"peer": name, "torch": torch.__version__, "params": n,
                          "params_per_s": n / statistics.median(s),
                          "min_params_per_s": n / max(s), "max_params_per_s": n / min(s)}))


if __name__ == "__main__":
    main()
