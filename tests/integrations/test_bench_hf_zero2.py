"""examples/bench_hf_trainer.py's ``Trainer + DeepSpeed ZeRO-2 (offload_optimizer cpu)`` row.

Without DeepSpeed (CI has none) the row says why it did not run and the exit status ignores it:
those tests always run. With DeepSpeed importable (``PYTHONPATH`` holding the wheels of .whl,
``pip install --no-deps --target``), the row runs on the CPU through DeepSpeed's CPU accelerator
and its cpu_adam op: its losses equal ``Trainer + AdamW``'s, and the parity column says ``NO``
when DeepSpeedCPUAdam runs in Adam (L2) mode (Note [bench hf ZeRO-2 optimizer]). Those tests
skip without DeepSpeed: the row is optional; the other rows' tests (test_hf_docs.py) still run.
"""

from __future__ import annotations

import os
import re
import sys

import accelerate.accelerator  # noqa: F401
import pytest
import torch
import transformers.trainer  # noqa: F401

# (both decide at import whether DeepSpeed is there: imported before any test hides it)
from test_hf_docs import TINY, _bench
from tiermem.apps.bench.deepspeed_env import import_deepspeed

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS8 = TINY + ["--steps", "6"]  # 2 warmup + 6 timed: 8 optimizer steps, every one clipped


def _row(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith(name + " "))


def test_zero2_row_not_run_without_deepspeed(monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises
    assert bench.main(TINY + ["--rows", "0,6", "--repeats", "1"]) == 0  # the row is optional
    out = capsys.readouterr().out
    line = _row(out, bench.ZERO2)
    assert line.endswith(")") and re.search(
        r"\(not run: deepspeed not importable: ModuleNotFoundError: .*deepspeed", line), out
    assert "0.00e+00  yes" in _row(out, "Trainer + AdamW")
    assert "runs per row: [1, 0]" in out


def test_zero2_row_not_run_when_cpu_adam_does_not_build(monkeypatch, capsys):
    bench = _bench()

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions\n(the build log)")

    monkeypatch.setattr(bench, "import_deepspeed", lambda: (object(), ""))
    monkeypatch.setattr(bench, "build_cpu_adam", no_compiler)
    assert bench.main(TINY + ["--rows", "0,6", "--repeats", "1"]) == 0
    line = _row(capsys.readouterr().out, bench.ZERO2)
    assert line.endswith("(not run: DeepSpeed's cpu_adam op did not build: RuntimeError: "
                         "Ninja is required to load C++ extensions)"), line


def test_a_row_past_its_tolerance_still_fails_beside_a_missing_zero2_row():
    bench = _bench()
    ref = [4.0, 3.9]
    rows = [bench.Row("Trainer + AdamW", [bench.Run([0.1], ref, None)]),
            bench.Row("past", [bench.Run([0.2], [4.0, 3.9005], None)]),
            bench.Row(bench.ZERO2, missing="not run: deepspeed not importable: x")]
    lines = bench.table(rows, 32)
    assert "NO (tol 4.0e-04)" in lines[2]
    assert lines[3] == f"{bench.ZERO2:<{bench.NAME_W}}  (not run: deepspeed not importable: x)"


@pytest.mark.parametrize("kind,autocast", [("cpu", False), ("cuda", True)])
def test_zero2_config(kind, autocast):
    cfg = _bench().zero2_config(torch.device(kind))
    assert cfg["zero_optimization"] == {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "train_batch_size", "gradient_clipping"):
        assert cfg[key] == "auto", key  # Trainer fills them from its own arguments
    # Note [bench hf ZeRO-2 precision]: bf16 autocast over fp32 weights, no bf16 section
    assert cfg["torch_autocast"] == {"enabled": autocast, "dtype": "bfloat16",
                                     "lower_precision_safe_modules": []}
    assert "bf16" not in cfg and "fp16" not in cfg
    # Note [bench hf ZeRO-2 optimizer]: Trainer's AdamW and schedule, not DeepSpeed's
    assert "optimizer" not in cfg and "scheduler" not in cfg


def _deepspeed():
    deepspeed, why = import_deepspeed()
    if deepspeed is None:
        pytest.skip(f"deepspeed not importable ({why}): the ZeRO-2 row is optional")
    return deepspeed


def test_zero2_row_equals_adamw_on_the_cpu(capsys):
    _deepspeed()
    bench = _bench()
    env = dict(os.environ)
    # two rounds: the second AdamW run comes after a ZeRO-2 run and must be the first's
    assert bench.main(STEPS8 + ["--rows", "0,6", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert dict(os.environ) == env  # no RANK, LOCAL_RANK, ACCELERATE_USE_DEEPSPEED left
    assert "DeepSpeedCPUAdam's op ready in" in out
    line = _row(out, bench.ZERO2)
    assert re.search(r"\d\.\d\de-\d\d  yes \(tol", line), out
    assert "runs per row: [2, 2]; AdamW's run-to-run max |dloss|: 0.00e+00" in out
    losses = re.findall(r"run \d " + re.escape(bench.ZERO2) + r": .* losses (.*) \(", out)
    assert len(losses) == 2 and len(losses[0].split(", ")) == 8


def _first_losses(out: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"run 1 (.*): .* losses ([\d.]+),", out)}


def test_zero2_row_autocast_is_trainer_bf16_on_the_cpu(monkeypatch, capsys):
    """Note [bench hf ZeRO-2 precision], on the CPU (CPU autocast has bf16 too): DeepSpeed's
    ``torch_autocast`` (the CUDA config) gives the first step's loss of Trainer's
    ``bf16=True``, to the printed digit, where fp32 differs in the fourth decimal."""
    _deepspeed()
    from transformers import TrainingArguments

    bench = _bench()
    real_config, real_init = bench.zero2_config, TrainingArguments.__init__

    def cuda_config(dev):
        return real_config(torch.device("cuda"))

    def bf16_init(self, *args, **kwargs):  # the other rows as on CUDA: bf16=True
        real_init(self, *args, **{**kwargs, "bf16": not kwargs.get("deepspeed")})

    monkeypatch.setattr(bench, "zero2_config", cuda_config)
    monkeypatch.setattr(TrainingArguments, "__init__", bf16_init)
    assert bench.main(STEPS8 + ["--rows", "0,6", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\d\.\d\de-\d\d  yes \(tol", _row(out, bench.ZERO2)), out
    first = _first_losses(out)
    assert first[bench.ZERO2] == first["Trainer + AdamW"] == "4.8724", first
    monkeypatch.undo()  # fp32 (the CPU rows as they are): another first loss
    assert bench.main(STEPS8 + ["--rows", "0,6", "--repeats", "1"]) == 0
    first = _first_losses(capsys.readouterr().out)
    assert first[bench.ZERO2] == first["Trainer + AdamW"] == "4.8727", first


def test_zero2_training_arguments_fill_the_autos():
    _deepspeed()
    bench = _bench()
    args = bench.argparse.Namespace(batch=2, lr=3e-4, warmup=2, steps=6)
    with bench.single_process_env():
        targs = bench.training_args(args, "unused", torch.device("cpu"), zero2=True)
        cfg = targs.hf_deepspeed_config.config
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"], cfg["gradient_clipping"]) == (2, 1, 2, 1.0)
    assert not targs.bf16 and targs.optim == "adamw_torch_fused"


def test_zero2_row_in_adam_mode_is_not_equal(monkeypatch, capsys):
    """The tolerance is not loose for this row: DeepSpeedCPUAdam in Adam (L2) mode, what
    Accelerate builds from any optimizer that is not a torch AdamW (Note [bench hf ZeRO-2
    optimizer]), is caught."""
    _deepspeed()
    import accelerate.accelerator

    real = accelerate.accelerator.map_pytorch_optim_to_deepspeed

    def as_adam(optimizer):  # Accelerate then passes adamw_mode=False
        optimizer.__class__ = torch.optim.Adam
        return real(optimizer)

    monkeypatch.setattr(accelerate.accelerator, "map_pytorch_optim_to_deepspeed", as_adam)
    bench = _bench()
    assert bench.main(STEPS8 + ["--rows", "0,6", "--repeats", "1"]) == 1
    assert re.search(r"\d\.\d\de-0[23]  NO \(tol 4\.9e-04\)", _row(capsys.readouterr().out,
                                                                 bench.ZERO2))
