"""Weight streaming refuses data parallel (DDP) and FSDP2 with one line naming the wrapper and
the fix, whichever was applied first (docs/streaming.md, "What it refuses"). A single-process
gloo group on the CPU stands for the real ones (tests/distributed start multi-process ones)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _stream_train import batches, make_model

from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def group(tmp_path):
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of the caller")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


DDP_ERROR = (r"streamed blocks run inside a DistributedDataParallel forward; .*data parallel "
             r"with weight streaming is not supported: train on one process")


@pytest.mark.parametrize("ddp_first", [False, True])
def test_ddp_is_refused_whichever_comes_first(group, store, ddp_first):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    idx, targets = batches(0, 1)[0]
    if ddp_first:
        ddp = DDP(model)
        h = stream_weights(model.blocks, store=store)
    else:
        h = stream_weights(model.blocks, store=store)
        ddp = DDP(model)
    with pytest.raises(RuntimeError, match=DDP_ERROR):
        ddp(idx, targets)
    assert not h.in_pass
    forward_backward(model, batches(1, 1))  # without DDP the stream trains on
    h.close()


def test_fully_shard_after_streaming_is_refused(group, store):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    h = stream_weights(model.blocks, store=store)
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"blocks\[0\].ln1.weight is no longer the parameter "
                                           r"stream_weights\(\) streams .*fully_shard.*does not "
                                           r"compose"):
        model(*batches(0, 1)[0])
    assert not h.in_pass
    h.close(force=True)


def test_streaming_a_fully_sharded_model_is_refused(group, store):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    with pytest.raises(ValueError, match=r"blocks\[0\].ln1.weight is sharded \(a DTensor: "
                                         r"FSDP2's fully_shard.*does not compose with FSDP2"):
        stream_weights(model.blocks, store=store)
    assert len(store) == 0
