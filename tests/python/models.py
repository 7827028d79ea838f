"""Small models and data for the equivalence tests: odd sizes, every layer kind the GPT uses."""

import torch
import torch.nn.functional as F
from torch import nn

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


def make(cls=Net):
    torch.manual_seed(0)  # the same values on every rank, and in the reference
    return cls()


def batch(step, micro, world, rank, global_batch=GLOBAL_BATCH):
    """This rank's equal slice of the global batch of (step, micro)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    target = torch.randint(0, CLASSES, (global_batch, SEQ), generator=g)
    per = global_batch // world
    return tokens[rank * per:(rank + 1) * per], target[rank * per:(rank + 1) * per]


def loss_of(model, tokens, target, accum):
    """The rank's mean loss, divided by the micro-batches of a step (as with AdamW)."""
    out = model(tokens)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)) / accum


def train(model, opt, sched, steps, world, rank, accum=1, clip=0.0, start=0, params=None, norms=None):
    """Runs steps start..steps-1; returns each step's loss. `clip` clips with torch (the
    reference; zest clips by its config); `norms` gets the gradient norm of each step (torch's
    from clip_grad_norm_, or zest's last_step)."""
    losses = []
    for step in range(start, steps):
        total = 0.0
        for micro in range(accum):
            tokens, target = batch(step, micro, world, rank)
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


def max_diff(a_params, b_params):
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(a_params, b_params))


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
