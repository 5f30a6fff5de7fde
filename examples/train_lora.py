"""LoRA fine-tuning of a transformers Llama with activation offload and HybridAdam (extra [lora]).

The recipe (docs/lora.md says what is offloaded where)::

    model = lora_llama(SHAPES["7b"], device="cuda", dtype=torch.bfloat16)  # peft LoRA, base frozen
    opt = HybridAdam(adapter_parameters(model), lr=2e-4)     # only the adapters get state
    offloader = offload_activations(decoder_layers(model), num_layers=len(layers) - 1)
    for ids in batches:
        with offloader:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

The Llama is built from a config (no weights are downloaded; ``--preset tiny``: fp32 on the CPU,
``--preset 7b``: Llama-2-7B's shape, bf16 base on CUDA), peft puts LoRA adapters on q/k/v/o and
gate/up/down of every layer and freezes everything else. Activations saved inside the decoder
layers go to the store's pinned-RAM tier (all layers but the last; with ``--checkpoint`` every
layer checkpoints and the checkpointed inputs of all layers go). The adapters' own saved
tensors are inside those layers, so the same block hooks take them. ``--offload adapters``
shows tensor-level offload instead, the way Megatron-Core marks the tensors of its LoRA
linear_in/linear_out path: :func:`~tiermem.offload.offload_in_modules` enters one region around
every ``lora_A`` / ``lora_B`` call by forward hooks, so only what the adapters save goes to
pinned RAM; ``--offload layers+adapters`` adds that region to the block offloader (it then
also takes the last layer's adapter tensors, which the block offloader keeps). HybridAdam
keeps the adapters' fp32 masters and moments in pinned RAM and steps them on the CPU. The
frozen base weights are never given optimizer state, and without ``--stream-weights`` they
are neither copied nor offloaded.

It prints each step's loss and time and, on CUDA, the peak GPU memory; ``--compare`` also
trains the same model without offload (torch AdamW on the adapters, nothing offloaded) and
exits 1 if a loss differs by more than ``--tolerance``.

Weight streaming of the frozen base (issue 29; ``--stream-weights``, the flag names of
``tiermem plan`` / examples/train_large.py): after the model is built its decoder layers'
frozen weights go to a store of their own (:func:`tiermem.models.lora_stream.stream_lora_base`:
``--stream-tier`` cpu = pinned RAM, or nvme with ``--nvme-dir``) and reach the GPU one layer
at a time, ``--prefetch-blocks`` ahead (``--stream-schedule depth-first``: Note [LoRA stream
schedule]); the adapters stay resident. ``--gpu-bytes SIZE`` then caps the process at SIZE
(``torch.cuda.set_per_process_memory_fraction``) to stand for a smaller card. The base is
built on ``--device`` (on CUDA: initialised on the GPU, fast, before the cap; ``32b``'s 65 GB
fit an H200 uncapped) and moved to the store by the stream.

    pip install -e ".[lora]"
    python examples/train_lora.py --compare                 # CPU: tiny Llama, fp32, exact
    python examples/train_lora.py --compare --checkpoint
    python examples/train_lora.py --compare --offload adapters
    python examples/train_lora.py --compare --stream-weights --checkpoint
    python examples/train_lora.py --compare --stream-weights --stream-tier nvme \\
        --nvme-dir /tmp/spill --staging-blocks 2  # the base on NVMe only, 2 layers in RAM
    python examples/train_lora.py --preset 70b --device cuda --seq 4096 --batch 1 --steps 3 \\
        --checkpoint --stream-weights --stream-tier nvme --nvme-dir /nvme/spill \\
        --layerwise-base --gpu-bytes 24GiB  # 127.5 GiB base built layer by layer into NVMe
    python examples/train_lora.py --preset 7b --device cuda --seq 4096 --steps 10
    python examples/train_lora.py --preset 32b --device cuda --seq 4096 --batch 1 --steps 4 \\
        --checkpoint --stream-weights --gpu-bytes 24GiB  # base in pinned RAM, GPU at 24 GiB
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field

import torch

from tiermem.models.lora_llama import (SHAPES, adapter_parameters, decoder_layers, lora_batches,
                                       lora_llama, lora_modules)
from tiermem.models.lora_layerwise import layerwise_lora_llama
from tiermem.gpu_cap import cap_gpu, uncap_gpu
from tiermem.models.lora_stream import check_stream_options, stream_lora_base, stream_summary
from tiermem.options import STREAM_SCHEDULES, STREAM_TIERS
from tiermem.names import check_device, parse_bytes, resolve_device
from tiermem.offload import ActivationOffloader, offload_activations, offload_in_modules
from tiermem.optim import HybridAdam

HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
OFFLOAD_MODES = ("layers", "adapters", "layers+adapters")
"""``--offload``: the decoder layers' blocks, the adapters' tensors (a region), or both."""


@dataclass
class Run:
    """One training run: per-step losses, step times (ms; empty unless timed), peak device
    memory (bytes, CUDA only), what the activation offloader reports, the final adapter
    weights (CPU copies) and, with ``--stream-weights``, the stream's stats()."""

    losses: list[float]
    step_ms: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    offload_stats: dict | None = None
    adapters: list[torch.Tensor] = field(default_factory=list)
    stream_stats: dict | None = None


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The peft LoRA Llama of ``args`` on ``device`` (bf16 base on CUDA, fp32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return lora_llama(SHAPES[args.preset], device=device, dtype=dtype, rank=args.rank,
                      alpha=2 * args.rank, max_seq=args.seq, checkpoint=args.checkpoint)


def build_layerwise(args: argparse.Namespace, device: torch.device, materialize: bool):
    """``--layerwise-base``: the LoRA Llama with its base's layers as stand-ins and the
    function that makes one layer (the stream writes each to NVMe as it is made), or with
    every layer made now (``materialize``: the run without streaming, the same weights);
    Note [layer-wise LoRA Llama]."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return layerwise_lora_llama(SHAPES[args.preset], device=device, dtype=dtype,
                                rank=args.rank, alpha=2 * args.rank, max_seq=args.seq,
                                checkpoint=args.checkpoint, materialize=materialize)


def make_optimizer(model: torch.nn.Module, hybrid: bool,
                   offload_fraction: float = 1.0) -> torch.optim.Optimizer:
    """HybridAdam (``offload_fraction`` of the state in pinned RAM) or torch's fused AdamW,
    over the adapter parameters only."""
    params = adapter_parameters(model)
    if hybrid:
        return HybridAdam(params, **HP, offload_fraction=offload_fraction)
    return torch.optim.AdamW(params, **HP, fused=True)


def make_offloader(model: torch.nn.Module, checkpoint: bool, mode: str = "layers", **kw):
    """The activation offload of ``--offload`` (:data:`OFFLOAD_MODES`), entered around each
    forward: ``"layers"`` offloads the decoder layers' saved activations, all layers but the
    last (their backward comes first), or with checkpointing every layer's checkpointed inputs;
    ``kw`` goes to :func:`~tiermem.offload.offload_activations` (e.g. ``store=``).
    ``"adapters"`` / ``"layers+adapters"``: an :class:`AdapterOffload` without / with them.

    Raises:
        ValueError: an unknown ``mode``, or ``"adapters"`` with ``checkpoint`` (a checkpointed
            layer saves only its input: the region would offload nothing).
    """
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"--offload={mode!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if mode == "adapters" and checkpoint:
        raise ValueError("--offload=adapters with --checkpoint offloads nothing (a checkpointed "
                         "layer saves only its input); use --offload layers or layers+adapters")
    blocks = None
    if mode != "adapters":
        layers = decoder_layers(model)
        chosen = range(len(layers)) if checkpoint else range(len(layers) - 1)
        blocks = offload_activations(layers, layers=chosen, **kw)
        if mode == "layers":
            return blocks
    return AdapterOffload(model, blocks)


class AdapterOffload:
    """Tensor-level offload of the LoRA adapters: :func:`~tiermem.offload.offload_in_modules`
    over every ``lora_A`` / ``lora_B``, so every tensor autograd saves inside an adapter
    (``lora_A``'s input, which peft casts to the adapter dtype, and ``lora_A``'s output, which
    ``lora_B`` saves) goes to pinned RAM and comes back prefetched in backward. Alone it
    offloads nothing else; inside ``blocks`` (entered around the forward, like an offloader) the
    region joins that context and its store.

    Args:
        model: the peft LoRA model.
        blocks: the block offloader the region joins, or None.

    Raises:
        ValueError: the model has no ``lora_A`` / ``lora_B`` module.
    """

    def __init__(self, model: torch.nn.Module, blocks: ActivationOffloader | None) -> None:
        self.blocks = blocks
        self.regions = offload_in_modules(
            lora_modules(model), store=blocks.store if blocks is not None else None)

    def __enter__(self) -> "AdapterOffload":
        if self.blocks is not None:
            self.blocks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.blocks is not None:
            self.blocks.__exit__(*exc)

    def stats(self) -> dict:
        """The offload counters (the block offloader's, which the region's traffic joins)."""
        return (self.blocks if self.blocks is not None else self.regions).stats()

    def close(self) -> None:
        """Remove the hooks and close the region and the block offloader."""
        self.regions.close()
        if self.blocks is not None:
            self.blocks.close()


def train(model: torch.nn.Module, opt: torch.optim.Optimizer,
          offloader: "ActivationOffloader | AdapterOffload | None", batches: list[torch.Tensor],
          timed: bool = False, log=None) -> Run:
    """Train one step per batch; return the losses (read after the last step unless
    ``timed``: then every step is synchronised, timed and passed to ``log``)."""
    device = batches[0].device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_ms = [], []
    for step, ids in enumerate(batches, 1):
        t0 = time.perf_counter()
        with offloader if offloader is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if timed:
            if cuda:
                torch.cuda.synchronize(device)  # timing only: the step must have finished
            step_ms.append(1e3 * (time.perf_counter() - t0))
            if log is not None:
                peak = (f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f}"
                        f" GiB" if cuda else "")
                log(f"step {step:>3}  loss {losses[-1].item():.6f}  {step_ms[-1]:.1f} ms{peak}")
    if isinstance(opt, HybridAdam):
        opt.synchronize()
    return Run([float(x) for x in torch.stack(losses).double().cpu()], step_ms,
               torch.cuda.max_memory_allocated(device) if cuda else None,
               offloader.stats() if offloader is not None else None,
               [p.detach().to("cpu", copy=True) for p in adapter_parameters(model)])


def run(args: argparse.Namespace, device: torch.device, offload: bool, log=print,
        stream: bool | None = None) -> Run:
    """Build, train ``args.steps`` steps (offload + HybridAdam, or neither) and clean up.

    ``stream``: stream the frozen base (``--stream-weights``, its tier and prefetch from
    ``args``) before the optimizer and the offloader are built, then cap the GPU at
    ``args.gpu_bytes`` if set; None: ``args.stream_weights`` on the offload run, never on the
    baseline. The stream and its store are closed at the end (the GPU uncapped first: closing
    puts the base back on the device it was built on).
    """
    if stream is None:
        stream = offload and getattr(args, "stream_weights", False)
    load = None
    if getattr(args, "layerwise_base", False):  # Note [layer-wise LoRA Llama]
        model, load = build_layerwise(args, device, materialize=not stream)
    else:
        model = build(args, device)
    handle = store = None
    if stream:
        handle, store = stream_lora_base(model, device=device, tier=args.stream_tier,
                                         prefetch_blocks=args.prefetch_blocks,
                                         schedule=args.stream_schedule, nvme_dir=args.nvme_dir,
                                         staging_blocks=getattr(args, "staging_blocks", None),
                                         load_block=load)
    capped = getattr(args, "gpu_bytes", None) is not None and device.type == "cuda"
    opt = offloader = None
    try:
        if capped:
            cap_gpu(device, args.gpu_bytes)
        opt = make_optimizer(model, hybrid=offload, offload_fraction=args.offload_fraction)
        offloader = make_offloader(model, args.checkpoint, args.offload) if offload else None
        batches = lora_batches(SHAPES[args.preset].vocab, args.batch, args.seq, args.steps,
                               device)
        out = train(model, opt, offloader, batches, timed=True, log=log)
        if handle is not None:
            out.stream_stats = handle.stats()
        return out
    finally:
        if isinstance(opt, HybridAdam):
            opt.close()
        if offloader is not None:
            offloader.close()
        if capped:
            uncap_gpu(device)
        if handle is not None:  # the model is dropped: no copy of the base back to the
            handle.close(restore=False)  # device (Note [closing without a copy])
            store.close()


STREAM_DEFAULTS = {"stream_tier": "cpu", "prefetch_blocks": 1, "stream_schedule": "depth-first"}
"""The streaming flags' values when ``--stream-weights`` is given without them."""


def check_stream_flags(args: argparse.Namespace, device: torch.device) -> None:
    """Check the streaming flags and ``--gpu-bytes`` before anything is built, then fill in
    :data:`STREAM_DEFAULTS` and parse ``--gpu-bytes`` to bytes (in ``args``).

    Raises:
        ValueError, TypeError: a streaming flag without ``--stream-weights``,
            ``--stream-weights`` with ``--no-offload``, a bad value
            (:func:`~tiermem.models.lora_stream.check_stream_options`), or ``--gpu-bytes`` not
            a byte count > 0 or on a device that is not CUDA; one line naming the flag, the
            value and the fix.
    """
    given = {k: getattr(args, k) for k in (*STREAM_DEFAULTS, "nvme_dir", "staging_blocks")
             if getattr(args, k) is not None}
    if given and not args.stream_weights:
        name, value = next(iter(given.items()))
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag}={value!r} sets how the base streams; fix: add "
                         f"--stream-weights or drop {flag}")
    if args.stream_weights and args.no_offload:
        raise ValueError("--stream-weights streams the tiermem run, --no-offload runs without "
                         "tiermem; fix: drop one of them")
    if args.layerwise_base and not (args.stream_weights and args.stream_tier == "nvme"):
        raise ValueError("--layerwise-base builds the base layer by layer into its NVMe home; "
                         "fix: add --stream-weights --stream-tier nvme --nvme-dir DIR, or drop "
                         "--layerwise-base")
    for name, default in STREAM_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.stream_weights:
        check_stream_options(tier=args.stream_tier, prefetch_blocks=args.prefetch_blocks,
                             schedule=args.stream_schedule, nvme_dir=args.nvme_dir,
                             staging_blocks=args.staging_blocks)
    if args.gpu_bytes is not None:
        cap = parse_bytes(args.gpu_bytes, "--gpu-bytes")
        if cap <= 0:
            raise ValueError(f"--gpu-bytes={args.gpu_bytes!r} must be > 0, e.g. 24GiB")
        if device.type != "cuda":
            raise ValueError(f"--gpu-bytes={args.gpu_bytes!r} caps a CUDA device, not "
                             f"{device}; fix: --device cuda, or drop --gpu-bytes")
        args.gpu_bytes = cap


def main(argv: list[str] | None = None) -> int:
    """Train (and with ``--compare`` compare); returns the exit code (0 ok, 1 the losses
    differ, 2 bad usage)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(SHAPES), default="tiny", help="model shape")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (tokens)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="checkpoint every decoder layer (offload then takes their inputs)")
    parser.add_argument("--offload", choices=OFFLOAD_MODES, default="layers",
                        help="what goes to pinned RAM: the decoder layers' activations, only "
                             "the LoRA adapters' saved tensors (tensor-level), or both")
    parser.add_argument("--offload-fraction", type=float, default=1.0,
                        help="share of the adapters' optimizer state in pinned RAM")
    parser.add_argument("--no-offload", action="store_true",
                        help="train without tiermem (torch AdamW, nothing offloaded)")
    parser.add_argument("--compare", action="store_true",
                        help="also train without offload and compare the losses")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="largest loss difference --compare accepts")
    parser.add_argument("--stream-weights", action="store_true",
                        help="stream the frozen base's decoder-layer weights from the store "
                             "(streaming.enabled; the adapters stay on the device)")
    parser.add_argument("--stream-tier", choices=STREAM_TIERS, default=None,
                        help="the streamed base's home: cpu (pinned RAM) or nvme (needs "
                             "--nvme-dir) (streaming.tier; default cpu)")
    parser.add_argument("--prefetch-blocks", type=int, default=None,
                        help="layers fetched ahead of the running one (streaming."
                             "prefetch_blocks; default 1)")
    parser.add_argument("--stream-schedule", choices=STREAM_SCHEDULES, default=None,
                        help="depth-first only here: a transformers Llama runs its own "
                             "forward (streaming.schedule; tiermem/models/lora_stream.py)")
    parser.add_argument("--nvme-dir", default=None,
                        help="spill directory of the stream's store (store.nvme_dir)")
    parser.add_argument("--layerwise-base", action="store_true",
                        help="build the base one decoder layer at a time straight into its "
                             "NVMe home (a base neither RAM nor the GPU holds whole; with "
                             "--stream-tier nvme; --compare's baseline makes the same weights "
                             "whole: Note [layer-wise LoRA Llama])")
    parser.add_argument("--staging-blocks", type=int, default=None,
                        help="with --stream-tier nvme: layers of the base staged in pinned RAM "
                             "at once, the base's only RAM (default prefetch + 2; "
                             "Note [NVMe home] in tiermem/stream/nvme_home.py)")
    parser.add_argument("--gpu-bytes", default=None,
                        help="cap the process's GPU memory at SIZE, e.g. 24GiB, to stand for a "
                             "smaller card (budgets.gpu_bytes, as in examples/train_large.py)")
    args = parser.parse_args(argv)
    for name in ("seq", "batch", "steps", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.offload == "adapters" and args.checkpoint:
        parser.error("--offload=adapters with --checkpoint offloads nothing (a checkpointed "
                     "layer saves only its input); use --offload layers or layers+adapters")
    try:  # before anything is built: a 7B preset on a machine without CUDA is one line
        device = resolve_device(check_device("", "--device", args.device), "--device")
    except ValueError as exc:
        print(f"train_lora: error: {exc}", file=sys.stderr)
        return 2
    try:
        check_stream_flags(args, device)
    except (ValueError, TypeError) as exc:
        print(f"train_lora: error: {exc}", file=sys.stderr)
        return 2
    shape = SHAPES[args.preset]
    print(f"model: LlamaForCausalLM '{args.preset}' ({shape.layers} layers, hidden "
          f"{shape.hidden}), LoRA rank {args.rank} on q, k, v, o, gate, up, down; "
          f"{args.steps} steps of {args.batch} x {args.seq} tokens on {device}"
          f"{', checkpointing every layer' if args.checkpoint else ''}")
    if args.no_offload:
        print("without tiermem: torch.optim.AdamW(fused=True) on the adapters, nothing offloaded")
        run(args, device, offload=False)
        return 0
    what = {"layers": "decoder-layer activations", "adapters": "the LoRA adapters' saved tensors",
            "layers+adapters": "decoder-layer activations and every adapter's saved tensors"}
    print(f"tiermem: {what[args.offload]} -> pinned RAM, HybridAdam on the adapters")
    if args.stream_weights:
        cap = "" if args.gpu_bytes is None else f", GPU capped at {args.gpu_bytes / 2**30:.1f} GiB"
        staging = "" if args.stream_tier != "nvme" else (
            f", {args.staging_blocks or args.prefetch_blocks + 2} layers of RAM staging "
            f"(no RAM copy of the base)")
        print(f"tiermem: the base's decoder layers streamed from {args.stream_tier}, prefetch "
              f"{args.prefetch_blocks}, {args.stream_schedule}{cap}{staging}", flush=True)
    off = run(args, device, offload=True)
    print(f"offloaded {off.offload_stats['put_bytes'] / args.steps / 2**20:.1f} MiB of "
          f"activations per step")
    if off.stream_stats is not None:
        print(stream_summary(off.stream_stats, args.steps))
        later = sorted(off.step_ms[1:] or off.step_ms)
        median_s = later[len(later) // 2] / 1e3
        h2d = off.stream_stats["h2d_bytes"] / args.steps / 1e9
        print(f"s/step {median_s:.2f} (median of the steps after the first), stream H2D "
              f"{h2d / median_s:.1f} GB/s over the step (PCIe-bound when this is near the "
              f"host's pinned H2D rate, tiermem bench transfer)")
    if not args.compare:
        return 0
    print("baseline: torch.optim.AdamW(fused=True) on the adapters, nothing offloaded")
    base = run(args, device, offload=False)
    diff = max(abs(a - b) for a, b in zip(off.losses, base.losses))
    ok = diff <= args.tolerance
    print(f"max |loss difference|: {diff:.3g} (tolerance {args.tolerance:g}): "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
