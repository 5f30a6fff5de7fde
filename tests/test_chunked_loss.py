"""The chunked loss of the reference models (Note [chunked loss] in tiermem/models/gpt.py): the
same loss and gradients as the loss on the full logits up to float rounding, no full logits
tensor, one-line errors for bad input, and bit-identical training with activation offload."""

from __future__ import annotations

import pytest
import torch

from tiermem.models.gpt import GPT, IGNORE_INDEX, GPTConfig
from tiermem.models.moe import MoE, MoEConfig
from tiermem.offload import offload_activations

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab=64)
BATCH, SEQ = 2, 16  # 32 tokens a batch
TOKENS = BATCH * SEQ


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG), **kw)


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(**CFG, n_experts=4, top_k=2, d_expert=48), **kw)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG["vocab"], (BATCH, SEQ), generator=g)
    return idx, torch.randint(0, CFG["vocab"], (BATCH, SEQ), generator=g)


def _loss_and_grads(model, idx, targets) -> tuple[torch.Tensor, list[torch.Tensor]]:
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


# ---------------------------------------------------------------------------------- same loss


@pytest.mark.parametrize("make", [_gpt, _moe], ids=["gpt", "moe"])
@pytest.mark.parametrize("chunk", [1, 7, 12, TOKENS, 1000])  # 7, 12 do not divide 32 tokens
@pytest.mark.parametrize("checkpoint", [False, True])
def test_chunked_loss_and_gradients_match_the_full_logits(make, chunk, checkpoint):
    idx, targets = _batch(1)
    ref_loss, ref_grads = _loss_and_grads(make(checkpoint=checkpoint), idx, targets)
    model = make(checkpoint=checkpoint, loss_chunk_tokens=chunk)
    logits, _ = model(idx, targets)
    assert logits is None  # not materialized
    loss, grads = _loss_and_grads(model, idx, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7, msg=f"gradient {i}")


def test_ignored_targets_are_left_out_of_the_mean_as_in_cross_entropy():
    idx, targets = _batch(2)
    targets[0, :9] = IGNORE_INDEX
    targets[1, 3] = IGNORE_INDEX
    ref_loss, ref_grads = _loss_and_grads(_gpt(), idx, targets)
    loss, grads = _loss_and_grads(_gpt(loss_chunk_tokens=5), idx, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_without_targets_or_chunks_the_logits_are_returned_as_before():
    idx, targets = _batch(3)
    ref_logits, ref_loss = _gpt()(idx, targets)
    chunked = _gpt(loss_chunk_tokens=8)
    logits, loss = chunked(idx)
    assert loss is None and torch.equal(logits, ref_logits)
    chunked.loss_chunk_tokens = None  # switched off: the full logits and their loss again
    logits, loss = chunked(idx, targets)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)


def test_eval_without_grad_is_chunked_too():
    idx, targets = _batch(4)
    ref = _gpt()(idx, targets)[1]
    with torch.no_grad():
        logits, loss = _gpt(loss_chunk_tokens=10, checkpoint=True)(idx, targets)
    assert logits is None and loss.grad_fn is None
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 8])
def test_no_full_logits_tensor_exists_in_forward_or_backward(chunk):
    """The head's outputs (also when backward recomputes them) and every activation autograd
    saves outside the checkpointed chunks stay below tokens x vocab elements; without chunks
    both reach it (so the check can fail)."""
    vocab = 512  # wider than the MLP's hidden layer (4 x 32), as in a real LM
    model = GPT(GPTConfig(**{**CFG, "vocab": vocab}), loss_chunk_tokens=chunk)
    full = TOKENS * vocab
    head_outputs: list[int] = []
    model.head.register_forward_hook(lambda m, i, out: head_outputs.append(out.numel()))
    saved: list[int] = []  # numel of every saved tensor but the weights (views of them too)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(t.numel())
        return t

    idx, targets = _batch(5)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, targets)
    loss.backward()
    if chunk is None:
        assert head_outputs == [full] and max(saved) >= full
    else:
        assert len(head_outputs) == 2 * TOKENS // chunk  # every chunk, again in backward
        assert max(head_outputs) == chunk * vocab and max(saved) < full


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("value, exc, match", [
    (0, ValueError, r"GPT: loss_chunk_tokens=0 must be an int >= 1 \(tokens\); give the tokens"),
    (-4, ValueError, r"GPT: loss_chunk_tokens=-4 must be an int >= 1"),
    (4.0, TypeError, r"GPT: loss_chunk_tokens must be an int >= 1 \(tokens\), got float 4.0; "),
    ("4096", TypeError, r"got str '4096'; give the tokens per loss chunk \(e.g. 4096\), or None"),
    (True, TypeError, r"got bool True"),
])
def test_bad_loss_chunk_tokens_is_named_with_the_fix(value, exc, match):
    with pytest.raises(exc, match=match):
        GPT(GPTConfig(**CFG), loss_chunk_tokens=value)
    model = _gpt()
    with pytest.raises(exc, match=match):
        model.loss_chunk_tokens = value
    assert model.loss_chunk_tokens is None  # unchanged
    with pytest.raises(exc, match=match.replace("GPT:", "MoE:")):
        MoE(MoEConfig(**CFG), loss_chunk_tokens=value)


def test_targets_of_another_size_are_rejected():
    idx, targets = _batch(6)
    with pytest.raises(ValueError, match=r"GPT: targets has 31 elements for 32 tokens \(idx "
                                         r"shape \(2, 16\)\); give one target id per token"):
        _gpt(loss_chunk_tokens=8)(idx, targets.reshape(-1)[:-1])


# ---------------------------------------------------------------------------------- training


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("checkpoint, layers", [(True, range(3)), (False, range(2))],
                         ids=["checkpoint-all-inputs", "no-checkpoint-all-but-last"])
def test_chunked_training_with_offload_is_bit_identical(make_store, tier, checkpoint, layers):
    """AdamW steps on a new batch each, chunked loss (10 tokens: 32 is not a multiple), with and
    without offload: every loss and the final weights are bit-identical, and the weights moved."""
    cfg = GPTConfig(**{**CFG, "n_layers": 3})
    steps = 8

    def train(offload: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], dict | None]:
        torch.manual_seed(0)
        model = GPT(cfg, checkpoint=checkpoint, loss_chunk_tokens=10)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ctx = (offload_activations(model.blocks, store=make_store(), tier=tier, layers=layers)
               if offload else None)
        losses = []
        for step in range(steps):
            idx, targets = _batch(100 + step)
            if ctx is None:
                _, loss = model(idx, targets)
                loss.backward()
            else:
                with ctx:
                    _, loss = model(idx, targets)
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return losses, [p.detach().clone() for p in model.parameters()], \
            (ctx.stats() if ctx is not None else None)

    torch.manual_seed(0)
    initial = [p.detach().clone() for p in GPT(cfg).parameters()]
    ref_losses, ref_params, _ = train(offload=False)
    losses, params, stats = train(offload=True)
    assert stats["offloaded"] >= steps and stats["reloads"] >= steps and stats["live_keys"] == 0
    assert len(set(float(x) for x in ref_losses)) == steps  # every step saw a new loss
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(a, b), f"step {step}: {a.item()!r} != {b.item()!r}"
    for i, (p, r, p0) in enumerate(zip(params, ref_params, initial)):
        assert torch.equal(p, r), f"parameter {i} differs after {steps} steps"
        assert not torch.equal(p, p0), f"parameter {i} did not change"
