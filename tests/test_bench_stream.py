"""``tiermem bench stream`` on the CPU (a smoke run at a tiny shape): every row is timed and
checked against its reference, at each ``--max-grad-norm`` of the grid (default ``off,1.0``),
a clipped row against its reference clipped alike (Note [bench clip rows]); a streamed row fed
one-step-stale weights, or one that does not clip in the clipped block, is reported WRONG and
the command exits 1 (a fast wrong row cannot pass); bad input exits 2."""

from __future__ import annotations

import re

import pytest
import torch

from tiermem.apps import cli
from tiermem.apps.bench import stream as bench
from tiermem.apps.bench.parity import noise_of, verdict

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
        "--vocab", "64", "--steps", "2", "--warmup", "1"]
NAMES = (bench.BASELINE, bench.AGAIN, bench.HOST_REF, bench.STREAMED, bench.HYBRID_REF,
         bench.HYBRID_STREAMED)
ALWAYS = "1e-3"  # a max_grad_norm every step of TINY's model clips at (its grad norm is ~1)


def _rows(out: str) -> dict[tuple[str, str], dict[str, str]]:
    """The table's rows by (setup, clip), each its cells by column title (the columns are two
    or more spaces apart; a cell holds single spaces at most)."""
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("setup "))
    titles = re.split(r" {2,}", lines[at])
    rows = {}
    for ln in lines[at + 1:]:
        cells = re.split(r" {2,}", ln.strip())
        if cells[0] in NAMES:
            assert len(cells) == len(titles), ln
            rows[cells[0], cells[1]] = dict(zip(titles, cells))
    return rows


def test_smoke_every_row_at_each_clip_with_its_parity(capsys, one_thread):
    """The default grid, off and 1.0: every row at each, the streamed rows exact against their
    references clipped alike, ``spec/rb`` counted for the clipping HybridAdam rows only, a
    ratio line per optimizer and clip."""
    assert bench._parse_args([]).repeats == 3
    assert cli.main(["bench", "stream", *TINY, "--micro-batches", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "micro_batches=2" in out and "max_grad_norm=off,1.0 rollback_bytes=4294967296" in out
    rows = _rows(out)
    assert set(rows) == {(n, c) for n in NAMES for c in ("off", "1.0")}, out
    for clip in ("off", "1.0"):
        assert rows[bench.BASELINE, clip]["parity"] == "baseline"
        assert rows[bench.BASELINE, clip]["x"] == "1.00x"
        assert rows[bench.STREAMED, clip]["parity"] == (f"exact vs {bench.HOST_REF}; exact vs "
                                                        f"{bench.BASELINE}"), out
        assert rows[bench.HYBRID_STREAMED, clip]["parity"].startswith(
            f"exact vs {bench.HYBRID_REF}; "), out
        for name in (bench.STREAMED, bench.HYBRID_STREAMED):
            assert float(rows[name, clip]["PCIe floor ms"]) >= 0.0  # a number
        for name in NAMES:
            spec = rows[name, clip]["spec/rb"]
            if clip == "1.0" and name in (bench.HYBRID_REF, bench.HYBRID_STREAMED):
                assert re.fullmatch(r"\d+/\d+", spec), out
            else:
                assert spec == "-", out
            assert rows[name, clip]["vs off"] == "1.00x" if clip == "off" else \
                re.fullmatch(r"\d+\.\d\dx", rows[name, clip]["vs off"]), out
    for opt in ("AdamW", "HybridAdam"):
        for clip in ("off", "1.0"):
            assert re.search(rf"^streamed vs resident, {opt}, clip {clip}: \d+\.\d\dx step, "
                             rf"\d+\.\d\dx fwd\+bwd$", out, re.M), out


def test_clipped_rows_are_judged_against_the_baseline_clipped_alike(one_thread):
    """Note [bench clip rows]: clipping at ``ALWAYS`` changes the training, so against the
    unclipped baseline the clipped baseline is WRONG and the clipped resident HybridAdam
    "differs" (its trade): a clipped row judged against an unclipped reference would be
    flagged. Against the baseline clipped alike (what the bench does) every row is exact, and
    the HybridAdam rows, which clip on every step, roll back every chunk they speculated."""
    args = bench._parse_args([*TINY, "--max-grad-norm", f"off,{ALWAYS}", "--repeats", "1"])
    rows = {(r.setup, r.clip): r for r in bench.run(args, log=lambda line: None)}
    off = rows[bench.BASELINE, "off"].losses
    clipped = rows[bench.BASELINE, ALWAYS].losses
    noise = noise_of(clipped, rows[bench.AGAIN, ALWAYS].losses)
    assert verdict(clipped, off, noise).startswith("WRONG")
    assert verdict(rows[bench.HYBRID_REF, ALWAYS].losses, off, noise,
                   "HybridAdam's fp32 masters").startswith("differs")
    for name in NAMES[1:]:  # fp32 on the CPU: bit-exact but HybridAdam's own arithmetic
        if name != bench.HYBRID_REF:
            assert rows[name, ALWAYS].parity.startswith("exact vs "), rows[name, ALWAYS]
    hybrid = verdict(rows[bench.HYBRID_REF, ALWAYS].losses, clipped, noise,
                     "HybridAdam's fp32 masters")  # within the clipped block's own noise
    assert rows[bench.HYBRID_REF, ALWAYS].parity == f"{hybrid} vs {bench.BASELINE}"
    assert hybrid.startswith(("exact", "equal"))
    for name in (bench.HYBRID_REF, bench.HYBRID_STREAMED):
        speculated, rolled_back = rows[name, ALWAYS].spec
        assert speculated == rolled_back, rows[name, ALWAYS].spec
        assert rows[name, "off"].spec is None


@pytest.mark.parametrize("name,reference,optimizers", [
    (bench.STREAMED, bench.HOST_REF, "adamw"),
    (bench.HYBRID_STREAMED, bench.HYBRID_REF, "hybrid"),
])
def test_a_clipped_row_that_does_not_clip_is_reported_wrong(capsys, monkeypatch, one_thread,
                                                            name, reference, optimizers):
    """The streamed row of the clipped block trains unclipped (its unclipped setup swapped
    in): its losses are exactly the unclipped reference's, so judged against that it would
    pass; against its reference clipped alike it is WRONG and the command exits 1."""
    real_setups, real_run, rows = bench._setups, bench.run, []

    def lax(args, store, clip=None):
        unclipped = {s.name: s for s in real_setups(args, store, None)}
        return [unclipped[s.name] if s.name == name else s
                for s in real_setups(args, store, clip)]

    monkeypatch.setattr(bench, "_setups", lax)
    monkeypatch.setattr(bench, "run", lambda args, log: rows.extend(real_run(args, log)) or rows)
    code = cli.main(["bench", "stream", *TINY, "--optimizers", optimizers, "--repeats", "1",
                     "--max-grad-norm", f"off,{ALWAYS}"])
    out, err = capsys.readouterr()
    assert code == 1
    table = _rows(out)
    assert table[name, ALWAYS]["parity"].startswith("WRONG"), out
    assert table[name, "off"]["parity"].startswith("exact"), out
    assert f"their references (clipped alike): {name} (clip {ALWAYS})" in err
    by = {(r.setup, r.clip): r.losses for r in rows}
    assert by[name, ALWAYS] == by[reference, "off"]  # an unclipped reference: "exact"


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
    for clip in ("off", "1.0"):  # the default grid: stale weights are wrong at each clip
        assert _rows(out)[bench.STREAMED, clip]["parity"].startswith("WRONG"), out
    assert (f"did not train as their references (clipped alike): {bench.STREAMED} (clip off), "
            f"{bench.STREAMED} (clip 1.0)") in err


def test_nvme_home_smoke(capsys, tmp_path, one_thread):
    """The streamed weights' home on NVMe, HybridAdam clipping (and speculating) every step."""
    code = cli.main(["bench", "stream", *TINY, "--tier", "nvme", "--nvme-dir", str(tmp_path),
                     "--optimizers", "hybrid", "--repeats", "1", "--max-grad-norm", ALWAYS])
    out = capsys.readouterr().out
    assert code == 0 and "tier=nvme" in out
    row = _rows(out)[bench.HYBRID_STREAMED, ALWAYS]
    assert row["parity"].startswith(f"exact vs {bench.HYBRID_REF}; "), out
    assert row["vs off"] == "-", out  # no unclipped row to compare with


@pytest.mark.parametrize("argv,message", [
    (["--tier", "nvme"], "--tier nvme needs --nvme-dir"),
    (["--optimizers", "sgd"], "--optimizers='sgd'"),
    (["--repeats", "0"], "--repeats=0 must be >= 1"),
    (["--gpu", "lots"], "--gpu='lots' is not a byte size"),
    (["--max-grad-norm", "off,0"], "--max-grad-norm: '0' is not off or a positive finite "
                                   "max_grad_norm (e.g. --max-grad-norm off,1.0)"),
    (["--max-grad-norm", "inf"], "--max-grad-norm: 'inf' is not off"),
    (["--max-grad-norm", "one"], "--max-grad-norm: 'one' is not off"),
    (["--max-grad-norm", ","], "--max-grad-norm: ',' names no threshold (e.g. "
                               "--max-grad-norm off,1.0)"),
    (["--rollback-bytes", "-1"], "--rollback-bytes='-1' is not a byte size; write an integer"),
])
def test_bad_input_exits_2(capsys, argv, message):
    assert cli.main(["bench", "stream", *TINY, *argv]) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], errors  # one line


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
                     "--max-grad-norm", "off", *extra]) == 0
    out = capsys.readouterr().out
    assert f"schedule={'block-major' if block_major else 'depth-first'}" in out
    assert count[0] == calls
    assert seen and set(seen[-3:]) == {block_major}  # the streamed row's 3 steps


def test_hybrid_rows_print_the_workers_phases(capsys, one_thread):
    """Each HybridAdam row's run line names where its last step's worker time went (Note
    [worker phases] in tiermem/optim/chunk_worker.py: every name of ``WORKER_STATS``), the
    streamed gradients stepped in place or copied through the ring (Note [in-place host
    chunks]: none copied with the native kernel) and the step's speculation (Note [speculative
    step]): whether it speculated, its speculated and rolled-back chunks."""
    from tiermem.optim.cpu_adam import native_available

    assert cli.main(["bench", "stream", *TINY, "--optimizers", "hybrid", "--repeats", "1",
                     "--max-grad-norm", f"off,{ALWAYS}"]) == 0
    out = "\n".join(capsys.readouterr())  # the run lines go to stderr
    hybrid = (bench.HYBRID_REF, bench.HYBRID_STREAMED)
    lines = {(name, clip): ln for ln in out.splitlines() for name in hybrid
             for clip in ("off", ALWAYS) if ln.startswith(f"  {name}, clip {clip}: run 1/1")}
    assert set(lines) == {(n, c) for n in hybrid for c in ("off", ALWAYS)}, out
    for (name, clip), ln in lines.items():
        got = dict(re.findall(r"(\w+) (-?[\d.]+)", ln.split("last step: ")[1]))
        assert set(bench.WORKER_STATS) | {"in_place_mib", "ring_copy_mib", "speculating",
                                          "speculated_chunks", "rolled_back_chunks"} <= got.keys()
        if name == bench.HYBRID_STREAMED:
            assert float(got["in_place_mib"]) > 0, ln
            assert float(got["ring_copy_mib"]) == 0 or not native_available(), ln
        else:
            assert float(got["in_place_mib"]) == float(got["ring_copy_mib"]) == 0, ln
        if name == bench.HYBRID_STREAMED and clip == ALWAYS:  # Note [streamed gradient norms]
            assert int(got["norms_precomputed"]) > 0 and int(got["norms_computed"]) == 0, ln


def _run_lines(out: str) -> dict[str, str]:
    """Each setup's ``run 1/1`` line (clip off) by setup name."""
    return {name: ln for ln in out.splitlines() for name in NAMES
            if ln.startswith(f"  {name}, clip off: run 1/1")}


@pytest.mark.parametrize("schedule", ["depth-first", "block-major"])
def test_run_lines_print_pass_times_and_the_adders_seconds(capsys, one_thread, schedule):
    """Note [pass clock] and Note [adder seconds]: with 3 micro-batches, every row run
    depth-first prints ``pass_ms`` with one time per micro-batch (the resident rows always;
    a block-major streamed row has no passes of its own and prints none), and the streamed row
    the adder's seconds per timed step and the bytes it added: (3 - 1) micro-batches x the
    blocks' weight bytes per step (zero_grad(set_to_none=True): the first micro-batch is
    copied, the later ones added)."""
    m = 3
    argv = [*TINY, "--micro-batches", str(m), "--optimizers", "adamw", "--repeats", "1",
            "--max-grad-norm", "off", "--schedule", schedule]
    assert cli.main(["bench", "stream", *argv]) == 0
    lines = _run_lines("\n".join(capsys.readouterr()))
    assert set(lines) == {bench.BASELINE, bench.AGAIN, bench.HOST_REF, bench.STREAMED}, lines
    for name, ln in lines.items():
        got = re.search(r"pass_ms ([\d./]+)", ln)
        if name == bench.STREAMED and schedule == "block-major":
            assert got is None, ln
            continue
        assert got is not None, ln
        times = [float(x) for x in got.group(1).split("/")]
        assert len(times) == m and min(times) >= 0, ln
    ln = lines[bench.STREAMED]
    fields = dict(re.findall(r"(\w+) (-?[\d.]+)", ln.split("timed steps: ")[1]))
    assert set(bench.ADDER_STATS[:-1]) | {"added_mib"} <= fields.keys(), ln
    assert min(float(fields[k]) for k in bench.ADDER_STATS[:-1]) >= 0, ln
    assert float(fields["end_wait_s"]) <= float(fields["add_wait_s"]), ln
    args = bench._parse_args(argv)
    _, _, _, model, _ = bench.seeded_model(args, torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    if schedule == "depth-first":  # block-major accumulates on the device: nothing to add
        assert abs(float(fields["added_mib"]) - (m - 1) * weights / 2**20) < 1e-3, ln
    else:
        assert float(fields["added_mib"]) == 0, ln
