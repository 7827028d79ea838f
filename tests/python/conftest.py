"""Shared ground of the Python package's tests. They run under torchrun and under mpirun
(tests/python/run_tests.sh): every rank runs every test in the same order. The references are
torch's own: torch.optim.AdamW under DistributedDataParallel on the default gloo group, made here
(MASTER_ADDR/MASTER_PORT from the launcher). Under torchrun zest takes its ranks from that group
(its own choice: the initialised default group); under mpirun the runs pin zest to MPI (below), so
that the same suite proves both.

Every test case runs on each device (the `device` fixture): the cpu always, and CUDA where a GPU is
visible in a world of one (scripts/gpu-kit run runs pytest there without mpirun); elsewhere the
cuda cases skip, saying why."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import zest.torch  # noqa: F401  (zest first: MPI initialized before gloo's sockets)

torch.set_num_threads(1)  # up to 4 ranks on 2 cores

UNDER_MPIRUN = "OMPI_COMM_WORLD_SIZE" in os.environ
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
LAUNCHER = "mpirun" if UNDER_MPIRUN else "torchrun"

if UNDER_MPIRUN:
    # zest's own choice would take the references' default group, initialised below; the mpirun
    # runs are there to prove zest over MPI, so they pin it to MPI as comm.backend: mpi would
    # (test_launch.py tests the choice itself).
    _choose = zest.torch._choose_group
    zest.torch._choose_group = lambda process_group, cfg: _choose(process_group, cfg) if process_group else None


def _cuda_skip_reason():
    if not torch.cuda.is_available():
        return ("no CUDA GPU visible: torch.cuda.is_available() is False (the cuda cases run on a GPU "
                "machine: scripts/gpu-kit run)")
    if WORLD > 1:
        return (f"the cuda cases run in a world of one, not at {WORLD} ranks (one GPU per rank, and the GPU "
                "machine has one GPU and no MPI): run pytest there without mpirun (scripts/gpu-kit run does)")
    return None


def _cuda_param():
    reason = _cuda_skip_reason()
    return pytest.param("cuda", id="cuda", marks=[pytest.mark.skip(reason=reason)] if reason else [])


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), _cuda_param()])
def device(request):
    """The device a case trains on, zest and its torch reference alike."""
    return torch.device(request.param)


@pytest.fixture(params=[_cuda_param()])
def cuda(request):
    """For the cases about CUDA alone (stream order): the GPU, or a skip saying why there is none."""
    return torch.device(request.param)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # scripts/gpu-kit asks which case is running (its id, then its file): after a crash (a signal
    # ends pytest before any report is written) it runs that case's file again under a debugger,
    # and the suite again without that case.
    path = os.environ.get("ZEST_TEST_CURRENT")
    if path:
        with open(path, "w") as f:
            f.write(f"{item.nodeid}\n{item.path}\n")


@pytest.fixture(scope="session", autouse=True)
def ddp():
    """The gloo process group of the reference, the same ranks as zest's: made before any test,
    so that under torchrun every zest optimizer finds it."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if WORLD > 1:
                pytest.fail("MASTER_PORT is not set: run the tests through tests/python/run_tests.sh")
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    yield dist.group.WORLD
    # Every rank ends here together; a group left to the interpreter's exit sometimes hung it there.
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A directory every rank sees (offload swap files, checkpoints): the launcher's, shared
    across its runs at different rank counts."""
    path = os.environ.get("ZEST_TEST_SHARED")
    if not path:
        if WORLD > 1:
            pytest.fail("ZEST_TEST_SHARED is not set: run the tests through tests/python/run_tests.sh")
        path = str(tmp_path_factory.mktemp("shared"))
    return path
