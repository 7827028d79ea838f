"""Shared ground of the Python package's tests. They run under mpirun (tests/python/run_tests.sh):
every rank runs every test in the same order, and zest's ranks are MPI's. The references are
torch's own: torch.optim.AdamW under DistributedDataParallel on a gloo group made in the same
processes (MASTER_ADDR/MASTER_PORT from the launcher)."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import zest.torch  # noqa: F401  (zest first: MPI initialized before gloo's sockets)

torch.set_num_threads(1)  # up to 4 ranks on 2 cores

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))


@pytest.fixture(scope="session")
def ddp():
    """The gloo process group of the reference, the same ranks as zest's."""
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
    return dist.group.WORLD


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
