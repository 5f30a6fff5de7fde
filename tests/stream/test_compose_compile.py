"""torch.compile of single streamed blocks (Note [compiled blocks]): compiled in place before or
after streaming, or wrapped (``torch.compile(block)`` in ``model.blocks``), 8 AdamW steps equal
bit for bit, every step, to the same compiled model unstreamed (built from the same seed), with
one dynamo frame per compiled call (the stream's hooks are not traced)."""

from __future__ import annotations

import pytest
import torch
from _stream_train import fills_per_pass, make_model, train

from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 8


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(model, backend, how):
    for i, block in enumerate(model.blocks):
        if how == "wrapped":
            model.blocks[i] = torch.compile(block, backend=backend)
        else:
            block.compile(backend=backend)
    return model


def _fb(major):
    return lambda m, b: forward_backward(m, b, block_major=major)


CASES = [  # backend, how, when, block-major
    ("aot_eager", "in_place", "before", False),
    ("aot_eager", "in_place", "after", False),
    ("aot_eager", "wrapped", "before", False),
    ("aot_eager", "in_place", "before", True),
    ("inductor", "in_place", "before", False),
]


@pytest.mark.parametrize("backend,how,when,major", CASES)
def test_compiled_blocks_stream_exactly(store, backend, how, when, major):
    from torch._dynamo.utils import counters

    ref = train(_compile(make_model(), backend, how), steps=STEPS, n_micro=2, fb=_fb(major))
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    if when == "before":
        _compile(model, backend, how)

    def stream(m):
        h = stream_weights(m.blocks, store=store, prefetch_blocks=1)
        if when == "after":
            _compile(m, backend, how)
        return h

    out = train(model, steps=STEPS, n_micro=2, fb=_fb(major), stream=stream)
    for step, (x, y) in enumerate(zip(out[0], ref[0])):
        assert torch.equal(x, y), f"step {step}: {x.tolist()} != {y.tolist()}"
    for k in ref[1]:
        key = k if k in out[1] else k.replace("._orig_mod", "")
        assert torch.equal(out[1][key], ref[1][k]), k
    # the blocks' forward compiled once for all blocks (and once more for the recomputation's
    # or the no_grad forward's graph): the stream's hooks added no frame, break or recompile
    assert counters["frames"]["total"] <= 2, dict(counters["frames"])
    assert not counters["graph_break"], list(counters["graph_break"])
    h = out[2]
    assert h.stats()["fills"] == fills_per_pass(4, 1) * (1 if major else 2) * STEPS
    h.close()
