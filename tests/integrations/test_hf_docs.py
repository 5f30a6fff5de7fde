"""docs/huggingface.md's runnable snippets (Trainer, Accelerate) run as written, and
examples/hf_trainer.py trains the stock Trainer and TiermemTrainer side by side and agrees."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

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


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hf_trainer",
                                                  ROOT / "examples" / "bench_hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4",
        "--kv-heads", "2", "--vocab", "128", "--seq", "16", "--batch", "2", "--steps", "1"]


def test_the_bench_script_runs_its_rows_on_the_cpu(capsys):
    """scripts/device_run.sh's bench_hf on a tiny Llama: every row runs, and on the CPU (one
    kernel for both optimizers) every row's losses equal the stock Trainer's (the optional
    DeepSpeed row: tests/integrations/test_bench_hf_zero2.py)."""
    assert _bench().main(TINY + ["--repeats", "1", "--rows", "0,1,2,3,4,5"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(Trainer \+ .*|plain loop \+ .*)$", out, re.M)
    assert len(rows) == 6 and all("0.00e+00  yes" in r for r in rows), out
    assert re.search(r"^Trainer.s step time over the plain loop.s: AdamW \d+\.\d\dx, "
                     r"HybridAdam f=1.0 \d+\.\d\dx, HybridAdam f=1.0 \+ act. offload \d", out, re.M)


def test_the_bench_equal_loss_column_says_no_past_its_tolerance():
    bench = _bench()
    ref = [4.0, 3.9]
    rows = [bench.Row("Trainer + AdamW", [bench.Run([0.1], ref, None),
                                          bench.Run([0.1], [4.0, 3.9001], None)]),
            bench.Row("within", [bench.Run([0.2], [4.0, 3.9004], None)]),
            bench.Row("past", [bench.Run([0.2], [4.0, 3.9005], None)])]
    lines = bench.table(rows, 32)  # tolerance: max(4 x 1e-4 noise, 1e-4 x 4.0) = 4e-4
    assert "yes (tol 4.0e-04)" in lines[2] and "NO (tol 4.0e-04)" in lines[3]
    assert bench.main(TINY + ["--warmup", "1"]) == 2
