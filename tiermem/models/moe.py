"""A small mixture-of-experts transformer (pre-LN, causal SDPA attention, top-k routed MLPs).

``MoE(MoEConfig(n_layers=4, d_model=256, n_experts=8, top_k=2))``: each block's MLP is
``n_experts`` GELU MLPs and a softmax router; every token goes to the ``top_k`` experts of
highest router probability, and their outputs are summed with those probabilities renormalised
over the chosen ``top_k``. Each expert runs densely on just its tokens (``index_select`` in,
``scatter_add`` back), so an expert that receives no token in a step does not run and its
parameters get no gradient (``p.grad is None``, which torch's optimizers and
:class:`tiermem.optim.HybridAdam` skip). There is no load-balancing loss and no capacity limit:
routing is exactly top-k. ``model.blocks`` is the ``nn.ModuleList`` of blocks to hand to
:func:`tiermem.offload.offload_activations`; after a forward, ``block.moe.tokens_per_expert``
holds the routed-token count per expert. Grouping tokens by expert needs the counts on the
host: one device synchronisation per block and forward on CUDA.

``MoEConfig.num_params()`` counts every parameter (what the weights, gradients and optimizer
state cost); ``MoEConfig.active_params()`` counts the parameters one token uses (``top_k``
experts per block: the compute per token scales with these). The activations a block saves
depend on ``top_k``, not ``n_experts``, and not on how the tokens are spread over the experts:
per token, the attention part of a dense block plus ``top_k`` copies of the expert input and
output (``d_model`` each) and of the expert's hidden layer before and after the GELU
(``d_expert`` each), plus a few bytes of gates and routing indices
(:func:`tiermem.apps.plan.moe_activation_bytes_per_block` counts them; ``tiermem plan --experts E
--top-k K --d-expert H`` sizes a run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tiermem.models.gpt import DecoderLM, PreLNBlock, decoder_params


@dataclass(kw_only=True)
class MoEConfig:
    """Shape of the MoE transformer.

    Raises:
        ValueError: a field that is not an int >= 1, ``d_model`` not divisible by ``n_heads``,
            or ``top_k`` > ``n_experts``.
    """

    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 256
    """Model width."""
    n_heads: int = 4
    """Attention heads (``d_model`` must be divisible by it)."""
    seq_len: int = 256
    """Maximum sequence length in tokens."""
    vocab: int = 32000
    """Vocabulary size in tokens."""
    n_experts: int = 8
    """Experts per block."""
    top_k: int = 2
    """Experts each token is routed to (<= ``n_experts``)."""
    d_expert: int = 512
    """Hidden width of each expert's MLP."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab", "n_experts", "top_k",
                     "d_expert"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name}={value!r} must be an int >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"MoEConfig.d_model={self.d_model} must be divisible by "
                             f"n_heads={self.n_heads}")
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}; "
                             f"route each token to at most n_experts experts")

    def expert_params(self) -> int:
        """Parameters of one expert MLP (weights and biases)."""
        d, h = self.d_model, self.d_expert
        return (d * h + h) + (h * d + d)

    def num_params(self) -> int:
        """Total parameter count: embeddings, untied head, norms, attention, routers, all experts."""
        return decoder_params(n_layers=self.n_layers, d_model=self.d_model, seq_len=self.seq_len,
                              vocab=self.vocab, qkv_bias=False,
                              mlp_params=self.d_model * self.n_experts
                              + self.n_experts * self.expert_params())

    def active_params(self) -> int:
        """Parameters one token uses: the total less the ``n_experts - top_k`` experts per block
        it is not routed to (the embedding tables and the head count in full)."""
        return self.num_params() - self.n_layers * (self.n_experts - self.top_k) * self.expert_params()


class Expert(nn.Module):
    """One expert: a GELU MLP ``d_model -> d_expert -> d_model``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_expert)
        self.out = nn.Linear(cfg.d_expert, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class MoELayer(nn.Module):
    """Softmax router + ``n_experts`` experts; each token goes to its ``top_k`` best experts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))
        self.tokens_per_expert: torch.Tensor | None = None  # int64 [n_experts], last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, d_model)
        # softmax over the top_k logits = the router's softmax renormalised over the chosen
        # experts, but the others' logits get an exactly zero gradient (not rounding noise)
        logits, chosen = self.router(x).topk(self.top_k, dim=-1)  # (tokens, top_k)
        weights = F.softmax(logits, dim=-1, dtype=torch.float32).to(x.dtype)
        flat = chosen.flatten()
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.tokens_per_expert = counts.detach()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens, gates = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        sizes = counts.tolist()
        for expert, tok, gate in zip(self.experts, tokens.split(sizes), gates.split(sizes)):
            if tok.numel():  # an expert without tokens does not run: its params get no grad
                y = expert(x.index_select(0, tok)) * gate.unsqueeze(1)
                # scatter_add saves only the index (index_add would save y as well); a token
                # appears once per expert, so there are no colliding adds
                out = out.scatter_add(0, tok.unsqueeze(1).expand_as(y), y)
        return out.view(shape)


class MoEBlock(PreLNBlock):
    """Pre-LN block (:class:`tiermem.models.gpt.PreLNBlock`, no QKV bias), then the MoE MLP."""

    def __init__(self, cfg: MoEConfig) -> None:
        # no QKV bias: the key bias's gradient is zero in exact arithmetic (softmax is
        # shift-invariant), so Adam would turn its rounding noise into full-size updates
        super().__init__(cfg.d_model, cfg.n_heads, qkv_bias=False)
        self.moe = MoELayer(cfg)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class MoE(DecoderLM):
    """Token + position embeddings, ``n_layers`` MoE blocks, final LN, untied LM head
    (:class:`tiermem.models.gpt.DecoderLM`; ``forward(idx, targets)`` returns ``(logits, loss)``
    and raises ValueError for a sequence longer than ``cfg.seq_len``).

    Args:
        cfg: the shape.
        checkpoint: run each block under ``torch.utils.checkpoint`` (non-reentrant).
        loss_chunk_tokens: None, or the tokens per checkpointed loss chunk; then ``forward``
            with targets returns ``(None, loss)`` (Note [chunked loss] in tiermem/models/gpt.py).

    Raises:
        TypeError, ValueError: ``loss_chunk_tokens`` not None or an int >= 1.
    """

    def __init__(self, cfg: MoEConfig, checkpoint: bool = False, *,
                 loss_chunk_tokens: int | None = None) -> None:
        super().__init__(cfg, MoEBlock, checkpoint, loss_chunk_tokens=loss_chunk_tokens)
