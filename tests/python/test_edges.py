"""Edges where torch code meets zest (issue 34 item 5): each gave torch's message, or ran silently,
before. zest's message names the problem and the fix, or zest does what torch would. On each
device (the conftest's `device` fixture: cuda where a GPU is visible in a world of one)."""

import pytest
import torch
from torch import nn

import zest.torch
from zest import Error


def small(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(device)


def message_of(call):
    with pytest.raises(Error) as raised:
        call()
    return str(raised.value)


def test_an_empty_config_path_is_named(device):
    assert "config='' names no file" in message_of(lambda: zest.torch.Optimizer(small(device), ""))


def test_a_name_given_twice_is_refused(device):
    model = small(device)
    named = [("w", model[0].weight), ("w", model[1].weight)]
    assert "the name 'w' is given twice" in message_of(lambda: zest.torch.Optimizer(named, {"stage": 1}))


def test_a_sparse_embedding_is_refused_at_construction(device):
    class WithEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(10, 4, sparse=True)

    message = message_of(lambda: zest.torch.Optimizer(WithEmbedding().to(device), {"stage": 1}))
    assert "module 'tokens' is Embedding(sparse=True)" in message and "sparse=False" in message


def test_a_non_leaf_tensor_is_refused(device):
    leaf = torch.ones(3, requires_grad=True, device=device)
    message = message_of(lambda: zest.torch.Optimizer([("doubled", leaf * 2)], {"stage": 1}))
    assert "parameter 'doubled' is not a leaf tensor" in message


def test_full_parameters_load_strictly_into_a_model_with_tied_weights(device):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.embed(tokens))

    torch.manual_seed(0)
    model = Tied().to(device)
    opt = zest.torch.Optimizer(model, {"stage": 2, "optimizer": {"lr": 1e-2}})
    model(torch.tensor([[1, 2, 3]], device=device)).sum().backward()
    opt.step()
    full = opt.full_parameters()
    assert set(full) == set(model.state_dict())
    fresh = Tied()
    fresh.load_state_dict(full, strict=True)
    assert torch.equal(fresh.head.weight, full["embed.weight"])
    opt.close()


def test_a_backward_count_other_than_the_accumulation_is_refused(device):
    model = small(device)
    opt = zest.torch.Optimizer(model, {"stage": 1, "gradient_accumulation_steps": 2})
    model(torch.ones(2, 4, device=device)).sum().backward()
    message = message_of(opt.step)
    assert "1 backward pass(es) since the last step, but gradient_accumulation_steps is 2" in message
    opt.close()


def test_zeroing_grad_in_place_names_what_to_do_instead(device):
    model = small(device)
    opt = zest.torch.Optimizer(model, {"stage": 1})
    model(torch.ones(2, 4, device=device)).sum().backward()
    with pytest.raises(RuntimeError) as raised:
        model.zero_grad(set_to_none=False)
    message = str(raised.value)
    assert "is not in .grad" in message and "zero_grad(set_to_none=False) does not" in message
    assert "zest::torch" not in message  # no C++ names for a Python user
    model.zero_grad()  # set_to_none, torch's default: fine
    opt.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_write_to_fp32_parameters_between_steps_is_what_the_next_step_updates(stage, device):
    """As with torch's AdamW: at stages 0-2 with fp32 parameters and states, the parameters are zest's
    master weights, so `p.mul_()` between steps is what the next step starts from (a separate
    master would overwrite it: off by half a weight)."""
    model, ref = small(device), small(device)
    opt = zest.torch.Optimizer(model, {"stage": stage, "optimizer": {"lr": 1e-2, "weight_decay": 0.01}})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.linspace(-1, 1, 8, device=device).reshape(2, 4)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().sum().backward()
            o.step()
            m.zero_grad()
            if step == 0:
                with torch.no_grad():
                    for p in m.parameters():
                        p.mul_(0.5)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    opt.close()
