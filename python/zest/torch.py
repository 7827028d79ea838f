"""zest.torch: zest as a torch.optim optimizer (see Optimizer)."""

import atexit
import json
import os
import weakref
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Tuple, Union

import torch

from zest import _C
from zest._C import Error

__all__ = ["Optimizer", "StepResult", "LoadResult", "Error"]


@dataclass(frozen=True)
class StepResult:
    """The result of the last step(): skipped (fp16 overflow: nothing was updated), the global
    gradient norm before clipping (of the gradients as handed over, i.e. averaged over ranks by
    default), and the loss scale for the next step."""

    skipped: bool = False
    grad_norm: float = 0.0
    loss_scale: float = 1.0


@dataclass(frozen=True)
class LoadResult:
    """What load() found: the checkpoint's step count, and the saving run's settings that differ
    from this optimizer's config ("lr: 0.001 in the checkpoint, 0.0005 now")."""

    steps: int
    config_changes: List[str]


# Optimizers alive in this process: closed at exit, before MPI is finalized (closing a stage-3
# optimizer gathers the parameters back, which is collective).
_live = weakref.WeakSet()
_atexit_registered = False


def _at_exit():
    for opt in list(_live):
        opt.close()
    _C.finalize()


def _load_config(config):
    if isinstance(config, Mapping):
        def path_or_refuse(value):
            if isinstance(value, os.PathLike):
                return os.fspath(value)
            raise Error(f"zest.torch.Optimizer: config holds a {type(value).__name__} ({value!r}); give "
                        "numbers, strings, booleans, lists and dicts, as a YAML config would")

        # JSON is YAML: the same keys and checks as a YAML file, reported against "<dict>".
        return _C.parse_config(json.dumps(config, default=path_or_refuse), "<dict>")
    if isinstance(config, (str, os.PathLike)):
        if os.fspath(config) == "":
            raise Error("zest.torch.Optimizer: config='' names no file; give the path of a zest YAML config "
                        "(configs/reference.yaml lists every key) or a dict with the same keys")
        return _C.load_config(os.fspath(config))
    raise Error(
        f"zest.torch.Optimizer: config is a {type(config).__name__}; give the path of a zest YAML "
        "config (configs/reference.yaml lists every key) or a dict with the same keys")


def _check_launcher(world_size):
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return  # not torchrun's
    if world_size == 1 and launched > 1:
        raise Error(
            f"zest.torch.Optimizer: WORLD_SIZE is {launched} (torchrun?) but zest would take its ranks from MPI "
            "(torch.distributed is not initialised, or the config's comm.backend is mpi), which sees 1 rank, so every "
            "process would train alone; call "
            "torch.distributed.init_process_group(\"gloo\") (\"nccl\" with the model on GPUs) before building the "
            f"optimizer (or give process_group=), or launch with `mpirun -np {launched} python ...` instead")


def _choose_group(process_group, cfg):
    """The torch.distributed group whose ranks zest takes, or None for MPI's (or a world of one):
    the group given; else, unless the config's comm.backend is mpi, the initialised default group."""
    import torch.distributed as dist
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise Error(f"zest.torch.Optimizer: process_group is a {type(process_group).__name__}; give a "
                        "torch.distributed.ProcessGroup (dist.group.WORLD, or one from dist.new_group), or None")
        return process_group
    if cfg.comm_backend_mpi or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


def _group_maker(group):
    """zest's groups over ranks of `group`: what zest's C++ calls, on every rank, for every group
    it makes (two per communicator, and per host or per place on a host for hpZ and qgZ), in the
    same order; returns this rank's group's name, or "" where it is not a member. dist.new_group's
    groups: gloo groups split from one parent (splitGroup) hang after a few are made in torch 2.11."""
    import torch.distributed as dist

    def new_group(ranks):
        made = dist.new_group([dist.get_global_rank(group, r) for r in ranks], use_local_synchronization=True)
        return made.group_name if made not in (None, dist.GroupMember.NON_GROUP_MEMBER) else ""
    return new_group


class _GatherForBackward(torch.autograd.Function):
    """Identity on a stage-3 module's outputs; its backward runs before the module's own backward
    and gathers the module's parameters for it (zest releases them once their gradients are
    handed over)."""

    @staticmethod
    def forward(ctx, params, *outputs):
        ctx.params = params
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        _C.hold_for_backward(ctx.params)
        return (None,) + grads


def _wrap_outputs(output, params):
    """Applies _GatherForBackward once to every tensor of `output` (a tensor, or tuples, lists
    and dicts of them) that requires a gradient."""
    found = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.append(x)
        elif isinstance(x, (tuple, list)):
            for item in x:
                collect(item)
        elif isinstance(x, dict):
            for item in x.values():
                collect(item)

    collect(output)
    if not found:
        return output
    wrapped = _GatherForBackward.apply(params, *found)
    if len(found) == 1:
        wrapped = (wrapped,)
    replacement = {id(t): w for t, w in zip(found, wrapped)}

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return replacement.get(id(x), x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(rebuild(item) for item in x))
        if isinstance(x, (tuple, list)):
            return type(x)(rebuild(item) for item in x)
        if isinstance(x, dict):
            return type(x)((k, rebuild(v)) for k, v in x.items())
        return x

    return rebuild(output)


class _Stage3Hooks:
    """Module hooks that gather each module's own parameters (recurse=False: a parameter of the
    root does not make the root gather the whole model) for its forward, release them after it,
    and gather them again before its backward."""

    def __init__(self, model: torch.nn.Module):
        self.handles = []
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not params:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre(params)))
            self.handles.append(module.register_forward_hook(self._post(params), always_call=True))

    @staticmethod
    def _pre(params):
        def hook(module, args):
            _C.hold_for_forward(params)

        return hook

    @staticmethod
    def _post(params):
        def hook(module, args, output):
            _C.drop_after_forward(params)
            if torch.is_grad_enabled():
                return _wrap_outputs(output, params)
            return None

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


NamedParameters = Iterable[Tuple[str, torch.nn.Parameter]]


class Optimizer(torch.optim.Optimizer):
    """zest as a ``torch.optim.Optimizer``: AdamW (or Adam) over zest's engine, which shards
    optimizer states (stage 1), gradients (2) and parameters (3) across the ranks and offloads them
    to host memory or NVMe, as the config says.

        # was: opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        opt = zest.torch.Optimizer(model, "zest.yaml")   # or a dict: {"stage": 2, "optimizer": {...}}
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
        for batch in this_ranks_batches:
            loss = model(batch).mean()          # this rank's mean loss, as with DDP
            (loss * opt.loss_scale).backward()  # gradients go to zest as backward makes them
            opt.step()
            opt.zero_grad()
            sched.step()

    ``model`` is an ``nn.Module`` or its ``named_parameters()`` (stages 0-2; stage 3 needs the
    module, to hook it); every rank builds it with the same values (same seed). The parameters that
    require a gradient are trained, in this order; consecutive ones of one module form a
    communication group (a layer). Build the optimizer after moving the module to its dtype and
    device: the cpu, or one CUDA GPU per rank (``model.cuda()``; zest then runs there: the config's
    ``device.type`` follows the parameters, its device memory comes from torch's caching allocator,
    so ``torch.cuda.memory_allocated()`` counts it and running out raises ``zest.OutOfMemoryError``,
    a ``torch.cuda.OutOfMemoryError``, and its streams wait for torch's current stream with events).
    Anything that later replaces a parameter's data (``model.to(...)``) breaks the sharing with zest.

    The ranks: those of ``process_group`` if given (a torch.distributed group); else, unless the
    config's ``comm.backend`` is ``mpi``, those of the initialised default group (``torchrun
    --nproc_per_node N train.py`` with ``torch.distributed.init_process_group("gloo")`` in the
    script, or a launcher that does the same, such as Lightning); else MPI's (``mpirun -np N python
    train.py``); else this process alone. Over a group, zest's collectives on the cpu run on gloo
    groups of its own split from it (it needs a cpu backend: "gloo", or "cpu:gloo,cuda:nccl"); on a
    GPU on an NCCL communicator of zest's own whose id goes through the group's store. Checkpoints
    are the same whichever launcher made them.

    ``config`` is a zest YAML file or a dict with the same keys (configs/reference.yaml): stage,
    optimizer (type, lr, betas, eps, weight_decay, param_groups), gradient_clipping,
    gradient_accumulation_steps, precision, offload, buckets...

    Gradients: with ``average_gradients=True`` (the default) each gradient is divided by the
    number of ranks as it is handed over, so a per-rank mean loss gives the same update as
    ``DistributedDataParallel`` + ``torch.optim.AdamW``; with False they are summed over ranks (then
    divide the loss by the global number of examples). With gradient_accumulation_steps K, call
    backward K times per step(), each loss divided by K, as with AdamW (another count of backward
    passes makes step() raise zest.Error, where AdamW would take whatever .grad summed). Each gradient goes to zest
    as soon as backward has made it; ``p.grad`` then holds a placeholder without values whose any
    read raises an error saying so (clip with the config's gradient_clipping instead of
    clip_grad_norm_; the norm is in last_step.grad_norm).

    ``param_groups`` mirror the config's optimizer groups (group 0: the parameters no
    ``optimizer.param_groups`` pattern matches); each has lr, betas, eps, weight_decay as
    AdamW's, which ``torch.optim.lr_scheduler`` or your code may change: step() applies them.

    Stage 3: between uses a parameter holds no values (nothing allocated; any access to its data
    raises an error naming it and the ways out). Hooks on every module gather its own parameters for
    its forward and backward and release them after; so using a parameter outside its module's
    forward (``x @ model.fc.weight``) raises that error. full_parameters() reads them all.

    ``trace="step.json"`` records what ran when in every rank's steps (the gradient hand-offs, each
    reduction, the updates ahead, NVMe reads and writes, the commit, the all-gather) from here to
    ``close()`` (or exit), which writes them as one Chrome trace (open it in https://ui.perfetto.dev
    or chrome://tracing). The file must not exist: an existing one raises ``zest.Error`` and is left
    as it was.

    Checkpoints: ``save(dir)`` / ``load(dir, scheduler)`` (zest checkpoints, loadable at any rank
    count and stage). ``state_dict()`` / ``load_state_dict()`` cannot hold a sharded optimizer and
    raise ``zest.Error``. Every zest failure raises ``zest.Error`` (a RuntimeError) saying what to do.
    """

    def __init__(self, model: Union[torch.nn.Module, NamedParameters],
                 config: Union[str, os.PathLike, Mapping], *, average_gradients: bool = True,
                 trace: Union[str, os.PathLike, None] = None, process_group=None):
        global _atexit_registered
        cfg = _load_config(config)
        if isinstance(model, torch.nn.Module):
            # Every name, a tied weight's too: full_parameters() gives what model.state_dict() has.
            module, named = model, list(model.named_parameters(remove_duplicate=False))
        else:
            module, named = None, list(model)
            for item in named:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                    raise Error("zest.torch.Optimizer: give a module or its named_parameters() "
                                "((name, parameter) pairs); plain parameters have no names for checkpoints")
        seen = set()
        for name, _ in named:
            if name in seen:
                raise Error(f"zest.torch.Optimizer: the name {name!r} is given twice; zest names each parameter "
                            "once in its checkpoints: give each (name, parameter) pair a name of its own")
            seen.add(name)
        if module is not None:
            for module_name, m in module.named_modules():
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and \
                        any(p.requires_grad for p in m.parameters(recurse=False)):
                    raise Error(f"zest.torch.Optimizer: module {module_name or '(the model)'!r} is "
                                f"{type(m).__name__}(sparse=True), whose gradients are sparse; zest reduces dense "
                                "gradients: build it with sparse=False")
        if cfg.stage == 3 and module is None:
            raise Error("zest.torch.Optimizer: stage 3 hooks the modules to gather their parameters; "
                        "give the module (zest.torch.Optimizer(model, config)), not its named_parameters()")
        if trace is not None and os.fspath(trace) == "":
            raise Error("zest.torch.Optimizer: trace='' names no file; give a new file's path, or leave trace out")
        group = _choose_group(process_group, cfg)
        if group is None:
            _check_launcher(_C.world()[1])  # initializes MPI (a world of one without mpirun)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True

        self._c = _C.Optimizer([(name, p) for name, p in named], cfg, os.fspath(trace) if trace is not None else "",
                               group.group_name if group is not None else "",
                               _group_maker(group) if group is not None else None)
        self._config = cfg
        self._rank, self._world_size = self._c.world()
        world = self._world_size
        self._average = bool(average_gradients)
        if self._average:
            self._c.set_grad_scale(1.0 / world)
        self._last = StepResult(loss_scale=self._c.loss_scale())
        groups = []
        for g in range(self._c.group_count()):
            lr, beta1, beta2, eps, weight_decay = self._c.group_options(g)
            groups.append({"params": self._c.group_params(g), "lr": lr, "betas": (beta1, beta2),
                           "eps": eps, "weight_decay": weight_decay})
        defaults = {k: v for k, v in groups[0].items() if k != "params"}
        self._building = True
        super().__init__(groups, defaults)
        self._building = False
        self._hooks = _Stage3Hooks(module) if cfg.stage == 3 else None
        _live.add(self)

    # --- torch.optim.Optimizer

    @torch.no_grad()
    def step(self, closure=None):
        """Hands over what backward left, applies each param group's lr, betas, eps and
        weight_decay, and runs zest's step: reduce over ranks, unscale, clip, Adam on this rank's
        shard, gather the updated parameters. Collective. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_groups()
        skipped, grad_norm, loss_scale = self._c.step()
        self._last = StepResult(bool(skipped), float(grad_norm), float(loss_scale))
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Nothing to clear: zest took the trained parameters' gradients as backward made them (what
        .grad holds then is zest's, not a gradient to zero). Kept for code written for torch
        optimizers."""

    def add_param_group(self, param_group):
        if not getattr(self, "_building", False):
            raise Error("zest.torch.Optimizer: parameter groups are fixed at construction (zest shards "
                        "the parameters by them); use the config's optimizer.param_groups")
        super().add_param_group(param_group)

    def state_dict(self):
        """Raises zest.Error: a torch state dict cannot hold a sharded optimizer; use save(dir)."""
        raise Error("zest.torch.Optimizer: state_dict() cannot hold a sharded optimizer (each rank has "
                    "only its shard); use save(dir), a zest checkpoint, and load(dir, scheduler)")

    def load_state_dict(self, state_dict):
        """Raises zest.Error: a torch state dict cannot hold a sharded optimizer; use load(dir)."""
        raise Error("zest.torch.Optimizer: load_state_dict() cannot hold a sharded optimizer; use "
                    "load(dir, scheduler) with a checkpoint written by save(dir)")

    # --- zest

    @property
    def last_step(self) -> StepResult:
        """The result of the last step() (skipped, grad_norm, loss_scale)."""
        return self._last

    @property
    def loss_scale(self) -> float:
        """The factor to multiply the loss by before backward (1 unless fp16 loss scaling)."""
        return self._c.loss_scale()

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def config(self):
        """The config as zest resolved it (every default filled in): ``config.to_yaml()``."""
        return self._config

    def save(self, dir: Union[str, os.PathLike]) -> None:
        """Writes a zest checkpoint into ``dir`` (replaced atomically if it is a zest checkpoint;
        refused otherwise): the fp32 master weights, Adam's moments, the step count and the param
        groups' hyper-parameters as they are now. Collective. Save the scheduler's and your own
        state beside it if they are not a function of the step count."""
        self._push_groups()
        self._c.save(os.fspath(dir))

    def load(self, dir: Union[str, os.PathLike], scheduler=None) -> LoadResult:
        """Loads a zest checkpoint written at any rank count and stage: weights (into the model's
        parameters), optimizer states, step count, and the param groups' hyper-parameters. With
        ``scheduler`` (a torch.optim.lr_scheduler built on this optimizer before the call, stepped
        once per optimizer step), puts it at the checkpoint's step count (last_epoch, _step_count,
        _last_lr) so that it resumes as the saving run went on. Collective."""
        steps, changes = self._c.load(os.fspath(dir))
        for g, group in enumerate(self.param_groups):
            lr, beta1, beta2, eps, weight_decay = self._c.group_options(g)
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        if scheduler is not None:
            if getattr(scheduler, "optimizer", None) is not self:
                raise Error("zest.torch.Optimizer.load: the scheduler given is not built on this optimizer")
            scheduler.last_epoch = steps
            scheduler._step_count = steps + 1
            scheduler._last_lr = [group["lr"] for group in self.param_groups]
        return LoadResult(int(steps), list(changes))

    def full_parameters(self) -> "dict[str, torch.Tensor]":
        """Copies of the trained parameters' full values (in their dtype, on the cpu whatever the
        module's device), by every name the module's state dict has (a tied weight under each of
        its names), on every rank: what to torch.save for inference, since at stage
        3 model.state_dict() holds released tensors. Collective; call between steps."""
        return dict(self._c.full_parameters())

    def close(self) -> None:
        """Gives the parameters back to torch (each with storage of its own holding the trained
        values; collective at stage 3), writes the trace if one was asked for (collective), and ends
        this optimizer. Called at exit otherwise."""
        if getattr(self, "_hooks", None) is not None:
            self._hooks.remove()
            self._hooks = None
        if getattr(self, "_c", None) is not None:
            self._c.close()
        _live.discard(self)

    def _push_groups(self):
        for g, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            self._c.set_group_options(g, (float(group["lr"]), float(beta1), float(beta2),
                                          float(group["eps"]), float(group["weight_decay"])))
