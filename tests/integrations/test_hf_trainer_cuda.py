"""TiermemTrainer on a GPU (issue 31 item 1): what the CPU tests cannot show.

1. Exact on CUDA: with ``offload_fraction=0.0`` HybridAdam steps with torch's fused CUDA Adam,
   so Trainer's accumulation, clipping (Note [trainer clipping]), LR schedule, decay groups and
   a checkpoint resumed in a new trainer must give the reference's losses and weights bit for
   bit (Note [trainer reference]). (Offloaded chunks step on the CPU kernel, an ulp away from
   the CUDA one: tests/optim/test_hybrid_adam_cuda.py bounds that drift.)
2. No state on the GPU: with the whole state offloaded, the trainer's peak GPU memory stays a
   whole state's size (8 B/param) below the slip where Accelerate wraps the optimizer itself
   and round-trips ``state_dict()`` through the GPU in ``prepare`` (Note [trainer optimizer
   wrap]); also with ``param_sync="forward"`` and a checkpoint save in the run.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_tiny import ClipInGroupOrder, dataset, max_diff, tiny_llama, training_args
from transformers import LlamaConfig, LlamaForCausalLM

from tiermem.integrations.hf import TiermemTrainer

pytestmark = pytest.mark.cuda


def _run(cls, out, model=None, resume=None, **kw):
    trainer_kw = {k: kw.pop(k) for k in ("hybrid_adam",) if k in kw}
    model = (tiny_llama() if model is None else model).cuda()
    trainer = cls(model=model, args=training_args(out, use_cpu=False, **kw),
                  train_dataset=dataset(), **trainer_kw)
    trainer.train(resume_from_checkpoint=resume)
    logs = [(h["step"], h["loss"], h.get("grad_norm")) for h in trainer.state.log_history
            if "loss" in h]
    return trainer, logs, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def test_exact_on_cuda_with_resume(tmp_path):
    _, ref_logs, ref_weights = _run(ClipInGroupOrder, str(tmp_path / "ref"))
    trainer, logs, weights = _run(TiermemTrainer, str(tmp_path / "a"),
                                  hybrid_adam={"offload_fraction": 0.0})
    assert trainer.hybrid_adam.device.type == "cuda"
    assert logs == ref_logs and max_diff(weights, ref_weights) == 0.0
    full = str(tmp_path / "c")  # the same run, saving at step 4; then resumed from there
    _, full_logs, _ = _run(TiermemTrainer, full, save_strategy="steps", save_steps=4,
                           hybrid_adam={"offload_fraction": 0.0})
    _, logs, weights = _run(TiermemTrainer, full, model=tiny_llama(seed=7),
                            resume=os.path.join(full, "checkpoint-4"), save_strategy="steps",
                            save_steps=4, hybrid_adam={"offload_fraction": 0.0})
    assert logs == full_logs == ref_logs and max_diff(weights, ref_weights) == 0.0


class AccelerateWraps(TiermemTrainer):
    """Slip: the bare HybridAdam goes to accelerate.prepare, which wraps it with device
    placement (state_dict() moved to the GPU and loaded back)."""

    def create_optimizer(self, model=None):
        super().create_optimizer(model)
        self.optimizer = self.hybrid_adam
        return self.optimizer


def _peak(cls, out, **hybrid):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=64)
    model = LlamaForCausalLM(config).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32000, (8, 64))]
    trainer = cls(model=model, args=training_args(out, use_cpu=False, max_steps=4,
                                                  save_strategy="steps", save_steps=2),
                  train_dataset=data, hybrid_adam=dict(offload_fraction=1.0, **hybrid))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated()
    trainer.hybrid_adam.close()
    del trainer, model
    torch.cuda.empty_cache()
    return peak, n_params


@pytest.mark.parametrize("param_sync", ["step", "forward"])
def test_the_state_never_lands_on_the_gpu(tmp_path, param_sync):
    peak, n_params = _peak(TiermemTrainer, str(tmp_path / "a"), param_sync=param_sync)
    slip, _ = _peak(AccelerateWraps, str(tmp_path / "b"), param_sync=param_sync)
    state_bytes = 8 * n_params  # fp32 exp_avg + exp_avg_sq
    print(f"peak GPU memory: {peak / 2**20:.0f} MiB, with Accelerate's wrap "
          f"{slip / 2**20:.0f} MiB (state {state_bytes / 2**20:.0f} MiB)")
    assert slip - peak >= 0.9 * state_bytes
