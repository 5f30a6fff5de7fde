"""The training loop the weight-streaming tests compare: a small GPT (or MoE), AdamW (weights
change every step), a different batch every micro-batch, depth-first micro-batches (or the
schedule given as ``fb``)."""

from __future__ import annotations

import torch

from tiermem.models.gpt import GPT, GPTConfig
from tiermem.models.moe import MoE, MoEConfig
from tiermem.schedule.micro_batches import forward_backward

CFG = GPTConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16, vocab=64)
MOE_CFG = MoEConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16, vocab=64, n_experts=4,
                    top_k=2, d_expert=48)


def make_model(dtype=torch.float32, checkpoint=False, seed=0, kind="gpt") -> GPT:
    torch.manual_seed(seed)
    if kind == "moe":
        return MoE(MOE_CFG, checkpoint=checkpoint).to(dtype)
    return GPT(CFG, checkpoint=checkpoint).to(dtype)


def frozen_gpt(seed=0) -> GPT:
    """The GPT of the stream tests with its blocks' matrices frozen (a base) and everything
    else trainable (LayerNorms, embeddings, head)."""
    m = make_model(seed=seed)
    for b in m.blocks:
        for p in b.parameters():
            if p.dim() == 2:
                p.requires_grad_(False)
    return m


def batches(step: int, n_micro: int, batch: int = 2) -> list:
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n_micro):
        idx = torch.randint(0, CFG.vocab, (batch, CFG.seq_len), generator=gen)
        out.append((idx, torch.roll(idx, -1, dims=1)))
    return out


def train(model, *, steps=8, n_micro=1, clip=None, stream=None, before_step=None,
          between_steps=None, fb=forward_backward):
    """Train ``model``; ``stream(model)`` (if given) starts weight streaming after the
    optimizer is made; ``fb(model, batches)`` runs each step's forward and backward. Returns
    the per-step micro-batch losses and the final weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    handle = stream(model) if stream is not None else None
    losses = []
    for step in range(steps):
        if between_steps is not None:
            between_steps(model, step)
        losses.append(torch.stack(fb(model, batches(step, n_micro))))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if before_step is not None:
            before_step(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return losses, weights, handle


def fills_per_pass(n_streamed: int, prefetch: int) -> int:
    """Fills of one pass that has a backward (depth-first: per micro-batch; block-major: per
    step): every streamed block twice, but the last ``prefetch + 2``, which the forward keeps
    on the device for the backward, once (Note [kept into backward])."""
    return 2 * n_streamed - min(prefetch + 2, n_streamed)


def step_snapshot(model, opt, losses: list, set_to_none: bool = True) -> tuple:
    """Step the HybridAdam ``opt``, zero its gradients (``set_to_none``) and wait for it; then
    ``(losses, {name: weight}, {(param index, state name): tensor})``: copies of the step's
    micro-batch ``losses`` (stacked), ``model``'s weights and ``opt``'s tensor state."""
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    opt.synchronize()
    losses = torch.stack(losses).detach()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    state = {(i, name): t.clone() for i, st in sd["state"].items() for name, t in st.items()
             if isinstance(t, torch.Tensor)}
    return losses, weights, state


def assert_same_steps(got, want, what: str) -> None:
    """``got`` and ``want``, lists of :func:`step_snapshot` per step, are bit-identical."""
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a[0], b[0]), f"{what} step {step}: losses {a[0]} != {b[0]}"
        for k in b[1]:
            assert torch.equal(a[1][k], b[1][k]), f"{what} step {step}: weight {k} differs"
        assert a[2].keys() == b[2].keys()
        for k in b[2]:
            assert torch.equal(a[2][k], b[2][k]), f"{what} step {step}: state {k} differs"


def assert_same_run(got, want, what: str) -> None:
    """``got`` and ``want`` (``(losses per step, {name: final weight})``) are bit-identical."""
    assert len(got[0]) == len(want[0])
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert torch.equal(a, b), f"{what}: step {step} losses {a.tolist()} != {b.tolist()}"
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), f"{what}: final weight {k} differs"
