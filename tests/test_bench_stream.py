"""``tiermem bench stream`` on the CPU (a smoke run at a tiny shape): every row is timed and
checked against its reference; a streamed row fed one-step-stale weights is reported WRONG and
the command exits 1 (a fast wrong row cannot pass); bad input exits 2."""

from __future__ import annotations

import pytest

from tiermem.apps import cli
from tiermem.apps.bench import stream as bench

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
        "--vocab", "64", "--steps", "2", "--warmup", "1"]


def _rows(out: str) -> dict[str, str]:
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("setup "))
    return {name: ln for ln in lines[at + 1:] for name in (bench.BASELINE, bench.AGAIN,
            bench.HOST_REF, bench.STREAMED, bench.HYBRID_REF, bench.HYBRID_STREAMED)
            if ln.startswith(name + " ") and not (name == bench.BASELINE and "again" in ln)}


def test_smoke_every_row_with_its_parity(capsys, one_thread):
    assert cli.main(["bench", "stream", *TINY, "--micro-batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "micro_batches=2" in out and "repeats=3" in out
    rows = _rows(out)
    assert len(rows) == 6, out
    assert "PCIe floor ms" in out and "streamed GiB" in out
    assert rows[bench.STREAMED].endswith(f"exact vs {bench.HOST_REF}; exact vs "
                                         f"{bench.BASELINE}")
    assert f"exact vs {bench.HYBRID_REF}; " in rows[bench.HYBRID_STREAMED]
    for name in (bench.STREAMED, bench.HYBRID_STREAMED):
        cols = rows[name].split()
        assert float(cols[cols.index("exact") - 1]) >= 0.0  # the PCIe floor, a number


def stale_stream_maker(made):
    """``made`` (a bench's ``make_stream``) wrapped so that block 1 gets the weights of its
    previous fill: a stale buffer the parity column must report."""
    def stale_stream(model, store, args):
        stream = made(model, store, args)
        last: dict = {}

        def fault(block, p, src):
            old = last.get(p.key)
            last[p.key] = src.clone()
            return old if old is not None and block.index == 1 else src

        stream._fetcher.fault = fault
        return stream
    return stale_stream


def test_stale_streamed_weights_are_reported_wrong(capsys, monkeypatch, one_thread):
    monkeypatch.setattr(bench, "make_stream", stale_stream_maker(bench.make_stream))
    code = cli.main(["bench", "stream", *TINY, "--optimizers", "adamw", "--repeats", "1"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "WRONG" in _rows(out)[bench.STREAMED]
    assert f"did not train as their references: {bench.STREAMED}" in err


def test_nvme_home_smoke(capsys, tmp_path, one_thread):
    code = cli.main(["bench", "stream", *TINY, "--tier", "nvme", "--nvme-dir", str(tmp_path),
                     "--optimizers", "hybrid", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "tier=nvme" in out
    assert f"exact vs {bench.HYBRID_REF}; " in _rows(out)[bench.HYBRID_STREAMED]


@pytest.mark.parametrize("argv,message", [
    (["--tier", "nvme"], "--tier nvme needs --nvme-dir"),
    (["--optimizers", "sgd"], "--optimizers='sgd'"),
    (["--repeats", "0"], "--repeats=0 must be >= 1"),
    (["--gpu", "lots"], "--gpu='lots' is not a byte size"),
])
def test_bad_input_exits_2(capsys, argv, message):
    assert cli.main(["bench", "stream", *TINY, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra,block_major,calls", [
    ([], False, 3 * 2 + 2),                                   # auto at M=1: depth-first
    (["--schedule", "block-major"], True, 3 * 2 * 2 + 2),     # asked for: a recomputation
])
def test_one_micro_batch_streams_depth_first(capsys, monkeypatch, one_thread, extra,
                                             block_major, calls):
    """Note [bench stream schedule]: with one micro-batch the block-major schedule fills each
    block twice per step as depth-first does, and adds a forward of every block (its
    recomputation), which the resident rows do not run; so by default the streamed rows run
    depth-first then: each block's forward once per step (3 steps x 2 blocks, and one more for
    the final no-grad batch)."""
    made, seen, count = bench.make_stream, [], [0]
    real = bench.forward_backward

    def counting_stream(model, store, args):
        for block in model.blocks:
            block.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        return made(model, store, args)

    def spy(model, batches, **kw):
        seen.append(kw.get("block_major", False))
        return real(model, batches, **kw)

    monkeypatch.setattr(bench, "make_stream", counting_stream)
    monkeypatch.setattr(bench, "forward_backward", spy)
    assert cli.main(["bench", "stream", *TINY, "--optimizers", "adamw", "--repeats", "1",
                     *extra]) == 0
    out = capsys.readouterr().out
    assert f"schedule={'block-major' if block_major else 'depth-first'}" in out
    assert count[0] == calls
    assert seen and set(seen[-3:]) == {block_major}  # the streamed row's 3 steps
