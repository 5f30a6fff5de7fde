"""PEFT LoRA through TiermemTrainer (issue 31 item 4): HybridAdam (optimizer state offloaded)
and the activation offload switch on a LoRA-wrapped tiny Llama train bit-identically to
Trainer + fused AdamW on the same PEFT model (Note [trainer reference]) over 9 steps, clipping
at 0.5; HybridAdam holds state for the adapters only, and the frozen base does not move."""

from __future__ import annotations

import peft
import pytest
import torch

from hf_tiny import ClipInGroupOrder, max_diff, run, tiny_llama

from tiermem.integrations.hf import TiermemTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

CLIP = 0.5  # the adapters' gradient norms are 0.45-0.9
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model():
    """The tiny Llama with rank-8 LoRA on every projection (every adapter tensor a multiple
    of 16 elements), lora_B seeded non-zero so that both adapter matrices train from step 1."""
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, lora_alpha=16,
                                                              target_modules=TARGETS))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def test_lora_with_hybrid_adam_and_activation_offload_is_exact(tmp_path):
    ref_model = lora_model()
    base = {n: p.detach().clone() for n, p in ref_model.named_parameters()
            if not p.requires_grad}
    _, ref_logs, ref_weights = run(ClipInGroupOrder, str(tmp_path / "ref"), model=ref_model,
                                   max_grad_norm=CLIP)
    assert sum(n > CLIP for _, _, n in ref_logs) >= 7  # the clip is active on most steps
    model = lora_model()
    trainer, logs, weights = run(TiermemTrainer, str(tmp_path / "out"), model=model,
                                 hybrid_adam={"offload_fraction": 1.0, "chunk_numel": 4096},
                                 activation_offload=True, max_grad_norm=CLIP)
    opt = trainer.hybrid_adam
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable) == 2 * 7 * 2
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in owned for p in trainable)
    # the frozen base has no optimizer state: the state is 2 moments of the adapters only
    assert len(opt.state_dict()["state"]) == len(trainable)
    assert sum(opt.state_numel().values()) == sum(p.numel() for p in trainable)
    stats = trainer.activation_offloader.stats()
    assert stats["offloaded"] > 0 and stats["live_keys"] == 0
    assert len(logs) == 9 and logs == ref_logs
    assert max_diff(weights, ref_weights) == 0.0
    assert all(torch.equal(weights[n], base[n]) for n in base)  # the base did not move
    assert all(torch.equal(ref_weights[n], base[n]) for n in base)  # nor the reference's
    opt.close()
