"""examples/train_large.py ends within what training held (Note [closing without a copy] in
tiermem/stream/closing.py): the 13B stream preset's run on the H200 printed "done" at 112.8
GiB of RSS and was then OOM-killed (rc 137) in ``stream.close()``, which copied every streamed
weight back to the CPU where the model was built. Here the preset's code path, scaled down
(--tiny, 8 steps, HybridAdam stepping the streamed host copies), must allocate nothing near a
streamed weight's size after it prints "done", and leave the streamed weights dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from _examples import load_example
from _fresh_bytes import FreshBytes

ROOT = Path(__file__).resolve().parents[1]
PRESET = str(ROOT / "examples" / "configs" / "large" / "h200_13b_stream_24gib.yaml")


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_end_of_a_streamed_run_allocates_no_copy_of_the_weights(tmp_path, capsys,
                                                                    monkeypatch, one_thread,
                                                                    tier):
    example = load_example("train_large", "train_large_teardown")
    streams, fresh = [], FreshBytes()
    make_stream = example.stream_weights

    def stream_weights(*args, **kw):  # the run's stream, to look at after the run
        streams.append(make_stream(*args, **kw))
        return streams[-1]

    def hooked_print(*args, **kw):  # from "done" on, count what torch allocates
        print(*args, **kw)
        if args and str(args[0]).startswith("train_large: done"):
            fresh.__enter__()

    monkeypatch.setattr(example, "stream_weights", stream_weights)
    monkeypatch.setattr(example, "print", hooked_print, raising=False)
    argv = ["--config", PRESET, "--tiny", "--nvme-dir", str(tmp_path), "--steps", "8",
            "model.n_layers=4", f"streaming.gpu_bytes={_buffers_only_bytes()}",
            f"streaming.tier={tier}"]
    try:
        code = example.main(argv)
    finally:
        if torch_mode_active(fresh):
            fresh.__exit__(None, None, None)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "train_large: done" in out.out and len(streams) == 1
    stream = streams[0]
    params = [e.param for b in stream._blocks for e in b.params]
    streamed = sum(e.nbytes for b in stream._blocks for e in b.params)
    largest = max(e.nbytes for b in stream._blocks for e in b.params)
    assert len(stream.plan.streamed) == 4 and stream.closed  # every block streamed
    # today's end copied all the streamed weights (``streamed`` bytes) to the CPU
    assert fresh.bytes < largest, (fresh.bytes, fresh.largest, largest, streamed)
    assert all(p.numel() == 0 and p.grad is None for p in params)


def _buffers_only_bytes() -> int:
    """streaming.gpu_bytes that holds only the (prefetch 1 + 2) buffers of --tiny's fp32
    blocks (width 64): every block streamed."""
    import torch  # noqa: PLC0415
    from tiermem.models.gpt import GPT, GPTConfig  # noqa: PLC0415
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=32, vocab=128))
    return 3 * sum(p.numel() for p in model.blocks[0].parameters()) * 4


def torch_mode_active(mode: FreshBytes) -> bool:
    """Whether ``mode`` is on this thread's dispatch mode stack (entered at "done")."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return any(m is mode for m in _get_current_dispatch_mode_stack())
