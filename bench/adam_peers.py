"""The peers of zest's CPU Adam, timed for `zest bench adam --peers`.

zest runs this as a child (python -c, the text compiled into zest) kept alive for the whole run, so
that its rounds and the peers' interleave and drifting machine load affects them alike. It talks
in lines on stdin/stdout:

  started with  --params N --lr X --beta1 X --beta2 X --eps X --weight-decay X
  it answers    "ready<TAB>torch:V deepspeed:V<TAB><ok or why not><TAB>..." (a field per peer) once
                its peers are built, or "error <text>"
  "round T"     one untimed, then one timed step of each peer at T threads -> "times <seconds or
                nan> ..." (seconds of the timed step)
  "check N K"   K steps of every peer on N parameters from the inputs check_inputs() makes
                (zest makes the same) -> one line per peer "values <v1> ... <vN>" (or
                "values unavailable"), so zest can compare the updates with its own
  end of input  exit

The peers, in this order: DeepSpeed's CPU Adam (its op built by DeepSpeed's own CPUAdamBuilder,
unmodified), torch.optim.AdamW(foreach=True), torch.optim.AdamW(fused=True). Each owns its
parameters, gradients and states (16 bytes a parameter, as zest's), all fp32.
"""
import argparse
import os
import sys
import time

# Libraries print (DeepSpeed's logger, warnings): the protocol gets a private copy of stdout and
# everything else written to fd 1 goes to stderr.
_protocol = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

PEERS = ("deepspeed", "torch-foreach", "torch-fused")


def reply(line):
    _protocol.write(line + "\n")
    _protocol.flush()


def fail(text):
    reply("error " + " ".join(text.split()))
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    for name in ("--lr", "--beta1", "--beta2", "--eps", "--weight-decay"):
        ap.add_argument(name, type=float, required=True)
    ap.add_argument("--params", type=int, required=True)
    args = ap.parse_args()

    # A machine without a GPU: DeepSpeed's accelerator must be told (it would look for CUDA).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's op is built (once) and kept in the environment, beside the torch it is built
    # against, rather than in ~/.cache shared by every torch (scripts/python-env.sh builds it there).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    try:
        import torch
        import deepspeed  # noqa: F401 (its accelerator and version)
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as e:
        fail(f"{sys.executable} cannot import torch and deepspeed ({e}): make the environment with "
             "scripts/python-env.sh (source scripts/setup.sh does), which installs "
             "python/requirements.txt and python/requirements-peers.txt, and pass its python "
             "with --python or set ZEST_VENV")

    hyper = dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                 weight_decay=args.weight_decay)

    def make(peer, params):
        """The optimizer over `params`, or raises (the row then says why)."""
        if peer == "deepspeed":
            return DeepSpeedCPUAdam(params, adamw_mode=True, **hyper)
        if peer == "torch-foreach":
            return torch.optim.AdamW(params, foreach=True, **hyper)
        return torch.optim.AdamW(params, fused=True, **hyper)

    def tensors(n, p=None):
        p = torch.empty(n, dtype=torch.float32) if p is None else p
        param = torch.nn.Parameter(p)
        param.grad = torch.empty(n, dtype=torch.float32)
        return param

    # The bench's inputs (zest's formula): bounded, normal-range values.
    n = args.params
    base = 0.5 + (torch.arange(n, dtype=torch.int64) % 1000).to(torch.float32) * 1e-3
    status, opts = {}, {}
    for peer in PEERS:
        try:
            param = tensors(n, base.clone())
            param.grad.copy_(base - 1.0)
            opt = make(peer, [param])
            opt.step()  # allocates the states: no first-touch page faults in timed steps
            opts[peer] = opt
            status[peer] = "ok"
        except Exception as e:  # noqa: BLE001 (any failure is reported in the row)
            status[peer] = " ".join(f"{type(e).__name__}: {e}".split())  # one line, no tabs
    del base
    versions = f"torch:{torch.__version__} deepspeed:{deepspeed.__version__}"
    reply("\t".join(["ready", versions] + [status[p] for p in PEERS]))

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "round":
            # torch.set_num_threads sets torch's intra-op pool and OpenMP's (the libgomp torch
            # ships, which DeepSpeed's op uses too: it links none of its own).
            torch.set_num_threads(int(words[1]))
            times = []
            for peer in PEERS:
                if peer not in opts:
                    times.append("nan")
                    continue
                # An untimed step first, so the timed one finds its arrays in the caches as
                # zest's step finds its own (after zest's roofline pass over the same arrays):
                # at sizes that fit in the caches all rows are timed warm; at 1e8 parameters
                # (1.6 GB each) the caches hold nothing from one step to the next either way.
                opts[peer].step()
                start = time.perf_counter()
                opts[peer].step()
                times.append(repr(time.perf_counter() - start))
            reply("times " + " ".join(times))
        elif words[0] == "check":
            count, steps = int(words[1]), int(words[2])
            for peer in PEERS:
                if peer not in opts:
                    reply("values unavailable")
                    continue
                param = tensors(count)
                param.data.copy_(check_inputs(torch, count, 0))
                opt = make(peer, [param])
                for k in range(1, steps + 1):
                    param.grad.copy_(check_inputs(torch, count, k))
                    opt.step()
                reply("values " + " ".join(repr(float(x)) for x in param.data.tolist()))
        else:
            fail(f"unknown request {line.strip()!r}")


def check_inputs(torch, count, k):
    """The parameters (k = 0) or step k's gradients of a check: zest computes the same in fp32."""
    i = torch.arange(count, dtype=torch.int64)
    if k == 0:
        return 0.5 + ((i * 7) % 1000).to(torch.float32) * 1e-3
    return ((i * 13 + k * 101) % 1000).to(torch.float32) * 1e-3 - 0.5


if __name__ == "__main__":
    main()
