"""Note [breadth-first blocks]: forward_backward gives depth-first's bits, alone and with
HybridAdam(param_sync="forward", max_grad_norm) over real training steps."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from tiermem.models.gpt import GPT, GPTConfig
from tiermem.models.moe import MoE, MoEConfig
from tiermem.optim import HybridAdam
from tiermem.schedule.micro_batches import forward_backward

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(n_layers=4, d_model=32, n_heads=4, seq_len=16, vocab=64)
BATCH, SEQ, MICRO = 2, 16, 3


def _model(kind: str, dtype=torch.float32, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "moe":
        return MoE(MoEConfig(**CFG, n_experts=4, top_k=2, d_expert=48), **kw).to(dtype)
    return GPT(GPTConfig(**CFG), **kw).to(dtype)


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, CFG["vocab"], (MICRO, BATCH, SEQ + 1), generator=g)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def _depth_first(model, batches) -> list[torch.Tensor]:
    losses = []
    for idx, targets in batches:
        _, loss = model(idx, targets)
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("kind", ["gpt", "moe"])
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_breadth_first_gives_the_depth_first_bits(kind, checkpoint, dtype, k):
    ref = _model(kind, dtype, checkpoint=checkpoint)
    model = copy.deepcopy(ref)
    batches = _batches(0)
    want = _depth_first(ref, batches)
    got = forward_backward(model, batches, breadth_first_blocks=k)
    assert [float(a) for a in got] == [float(b) for b in want]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert len({float(a) for a in got}) == MICRO  # the micro-batches differ


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_training_with_forward_sync_and_clipping_matches_depth_first(tier, tmp_path):
    """8 steps, a different batch every step, weights changing: breadth-first over 2 of 4
    blocks with param_sync="forward" (the next forward waits per module for chunks the worker
    steps in forward order) gives the same losses and params, bit for bit, as depth-first with
    param_sync="step"; both stay close to torch's AdamW with clip_grad_norm_ (independent)."""
    ref = _model("gpt", checkpoint=True)
    runs = []
    for k, sync in ((0, "step"), (2, "forward")):
        model = copy.deepcopy(ref)
        (tmp_path / f"spill{k}").mkdir()
        opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=0.7,
                         chunk_numel=2048, max_grad_norm=0.5, param_sync=sync,
                         grad_accumulation_steps=MICRO, state_tier=tier,
                         nvme_dir=str(tmp_path / f"spill{k}"))
        losses = []
        for step in range(8):
            losses.append([float(x) for x in
                           forward_backward(model, _batches(step), breadth_first_blocks=k)])
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.synchronize()
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        opt.close()
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(8):
        losses = [float(x) for x in _depth_first(ref, _batches(step))]
        assert losses == pytest.approx(runs[0][0][step], rel=1e-4)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
    d = CFG["d_model"]
    for a, (name, p) in zip(runs[0][1], ref.named_parameters()):
        a, p = a.clone(), p.detach().clone()
        if name.endswith("qkv.bias"):  # the key bias's true gradient is 0 (softmax ignores a
            a[d:2 * d] = p[d:2 * d] = 0  # shift), so it is rounding noise Adam scales to full steps
        torch.testing.assert_close(a, p, rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.equal(runs[0][1][0], _model("gpt").tok.weight)  # it trained


OFFLOAD_MODES = {"auto": dict(layers="auto"), "noncontiguous": dict(layers=[1, 3]),
                 "double_buffering": dict(layers=[0, 1, 2, 3], double_buffering=True),
                 "prefetch_depth_2": dict(num_layers=3, prefetch_depth=2),
                 "nvme": dict(layers=[0, 1, 2, 3], tier="nvme")}


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", sorted(OFFLOAD_MODES))
def test_activation_offload_around_breadth_first_keeps_the_bits(mode, checkpoint, tmp_path):
    """offload_activations around forward_backward (backward inside the with block; with
    breadth-first the blocks' saved tensors of every micro-batch wait for their backward, and
    layers="auto" makes its choice in the middle of a step): 6 AdamW steps of different
    batches give the losses and params of the same loop without offload, bit for bit."""
    from tiermem import StoreConfig, TierStore
    from tiermem.offload import offload_activations

    ref = _model("gpt", checkpoint=checkpoint)
    runs = []
    for offload in (False, True):
        model = copy.deepcopy(ref)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kw = dict(OFFLOAD_MODES[mode])
        store = TierStore(StoreConfig(cpu_bytes="64MiB", nvme_bytes="64MiB",
                                      nvme_dir=str(tmp_path)))
        offloader = offload_activations(model.blocks, store=store, **kw) if offload else None
        losses = []
        for step in range(6):
            with offloader if offloader is not None else contextlib.nullcontext():
                losses.append([float(x) for x in
                               forward_backward(model, _batches(step), breadth_first_blocks=2)])
            opt.step()
            opt.zero_grad(set_to_none=True)
        if offloader is not None:
            assert offloader.stats()["offloaded"] > 0 and offloader.stats()["live_keys"] == 0
            offloader.close()
        store.close()
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    for (name, _), a, b in zip(ref.named_parameters(), runs[0][1], runs[1][1]):
        assert torch.equal(a, b), name
    assert not torch.equal(runs[0][1][0], ref.tok.weight)  # it trained


def test_bad_arguments_are_named():
    model = _model("gpt")
    with pytest.raises(ValueError, match="breadth_first_blocks=5 exceeds the model's 4 blocks"):
        forward_backward(model, _batches(0), breadth_first_blocks=5)
    with pytest.raises(ValueError, match="breadth_first_blocks"):
        forward_backward(model, _batches(0), breadth_first_blocks=-1)
    with pytest.raises(TypeError, match="breadth_first_blocks"):
        forward_backward(model, _batches(0), breadth_first_blocks=True)
    with pytest.raises(ValueError, match="batches is empty"):
        forward_backward(model, [])
    with pytest.raises(TypeError, match="has no embed, blocks, run_block, output"):
        forward_backward(torch.nn.Linear(2, 2), _batches(0))
    assert all(p.grad is None for p in model.parameters())  # nothing ran


@pytest.mark.cuda
def test_cuda_breadth_first_with_forward_sync_trains_as_depth_first(tmp_path):
    """On CUDA, as train_large runs the 20B RAM preset but smaller: a GPT of 6 blocks of width
    2048 (sequence 2048, bf16, every block checkpointed), 4 micro-batches per step, HybridAdam
    with 74 % of the state off the GPU, bf16 moments, max_grad_norm 1 and 4M chunks, torch's
    default kernels, 8 steps of different batches. param_sync="forward" with 3 blocks
    breadth-first (the next forward waits per module for the CPU step, in forward order) must
    give every step's loss and the final params within 4x the noise of the depth-first,
    param_sync="step" run repeated 3 times (a stale or half-updated param changes a loss by far
    more: Note [training parity] in tests/test_cuda_training_parity.py)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run `pytest -m cuda` on a GPU machine)")
    cfg = GPTConfig(n_layers=6, d_model=2048, n_heads=16, seq_len=2048, vocab=32000)

    def batches(step):  # random tokens, each target a fixed function of its token: learnable
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab, (4, 1, cfg.seq_len), generator=g).cuda()
        return [(i, (i * 7 + 3) % cfg.vocab) for i in idx]

    def run(k, sync):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = GPT(cfg, checkpoint=True).to(torch.bfloat16)
        opt = HybridAdam(model.parameters(), lr=3e-4, weight_decay=0.1, offload_fraction=0.74,
                         moments_dtype=torch.bfloat16, max_grad_norm=1.0, chunk_numel=1 << 22,
                         param_sync=sync, grad_accumulation_steps=4)
        losses = []
        for step in range(8):
            losses.append(torch.stack(forward_backward(model, batches(step),
                                                       breadth_first_blocks=k)).mean())
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # the final params, through one more batch's loss
            losses.append(model(*batches(8)[0])[1])
        opt.synchronize()
        torch.cuda.synchronize()  # test only: read the results
        out = (torch.stack(losses).double().cpu(),
               torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]))
        opt.close()
        del model
        torch.cuda.empty_cache()
        return out

    refs = [run(0, "step") for _ in range(3)]
    got = run(3, "forward")
    (l0, p0), others = refs[0], refs[1:]
    loss_noise = max((l0 - l).abs().max().item() for l, _ in others)
    param_noise = max((p0 - p).norm().item() for _, p in others)
    tol = 4 * loss_noise + 1e-6 * l0.abs()
    diff = (got[0] - l0).abs()
    print(f"breadth-first/forward sync: loss diff per step {[f'{d:.2e}' for d in diff.tolist()]}"
          f", tol {[f'{t:.2e}' for t in tol.tolist()]}; params |diff| "
          f"{(got[1] - p0).norm().item():.3e} vs noise {param_noise:.3e}")
    assert (diff <= tol).all(), (got[0].tolist(), l0.tolist())
    assert (got[1] - p0).norm().item() <= 4 * param_noise + 1e-30
    torch.manual_seed(0)
    with torch.device("cuda"):
        init = torch.cat([p.detach().float().reshape(-1).cpu() for p in
                          GPT(cfg, checkpoint=True).to(torch.bfloat16).parameters()])
    assert (p0 - init).norm().item() > 10 * param_noise  # the weights moved, beyond noise
    assert (l0[0] - l0[-1]).item() > 0.1  # and the loss fell


def _batches_n(step: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(0, CFG["vocab"], (n, BATCH, SEQ + 1), generator=g)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


BLOCK_MAJOR_CASES = [  # kind, dtype, micro-batches, checkpoint, saved inputs' tier (None: device)
    ("gpt", torch.float32, 4, False, None),
    ("gpt", torch.bfloat16, 2, True, "cpu"),
    ("moe", torch.float32, 2, False, "cpu"),
    ("moe", torch.bfloat16, 1, True, None),
]


@pytest.mark.parametrize("kind,dtype,n_micro,checkpoint,saved", BLOCK_MAJOR_CASES)
def test_block_major_trains_as_depth_first(kind, dtype, n_micro, checkpoint, saved, tmp_path):
    """Note [block-major schedule], without weight streaming: 8 AdamW steps of different
    batches give every step's losses and the final weights of the depth-first loop, bit for
    bit, with each block's inputs on the device or in a store's cpu tier."""
    from tiermem import StoreConfig, TierStore

    ref = _model(kind, dtype, checkpoint=checkpoint)
    init = copy.deepcopy(ref)
    store = TierStore(StoreConfig(device="cpu", gpu_bytes="1MiB", cpu_bytes="4MiB",
                                  pool_slab_bytes="1MiB")) if saved else None
    runs = []
    for block_major in (False, True):
        model = copy.deepcopy(init)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        losses = []
        for step in range(8):
            mb = _batches_n(step, n_micro)
            kw = dict(block_major=True, saved_store=store, saved_tier=saved or "cpu") \
                if block_major else {}
            losses.append([float(x) for x in forward_backward(model, mb, **kw)])
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    for (name, _), a, b in zip(ref.named_parameters(), runs[0][1], runs[1][1]):
        assert torch.equal(a, b), name
    assert not torch.equal(runs[0][1][0], init.tok.weight)  # it trained
    if store is not None:
        assert len(store) == 0 and store.stats()["moved_bytes"].get("cpu->gpu", 0) > 0
        store.close()


def test_block_major_with_hybrid_adam_forward_sync_matches_depth_first(tmp_path):
    """HybridAdam counts each weight's backward passes (grad_accumulation_steps): block-major
    gives a weight its M gradients in a row instead of interleaved with the other blocks'.
    8 steps with param_sync="forward", max_grad_norm and 70 % offloaded: the same losses and
    params, bit for bit, as depth-first with param_sync="step"."""
    ref = _model("gpt", checkpoint=True)
    runs = []
    for block_major, sync in ((False, "step"), (True, "forward")):
        model = copy.deepcopy(ref)
        opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=0.7,
                         chunk_numel=2048, max_grad_norm=0.5, param_sync=sync,
                         grad_accumulation_steps=MICRO)
        losses = []
        for step in range(8):
            losses.append([float(x) for x in
                           forward_backward(model, _batches(step), block_major=block_major)])
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.synchronize()
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        opt.close()
    assert runs[0][0] == runs[1][0]
    for (name, _), a, b in zip(ref.named_parameters(), runs[0][1], runs[1][1]):
        assert torch.equal(a, b), name
    assert not torch.equal(runs[0][1][0], ref.tok.weight)  # it trained


def test_block_major_under_no_grad_is_refused():
    model = _model("gpt")
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"under torch.no_grad\(\)"):
        forward_backward(model, _batches(0), block_major=True)
    assert all(p.grad is None for p in model.parameters())
