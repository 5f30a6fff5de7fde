"""Small models shared by the tests: a GPT-style stack (``TinyGPT``) and deterministic batches.

``TinyGPT(vocab=64, d_model=32, n_heads=4, n_layers=4, seq_len=16)`` is a pre-LN transformer
with causal SDPA attention and a GELU MLP; ``model.blocks`` is the ``nn.ModuleList`` of its
blocks. ``checkpoint_blocks=True`` wraps each block in non-reentrant activation checkpointing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)  # views of one storage
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A small GPT: token + position embeddings, ``n_layers`` blocks, final LN, LM head.

    Args:
        vocab: vocabulary size (tokens).
        d_model: model width.
        n_heads: attention heads.
        n_layers: number of blocks (``self.blocks``).
        seq_len: maximum sequence length (tokens).
        dropout: dropout probability (0 keeps runs deterministic).
        tie_weights: share the token embedding with the LM head.
        checkpoint_blocks: run each block under non-reentrant activation checkpointing.
    """

    def __init__(self, vocab: int = 64, d_model: int = 32, n_heads: int = 4, n_layers: int = 4,
                 seq_len: int = 16, dropout: float = 0.0, tie_weights: bool = False,
                 checkpoint_blocks: bool = False) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.tok.weight
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={self.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def make_batch(seed: int, batch: int = 4, seq_len: int = 16, vocab: int = 64,
               device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Return deterministic ``(idx, targets)`` int64 tensors of shape ``(batch, seq_len)``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq_len), generator=g)
    targets = torch.randint(0, vocab, (batch, seq_len), generator=g)
    return idx.to(device), targets.to(device)
