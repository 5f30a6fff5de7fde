"""``tiermem bench optim`` on the CPU: one table, a parity verdict on every row, exit codes."""

import threading

import pytest
import torch

from tiermem.apps.bench import optim

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--steps", "2", "--grad-accumulation-steps", "1", "--layers", "1", "--d-model", "32",
        "--heads", "4", "--seq", "16", "--vocab", "64", "--batch", "2"]


def test_one_table_with_a_parity_verdict_per_row(capsys):
    assert optim.main(ARGS + ["--setups", "gpu,0.5,1.0+bf16", "--repeats", "2",
                                  "--max-grad-norm", "off"]) == 0
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
    assert optim.main(ARGS + ["--setups", "gpu,0.5", "--max-grad-norm", "off"]) == 1
    captured = capsys.readouterr()
    assert "WRONG" in next(r for r in captured.out.splitlines() if "f=0.5" in r)
    assert "did not train as the baseline" in captured.err


def test_bad_setup_exits_2(capsys):
    assert optim.main(ARGS + ["--setups", "gpu,1.5"]) == 2
    assert "'1.5' is not gpu, naive" in capsys.readouterr().err



def _speculating(opt, broken: bool = False):
    """Make a speculating HybridAdam's ``step()`` wait until a chunk was admitted (so a step
    that may speculate really does, whatever the scheduling); ``broken``: forget every restore,
    so a rolled-back chunk is stepped again from its speculated state (a broken rollback)."""
    spec = opt._spec
    admitted = threading.Event()
    admit, prepare, step = spec.admit, spec.prepare, opt.step

    def admit_and_tell(item):
        ok = admit(item)
        if ok:
            admitted.set()
        return ok

    def no_restore(item, blob):
        with spec._step.lock:
            spec._restore.discard(item)
        return prepare(item, blob)

    def step_after_an_admission(*a, **k):
        while spec.active and not spec._admitted:
            admitted.wait()  # a chunk is being stepped before the norm is known
            admitted.clear()
        return step(*a, **k)

    spec.admit = admit_and_tell
    if broken:
        spec.prepare = no_restore
    opt.step = step_after_an_admission
    return opt


def _rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if "HybridAdam" in line or "AdamW" in line]


def _patch(monkeypatch, broken: bool = False):
    real = optim._make_opt

    def make(name, model, *args):
        opt = real(name, model, *args)
        return _speculating(opt, broken) if getattr(opt, "_spec", None) and \
            opt._spec.enabled else opt
    monkeypatch.setattr(optim, "_make_opt", make)


def test_clip_rows_are_the_default_and_each_is_checked_against_adamw_clipped_alike(
        capsys, monkeypatch):
    _patch(monkeypatch)
    assert optim.main(ARGS + ["--setups", "gpu,0.5"]) == 0  # --clip off,1e6,1e-3 by default
    out = capsys.readouterr().out
    rows = _rows(out)
    assert len(rows) == 3 + 4 + 4, out  # off: gpu, again, f=0.5; per threshold: + wait, spec
    assert [r.split("  ")[0] for r in rows[3:7]] == [
        "CPU-only AdamW", "CPU-only AdamW again (noise)", "HybridAdam f=0.5 cpu",
        "HybridAdam f=0.5 cpu"], out
    assert "baseline" in rows[0] and "baseline" in rows[3] and "baseline" in rows[7], out
    assert all(("exact" in r or "equal" in r) for r in rows if "baseline" not in r), out
    assert " 1e6 wait " in rows[5] and " 1e6 spec " in rows[6], out
    assert " 1e-3 wait " in rows[9] and " 1e-3 spec " in rows[10], out
    spec_rb = {i: rows[i].split()[-2] if "exact" in rows[i] else rows[i].split()[-3]
               for i in (5, 6, 9, 10)}
    spec_rb = {i: tuple(int(n) for n in v.split("/")) for i, v in spec_rb.items()}
    assert spec_rb[5] == (0, 0) and spec_rb[9] == (0, 0), out  # waiting rows never speculate
    assert spec_rb[6][0] >= 2 and spec_rb[6][1] == 0, out  # 1e6: every step, none rolled back
    assert spec_rb[10][0] >= 1 and spec_rb[10][1] == spec_rb[10][0], out  # 1e-3: all rolled back
    assert "nan" not in out


def test_a_broken_rollback_is_reported_wrong_and_fails(capsys, monkeypatch):
    _patch(monkeypatch, broken=True)
    assert optim.main(ARGS + ["--setups", "gpu,0.5", "--max-grad-norm", "1e-3"]) == 1
    captured = capsys.readouterr()
    rows = _rows(captured.out)
    assert "WRONG" in next(r for r in rows if " 1e-3 spec " in r), captured.out
    assert "WRONG" not in next(r for r in rows if " 1e-3 wait " in r), captured.out
    assert "f=0.5 cpu clip 1e-3 spec" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["--max-grad-norm", "0"],
     "--max-grad-norm: '0' is not off or a positive finite max_grad_norm"),
    (["--max-grad-norm", "inf"], "--max-grad-norm: 'inf' is not off"),
    (["--max-grad-norm", "x"], "--max-grad-norm: 'x' is not off"),
    (["--rollback-bytes", "-1"], "--rollback-bytes"),
    (["--world", "2", "--max-grad-norm", "1e6"], "--max-grad-norm: not with --world > 1"),
])
def test_bad_clip_input_exits_2(capsys, argv, message):
    assert optim.main(ARGS + ["--setups", "gpu"] + argv) == 2
    assert message in capsys.readouterr().err


def test_clipped_rows_against_an_unclipped_baseline_would_be_wrong(capsys, monkeypatch):
    """Note [bench clip rows]: the reference of a clipped row must clip alike. With the AdamW
    baseline's clip_grad_norm_ made a no-op, the always-clipping HybridAdam rows differ from it
    beyond the noise bound: the parity column can tell a clipped step from an unclipped one."""
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: None)
    assert optim.main(ARGS + ["--setups", "gpu,0.5", "--max-grad-norm", "1e-3",
                              "--rollback-bytes", "0"]) == 1
    rows = _rows(capsys.readouterr().out)
    assert "WRONG" in next(r for r in rows if " 1e-3 wait " in r)
