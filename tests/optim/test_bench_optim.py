"""``tiermem bench optim`` on the CPU: one table, a parity verdict on every row, exit codes."""

import pytest

from tiermem.apps.bench import optim

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--steps", "2", "--accum", "1", "--layers", "1", "--d-model", "32", "--heads", "4",
        "--seq", "16", "--vocab", "64", "--batch", "2"]


def test_one_table_with_a_parity_verdict_per_row(capsys):
    assert optim.main(ARGS + ["--setups", "gpu,0.5,1.0+bf16", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens/step") == 1  # the table once (progress goes to stderr)
    rows = [line for line in out.splitlines() if "HybridAdam" in line or "AdamW" in line]
    assert len(rows) == 4, out
    assert "baseline" in rows[0] and "again (noise)" in rows[1]
    assert all(("exact" in r or "equal" in r) for r in rows[1:]), out
    assert "nan" not in out


def test_a_wrong_optimizer_is_reported_and_fails(capsys, monkeypatch):
    real = optim._make_opt

    def make(name, model, *args):
        opt = real(name, model, *args)
        if name != "0.5":
            return opt
        step = opt.step

        def wrong_step(*a, **k):  # drops one parameter's gradient: trains wrongly
            next(model.parameters()).grad = None
            return step(*a, **k)
        opt.step = wrong_step
        return opt

    monkeypatch.setattr(optim, "_make_opt", make)
    assert optim.main(ARGS + ["--setups", "gpu,0.5"]) == 1
    captured = capsys.readouterr()
    assert "WRONG" in next(r for r in captured.out.splitlines() if "f=0.5" in r)
    assert "did not train as the baseline" in captured.err


def test_bad_setup_exits_2(capsys):
    assert optim.main(ARGS + ["--setups", "gpu,1.5"]) == 2
    assert "'1.5' is not gpu, naive" in capsys.readouterr().err

