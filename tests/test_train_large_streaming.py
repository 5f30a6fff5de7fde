"""examples/train_large.py's ``streaming`` section (issue 29): a tiny GPT trained with its
blocks' weights streamed equals, bit for bit, the same run without streaming (8 optimizer
steps, 2 micro-batches each, clipping, AdamW changing the weights every step), for the cpu and
nvme homes and both schedules; the section's overrides and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _examples import load_example
from tiermem.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
PRESET = str(ROOT / "examples" / "configs" / "large" / "h200_13b_nvme.yaml")


def _example():
    return load_example("train_large", "train_large_stream")


def _every_block_streamed_bytes(n_layers=4, prefetch=1) -> int:
    """GPU bytes that hold only the streaming buffers: every block streamed."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=n_layers, d_model=64, n_heads=4, seq_len=32, vocab=128))
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    return (prefetch + 2) * block


def _run(example, tmp_path, capsys, *extra, optimizer="torch"):
    losses: list = []
    argv = ["--config", PRESET, "--tiny", "--nvme-dir", str(tmp_path), "--steps", "8",
            "model.n_layers=4", f"streaming.optimizer={optimizer}", *extra]
    assert example.main(argv, record=losses) == 0, capsys.readouterr().err[-2000:]
    return losses, capsys.readouterr().out


@pytest.mark.parametrize("optimizer,tier,schedule", [
    ("torch", "cpu", "block-major"), ("torch", "nvme", "depth-first"),
    ("torch", "nvme", "block-major"),
    # HybridAdam (the preset's: all state offloaded, split RAM + NVMe, clipping at 1.0)
    ("hybrid", "cpu", "block-major"), ("hybrid", "nvme", "depth-first")])
def test_streamed_training_equals_the_unstreamed_run(tmp_path, capsys, one_thread, optimizer,
                                                     tier, schedule):
    example = _example()
    ref, _ = _run(example, tmp_path, capsys, "streaming.enabled=false", optimizer=optimizer)
    gpu = _every_block_streamed_bytes()
    out_losses, out = _run(example, tmp_path, capsys, "--streaming.enabled", "true",
                           f"--streaming.tier={tier}", "--streaming.schedule", schedule,
                           f"streaming.gpu_bytes={gpu}", optimizer=optimizer)
    assert "weights of 4 of 4 blocks streamed from " + tier in out
    assert "stream h2d" in out and " 0 fills" not in out
    assert len(ref) == 8 and all(len(step) == 2 for step in ref)  # 2 micro-batches a step
    assert len({tuple(step) for step in ref}) == 8  # the weights change every step
    assert out_losses == ref


def test_dotted_flags_are_overrides(tmp_path):
    example = _example()
    rest, over = example.split_dotted_flags(["--config", "x.yaml", "--streaming.tier", "nvme",
                                             "--streaming.enabled=true", "--tiny",
                                             "--nvme-dir", "d"])
    assert rest == ["--config", "x.yaml", "--tiny", "--nvme-dir", "d"]
    assert over == ["streaming.tier=nvme", "streaming.enabled=true"]
    with pytest.raises(ValueError, match="--streaming.tier needs a value"):
        example.split_dotted_flags(["--streaming.tier"])
    cfg = example.load(PRESET, overrides=over)
    assert cfg["streaming"].tier == "nvme" and cfg["streaming"].enabled is True


def test_gpu_flag_is_the_plans_capacity(capsys):
    example = _example()
    argv = ["--config", PRESET, "--dry-run", "--gpu", "24GiB", "streaming.enabled=true",
            "optimizer.offload_fraction=1.0", "optimizer.moments_dtype=bfloat16",
            "train.grad_accumulation_steps=1"]
    code = example.main(argv)
    out = capsys.readouterr().out
    assert "capacity                         24.0 GiB" in out, out[-3000:]
    assert "blocks streamed from" in out and code == 0


@pytest.mark.parametrize("override,message", [
    (["train.breadth_first_blocks=2"], "train.breadth_first_blocks=2 with streaming.enabled"),
    (["optimizer.gpu_step_fraction=0.5"], "optimizer.gpu_step_fraction=0.5 with streaming"),
    (["store.nvme_bytes=0", "streaming.tier=nvme"], "streaming.tier=nvme needs the store's"),
    (["streaming.tier=gpu"], "streaming.tier='gpu' is not one of 'cpu', 'nvme'"),
    (["streaming.optimizer=torch", "optimizer.moments_dtype=bfloat16"],
     "streaming.optimizer=torch keeps torch AdamW's moments"),
])
def test_streaming_refusals_are_one_line_exit_2(capsys, override, message):
    example = _example()
    code = example.main(["--config", PRESET, "--dry-run", "streaming.enabled=true", *override])
    lines = capsys.readouterr().err.strip().splitlines()
    # the refusal is one line, the last; a warning the tiermem logger printed before it (its
    # stderr handler exists once a CLI ran earlier in this process) is not part of it
    errors = [line for line in lines if not line.startswith("tiermem: warning:")]
    assert code == 2 and errors == lines[-1:] and message in lines[-1], lines


@pytest.mark.parametrize("preset,quoted", [
    ("h200_8b_stream_24gib", ["27 of 32 blocks streamed", "23.6 of 24.0 GiB of GPU",
                              "step 5.18 s", "to 5.63 s", "6,324 to 5,816 tokens/s"]),
    ("h200_13b_stream_24gib", ["28 of 40 blocks streamed", "22.9 of 24.0 GiB of GPU",
                               "step 36.90 s", "to 40.67 s", "55 to 50 tokens/s"]),
    ("h200_20b_stream_80gib", ["16 of 48 blocks streamed", "79.5 of 80.0 GiB of GPU",
                               "step 88.62 s", "to 94.30 s", "370 to 347 tokens/s"]),
])
def test_streamed_presets_fit_and_their_comments_quote_the_plan(preset, quoted):
    """The streamed presets plan as their comments say (a change to the planner must be
    carried into the comment), with the stream's resident blocks and home."""
    example = _example()
    path = ROOT / "examples" / "configs" / "large" / f"{preset}.yaml"
    pl = example.make_plan(example.load(str(path)))
    comment = " ".join(ln.lstrip("# ").strip() for ln in path.read_text().splitlines()
                       if ln.startswith("#"))
    for text in quoted:
        assert text in comment, text
    st = pl.step_time
    assert pl.fits and pl.stream is not None
    n_streamed = int(quoted[0].split()[0])
    assert len(pl.stream.streamed) == n_streamed
    gib = 2 ** 30
    assert f"{pl.used['gpu'] / gib:.1f} of" in comment
    floor = f"{st.overlapped_s:.2f} s" if st.overlapped_s < 100 else f"{st.overlapped_s:.0f} s"
    assert f"step {floor}" in comment
    assert f"{st.tokens_per_s_overlapped:,.0f} to {st.tokens_per_s_serial:,.0f} tokens/s" \
        in comment


def test_70b_nvme_preset_is_refused_for_the_host_copies_it_needs():
    """h200_70b_stream_nvme.yaml: trained weights streamed from NVMe keep a RAM host copy
    (Note [streamed RAM count]), so 125 GiB cannot hold the plan and it is refused naming the
    host side; at the 210 GiB its comment names it fits. The comment quotes the plan."""
    example = _example()
    path = ROOT / "examples" / "configs" / "large" / "h200_70b_stream_nvme.yaml"
    comment = " ".join(ln.lstrip("# ").strip() for ln in path.read_text().splitlines()
                       if ln.startswith("#"))
    gib = 2 ** 30
    pl = example.make_plan(example.load(str(path)))
    assert not pl.fits and [r[:10] for r in pl.reasons] == ["host needs"]
    assert len(pl.stream.streamed) == 60 and pl.stream.tier == "nvme"
    assert f"host needs {pl.used['host'] / gib:.1f} GiB of the 125 GiB" in comment
    params = next(i for i in pl.items if i.name == "parameters")
    assert params.host == pl.stream.streamed_bytes  # the host copies, beside the NVMe copy
    assert f"RAM host copy ({params.host / gib:.1f} GiB" in comment
    fits = example.make_plan(example.load(str(path), overrides=["budgets.host_bytes=210GiB"]))
    t = fits.step_time
    assert fits.fits
    assert f"predicted {t.overlapped_s:.0f} to {t.serial_s:.0f} s per step" in comment


def test_13b_stream_preset_is_the_plans_configuration():
    """h200_13b_stream_24gib.yaml is what `tiermem plan --model-size 13b --gpu-bytes 24GiB
    --moments-dtype bf16 --checkpoint` says to configure (its `note: configure:` and `note:
    stream:` lines), at the host figure the preset names, and its store holds the plan's state
    in RAM (weights, rings and NVMe staging first: the store replayed by ``HostPool``)."""
    from tiermem.apps.plan.cli import main as plan_main
    example = _example()
    path = ROOT / "examples" / "configs" / "large" / "h200_13b_stream_24gib.yaml"
    cfg = example.load(str(path))
    pl = example.make_plan(cfg)
    notes = [n for n in pl.notes if n.startswith(("configure:", "stream:"))]
    o, st, s = cfg["optimizer"], cfg["streaming"], cfg["store"]
    assert len(notes) == 2, pl.notes
    for text in notes[0].split()[1:]:  # configure: section.field=value ...
        key, value = text.split("=")
        section, name = key.split(".")
        if section == "activations":
            assert value == "false"  # train_large offloads no activations
            continue
        want = {"1": 1.0, "bfloat16": "bfloat16"}.get(value, value)
        assert getattr(cfg[section], name) == want, text
    assert (f"tier='{st.tier}', prefetch_blocks={st.prefetch_blocks}, "
            f"gpu_bytes={pl.stream.stream_gpu_bytes})") in notes[1]
    assert st.enabled and st.schedule == "block-major" and st.gpu_bytes is None
    assert o.max_grad_norm is None and cfg["train"].checkpoint  # the plan command's
    # the same plan from the CLI at the preset's host figure
    host = f"{cfg['budgets'].host_bytes // 2**30}GiB"
    assert cfg["budgets"].host_bytes == 112 * 2**30 and host in path.read_text()
    assert plan_main(["--model-size", "13b", "--gpu-bytes", "24GiB", "--host-bytes", host,
                      "--nvme-bytes", "60GiB", "--moments-dtype", "bf16", "--checkpoint"]) == 0
    assert example.make_plan(example.load(str(path))).used == pl.used
    # the store: RAM state chunks as the plan's (within one), replayed without touching memory
    from tiermem.optim.layout import GRAD_SLOTS, NVME_EXTRA_CHUNKS, OUT_SLOTS, chunk_state_bytes
    from tiermem.store.pool import HostPool
    with torch.device("meta"):
        model = GPT(cfg["model"])
    pool = HostPool(s.cpu_bytes, s.pool_slab_bytes, pin=False)
    for i in pl.stream.streamed:
        for p in model.blocks[i].parameters():
            assert pool.alloc(p.numel() * 2) is not None
    for slots in (GRAD_SLOTS, OUT_SLOTS):
        assert pool.alloc(slots * o.chunk_numel * 2) is not None
    chunk = chunk_state_bytes(o.chunk_numel, torch.bfloat16)
    for _ in range(o.nvme_lookahead_chunks + NVME_EXTRA_CHUNKS):
        assert pool.alloc(chunk) is not None
    ram = 0
    while pool.alloc(chunk) is not None:
        ram += 1
    chunks = -(-cfg["model"].num_params() // o.chunk_numel)
    planned_nvme = pl.used["nvme"] / chunk  # the plan counts bytes, the store whole GiB slabs
    assert 0 <= planned_nvme - (chunks - ram) <= 2, (ram, chunks, planned_nvme)


def test_13b_stream_preset_trains_scaled_down(tmp_path, capsys, one_thread):
    """h200_13b_stream_24gib.yaml's code path on the CPU, scaled down (--tiny: 6 blocks of width
    64, the preset's optimizer and streaming sections as they are): 4 blocks streamed from the
    store's RAM, the last 2 resident (as 28 + 12), one micro-batch a step, block-major, every
    block checkpointed, HybridAdam with all state offloaded, split between RAM and NVMe chunks,
    bf16 moments, no clipping; 8 steps, finite losses that change every step, bit-equal to the
    same run without streaming."""
    example = _example()
    path = str(ROOT / "examples" / "configs" / "large" / "h200_13b_stream_24gib.yaml")
    block = _every_block_streamed_bytes() // 3  # (prefetch 1 + 2) buffers of one fp32 block
    common = ["--config", path, "--tiny", "--nvme-dir", str(tmp_path), "--steps", "8",
              "model.n_layers=6", "train.grad_accumulation_steps=1"]
    outs, losses = [], []
    # 5 blocks' bytes: 3 buffers + the last 2 blocks (all 6 do not fit, so 4 stream)
    for extra in (["streaming.enabled=false"], [f"streaming.gpu_bytes={5 * block}"]):
        record: list = []
        assert example.main(common + extra, record=record) == 0, capsys.readouterr().err[-2000:]
        outs.append(capsys.readouterr().out)
        losses.append(record)
    ref, got = losses
    out = outs[1]
    assert "weights of 4 of 6 blocks streamed from cpu (2 resident" in out, out[-3000:]
    assert "block-major" in out and "stream h2d" in out and " 0 fills" not in out
    tiers = out.split("offloaded chunks per tier ")[1].splitlines()[0]
    assert "'nvme': 0" not in tiers and "'cpu': 0" not in tiers, tiers  # split RAM + NVMe
    flat = [x for step in got for x in step]
    assert len(got) == 8 and all(len(step) == 1 for step in got)
    assert all(torch.isfinite(torch.tensor(flat))) and len(set(flat)) == 8
    assert got == ref


@pytest.mark.cuda
@pytest.mark.parametrize("tier,schedule", [("cpu", "block-major"), ("nvme", "depth-first")])
def test_streamed_training_on_cuda_trains_as_unstreamed(tmp_path, capsys, tier, schedule):
    """On CUDA (torch's default kernels, fp32): the tiny preset with every block streamed and
    HybridAdam stepping the host copies, GPU capped by --gpu, trains as the unstreamed run
    within 4x that run's own run-to-run noise (tiermem.apps.bench.parity), and gives the process
    its whole GPU back (a cap left behind made the next test in the same xdist worker run out of
    memory at 8 GiB: docs/results/cuda_s17.log)."""
    from tiermem.apps.bench.parity import noise_of, verdict
    example = _example()
    cuda = ["train.device=cuda", "--gpu", "8GiB"]

    def flat(losses):
        return [x for step in losses for x in step]

    ref = [flat(_run(example, tmp_path, capsys, "streaming.enabled=false", *cuda,
                     optimizer="hybrid")[0]) for _ in range(2)]
    got, out = _run(example, tmp_path, capsys, "streaming.enabled=true",
                    f"streaming.tier={tier}", f"streaming.schedule={schedule}",
                    f"streaming.gpu_bytes={_every_block_streamed_bytes()}", *cuda,
                    optimizer="hybrid")
    assert "GPU capped at 8.0 GiB" in out and "weights of 4 of 4 blocks streamed" in out
    result = verdict(flat(got), ref[0], noise_of(ref[0], ref[1]))
    assert not result.startswith("WRONG"), result
    assert torch.cuda.get_per_process_memory_fraction(torch.cuda.current_device()) == 1.0
