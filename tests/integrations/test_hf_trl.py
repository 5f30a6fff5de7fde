"""TRL's SFTTrainer with tiermem (issue 31 items 1, 2): ``with_tiermem(SFTTrainer)`` with
HybridAdam (state offloaded) and the activation offload switch trains a tiny Llama
bit-identically to SFTTrainer + torch fused AdamW (Note [trainer reference]) over 9 optimizer
steps. It goes through SFTTrainer's own code: its dataset preparation (pre-tokenized
sequences of different lengths), its collator (padding, labels masked on the pads), its
loss (TRL's fused LM head, normalised by the window's token count) and its
``training_step``; TRL's default gradient checkpointing is on (the offload then takes the
checkpoints' inputs) and off. TRL's own ``activation_offloading=True`` beside tiermem's switch
is refused."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_tiny import ClipInGroupOrder, VOCAB, max_diff, tiny_llama, training_args

datasets = pytest.importorskip("datasets")  # both in the [test] extra: never skipped in CI
trl = pytest.importorskip("trl")

from tokenizers import Tokenizer, models  # noqa: E402  (transformers' dependency)
from transformers import PreTrainedTokenizerFast  # noqa: E402

from tiermem.integrations.hf import with_tiermem  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLES = 34  # batches of 2, accumulation 2: 8 windows of 2 micro-batches and a last one of 1


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's vocabulary, built here (no download):
    token i is ``t{i}``; ``t0`` is the pad token and ``t1`` the end of sequence."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1",
                                   unk_token="t2")


def sft_dataset(seed: int = 1):
    """``SAMPLES`` pre-tokenized sequences of 6-16 tokens ending in EOS (different lengths:
    the collator pads, and the loss counts the window's real tokens)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(SAMPLES):
        n = int(torch.randint(5, 16, (1,), generator=g))
        rows.append(torch.randint(3, VOCAB, (n,), generator=g).tolist() + [1])
    return datasets.Dataset.from_dict({"input_ids": rows})


class SFTClipInGroupOrder(trl.SFTTrainer):
    """Note [trainer reference]: SFTTrainer + fused AdamW, the clip norm in group order."""

    _clip_grad_norm = ClipInGroupOrder._clip_grad_norm


def run_sft(cls, out, **kw):
    """Train with ``cls`` (an SFTTrainer); ``(trainer, logs, weights)`` as hf_tiny.run."""
    trainer_kw = {k: kw.pop(k) for k in ("hybrid_adam", "activation_offload") if k in kw}
    model = tiny_llama()
    args = training_args(out, cls=trl.SFTConfig, bf16=False, max_length=None, **kw)
    trainer = cls(model=model, args=args, train_dataset=sft_dataset(),
                  processing_class=tokenizer(), **trainer_kw)
    trainer.train()
    logs = [(h["step"], h["loss"], h.get("grad_norm")) for h in trainer.state.log_history
            if "loss" in h]
    return trainer, logs, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [True, False])
def test_sft_trainer_with_hybrid_adam_and_activation_offload_is_exact(tmp_path, checkpointing):
    _, ref_logs, ref_weights = run_sft(SFTClipInGroupOrder, str(tmp_path / "ref"),
                                       gradient_checkpointing=checkpointing)
    assert sum(n > 1.0 for _, _, n in ref_logs) >= 7  # the clip is active on most steps
    trainer, logs, weights = run_sft(with_tiermem(trl.SFTTrainer), str(tmp_path / "out"),
                                     gradient_checkpointing=checkpointing,
                                     hybrid_adam={"offload_fraction": 1.0, "chunk_numel": 4096},
                                     activation_offload=True)
    assert type(trainer).__name__ == "TiermemSFTTrainer"
    assert trainer.model.is_gradient_checkpointing == checkpointing
    opt = trainer.hybrid_adam
    assert opt.grad_accumulation_steps == 2 and opt.max_grad_norm == 1.0
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    stats = trainer.activation_offloader.stats()
    assert stats["offloaded"] > 0 and stats["reloads"] > 0 and stats["live_keys"] == 0
    assert len(logs) == 9 and logs == ref_logs
    assert max_diff(weights, ref_weights) == 0.0
    opt.close()


def test_trl_activation_offloading_beside_the_switch_is_refused(tmp_path, monkeypatch):
    """TRL's offloader is built in SFTTrainer.__init__ (it needs an accelerator: stubbed on
    the CPU); the mixin then refuses the pair."""
    import trl.trainer.sft_trainer as sft
    monkeypatch.setattr(sft, "get_act_offloading_ctx_manager",
                        lambda model, **kw: contextlib.nullcontext())
    with pytest.raises(ValueError, match="activation_offloading=True in the trainer's config"):
        run_sft(with_tiermem(trl.SFTTrainer), str(tmp_path), activation_offloading=True,
                hybrid_adam=False, activation_offload=True)
