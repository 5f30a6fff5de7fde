"""Model shapes the planner sizes: :class:`ModelShape` (a GPT's layers, width, heads, vocabulary,
sequence and the micro-batch of its preset), the ``--model-size`` :data:`PRESETS`, and the byte
units :data:`GB` and :data:`GiB` every module of :mod:`tiermem.apps.plan` counts in."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1000 ** 3
GiB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """A GPT shape (vocab 32000, MLP ratio 4) and the micro-batch its preset uses."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab: int = 32000
    seq_len: int = 2048
    micro_batch: int = 1
    mlp_ratio: int = 4

    def num_params(self) -> int:
        """Parameters of ``tiermem.models.gpt.GPT`` with this shape (untied head)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return self.vocab * d * 2 + self.seq_len * d + self.n_layers * block + 2 * d


PRESETS: dict[str, ModelShape] = {
    "1b": ModelShape(24, 2048, 16, micro_batch=8),   # the reference GPT, 1.34B (docs/benchmarks.md)
    "7b": ModelShape(32, 4096, 32),                  # 6.71B
    "13b": ModelShape(40, 5120, 40),                 # 12.92B
    "30b": ModelShape(60, 6656, 52),                 # 32.34B
    "70b": ModelShape(80, 8192, 64),                 # 64.96B
}
"""``--model-size`` presets: GPT shapes of common sizes (sequence 2048)."""
