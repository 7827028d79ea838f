"""Where zest's ranks come from: a torch.distributed group (given, or the initialised default one)
or MPI. The same training over the torch group and over MPI gives the same numbers: bit for bit
at 1 and 2 ranks (a sum of two is the same in any order), within fp32 rounding at 4 (gloo and
Open MPI may add four terms in different orders). Under torchrun MPI is a world of one, so the
comparisons with MPI run under mpirun; the torchrun runs check zest took the launcher's ranks."""

import pytest
import torch
import torch.distributed as dist

import zest
import zest.torch
from conftest import LAUNCHER, RANK, WORLD
from models import make, max_diff, train

STEPS = 3


def config(stage, **extra):
    cfg = {"stage": stage, "comm": {"timeout": "60s"}, "optimizer": {"lr": 1e-2, "weight_decay": 0.05},
           "buckets": {"reduce": "1KiB", "allgather": "1KiB"}, "stage3": {"persistence_threshold": 0}}
    cfg.update(extra)
    return cfg


def trained(cfg, process_group=None):
    model = make()
    opt = zest.torch.Optimizer(model, cfg, process_group=process_group)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = train(model, opt, sched, STEPS, WORLD, RANK)
    world = opt.world_size
    params = opt.full_parameters()
    opt.close()
    return world, losses, params


def test_takes_the_launchers_ranks(ddp):
    """Under torchrun the default group (conftest made it); under mpirun MPI (conftest pins it)."""
    world, _, _ = trained(config(2))
    assert world == WORLD == ddp.size()


# hpZ (a secondary copy of the parameters per host) and qgZ (int8 gradients, all-to-all inside the
# host, then across hosts) use the communicator's splits by host and across hosts.
CASES = {
    "stage1": config(1),
    "stage3": config(3),
    "stage3-hpz-qgz": config(3, partition={"secondary": "host"}, comm={"timeout": "60s", "quantize": {"grads": "int8"}}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_group_given_equals_mpi(name, ddp):
    if LAUNCHER != "mpirun":
        pytest.skip("torchrun's processes have no MPI ranks to compare with (MPI is a world of one there); "
                    "the mpirun runs compare the two")
    cfg = CASES[name]
    _, mpi_losses, mpi_params = trained(cfg)
    _, group_losses, group_params = trained(cfg, process_group=ddp)
    if WORLD <= 2:
        assert group_losses == mpi_losses
        assert all(torch.equal(group_params[k], mpi_params[k]) for k in mpi_params), \
            f"not bit for bit: {max_diff(group_params.values(), mpi_params.values())}"
    else:
        assert max_diff(group_params.values(), mpi_params.values()) < 1e-6


def test_a_new_group(ddp):
    group = dist.new_group(list(range(WORLD)))
    world, _, _ = trained(config(2), process_group=group)
    assert world == WORLD


def test_a_group_and_comm_backend_mpi_refused():
    with pytest.raises(zest.Error, match="comm.backend is mpi"):
        zest.torch.Optimizer(make(), config(1, comm={"backend": "mpi"}), process_group=dist.group.WORLD)


def test_not_a_group_refused():
    with pytest.raises(zest.Error, match="process_group is a str"):
        zest.torch.Optimizer(make(), config(1), process_group="gloo")
