"""What a run of ``tiermem demo`` / examples/train_gpt.py costs, said before anything is built.

Note [run cost before building]: a YAML that leaves fields out gets the dataclasses' defaults,
and :class:`tiermem.models.gpt.GPTConfig`'s are a 1.34B-parameter GPT sized for an H200. On a
CPU an empty ``--config`` then spent 98 s building that model before HybridAdam refused the
store's 4 GiB cpu tier, and ``model: {n_layers: 2}`` (236M params, 16,384 tokens per step) sat
silent at step 0 for minutes. So before building, the run prints one line with the model size,
the tokens and FLOPs per step and (on a CPU) the time they take at the speed this CPU just
measured for a matmul, naming the model fields the config left out; and it refuses, naming the
config and the field, a budget that cannot hold even a lower bound of what the run needs: the
offloaded optimizer state against ``store.cpu_bytes`` / ``store.nvme_bytes``, and on a CPU
weights + gradients + Adam moments against the host's available memory. A lower bound never
refuses a run that would fit; the library's own checks (HybridAdam's ``check_room``) still
judge the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.names import format_bytes

RunConfig = Any
"""A :class:`tiermem.apps.demo.RunConfig` (not imported: demo imports this module)."""

SIZE_FIELDS = ("n_layers", "d_model", "n_heads", "seq_len", "vocab")
"""The ``model`` fields that size the model; those a config leaves out are named in the cost
line and in a refusal (GPTConfig's defaults are an H200's 1.34B GPT)."""


@dataclass(frozen=True)
class RunCost:
    """Lower bounds of what one training run needs. Bytes are bytes."""

    params: int
    """Parameters of the model."""
    tokens_per_step: int
    """Tokens per optimizer step (accumulation x micro-batch x sequence)."""
    flop_per_step: float
    """6 x params x tokens plus the attention scores (12 x layers x d_model x seq x tokens)."""
    offloaded_state_bytes: int
    """Optimizer state HybridAdam puts in the store: ``offload_fraction`` of the params x (fp32
    master + two moments); rings and staging come on top."""
    host_bytes: int
    """Weights + gradients + Adam moments of one run (the runs take turns); activations and
    allocator overhead come on top. On a CPU all of it is host memory."""


def estimate(cfg: RunConfig) -> RunCost:
    """The :class:`RunCost` of ``cfg`` (arithmetic only: nothing is built).

    Raises:
        nothing: plain arithmetic on validated configs.
    """
    m, t = cfg.model, cfg.train
    n = m.num_params()
    tokens = t.grad_accumulation_steps * t.micro_batch * cfg.seq_len
    flop = 6.0 * n * tokens + 12.0 * m.n_layers * m.d_model * cfg.seq_len * tokens
    moment_b = 4 if cfg.optimizer.moments_dtype == "float32" else 2
    offloaded = int(cfg.optimizer.offload_fraction * n) * (4 + 2 * moment_b)
    weight_b = 4 if t.dtype == "float32" else 2
    return RunCost(params=n, tokens_per_step=tokens, flop_per_step=flop,
                   offloaded_state_bytes=offloaded, host_bytes=n * (2 * weight_b + 2 * moment_b))


def host_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_flop_per_s(n: int = 1024, calls: int = 2) -> float:
    """FLOP/s of an ``n`` x ``n`` fp32 matmul on this CPU with torch's threads: the fastest of
    ``calls`` timed calls after a warm-up (the fastest, so that a moment of other processes'
    load counts least). A model's matmuls are of this size or larger, so it is about the speed
    its forward and backward can reach here now."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b  # warm-up: the first call sets up threads
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / max(best, 1e-9)


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def describe(cfg: RunConfig, cost: RunCost, device_type: str,
             flop_per_s: float | None) -> str:
    """The cost line: params, tokens and FLOPs per step, and on a CPU (``flop_per_s`` given)
    the time per step and for the run; names the ``model`` fields ``cfg`` left out."""
    runs = 2 if cfg.train.baseline else 1
    line = (f"cost: {cost.params / 1e6:,.1f}M params ({format_bytes(cost.host_bytes)} of "
            f"weights, gradients and Adam moments per run), {cost.tokens_per_step:,} tokens per "
            f"step = {cost.flop_per_step / 1e12:.3g} TFLOP per step")
    if device_type == "cpu" and flop_per_s:
        step_s = cost.flop_per_step / flop_per_s
        total_s = step_s * cfg.train.steps * runs
        line += (f"; at the {flop_per_s / 1e9:.0f} GFLOP/s of a 1024 x 1024 matmul on this CPU "
                 f"now: ~{_duration(step_s)} per step, ~{_duration(total_s)} for "
                 f"{cfg.train.steps} steps x {runs} run{'s' if runs > 1 else ''}")
    if cfg.left_out:
        line += (f" (left out of {cfg.origin}, so GPTConfig's defaults: "
                 f"{', '.join(f'model.{k}={getattr(cfg.model, k)}' for k in cfg.left_out)}; "
                 f"examples/configs/cpu.yaml is sized for a CPU)")
    return line


def check(cfg: RunConfig, cost: RunCost, device_type: str,
          host_available: int | None) -> None:
    """Refuse a budget that cannot hold a lower bound of the run (Note [run cost before
    building]).

    Args:
        cfg: the run config (``cfg.origin`` names it in the message).
        cost: its :func:`estimate`.
        device_type: ``"cpu"`` or ``"cuda"`` (the host-memory bound applies to the CPU).
        host_available: available host memory in bytes (None: not checked).

    Raises:
        ValueError: one line naming the config, the field, the bytes needed and the fix.
    """
    o, s = cfg.optimizer, cfg.store
    size = f"{cost.params / 1e6:,.1f}M-param model"
    if cfg.left_out:
        size += (f" ({', '.join('model.' + k for k in cfg.left_out)} left out: GPTConfig's "
                 f"defaults)")
    state = format_bytes(cost.offloaded_state_bytes)
    shrink = "or a smaller model (examples/configs/cpu.yaml fits a CPU)"
    if o.offload_fraction > 0:
        room = {"cpu": ("store.cpu_bytes", s.cpu_bytes),
                "nvme": ("store.nvme_bytes", s.nvme_bytes),
                "split": ("store.cpu_bytes + store.nvme_bytes", s.cpu_bytes + s.nvme_bytes)}
        field, budget = room[o.state_tier]
        if cost.offloaded_state_bytes > budget:
            raise ValueError(
                f"{cfg.origin}: optimizer.offload_fraction={o.offload_fraction:g} of a {size} "
                f"puts at least {state} of optimizer state in the store, but {field}="
                f"{format_bytes(budget)}; fix: raise {field}, lower optimizer.offload_fraction, "
                f"{shrink}")
    if device_type == "cpu" and host_available is not None and cost.host_bytes > host_available:
        raise ValueError(
            f"{cfg.origin}: a {size} needs at least {format_bytes(cost.host_bytes)} of host "
            f"memory for weights, gradients and Adam moments (train.dtype={cfg.train.dtype}), "
            f"but {format_bytes(host_available)} is available; fix: {shrink.removeprefix('or ')}")
