"""zest: a ZeRO-style partitioned optimizer with offload, for PyTorch programs.

    import zest.torch
    # was: opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt = zest.torch.Optimizer(model, "zest.yaml")

Launch with ``torchrun --nproc_per_node N train.py`` (the script calls
``torch.distributed.init_process_group``: zest takes that group's ranks), with Lightning
(``import zest.lightning``; ``Trainer(strategy="zest_stage_3_offload")``), or with
``mpirun -np N python train.py`` (zest takes MPI's ranks). The module may be on the cpu or on one
CUDA GPU per rank (``model.cuda()`` before building the optimizer). See zest.torch.Optimizer.
"""

# torch first: zest._C is linked against torch's libraries, which this import loads.
import torch as _torch  # noqa: F401

from zest._C import ConfigError, Error, OutOfMemoryError

__all__ = ["Error", "ConfigError", "OutOfMemoryError"]
__version__ = "0.1.0"
