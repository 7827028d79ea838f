"""zest.torch.Optimizer against torch.optim.AdamW under DistributedDataParallel, at the rank count
mpirun gave: every stage, offloaded optimizer states (cpu, nvme), with a StepLR schedule, gradient
clipping, two micro-batches per step and param groups; and a checkpoint saved at one rank count,
resumed at another, equal to the run that was not interrupted.

Tolerance: fp32 noise. zest reduces in other buckets and orders than DDP and computes Adam in its
own kernel, so results agree to rounding, amplified a little by Adam's normalisation; 2e-6 absolute
on parameters of size ~0.5 after a few steps at lr 1e-2 is ~1e4 ulps below any real difference
(a wrong step, lr or clip moves them by ~1e-3). On a GPU (a world of one) within 1e-5 relative
(models.CUDA_RTOL)."""

import os

import pytest
import torch

import zest
import zest.torch
from conftest import RANK, WORLD
from models import (NO_DECAY, assert_near, batch, data_parallel, gradient_went_to_zest, loss_of, make, near,
                    no_decay_groups, train)

LR, WD, CLIP, ACCUM, STEPS = 1e-2, 0.05, 0.5, 2, 5
TOL = 2e-6


def zest_config(stage, offload="none", path=""):
    cfg = {
        "stage": stage,
        "comm": {"timeout": "60s"},
        "optimizer": {"lr": LR, "weight_decay": WD, "param_groups": NO_DECAY},
        "gradient_clipping": CLIP,
        "gradient_accumulation_steps": ACCUM,
        # Small buckets and no resident small groups: several collectives and real stage-3 gathers
        # even for this small model.
        "buckets": {"reduce": "1KiB", "allgather": "1KiB"},
        "stage3": {"persistence_threshold": 0},
    }
    if offload != "none":
        cfg["offload"] = {"optimizer": {"device": offload, "path": path}}
        if offload == "nvme":
            cfg["io"] = {"block_size": "4KiB"}
    return cfg


def reference(steps, ddp_group, device, norms=None):
    """torch's own: AdamW + StepLR + clip_grad_norm_ under DDP at this rank count, on `device`."""
    model = make(device=device)
    ddp_model = data_parallel(model, ddp_group)
    opt = torch.optim.AdamW(no_decay_groups(model, WD), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = train(ddp_model, opt, sched, steps, WORLD, RANK, accum=ACCUM, clip=CLIP, norms=norms)
    return model, losses, [g["lr"] for g in opt.param_groups]


def case_dir(shared_dir, name, device):
    path = os.path.join(shared_dir, f"np{WORLD}-{device.type}-{name}")
    os.makedirs(path, exist_ok=True)
    return path


CASES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "nvme"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,offload", CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_equals_ddp_adamw(stage, offload, device, ddp, shared_dir):
    ref_norms, norms = [], []
    ref_model, ref_losses, ref_lrs = reference(STEPS, ddp, device, ref_norms)

    model = make(device=device)
    path = case_dir(shared_dir, f"stage{stage}-{offload}", device) if offload == "nvme" else ""
    opt = zest.torch.Optimizer(model, zest_config(stage, offload, path))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = train(model, opt, sched, STEPS, WORLD, RANK, accum=ACCUM, norms=norms)
    assert min(norms) > CLIP, "the case should clip"
    assert norms == pytest.approx(ref_norms, rel=1e-5), "the norm of the averaged gradients, as torch's"
    assert [g["lr"] for g in opt.param_groups] == ref_lrs
    assert all(gradient_went_to_zest(p) for p in model.parameters()), "gradients go to zest, not .grad"
    full = opt.full_parameters()
    assert list(full) == [name for name, _ in ref_model.named_parameters()]
    assert all(t.device.type == "cpu" for t in full.values()), "full_parameters() are cpu tensors"
    assert_near(full.values(), ref_model.parameters(), TOL)
    opt.close()  # stage 3: the parameters get their values back

    assert losses == near(ref_losses, device, TOL)
    assert all(p.device == ref_model.fc1.weight.device for p in model.parameters())
    assert_near(model.parameters(), ref_model.parameters(), TOL)


def test_checkpoint_resumes_at_another_rank_count(device, ddp, shared_dir):
    """Saved after 3 of 6 steps at stage 2 on this many ranks; then the checkpoint the launcher
    names (ZEST_TEST_RESUME_FROM: saved by its previous run, at another rank count) is loaded at
    stage 3 with a fresh StepLR, which load() puts at step 3; the last 3 steps end where the
    uninterrupted reference does. On a GPU (a world of one, without a previous run on a GPU) the
    checkpoint loaded is the one this case saved."""
    total, cut = 6, 3
    model = make(device=device)
    opt = zest.torch.Optimizer(model, zest_config(2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, sched, cut, WORLD, RANK, accum=ACCUM)
    opt.save(os.path.join(shared_dir, f"ckpt-np{WORLD}-{device.type}"))
    opt.close()

    saved_at = os.environ.get("ZEST_TEST_RESUME_FROM", WORLD) if device.type == "cpu" else WORLD
    source = os.path.join(shared_dir, f"ckpt-np{saved_at}-{device.type}")
    resumed = make(device=device)
    with torch.no_grad():  # other values than the checkpoint's: load must overwrite them
        for p in resumed.parameters():
            p.add_(1.0)
    opt = zest.torch.Optimizer(resumed, zest_config(3))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    result = opt.load(source, sched)
    assert result.steps == cut
    assert sched.last_epoch == cut and sched.get_last_lr() == [LR * 0.5, LR * 0.5]
    train(resumed, opt, sched, total, WORLD, RANK, accum=ACCUM, start=cut)
    opt.close()

    ref_model, _, ref_lrs = reference(total, ddp, device)
    assert sched.get_last_lr() == ref_lrs
    assert_near(resumed.parameters(), ref_model.parameters(), TOL)


def test_sum_instead_of_mean(device, ddp):
    """average_gradients=False: gradients are summed over ranks (the engine's own convention), so
    a loss divided by the world size gives the mean again."""
    ref_model, _, _ = reference(2, ddp, device)
    model = make(device=device)
    opt = zest.torch.Optimizer(model, zest_config(2), average_gradients=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    for step in range(2):
        for micro in range(ACCUM):
            tokens, target = batch(step, micro, WORLD, RANK, device=device)
            (loss_of(model, tokens, target, ACCUM) / WORLD).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.close()
    assert_near(model.parameters(), ref_model.parameters(), TOL)
