"""Stream order on a GPU (issue 33): zest's work waits for torch's streams by events, as FSDP2's
does, not by luck. Each case makes torch's side of a hand-off late with a long spin of the GPU
(torch.cuda._sleep) on the stream the values are made on, so that a missing wait reads values that
are not there yet and the step differs from torch.optim.AdamW's on the same data:

- gradients made late on a side stream (forward and backward under torch.cuda.stream), while
  step() is called on the default stream: zest's reduction must wait for the side stream;
- parameters read on a side stream right after step(), whose update was queued behind a spin on
  the default stream: step() returns with its writes done (README, "On a GPU").

Each case also runs torch's own AdamW the same way, without the wait a correct program would add,
and asserts that it does see the wrong values: the spin outlasts the host, so the case can fail.
CUDA alone, in a world of one (conftest's `cuda` fixture skips elsewhere, saying why)."""

import math

import pytest
import torch
import torch.nn.functional as F

import zest.torch
from models import CUDA_RTOL, assert_near, batch, make, max_rel_diff

LR, WD, STEPS = 1e-2, 0.05, 3
FIRST_BATCH = 500  # batches no other case trains on: stale memory cannot hold these gradients by chance
SPIN = int(5e7)  # GPU cycles, ~25 ms at 2 GHz: far longer than the host takes to queue what follows


class LateGradient(torch.autograd.Function):
    """Identity whose backward first spins the GPU on the current stream (the one its forward ran
    on): on the model's output, every parameter's gradient is made after the spin."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(SPIN)
        return grad


def loss_on(model, step, device, late=False):
    tokens, target = batch(FIRST_BATCH + step, 0, 1, 0, device=device)
    out = model(tokens)
    if late:
        out = LateGradient.apply(out)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def backward_on_side_stream(model, step, device, side):
    """Forward and backward on `side` (autograd runs each backward op on its forward's stream, and
    backward() orders only the stream it is called on after them: here `side`), the gradients late."""
    side.wait_stream(torch.cuda.current_stream())  # the model and the last step's writes, as a program would
    with torch.cuda.stream(side):
        loss_on(model, step, device, late=True).backward()


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def reference(device, steps):
    """torch's own, in order on the default stream: the parameters after each step."""
    model = make(device=device)
    opt = adamw(model)
    after = []
    for step in range(steps):
        loss_on(model, step, device).backward()
        opt.step()
        opt.zero_grad()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def config(stage, offload):
    cfg = {"stage": stage, "comm": {"timeout": "60s"}, "optimizer": {"lr": LR, "weight_decay": WD},
           "buckets": {"reduce": "1KiB", "allgather": "1KiB"}, "stage3": {"persistence_threshold": 0}}
    if offload != "none":
        cfg["offload"] = {"optimizer": {"device": offload}}
    return cfg


def differs(seen, expected):
    """Far outside the equality bound, NaN included (unfinished memory may hold anything)."""
    worst = max_rel_diff(seen, expected)
    return math.isnan(worst) or worst > 100 * CUDA_RTOL


CASES = [(0, "none"), (2, "cpu"), (3, "none")]


@pytest.mark.parametrize("stage,offload", CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_reduction_waits_for_gradients_late_on_a_side_stream(stage, offload, cuda):
    side = torch.cuda.Stream(device=cuda)

    # The control first (before the reference makes these gradients anywhere): torch's AdamW
    # stepped on the default stream without waiting for the side stream reads unfinished gradients.
    control = make(device=cuda)
    control_opt = adamw(control)
    backward_on_side_stream(control, 0, cuda, side)
    control_opt.step()
    torch.cuda.synchronize()
    after = reference(cuda, STEPS)
    assert differs(list(control.parameters()), after[0]), \
        "torch's AdamW without a wait saw the gradients: the spin no longer outlasts the host; raise SPIN"

    model = make(device=cuda)
    opt = zest.torch.Optimizer(model, config(stage, offload))
    for step in range(STEPS):
        backward_on_side_stream(model, step, cuda, side)
        opt.step()  # on the default stream: only zest's events order its reduction after the side stream
    full = opt.full_parameters()
    opt.close()
    assert_near(full.values(), after[-1], cpu_tol=None)


@pytest.mark.parametrize("stage,offload", CASES[:2], ids=[f"stage{s}-{o}" for s, o in CASES[:2]])
def test_parameters_read_on_a_side_stream_right_after_step(stage, offload, cuda):
    reader = torch.cuda.Stream(device=cuda)
    after = reference(cuda, STEPS)

    def step_behind_a_spin_and_read(model, opt, step):
        loss_on(model, step, cuda).backward()
        torch.cuda._sleep(SPIN)  # the update is queued behind it on the default stream
        opt.step()
        opt.zero_grad()
        with torch.cuda.stream(reader):  # no wait: what step() left in the parameters now
            seen = [p.detach().clone() for p in model.parameters()]
        torch.cuda.synchronize()
        return seen

    control = make(device=cuda)
    assert differs(step_behind_a_spin_and_read(control, adamw(control), 0), after[0]), \
        "a side stream saw torch's AdamW's update at once: the spin no longer outlasts the host; raise SPIN"

    model = make(device=cuda)  # stages 0-2: the parameters hold zest's values between steps
    opt = zest.torch.Optimizer(model, config(stage, offload))
    for step in range(STEPS):
        assert_near(step_behind_a_spin_and_read(model, opt, step), after[step], cpu_tol=None)
    opt.close()
