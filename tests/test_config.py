"""tiermem.config: byte sizes, dotted overrides, YAML loading, section dataclasses and errors."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest
import torch

from tiermem.config import (ActivationConfig, OptimizerConfig, StoreConfig, TrainConfig,
                            apply_overrides, from_dict, load_config, parse_bytes)

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


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
    (OptimizerConfig, {"offload_fraction": 1.5}, ValueError, "optimizer.offload_fraction=1.5 is outside [0.0, 1.0]; the fraction of parameter bytes"),
    (OptimizerConfig, {"offload_fraction": "half"}, TypeError, "optimizer.offload_fraction must be a number"),
    (OptimizerConfig, {"betas": [0.9, 1.0]}, ValueError, "optimizer.betas[1]=1.0 must be < 1.0"),
    (OptimizerConfig, {"betas": [0.9]}, ValueError, "optimizer.betas=[0.9] must be two numbers"),
    (OptimizerConfig, {"state_tier": "disk"}, ValueError, "optimizer.state_tier='disk' is not one of"),
    (OptimizerConfig, {"chunk_numel": 10}, ValueError, "optimizer.chunk_numel=10 must be an int >= 1024 (elements); or null"),
    (OptimizerConfig, {"max_grad_norm": 0}, ValueError, "optimizer.max_grad_norm=0 must be > 0.0"),
    (OptimizerConfig, {"moments_dtype": "int8"}, ValueError, "optimizer.moments_dtype='int8'"),
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
])
def test_section_configs_reject_bad_values(cls, kwargs, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        cls(**kwargs)


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
                                GPTConfig) for f in dataclasses.fields(cls)}
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
