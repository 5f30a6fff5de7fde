"""LoRA fine-tuning (examples/train_lora.py) on the CPU: activation offload + HybridAdam on the
adapters trains as the same run without offload (torch fused AdamW on the adapters, its model
built separately from the same seed), and the frozen base is never copied, offloaded or given
optimizer state.

fp32 on the CPU: every adapter tensor of the tiny preset has a multiple of 16 elements, so
HybridAdam is bit-identical to torch's fused AdamW (README) and activation offload changes no
value: the losses, and the adapters after training, must be equal, not close. peft and
transformers are in the test extra (pyproject.toml), so CI runs this.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import pytest
import torch

from tiermem.models.lora_llama import adapter_parameters, frozen_parameters, lora_batches
from tiermem.store import TierStore

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 8
SEQ = 32


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("train_lora", ROOT / "examples" / "train_lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def puts(monkeypatch):
    """Every tensor any TierStore receives (the offloader's and HybridAdam's stores):
    ``(storage data_ptr, nbytes)``."""
    seen: list[tuple[int, int]] = []
    real = TierStore.put

    def put(self, key, tensor, tier=None):
        seen.append((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return real(self, key, tensor, tier)

    monkeypatch.setattr(TierStore, "put", put)
    return seen


def _args(checkpoint: bool) -> argparse.Namespace:
    return argparse.Namespace(preset="tiny", seq=SEQ, batch=2, steps=STEPS, rank=8,
                              checkpoint=checkpoint, offload_fraction=1.0)


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _reference(ex, checkpoint: bool):
    """No offload, torch fused AdamW on the adapters; the adapters after every step."""
    model = ex.build(_args(checkpoint), torch.device("cpu"))
    opt = ex.make_optimizer(model, hybrid=False)
    after: list[torch.Tensor] = []
    opt.register_step_post_hook(lambda *_: after.append(_flat(adapter_parameters(model)).clone()))
    run = ex.train(model, opt, None, lora_batches(256, 2, SEQ, STEPS))
    return run, after, _flat(adapter_parameters(model))


@pytest.mark.parametrize("checkpoint, mode", [(False, "layers"), (True, "layers"),
                                              (False, "adapters"), (False, "layers+adapters"),
                                              (True, "layers+adapters")],
                         ids=["offload", "checkpoint+offload", "adapter-tensors",
                              "offload+adapter-tensors", "checkpoint+offload+adapter-tensors"])
def test_lora_trains_as_without_offload_and_leaves_the_base_alone(ex, puts, checkpoint, mode):
    ref, ref_after, ref_adapters = _reference(ex, checkpoint)
    # the reference really trains: a different batch and new adapters at every step
    assert len(set(ref.losses)) == STEPS
    assert all(not torch.equal(a, b) for a, b in zip(ref_after, ref_after[1:]))
    assert len(ref_after) == STEPS

    model = ex.build(_args(checkpoint), torch.device("cpu"))
    frozen = frozen_parameters(model)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in frozen.items()}
    opt = ex.make_optimizer(model, hybrid=True)
    offloader = ex.make_offloader(model, checkpoint, mode)
    got = ex.train(model, opt, offloader, lora_batches(256, 2, SEQ, STEPS))
    state = opt.state_dict()["state"]
    opt.close()
    offloader.close()

    assert got.losses == ref.losses  # every step, exactly
    assert torch.equal(_flat(adapter_parameters(model)), ref_adapters)
    assert got.offload_stats["offloaded"] > 0 and got.offload_stats["put_bytes"] > 0

    adapters = adapter_parameters(model)
    frozen_ptrs = {p.untyped_storage().data_ptr() for p in frozen.values()}
    given = {id(p) for g in opt.param_groups for p in g["params"]}
    assert given == {id(p) for p in adapters}  # no frozen weight is given to the optimizer
    assert len(state) == len(adapters)  # ... nor has optimizer state: one entry per adapter,
    for i, p in enumerate(adapters):  # each of the adapter's shape
        assert state[i]["exp_avg"].shape == p.shape and state[i]["exp_avg_sq"].shape == p.shape
    assert not frozen_ptrs & {ptr for ptr, _ in puts}  # no store received a frozen weight
    for name, p in frozen.items():
        ptr, value = before[name]
        assert not p.requires_grad and p.grad is None, name
        assert p.data_ptr() == ptr and torch.equal(p.detach(), value), name  # bit-unchanged


def test_the_adapters_saved_activations_go_through_the_store(ex, puts):
    """The adapters sit inside the decoder layers, so the block hooks offload what autograd
    saves in them: lora_B saves lora_A's output (batch x seq x rank), which the store gets."""
    model = ex.build(_args(False), torch.device("cpu"))
    outputs: list[int] = []
    lora_a = model.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"]
    lora_a.register_forward_hook(lambda m, a, out: outputs.append(out.untyped_storage().data_ptr()))
    offloader = ex.make_offloader(model, False)
    ids = lora_batches(256, 2, SEQ, 1)[0]
    with offloader:
        loss = model(input_ids=ids, labels=ids).loss
    assert outputs and outputs[0] in {ptr for ptr, _ in puts}
    loss.backward()
    offloader.close()


def test_adapter_tensor_offload_takes_the_adapters_tensors_only(ex, held_puts):
    """--offload adapters (tensor-level, Note [offload rules] rule 10): what the adapters save
    goes through the store, in every layer, the last included (which the block offloader keeps);
    what the frozen base saves outside the adapters does not (the MLP activation's input, which
    SiLU saves)."""
    model = ex.build(_args(False), torch.device("cpu"))
    layers = model.base_model.model.model.layers
    lora_out, act_in = [], []
    for layer in (layers[0], layers[-1]):
        layer.mlp.up_proj.lora_A["default"].register_forward_hook(
            lambda m, a, out: lora_out.append(out))
        layer.mlp.act_fn.register_forward_hook(lambda m, a, out: act_in.append(a[0]))
    offloader = ex.make_offloader(model, False, "adapters")
    ids = lora_batches(256, 2, SEQ, 1)[0]
    with offloader:
        loss = model(input_ids=ids, labels=ids).loss
    put_ptrs = {t.untyped_storage().data_ptr() for t in held_puts}
    assert len(lora_out) == 2 and all(t.untyped_storage().data_ptr() in put_ptrs
                                      for t in lora_out)
    assert len(act_in) == 2 and not put_ptrs & {t.untyped_storage().data_ptr() for t in act_in}
    loss.backward()
    assert offloader.stats()["offloaded"] > 0
    offloader.close()  # removes its hooks: the adapters run plainly again
    assert not layers[0].mlp.up_proj.lora_A["default"]._forward_pre_hooks


def test_adapter_tensor_offload_refuses_checkpointing_alone(ex):
    model = ex.build(_args(True), torch.device("cpu"))
    with pytest.raises(ValueError, match="--offload=adapters with --checkpoint offloads nothing"):
        ex.make_offloader(model, True, "adapters")
    with pytest.raises(ValueError, match="--offload='blocks' is not one of"):
        ex.make_offloader(model, False, "blocks")
    with pytest.raises(SystemExit) as exc:
        ex.main(["--offload", "adapters", "--checkpoint"])
    assert exc.value.code == 2


def test_the_frozen_weight_check_can_fail(ex, puts):
    """With offload_weights=True the offloader does take the frozen weights autograd saves (the
    projections' weights, for the gradient of their input): the check above would see them."""
    model = ex.build(_args(False), torch.device("cpu"))
    frozen_ptrs = {p.untyped_storage().data_ptr() for p in frozen_parameters(model).values()}
    offloader = ex.make_offloader(model, False, offload_weights=True)
    ids = lora_batches(256, 2, SEQ, 1)[0]
    with offloader:
        loss = model(input_ids=ids, labels=ids).loss
    assert frozen_ptrs & {ptr for ptr, _ in puts}
    loss.backward()
    offloader.close()


def test_example_compares_and_prints_each_step(ex, capsys):
    assert ex.main(["--steps", "3", "--seq", "16", "--compare", "--checkpoint"]) == 0
    out = capsys.readouterr().out
    assert "max |loss difference|: 0 (tolerance 0): OK" in out
    assert out.count("step   3  loss") == 2 and "MiB of activations per step" in out
