"""tiermem demo: offloaded training matches the baseline bit for bit on the CPU (fp32)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tiermem import cli
from tiermem.demo import MarkovText, RunConfig, compare, main, run

TINY = ["--steps", "3", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16",
        "--vocab", "64", "--batch", "2", "--log-every", "1", "--no-progress"]


def loss_diff(out: str) -> float:
    m = re.search(r"max \|loss difference\| over \d+ steps: (\S+) \(tolerance", out)
    assert m, out
    return float(m.group(1))


def test_demo_matches_the_baseline_and_exits_0(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert loss_diff(out) < 1e-6
    assert ": OK" in out
    assert "device memory saved:" in out  # CPU: the device-tier footprint estimate
    assert re.search(r"\[offload\] step +1/3 +loss \d+\.\d+ +[\d,]+ tok/s +gpu .* cpu .* nvme", out)


def test_full_offload_with_state_on_nvme_is_exact(tmp_path, capsys):
    spill = tmp_path / "new" / "spill"  # missing: created as README and docs/quickstart.md say
    argv = TINY + ["--offload-fraction", "1.0", "--nvme-dir", str(spill),
                   "--nvme-activations", "store.io_chunk_bytes=64KiB", "store.io_backend=posix"]
    assert cli.main(["demo", *argv]) == 0
    out = capsys.readouterr().out
    assert loss_diff(out) < 1e-6
    assert "optimizer state 100% -> nvme" in out and "blocks -> nvme" in out
    assert f"created --nvme-dir directory {spill} (mode 0700)" in out
    assert spill.is_dir() and spill.stat().st_mode & 0o777 == 0o700


def test_demo_exits_1_when_the_losses_differ(monkeypatch, capsys):
    cfg = RunConfig.from_tree({"model": {"n_layers": 2, "d_model": 32, "n_heads": 2,
                                         "seq_len": 16, "vocab": 64},
                               "train": {"steps": 2, "micro_batch": 2, "progress": False,
                                         "log_every": 0}})
    off, base, cmp = run(cfg, log=lambda s: None)
    assert cmp.ok and cmp.max_loss_diff == 0.0
    base.losses = [x + 1e-3 for x in base.losses]
    bad = compare(off, base, 1e-6)
    assert not bad.ok and "FAILED" in bad.lines[-1]
    assert bad.max_loss_diff == pytest.approx(1e-3)
    import tiermem.demo
    monkeypatch.setattr(tiermem.demo, "run", lambda cfg: (off, base, bad))
    assert main(TINY) == 1


def test_gradient_accumulation_and_checkpointing_stay_exact():
    cfg = RunConfig.from_tree({
        "model": {"n_layers": 3, "d_model": 32, "n_heads": 2, "seq_len": 16, "vocab": 64},
        "train": {"steps": 2, "micro_batch": 2, "grad_accumulation_steps": 2,
                  "checkpoint": True, "progress": False, "log_every": 0},
        "optimizer": {"offload_fraction": 0.7, "chunk_numel": 1024, "overlap": False},
        "activations": {"num_layers": 2}})
    off, base, cmp = run(cfg, log=lambda s: None)
    assert cmp.max_loss_diff < 1e-6
    assert off.offloaded_activation_bytes > 0 and base.offloaded_activation_bytes == 0


@pytest.mark.parametrize("argv, message", [
    (["optimizer.offload_fraction=2"], "optimizer.offload_fraction=2 is outside [0.0, 1.0]"),
    (["optimizer.offload_fractoin=0.5"], "unknown field(s) optimizer.offload_fractoin"),
    (["--nvme-activations"], "--nvme-activations needs --nvme-dir"),
    (["--layers", "2", "activations.num_layers=2"], "activations.num_layers=2 must be < model.n_layers=2"),
])
def test_bad_usage_exits_2_naming_the_field(capsys, argv, message):
    assert main(TINY + argv) == 2
    assert message in capsys.readouterr().err


def test_markov_text_is_deterministic_and_learnable():
    data = MarkovText(64, branching=4, seed=3)
    a, b = data.batch(5, 2, 16), data.batch(5, 2, 16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(data.batch(6, 2, 16)[0], a[0])
    idx, tgt = a
    assert idx.shape == tgt.shape == (2, 16) and idx.is_contiguous() and tgt.is_contiguous()
    assert torch.equal(idx[:, 1:], tgt[:, :-1])
    # every transition is one of the token's successors
    assert all(int(t) in data.successors[int(s)].tolist()
               for s, t in zip(idx.flatten(), tgt.flatten()))
    assert 0 < data.entropy < math.log(4) < math.log(64)
    with pytest.raises(ValueError, match="branching=0 must be in"):
        MarkovText(64, branching=0)
