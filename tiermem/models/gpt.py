"""The reference GPT of the benchmarks, ``tiermem demo`` and ``tiermem tune`` (pre-LN, SDPA causal
attention, GELU MLP).

``GPT(GPTConfig(n_layers=24, d_model=2048, n_heads=16, seq_len=2048, vocab=32000))`` is the
reference workload of docs/benchmarks.md (1.34B parameters, bf16 on the GPU). ``model.blocks`` is the
``nn.ModuleList`` of blocks to hand to :func:`tiermem.offload.offload_activations`;
``checkpoint=True`` runs each block under non-reentrant activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the reference GPT."""

    n_layers: int = 24
    """Number of transformer blocks."""
    d_model: int = 2048
    """Model width."""
    n_heads: int = 16
    """Attention heads (``d_model`` must be divisible by it)."""
    seq_len: int = 2048
    """Maximum sequence length in tokens."""
    vocab: int = 32000
    """Vocabulary size in tokens."""
    mlp_ratio: int = 4
    """MLP hidden width / ``d_model``."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be an int >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by "
                             f"n_heads={self.n_heads}")

    def num_params(self) -> int:
        """Parameter count (untied head; biases and norms included)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return self.vocab * d * 2 + self.seq_len * d + self.n_layers * block + 2 * d


class Block(nn.Module):
    """Pre-LN transformer block with fused QKV and causal SDPA attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, final LN, untied LM head.

    Args:
        cfg: the shape.
        checkpoint: run each block under ``torch.utils.checkpoint`` (non-reentrant).
    """

    def __init__(self, cfg: GPTConfig, checkpoint: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``; ``loss`` is None without ``targets``.

        Raises:
            ValueError: a sequence longer than ``cfg.seq_len``.
        """
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss
