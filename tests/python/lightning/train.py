"""Lightning runs for checks.py: one launch, one or more fits in a row, each the same unchanged
LightningModule (AdamW with two param groups and a per-step StepLR, a buffer the steps count) on
the same data, under the strategy, precision and device count given.

    python train.py --devices 2 --out DIR --runs '[{"name": "ddp", "strategy": "ddp"}, ...]'

Lightning's own launcher starts the other ranks (it runs this command again); each run's rank 0
writes DIR/NAME.pt: the module's state dict after fit, and the gradient norms zest reported.
Global batches do not depend on the device count (DistributedSampler without shuffling: rank r
takes samples r, r + D, ...), so that a run resumed on other devices continues the same training.
A run: name, strategy, precision ("32-true"), epochs (2), form ("dict" or "list": how
configure_optimizers returns the scheduler), save (a directory: ModelCheckpoint writes epoch=N.ckpt
there at the end of epoch N), resume (a checkpoint for fit(ckpt_path=...)).
"""

import argparse
import json
import os
import sys

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402  (tests/python/models.py: the equivalence tests' model)
import zest.lightning  # noqa: E402,F401  (registers the zest strategies)

torch.set_num_threads(1)  # two ranks on two cores

GLOBAL_BATCH, ACCUMULATE, BATCHES_PER_EPOCH, CLIP = 8, 2, 6, 0.05


class Classifier(pl.LightningModule):
    def __init__(self, form="dict"):
        super().__init__()
        self.net = models.make()
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))
        self.form = form

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        self.steps_seen += 1
        return models.loss_of(self.net, tokens, target, 1)

    def configure_optimizers(self):
        groups = models.no_decay_groups(self.net, weight_decay=0.1)
        groups[1]["lr"] = 2e-2
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-7)
        sched = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), "interval": "step"}
        return ([opt], [sched]) if self.form == "list" else {"optimizer": opt, "lr_scheduler": sched}


class Norms(pl.Callback):
    """zest's gradient norm of each step (before clipping)."""

    def __init__(self):
        self.norms = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        last_step = getattr(trainer.optimizers[0], "last_step", None)
        if last_step is not None and (batch_idx + 1) % ACCUMULATE == 0:
            self.norms.append(last_step.grad_norm)


def data(devices):
    g = torch.Generator().manual_seed(1)
    n = GLOBAL_BATCH * BATCHES_PER_EPOCH
    tokens = torch.randint(0, models.VOCAB, (n, models.SEQ), generator=g)
    target = torch.randint(0, models.CLASSES, (n, models.SEQ), generator=g)
    return DataLoader(TensorDataset(tokens, target), batch_size=GLOBAL_BATCH // devices, shuffle=False)


def run(spec, devices, out):
    norms = Norms()
    callbacks = [norms]
    if spec.get("save"):
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=spec["save"], filename="{epoch}", save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=spec["strategy"],
                         precision=spec.get("precision", "32-true"), max_epochs=spec.get("epochs", 2),
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, callbacks=callbacks,
                         enable_checkpointing=bool(spec.get("save")), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    module = Classifier(spec.get("form", "dict"))
    trainer.fit(module, data(devices), ckpt_path=spec.get("resume"))
    if trainer.is_global_zero:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        torch.save({"state": state, "norms": norms.norms, "global_step": trainer.global_step},
                   os.path.join(out, spec["name"] + ".pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True, help="a JSON list of runs (see the module's doc)")
    args = parser.parse_args()
    for spec in json.loads(args.runs):
        run(spec, args.devices, args.out)


if __name__ == "__main__":
    main()
