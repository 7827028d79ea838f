"""zest.lightning: zest as a PyTorch Lightning strategy.

    import zest.lightning  # registers zest_stage_0 ... zest_stage_3_offload
    trainer = pl.Trainer(strategy="zest_stage_3_offload", devices=2, precision="bf16-mixed")
    # or a config of your own:  pl.Trainer(strategy=zest.lightning.ZestStrategy("zest.yaml"))

The LightningModule stays as it is: its ``configure_optimizers`` returns ``torch.optim.AdamW`` (or
Adam), with param groups and lr schedulers in any of Lightning's forms; the strategy builds a
``zest.torch.Optimizer`` with the same groups and hyper-parameters and moves the schedulers onto
it. Data is sharded as under ``strategy="ddp"`` (a DistributedSampler per rank); there is no
DistributedDataParallel wrapper, since zest reduces the gradients itself (averaged over ranks, as
DDP does). Checkpoints are directories: ``lightning.ckpt`` (Lightning's dict, with the full model
weights) and ``zest/`` (zest's sharded checkpoint), loadable at any stage and device count.

Needs pytorch-lightning (``import zest`` does not).
"""

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

try:
    import pytorch_lightning as pl
    import yaml  # a dependency of pytorch-lightning
except ImportError as _missing:
    raise ImportError(f"zest.lightning: {_missing}; zest's Lightning strategies need pytorch-lightning: "
                      "pip install pytorch-lightning (python/requirements.txt pins the tested version)") from _missing

from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.enums import GradClipAlgorithmType
from pytorch_lightning.utilities.rank_zero import rank_zero_info

import zest.torch
from zest import Error

__all__ = ["ZestStrategy", "STRATEGIES"]

# The registered names and their configs (zest_stage_N_offload: the optimizer states in host memory).
STRATEGIES = {
    "zest_stage_0": {"stage": 0},
    "zest_stage_1": {"stage": 1},
    "zest_stage_2": {"stage": 2},
    "zest_stage_3": {"stage": 3},
    "zest_stage_2_offload": {"stage": 2, "offload": {"optimizer": {"device": "cpu"}}},
    "zest_stage_3_offload": {"stage": 3, "offload": {"optimizer": {"device": "cpu"}}},
}

# Inside a checkpoint directory.
LIGHTNING_FILE, ZEST_DIR = "lightning.ckpt", "zest"


class _ZestYamlLoader(yaml.SafeLoader):
    """Reads zest's to_yaml(): PyYAML reads YAML 1.1, where a float without a dot (zest writes
    eps as 1e-08, yaml-cpp reads it as YAML 1.2 does) would be a string."""


_ZestYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"),
                                      list("-+0123456789"))


def _resolved(config) -> dict:
    """The config as zest reads it, every default filled in, as a dict: zest checks it first (a
    file's errors name file:line:col), then its own YAML of it is what the strategy adds to."""
    return yaml.load(zest.torch._load_config(config).to_yaml(), Loader=_ZestYamlLoader)


_DEFAULTS = None


def _default(section: str, key: str):
    global _DEFAULTS
    if _DEFAULTS is None:
        _DEFAULTS = _resolved({})
    return _DEFAULTS[section][key] if section else _DEFAULTS[key]


def _exact_pattern(name: str) -> str:
    """An fnmatch pattern (zest's optimizer.param_groups match) matching exactly `name`."""
    return re.sub(r"([*?\[\\])", r"\\\1", name)


def _unwrap(optimizer):
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's


class _ClipInZest:
    """Lightning's clipping would read .grad, which holds zest's placeholders: zest clips in its
    step() by the config's gradient_clipping, which the strategy sets from Trainer(gradient_clip_val)."""

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM):
        if clip_val <= 0:
            return
        zest_clip = _unwrap(optimizer).config.gradient_clipping
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM or clip_val != zest_clip:
            raise Error(f"zest.lightning: gradients clipped by {gradient_clip_algorithm} at {clip_val} (a "
                        "configure_gradient_clipping of the LightningModule?), but the gradients are in zest, "
                        f"which clips by norm at the config's gradient_clipping ({zest_clip}) in its step; give "
                        "the clip as Trainer(gradient_clip_val=..., gradient_clip_algorithm=\"norm\") or the "
                        "config's gradient_clipping, and leave configure_gradient_clipping as Lightning's")


class _ZestPrecision(_ClipInZest, Precision):
    """precision="32-true", clipped by zest."""


class _ZestMixedPrecision(_ClipInZest, MixedPrecision):
    """precision="bf16-mixed" (autocast, fp32 parameters), clipped by zest."""


def _zest_precision(plugin):
    if plugin is None or isinstance(plugin, _ClipInZest):
        return plugin
    if type(plugin) is Precision:
        return _ZestPrecision()
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        return _ZestMixedPrecision("bf16-mixed", plugin.device)
    what = getattr(plugin, "precision", type(plugin).__name__)
    raise Error(f"zest.lightning: precision {what!r} ({type(plugin).__name__}) is not supported by the zest "
                "strategies: 16-mixed's GradScaler and the other plugins read or convert the gradients, which are "
                "in zest; use precision=\"bf16-mixed\" (autocast, fp32 parameters) or \"32-true\"")


class ZestStrategy(DDPStrategy):
    """A Lightning strategy training with zest: ``ZestStrategy(config)``, config a zest YAML file or
    a dict with the same keys (configs/reference.yaml), as zest.torch.Optimizer takes it; the
    registered names (STRATEGIES) are such dicts.

    From the Trainer and the LightningModule it takes (and refuses where they disagree with the
    config): the optimizer's type (AdamW or Adam), param groups and their lr, betas, eps and
    weight_decay (the config leaves optimizer.lr, betas, eps, weight_decay and param_groups out);
    gradient_clip_val (by norm) as gradient_clipping; accumulate_grad_batches as
    gradient_accumulation_steps. Refused by name: amsgrad, maximize, several optimizers, optimizers
    other than Adam and AdamW, manual optimization, clipping by value, precisions other than
    32-true and bf16-mixed.

    Checkpoints (trainer.save_checkpoint, ModelCheckpoint, fit(ckpt_path=...)) are directories:
    lightning.ckpt (Lightning's dict with the full weights: LightningModule.load_from_checkpoint
    reads it under any strategy) and zest/ (zest's checkpoint: master weights, Adam's moments, step
    count), resumable at any stage and device count. The optimizer ends with fit() (the module then
    holds the trained values as ordinary tensors), so save during fit to resume later.
    """

    def __init__(self, config: Union[str, os.PathLike, Mapping], *, accelerator=None, parallel_devices=None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None, process_group_backend=None,
                 timeout=None, start_method="popen"):
        kwargs = {} if timeout is None else {"timeout": timeout}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method, **kwargs)
        self._user_config = _resolved(config)  # checked now: a bad config fails at Trainer(...)
        self._zest: Optional[zest.torch.Optimizer] = None
        self._trained_names = set()
        self._backwards = 0

    # --- precision: clipping goes to zest, and only the plugins that leave the gradients alone

    @property
    def precision_plugin(self):
        return self._precision_plugin if self._precision_plugin is not None else _ZestPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin):
        self._precision_plugin = _zest_precision(plugin)

    # --- model and optimizer

    def configure_ddp(self) -> None:
        # No DistributedDataParallel: zest reduces the gradients as backward hands them over. What
        # DDP's constructor does besides is kept: every rank starts from rank 0's values.
        _sync_module_states(self.model)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)  # configure_optimizers: the torch optimizer and its schedulers
        module = self.lightning_module
        if not module.automatic_optimization:
            raise Error("zest.lightning: manual optimization (automatic_optimization = False) is not supported: "
                        "zest takes a fixed number of backward passes per step and holds the gradients itself; use "
                        "automatic optimization, or zest.torch.Optimizer in a loop of your own")
        if len(self.optimizers) != 1:
            raise Error(f"zest.lightning: configure_optimizers gave {len(self.optimizers)} optimizers; the zest "
                        "strategies train with one (torch.optim.AdamW or Adam)")
        torch_opt = _unwrap(self.optimizers[0])
        self._zest = zest.torch.Optimizer(module, self._config_for(trainer, torch_opt))
        self._take_over(torch_opt, self._zest)
        self.optimizers = [self._zest]
        self._backwards = 0

    def _config_for(self, trainer, torch_opt) -> dict:
        """The user's config with what Lightning decides: the optimizer, its param groups (by
        parameter name), clipping, accumulation and precision."""
        if type(torch_opt) not in (torch.optim.AdamW, torch.optim.Adam):
            raise Error(f"zest.lightning: configure_optimizers gave {type(torch_opt).__name__}; zest runs Adam and "
                        "AdamW: return torch.optim.AdamW (or Adam) with the hyper-parameters you want")
        module = self.lightning_module
        names_of = defaultdict(list)  # a tied weight has several names
        for name, p in module.named_parameters(remove_duplicate=False):
            names_of[id(p)].append(name)
        group_of, groups, types = {}, [], set()
        for g, group in enumerate(torch_opt.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise Error(f"zest.lightning: param group {g} of {type(torch_opt).__name__} has {flag}=True, which "
                                f"zest's Adam does not do; build the optimizer without {flag}")
            lr = float(group["lr"])
            if not lr > 0:
                raise Error(f"zest.lightning: param group {g} starts with lr {lr} (a scheduler's first value?); "
                            "zest needs lr > 0 at every step: start a warmup above 0 (e.g. LambdaLR with "
                            "(step + 1) / warmup)")
            weight_decay = float(group["weight_decay"])
            if weight_decay > 0:
                types.add("adamw" if group.get("decoupled_weight_decay", False) else "adam")
            patterns = []
            for p in group["params"]:
                if id(p) not in names_of:
                    raise Error(f"zest.lightning: param group {g} holds a tensor of shape {tuple(p.shape)} that "
                                "is not a parameter of the LightningModule; zest trains the module's parameters: "
                                "register it (nn.Parameter as a module attribute)")
                group_of[id(p)] = g
                patterns += [_exact_pattern(name) for name in names_of[id(p)]]
            if g > 0 and not patterns:
                raise Error(f"zest.lightning: param group {g} holds no parameter; zest keeps torch's group numbers by "
                            "the names of their parameters: leave empty groups out")
            beta1, beta2 = (float(b) for b in group["betas"])
            groups.append({"match": patterns, "lr": lr, "betas": [beta1, beta2], "eps": float(group["eps"]),
                           "weight_decay": weight_decay})
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in group_of:
                raise Error(f"zest.lightning: parameter {name!r} requires a gradient but is in no param group of the "
                            "optimizer; zest trains every parameter that requires one: add it to a group, or set "
                            "requires_grad=False")
        self._trained_names = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
        if len(types) > 1:
            raise Error("zest.lightning: some param groups decay weights decoupled (AdamW) and some as L2 (Adam); "
                        "zest runs one of the two for all: give every group the same decoupled_weight_decay")

        config = _resolved(self._user_config)
        optimizer = config["optimizer"]
        wanted = {"type": types.pop() if types else "adamw", "lr": groups[0]["lr"], "betas": groups[0]["betas"],
                  "eps": groups[0]["eps"], "weight_decay": groups[0]["weight_decay"]}
        for key, value in wanted.items():
            if optimizer[key] != _default("optimizer", key) and optimizer[key] != value:
                raise Error(f"zest.lightning: the config sets optimizer.{key} to {optimizer[key]}, but "
                            f"configure_optimizers' {type(torch_opt).__name__} gives {value}; under Lightning the "
                            f"LightningModule's optimizer decides: leave optimizer.{key} out of the config")
            optimizer[key] = value
        if optimizer["param_groups"]:
            raise Error("zest.lightning: the config sets optimizer.param_groups; under Lightning the param groups of "
                        "configure_optimizers' optimizer are zest's: leave optimizer.param_groups out of the config")
        optimizer["param_groups"] = groups[1:]

        clip = trainer.gradient_clip_val or 0.0
        if clip > 0:
            algorithm = GradClipAlgorithmType(trainer.gradient_clip_algorithm or "norm")  # None: Lightning's norm
            if algorithm != GradClipAlgorithmType.NORM:
                raise Error(f"zest.lightning: Trainer(gradient_clip_algorithm={algorithm.value!r}); "
                            "zest clips by the global norm only: use gradient_clip_algorithm=\"norm\"")
            if config["gradient_clipping"] not in (0, clip):
                raise Error(f"zest.lightning: Trainer(gradient_clip_val={clip}) but the config's gradient_clipping is "
                            f"{config['gradient_clipping']}; give the clip in one place")
            config["gradient_clipping"] = float(clip)
        accumulate = trainer.accumulate_grad_batches
        if config["gradient_accumulation_steps"] not in (1, accumulate):
            raise Error(f"zest.lightning: Trainer(accumulate_grad_batches={accumulate}) but the config's "
                        f"gradient_accumulation_steps is {config['gradient_accumulation_steps']}; give it in one place")
        config["gradient_accumulation_steps"] = accumulate
        if config["precision"]["dtype"] != "fp32":
            raise Error(f"zest.lightning: the config's precision.dtype is {config['precision']['dtype']}, but "
                        f"Trainer(precision={self.precision_plugin.precision!r}) trains fp32 parameters; leave "
                        "precision.dtype out of the config")
        return config

    def _take_over(self, torch_opt, zest_opt) -> None:
        """Moves configure_optimizers' schedulers from the torch optimizer onto zest's, whose param
        groups take the torch groups' entries (lr as the schedulers left it, initial_lr...)."""
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        if schedulers:
            # A scheduler marks its optimizer's step() to check the order of the two calls; one that
            # changes nothing (factor 1) marks zest's, so that the schedulers moved onto it see the mark.
            torch.optim.lr_scheduler.ConstantLR(zest_opt, factor=1.0, total_iters=0)
        for zest_group, torch_group in zip(zest_opt.param_groups, torch_opt.param_groups):
            zest_group.update((key, value) for key, value in torch_group.items() if key != "params")

        def rebind(scheduler):
            if getattr(scheduler, "optimizer", None) is torch_opt:
                scheduler.optimizer = zest_opt
            for inner in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
                rebind(inner)

        for scheduler in schedulers:
            rebind(scheduler)

    # --- a step

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        self._backwards += 1
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        zest_opt = _unwrap(optimizer)
        for g, group in enumerate(zest_opt.param_groups):
            if not float(group["lr"]) > 0:
                raise Error(f"zest.lightning: param group {g}'s lr is {float(group['lr'])} at step "
                            f"{self.lightning_module.trainer.global_step} (set by a scheduler?); zest needs lr > 0 at "
                            "every step: keep the schedule above 0 (e.g. CosineAnnealingLR with eta_min > 0)")
        accumulate = zest_opt.config.gradient_accumulation_steps

        def counted():
            # The closure runs the step's last backward; zest takes exactly `accumulate` of them.
            result = closure()
            backwards, self._backwards = self._backwards, 0
            if backwards != accumulate:
                raise Error(f"zest.lightning: {backwards} backward passes before optimizer step "
                            f"{self.lightning_module.trainer.global_step}, but zest takes exactly "
                            f"accumulate_grad_batches ({accumulate}) per step; a training_step that returns None "
                            "(Lightning skips its backward) or an epoch whose batch count is not a multiple of "
                            "accumulate_grad_batches (Lightning steps early at its end) gives another count: return a "
                            "loss from every training_step and make the batches per epoch a multiple of "
                            "accumulate_grad_batches (limit_train_batches)")
            return result

        return super().optimizer_step(optimizer, counted, model, **kwargs)

    # --- checkpoints: a directory of lightning.ckpt and zest/

    def optimizer_state(self, optimizer):
        if self._zest is None:
            raise Error("zest.lightning: the zest optimizer ended with fit() (the module holds the trained values), so "
                        "a checkpoint saved now could not resume training; save during fit (ModelCheckpoint, or "
                        "trainer.save_checkpoint in a callback's on_train_end), or save the weights alone: "
                        "trainer.save_checkpoint(path, weights_only=True)")
        return {"zest": f"the optimizer's states are in the checkpoint's {ZEST_DIR}/ directory (a zest checkpoint)"}

    def lightning_module_state_dict(self):
        state = super().lightning_module_state_dict()
        if self._zest is not None and self._zest.config.stage == 3:
            # At stage 3 the module's parameters hold no values between uses: zest's full copies
            # (collective: every rank dumps the checkpoint).
            state.update(self._zest.full_parameters())
        return state

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise Error("zest.lightning: trainer.save_checkpoint(..., storage_options=...) is not supported: the "
                        "zest strategies write a directory through zest and the checkpoint_io plugin; leave "
                        "storage_options out")
        path = Path(self.broadcast(os.fspath(filepath)))  # one directory for every rank's shard
        problem = _checkpoint_dir_problem(path) if self.is_global_zero else None
        problem = self.broadcast(problem)  # every rank fails alike, before the collective save
        if problem:
            raise Error(problem)
        if "optimizer_states" in checkpoint and self._zest is not None:
            self._zest.save(path / ZEST_DIR)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path / LIGHTNING_FILE)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the zest optimizer loads its part

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint did, from zest/

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        path = Path(checkpoint_path)
        fitting = self._zest is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if not path.is_dir():
            if fitting:
                raise Error(f"zest.lightning: {path} is a file, not a zest strategy's checkpoint directory "
                            f"({LIGHTNING_FILE} and {ZEST_DIR}/), so it holds no zest optimizer states to resume; "
                            "resume from a checkpoint saved under a zest strategy, or load the weights into the "
                            "module before fit (LightningModule.load_from_checkpoint)")
            return super().load_checkpoint(path, weights_only)
        if not (path / LIGHTNING_FILE).is_file():
            raise Error(f"zest.lightning: {path} is a directory without {LIGHTNING_FILE}, not a zest strategy's "
                        "checkpoint; give the directory that trainer.save_checkpoint or ModelCheckpoint wrote")
        checkpoint = super().load_checkpoint(path / LIGHTNING_FILE, weights_only)
        if fitting:
            if "optimizer_states" not in checkpoint or not (path / ZEST_DIR).is_dir():
                raise Error(f"zest.lightning: {path} holds the weights only (saved with weights_only=True), no "
                            "optimizer states to resume; resume from a full checkpoint, or load the weights into the "
                            f"module before fit (LightningModule.load_from_checkpoint of {path / LIGHTNING_FILE})")
            loaded = self._zest.load(path / ZEST_DIR)
            if loaded.steps != checkpoint["global_step"]:
                raise Error(f"zest.lightning: {path / ZEST_DIR} is at step {loaded.steps} but "
                            f"{path / LIGHTNING_FILE} at step {checkpoint['global_step']}: the two parts come from "
                            "different saves; resume from a checkpoint directory written by one save")
            for change in loaded.config_changes:
                rank_zero_info(f"zest.lightning: resuming {path}: {change}")
        return checkpoint

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if self._zest is None:
            return super().load_model_state_dict(checkpoint, strict)
        # zest loaded the trained parameters (stage 3's are sharded); the rest (buffers, frozen
        # parameters) comes from Lightning's state dict.
        rest = {k: v for k, v in checkpoint["state_dict"].items() if k not in self._trained_names}
        missing, unexpected = self.lightning_module.load_state_dict(rest, strict=False)
        missing = [k for k in missing if k not in self._trained_names]
        if strict and (missing or unexpected):
            raise Error(f"zest.lightning: the checkpoint's state_dict does not fit the module: missing {missing}, "
                        f"unexpected {unexpected}; load a checkpoint of this model, or set the LightningModule's "
                        "strict_loading = False")

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint loaded zest's part

    # --- the end of fit

    def teardown(self) -> None:
        if self._zest is not None:
            # The parameters go back to torch holding the trained values (stage 3: gathered), so
            # the module works as after DDP.
            self._zest.close()
            self._zest = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, config in STRATEGIES.items():
            offload = " with the optimizer states in host memory" if "offload" in config else ""
            strategy_registry.register(name, cls, description=f"zest ZeRO stage {config['stage']}{offload}",
                                       override=True, config=config)


def _checkpoint_dir_problem(path: Path) -> Optional[str]:
    """Why a checkpoint cannot be saved at `path` (None: it can, and the directory exists now):
    the zest strategies' checkpoints are directories, and a save replaces only one of them."""
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            return (f"zest.lightning: cannot save a checkpoint at {path}: it exists and is not a directory; a zest "
                    f"strategy's checkpoint is a directory ({LIGHTNING_FILE} and {ZEST_DIR}/): give another path, or "
                    "move that one away")
        if any(path.iterdir()) and not (path / LIGHTNING_FILE).is_file():
            return (f"zest.lightning: cannot save a checkpoint at {path}: it is a directory that is not a zest "
                    f"strategy's checkpoint (it has no {LIGHTNING_FILE}); give a new or empty directory")
        return None
    path.mkdir(parents=True, exist_ok=True)
    return None


ZestStrategy.register_strategies(StrategyRegistry)
