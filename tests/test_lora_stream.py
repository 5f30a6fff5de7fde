"""LoRA with the frozen base streamed (issue 29; tiermem/models/lora_stream.py and
examples/train_lora.py ``--stream-weights``) on the CPU: the peft LoRA Llama whose decoder
layers' frozen weights stream through a store trains bit-identically to the same loop without
streaming (same optimizer, same activation offload, same checkpointing), every step's adapters
and loss, over 8 steps of different batches; bad flags get one line naming the flag, the value
and the fix (exit 2)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("peft")

from tiermem.models.lora_llama import (SHAPES, adapter_parameters, decoder_layers,  # noqa: E402
                                       frozen_parameters, lora_batches, lora_llama)
from tiermem.models.lora_stream import base_bytes, stream_lora_base  # noqa: E402
from test_lora import ex  # noqa: E402, F401  (the module-scoped examples/train_lora.py fixture)
from _lora_runs import assert_same_lora_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
SHAPE = dataclasses.replace(SHAPES["tiny"], layers=6)  # enough layers to refill in backward


def _train(ex, *, stream: dict | None, hybrid: bool, checkpoint: bool, offload: str | None):
    """Per-step (loss, adapters) of the LoRA loop of examples/train_lora.py (its optimizer and
    offloader), the base streamed with ``stream``'s options or not; and the stream's stats."""
    model = lora_llama(SHAPE, checkpoint=checkpoint, seed=0)
    handle = store = None
    if stream is not None:
        handle, store = stream_lora_base(model, device="cpu", **stream)
    opt = ex.make_optimizer(model, hybrid=hybrid)
    offloader = ex.make_offloader(model, checkpoint, offload) if offload else None
    out, stats = [], None
    try:
        for ids in lora_batches(SHAPE.vocab, 2, 16, STEPS):
            with offloader if offloader is not None else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if hybrid:
                opt.synchronize()
            out.append((loss.detach().clone(),
                        [p.detach().clone() for p in adapter_parameters(model)]))
        if handle is not None:
            stats = handle.stats()
            assert all(p.grad is None for p in frozen_parameters(model).values())
    finally:
        if hybrid:
            opt.close()
        if offloader is not None:
            offloader.close()
        if handle is not None:
            handle.close()
            store.close()
    return out, stats


CASES = [  # hybrid, checkpoint, activation offload
    (False, False, None), (True, False, "layers"), (True, True, "layers"),
    (False, True, None), (True, True, "layers+adapters"),
]


@pytest.mark.parametrize("hybrid,ckpt,offload", CASES)
def test_a_streamed_base_trains_bit_identical_to_the_loop_without_it(ex, hybrid, ckpt, offload):
    ref, _ = _train(ex, stream=None, hybrid=hybrid, checkpoint=ckpt, offload=offload)
    got, stats = _train(ex, stream=dict(prefetch_blocks=1), hybrid=hybrid, checkpoint=ckpt,
                        offload=offload)
    assert_same_lora_run(got, ref, STEPS)
    # every layer streamed: 6 layers, prefetch 1: the last 3 kept into the backward
    assert stats["fills"] == (2 * 6 - 3) * STEPS
    assert stats["peak_blocks"] <= 3


def test_the_nvme_tier_trains_bit_identical_too(ex, tmp_path):
    ref, _ = _train(ex, stream=None, hybrid=True, checkpoint=True, offload="layers")
    got, stats = _train(ex, stream=dict(tier="nvme", nvme_dir=str(tmp_path), prefetch_blocks=0),
                        hybrid=True, checkpoint=True, offload="layers")
    for (loss, adapters), (ref_loss, ref_adapters) in zip(got, ref):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(a, b) for a, b in zip(adapters, ref_adapters))
    assert stats["fills"] == (2 * 6 - 2) * STEPS


def test_the_comparison_can_fail(ex):
    """The same check sees a base weight changed behind the stream's back (the host copy the
    fills read): the losses differ from the second step on."""
    ref, _ = _train(ex, stream=None, hybrid=False, checkpoint=False, offload=None)
    model = lora_llama(SHAPE, seed=0)
    handle, store = stream_lora_base(model, device="cpu")
    opt = ex.make_optimizer(model, hybrid=False)
    losses = []
    for step, ids in enumerate(lora_batches(SHAPE.vocab, 2, 16, 2)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step == 0:
            weight = decoder_layers(model)[2].mlp.down_proj.base_layer.weight
            handle.host_copy(weight).mul_(1.5)
            handle.mark_changed(weight)
    handle.close()
    store.close()
    assert torch.equal(losses[0], ref[0][0])
    assert not torch.equal(losses[1], ref[1][0])


def test_the_store_holds_the_base_and_nothing_else():
    model = lora_llama(SHAPE, seed=0)
    total, largest = base_bytes(model)
    want = sum(p.numel() * p.element_size() for layer in decoder_layers(model)
               for p in layer.parameters() if not p.requires_grad)
    assert total == want and 0 < largest < total
    handle, store = stream_lora_base(model, device="cpu")
    try:
        assert store.config.cpu_bytes - total < max(1 << 20, largest) + 1
        streamed = {id(p.param) for b in handle._blocks for p in b.params}
        assert all(not p.param.requires_grad for b in handle._blocks for p in b.params)
        assert not any(id(p) in streamed for p in adapter_parameters(model))
    finally:
        handle.close()
        store.close()


def test_the_entry_point_compares_streamed_and_baseline(ex, capsys):
    code = ex.main(["--compare", "--stream-weights", "--checkpoint", "--steps", "8",
                    "--seq", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "streamed from cpu, prefetch 1, depth-first" in out
    assert "layer fills per step" in out and "max |loss difference|: 0 " in out


def _args(ex, **kw) -> argparse.Namespace:
    args = argparse.Namespace(preset="tiny", seq=16, batch=2, steps=STEPS, rank=8,
                              checkpoint=True, offload="layers", offload_fraction=1.0,
                              stream_weights=False, stream_tier="cpu", prefetch_blocks=1,
                              stream_schedule="depth-first", nvme_dir=None, gpu_bytes=None)
    return argparse.Namespace(**{**vars(args), **kw})


def test_run_streams_only_the_offload_run_and_matches_it(ex):
    """examples/train_lora.py's run(): with --stream-weights the tiermem run streams, and its
    losses and final adapters equal the same run without streaming."""
    args = _args(ex, stream_weights=True)
    streamed = ex.run(args, torch.device("cpu"), offload=True, log=lambda _: None)
    plain = ex.run(args, torch.device("cpu"), offload=True, log=lambda _: None, stream=False)
    assert streamed.stream_stats is not None and plain.stream_stats is None
    assert streamed.stream_stats["fills"] == STEPS * 3  # 3 layers, all kept into backward
    assert streamed.losses == plain.losses
    assert all(torch.equal(a, b) for a, b in zip(streamed.adapters, plain.adapters))


@pytest.mark.parametrize("argv,needle", [
    (["--stream-tier", "nvme"], "--stream-tier='nvme' sets how the base streams; fix: add "
                                "--stream-weights or drop --stream-tier"),
    (["--prefetch-blocks", "2"], "--prefetch-blocks=2 sets how the base streams"),
    (["--stream-weights", "--stream-schedule", "block-major"],
     "--stream-schedule=block-major drives tiermem's GPT blocks"),
    (["--stream-weights", "--stream-tier", "nvme"],
     "--stream-tier=nvme needs --nvme-dir DIR"),
    (["--stream-weights", "--prefetch-blocks", "-1"], "--prefetch-blocks=-1 must be an int >= 0"),
    (["--stream-weights", "--no-offload"], "--stream-weights streams the tiermem run"),
    (["--gpu-bytes", "24GiB"], "--gpu-bytes='24GiB' caps a CUDA device, not cpu; fix: "
                               "--device cuda"),
    (["--gpu-bytes", "lots"], "--gpu-bytes"),
    (["--gpu-bytes", "0"], "--gpu-bytes='0' must be > 0"),
])
def test_bad_streaming_flags_get_one_line_and_exit_2(ex, capsys, argv, needle):
    assert ex.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_lora: error: ") and err.count("\n") == 1, err
    assert needle in err, err


@pytest.mark.cuda
@pytest.mark.parametrize("offload", [False, True])
def test_cuda_streamed_base_under_a_cap_matches_the_unstreamed_run(ex, offload):
    """On CUDA (bf16 base built on the GPU, examples/train_lora.py's run()): the base streamed
    from pinned RAM, the process capped at 1 GiB after the stream, trains as the same run
    without streaming; the tolerance is the unstreamed run's own noise (run twice), 0 when
    its kernels are deterministic."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    args = _args(ex, stream_weights=True, checkpoint=True, gpu_bytes=1 << 30, seq=64)
    streamed = ex.run(args, device, offload=offload, log=lambda _: None, stream=True)
    args.gpu_bytes = None
    plain = [ex.run(args, device, offload=offload, log=lambda _: None, stream=False)
             for _ in range(2)]

    def diff(a, b):
        return max([abs(x - y) for x, y in zip(a.losses, b.losses)]
                   + [(x - y).abs().max().item() for x, y in zip(a.adapters, b.adapters)])

    noise = diff(plain[0], plain[1])
    assert diff(streamed, plain[0]) <= 4 * noise, (diff(streamed, plain[0]), noise)
    assert streamed.stream_stats["fills"] == STEPS * 3
    assert streamed.peak_bytes < 1 << 30
