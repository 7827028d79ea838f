"""zest.torch.Optimizer(..., trace=FILE): from construction to close(), every rank's steps are
recorded and written as one Chrome trace (JSON) holding the gradient hand-offs of the autograd
hooks, the reductions, the updates ahead, the NVMe transfers and the all-gather of every rank; an
existing FILE raises zest.Error and is left as it was."""

import json
import os

import pytest
import torch.distributed as dist

import zest
import zest.torch
from conftest import RANK, WORLD
from models import batch, loss_of, make


def config(path):
    return {"stage": 2, "comm": {"timeout": "60s"}, "buckets": {"reduce": "1KiB"},
            "offload": {"optimizer": {"device": "nvme", "path": path, "update_ahead": True}},
            "io": {"block_size": "4KiB"}}


def test_trace_holds_every_rank_and_lane(device, ddp, shared_dir):
    trace = os.path.join(shared_dir, f"np{WORLD}-{device.type}-trace.json")
    model = make(device=device)
    opt = zest.torch.Optimizer(model, config(shared_dir), trace=trace)
    for step in range(2):
        tokens, target = batch(step, 0, WORLD, RANK, device=device)
        loss_of(model, tokens, target, 1).backward()
        opt.step()
    opt.close()  # writes the trace (collective)
    dist.barrier()
    with open(trace) as f:
        doc = json.load(f)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(WORLD))
    assert doc["otherData"]["dropped_events"] == 0 and doc["otherData"]["ranks"] == WORLD
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    for rank in range(WORLD):
        names = {(e["name"], lanes[(e["pid"], e["tid"])]) for e in spans if e["pid"] == rank}
        for expected in [("gradient hand-off", "backward"), ("step", "host"), ("update ahead", "update ahead"),
                         ("commit updates ahead", "host"), ("all-gather", "comm stream")]:
            assert expected in names, (rank, expected, sorted(names))
        assert any(name == "nvme read" for name, _ in names) and any(name == "nvme write" for name, _ in names)
        assert ("reduce", "comm stream") in names  # a bucket's span even at one rank, where nothing is sent


def test_existing_trace_file_is_refused_and_kept(device, ddp, shared_dir):
    trace = os.path.join(shared_dir, f"np{WORLD}-{device.type}-mine.json")
    if RANK == 0:
        with open(trace, "w") as f:
            f.write("the user's")
    dist.barrier()
    with pytest.raises(zest.Error, match="trace=.*exists.*remove it or name another"):
        zest.torch.Optimizer(make(device=device), config(shared_dir), trace=trace)
    dist.barrier()
    with open(trace) as f:
        assert f.read() == "the user's"
