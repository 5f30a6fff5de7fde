"""tiermem.config and tiermem.names: byte sizes, dotted overrides, YAML loading, section
dataclasses, the shared vocabulary (dtype spellings, tiers) and errors."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pathlib
import re

import pytest
import torch
import yaml

from models import TinyGPT, make_batch
from _examples import load_example
from tiermem.config import (ActivationConfig, BudgetConfig, OptimizerConfig, StoreConfig,
                            StreamingConfig,
                            TrainConfig, apply_overrides, from_dict, from_tree, from_yaml,
                            load_config, parse_bytes)
from tiermem.names import check_bool, check_int, dtype_name, parse_dtype

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LARGE_PRESETS = sorted((ROOT / "examples" / "configs" / "large").glob("*.yaml"))


@pytest.mark.parametrize("value, expected", [
    (0, 0), (4096, 4096), (2.0, 2), ("512", 512), ("1KB", 1000), ("1kib", 1024),
    ("1.5GiB", 3 << 29), ("4GB", 4 * 10**9), (" 2 MiB ", 2 << 20), ("1e3", 1000), ("1TiB", 1 << 40),
])
def test_parse_bytes_accepts_ints_and_units(value, expected):
    assert parse_bytes(value, "f") == expected


@pytest.mark.parametrize("value, exc, message", [
    ("4 lightyears", ValueError, "StoreConfig.cpu_bytes='4 lightyears' is not a byte size"),
    ("GiB", ValueError, "is not a byte size"),
    (-1, ValueError, "StoreConfig.cpu_bytes=-1 is negative"),
    ("0.5B", ValueError, "is not a whole number of bytes"),
    (True, TypeError, "got bool"),
    ([1], TypeError, "got list"),
])
def test_parse_bytes_rejects_bad_values_naming_the_field(value, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        parse_bytes(value, "StoreConfig.cpu_bytes")


def test_apply_overrides_creates_sections_and_parses_yaml_values():
    tree = {"optimizer": {"lr": 1e-3}}
    apply_overrides(tree, ["optimizer.offload_fraction=0.5", "activations.num_layers=8",
                           "store.nvme_dir=/tmp/spill", "optimizer.betas=[0.8, 0.9]",
                           "train.baseline=false", "store.cpu_bytes=4GiB", "store.nvme_dir2="])
    assert tree == {"optimizer": {"lr": 1e-3, "offload_fraction": 0.5, "betas": [0.8, 0.9]},
                    "activations": {"num_layers": 8},
                    "store": {"nvme_dir": "/tmp/spill", "cpu_bytes": "4GiB", "nvme_dir2": None},
                    "train": {"baseline": False}}


@pytest.mark.parametrize("item, message", [
    ("optimizer.offload_fraction", "is not 'section.field=value'"),
    ("=3", "is not 'section.field=value'"),
])
def test_apply_overrides_rejects_malformed_items(item, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_overrides({}, [item])


def test_apply_overrides_rejects_a_value_used_as_a_section():
    with pytest.raises(ValueError, match="'lr' is a value, not a section"):
        apply_overrides({"optimizer": {"lr": 1.0}}, ["optimizer.lr.x=2"])


def test_load_config_reads_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  cpu_bytes: 1GiB\noptimizer:\n  offload_fraction: 1.0\n")
    tree = load_config(path, ["optimizer.offload_fraction=0.25"])
    assert tree == {"store": {"cpu_bytes": "1GiB"}, "optimizer": {"offload_fraction": 0.25}}
    assert load_config(None, ["a.b=1"]) == {"a": {"b": 1}}


def test_load_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a YAML mapping of sections"):
        load_config(bad)


def test_from_dict_builds_and_rejects_unknown_fields_listing_valid_ones():
    cfg = from_dict(StoreConfig, {"cpu_bytes": "1GiB"}, "store")
    assert cfg.cpu_bytes == 1 << 30
    with pytest.raises(ValueError) as err:
        from_dict(StoreConfig, {"cpu_bytez": 1, "gpu_bytes": 1}, "store")
    msg = str(err.value)
    assert msg.startswith("unknown field(s) store.cpu_bytez; valid fields of store: ")
    assert "cpu_bytes" in msg and "nvme_dir" in msg
    assert from_dict(OptimizerConfig, None, "optimizer") == OptimizerConfig()


def test_store_config_errors_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match="StoreConfig.nvme_bytes=.* needs a spill directory"):
        StoreConfig(nvme_bytes="1GiB")
    with pytest.raises(ValueError, match="StoreConfig.io_chunk_bytes=.*multiple of 4096"):
        StoreConfig(io_chunk_bytes=1000)


@pytest.mark.parametrize("cls, kwargs, exc, message", [
    (OptimizerConfig, {"offload_fraction": 1.5}, ValueError, "optimizer.offload_fraction=1.5 is outside [0.0, 1.0]; it is the fraction of parameter bytes"),
    (OptimizerConfig, {"offload_fraction": "half"}, TypeError, "optimizer.offload_fraction must be a number"),
    (OptimizerConfig, {"betas": [0.9, 1.0]}, ValueError, "optimizer.betas[1]=1.0 must be < 1.0"),
    (OptimizerConfig, {"betas": [0.9]}, ValueError, "optimizer.betas=[0.9] must be two numbers"),
    (OptimizerConfig, {"state_tier": "disk"}, ValueError,
     "optimizer.state_tier='disk' is not one of 'cpu', 'nvme', 'split'; cpu is pinned RAM"),
    (OptimizerConfig, {"chunk_numel": 10}, ValueError, "optimizer.chunk_numel=10 must be an int >= 1024 (elements); or null"),
    (OptimizerConfig, {"max_grad_norm": 0}, ValueError, "optimizer.max_grad_norm=0 must be > 0.0; or null"),
    (OptimizerConfig, {"moments_dtype": "int8"}, ValueError, "optimizer.moments_dtype='int8'"),
    (OptimizerConfig, {"moments_dtype": "fp16"}, ValueError,
     "optimizer.moments_dtype='fp16' is not a supported dtype; use one of float32, fp32, "
     "torch.float32, bfloat16, bf16, torch.bfloat16"),
    (OptimizerConfig, {"grad_accumulation_steps": 0}, ValueError,
     "optimizer.grad_accumulation_steps=0 must be an int >= 1"),
    (OptimizerConfig, {"adamw": "yes"}, ValueError, "optimizer.adamw='yes' is not one of True, False"),
    (OptimizerConfig, {"overlap": 1}, ValueError, "optimizer.overlap=1 is not one of True, False"),
    (OptimizerConfig, {"data_parallel": "on"}, ValueError, "optimizer.data_parallel='on'"),
    (OptimizerConfig, {"bucket_numel": 0}, ValueError, "optimizer.bucket_numel=0 must be an int >= 1"),
    (OptimizerConfig, {"param_sync": "later"}, ValueError,
     "optimizer.param_sync='later' is not one of 'step', 'forward'"),
    (OptimizerConfig, {"placement": "random"}, ValueError,
     "optimizer.placement='random' is not one of 'trace', 'given'"),
    (OptimizerConfig, {"gpu_step_fraction": 2}, ValueError, "optimizer.gpu_step_fraction=2 is outside [0.0, 1.0]"),
    (OptimizerConfig, {"cpu_threads": 1.5}, TypeError, "optimizer.cpu_threads must be an int >= 1 (threads), got float 1.5"),
    (ActivationConfig, {"num_layers": -1}, ValueError, "activations.num_layers=-1 must be an int >= 0 (blocks)"),
    (ActivationConfig, {"prefetch_depth": 0}, ValueError, "activations.prefetch_depth=0 must be an int >= 1 (layers)"),
    (ActivationConfig, {"double_buffering": True, "prefetch_depth": 2}, ValueError,
     "activations.double_buffering=True needs activations.prefetch_depth=1"),
    (ActivationConfig, {"tier": "gpu"}, ValueError, "activations.tier='gpu' is not one of"),
    (ActivationConfig, {"num_layers": 2, "max_kept_bytes": "1GiB"}, ValueError,
     "activations.max_kept_bytes bounds the automatic choice"),
    (ActivationConfig, {"max_kept_bytes": "lots"}, ValueError,
     "activations.max_kept_bytes='lots' is not a byte size"),
    (TrainConfig, {"steps": 0}, ValueError, "train.steps=0 must be an int >= 1"),
    (TrainConfig, {"steps": 2.5}, TypeError, "train.steps must be an int"),
    (TrainConfig, {"dtype": "float16"}, ValueError, "train.dtype='float16' is not a supported dtype; use one of float32, fp32"),
    (TrainConfig, {"device": "tpu"}, ValueError, "train.device='tpu' is not 'auto'"),
    (TrainConfig, {"tolerance": -1}, ValueError, "train.tolerance=-1 must be >= 0.0"),
    (StoreConfig, {"io_backend": "tape"}, ValueError,
     "StoreConfig.io_backend='tape' is not one of 'auto', 'posix', 'kvikio', 'aiofiles'; auto is posix"),
    (StoreConfig, {"pin_memory": 1}, ValueError, "StoreConfig.pin_memory=1 is not one of True, False, 'auto'"),
    (StoreConfig, {"io_threads": 0}, ValueError, "StoreConfig.io_threads=0 must be an int >= 1 (threads)"),
    (BudgetConfig, {"host_bytes": "lots"}, ValueError, "budgets.host_bytes='lots' is not a byte size"),
])
def test_section_configs_reject_bad_values(cls, kwargs, exc, message):
    with pytest.raises(exc, match=re.escape(message)) as err:
        cls(**kwargs)
    assert "\n" not in str(err.value)  # one line


def test_section_kwargs_match_the_apis_they_feed():
    from tiermem.offload import offload_activations
    from tiermem.optim import HybridAdam
    hybrid = inspect.signature(HybridAdam).parameters
    assert set(OptimizerConfig().kwargs()) <= set(hybrid)
    assert OptimizerConfig().kwargs()["moments_dtype"] is torch.float32
    assert OptimizerConfig(moments_dtype="bfloat16").kwargs()["moments_dtype"] is torch.bfloat16
    assert set(ActivationConfig().kwargs()) <= set(inspect.signature(offload_activations).parameters)
    assert OptimizerConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)


def test_configuration_doc_lists_every_parameter():
    """docs/configuration.md is the reference: every field and API argument has a row."""
    from tiermem.models.gpt import GPTConfig
    from tiermem.offload import offload_activations
    from tiermem.optim import HybridAdam
    text = (DOCS / "configuration.md").read_text()
    names = {f.name for cls in (StoreConfig, OptimizerConfig, ActivationConfig, TrainConfig,
                                BudgetConfig, StreamingConfig, GPTConfig)
             for f in dataclasses.fields(cls)}
    names |= set(inspect.signature(HybridAdam).parameters) - {"params"}
    names |= set(inspect.signature(offload_activations).parameters) - {"blocks"}
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/configuration.md lacks rows for {missing}"


def test_activation_max_kept_bytes_parses_units():
    assert ActivationConfig(max_kept_bytes="2GiB").kwargs()["max_kept_bytes"] == 2 << 30


def test_nvme_dir_without_nvme_bytes_warns_through_logger_and_warnings(caplog):
    """Issue 17.5: the nvme tier is off (nvme_bytes=0) although a spill directory was given;
    0 is the documented off switch, so it is a warning, not an error."""
    with caplog.at_level("WARNING", logger="tiermem"):
        with pytest.warns(UserWarning, match=r"StoreConfig.nvme_dir='/tmp/spill' is ignored "
                                             r"because StoreConfig.nvme_bytes=0 .*set nvme_bytes"):
            cfg = StoreConfig(nvme_dir="/tmp/spill")
    assert cfg.nvme_bytes == 0
    assert [r.name for r in caplog.records] == ["tiermem"]
    assert "is ignored because StoreConfig.nvme_bytes=0" in caplog.records[0].getMessage()


@pytest.mark.parametrize("kw", [{}, {"nvme_bytes": "1GiB", "nvme_dir": "/tmp/spill"}])
def test_consistent_nvme_settings_do_not_warn(kw, recwarn):
    StoreConfig(**kw)
    assert not [w for w in recwarn if "nvme_dir" in str(w.message)]


@pytest.mark.parametrize("value", ["1e400", float("inf"), float("nan")])
def test_parse_bytes_rejects_non_finite_values_naming_the_field(value):
    with pytest.raises(ValueError, match=re.escape(f"StoreConfig.cpu_bytes={value!r} is not a "
                                                   f"finite byte size")):
        parse_bytes(value, "StoreConfig.cpu_bytes")


# ------------------------------------------------------------------ one vocabulary (issue 18.4)

def test_state_tier_split_is_accepted_and_passed_on():
    assert OptimizerConfig(state_tier="split").kwargs()["state_tier"] == "split"


@pytest.mark.parametrize("spelling, name", [
    ("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("torch.bfloat16", "bfloat16"),
    ("BF16", "bfloat16"), (torch.bfloat16, "bfloat16"),
    ("fp32", "float32"), ("float32", "float32"), ("torch.float32", "float32"),
    (" FP32 ", "float32"), (torch.float32, "float32"),
])
def test_every_dtype_spelling_means_the_same_dtype(spelling, name):
    opt = OptimizerConfig(moments_dtype=spelling)
    assert opt.moments_dtype == name  # kept canonical: YAML written back uses one spelling
    assert opt.kwargs()["moments_dtype"] is getattr(torch, name)
    assert TrainConfig(dtype=spelling).dtype == name
    assert dtype_name("x.", "f", spelling) == name
    assert parse_dtype("x.", "f", spelling) is getattr(torch, name)


@pytest.mark.parametrize("value", ["fp16", torch.float16, "int8", 3, None])
def test_unsupported_dtypes_name_the_field_and_the_spellings(value):
    with pytest.raises(ValueError, match=re.escape(f"HybridAdam: moments_dtype={value!r} is not "
                                                   f"a supported dtype; use one of float32")):
        parse_dtype("HybridAdam: ", "moments_dtype", value)


def test_choices_match_bools_only_by_identity_and_ints_by_type():
    assert check_bool("x.", "f", True) is True
    for bad in (1, 0, "true", None):
        with pytest.raises(ValueError, match=r"x.f=.* is not one of True, False; give a bool"):
            check_bool("x.", "f", bad)
    with pytest.raises(TypeError, match=r"x.f must be an int >= 1 \(threads\), got bool True"):
        check_int("x.", "f", True, unit="threads")


def test_unknown_keys_are_refused_naming_the_key_and_listing_the_valid_ones(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {moment_dtype: bf16}\n")
    with pytest.raises(ValueError) as err:
        from_yaml(path, {"optimizer": OptimizerConfig})
    msg = str(err.value)
    assert msg.startswith("unknown field(s) optimizer.moment_dtype; valid fields of optimizer: ")
    for field in ("moments_dtype", "state_tier", "grad_accumulation_steps", "placement"):
        assert field in msg
    with pytest.raises(ValueError, match=r"unknown section\(s\) optimiser; valid sections: "
                                         r"optimizer, store"):
        from_tree({"optimiser": {}}, {"optimizer": OptimizerConfig, "store": StoreConfig})
    with pytest.raises(ValueError, match=r"the config lacks 'store' \(sections: optimizer, "
                                         r"store\); fix: add it"):
        from_tree({"optimizer": {}}, {"optimizer": OptimizerConfig, "store": StoreConfig},
                  required=("store",))
    with pytest.raises(TypeError, match="section 'optimizer' must be a mapping of fields"):
        from_tree({"optimizer": [1]}, {"optimizer": OptimizerConfig})


def test_from_yaml_builds_every_section_with_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("store: {cpu_bytes: 1GiB}\noptimizer: {state_tier: split, "
                    "moments_dtype: bf16}\n")
    cfg = from_yaml(path, {"store": StoreConfig, "optimizer": OptimizerConfig,
                           "budgets": BudgetConfig}, ["optimizer.lr=0.5"])
    assert cfg["store"].cpu_bytes == 1 << 30
    assert (cfg["optimizer"].state_tier, cfg["optimizer"].moments_dtype,
            cfg["optimizer"].lr) == ("split", "bfloat16", 0.5)
    assert cfg["budgets"] == BudgetConfig() and cfg["budgets"].kwargs() == {}


def test_optimizer_kwargs_take_the_runtime_arguments_and_refuse_conflicts():
    store = object()
    kw = OptimizerConfig().kwargs(store=store, grad_accumulation_steps=3)
    assert kw["store"] is store and kw["grad_accumulation_steps"] == 3
    assert "grad_accumulation_steps" not in OptimizerConfig().kwargs()  # HybridAdam's default
    assert OptimizerConfig(grad_accumulation_steps=3).kwargs(grad_accumulation_steps=3)[
        "grad_accumulation_steps"] == 3
    with pytest.raises(ValueError, match=r"optimizer.grad_accumulation_steps=2 but the training "
                                         r"loop runs 4 .*fix: set it in one place"):
        OptimizerConfig(grad_accumulation_steps=2).kwargs(grad_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"optimizer.nvme_dir='/ssd' is for HybridAdam's private "
                                         r"store, but a store is given; fix: set store.nvme_dir"):
        OptimizerConfig(nvme_dir="/ssd").kwargs(store=store)


def test_optimizer_config_covers_every_hybrid_adam_argument():
    """Every HybridAdam argument but params and the runtime objects is a field."""
    from tiermem.optim import HybridAdam
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    runtime = {"params", "store", "process_group"}
    assert fields == set(inspect.signature(HybridAdam).parameters) - runtime


def _train_large():
    return load_example("train_large")


@pytest.mark.parametrize("preset", LARGE_PRESETS, ids=lambda p: p.stem)
def test_large_preset_loads_and_trains_a_tiny_model_with_its_hybrid_adam_kwargs(preset, tmp_path):
    """Each examples/configs/large preset goes through the config classes; the HybridAdam
    kwargs the example builds carry the preset's values, and a HybridAdam made from them trains
    a tiny model on the CPU (float32 moments: as torch's AdamW with clipping does)."""
    from tiermem import TierStore
    from tiermem.optim import HybridAdam
    assert len(LARGE_PRESETS) == 8  # 13b, 20b x2, 32b refused; 8b, 13b, 20b, 70b streamed
    example = _train_large()
    cfg = example.load(str(preset))
    raw = yaml.safe_load(preset.read_text())
    store = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes="40MiB", nvme_bytes="64MiB",
                                  nvme_dir=str(tmp_path), device="cpu", pool_slab_bytes="8MiB"))
    kw = example.optimizer_kwargs(cfg, store)
    o = raw["optimizer"]
    assert kw["store"] is store and kw["state_tier"] == o["state_tier"]
    assert o["state_tier"] in ("split", "cpu")  # h200_20b_ram keeps all state in RAM
    assert kw["grad_accumulation_steps"] == raw["train"]["grad_accumulation_steps"]
    assert kw["moments_dtype"] is {"float32": torch.float32,
                                   "bfloat16": torch.bfloat16}[o["moments_dtype"]]
    assert kw["betas"] == tuple(o["betas"])
    for name in ("lr", "offload_fraction", "chunk_numel", "max_grad_norm"):
        assert kw[name] == o[name], name
    assert set(kw) - {"store"} <= {f.name for f in dataclasses.fields(OptimizerConfig)}

    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    accum = kw["grad_accumulation_steps"]
    opt = HybridAdam(model.parameters(), **{**kw, "offload_fraction": 0.5})  # both sides used
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=kw["lr"], betas=kw["betas"],
                                  eps=kw["eps"], weight_decay=kw["weight_decay"], fused=True)
    for step in range(2):
        for m, o_ in ((model, opt), (ref, torch_opt)):
            for micro in range(accum):
                idx, tgt = make_batch(step * accum + micro)
                (m(idx, tgt)[1] / accum).backward()
            if o_ is torch_opt and kw["max_grad_norm"] is not None:  # 13b stream: none
                torch.nn.utils.clip_grad_norm_(ref.parameters(), kw["max_grad_norm"])
            o_.step()
            o_.zero_grad(set_to_none=True)
    # bf16 moments are rounded after each update: 1e-6 measured here, against updates of ~8e-4
    tol = 1e-6 if kw["moments_dtype"] is torch.float32 else 1e-5
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    opt.close()
    store.close()


def test_train_large_takes_dotted_overrides_last(capsys):
    """train_large.py takes train_gpt.py's ``section.field=value`` overrides (issue 27): they
    apply after the file, ``--tiny`` and the flags, and the plan sees them."""
    example = _train_large()
    preset = str(LARGE_PRESETS[0])
    cfg = example.load(preset, tiny=True, grad_accumulation_steps=3,
                       overrides=["model.n_layers=3", "optimizer.offload_fraction=0.25",
                                  "train.grad_accumulation_steps=5", "budgets.host_bytes=1TiB"])
    assert cfg["model"].n_layers == 3 and cfg["model"].d_model == 64  # --tiny, then n_layers
    assert cfg["optimizer"].offload_fraction == 0.25
    assert cfg["train"].grad_accumulation_steps == 5  # the override beats the flag
    assert cfg["budgets"].host_bytes == 1 << 40
    assert example.main(["--config", preset, "--dry-run", "train.micro_batch=3"]) == 0
    capsys.readouterr()
    assert example.main(["--config", preset, "optimizer.offload_fractoin=1"]) == 2
    assert "unknown field(s) optimizer.offload_fractoin" in capsys.readouterr().err


def test_streaming_staging_blocks_loads_checks_and_overrides(tmp_path):
    """``streaming.staging_blocks`` (Note [NVMe home]): null by default (a RAM host copy of
    every streamed weight), an int >= 1 with ``tier: nvme`` from YAML or a dotted override;
    a bad value or ``tier: cpu`` is a one-line error naming the field, the value and the fix."""
    assert StreamingConfig().staging_blocks is None
    path = tmp_path / "s.yaml"
    path.write_text("streaming: {enabled: true, tier: nvme, staging_blocks: 3}\n")
    assert from_yaml(str(path), {"streaming": StreamingConfig})["streaming"].staging_blocks == 3
    tree = apply_overrides({"streaming": {"tier": "nvme"}}, ["streaming.staging_blocks=4"])
    assert from_tree(tree, {"streaming": StreamingConfig})["streaming"].staging_blocks == 4
    for value, error, words in ((0, ValueError, "streaming.staging_blocks=0 must be an int >= 1"),
                                (True, TypeError, "got bool True"),
                                ("3", TypeError, "got str '3'"), (2.0, TypeError, "got float")):
        with pytest.raises(error, match=re.escape(words)) as info:
            StreamingConfig(tier="nvme", staging_blocks=value)
        assert "\n" not in str(info.value) and "prefetch_blocks + 2" in str(info.value)
    with pytest.raises(ValueError, match=r"^streaming\.staging_blocks=2 bounds the RAM staging "
                                         r".*streaming\.tier='cpu'.*fix: streaming\.tier=nvme, "
                                         r"or streaming\.staging_blocks=null$"):
        StreamingConfig(staging_blocks=2)


def test_train_large_refuses_staging_blocks_for_its_trained_weights(capsys):
    """train_large trains every streamed weight, and an NVMe-only home holds frozen weights
    only: ``streaming.staging_blocks`` is refused at load (naming what to use instead), from
    the preset's YAML path and from a dotted override alike; exit 2 on the command line."""
    example = _train_large()
    preset = str(ROOT / "examples" / "configs" / "large" / "h200_70b_stream_nvme.yaml")
    assert example.load(preset).get("streaming").staging_blocks is None
    with pytest.raises(ValueError, match=r"streaming\.staging_blocks=3: a home on NVMe only .*"
                                         r"holds frozen weights only.*fix: streaming\."
                                         r"staging_blocks=null .*train_lora\.py "
                                         r"--staging-blocks") as info:
        example.load(preset, overrides=["streaming.staging_blocks=3"])
    assert "\n" not in str(info.value)
    capsys.readouterr()
    assert example.main(["--config", preset, "--dry-run", "streaming.staging_blocks=3"]) == 2
    err = capsys.readouterr().err
    assert "streaming.staging_blocks=3" in err and "frozen weights only" in err
