"""``tiermem plan``, the command: its arguments (the model, the machine's capacities and rates,
HybridAdam's settings) and :func:`main`, which prints the plan's table or JSON (exit code 0
fits, 1 does not fit, 2 bad usage). The rate flags take GB/s, TFLOP/s and G params/s and are
converted to :class:`MachineRates`' units here, at the command's boundary."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys

from tiermem import flags
from tiermem.names import PARAM_SYNCS
from tiermem.apps.plan.placement import breadth_first_note, plan
from tiermem.apps.plan.rollback import rollback_refusal
from tiermem.rates import MachineRates
from tiermem.shapes import PRESETS


def _fraction(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1] or 'auto'") from None


def _layers(text: str) -> int | None:
    value = blocks_or_auto(text)
    return None if value == "auto" else value


def blocks_or_auto(text: str) -> int | str:
    """The ``--breadth-first-blocks`` argument: an int, or ``"auto"``.

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or 'auto'") from None


def _share(text: str) -> float:
    try:
        return float(text)  # the range is plan()'s check, one message for both
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]") from None


def _norm(text: str) -> float:
    try:
        return float(text)  # the range is plan()'s check, one message for both
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (a clipping norm > 0, "
                                         f"e.g. 1.0)") from None


def _count(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 13e9)") from None
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiermem plan",
        description="Say what must go where (GPU / pinned host RAM / NVMe) to train a GPT-style "
                    "model (dense, or mixture of experts with --experts, --top-k and --d-expert), "
                    "and whether it fits. Exit code 0: fits; 1: does not fit; 2: bad "
                    "usage. The memory model is documented in tiermem/apps/plan/memory.py "
                    "(weight streaming: tiermem/apps/plan/streaming.py) and docs/sizing.md.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--model-size", choices=sorted(PRESETS, key=lambda s: float(s[:-1])),
                      help="a GPT preset (vocab 32000, seq 2048; 1b: 24x2048 micro-batch 8, "
                           "7b: 32x4096, 13b: 40x5120, 30b: 60x6656, 70b: 80x8192, batch 1)")
    size.add_argument("--hf-config", metavar="PATH|NAME",
                      help="a transformers model's config: a config.json, a directory with "
                           "one, or a hub name already in the local Hugging Face cache (no "
                           "download); sets the parameter count (exact), layers, width, heads, "
                           "vocabulary, MLP width and seq (max_position_embeddings, at most "
                           "2048) (Note [hf config shape] in tiermem/integrations/hf_config.py)")
    size.add_argument("--params", type=_count, help="parameter count, e.g. 13e9 "
                      "(needs --layers and --d-model; for an MoE all parameters, and optional: "
                      "counted from the shape)")
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--heads", type=int, help="attention heads (eager attention only)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 32000)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int, help="sequences per micro-batch (default: preset's, or 1)")
    p.add_argument("--experts", type=int, help="MoE: experts per block (with --top-k, --d-expert)")
    p.add_argument("--top-k", type=int, help="MoE: experts each token is routed to")
    p.add_argument("--d-expert", type=int, help="MoE: hidden width of each expert's MLP")
    p.add_argument("--dtype", default="bf16",
                   help="parameter dtype: bf16, fp32 or fp16, or their long names (bfloat16, "
                        "...) (default bf16)")
    add = functools.partial(flags.add, p, "plan")  # default and field: tiermem/flags.py
    add("--moments-dtype", help="dtype of the Adam moments, on the GPU and offloaded alike: fp32 "
        "or bf16, or their long names (default %(default)s)")
    add("--gpu-bytes", metavar="SIZE",
        help="GPU capacity (default %(default)s = 141GB: one H200; output is in GiB)")
    add("--host-bytes", metavar="SIZE", help="host RAM (default %(default)s)")
    add("--nvme-bytes", metavar="SIZE", help="NVMe space for spill files (default %(default)s)")
    add("--gpu-reserve", help="GPU bytes kept free (default 1GiB + 5%% of --gpu-bytes)")
    add("--host-reserve", help="host bytes kept free (default %(default)s)")
    add("--offload-fraction", type=_fraction, metavar="F|auto",
        help="optimizer state off the GPU, 0..1 (default auto: the least that fits)")
    add("--state-tier", choices=["auto", "cpu", "nvme", "split"],
        help="where offloaded state lives (default auto: RAM, else split RAM + NVMe)")
    add("--offload-layers", type=_layers, metavar="K|auto",
        help="blocks whose activations are offloaded (default auto)")
    add("--activation-tier", choices=["cpu", "nvme"],
        help="where offloaded activations go (default %(default)s)")
    add("--checkpoint", action="store_true", help="activation checkpointing")
    add("--prefetch-depth", type=int, help="blocks reloaded ahead (%(default)s)")
    p.add_argument("--eager-attention", action="store_true",
                   help="attention saves its softmax (no flash/efficient SDPA kernel)")
    add("--gpu-step-fraction", type=_share, metavar="S",
        help="share of the offloaded chunks HybridAdam's GPU lane steps "
        "(optimizer.gpu_step_fraction), 0..1, for the time per step: that share "
        "crosses PCIe as state both ways instead of being stepped by the CPU "
        "(default %(default)s: the CPU steps all)")
    add("--max-grad-norm", type=_norm, metavar="X",
        help="HybridAdam's gradient clipping norm (optimizer.max_grad_norm), for the "
        "time per step: with it the optimizer phase cannot overlap backward (it "
        "waits for the global norm), so the floor step is the GPU's time plus "
        "the whole optimizer phase, but for the chunks --rollback-bytes lets "
        "speculate (default: no clipping)")
    add("--rollback-bytes", metavar="SIZE",
        help="HybridAdam's budget of pre-step copies for speculative clipping "
        "(optimizer.rollback_bytes): with --max-grad-norm or --grad-scaler the chunks it "
        "holds step during backward and are rolled back when the norm clips (or the scaler "
        "skips the step); the memory table "
        "counts the copies in host RAM (the GPU lane's share on the GPU), the time "
        "per step lets those chunks overlap backward (if the norm does not clip); a budget "
        "that alone keeps the plan from fitting is refused with the largest that fits "
        "(default %(default)s: every chunk waits for the norm)")
    p.add_argument("--grad-scaler", action="store_true",
                   help="a torch.amp.GradScaler drives the steps (fp16 training): every "
                   "offloaded chunk waits for its verdict or, within --rollback-bytes, steps "
                   "speculatively, also without --max-grad-norm, so the memory table counts the "
                   "rollback copies and the time per step lets only those chunks overlap "
                   "backward, as with --max-grad-norm (no configuration field: HybridAdam finds "
                   "the scaler at run time)")
    add("--grad-accumulation-steps", type=int, metavar="N",
        help="micro-batches per optimizer step, for the time per step: tokens per "
        "step = batch x seq x N (default %(default)s; the memory depends on it only with "
        "--breadth-first-blocks and with streamed weights: block-major keeps every "
        "micro-batch's block inputs, depth-first over N > 1 the last pass's gradient sums)")
    add("--param-sync", choices=PARAM_SYNCS,
        help="HybridAdam's param_sync (optimizer.param_sync), for the time per "
        "step: with 'forward' and --max-grad-norm the next forward runs beside "
        "the optimizer's tail (default: %(default)s)")
    add("--breadth-first-blocks", type=blocks_or_auto, metavar="K",
        help="blocks run for every micro-batch first (train.breadth_first_blocks), "
        "or 'auto': the most that fit; their saved inputs count on the GPU, and "
        "with --param-sync forward their forward runs beside the optimizer's "
        "tail (default %(default)s)")
    stream = p.add_argument_group(
        "weight streaming", "issue 29: the blocks' weights live on the host and reach the GPU "
        "block by block (docs/streaming.md; Note [streaming plan] in "
        "tiermem/apps/plan/streaming.py); "
        "predictions, checked once against an H200 run in docs/benchmarks.md")
    add_s = functools.partial(flags.add, stream, "plan")
    add_s("--stream-weights", choices=sorted(_STREAM),
          help="stream the blocks' weights: on, off, or auto: only when the GPU "
          "cannot hold every weight (default %(default)s)")
    add_s("--stream-tier", choices=["auto", "cpu", "nvme"],
          help="the streamed weights' home: pinned RAM (cpu), NVMe, or auto: RAM "
          "if the run fits so, else NVMe (default %(default)s)")
    add_s("--prefetch-blocks", type=int, metavar="P",
          help="streamed blocks fetched ahead; the GPU holds P + 2 blocks' "
          "buffers (default %(default)s)")
    add_s("--stream-schedule", choices=["auto", "block-major", "depth-first"],
          help="block-major moves each streamed block once per pass whatever the "
          "micro-batches (and keeps every micro-batch's activations); "
          "depth-first once per micro-batch (default %(default)s: block-major with "
          "--grad-accumulation-steps > 1)")
    rates = p.add_argument_group(
        "machine rates", "what the time per optimizer step is predicted from (defaults: the "
        "H200 machine, one run each, docs/results/*.log; docs/sizing.md)")
    d = MachineRates()
    for flag, fld, scale, unit, log in _RATE_FLAGS:
        rates.add_argument(flag, type=_rate, default=None, metavar=unit.split()[0],
                           help=f"{unit} (default {getattr(d, fld) / scale:,.2f}, {log})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


_RATE_FLAGS = (
    ("--gpu-tflops", "gpu_flops", 1e12, "TFLOP/s of forward + backward counted as 6·N·tokens",
     "bench_activations.log"),
    ("--gpu-tflops-checkpointed", "gpu_flops_checkpointed", 1e12,
     "TFLOP/s of forward + backward with every block checkpointed, counted as 8·N·tokens",
     "bench_activations.log"),
    ("--pcie-h2d", "pcie_h2d_bytes_per_s", 1e9, "GB/s host to device", "bench_transfer.log"),
    ("--pcie-d2h", "pcie_d2h_bytes_per_s", 1e9, "GB/s device to host", "bench_transfer.log"),
    ("--pcie-both", "pcie_both_bytes_per_s", 1e9, "GB/s both directions at once",
     "bench_transfer.log"),
    ("--cpu-adam", "cpu_adam_params_per_s", 1e9, "Gparams/s of CPU Adam, fp32 moments",
     "bench_adam.log"),
    ("--cpu-adam-bf16", "cpu_adam_bf16_moments_params_per_s", 1e9,
     "Gparams/s of CPU Adam, bf16 moments", "bench_adam.log"),
    ("--nvme-read", "nvme_read_bytes_per_s", 1e9, "GB/s spill-file reads", "bench_io.log"),
    ("--nvme-write", "nvme_write_bytes_per_s", 1e9, "GB/s spill-file writes", "bench_io.log"),
)
"""``tiermem plan``'s rate options: flag, :class:`MachineRates` field, unit scale, unit, log."""


_STREAM = {"on": True, "off": False, "auto": "auto"}
"""``--stream-weights`` -> ``plan(stream_weights=...)``."""


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run ``tiermem plan``; return 0 (fits), 1 (does not fit) or 2 (bad usage).

    Bad usage prints one line (or argparse's usage message) on stderr and returns 2.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        moe = dict(n_experts=args.experts, top_k=args.top_k, d_expert=args.d_expert)
        is_moe = any(v is not None for v in moe.values())
        if (args.model_size is None and args.params is None and args.hf_config is None
                and not is_moe):
            raise ValueError("give the model: --model-size 1b|7b|13b|30b|70b, --hf-config "
                             "config.json, --params N with --layers and --d-model, or an MoE: "
                             "--layers, --d-model, --experts, --top-k and --d-expert")
        shape = PRESETS.get(args.model_size)
        hf = None
        if args.hf_config is not None:
            from tiermem.integrations.hf_config import hf_shape  # imports transformers
            taken = [f for f, v in (("--layers", args.layers), ("--d-model", args.d_model),
                                    ("--heads", args.heads), ("--vocab", args.vocab)) if v]
            if taken:
                raise ValueError(f"--hf-config sets the shape; drop {taken[0]} (or give "
                                 f"--params with --layers and --d-model instead)")
            hf = hf_shape(args.hf_config)
            shape = hf.shape
        kw = dict(
            n_layers=args.layers or (shape.n_layers if shape else None),
            d_model=args.d_model or (shape.d_model if shape else None),
            n_heads=args.heads or (shape.n_heads if shape else None),
            vocab=args.vocab or (shape.vocab if shape else 32000),
            seq=args.seq or (shape.seq_len if shape else 2048),
            batch=args.batch or (shape.micro_batch if shape else 1),
            mlp_ratio=shape.mlp_ratio if shape else 4,
            dtype=args.dtype, moments_dtype=args.moments_dtype, gpu_bytes=args.gpu_bytes,
            host_bytes=args.host_bytes, nvme_bytes=args.nvme_bytes,
            gpu_reserve_bytes=args.gpu_reserve,
            host_reserve_bytes=args.host_reserve, offload_fraction=args.offload_fraction,
            state_tier=args.state_tier, offload_layers=args.offload_layers,
            activation_tier=args.activation_tier, checkpoint=args.checkpoint,
            prefetch_depth=args.prefetch_depth, eager_attention=args.eager_attention,
            grad_accumulation_steps=args.grad_accumulation_steps,
            gpu_step_fraction=args.gpu_step_fraction, max_grad_norm=args.max_grad_norm,
            rollback_bytes=args.rollback_bytes, grad_scaler=args.grad_scaler,
            param_sync=args.param_sync,
            breadth_first_blocks=args.breadth_first_blocks,
            stream_weights=_STREAM[args.stream_weights], stream_tier=args.stream_tier,
            prefetch_blocks=args.prefetch_blocks, stream_schedule=args.stream_schedule,
            rates=MachineRates(**{fld: getattr(args, flag[2:].replace("-", "_")) * scale
                                  for flag, fld, scale, _, _ in _RATE_FLAGS
                                  if getattr(args, flag[2:].replace("-", "_")) is not None}),
            **moe)
        if hf is not None:
            if is_moe:
                raise ValueError("--hf-config reads a dense model; for an MoE give --layers, "
                                 "--d-model, --experts, --top-k and --d-expert instead")
            n = hf.num_params
        elif shape is not None:
            if args.layers or args.d_model:
                raise ValueError("--model-size sets the shape; use --params with --layers and "
                                 "--d-model for another shape")
            if is_moe:
                raise ValueError("--model-size is a dense GPT preset; for an MoE give --layers, "
                                 "--d-model, --experts, --top-k and --d-expert instead")
            n = dataclasses.replace(shape, vocab=kw["vocab"], seq_len=kw["seq"]).num_params()
        else:
            n = args.params
        result = plan(n, **kw)
        refusal = rollback_refusal(result, n, kw)  # Note [rollback refusal]
        if refusal:
            raise ValueError(refusal)
        hint = breadth_first_note(result, n, kw)
    except (ValueError, TypeError) as exc:
        print(f"tiermem plan: error: {exc}", file=sys.stderr)
        return 2
    if hint:
        result.notes.append(hint)
    if hf is not None:
        s = hf.shape
        result.notes.append(f"model from {hf.source}: {hf.num_params:,} parameters, "
                            f"{s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, "
                            f"vocab {s.vocab}, mlp_ratio {s.mlp_ratio}, seq {kw['seq']}")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table(), end="")
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
