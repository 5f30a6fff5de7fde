"""Weight streaming composes with what it is combined with (issue 29 item 5): activation offload
and checkpointing (depth-first and block-major), LoRA (a frozen base streamed, adapters resident
or streamed), MoE blocks whose experts get no token, tied embeddings; and refuses clearly what
it does not compose with. Every training run is 8 AdamW steps of different batches compared at
every step, bit for bit, with an independent unstreamed model built from the same seed
(Note [backward release], Note [block-major offload])."""

from __future__ import annotations

import pytest
import torch
from _stream_train import batches, fills_per_pass, make_model, train
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiermem import StoreConfig, TierStore
from tiermem.models.moe import MoE, MoEConfig
from tiermem.offload import offload_activations
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster
STEPS = 8


@pytest.fixture
def store(make_stream_store):
    return make_stream_store(nvme_bytes=16 << 20)


def _equal(a, b):
    assert len(a[0]) == len(b[0]) == STEPS
    for step, (x, y) in enumerate(zip(a[0], b[0])):
        assert torch.equal(x, y), f"step {step}: losses {x.tolist()} != {y.tolist()}"
    for k in b[1]:
        assert torch.equal(a[1][k], b[1][k]), f"final weight {k} differs"


def _fb(block_major=False, offload_store=None, **offload):
    """Each step's forward/backward, under one activation offloader made on first use."""
    held = {}

    def run(model, mb):
        if offload_store is None:
            return forward_backward(model, mb, block_major=block_major)
        if "off" not in held:
            held["off"] = offload_activations(model.blocks, store=offload_store, **offload)
        with held["off"]:
            return forward_backward(model, mb, block_major=block_major)

    run.held = held
    return run


# ---------------------------------------------------------------- activation offload, checkpoint

OFFLOAD_CASES = [  # kind, checkpoint, block-major, tier, offloaded layers
    ("gpt", False, False, "cpu", [0, 1, 2]),
    ("gpt", True, False, "nvme", [0, 1, 2, 3]),
    ("moe", True, False, "cpu", "auto"),
    ("gpt", False, True, "cpu", [0, 1, 2]),
    ("gpt", True, True, "nvme", "auto"),
    ("moe", False, True, "cpu", [1, 2]),
]


@pytest.mark.parametrize("kind,ckpt,major,tier,layers", OFFLOAD_CASES)
def test_activation_offload_and_checkpointing_with_a_stream_are_exact(
        store, tmp_path, kind, ckpt, major, tier, layers):
    """The stream's fills are planned around the offloader's reloads and the checkpoint's
    recomputation (no extra fill: 2 per block per micro-batch depth-first, 2 per step
    block-major); in a block-major step the offloader has nothing to move (Note [block-major
    offload]): before, it copied every recomputed block's activations out and straight back."""
    n_micro = 2
    ref = train(make_model(checkpoint=ckpt, kind=kind), steps=STEPS, n_micro=n_micro)
    (tmp_path / "act").mkdir()
    act = TierStore(StoreConfig(device="cpu", gpu_bytes=1 << 20, cpu_bytes=32 << 20,
                                pool_slab_bytes=1 << 20, nvme_bytes=64 << 20,
                                nvme_dir=str(tmp_path / "act"), io_backend="posix"))
    fb = _fb(major, act, tier=tier, layers=layers, min_offload_bytes=0)
    out = train(make_model(checkpoint=ckpt, kind=kind), steps=STEPS, n_micro=n_micro, fb=fb,
                stream=lambda m: stream_weights(m.blocks, store=store, tier="cpu",
                                                prefetch_blocks=1))
    _equal(out, ref)
    h, off = out[2], fb.held["off"]
    per_step = fills_per_pass(4, 1) * (1 if major else n_micro)
    assert h.stats()["fills"] == per_step * STEPS
    assert h.stats()["peak_blocks"] <= h.plan.buffer_blocks
    if major:
        assert off.counters["offloaded"] == 0 and off.counters["packed"] == 0
    else:
        assert off.counters["offloaded"] > 0 and off.counters["reloads"] > 0
    assert off.live_keys == 0
    h.close()
    off.close()
    act.close()


def test_reentrant_checkpointing_is_refused(store):
    model = make_model()
    h = stream_weights(model.blocks, store=store)
    idx, targets = batches(0, 1)[0]
    x = model.embed(idx)
    for block in model.blocks:
        x = checkpoint(block, x, use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"blocks\[3\] ran inside a backward but its forward "
                                           r"recorded no graph.*use_reentrant=False"):
        model.output(x, targets)[1].backward()
    assert not h.in_pass
    forward_backward(model, batches(1, 1))  # the stream stays usable
    h.close()


def test_offloading_streamed_weights_is_refused(store):
    model = make_model()
    h = stream_weights(model.blocks, store=store, resident=[3])
    with offload_activations(model.blocks, layers=[3], offload_weights=True):
        forward_backward(model, batches(0, 1))  # only a resident block: allowed
    with pytest.raises(RuntimeError, match=r"offload_activations\(offload_weights=True\) covers "
                                           r"streamed block 0.*pass offload_weights=False"):
        with offload_activations(model.blocks, layers=[0], offload_weights=True):
            forward_backward(model, batches(0, 1))
    assert not h.in_pass
    h.close()


# ---------------------------------------------------------------- LoRA


class LoRALinear(nn.Module):
    """A frozen ``base`` Linear plus a trainable rank-``rank`` update ``B(A(x)) * alpha/rank``."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # non-zero: both adapters learn at once
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


def lora_model(checkpoint=False):
    """The test GPT, every weight frozen, LoRA on each block's four Linears (seeded)."""
    model = make_model(checkpoint=checkpoint).requires_grad_(False)
    torch.manual_seed(1)
    for block in model.blocks:
        for name in ("qkv", "proj", "fc", "out"):
            setattr(block, name, LoRALinear(getattr(block, name)))
    return model


def _frozen(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


LORA_CASES = [  # frozen_only, checkpoint, block-major, activation offload, tier
    (True, False, False, False, "cpu"),
    (True, True, False, True, "nvme"),
    (True, False, True, False, "cpu"),
    (False, False, False, False, "cpu"),
    (False, True, True, True, "nvme"),
]


@pytest.mark.parametrize("frozen_only,ckpt,major,offload,tier", LORA_CASES)
def test_lora_with_a_streamed_frozen_base_is_exact_and_frees_each_block(
        store, frozen_only, ckpt, major, offload, tier):
    """The base streams, the adapters stay ordinary parameters (``frozen_only``) or stream
    with it; the base gets no gradient and does not move; each block leaves the device when its
    backward is done (Note [backward release]): before, a block whose streamed weights were all
    frozen stayed until the backward ended (every block at once), and a block that also
    streamed its adapters was freed before its frozen LayerNorm's backward read it."""
    ref_model = lora_model(ckpt)
    start = _frozen(ref_model)
    ref = train(ref_model, steps=STEPS, n_micro=2)
    model = lora_model(ckpt)
    act = TierStore(StoreConfig(device="cpu", gpu_bytes=1 << 20, cpu_bytes=16 << 20,
                                pool_slab_bytes=1 << 20)) if offload else None
    fb = _fb(major, act, layers=[0, 1, 2], min_offload_bytes=0)
    out = train(model, steps=STEPS, n_micro=2, fb=fb,
                stream=lambda m: stream_weights(m.blocks, store=store, tier=tier,
                                                prefetch_blocks=1, frozen_only=frozen_only))
    _equal(out, ref)
    h = out[2]
    streamed = [p.param for b in h._blocks for p in b.params]
    assert any(p.requires_grad for p in streamed) is not frozen_only
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters()
               if not p.requires_grad)  # the base did not move
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert h.stats()["fills"] == fills_per_pass(4, 1) * (1 if major else 2) * STEPS
    assert h.stats()["peak_blocks"] <= h.plan.buffer_blocks
    h.close()
    if act is not None:
        fb.held["off"].close()
        act.close()


def test_a_partly_frozen_block_is_exact(store):
    """Frozen LayerNorm and QKV weight in trainable blocks: the block stays on the device until
    its frozen weights' readers have run (before: 'weight of shape [0]' in LayerNorm)."""
    def model():
        m = make_model()
        for block in m.blocks:
            block.ln1.requires_grad_(False)
            block.qkv.weight.requires_grad_(False)
        return m

    ref = train(model(), steps=STEPS, n_micro=2)
    out = train(model(), steps=STEPS, n_micro=2,
                stream=lambda m: stream_weights(m.blocks, store=store, prefetch_blocks=0))
    _equal(out, ref)
    assert out[2].stats()["peak_blocks"] <= out[2].plan.buffer_blocks
    out[2].close()


def test_a_weight_unfrozen_after_streaming_is_refused(store):
    model = lora_model()
    h = stream_weights(model.blocks, store=store, frozen_only=True)
    model.blocks[1].fc.base.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"blocks\[1\].fc.base.weight requires grad now but "
                                         r"was frozen when stream_weights\(\) began"):
        forward_backward(model, batches(0, 1))
    model.blocks[1].fc.base.weight.requires_grad_(False)
    forward_backward(model, batches(0, 1))
    h.close()
    with pytest.raises(TypeError, match="frozen_only='yes' must be a bool"):
        stream_weights(model.blocks, store=store, frozen_only="yes")


def test_peft_lora_llama_with_a_streamed_base_is_exact(store):
    """peft's LoRA on a transformers Llama (tests/test_lora.py's model): the decoder layers'
    frozen weights stream, peft's adapters stay resident; checkpointed with
    use_reentrant=False as transformers does it for tiermem."""
    pytest.importorskip("peft")
    from tiermem.models.lora_llama import (SHAPES, adapter_parameters, decoder_layers,
                                           lora_batches, lora_llama)

    data = lora_batches(256, 2, 16, STEPS)

    def run(stream: bool, ckpt: bool):
        model = lora_llama(SHAPES["tiny"], checkpoint=ckpt, seed=0)
        opt = torch.optim.AdamW(adapter_parameters(model), lr=3e-3, weight_decay=0.1)
        h = stream_weights(decoder_layers(model), store=store, frozen_only=True,
                           prefetch_blocks=1) if stream else None
        losses = []
        for ids in data:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        adapters = [p.detach().clone() for p in adapter_parameters(model)]
        return losses, adapters, h

    for ckpt in (False, True):
        ref_losses, ref_adapters, _ = run(False, ckpt)
        losses, adapters, h = run(True, ckpt)
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), ckpt
        assert all(torch.equal(a, b) for a, b in zip(adapters, ref_adapters))
        assert all(not p.param.requires_grad for b in h._blocks for p in b.params)
        assert h.stats()["fills"] == fills_per_pass(3, 1) * STEPS  # 3 layers
        assert h.stats()["peak_blocks"] <= h.plan.buffer_blocks
        h.close()


# ---------------------------------------------------------------- MoE


def sparse_moe():
    torch.manual_seed(0)
    return MoE(MoEConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16, vocab=64, n_experts=8,
                         top_k=1, d_expert=48))


@pytest.mark.parametrize("major", [False, True])
def test_moe_experts_without_tokens_release_and_leave_no_stale_gradient(store, major):
    """Top-1 of 8 experts: some experts get no token in a step, so no gradient. Every step's
    gradients (None where the reference has None) and losses equal the unstreamed run's, and
    blocks leave the device after their backward (before: a block with an idle expert stayed
    until the backward ended)."""
    grads: dict = {"ref": [], "out": []}

    def record(which):
        def hook(model, step):
            grads[which].append({n: None if p.grad is None else p.grad.clone()
                                 for n, p in model.named_parameters()})
        return hook

    ref = train(sparse_moe(), steps=STEPS, n_micro=2, before_step=record("ref"))
    idle = [sum(g is None for g in step.values()) for step in grads["ref"]]
    assert sum(idle) > 0, "the test needs experts without tokens"
    out = train(sparse_moe(), steps=STEPS, n_micro=2, before_step=record("out"),
                fb=_fb(major), stream=lambda m: stream_weights(m.blocks, store=store,
                                                               prefetch_blocks=0))
    _equal(out, ref)
    for step, (a, b) in enumerate(zip(grads["out"], grads["ref"])):
        for name in b:
            assert (a[name] is None) == (b[name] is None), f"step {step}: {name}"
            assert b[name] is None or torch.equal(a[name], b[name]), f"step {step}: {name}"
    assert out[2].stats()["peak_blocks"] <= out[2].plan.buffer_blocks
    out[2].close()


# ---------------------------------------------------------------- tied weights


@pytest.mark.parametrize("major", [False, True])
def test_an_embedding_tied_to_the_head_outside_the_blocks_is_exact(store, major):
    """Against the same schedule unstreamed: block-major sums the tied weight's gradient in
    another order than depth-first (every micro-batch's head first, then the embeddings), so
    it equals depth-first only to rounding (Note [block-major schedule])."""
    def tied():
        m = make_model()
        m.head.weight = m.tok.weight
        return m

    ref = train(tied(), steps=STEPS, n_micro=2, fb=_fb(major))
    out = train(tied(), steps=STEPS, n_micro=2, fb=_fb(major),
                stream=lambda m: stream_weights(m.blocks, store=store))
    _equal(out, ref)
    out[2].close()


def test_a_parameter_shared_by_two_streamed_blocks_is_refused(store):
    model = make_model()
    model.blocks[2].fc.weight = model.blocks[0].fc.weight
    with pytest.raises(ValueError, match=r"blocks\[2\].fc.weight is the same parameter as "
                                         r"blocks\[0\].fc.weight \(tied weights across blocks\)"):
        stream_weights(model.blocks, store=store)
    assert len(store) == 0


class _Scaled(nn.Module):
    """``x + fc(x) * scale`` with ``scale`` passed in (a parameter of the model, not the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8).requires_grad_(False)

    def forward(self, x, scale):
        return x + self.fc(self.norm(x)) * scale


def test_a_parameter_passed_into_the_blocks_gathers_no_hooks(store):
    """A block input that is a Parameter outlives every pass: the release's input hooks are
    not put on it (one per pass would pile up), and training stays exact."""
    def build():
        torch.manual_seed(3)
        blocks = nn.ModuleList(_Scaled() for _ in range(3))
        return blocks, nn.Parameter(torch.ones(8))

    def loop(stream):
        blocks, scale = build()
        opt = torch.optim.AdamW([*blocks.parameters(), scale], lr=1e-2)
        h = stream_weights(blocks, store=store, prefetch_blocks=0) if stream else None
        losses = []
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            for b in blocks:
                x = b(x, scale)
            loss = x.square().mean()
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, scale, h

    ref, _, _ = loop(False)
    out, scale, h = loop(True)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert not scale._backward_hooks
    assert h.stats()["peak_blocks"] <= h.plan.buffer_blocks
    h.close()
