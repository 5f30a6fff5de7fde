"""tiermem demo: offloaded training matches the baseline bit for bit on the CPU (fp32)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tiermem.apps import cli
from tiermem.apps.demo import MarkovText, RunConfig, compare, main, run

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
    import tiermem.apps.demo
    monkeypatch.setattr(tiermem.apps.demo, "run", lambda cfg: (off, base, bad))
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


# ------------------------------------------------- Note [run cost before building] (issue 27)

def _train_gpt():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_empty_config_on_the_cpu_is_refused_before_building(tmp_path, monkeypatch, capsys):
    """An empty --config got GPTConfig's 1.34B defaults and failed after 98 s of building with
    a HybridAdam error that never named the config: now the cost line and a one-line refusal
    naming the file and store.cpu_bytes come before anything is built."""
    import tiermem.apps.demo as demo
    if torch.cuda.is_available():
        pytest.skip("the CPU's defaults")

    def no_build(*a, **kw):
        raise AssertionError("the model was built")
    monkeypatch.setattr(demo, "build_model", no_build)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert _train_gpt().main(["--config", str(empty)]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"train_gpt: error: config file {str(empty)!r}: optimizer."
                               f"offload_fraction=0.5 of a 1,343.9M-param model (model.n_layers")
    assert "but store.cpu_bytes=4.0 GiB; fix: raise store.cpu_bytes" in lines[0]
    assert "cost: 1,343.9M params" in out and "16,384 tokens per step" in out
    assert "so GPTConfig's defaults: model.n_layers=24, model.d_model=2048" in out


def test_the_cost_line_comes_before_building_and_names_left_out_fields(tmp_path, monkeypatch):
    import tiermem.apps.demo as demo
    path = tmp_path / "two.yaml"
    path.write_text("model: {n_layers: 2}\ntrain: {device: cpu}\n")
    cfg = RunConfig.load(path, ["train.steps=3"])
    assert cfg.left_out == ("d_model", "n_heads", "seq_len", "vocab")
    assert cfg.origin == f"config file {str(path)!r} + 1 override"
    lines: list[str] = []

    def stop(*a, **kw):
        raise KeyboardInterrupt  # the test ends where training would start
    monkeypatch.setattr(demo, "train", stop)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, log=lines.append)
    cost = next(line for line in lines if line.startswith("cost: "))
    assert cost.startswith("cost: 236.0M params") and "16,384 tokens per step" in cost
    assert re.search(r"GFLOP/s of a 1024 x 1024 matmul on this CPU now: ~[\d.]+ (s|min|h) per "
                     r"step, ~[\d.]+ (s|min|h) for 3 steps x 2 runs", cost), cost
    assert "model.d_model=2048, model.n_heads=16, model.seq_len=2048, model.vocab=32000" in cost


def test_run_cost_bounds_are_lower_bounds_of_what_the_library_needs(tmp_path):
    """The refusals only refuse what cannot fit: a store one byte under the estimate of the
    offloaded state is refused by HybridAdam too; the host bound counts weights, gradients and
    Adam moments of the params a built model really has."""
    from tiermem.apps import run_cost
    from tiermem.models.gpt import GPT
    tree = {"model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 16, "vocab": 64},
            "train": {"steps": 1, "micro_batch": 2, "progress": False, "log_every": 0,
                      "device": "cpu", "baseline": False},
            "optimizer": {"offload_fraction": 1.0, "chunk_numel": 4096}}
    cfg = RunConfig.from_tree(tree)
    cost = run_cost.estimate(cfg)
    n = sum(p.numel() for p in GPT(cfg.model).parameters())
    assert cost.params == n and cost.host_bytes == 16 * n and cost.tokens_per_step == 32
    assert cost.offloaded_state_bytes == 12 * n
    run_cost.check(cfg, cost, "cpu", host_available=16 * n)  # fits exactly: no refusal
    tight = RunConfig.from_tree({**tree, "store": {"cpu_bytes": cost.offloaded_state_bytes - 1}},
                                "config file 'tight.yaml'")
    with pytest.raises(ValueError, match=r"^config file 'tight.yaml': optimizer.offload_fraction"
                                         r"=1 of a 0.\dM-param model puts at least .* but "
                                         r"store.cpu_bytes="):
        run_cost.check(tight, cost, "cpu", host_available=None)
    data = MarkovText(64)
    from tiermem.apps.demo import train
    with pytest.raises(ValueError, match="HybridAdam: the store's cpu tier has"):
        train(tight, offload=True, data=data, log=lambda s: None)
    with pytest.raises(ValueError, match=r"needs at least .* of host memory for weights, "
                                         r"gradients and Adam moments .* is available"):
        run_cost.check(cfg, cost, "cpu", host_available=16 * n - 1)
