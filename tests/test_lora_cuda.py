"""LoRA fine-tuning on CUDA (Note [training parity] in tests/test_cuda_training_parity.py):
activation offload of the decoder layers, with torch AdamW and with HybridAdam on the adapters,
trains as the same run without activation offload, and the frozen bf16 base is never copied,
offloaded or given optimizer state.

Model: Llama-2-7B's width (hidden 4096, MLP 11008, 32 heads, vocab 32000) with 4 decoder
layers, built from a config in bf16 (peft keeps the rank-16 adapters in fp32), sequence 2048,
micro-batch 2; torch's default kernels (no SDPA backend pinned). Training and tolerance are
the matrix's: ``STEPS`` steps, a new batch every step, no host synchronisation in the loop;
each row's reference is the same optimizer and checkpointing without activation offload, built
from the same seed and run ``REFERENCE_RUNS`` times, and :func:`assert_parity` bounds the loss
at every step (and one batch after the last), the first-step adapter gradients and the final
adapters by ``NOISE_MULTIPLE`` x the references' own run-to-run noise. HybridAdam against torch
AdamW on CUDA (an ulp apart per update, so chaos, not this noise, bounds them) is
tests/optim/test_hybrid_adam_cuda.py's check.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from test_cuda_training_parity import (REFERENCE_RUNS, Reference, Run, assert_parity,
                                       first_step_noise, summarise)
from tiermem.models.lora_llama import (LlamaShape, adapter_parameters, decoder_layers,
                                       frozen_parameters, lora_batches, lora_llama)
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam
from tiermem.store import TierStore

pytestmark = pytest.mark.cuda

SHAPE = LlamaShape(vocab=32000, hidden=4096, intermediate=11008, layers=4, heads=32, kv_heads=32)
SEQ = 2048
BATCH = 2
STEPS = 8
RANK = 16
HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


@pytest.fixture
def puts(monkeypatch):
    """The storage address of every tensor any TierStore receives."""
    seen: set[int] = set()
    real = TierStore.put

    def put(self, key, tensor, tier=None):
        seen.add(tensor.untyped_storage().data_ptr())
        return real(self, key, tensor, tier)

    monkeypatch.setattr(TierStore, "put", put)
    return seen


def _train(opt_name: str, checkpoint: bool, offload: bool, puts: set[int] | None = None) -> Run:
    model = lora_llama(SHAPE, device="cuda", dtype=torch.bfloat16, rank=RANK, alpha=2 * RANK,
                       max_seq=SEQ, checkpoint=checkpoint)
    adapters = adapter_parameters(model)
    frozen = frozen_parameters(model)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in frozen.items()}
    opt = (HybridAdam(adapters, **HP, offload_fraction=1.0) if opt_name == "hybrid"
           else torch.optim.AdamW(adapters, **HP, fused=True))
    layers = decoder_layers(model)
    off = contextlib.nullcontext()
    if offload:
        chosen = range(len(layers)) if checkpoint else range(len(layers) - 1)
        off = offload_activations(layers, layers=chosen)
    batches = lora_batches(SHAPE.vocab, BATCH, SEQ, STEPS + 1, "cuda")
    losses = []
    for step, ids in enumerate(batches[:-1]):
        with off:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:  # before any update: differences here are the kernels' noise alone
            grads0 = torch.cat([p.grad.float().reshape(-1).cpu() for p in adapters])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if isinstance(opt, HybridAdam):
        opt.synchronize()
    with torch.no_grad():  # the final adapters, seen through the loss of one more batch
        losses.append(model(input_ids=batches[-1], labels=batches[-1]).loss)
    torch.cuda.synchronize()  # test only: read the results
    run = Run(torch.stack(losses).double().cpu(),
              torch.cat([p.detach().float().reshape(-1).cpu() for p in adapters]), grads0,
              off.stats()["offloaded"] if offload else 0)
    if puts is not None:  # the frozen base: no optimizer state, no store, bit-unchanged
        given = {id(p) for g in opt.param_groups for p in g["params"]}
        assert given == {id(p) for p in adapters}
        assert len(opt.state_dict()["state"]) == len(adapters)
        assert not puts & {p.untyped_storage().data_ptr() for p in frozen.values()}
        for name, p in frozen.items():
            ptr, value = before[name]
            assert not p.requires_grad and p.grad is None, name
            assert p.data_ptr() == ptr and torch.equal(p.detach(), value), name
    if isinstance(opt, HybridAdam):
        opt.close()
    if offload:
        off.close()
    del model, opt, before
    torch.cuda.empty_cache()
    return run


_REFERENCES: dict[tuple, Reference] = {}


def _reference(opt_name: str, checkpoint: bool) -> Reference:
    key = (opt_name, checkpoint)
    if key not in _REFERENCES:
        _REFERENCES.clear()  # one configuration at a time (host memory)
        _REFERENCES[key] = summarise([_train(opt_name, checkpoint, offload=False)
                                      for _ in range(REFERENCE_RUNS)], _grad_noise(checkpoint))
    return _REFERENCES[key]


def _grad_noise(checkpoint: bool) -> float:
    """The first step's adapter-gradient noise without offload (Note [training parity]: three
    LoRA references agreed exactly on the H200 while a correct HybridAdam row landed 1.4e-7
    away in L2)."""
    model = lora_llama(SHAPE, device="cuda", dtype=torch.bfloat16, rank=RANK, alpha=2 * RANK,
                       max_seq=SEQ, checkpoint=checkpoint)
    adapters = adapter_parameters(model)
    ids = lora_batches(SHAPE.vocab, BATCH, SEQ, STEPS + 1, "cuda")[0]

    def step_grads() -> torch.Tensor:
        model(input_ids=ids, labels=ids).loss.backward()
        g = torch.cat([p.grad.float().reshape(-1) for p in adapters])
        model.zero_grad(set_to_none=True)
        return g

    noise = first_step_noise(step_grads)
    del model, adapters
    torch.cuda.empty_cache()
    return noise


@pytest.mark.parametrize("opt_name,checkpoint", [("adamw", False), ("adamw", True),
                                                 ("hybrid", False), ("hybrid", True)],
                         ids=["adamw", "adamw-checkpoint", "hybrid", "hybrid-checkpoint"])
def test_lora_trains_as_without_offload(opt_name, checkpoint, puts):
    ref = _reference(opt_name, checkpoint)
    got = _train(opt_name, checkpoint, offload=True, puts=puts)
    assert got.offloaded > 0
    assert_parity(got, ref, f"lora/{opt_name}/checkpoint={checkpoint}")


def test_lora_reference_trains():
    """The comparison can fail: the adapters move far beyond the noise and the loss falls."""
    ref = _reference("adamw", False)
    a, noise = ref.run, ref.param_noise
    init = torch.cat([p.detach().float().reshape(-1).cpu() for p in adapter_parameters(
        lora_llama(SHAPE, device="cuda", dtype=torch.bfloat16, rank=RANK, alpha=2 * RANK,
                   max_seq=SEQ))])
    assert (a.params - init).norm().item() > 20 * noise
    assert a.losses[-1] < a.losses[0], a.losses.tolist()
