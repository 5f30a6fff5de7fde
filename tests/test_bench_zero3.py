"""examples/bench_zero3.py on the CPU: bad arguments exit 2 in one line; the table, the parity
verdicts, the exit status and the tiermem-over-ZeRO-3 line from fixed rows; a smoke run of the
rows that run without CUDA (resident AdamW and its noise row, tiermem streaming + HybridAdam),
the ZeRO-3 row reported as not available; a stale streamed weight is reported WRONG (exit 1)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tiermem.apps.bench import stream as bench_stream
from tiermem.apps.bench.optim_base import HP
from test_bench_stream import stale_stream_maker

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
        "--vocab", "64", "--steps", "8", "--warmup", "1", "--repeats", "2"]


@pytest.fixture(scope="module")
def bz():
    spec = importlib.util.spec_from_file_location("bench_zero3_example",
                                                  ROOT / "examples" / "bench_zero3.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _row(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith(name + "  "))


def _parity(out: str, name: str) -> str:
    """The row's last cell (cells are two spaces apart; a verdict holds single spaces)."""
    return _row(out, name).rsplit("  ", 1)[-1]


@pytest.mark.parametrize("argv,message", [
    (["--layers", "0"], "--layers=0 must be >= 1"),
    (["--repeats", "x"], "argument --repeats: invalid int value: 'x'"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--grad-clip", "-1"], "--grad-clip=-1.0 must be >= 0"),
    (["--budget-s", "0"], "--budget-s=0.0 must be > 0"),
    (["--gpu-bytes", "lots"], "'lots' is not a byte size"),
    (["--rollback-bytes", "-1"], "--rollback-bytes='-1' is not a byte size"),
])
def test_bad_arguments_exit_2_in_one_line(bz, capsys, argv, message):
    assert bz.main([*TINY, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("bench_zero3: error: "), err
    assert message in err


def _fixed(bz, zero3_losses, zero3_ms=40.0):
    base = [4.0, 3.9, 3.8]
    run = lambda ms, losses, peak=None: bz.Run([ms / 1e3] * 3, losses, peak)  # noqa: E731
    return [bz.Row(bz.BASELINE, [run(10.0, base, 2 << 30), run(12.0, base, 3 << 30)]),
            bz.Row(bz.AGAIN, [run(11.0, [4.0, 3.9, 3.8 + 1e-3])]),  # noise 1e-3
            bz.Row(bz.TIERMEM, [run(20.0, [4.0, 3.9 + 3e-3, 3.8])]),  # within 4 x 1e-3
            bz.Row(bz.ZERO3, [run(zero3_ms, zero3_losses)])]


def test_fixed_rows_table_verdicts_and_exit_status(bz):
    rows = _fixed(bz, [4.0, 3.9, 3.8 + 5e-3])  # 5e-3 > 4 x the noise: WRONG
    parity = bz.verdicts(rows)
    assert parity[bz.BASELINE] == "baseline"
    assert parity[bz.AGAIN] == "equal (d=1.0e-03)"
    assert parity[bz.TIERMEM] == "equal (d=3.0e-03)"
    assert parity[bz.ZERO3] == "WRONG (d=5.0e-03)"
    assert bz.exit_code(rows, parity) == 1
    text = bz.format_table(rows, 16384, parity)
    lines = text.splitlines()
    assert lines[0].split() == ["setup", "ms/step", "spread", "tokens/s", "peak", "GiB", "x",
                                "runs", "parity"]
    base = _row(text, bz.BASELINE).split()
    # median of the run medians 10 and 12 ms; 16384 tokens / 11 ms; peak the larger run's
    assert base[-7:] == ["11.0", "10.0-12.0", "1,489,455", "3.00", "1.00x", "2", "baseline"]
    assert _row(text, bz.ZERO3).split()[-8:-2] == ["40.0", "40.0-40.0", "409,600", "-",
                                                   "3.64x", "1"]
    assert lines[-1] == "tiermem over ZeRO-3: 2.00x tokens/s"
    ok = _fixed(bz, [4.0, 3.9 + 4e-3, 3.8])
    assert bz.exit_code(ok, bz.verdicts(ok)) == 0


def test_missing_zero3_row_is_named_and_not_a_failure(bz):
    rows = _fixed(bz, [])
    rows[-1] = bz.Row(bz.ZERO3, missing="not available: deepspeed not importable (x)")
    parity = bz.verdicts(rows)
    text = bz.format_table(rows, 32, parity)
    assert _row(text, bz.ZERO3).endswith("not available: deepspeed not importable (x)")
    assert text.splitlines()[-1] == ("tiermem over ZeRO-3: n/a (not available: deepspeed not "
                                     "importable (x))")
    assert bz.exit_code(rows, parity) == 0


def test_deepspeed_not_importable_is_one_reason(bz, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import raises ImportError
    module, why = bz.import_deepspeed()
    assert module is None and why.startswith("deepspeed not importable (ModuleNotFoundError")


def test_zero3_config_matches_the_other_rows(bz):
    args = bz.parse_args([*TINY, "--grad-accumulation-steps", "4", "--grad-clip", "0.5"])
    cfg = bz.zero3_config(args, torch.bfloat16)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"], cfg["gradient_clipping"]) == (2, 4, 8, 0.5)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and cfg["bf16"] == {"enabled": True}
    for key in ("offload_param", "offload_optimizer"):
        assert zero[key] == {"device": "cpu", "pin_memory": True}
    opt = cfg["optimizer"]
    assert opt["type"] == "AdamW" and opt["params"]["adam_w_mode"] is True
    assert not opt["params"]["torch_adam"]  # DeepSpeedCPUAdam
    assert {k: opt["params"][k] for k in ("lr", "eps", "weight_decay")} == {
        k: HP[k] for k in ("lr", "eps", "weight_decay")}
    assert tuple(opt["params"]["betas"]) == HP["betas"]


def _losses(err: str, name: str) -> list[str]:
    return [ln.split("losses ")[1].split(" (")[0] for ln in err.splitlines()
            if f" {name}: " in ln and "losses" in ln]


@pytest.mark.parametrize("extra", [[], ["--grad-accumulation-steps", "2", "--checkpoint"]])
def test_cpu_smoke_rows_equal_and_zero3_not_available(bz, capsys, one_thread, extra):
    # --grad-clip 1e-3 clips every step: the rows only agree if each clips as the baseline
    assert bz.main([*TINY, *extra, "--grad-clip", "1e-3"]) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint={'--checkpoint' in extra}" in out.splitlines()[0]
    assert _parity(out, bz.AGAIN) == "exact", out
    # HybridAdam's global norm is summed in another order: equal within the noise bound
    assert _parity(out, bz.TIERMEM).split(" ")[0] in ("exact", "equal"), out
    assert "not available: needs CUDA" in _row(out, bz.ZERO3)
    assert out.splitlines()[-1].startswith("tiermem over ZeRO-3: n/a (not available: ")
    clipped = _losses(err, bz.BASELINE)
    assert len(clipped) == 2 and len(clipped[0].split(", ")) == 8 + 1 + 1
    # the clip is real at this shape: without it the baseline trains otherwise
    assert bz.main([*TINY, *extra, "--grad-clip", "0", "--repeats", "1"]) == 0
    assert _losses(capsys.readouterr().err, bz.BASELINE)[0] != clipped[0]


def test_tiermem_row_without_the_clip_is_wrong(bz, capsys, monkeypatch, one_thread):
    import tiermem.optim

    real = tiermem.optim.HybridAdam

    def unclipped(*args, **kwargs):  # the factory's max_grad_norm dropped
        kwargs.pop("max_grad_norm")
        return real(*args, **kwargs)

    monkeypatch.setattr(tiermem.optim, "HybridAdam", unclipped)
    assert bz.main([*TINY, "--grad-clip", "1e-3", "--repeats", "1"]) == 1
    assert _parity(capsys.readouterr().out, bz.TIERMEM).startswith("WRONG (d=")


def test_stale_streamed_weights_are_wrong(bz, capsys, monkeypatch, one_thread):
    monkeypatch.setattr(bench_stream, "make_stream", stale_stream_maker(bench_stream.make_stream))
    assert bz.main([*TINY, "--repeats", "1"]) == 1
    assert _parity(capsys.readouterr().out, bz.TIERMEM).startswith("WRONG (d=")


@pytest.mark.parametrize("less", [0, 1])
def test_the_default_rollback_gives_every_chunk_a_slot(bz, one_thread, less):
    """``--rollback-bytes all``: ``every_chunk_rollback_bytes`` is the budget at which HybridAdam
    built as the tiermem row builds it (one group, ``offload_fraction=1``, the default
    ``chunk_numel``) holds a rollback slot for every chunk (Note [speculative step]); a byte
    less holds one slot fewer. Counted after clipped training steps of a 6-chunk model."""
    from tiermem.optim import HybridAdam
    from tiermem.optim.layout import chunk_state_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(5)])
    n = sum(p.numel() for p in model.parameters())
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, max_grad_norm=1e-3,
                     rollback_bytes=bz.every_chunk_rollback_bytes(n) - less)
    try:
        for _ in range(3):
            model(torch.randn(4, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            opt.synchronize()
        chunks = opt._groups[0].plan.chunks
        slot = chunk_state_bytes(max(c.numel for c in chunks), torch.float32)
        assert len(chunks) == 6
        assert opt.step_stats()["rollback_held_bytes"] == (len(chunks) - less) * slot
    finally:
        opt.close()


@pytest.mark.parametrize("flag", [[], ["--rollback-bytes", "1MiB"], ["--rollback-bytes", "0"]])
def test_tiermem_row_gets_rollback_bytes_and_prints_its_step_stats(bz, capsys, monkeypatch,
                                                                   one_thread, flag):
    """The tiermem row's HybridAdam gets ``--rollback-bytes`` (default ``all``: every chunk's
    state), the header names it, and each run's line gives HybridAdam's last step_stats (the
    worker's phases, the speculation) and spec/rb over the timed steps."""
    import tiermem.optim

    real, seen = tiermem.optim.HybridAdam, []

    def spy(params, **kwargs):
        params = list(params)
        seen.append((sum(p.numel() for p in params), kwargs["rollback_bytes"]))
        return real(params, **kwargs)

    monkeypatch.setattr(tiermem.optim, "HybridAdam", spy)
    assert bz.main([*TINY, *flag, "--grad-clip", "1e-3", "--repeats", "1", "--steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].endswith(f"rollback_bytes={flag[1] if flag else 'all'}")
    (n, got), = seen
    assert got == ({"1MiB": 1 << 20, "0": 0}[flag[1]] if flag else
                   bz.every_chunk_rollback_bytes(n))
    line = next(ln for ln in err.splitlines() if f" {bz.TIERMEM}: " in ln and "ms/step" in ln)
    for name in ("speculated_chunks", "rolled_back_chunks", "spec/rb", "grad_copy_s",
                 "write_back_s", "in_place_mib"):
        assert name in line, line
