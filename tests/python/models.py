"""Small models and data for the equivalence tests: odd sizes, every layer kind the GPT uses; and
how a case compares zest with its torch reference on each device."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VOCAB, CLASSES, GLOBAL_BATCH, SEQ = 11, 5, 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.fc1 = nn.Linear(6, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, CLASSES)

    def forward(self, tokens):
        h = torch.tanh(self.fc1(self.embed(tokens)))
        return self.fc2(self.norm(h))


def make(cls=Net, device="cpu"):
    torch.manual_seed(0)  # the same values on every rank, and in the reference
    return cls().to(device)


def batch(step, micro, world, rank, global_batch=GLOBAL_BATCH, device="cpu"):
    """This rank's equal slice of the global batch of (step, micro), on `device`."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    target = torch.randint(0, CLASSES, (global_batch, SEQ), generator=g)
    per = global_batch // world
    return tokens[rank * per:(rank + 1) * per].to(device), target[rank * per:(rank + 1) * per].to(device)


def device_of(model):
    return next(model.parameters()).device


def data_parallel(model, group):
    """The reference's model: DistributedDataParallel over the gloo group on the cpu; on a GPU the
    model itself, since the cuda cases run in a world of one (conftest), where DDP would average
    each gradient over one rank (and gloo's CUDA collectives are not what is tested)."""
    if device_of(model).type == "cpu":
        return DistributedDataParallel(model, process_group=group)
    assert group.size() == 1, "the cuda cases run in a world of one"
    return model


def loss_of(model, tokens, target, accum):
    """The rank's mean loss, divided by the micro-batches of a step (as with AdamW)."""
    out = model(tokens)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)) / accum


def train(model, opt, sched, steps, world, rank, accum=1, clip=0.0, start=0, params=None, norms=None):
    """Runs steps start..steps-1 on the model's device; returns each step's loss. `clip` clips
    with torch (the reference; zest clips by its config); `norms` gets the gradient norm of each
    step (torch's from clip_grad_norm_, or zest's last_step)."""
    losses = []
    device = device_of(model)
    for step in range(start, steps):
        total = 0.0
        for micro in range(accum):
            tokens, target = batch(step, micro, world, rank, device=device)
            loss = loss_of(model, tokens, target, accum)
            loss.backward()
            total += loss.item()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(params if params is not None else model.parameters(), clip)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        if norms is not None and not clip:
            norms.append(opt.last_step.grad_norm)
        opt.zero_grad()
        sched.step()
        losses.append(total)
    return losses


def no_decay_groups(model, weight_decay):
    """AdamW's groups matching the zest config's optimizer.param_groups below: group 0 the
    weights, group 1 biases and norms without weight decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or name.startswith("norm.") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


NO_DECAY = [{"match": ["*.bias", "norm.*"], "weight_decay": 0.0}]


def _largest(per_tensor):
    # torch's max keeps a NaN (Python's max drops it when it is not first): NaN fails every bound.
    return torch.stack(list(per_tensor)).max().item()


def max_diff(a_params, b_params):
    """The largest absolute difference, compared on the cpu (full_parameters() are cpu tensors
    whatever the model's device)."""
    return _largest((a.detach().cpu() - b.detach().cpu()).abs().max() for a, b in zip(a_params, b_params))


# On a GPU (a world of one: no reduction across ranks) zest's Adam kernel and torch's differ only
# in the order of their fp32 operations: each element agrees within CUDA_RTOL of its size, an
# element smaller than CUDA_FLOOR measured against CUDA_FLOOR. A wrong step, lr or clip moves an
# element by ~1e-3 (the cases' lr is 1e-2, and an Adam step moves an element by about lr): 200 times
# the bound at |p| = 0.5, 1e4 times at the floor.
CUDA_RTOL, CUDA_FLOOR = 1e-5, 1e-2


def max_rel_diff(a_params, b_params, floor=CUDA_FLOOR):
    return _largest(((a.detach().cpu() - b.detach().cpu()).abs() / b.detach().cpu().abs().clamp_min(floor)).max()
                    for a, b in zip(a_params, b_params))


def assert_near(actual, expected, cpu_tol):
    """zest's parameters (`actual`) equal the torch reference's (`expected`) in the measure of
    the reference's device: within cpu_tol absolute on the cpu (each test's fp32 tolerance, with
    its reasons), within CUDA_RTOL relative on a GPU."""
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected)
    if expected[0].device.type == "cpu":
        assert max_diff(actual, expected) < cpu_tol
    else:
        worst = max_rel_diff(actual, expected)
        assert worst < CUDA_RTOL, f"{worst:.2e} relative from torch's parameters on {expected[0].device}"


def near(values, device, cpu_tol):
    """What a list of losses (or norms) is compared with: within cpu_tol absolute on the cpu,
    CUDA_RTOL relative on a GPU."""
    return pytest.approx(values, abs=cpu_tol) if device.type == "cpu" else pytest.approx(values, rel=CUDA_RTOL)


def held(p):
    """Bytes of values a parameter holds: 0 when zest released it (stage 3 between uses: any
    access to its data raises zest's message)."""
    storage = p.untyped_storage()
    try:
        pointer = storage.data_ptr()
    except RuntimeError as e:
        assert "released" in str(e), e
        return 0
    return storage.nbytes() if pointer else 0


def gradient_went_to_zest(p):
    """.grad of a trained parameter after backward: a placeholder whose any read says where the
    gradient went."""
    try:
        p.grad.sum()
    except RuntimeError as e:
        return "not in .grad" in str(e)
    return False
