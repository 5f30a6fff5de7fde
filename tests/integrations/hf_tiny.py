"""A tiny transformers Llama, an in-memory dataset and Trainer runs for the integration tests.

Note [trainer reference]: the reference is ``transformers.Trainer`` with torch's fused AdamW
(``optim="adamw_torch_fused"``), nothing from tiermem. Trainer clips with
``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()``; HybridAdam clips by the norm of
its param groups, decay group first, and a sum of squares in another order can differ in the
last bit, which moves the clip coefficient by an ulp (seen: weights 2.4e-7 apart after 9 steps).
``ClipInGroupOrder`` is that Trainer with only the order of the norm's terms set to the
optimizer's groups' (still torch's ``clip_grad_norm_``, same formula): against it the result
must be bit-identical. Without clipping the plain Trainer is the reference, bit for bit.
"""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

VOCAB, SEQ, SAMPLES = 128, 16, 34  # 17 micro-batches of 2: windows of 2, the 9th of 1


def tiny_llama(layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A seeded 2-layer Llama, hidden 64, fp32 on the CPU."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def dataset(seed: int = 1) -> list[dict]:
    """``SAMPLES`` different token sequences (labels = inputs)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)]


def training_args(out: str, cls: type = TrainingArguments, **kw) -> TrainingArguments:
    """9 optimizer steps (one epoch: 8 windows of 2 micro-batches and a last one of 1), linear
    LR with warmup, weight decay, clipping at 1.0 (every step clips: the norms are 1.3-2.4);
    ``cls``: TrainingArguments or a subclass (TRL's SFTConfig)."""
    base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                num_train_epochs=1, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2,
                lr_scheduler_type="linear", max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.95,
                adam_epsilon=1e-8, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, seed=0, optim="adamw_torch_fused", disable_tqdm=True,
                dataloader_num_workers=0)
    base.update(kw)
    return cls(**base)


class ClipInGroupOrder(Trainer):
    """Note [trainer reference]: Trainer + fused AdamW, the clip norm summed in the optimizer's
    group order."""

    def _clip_grad_norm(self, model):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)


class StopAt(TrainerCallback):
    """Stop training after optimizer step ``step`` (the schedule stays the full run's)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def run(cls, out: str, model=None, resume: str | None = None, stop_at: int | None = None,
        **kw):
    """Train with ``cls`` and return ``(trainer, logs, weights)``: ``logs`` one ``(step, loss,
    grad_norm)`` per optimizer step (a resumed run's include the checkpoint's), ``weights``
    the final parameters by name."""
    trainer_kw = {k: kw.pop(k) for k in ("hybrid_adam", "activation_offload", "optimizers")
                  if k in kw}
    model = tiny_llama() if model is None else model
    trainer = cls(model=model, args=training_args(out, **kw), train_dataset=dataset(),
                  callbacks=[StopAt(stop_at)] if stop_at else None, **trainer_kw)
    trainer.train(resume_from_checkpoint=resume)
    logs = [(h["step"], h["loss"], h.get("grad_norm")) for h in trainer.state.log_history
            if "loss" in h]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trainer, logs, weights


def max_diff(a: dict, b: dict) -> float:
    """Largest elementwise difference of two weight dicts (same names)."""
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)
