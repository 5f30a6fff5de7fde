"""examples/train_gpt.py: YAML + dotted overrides, presets, errors, a short run."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest
import yaml

from tiermem.apps.demo import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
        "model.vocab=64", "train.steps=3", "train.micro_batch=2", "train.progress=false",
        "train.log_every=1"]


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_run_with_overrides_matches_the_baseline(train_gpt, capsys):
    assert train_gpt.main(TINY + ["optimizer.offload_fraction=1.0",
                                  "activations.num_layers=1"]) == 0
    out = capsys.readouterr().out
    assert "offload: optimizer state 100% -> cpu, activations 1 of 2 blocks -> cpu" in out
    m = re.search(r"max \|loss difference\| over 3 steps: (\S+) ", out)
    assert m and float(m.group(1)) < 1e-6
    assert len(re.findall(r"^\[offload\] step", out, re.M)) == 3


def test_nvme_spill_through_overrides(train_gpt, tmp_path, capsys):
    argv = TINY + ["optimizer.state_tier=nvme", "store.nvme_bytes=64MiB",
                   f"store.nvme_dir={tmp_path}", "store.io_chunk_bytes=64KiB",
                   "optimizer.chunk_numel=4096", "train.baseline=false"]
    assert train_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "max |loss difference|" not in out  # no baseline
    assert re.search(r"nvme [1-9][\d.]* [KM]iB", out)  # state bytes in the nvme tier


def test_print_config_applies_yaml_then_overrides(train_gpt, capsys):
    assert train_gpt.main(["--print-config", "optimizer.offload_fraction=0.25",
                           "store.cpu_bytes=2GiB", "activations.num_layers=2"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["optimizer"]["offload_fraction"] == 0.25
    assert tree["store"]["cpu_bytes"] == 2 << 30
    assert tree["activations"]["num_layers"] == 2
    assert tree["model"]["d_model"] == 128  # from configs/cpu.yaml
    assert train_gpt.main(["--preset", "h200_1b", "--print-config"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["model"] == {"n_layers": 24, "d_model": 2048, "n_heads": 16, "seq_len": 2048,
                             "vocab": 32000, "mlp_ratio": 4}
    assert tree["train"]["micro_batch"] == 8 and tree["train"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("argv, message", [
    (["optimizer.offload_fractoin=0.5"],
     "unknown field(s) optimizer.offload_fractoin; valid fields of optimizer: "),
    (["optimiser.lr=1"], "unknown section(s) optimiser; valid sections: model, train, store"),
    (["optimizer=3"], "section 'optimizer' must be a mapping of fields, got int 3"),
    (["optimizer.offload_fraction"], "is not 'section.field=value'"),
    (["store.cpu_bytes=lots"], "StoreConfig.cpu_bytes='lots' is not a byte size"),
    (["optimizer.state_tier=nvme"], "store.nvme_bytes=0; set store.nvme_bytes"),
    (["--preset", "h100_1b"], "no preset 'h100_1b'; available: cpu, h200_13b, h200_1b, h200_7b"),
    (["--config", "/nonexistent.yaml"], "No such file"),
])
def test_bad_config_exits_2_with_a_message(train_gpt, capsys, argv, message):
    assert train_gpt.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_preset_parses(path):
    cfg = RunConfig.load(path)
    assert cfg.model.n_layers >= 2
    if path.stem.startswith("h200"):
        assert cfg.train.device == "cuda" and cfg.train.dtype == "bfloat16"
        assert cfg.model.seq_len == 2048 and cfg.model.vocab == 32000


def test_h200_presets_fit_the_plan():
    """Each H200 preset's placement is one `tiermem plan` accepts on the H200 defaults."""
    from tiermem.apps.plan import plan
    for path in CONFIGS:
        if not path.stem.startswith("h200"):
            continue
        cfg = RunConfig.load(path)
        act = cfg.activations
        k = (act.num_layers if act.num_layers is not None else cfg.model.n_layers - 1) \
            if act.enabled else 0
        p = plan(cfg.model.num_params(), n_layers=cfg.model.n_layers, d_model=cfg.model.d_model,
                 n_heads=cfg.model.n_heads, vocab=cfg.model.vocab, seq=cfg.seq_len,
                 batch=cfg.train.micro_batch, dtype="bf16",
                 offload_fraction=cfg.optimizer.offload_fraction,
                 state_tier=cfg.optimizer.state_tier, offload_layers=k)
        assert p.fits, (path.stem, p.reasons)


def test_readme_usage_snippet_runs(tmp_path):
    """The README's Python example runs as written (model, batches and the SSD path filled in)."""
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "/mnt/ssd" in snippet
    snippet = snippet.replace("/mnt/ssd", str(tmp_path))
    from tiermem.models.gpt import GPT, GPTConfig
    from tiermem.apps.demo import MarkovText
    model = GPT(GPTConfig(n_layers=17, d_model=16, n_heads=2, seq_len=8, vocab=32))
    data = MarkovText(32)
    namespace = {"model": model, "batches": [data.batch(i, 2, 8) for i in range(2)]}
    exec(compile(snippet, "README.md", "exec"), namespace)
    namespace["opt"].close()
    namespace["store"].close()


def test_readme_commands_match_ci():
    text = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install torch==2.13.0 && pip install -e . && tiermem demo" in text
    test_cmd = ('pip install torch==2.13.0 && pip install -e ".[test]" && '
                'python -m pytest -m "not cuda" -q -n 2 --dist loadgroup')
    assert test_cmd in text
    for part in ("pip install -q torch==2.13.0", 'pip install -q -e ".[test]"',
                 'python3 -m pytest -m "not cuda" -q -n 2 --dist loadgroup'):
        assert part in ci


def test_hf_model_example_matches_the_baseline_exactly(capsys):
    """examples/hf_model.py: a transformers Llama built from a config, activation offload +
    HybridAdam vs torch fused AdamW, on the CPU in fp32: identical losses, printed as a table.
    transformers is in the test extra (pyproject.toml), so CI runs this."""
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "hf_model.py"
    spec = importlib.util.spec_from_file_location("hf_model_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--steps", "4", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "max |loss difference|: 0 (tolerance 1e-06): OK" in out
    assert "store traffic per step: cpu->gpu" in out and "{" not in out  # no raw dict
    assert len(re.findall(r"^\[baseline\] step +[1-4]/4  loss \d+\.\d{6}  \(", out, re.M)) == 4
    assert len(re.findall(r"^\[tiermem\] step +[1-4]/4  loss (\d+\.\d{6})  \(baseline \1\)",
                          out, re.M)) == 4  # fp32 on the CPU: the same digits


@pytest.mark.parametrize("name", ["hf_model", "train_moe"])
def test_examples_print_each_step_as_it_finishes(monkeypatch, name):
    """train_moe.py was silent for 135 s and hf_model.py printed its per-step lines only at
    the end (issue 27): each step's line is logged before the next step's batch is drawn."""
    import argparse
    module = _load_example(name)
    drawn = [0]
    if name == "hf_model":
        pytest.importorskip("transformers")
        real = module.batches

        def counted(args, device):
            for ids in real(args, device):
                drawn[0] += 1
                yield ids
        monkeypatch.setattr(module, "batches", counted)
        args = argparse.Namespace(vocab=64, hidden=32, layers=2, heads=2, seq=8, batch=1,
                                  steps=3, offload_fraction=1.0)
        run = lambda log: module.train(args, module.torch.device("cpu"), True, log=log)
    else:
        class Counted(module.MarkovText):
            def batch(self, *a, **kw):
                drawn[0] += 1
                return super().batch(*a, **kw)
        monkeypatch.setattr(module, "MarkovText", Counted)
        args = argparse.Namespace(steps=3, batch=1, offload_fraction=1.0)
        cfg = module.MoEConfig(n_layers=2, d_model=32, n_heads=4, seq_len=8, vocab=64,
                               n_experts=4, top_k=2, d_expert=64)
        run = lambda log: module.train(args, cfg, True, log=log)
    seen: list[tuple[int, str]] = []
    run(lambda line: seen.append((drawn[0], line)))
    steps = [(n, line) for n, line in seen if " step " in line]
    assert [n for n, _ in steps] == [1, 2, 3], seen
    assert all(f"step {k + 1:>3}/3" in line for k, (_, line) in enumerate(steps))


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example",
                                                  ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="for machines without CUDA")
@pytest.mark.parametrize("name, argv", [("hf_model", ["--device", "cuda"]),
                                        ("train_lora", ["--preset", "7b", "--device", "cuda"]),
                                        ("train_lora", ["--device", "gpu"])])
def test_cuda_examples_refuse_a_missing_cuda_in_one_line(capsys, name, argv):
    """docs/lora.md's `train_lora.py --preset 7b --device cuda` and hf_model.py's --device cuda
    on a machine without CUDA: one line naming --device, exit 2, nothing built (issue 27)."""
    pytest.importorskip("transformers")
    assert _load_example(name).main(argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: --device="), err
    assert ("CUDA is not available" in lines[0]) == ("cuda" in argv) and out == ""
