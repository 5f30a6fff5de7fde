"""The reference GPT of the benchmarks, ``tiermem demo`` and ``tiermem tune`` (pre-LN, SDPA causal
attention, GELU MLP).

``GPT(GPTConfig(n_layers=24, d_model=2048, n_heads=16, seq_len=2048, vocab=32000))`` is the
reference workload of docs/benchmarks.md (1.34B parameters, bf16 on the GPU). ``model.blocks`` is the
``nn.ModuleList`` of blocks to hand to :func:`tiermem.offload.offload_activations`;
``checkpoint=True`` runs each block under non-reentrant activation checkpointing;
``loss_chunk_tokens=C`` computes the training loss in checkpointed chunks of at most C tokens so
that no full logits tensor exists (Note [chunked loss]).

The pre-LN block (:class:`PreLNBlock`: LNs, fused QKV, causal SDPA, residuals; the MLP left to a
subclass) and the decoder around the blocks (:class:`DecoderLM`: embeddings, checkpointing, final
LN, head, loss) are shared with :mod:`tiermem.models.moe`, whose blocks swap the MLP for experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiermem.names import check_int, short_repr

IGNORE_INDEX = -100
"""Target id that the loss skips (``F.cross_entropy``'s default ``ignore_index``)."""


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
                raise ValueError(f"GPTConfig.{name}={short_repr(value)} must be an int >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by "
                             f"n_heads={self.n_heads}")

    def num_params(self) -> int:
        """Parameter count (untied head; biases and norms included)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        return decoder_params(n_layers=self.n_layers, d_model=d, seq_len=self.seq_len,
                              vocab=self.vocab, qkv_bias=True, mlp_params=(d * h + h) + (h * d + d))


def decoder_params(*, n_layers: int, d_model: int, seq_len: int, vocab: int, qkv_bias: bool,
                   mlp_params: int) -> int:
    """Parameter count of a :class:`DecoderLM` (untied head; biases and norms included).

    Args:
        n_layers, d_model, seq_len, vocab: the shape (blocks, width, positions, tokens).
        qkv_bias: whether the fused QKV projection has a bias.
        mlp_params: parameters of one block's MLP.

    Raises:
        nothing: plain arithmetic on the given ints.
    """
    d = d_model
    attention = 4 * d + (3 * d * d + (3 * d if qkv_bias else 0)) + (d * d + d)  # 2 LNs, QKV, proj
    return vocab * d * 2 + seq_len * d + n_layers * (attention + mlp_params) + 2 * d


class PreLNBlock(nn.Module):
    """Pre-LN transformer block: ``x + proj(attn(ln1(x)))``, then ``x + mlp(ln2(x))``.

    Fused QKV and causal SDPA attention; subclasses add the MLP's modules after calling this
    ``__init__`` (so parameter names and their order are ``ln1, qkv, proj, ln2``, then the MLP's)
    and define :meth:`mlp`.

    Args:
        d_model: width (must be divisible by ``n_heads``: the configs check it).
        n_heads: attention heads.
        qkv_bias: give the fused QKV projection a bias.
    """

    def __init__(self, d_model: int, n_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=qkv_bias)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The block's MLP on the normalised residual ``x`` ``(batch, seq, d_model)``.

        Raises:
            NotImplementedError: always here; subclasses define the MLP.
        """
        raise NotImplementedError(f"{type(self).__name__}.mlp: a PreLNBlock subclass defines "
                                  f"its MLP")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class Block(PreLNBlock):
    """The GPT block: :class:`PreLNBlock` with a QKV bias and a GELU MLP (``fc``, ``out``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.d_model, cfg.n_heads, qkv_bias=True)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class DecoderLM(nn.Module):
    """Token + position embeddings, ``cfg.n_layers`` blocks, final LN, untied LM head.

    Args:
        cfg: the shape (``n_layers``, ``d_model``, ``seq_len``, ``vocab``).
        block: builds one block from ``cfg``.
        checkpoint: run each block under ``torch.utils.checkpoint`` (non-reentrant).
        loss_chunk_tokens: ``None`` (default): the loss is computed on the full logits. A
            positive int C: with ``targets``, the head and the loss run in checkpointed chunks
            of at most C tokens and ``forward`` returns ``(None, loss)`` (Note [chunked loss]).

    Raises:
        TypeError: ``loss_chunk_tokens`` neither None nor an int (a bool is not an int).
        ValueError: ``loss_chunk_tokens`` < 1.

    Note [chunked loss]: the LM head and the loss dominate the activation memory of a
    checkpointed, offloaded model, because their tensors are V (vocabulary) wide where a block's
    are d wide. Without chunks, for N = batch x seq tokens and a bytes per logit (2 in bf16, 4 in
    fp32), forward makes the logits (N·V·a bytes, returned to the caller, who usually holds them
    through backward), their fp32 copy for the loss (N·V·4, transient when a = 2) and the
    log-softmax that ``F.cross_entropy`` saves (N·V·4); backward makes the log-softmax's
    gradient and the fp32 logits' gradient (N·V·4 each) while the saved log-softmax and the
    caller's logits are still alive: about N·V·(12 + a) bytes at once. With
    ``loss_chunk_tokens=C`` the final LN runs once on all tokens, then each chunk of at most C
    tokens runs ``head`` + fp32 ``cross_entropy(reduction="sum")`` under non-reentrant
    ``torch.utils.checkpoint``, which keeps only the chunk's input (a view of the LN output:
    no new memory). The chunk's logits, fp32 copy and log-softmax are freed when the chunk
    ends; backward recomputes one chunk at a time, so at most about C·V·12 bytes of head and
    loss tensors exist at once (C·V·(a + 8) in forward), plus the LN output's gradient
    (N·d·a) and the head weight's gradient (V·d·a), which exist either way. The chunk sums
    are added and divided by the number of targets that are not ``IGNORE_INDEX``, which is
    what the mean of ``F.cross_entropy`` divides by: the same loss and gradients up to float
    rounding (the order of the additions differs). The price is one more head matmul per
    step (2·N·d·V FLOPs in the recomputation). Arithmetic for the reference GPT (N = 8 x 2048,
    V = 32000, a = 2; not a measurement): 14·N·V = 7.3e9 bytes without chunks, 12·C·V =
    1.6e9 bytes with C = 4096.
    """

    def __init__(self, cfg, block: Callable[..., nn.Module], checkpoint: bool = False, *,
                 loss_chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.loss_chunk_tokens = loss_chunk_tokens
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    @property
    def loss_chunk_tokens(self) -> int | None:
        """Tokens per loss chunk (Note [chunked loss]); None: the loss on the full logits."""
        return self._loss_chunk_tokens

    @loss_chunk_tokens.setter
    def loss_chunk_tokens(self, value: int | None) -> None:
        if value is not None:
            check_int(f"{type(self).__name__}: ", "loss_chunk_tokens", value, unit="tokens",
                      fix="give the tokens per loss chunk (e.g. 4096), or None for the loss "
                          "on the full logits")
        self._loss_chunk_tokens = value

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Return ``(logits, loss)`` for token ids ``idx`` ``(batch, seq)``; ``loss`` (mean
        cross-entropy over the targets that are not ``IGNORE_INDEX``, nats/token, fp32) is None
        without ``targets``. With ``loss_chunk_tokens`` set and ``targets`` given, the logits
        are never materialized and ``(None, loss)`` is returned (Note [chunked loss]).
        The same as :meth:`embed`, :meth:`run_block` for every block, then :meth:`output`.

        Raises:
            ValueError: a sequence longer than ``cfg.seq_len``, or (chunked loss) ``targets``
                not holding one target per token of ``idx``.
        """
        x = self.embed(idx)
        for i in range(len(self.blocks)):
            x = self.run_block(i, x)
        return self.output(x, targets)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings of ``idx`` ``(batch, seq)``: the first block's input.

        Raises:
            ValueError: a sequence longer than ``cfg.seq_len``.
        """
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds {type(self.cfg).__name__}.seq_len="
                             f"{self.cfg.seq_len}; shorten the batch or raise seq_len")
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))

    def run_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Block ``i`` on ``x`` ``(batch, seq, d_model)``, checkpointed when ``checkpoint`` is
        set and autograd records.

        Raises:
            IndexError: no block ``i``.
        """
        block = self.blocks[i]
        if self.checkpoint and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Final LN, head and loss on the last block's output ``x``: ``(logits, loss)`` as
        :meth:`forward` returns them.

        Raises:
            ValueError: (chunked loss) ``targets`` not holding one target per token of ``x``.
        """
        if targets is not None and self.loss_chunk_tokens is not None:
            if targets.numel() != x.shape[0] * x.shape[1]:
                raise ValueError(f"{type(self).__name__}: targets has {targets.numel()} "
                                 f"elements for {x.shape[0] * x.shape[1]} tokens (idx shape "
                                 f"{tuple(x.shape[:2])}); give one target id per token")
            return None, self._chunked_loss(self.ln_f(x), targets)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def _head_loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed fp32 cross-entropy (nats) of the tokens ``h`` ``(tokens, d_model)``."""
        return F.cross_entropy(self.head(h).float(), targets, reduction="sum",
                               ignore_index=IGNORE_INDEX)

    def _chunked_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the normalised final states ``h`` ``(batch, seq, d_model)``,
        one checkpointed chunk of at most ``loss_chunk_tokens`` tokens at a time (Note [chunked
        loss])."""
        h = h.reshape(-1, h.shape[-1])
        targets = targets.reshape(-1)
        total = None
        for h_part, t_part in zip(h.split(self.loss_chunk_tokens),
                                  targets.split(self.loss_chunk_tokens)):
            if torch.is_grad_enabled():
                part = checkpoint(self._head_loss_sum, h_part, t_part, use_reentrant=False)
            else:
                part = self._head_loss_sum(h_part, t_part)
            total = part if total is None else total + part
        return total / (targets != IGNORE_INDEX).sum()


class GPT(DecoderLM):
    """The reference GPT: a :class:`DecoderLM` of GPT :class:`Block` s.

    Args:
        cfg: the shape.
        checkpoint: run each block under ``torch.utils.checkpoint`` (non-reentrant).
        loss_chunk_tokens: None, or the tokens per checkpointed loss chunk; then ``forward``
            with targets returns ``(None, loss)`` (Note [chunked loss]).

    Raises:
        TypeError, ValueError: ``loss_chunk_tokens`` not None or an int >= 1.
    """

    def __init__(self, cfg: GPTConfig, checkpoint: bool = False, *,
                 loss_chunk_tokens: int | None = None) -> None:
        super().__init__(cfg, Block, checkpoint, loss_chunk_tokens=loss_chunk_tokens)
