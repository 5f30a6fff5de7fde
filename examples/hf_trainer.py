"""Fine-tune a causal LM with ``transformers.Trainer`` and tiermem (docs/huggingface.md).

Trains the same model twice from the same weights: once with the stock Trainer and torch's fused
AdamW, once with ``TiermemTrainer``, which uses HybridAdam with ``--offload-fraction`` of the
optimizer state in ``--state-tier`` and, with ``--activation-offload``, offloads the decoder
layers' activations. It prints both runs' loss at each step and the largest loss difference,
and exits 1 if that difference exceeds ``--tolerance``.

    pip install -e ".[hf]"
    python examples/hf_trainer.py                      # CPU: a tiny Llama from a config, fp32
    python examples/hf_trainer.py --state-tier nvme --nvme-dir /mnt/nvme/tiermem
    python examples/hf_trainer.py --model Qwen/Qwen2.5-0.5B --bf16 --activation-offload \\
        --tolerance 1e-2                                # a real model on a GPU (downloads it)

The data is synthetic: random token sequences from the model's vocabulary, with labels equal
to the inputs. Swap in your own dataset and tokenizer; nothing else changes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def build_model(args: argparse.Namespace):
    """The model: a seeded tiny Llama from a config, or ``--model`` via ``from_pretrained``.

    Raises:
        SystemExit: transformers or accelerate is not installed (exit 2).
    """
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("hf_trainer: transformers is not installed; pip install -e '.[hf]'",
              file=sys.stderr)
        raise SystemExit(2) from None
    torch.manual_seed(0)
    if args.model:
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                        intermediate_size=2 * args.hidden,
                                        num_hidden_layers=args.layers, num_attention_heads=4,
                                        max_position_embeddings=args.seq))


def dataset(args: argparse.Namespace, vocab: int) -> list[dict]:
    """``batch * accumulation * steps`` random sequences of ``--seq`` tokens."""
    g = torch.Generator().manual_seed(1)
    n = args.batch * args.accumulation * args.steps
    return [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, vocab, (n, args.seq), generator=g)]


def train(args: argparse.Namespace, tiermem: bool, out: str) -> list[float]:
    """One run; returns the loss logged at each optimizer step."""
    from transformers import Trainer, TrainingArguments

    from tiermem.integrations.hf import TiermemTrainer

    model = build_model(args)
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=0.1, warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to=[], bf16=args.bf16, optim="adamw_torch_fused", disable_tqdm=True, seed=0)
    data = dataset(args, model.config.vocab_size)
    if tiermem:
        options = {"offload_fraction": args.offload_fraction, "state_tier": args.state_tier}
        if args.nvme_dir:
            options["nvme_dir"] = args.nvme_dir
        trainer = TiermemTrainer(model=model, args=targs, train_dataset=data,
                                 hybrid_adam=options,
                                 activation_offload=args.activation_offload)
    else:
        trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train()
    if tiermem:
        print(f"  optimizer state chunks per tier: {trainer.hybrid_adam.chunk_tiers()}",
              flush=True)
        trainer.hybrid_adam.close()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main(argv: list[str] | None = None) -> int:
    """Run both trainings and compare; returns the exit code (0 agree, 1 differ, 2 usage)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model name or path (default: a tiny "
                        "Llama built from a config, nothing downloaded)")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    parser.add_argument("--offload-fraction", type=float, default=1.0)
    parser.add_argument("--state-tier", default="cpu", choices=("cpu", "nvme"))
    parser.add_argument("--nvme-dir", default=None)
    parser.add_argument("--activation-offload", action="store_true")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if args.state_tier == "nvme" and not args.nvme_dir:
        print("hf_trainer: error: --state-tier nvme needs --nvme-dir (a directory on the SSD)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as out:
        print("baseline: transformers.Trainer, torch fused AdamW", flush=True)
        base = train(args, False, out)
        print(f"tiermem: TiermemTrainer, HybridAdam with {args.offload_fraction:.0%} of the "
              f"optimizer state in {args.state_tier}, activation offload "
              f"{'on' if args.activation_offload else 'off'}", flush=True)
        off = train(args, True, out)
    for step, (a, b) in enumerate(zip(base, off), 1):
        print(f"step {step:>3}  loss {b:.6f}  (baseline {a:.6f})")
    diff = max(abs(a - b) for a, b in zip(base, off))
    ok = len(base) == len(off) == args.steps and diff <= args.tolerance
    print(f"max |loss difference|: {diff:.3g} (tolerance {args.tolerance:g}): "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
