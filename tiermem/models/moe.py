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
(``d_expert`` each), plus a few bytes of routing indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


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
        d = self.d_model
        block = 4 * d + 3 * d * d + (d * d + d) + d * self.n_experts \
            + self.n_experts * self.expert_params()
        return self.vocab * d * 2 + self.seq_len * d + self.n_layers * block + 2 * d

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


class MoEBlock(nn.Module):
    """Pre-LN block: causal SDPA attention (fused QKV), then the MoE MLP."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        # no QKV bias: the key bias's gradient is zero in exact arithmetic (softmax is
        # shift-invariant), so Adam would turn its rounding noise into full-size updates
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.moe = MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.moe(self.ln2(x))


class MoE(nn.Module):
    """Token + position embeddings, ``n_layers`` MoE blocks, final LN, untied LM head.

    Args:
        cfg: the shape.
        checkpoint: run each block under ``torch.utils.checkpoint`` (non-reentrant).
    """

    def __init__(self, cfg: MoEConfig, checkpoint: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)`` for token ids ``idx`` ``(batch, seq)``; ``loss`` (mean
        cross-entropy, nats/token) is None without ``targets``.

        Raises:
            ValueError: a sequence longer than ``cfg.seq_len``.
        """
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds MoEConfig.seq_len={self.cfg.seq_len}; "
                             f"shorten the batch or raise seq_len")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss
