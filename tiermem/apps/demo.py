"""``tiermem demo``: train a small GPT with offloading, then without, and compare.

The offloaded run keeps its optimizer state partly off the device (:class:`HybridAdam`,
``offload_fraction`` of the parameter bytes in pinned RAM or on NVMe) and moves saved activations
of all but the last block to the store's ``"cpu"`` (or ``"nvme"``) tier. The baseline trains the
same model from the same initial weights on the same batches with plain ``torch.optim.AdamW``
(``fused=True``) and no activation offload. On the CPU in float32 the two runs do the same
arithmetic (tiermem's CPU Adam kernel follows torch's fused one operation for operation; moving
activations copies bytes), so their losses must agree to within ``train.tolerance`` (1e-6; in
practice they are identical); the command exits with 1 when they do not. On CUDA the offloaded
part steps on the CPU and the baseline on the GPU, whose kernels round differently, so the
default tolerance there is 1e-4.

This module is also the training loop of ``examples/train_gpt.py``: :class:`RunConfig` holds the
YAML sections, :class:`MarkovText` generates the data, :func:`train` runs one training run and
:func:`compare` judges two.

Memory figures. On CUDA the peak is measured (``torch.cuda.max_memory_allocated``). On a machine
without CUDA the "gpu" tier is host memory, so the process RSS cannot show a saving; the demo
then reports the *device-tier footprint* at the end of the forward pass, summed from measured
parts: parameters + gradients + optimizer state kept on the device + saved activations kept on
the device (the baseline's saved activations are counted with a ``saved_tensors_hooks`` pair,
unique storages only; the offloaded run's are that figure minus the bytes the offloader put
into the store per forward). Allocator overhead and temporaries are not in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tiermem._files import make_private_dir
from tiermem.apps import run_cost
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.names import format_bytes, resolve_device, short_repr
from tiermem.apps.run_cost import SIZE_FIELDS
from tiermem.telemetry.saved import SavedBytesCounter
from tiermem.config import (ActivationConfig, OptimizerConfig, StoreConfig, TrainConfig,
                            apply_overrides, from_tree, load_config)
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam
from tiermem.store import TierStore

SECTIONS: dict[str, type] = {
    "model": GPTConfig,
    "train": TrainConfig,
    "store": StoreConfig,
    "optimizer": OptimizerConfig,
    "activations": ActivationConfig,
}
"""YAML section name -> the dataclass it is parsed into."""


# ---------------------------------------------------------------------------------- config


@dataclass(kw_only=True)
class RunConfig:
    """All sections of one training run (see docs/configuration.md)."""

    model: GPTConfig = field(default_factory=GPTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    activations: ActivationConfig = field(default_factory=ActivationConfig)
    origin: str = "the run config"
    """Where the config came from, for messages (``"config file 'run.yaml'"``)."""
    left_out: tuple[str, ...] = ()
    """The ``model`` fields that size the model (:data:`tiermem.apps.run_cost.SIZE_FIELDS`) which
    the
    config left out, so they have GPTConfig's (H200-sized) defaults."""

    def __post_init__(self) -> None:
        n = self.model.n_layers
        if self.activations.num_layers is not None and self.activations.num_layers >= n:
            raise ValueError(f"activations.num_layers={self.activations.num_layers} must be < "
                             f"model.n_layers={n} (the last block's activations are needed "
                             f"first in backward)")
        if self.train.breadth_first_blocks != 0:
            raise ValueError(f"train.breadth_first_blocks={self.train.breadth_first_blocks} is "
                             f"examples/train_large.py's; tiermem demo runs its micro-batches "
                             f"depth-first: set it to 0 or remove it")
        if self.train.seq_len is not None and self.train.seq_len > self.model.seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.seq_len="
                             f"{self.model.seq_len}; raise model.seq_len or lower train.seq_len")
        uses_nvme = (self.optimizer.state_tier == "nvme" and self.optimizer.offload_fraction > 0) \
            or (self.activations.enabled and self.activations.tier == "nvme")
        if uses_nvme and self.store.nvme_bytes == 0:
            raise ValueError("optimizer.state_tier or activations.tier is 'nvme' but "
                             "store.nvme_bytes=0; set store.nvme_bytes (e.g. 8GiB) and "
                             "store.nvme_dir=/path/on/ssd")

    @property
    def seq_len(self) -> int:
        """Tokens per training sequence."""
        return self.train.seq_len or self.model.seq_len

    @classmethod
    def from_tree(cls, tree: dict, origin: str = "the run config") -> "RunConfig":
        """Build a RunConfig from a nested dict of sections (a parsed YAML file); ``origin``
        names it in messages.

        Raises:
            ValueError: an unknown section or field (the message lists the valid ones), or a
                bad value (naming the field).
            TypeError: a value of the wrong type, or a section that is not a mapping.
        """
        sections = from_tree(tree, SECTIONS, where=origin)
        given = tree.get("model") or {}
        left_out = tuple(k for k in SIZE_FIELDS if k not in given)
        return cls(**sections, origin=origin, left_out=left_out)

    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: list[str] = ()) -> "RunConfig":
        """Read a YAML file (or start from the defaults), apply dotted overrides, build.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError, TypeError: see :meth:`from_tree` and :func:`tiermem.config.load_config`.
        """
        origin = ("the defaults" if path is None else
                  f"config file {short_repr(os.fspath(path))}")
        if overrides:
            origin += f" + {len(overrides)} override{'s' if len(overrides) > 1 else ''}"
        return cls.from_tree(load_config(path, list(overrides)), origin)

    def to_tree(self) -> dict:
        """The sections as a nested dict of plain values (for printing and YAML)."""
        out = {}
        for name in SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            out[name] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in section.items()}
        return out


# ---------------------------------------------------------------------------------- data


class MarkovText:
    """A deterministic synthetic token stream with learnable structure (nothing downloaded).

    Each token has ``branching`` successors, drawn once from the seed, taken with
    probabilities proportional to ``2^-k`` (k = 0 .. branching-1). A model that learns the
    transition table reaches a loss near the chain's entropy (:attr:`entropy`, nats/token),
    far below the ``ln(vocab)`` of an untrained one, so the loss visibly falls.

    Args:
        vocab: vocabulary size (tokens), >= 2.
        branching: successors per token, in [1, vocab].
        seed: seed of the transition table and of every batch.

    Raises:
        ValueError: ``vocab`` < 2 or ``branching`` outside [1, vocab].
    """

    def __init__(self, vocab: int, branching: int = 4, seed: int = 0) -> None:
        if vocab < 2:
            raise ValueError(f"MarkovText: vocab={vocab} must be >= 2")
        if not 1 <= branching <= vocab:
            raise ValueError(f"MarkovText: branching={branching} must be in [1, vocab={vocab}]")
        self.vocab, self.branching, self.seed = vocab, branching, seed
        gen = torch.Generator().manual_seed(seed)
        # [vocab, branching]; a repeated successor just merges two branches' probabilities
        self.successors = torch.randint(vocab, (vocab, branching), generator=gen)
        probs = torch.tensor([2.0 ** -k for k in range(branching)], dtype=torch.float64)
        self.probs = probs / probs.sum()
        self.cum_probs = torch.cumsum(self.probs, 0).float()
        self.cum_probs[-1] = 1.0

    @property
    def entropy(self) -> float:
        """Entropy of one transition in nats: the loss of a perfect model."""
        return float(-(self.probs * self.probs.log()).sum())

    def batch(self, index: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(idx, targets)``, both int64 ``[batch, seq_len]`` on the CPU, contiguous.

        The same ``index`` gives the same batch on every call and machine (targets are
        ``idx`` shifted by one token).
        """
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab, (batch,), generator=gen)
        draws = torch.rand(batch, seq_len, generator=gen)
        choice = torch.searchsorted(self.cum_probs, draws.contiguous())
        choice.clamp_(max=self.branching - 1)
        for t in range(seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---------------------------------------------------------------------------------- helpers


def rss_bytes() -> int:
    """Resident set size of this process in bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups in execution order: matrices decay, biases/norms/embeddings' 1-D do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------------- training


@dataclass
class RunResult:
    """What one training run measured. Bytes are bytes; times are seconds."""

    name: str
    losses: list[float]
    """Mean micro-batch loss per optimizer step."""
    wall_s: float
    tokens_per_s: float
    device: str
    params_bytes: int
    state_bytes: dict[str, int]
    """Optimizer-state bytes per place (``gpu`` = on the compute device)."""
    saved_activation_bytes: int | None
    """Saved activations per forward counted on the device (baseline; None where unmeasured)."""
    offloaded_activation_bytes: int
    """Activation bytes the offloader put into the store per forward (0 without offload)."""
    peak_device_bytes: int | None
    """``torch.cuda.max_memory_allocated`` over the run (None on CPU)."""
    peak_rss_bytes: int
    """Largest process RSS sampled after each forward."""
    store_stats: dict | None = None


def _make_optimizer(cfg: RunConfig, model: GPT, offload: bool, store: TierStore | None):
    o = cfg.optimizer
    groups = param_groups(model, o.weight_decay)
    hp = dict(lr=o.lr, betas=o.betas, eps=o.eps)
    if offload:
        kw = o.kwargs(store=store, grad_accumulation_steps=cfg.train.grad_accumulation_steps)
        for k in ("lr", "betas", "eps", "weight_decay"):
            del kw[k]  # per group above
        return HybridAdam(groups, **hp, **kw)
    if cfg.train.dtype == "float32":
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, **hp, **({"fused": True} if fused else {}))
    # bf16 params: the baseline needs fp32 masters; HybridAdam with nothing offloaded is
    # torch's fused AdamW kernel on fp32 masters kept on the device.
    return HybridAdam(groups, **hp, offload_fraction=0.0, overlap=False,
                      max_grad_norm=o.max_grad_norm,
                      grad_accumulation_steps=cfg.train.grad_accumulation_steps)


def _state_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    if isinstance(opt, HybridAdam):
        return opt.memory_bytes()
    gpu = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
              if torch.is_tensor(t))
    return {"gpu": gpu, "cpu": 0, "nvme": 0}


def _tier_line(store: TierStore | None) -> str:
    if store is None:
        return ""
    s = store.stats()
    return "  " + "  ".join(f"{t} {format_bytes(s[t]['used_bytes'])}" for t in ("gpu", "cpu", "nvme"))


def build_model(cfg: RunConfig, device: torch.device) -> GPT:
    """The GPT of ``cfg.model``, initialised from ``cfg.train.seed`` directly on ``device``
    (no host copy of a large model), then cast to ``cfg.train.dtype``. The same seed and
    device give the same weights, so both runs start from the same init."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = GPT(cfg.model, checkpoint=cfg.train.checkpoint)
    return model.to(dtype=getattr(torch, cfg.train.dtype))


def train(cfg: RunConfig, *, offload: bool, data: MarkovText,
          log: Callable[[str], None] = print, name: str | None = None) -> RunResult:
    """Train ``cfg.model`` for ``cfg.train.steps`` optimizer steps; return what was measured.

    Args:
        cfg: the run's config.
        offload: True: HybridAdam with ``cfg.optimizer`` and activation offload with
            ``cfg.activations`` through one TierStore built from ``cfg.store``; False: the
            baseline (torch AdamW fused, no activation offload; bf16: fp32 masters on the
            device).
        data: the batches (``data.batch(step * accumulation + micro, ...)``).
        log: where the per-step lines go (``tqdm.write`` when a bar is shown).
        name: label of the run in the output.

    Raises:
        ValueError: a config the library rejects (each names the field and the fix).
        RuntimeError: the optimizer's CPU step failed.
    """
    t = cfg.train
    device = resolve_device(t.device, "train.device")
    name = name or ("offload" if offload else "baseline")
    model = build_model(cfg, device)
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    store = None
    if offload:
        store = TierStore(dataclasses.replace(cfg.store, device=str(device)))
    opt = _make_optimizer(cfg, model, offload, store)
    offloader = None
    if offload and cfg.activations.enabled:
        offloader = offload_activations(model.blocks, store=store, **cfg.activations.kwargs())
    counter = None
    if not offload:
        counter = SavedBytesCounter({p.untyped_storage().data_ptr() for p in model.parameters()})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    accum, batch, seq = t.grad_accumulation_steps, t.micro_batch, cfg.seq_len
    tokens_per_step = accum * batch * seq
    losses: list[float] = []
    peak_rss = rss_bytes()
    saved_bytes = 0
    put_bytes = 0
    plan_logged = False
    bar = None
    if t.progress:
        from tqdm import tqdm
        bar = tqdm(total=t.steps, desc=name, unit="step", leave=False, dynamic_ncols=True,
                   file=sys.stderr)
        log = bar.write
    start = time.perf_counter()
    try:
        for step in range(t.steps):
            step_start = time.perf_counter()
            total = torch.zeros((), device=device, dtype=torch.float32)
            tiers = ""
            for micro in range(accum):
                idx, tgt = data.batch(step * accum + micro, batch, seq)
                idx, tgt = idx.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
                if offloader is not None:
                    before = offloader.counters["put_bytes"]
                    with offloader:
                        _, loss = model(idx, tgt)
                    put_bytes = max(put_bytes, offloader.counters["put_bytes"] - before)
                    if offloader.plan is not None and not plan_logged:
                        plan_logged = True
                        log(f"activations: layers='auto' chose blocks {offloader.plan['layers']} "
                            f"of {len(model.blocks)} (their copies hide behind compute; "
                            f"predicted stall {offloader.plan['predicted_stall_ms']:.1f} ms)")
                    if micro == accum - 1:
                        tiers = _tier_line(store)  # activations of this step are in the store now
                elif counter is not None:
                    counter.reset()
                    with counter.hooks():
                        _, loss = model(idx, tgt)
                    saved_bytes = max(saved_bytes, counter.forward_bytes)
                else:
                    _, loss = model(idx, tgt)
                peak_rss = max(peak_rss, rss_bytes())
                (loss / accum).backward()
                total += loss.detach().float() / accum
            if not isinstance(opt, HybridAdam) and cfg.optimizer.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total.item())  # .item() waits for the step's kernels
            dt = time.perf_counter() - step_start
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if t.log_every and (step % t.log_every == 0 or step == t.steps - 1):
                log(f"[{name}] step {step + 1:>4}/{t.steps}  loss {losses[-1]:.6f}  "
                    f"{tokens_per_step / dt:>9,.0f} tok/s{tiers}")
        wall = time.perf_counter() - start
        peak_dev = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return RunResult(
            name=name, losses=losses, wall_s=wall,
            tokens_per_s=tokens_per_step * t.steps / wall, device=str(device),
            params_bytes=params_bytes, state_bytes=_state_bytes(opt),
            saved_activation_bytes=saved_bytes if counter is not None else None,
            offloaded_activation_bytes=put_bytes, peak_device_bytes=peak_dev,
            peak_rss_bytes=peak_rss, store_stats=store.stats() if store is not None else None)
    finally:
        if bar is not None:
            bar.close()
        if isinstance(opt, HybridAdam):
            opt.close()
        if offloader is not None:
            try:
                offloader.close()
            except RuntimeError:  # an exception left a graph with live keys; the store goes
                pass
        if store is not None:
            store.close()
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- compare


@dataclass
class Comparison:
    """The offloaded run against the baseline."""

    max_loss_diff: float
    """Largest |loss difference| over all steps (absolute, nats)."""
    tolerance: float
    ok: bool
    lines: list[str]
    """The human-readable report."""


def device_footprint(run: RunResult, saved_activation_bytes: int | None) -> int | None:
    """Device-tier bytes at the end of forward: params + grads + device optimizer state +
    saved activations kept on the device (``saved_activation_bytes`` is the baseline's count;
    the offloaded run keeps that minus what it offloaded). None when unmeasured."""
    if saved_activation_bytes is None:
        return None
    kept = max(0, saved_activation_bytes - run.offloaded_activation_bytes)
    return 2 * run.params_bytes + run.state_bytes["gpu"] + kept


def compare(off: RunResult, base: RunResult, tolerance: float) -> Comparison:
    """Compare per-step losses and memory of two runs of the same steps.

    Raises:
        ValueError: the runs have different numbers of steps.
    """
    if len(off.losses) != len(base.losses):
        raise ValueError(f"runs differ in length: {len(off.losses)} vs {len(base.losses)} steps")
    diffs = [abs(a - b) for a, b in zip(off.losses, base.losses)]
    max_diff = max(diffs) if diffs else 0.0
    ok = math.isfinite(max_diff) and max_diff <= tolerance
    rows = [("", "offload", "baseline")]
    rows.append(("loss first -> last", f"{off.losses[0]:.6f} -> {off.losses[-1]:.6f}",
                 f"{base.losses[0]:.6f} -> {base.losses[-1]:.6f}"))
    rows.append(("tokens/s", f"{off.tokens_per_s:,.0f}", f"{base.tokens_per_s:,.0f}"))
    rows.append(("optimizer state on device", format_bytes(off.state_bytes["gpu"]),
                 format_bytes(base.state_bytes["gpu"])))
    rows.append(("optimizer state in pinned RAM / NVMe",
                 f"{format_bytes(off.state_bytes['cpu'])} / {format_bytes(off.state_bytes['nvme'])}",
                 "0 B / 0 B"))
    rows.append(("activations offloaded per forward", format_bytes(off.offloaded_activation_bytes),
                 "0 B"))
    saving_line = ""
    if off.peak_device_bytes is not None and base.peak_device_bytes is not None:
        rows.append(("peak GPU memory (measured)", format_bytes(off.peak_device_bytes),
                     format_bytes(base.peak_device_bytes)))
        a, b = off.peak_device_bytes, base.peak_device_bytes
        saving_line = (f"GPU memory saved: {format_bytes(b - a)} "
                       f"({100 * (b - a) / b:.1f}% of the baseline's peak)")
    else:
        fa = device_footprint(off, base.saved_activation_bytes)
        fb = device_footprint(base, base.saved_activation_bytes)
        rows.append(("device-tier footprint (estimate*)", format_bytes(fa), format_bytes(fb)))
        if fa is not None and fb:
            saving_line = (f"device memory saved: {format_bytes(fb - fa)} ({100 * (fb - fa) / fb:.1f}% "
                           f"of the baseline's device-tier footprint*)")
    rows.append(("process RSS after forward (max)", format_bytes(off.peak_rss_bytes),
                 format_bytes(base.peak_rss_bytes)))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, width))) for r in rows]
    if saving_line:
        lines.append(saving_line)
    if off.peak_device_bytes is None:
        lines.append("* no CUDA here: the 'gpu' tier is host memory, so RSS shows no saving; the "
                     "footprint is params + grads + optimizer state + saved activations left on "
                     "the device, at the end of forward (measured parts, no allocator overhead)")
    verdict = "OK" if ok else "FAILED"
    lines.append(f"max |loss difference| over {len(diffs)} steps: {max_diff:.3g} "
                 f"(tolerance {tolerance:g}): {verdict}")
    return Comparison(max_diff, tolerance, ok, lines)


def run(cfg: RunConfig, log: Callable[[str], None] = print
        ) -> tuple[RunResult, RunResult | None, Comparison | None]:
    """Train with offload, then (``cfg.train.baseline``) without; print and return both.

    Raises:
        ValueError, RuntimeError: see :func:`train`.
    """
    data = MarkovText(cfg.model.vocab, cfg.train.markov_branching, cfg.train.seed)
    n = cfg.model.num_params()
    t = cfg.train
    act = cfg.activations
    layers = "off" if not act.enabled else (
        f"{act.num_layers if act.num_layers is not None else 'auto'} of "
        f"{cfg.model.n_layers} blocks -> {act.tier}")
    log(f"model: GPT {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
        f"{n / 1e6:.2f}M params, {t.dtype}, device {resolve_device(t.device, 'train.device')}")
    log(f"data: Markov chain over {cfg.model.vocab} tokens, {t.markov_branching} successors each "
        f"(entropy {data.entropy:.3f} nats; untrained ~{math.log(cfg.model.vocab):.3f}); "
        f"{t.steps} steps x {t.grad_accumulation_steps} x {t.micro_batch} x {cfg.seq_len} tokens")
    log(f"offload: optimizer state {cfg.optimizer.offload_fraction:.0%} -> "
        f"{cfg.optimizer.state_tier}, activations {layers}")
    device_type = resolve_device(t.device, "train.device").type
    cost = run_cost.estimate(cfg)  # Note [run cost before building]
    log(run_cost.describe(cfg, cost, device_type,
                          run_cost.cpu_flop_per_s() if device_type == "cpu" else None))
    run_cost.check(cfg, cost, device_type, run_cost.host_available_bytes())
    off = train(cfg, offload=True, data=data, log=log, name="offload")
    if not t.baseline:
        return off, None, None
    base = train(cfg, offload=False, data=data, log=log, name="baseline")
    cmp = compare(off, base, t.tolerance)
    for line in cmp.lines:
        log(line)
    return off, base, cmp


# ---------------------------------------------------------------------------------- CLI


def demo_config(args: argparse.Namespace) -> RunConfig:
    """The demo's run config: a small GPT sized for a 2-core CPU, changed by the flags."""
    tolerance = args.tolerance
    if tolerance is None:
        tolerance = 1e-6 if resolve_device(args.device, "--device").type == "cpu" else 1e-4
    tree: dict[str, Any] = {
        "model": {"n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
                  "seq_len": args.seq, "vocab": args.vocab},
        "train": {"steps": args.steps, "micro_batch": args.batch, "device": args.device,
                  "tolerance": tolerance, "progress": not args.no_progress,
                  "log_every": args.log_every, "seed": args.seed},
        "optimizer": {"offload_fraction": args.offload_fraction, "state_tier": "cpu",
                      "chunk_numel": 1 << 16},
        "activations": {"tier": "cpu"},
        "store": {"gpu_bytes": "2GiB", "cpu_bytes": "2GiB", "pool_slab_bytes": "64MiB"},
    }
    if args.nvme_dir:
        tree["optimizer"]["state_tier"] = "nvme"
        tree["store"].update(nvme_bytes="2GiB", nvme_dir=args.nvme_dir)
        if args.nvme_activations:
            tree["activations"]["tier"] = "nvme"
    elif args.nvme_activations:
        raise ValueError("--nvme-activations needs --nvme-dir DIR (a spill directory on an SSD)")
    return RunConfig.from_tree(apply_overrides(tree, args.overrides))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiermem demo",
        description="Train a small GPT with offloading (HybridAdam state in pinned RAM or on "
                    "NVMe, activations to host memory), then the same without offload, and "
                    "compare losses and memory. Exit code 0: losses agree within the "
                    "tolerance; 1: they do not; 2: bad usage.")
    p.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE",
                   help="dotted overrides of the run config (see docs/configuration.md), "
                        "e.g. optimizer.offload_fraction=1.0 activations.num_layers=2")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--offload-fraction", type=float, default=0.5,
                   help="fraction of optimizer state off the device, 0..1 (default 0.5)")
    p.add_argument("--nvme-dir", default=None, metavar="DIR",
                   help="keep the offloaded optimizer state in spill files under DIR (NVMe tier; "
                        "created with mode 0700 if missing)")
    p.add_argument("--nvme-activations", action="store_true",
                   help="with --nvme-dir: offload activations to the NVMe tier too")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest accepted |loss difference| vs the baseline (default 1e-6 on "
                        "the CPU, where the arithmetic is the same; 1e-4 on CUDA, where the "
                        "offloaded part steps on the CPU and the baseline on the GPU, whose "
                        "kernels round differently)")
    p.add_argument("--seed", type=int, default=0, help="seed of init and data (default 0)")
    p.add_argument("--log-every", type=int, default=5,
                   help="per-step line every N steps, 0: none (default 5)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``tiermem demo``; return 0 (losses agree), 1 (they do not) or 2 (bad usage).

    Bad flags or overrides print one line on stderr and return 2 (argparse's own usage
    errors exit with 2 through ``SystemExit``).
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        cfg = demo_config(args)
        if cfg.store.nvme_bytes and cfg.store.nvme_dir is not None:  # as train_gpt.py does
            make_private_dir(cfg.store.nvme_dir, "--nvme-dir" if args.nvme_dir else
                             "store.nvme_dir", log=print)
    except (ValueError, TypeError) as exc:
        print(f"tiermem demo: error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        _, _, cmp = run(cfg)
    except ValueError as exc:  # a budget that cannot hold the run (tiermem.apps.run_cost.check)
        print(f"tiermem demo: error: {exc}", file=sys.stderr)
        return 2
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0 if cmp is None or cmp.ok else 1


if __name__ == "__main__":
    sys.exit(main())
