"""Activation offload through transformers.Trainer (issue 31 item 2): the trainer's
``activation_offload=True`` finds the decoder layers (Note [decoder layers]) and runs each
training step inside :func:`tiermem.offload.offload_activations` (layers ``"auto"``), alone,
with ``activation_checkpointing=True`` and with HybridAdam: the same losses and weights as the
stock Trainer without it, while tensors really went through the store. The finder's choices and
refusals, and the setups the trainer refuses."""

from __future__ import annotations

import re
import types

import pytest
import torch

from hf_tiny import ClipInGroupOrder, max_diff, run, tiny_llama, training_args
from transformers import Trainer

from tiermem.integrations import find_decoder_layers
from tiermem.integrations.hf import TiermemTrainer, with_tiermem
from tiermem.integrations.trainer_setup import check_options, refusal

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_offload_switch_is_exact(tmp_path, checkpointing):
    _, ref_logs, ref_weights = run(Trainer, str(tmp_path / "ref"),
                                   activation_checkpointing=checkpointing)
    trainer, logs, weights = run(TiermemTrainer, str(tmp_path / "out"), hybrid_adam=False,
                                 activation_checkpointing=checkpointing, activation_offload=True)
    offloader = trainer.activation_offloader
    assert offloader is not None and trainer.hybrid_adam is None
    assert offloader.blocks[0] is trainer.model.model.layers[0]
    stats = offloader.stats()
    assert stats["offloaded"] > 0 and stats["reloads"] > 0 and stats["live_keys"] == 0
    assert logs == ref_logs and max_diff(weights, ref_weights) == 0.0


def test_activation_offload_with_hybrid_adam(tmp_path):
    """Both switches together against Trainer + fused AdamW (Note [trainer reference]), with
    the offloader's explicit options (first layer only, given by path)."""
    _, ref_logs, ref_weights = run(ClipInGroupOrder, str(tmp_path / "ref"))
    trainer, logs, weights = run(TiermemTrainer, str(tmp_path / "out"),
                                 hybrid_adam={"offload_fraction": 1.0},
                                 activation_offload={"blocks": "model.layers", "layers": [0]})
    assert trainer.activation_offloader.stats()["offloaded"] > 0
    assert logs == ref_logs and max_diff(weights, ref_weights) == 0.0
    trainer.hybrid_adam.close()


def test_finder_takes_the_decoder_layers_of_llama_and_of_peft():
    model = tiny_llama()
    assert find_decoder_layers(model) is model.model.layers
    assert find_decoder_layers(model, "model.layers") is model.model.layers
    import peft
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert find_decoder_layers(wrapped) is model.model.layers


def test_finder_uses_no_split_modules_and_refuses_clearly():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # not a candidate

    class Net(torch.nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self, stacks=1):
            super().__init__()
            self.stacks = torch.nn.ModuleList([torch.nn.ModuleList([Block(), Block()])
                                               for _ in range(stacks)])

    one = Net()
    assert find_decoder_layers(one) is one.stacks[0]
    with pytest.raises(ValueError, match=r"several lists of layers: 'stacks.0' \(2 x Block\), "
                                         r"'stacks.1'.*'blocks': 'stacks.1'"):
        find_decoder_layers(Net(stacks=2))
    with pytest.raises(ValueError, match="no nn.ModuleList of decoder layers found in Linear"):
        find_decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="has no submodule 'layerz'"):
        find_decoder_layers(tiny_llama(), "model.layerz")
    with pytest.raises(ValueError, match="'model.norm' is a LlamaRMSNorm"):
        find_decoder_layers(tiny_llama(), "model.norm")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        find_decoder_layers("model")


def _trainer(**args):
    base = dict(world_size=1, fp16=False, optim="adamw_torch_fused", activation_offloading=False,
                activation_checkpointing_kwargs=None)
    base.update(args)
    return types.SimpleNamespace(args=types.SimpleNamespace(**base), is_deepspeed_enabled=False,
                                 is_fsdp_enabled=False, optimizer_cls_and_kwargs=None)


@pytest.mark.parametrize("change,hybrid,offload,match", [
    ({"fp16": True}, True, False, "fp16=True: Trainer's GradScaler"),
    ({"optim": "adafactor"}, True, False, "optim='adafactor' but hybrid_adam replaces"),
    ({"world_size": 2}, True, False, "world_size=2: the tiermem trainer runs one process"),
    ({"activation_offloading": True}, False, True, "TRL's offloader"),
    ({"activation_checkpointing_kwargs": {"offload": True}}, False, True, "save_on_cpu"),
])
def test_setups_that_cannot_work_are_refused(change, hybrid, offload, match):
    assert refusal(_trainer(), hybrid, offload) is None
    assert match in refusal(_trainer(**change), hybrid, offload)


def test_refusals_reach_the_user(tmp_path):
    with pytest.raises(ValueError, match="tiermem trainer: TrainingArguments.optim='adafactor'"):
        run(TiermemTrainer, str(tmp_path), optim="adafactor")
    with pytest.raises(ValueError, match=r"hybrid_adam\['lr'\] is set by the TrainingArguments "
                                         r"\(learning_rate\)"):
        check_options({"lr": 1e-3})
    with pytest.raises(TypeError, match="hybrid_adam must be a dict"):
        check_options(0.5)
    with pytest.raises(TypeError, match="activation_offload must be True, False or a dict"):
        TiermemTrainer(model=tiny_llama(), activation_offload="yes")


@pytest.mark.parametrize("flag,match", [
    ("is_deepspeed_enabled", "DeepSpeed is enabled (TrainingArguments.deepspeed): DeepSpeed "
                             "builds its own optimizer"),
    ("is_fsdp_enabled", "FSDP is enabled (TrainingArguments.fsdp): the tiermem trainer runs one "
                        "process"),
])
@pytest.mark.parametrize("hybrid,offload", [(True, False), (False, True)])
def test_deepspeed_and_fsdp_trainers_are_refused_at_construction(tmp_path, flag, match, hybrid,
                                                                  offload):
    """Trainer sets ``is_deepspeed_enabled``/``is_fsdp_enabled`` from its accelerator's plugins
    in ``__init__`` (a CPU process cannot get either plugin: DeepSpeed is not installed here and
    Accelerate takes FSDP only with several GPUs), so a Trainer subclass sets the flag there as
    the plugin would; the mixin refuses right after, before any optimizer exists."""
    class Plugin(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            setattr(self, flag, True)

    with pytest.raises(ValueError, match=re.escape(f"tiermem trainer: {match}")):
        with_tiermem(Plugin)(model=tiny_llama(), args=training_args(str(tmp_path)),
                             hybrid_adam={"offload_fraction": 1.0} if hybrid else False,
                             activation_offload=offload)
