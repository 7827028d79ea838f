"""zest's Lightning strategies (zest.lightning) against Lightning's own strategy="ddp" with
torch.optim.AdamW, on the cpu at 2 devices: the same unchanged LightningModule (train.py: two
param groups, a per-step StepLR, gradient_clip_val, accumulate_grad_batches=2) ends with the same
parameters under every registered zest strategy, in fp32 and in bf16-mixed; a checkpoint saved
after the first epoch at 2 devices, stage 3 with offload, resumed on 1 device at stages 1 and 3,
ends where the uninterrupted run does; what the strategies do not support is refused by name.

Not part of the mpirun suite (Lightning launches its own processes): run_tests.sh runs
    python -m pytest -q tests/python/lightning/checks.py --confcutdir tests/python/lightning
Within 1e-5 (the runs agree within ~1e-7: fp32 sums in another order); a wrong lr, group,
clip, step count or restored state moves parameters by ~1e-3 (lr 1e-2).
"""

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train  # noqa: E402  (the runs' LightningModule and data)

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.strategies import StrategyRegistry  # noqa: E402

import zest  # noqa: E402
import zest.lightning  # noqa: E402
from zest.lightning import ZestStrategy  # noqa: E402

TOL = 1e-5
LAUNCH_TIMEOUT = 150  # seconds; a launch takes about 20 (2 devices, 9 fits) on 2 cores
STEPS = 2 * train.BATCHES_PER_EPOCH // train.ACCUMULATE  # two epochs

ZEST = list(zest.lightning.STRATEGIES)
TWO_DEVICES = ([{"name": "ddp", "strategy": "ddp"}, {"name": "ddp-bf16", "strategy": "ddp", "precision": "bf16-mixed"},
                {"name": "zest_stage_3-bf16", "strategy": "zest_stage_3", "precision": "bf16-mixed"}]
               # zest_stage_1 takes the scheduler in configure_optimizers' list form, the others the dict
               # form; zest_stage_3_offload saves a checkpoint after each epoch, the first for RESUMED.
               + [{"name": name, "strategy": name, **({"form": "list"} if name == "zest_stage_1" else {}),
                   **({"save": "{out}/ckpt"} if name == "zest_stage_3_offload" else {})} for name in ZEST])
RESUMED = {"resumed-stage_1": "zest_stage_1", "resumed-stage_3": "zest_stage_3"}

# The launcher's rank variables (mpirun's, torchrun's, or Lightning's own from an in-process fit
# below) would make Lightning take the launch for one of theirs.
_RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                   "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED")


def _launch(devices, runs, out):
    env = {k: v for k, v in os.environ.items()
           if k not in _RANK_VARIABLES and not k.startswith(("OMPI_", "PMIX_", "TORCHELASTIC_"))}
    # A session of its own: Lightning's ranks are its children, and a hung launch ends with all of them.
    launch = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--devices", str(devices), "--out", out,
                               "--runs", json.dumps(runs)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=out, start_new_session=True)
    try:
        output, _ = launch.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        output, _ = launch.communicate()
        pytest.fail(f"train.py at {devices} devices ran past {LAUNCH_TIMEOUT} s (hung?); killed:\n{output[-8000:]}")
    except BaseException:  # interrupted: the ranks go too
        os.killpg(launch.pid, signal.SIGKILL)
        raise
    assert launch.returncode == 0, f"train.py at {devices} devices failed:\n{output[-8000:]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lightning"))
    _launch(2, [{k: v.format(out=out) if isinstance(v, str) else v for k, v in run.items()} for run in TWO_DEVICES],
            out)
    _launch(1, [{"name": name, "strategy": strategy, "resume": f"{out}/ckpt/epoch=0.ckpt"}
                for name, strategy in RESUMED.items()], out)
    runs = {name[:-3]: torch.load(os.path.join(out, name)) for name in os.listdir(out) if name.endswith(".pt")}
    return out, runs


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("strategy", ZEST)
def test_zest_strategy_trains_as_ddp_with_adamw(results, strategy):
    _, runs = results
    assert runs[strategy]["global_step"] == runs["ddp"]["global_step"] == STEPS
    assert max_diff(runs[strategy]["state"], runs["ddp"]["state"]) < TOL


def test_zest_clips_as_lightning_would(results):
    # Every step's norm is above gradient_clip_val, so a clip left undone would show in the parameters.
    norms = results[1]["zest_stage_2"]["norms"]
    assert len(norms) == STEPS and min(norms) > train.CLIP


def test_bf16_mixed_trains_as_ddp(results):
    _, runs = results
    assert max_diff(runs["zest_stage_3-bf16"]["state"], runs["ddp-bf16"]["state"]) < TOL
    assert max_diff(runs["ddp-bf16"]["state"], runs["ddp"]["state"]) > 1e-3, "autocast made no difference"


def test_checkpoint_is_a_directory_with_the_full_weights(results):
    out, runs = results
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    path = os.path.join(out, "ckpt", "epoch=1.ckpt")  # at the end of the run
    assert sorted(os.listdir(path)) == [zest.lightning.LIGHTNING_FILE, zest.lightning.ZEST_DIR]
    # Saved at stage 3 (each rank holds a shard): lightning.ckpt still has the full tensors,
    # which any strategy's load_from_checkpoint reads.
    module = train.Classifier.load_from_checkpoint(os.path.join(path, zest.lightning.LIGHTNING_FILE))
    assert max_diff(module.state_dict(), runs["zest_stage_3_offload"]["state"]) == 0


@pytest.mark.parametrize("name", list(RESUMED))
def test_resumed_at_another_stage_and_device_count(results, name):
    _, runs = results
    assert runs[name]["global_step"] == STEPS
    assert runs[name]["state"]["steps_seen"] == runs["ddp"]["state"]["steps_seen"]  # the buffer came back
    assert max_diff(runs[name]["state"], runs["ddp"]["state"]) < TOL


def test_import_zest_does_not_import_lightning():
    code = "import sys, zest, zest.torch; assert 'pytorch_lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_without_lightning_says_what_to_install():
    code = "import sys; sys.modules['pytorch_lightning'] = None; import zest.lightning"  # as if not installed
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert done.returncode != 0 and "ImportError: zest.lightning:" in done.stdout
    assert "pip install pytorch-lightning" in done.stdout


def test_registered_names():
    assert set(ZEST) == {"zest_stage_0", "zest_stage_1", "zest_stage_2", "zest_stage_3", "zest_stage_2_offload",
                         "zest_stage_3_offload"}
    assert set(ZEST) <= set(StrategyRegistry.available_strategies())


# --- in this process, on one device


def test_schedulers_move_onto_zest_unnoticed(tmp_path):
    # torch warns when a scheduler's optimizer.step() was replaced after the scheduler was built.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_trainer(tmp_path))
    assert not [w for w in caught if "optimizer.step()" in str(w.message)]



class _Scheduled(train.Classifier):
    """configure_optimizers' other schedulers: nested (SequentialLR) and metric-driven (ReduceLROnPlateau,
    whose threshold makes every step after the first a plateau, so that it halves the lr each step)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler
        if self.kind == "sequential":
            inner = [sched.LinearLR(opt, start_factor=0.5, total_iters=2), sched.StepLR(opt, step_size=1, gamma=0.7)]
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched.SequentialLR(opt, inner, milestones=[2]),
                                                       "interval": "step"}}
        plateau = sched.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10, threshold_mode="abs")
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "loss", "interval": "step"}}


@pytest.mark.parametrize("kind", ["sequential", "plateau"])
def test_other_schedulers_act_on_zest(tmp_path, kind):
    modules = {strategy: _Scheduled(kind) for strategy in ("ddp", "zest_stage_2")}
    for strategy, module in modules.items():
        _fit(_trainer(tmp_path, strategy=strategy, max_epochs=2), module)
    lr = modules["zest_stage_2"].trainer.optimizers[0].param_groups[0]["lr"]
    assert lr < 1e-2 / 4, "the schedule did not act"
    assert max_diff(modules["zest_stage_2"].state_dict(), modules["ddp"].state_dict()) < TOL


def _trainer(tmp_path, strategy="zest_stage_2", **kwargs):
    options = dict(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, default_root_dir=str(tmp_path), accumulate_grad_batches=train.ACCUMULATE)
    options.update(kwargs)
    return pl.Trainer(**options)


def _fit(trainer, module=None, batches=train.BATCHES_PER_EPOCH, ckpt_path=None):
    loader = train.data(1)
    if batches != train.BATCHES_PER_EPOCH:
        subset = torch.utils.data.Subset(loader.dataset, range(batches * train.GLOBAL_BATCH))
        loader = torch.utils.data.DataLoader(subset, batch_size=train.GLOBAL_BATCH)
    trainer.fit(module or train.Classifier(), loader, ckpt_path=ckpt_path)


class _Flagged(train.Classifier):
    def __init__(self, **adamw):
        super().__init__()
        self.adamw = adamw

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, **self.adamw)


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_refuses_adam_variants_zest_does_not_run(tmp_path, flag):
    with pytest.raises(zest.Error, match=f"zest.lightning: param group 0 of AdamW has {flag}=True"):
        _fit(_trainer(tmp_path), _Flagged(**{flag: True}))


def test_refuses_other_optimizers(tmp_path):
    class WithSGD(train.Classifier):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(zest.Error, match="configure_optimizers gave SGD; zest runs Adam and AdamW"):
        _fit(_trainer(tmp_path), WithSGD())


def test_refuses_manual_optimization(tmp_path):
    class Manual(train.Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(zest.Error, match="manual optimization"):
        _fit(_trainer(tmp_path, accumulate_grad_batches=1), Manual())  # Lightning's own refusal comes first else


def test_refuses_clipping_by_value(tmp_path):
    with pytest.raises(zest.Error, match="gradient_clip_algorithm='value'"):
        _fit(_trainer(tmp_path, gradient_clip_val=1.0, gradient_clip_algorithm="value"))


def test_refuses_precisions_that_touch_the_gradients(tmp_path):
    with pytest.raises(zest.Error, match="precision '16-true'"):
        _trainer(tmp_path, precision="16-true")


def test_refuses_a_config_that_disagrees_with_the_module(tmp_path):
    with pytest.raises(zest.Error, match="the config sets optimizer.lr to 0.5, but configure_optimizers' AdamW "
                                         "gives 0.01"):
        _fit(_trainer(tmp_path, strategy=ZestStrategy({"stage": 1, "optimizer": {"lr": 0.5}})))
    with pytest.raises(zest.Error, match="accumulate_grad_batches=2.* gradient_accumulation_steps is 3"):
        _fit(_trainer(tmp_path, strategy=ZestStrategy({"gradient_accumulation_steps": 3})))


def test_refuses_an_epoch_that_ends_inside_an_accumulation(tmp_path):
    with pytest.raises(zest.Error, match="1 backward passes before optimizer step 1, but zest takes exactly "
                                         "accumulate_grad_batches \\(2\\)"):
        _fit(_trainer(tmp_path), batches=3)


def test_refuses_a_zero_lr(tmp_path):
    class WarmupFromZero(train.Classifier):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 10)]

    with pytest.raises(zest.Error, match="param group 0 starts with lr 0.0"):
        _fit(_trainer(tmp_path), WarmupFromZero())


def test_a_checkpoint_after_fit_is_weights_only(tmp_path):
    trainer = _trainer(tmp_path)
    module = train.Classifier()
    _fit(trainer, module)
    with pytest.raises(zest.Error, match="the zest optimizer ended with fit"):
        trainer.save_checkpoint(tmp_path / "after")
    trainer.save_checkpoint(tmp_path / "weights", weights_only=True)
    assert not (tmp_path / "weights" / zest.lightning.ZEST_DIR).exists()
    saved = train.Classifier.load_from_checkpoint(tmp_path / "weights" / zest.lightning.LIGHTNING_FILE)
    assert max_diff(saved.state_dict(), module.state_dict()) == 0
    # Resuming training from it would start Adam afresh: refused.
    with pytest.raises(zest.Error, match="holds the weights only"):
        _fit(_trainer(tmp_path, max_epochs=2), ckpt_path=tmp_path / "weights")


def test_refuses_to_resume_from_another_strategys_file(tmp_path):
    trainer = _trainer(tmp_path, strategy="ddp")
    _fit(trainer)
    trainer.save_checkpoint(tmp_path / "ddp.ckpt")
    with pytest.raises(zest.Error, match="is a file, not a zest strategy's checkpoint directory"):
        _fit(_trainer(tmp_path, max_epochs=2), ckpt_path=tmp_path / "ddp.ckpt")
