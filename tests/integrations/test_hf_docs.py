"""docs/huggingface.md's runnable snippets (Trainer, Accelerate) run as written, and
examples/hf_trainer.py trains the stock Trainer and TiermemTrainer side by side and agrees."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


def _blocks():
    text = (ROOT / "docs" / "huggingface.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2, "docs/huggingface.md: the Trainer and the Accelerate ```python blocks"
    return blocks


def test_the_usage_snippet_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its output_dir
    exec(compile(_blocks()[0], "docs/huggingface.md", "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"\{'cpu': [1-9]\d*, 'nvme': 0\}", printed), printed


def test_the_accelerate_snippet_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its save_state directory
    exec(compile(_blocks()[1], "docs/huggingface.md", "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"grad norm \d+\.\d{3}, state \{'cpu': [1-9]\d*, 'nvme': 0\}", printed)
    assert (tmp_path / "acc-ckpt" / "optimizer.bin").is_file()


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example",
                                                  ROOT / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_agrees_with_the_stock_trainer(capsys):
    assert _example().main(["--steps", "4", "--activation-offload"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^step +[1-4]  loss \d+\.\d{6}  \(baseline \d+\.\d{6}\)$", out,
                          re.M)) == 4
    assert re.search(r"max \|loss difference\|: \S+ \(tolerance 1e-05\): OK", out)


def test_the_example_refuses_nvme_without_a_directory(capsys):
    assert _example().main(["--state-tier", "nvme"]) == 2
    assert "--state-tier nvme needs --nvme-dir" in capsys.readouterr().err
