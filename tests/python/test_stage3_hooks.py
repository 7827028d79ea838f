"""Stage 3 without wrapper calls: the module hooks gather each module's own parameters for its
forward and its backward and release them otherwise; a parameter on the root module, a module
used twice in one forward and a frozen parameter train as under DDP + AdamW."""

import pytest
import torch
from torch import nn

import zest.torch
from conftest import RANK, WORLD
from models import assert_near, data_parallel, device_of, gradient_went_to_zest, held, make, train

SEEN = []  # (what, storage bytes) recorded during forward and backward


storage = held


class Probe(nn.Linear):
    """A Linear that records whether its weight, and another module's, has storage during its
    forward and during its backward."""

    def __init__(self, name, n_in, n_out, other=None):
        super().__init__(n_in, n_out)
        self.name, self.other = name, [other] if other is not None else []

    def forward(self, x):
        SEEN.append((f"{self.name} forward", storage(self.weight)))
        for other in self.other:
            SEEN.append((f"{self.name} forward: other", storage(other.weight)))
        out = super().forward(x)
        if out.requires_grad:
            weight = self.weight
            out.register_hook(lambda g: SEEN.append((f"{self.name} backward", storage(weight))))
        return out


class Tricky(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((7,), 0.5))  # on the root: the root gathers only it
        self.out = Probe("out", 7, 3)
        self.inp = Probe("inp", 4, 7, other=self.out)      # out's weight must not be there yet
        self.shared = Probe("shared", 7, 7)                 # used twice per forward
        self.frozen = nn.Linear(7, 7)
        self.frozen.weight.requires_grad_(False)            # stays torch's; its bias trains

    def forward(self, x):
        SEEN.append(("root forward: inp", storage(self.inp.weight)))
        h = torch.relu(self.inp(x)) * self.scale
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(self.frozen(h))


def data(step, micro, world, rank, device):
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    per = 8 // world
    return x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)


def run(model, opt, steps):
    for step in range(steps):
        x, y = data(step, 0, WORLD, RANK, device_of(model))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


CONFIG = {"stage": 3, "comm": {"timeout": "60s"}, "optimizer": {"lr": 1e-2},
          "stage3": {"persistence_threshold": 0}, "buckets": {"reduce": "1KiB", "allgather": "1KiB"}}


def test_hooks_gather_own_parameters_and_train_as_ddp(device, ddp):
    ref = make(Tricky, device)
    ref_ddp = data_parallel(ref, ddp)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    run(ref_ddp, ref_opt, 4)

    model = make(Tricky, device)
    frozen_before = model.frozen.weight.detach().clone()
    opt = zest.torch.Optimizer(model, CONFIG)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(storage(p) == 0 for p in trained), "released between uses"
    assert storage(model.frozen.weight) > 0, "a frozen parameter stays torch's"

    SEEN.clear()
    run(model, opt, 4)
    seen = dict()
    for what, size in SEEN:
        seen.setdefault(what, set()).add(size)
    assert seen["root forward: inp"] == {0}, "the root's hook gathers the root's own parameter only"
    assert seen["inp forward: other"] == {0}, "a module gathers its own parameters only"
    for name in ("inp", "shared", "out"):
        assert 0 not in seen[f"{name} forward"], f"{name} is gathered for its forward"
        assert 0 not in seen[f"{name} backward"], f"{name} is gathered for its backward"
    assert all(storage(p) == 0 for p in trained), "released after backward and step"
    assert all(gradient_went_to_zest(p) for p in trained)

    with torch.no_grad():  # evaluation: gathered for forward, released after, nothing for backward
        model(torch.randn(2, 4, device=device))
    assert all(storage(p) == 0 for p in trained)

    opt.close()
    assert torch.equal(model.frozen.weight, frozen_before)
    assert_near(model.parameters(), ref.parameters(), 2e-6)


def test_errors_name_the_zest_way(device):
    model = make(Tricky, device)
    with pytest.raises(zest.Error, match="give the module"):
        zest.torch.Optimizer(model.named_parameters(), CONFIG)
    with pytest.raises(zest.ConfigError, match="stgae"):
        zest.torch.Optimizer(model, {"stgae": 2})
    with pytest.raises(zest.Error, match="path of a zest YAML"):
        zest.torch.Optimizer(model, 3)
    with pytest.raises(zest.Error, match="config holds a set"):
        zest.torch.Optimizer(model, {"stage": 1, "optimizer": {"betas": {0.9, 0.99}}})
    opt = zest.torch.Optimizer(model, dict(CONFIG, stage=1))
    with pytest.raises(zest.Error, match=r"save\(dir\)"):
        opt.state_dict()
    with pytest.raises(zest.Error, match=r"load\(dir"):
        opt.load_state_dict({})
    with pytest.raises(zest.Error, match="param_groups"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    opt.close()
    with pytest.raises(zest.Error, match="closed"):
        opt.step()


@pytest.mark.skipif(WORLD != 1, reason="torchrun's WORLD_SIZE beside a world of one MPI rank")
def test_torchrun_without_mpirun_is_refused(device, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(zest.Error, match="mpirun -np 2"):
        zest.torch.Optimizer(make(Tricky, device), dict(CONFIG, stage=0))


class Tied(nn.Module):
    """A head tied to the embedding (GPT-2's): one parameter, owned by two modules, with a
    gradient from each use."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.fc(self.embed(tokens))))


@pytest.mark.parametrize("stage", [0, 3])
def test_tied_weights_train_as_ddp(stage, device, ddp):
    ref = make(Tied, device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(data_parallel(ref, ddp), ref_opt, torch.optim.lr_scheduler.StepLR(ref_opt, 2), 3, WORLD, RANK)

    model = make(Tied, device)
    opt = zest.torch.Optimizer(model, dict(CONFIG, stage=stage))
    assert len(opt.param_groups[0]["params"]) == 3, "the tied weight is trained once"
    train(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), 3, WORLD, RANK)
    opt.close()
    assert model.head.weight is model.embed.weight
    assert_near(model.parameters(), ref.parameters(), 2e-6)
