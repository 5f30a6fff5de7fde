"""Issue 10 (CPU-testable parts): the split state tier, the per-step breakdown, meta-device
init, and the large-model example (tiny smoke run, plan-only dry runs)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import TinyGPT, make_batch
from _examples import load_example
from tiermem import StoreConfig, TierStore
from tiermem.optim.layout import GRAD_SLOTS, OUT_SLOTS
from tiermem.optim import HybridAdam

ROOT = Path(__file__).resolve().parents[1]
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CHUNK = 1024


def _train(model, opt, steps, accum=2):
    for step in range(steps):
        for micro in range(accum):
            idx, tgt = make_batch(step * accum + micro)
            _, loss = model(idx, tgt)
            (loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _split_store(tmp_path, ram_chunks):
    """A store whose cpu budget holds the buffers, the NVMe staging and ``ram_chunks`` chunks
    (+ most of a chunk: the slabs fragment)."""
    torch.manual_seed(0)
    chunk_bytes = 4 * 3 * CHUNK
    # the fp32 gradient and param-out rings (tiermem.optim.layout.GRAD_SLOTS, OUT_SLOTS)
    buffers = 4 * (GRAD_SLOTS + OUT_SLOTS) * CHUNK
    staging = chunk_bytes * (2 + 3)
    cpu = buffers + staging + ram_chunks * chunk_bytes + chunk_bytes - 4096  # slab slack
    return TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=cpu, nvme_bytes="8MiB",
                                 nvme_dir=str(tmp_path), device="cpu",
                                 pool_slab_bytes=chunk_bytes * 8))


@pytest.mark.parametrize("overlap", [True, False])
def test_split_tier_matches_adamw_and_keeps_the_last_stepped_chunks_in_ram(tmp_path, overlap):
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    store = _split_store(tmp_path, ram_chunks=10)
    opt = HybridAdam(model.parameters(), **HP, state_tier="split", store=store,
                     chunk_numel=CHUNK, grad_accumulation_steps=2, overlap=overlap)
    torch_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    g = opt._groups[0]
    n_chunks = len(g.plan.chunks)
    # the budget holds about 10 chunks (how many exactly depends on how the pool's slabs
    # fragment; without overlap the small last chunk is stepped last, so it gets RAM first)
    n_ram = opt.chunk_tiers()["cpu"]
    assert 9 <= n_ram <= 11 and opt.chunk_tiers()["nvme"] == n_chunks - n_ram
    # RAM holds the chunks stepped last: the first layers with overlap, the last without
    ram = list(range(n_ram)) if overlap else list(range(n_chunks - n_ram, n_chunks))
    nvme = [c for c in range(n_chunks) if c not in ram]
    assert sorted(c for gi, c in opt._layout.nvme_chunks) == nvme

    def check_tiers():
        tiers = [store.tier_of(k) for k in g.chunk_keys]
        assert all(tiers[c] == "cpu" for c in ram)
        # NVMe chunks are in NVMe, except the ones read ahead for the next step
        assert sum(tiers[c] == "nvme" for c in nvme) >= len(nvme) - 2 * opt.nvme_lookahead_chunks
    check_tiers()
    _train(model, opt, 3)
    _train(ref, torch_opt, 3)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    check_tiers()  # the placement is static
    st = opt.step_stats()
    n_nvme = n_chunks - n_ram
    chunk_bytes = 4 * 3 * CHUNK
    assert st["chunks"] == n_chunks
    # each NVMe chunk is read and written about once per step (the last chunk is smaller; a
    # read-ahead chunk may be demoted and re-read under the tight staging budget); RAM chunks
    # cause no NVMe traffic at all
    for name in ("nvme_read_bytes", "nvme_write_bytes"):
        assert (n_nvme - 1) * chunk_bytes <= st[name] <= (n_nvme + 5) * chunk_bytes, (name, st)
    # state dict round trip works with both kinds of chunks
    sd = opt.state_dict()
    ref_sd = torch_opt.state_dict()
    for i, s in sd["state"].items():
        torch.testing.assert_close(s["exp_avg"], ref_sd["state"][i]["exp_avg"])
    check_tiers()
    opt.close()
    store.close()


def test_split_needs_a_store_with_nvme(tmp_path):
    with pytest.raises(ValueError, match="split"):
        HybridAdam(TinyGPT().parameters(), state_tier="split")


def test_step_stats_are_consistent_and_reset_each_step(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    n = sum(p.numel() for p in model.parameters())
    opt = HybridAdam(model.parameters(), **HP, state_tier="nvme", nvme_dir=str(tmp_path),
                     chunk_numel=CHUNK, offload_fraction=1.0)
    assert opt.step_stats()["chunks"] == 0
    for step in range(2):
        _train(model, opt, 1, accum=1)
        st = opt.step_stats()
        assert st["d2h_bytes"] == st["h2d_bytes"] == 4 * n  # every offloaded element, once
        assert st["chunks"] == len(opt._groups[0].plan.chunks)
        assert 0 < st["cpu_adam_s"] and 0 <= st["stall_s"] <= st["step_s"]
        state_bytes = 12 * n
        assert state_bytes <= st["nvme_write_bytes"] <= state_bytes + 4096 * st["chunks"]
        assert st["nvme_read_bytes"] == st["nvme_write_bytes"]
    opt.close()


# ---------------------------------------------------------------- meta init

def _small_gpt_cfg():
    from tiermem.models.gpt import GPTConfig
    return GPTConfig(n_layers=3, d_model=32, n_heads=4, seq_len=16, vocab=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_materialize_matches_eager_init_bit_for_bit(dtype, monkeypatch):
    from tiermem.models.gpt import GPT
    from tiermem.models import init as init_mod
    from tiermem.models import materialize_
    cfg = _small_gpt_cfg()
    torch.manual_seed(1)
    eager = GPT(cfg).to(dtype=dtype)
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    sizes = []
    real_empty = torch.empty

    def counting_empty(*a, **kw):
        t = real_empty(*a, **kw)
        sizes.append(t.numel())
        return t
    monkeypatch.setattr(init_mod.torch, "empty", counting_empty)
    torch.manual_seed(1)
    materialize_(model, "cpu", dtype)
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert a.dtype == dtype and a.device.type == "cpu" and not a.is_meta, name
        assert torch.equal(a, b), name
    # fp32 scratch: one tensor at a time, never more than the biggest single module's
    biggest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in eager.modules())
    assert max(sizes) <= biggest and sum(sizes) == sum(p.numel() for p in eager.parameters())
    idx, tgt = make_batch(0, seq_len=16, vocab=64)
    torch.testing.assert_close(model(idx, tgt)[1], eager(idx, tgt)[1])


def test_materialize_needs_an_init_for_custom_modules():
    from tiermem.models import materialize_

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match="reset_parameters"):
        materialize_(m, "cpu")
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale())
    materialize_(m, "cpu", torch.bfloat16,
                 init_fn=lambda mod: mod.w.fill_(2.0) if isinstance(mod, Scale) else None)
    assert torch.equal(m[1].w, torch.full((4,), 2.0, dtype=torch.bfloat16))


# ---------------------------------------------------------------- examples/train_large.py

def _run_example(*args, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train_large.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_train_large_tiny_runs_two_steps_on_cpu(tmp_path):
    r = _run_example("--config", str(ROOT / "examples/configs/large/h200_13b_nvme.yaml"), "--tiny",
                     "--nvme-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2 and "model TFLOP/s" in lines[0] and "nvme r/w" in lines[0]
    tiers = next(ln for ln in r.stdout.splitlines() if "chunks per tier" in ln)
    assert "'nvme': 0" not in tiers and "'cpu': 0" not in tiers, tiers  # split
    # after the steps, one block: the measured split of a step beside the plan's prediction
    out = r.stdout.splitlines()
    at = next(i for i, ln in enumerate(out) if ln.startswith("train_large: one optimizer step"))
    assert "of 128 tokens, measured (median of step 1) and predicted by the plan" in out[at]
    block = out[at + 1:at + 14]
    assert block[0].split() == ["measured", "predicted"]
    for row in ("step", "tokens/s", "GPU fwd+bwd (wall)", "fwd+bwd wall", "optimizer step wall",
                "of which stall", "CPU Adam (kernel, summed)", "PCIe", "D2H + H2D", "NVMe",
                "read + write"):
        assert any(ln.strip().startswith(row) for ln in block), row
    assert out[at + 13].startswith("train_large: done")


def test_train_large_step_lines_report_the_clip_speculation():
    """Issue 30: with optimizer.rollback_bytes the 20B RAM preset (which clips) reports on each
    step line the chunks speculated and rolled back and the RAM held (Note [speculative step])."""
    r = _run_example("--config", str(ROOT / "examples/configs/large/h200_20b_ram.yaml"), "--tiny",
                     "--steps", "3", "optimizer.rollback_bytes=64MiB")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3 and lines[0].endswith("| spec off")  # step 0 records the order
    for line in lines[1:]:
        assert re.search(r"\| spec [1-9]\d* chunks, \d+ rolled back, [0-9.]+ GB held$",
                         line), line
    # no budget: every step line says so
    r = _run_example("--config", str(ROOT / "examples/configs/large/h200_20b_ram.yaml"), "--tiny",
                     "--steps", "2", "optimizer.rollback_bytes=0")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2 and all(ln.endswith("| spec off") for ln in lines), lines


def test_the_speculation_text_of_a_step_line():
    """examples/train_large.py's step-line part: off, speculating (with the GPU lane's share of
    the bytes held), paused by the switch (Note [speculation switch])."""
    text = _train_large_module().speculation_text
    assert text({}) == text({"rollback_held_bytes": 0, "speculating": 0}) == "spec off"
    st = {"rollback_held_bytes": 3_000_000_000, "rollback_gpu_bytes": 1_000_000_000,
          "speculating": 1, "speculated_chunks": 21, "rolled_back_chunks": 2}
    assert text(st) == "spec 21 chunks, 2 rolled back, 3.00 GB held (1.00 on the GPU)"
    st.update(speculating=0, speculated_chunks=0, rolled_back_chunks=0, rollback_gpu_bytes=0)
    assert text(st) == "spec paused (recent steps clipped): 0 chunks, 0 rolled back, 3.00 GB held"


def test_train_large_dry_runs_fit_and_a_30b_fails_early(tmp_path):
    r = _run_example("--config", str(ROOT / "examples/configs/large/h200_13b_nvme.yaml"), "--dry-run")
    assert r.returncode == 0 and "FITS" in r.stdout, r.stdout + r.stderr
    big = tmp_path / "h200_30b.yaml"
    text = (ROOT / "examples/configs/large/h200_13b_nvme.yaml").read_text()
    big.write_text(text.replace("n_layers: 40, d_model: 5120, n_heads: 40",
                                "n_layers: 60, d_model: 6144, n_heads: 48"))
    r = _run_example("--config", str(big), "--dry-run")
    assert r.returncode == 1 and "does not fit" in r.stderr, r.stdout + r.stderr


def _train_large_module():
    return load_example("train_large", "train_large_example")


@pytest.mark.parametrize("preset", ["h200_13b_nvme", "h200_20b_bf16"])
def test_large_presets_accumulate_the_batch_from_which_the_gpu_bounds_the_step(preset):
    """Issue 19: each runnable preset accumulates exactly the least micro-batches from which its
    plan predicts the GPU's time exceeds the optimizer's (``gpu_bound_grad_accumulation_steps``);
    one fewer has another resource's time the largest (NVMe). Equality on purpose: a change to the
    planner's rates moves that batch, and the preset, with its device-stage time estimate (the
    YAML's comment), should then be re-decided. With max_grad_norm the optimizer phase overlaps
    no backward, so there the GPU computes only about half the floor step."""
    module = _train_large_module()
    path = str(ROOT / "examples" / "configs" / "large" / f"{preset}.yaml")
    cfg = module.load(path)
    accum = cfg["train"].grad_accumulation_steps
    pl = module.make_plan(cfg)
    assert pl.fits and pl.step_time.bound == "gpu"
    assert accum == pl.step_time.gpu_bound_grad_accumulation_steps > 4
    assert pl.step_time.max_grad_norm == cfg["optimizer"].max_grad_norm == 1.0
    assert pl.step_time.overlap_window_s == 0
    assert 0.5 <= pl.step_time.gpu_share_of_floor < 0.55
    fewer = module.make_plan(module.load(path, grad_accumulation_steps=accum - 1))
    assert fewer.step_time.bound != "gpu"


def _comment(path) -> str:
    """A preset's leading comment, its lines joined."""
    lines = Path(path).read_text().splitlines()
    return " ".join(ln.lstrip("# ").strip() for ln in lines if ln.startswith("#"))


@pytest.mark.parametrize("preset", ["h200_13b_nvme", "h200_20b_bf16", "h200_20b_ram"])
def test_preset_comments_quote_the_plans_predictions(preset):
    """The preset's comment quotes what make_plan predicts now: the floor with its two terms,
    the GPU's share of it, the ceiling (and for the 20B RAM preset the tokens/s and the lane's
    range; for the 20B split preset issue 19's 16 and 64 micro-batches)."""
    module = _train_large_module()
    path = ROOT / "examples" / "configs" / "large" / f"{preset}.yaml"
    text = _comment(path)
    st = module.make_plan(module.load(str(path))).step_time
    tail = {"nvme": "NVMe", "cpu_adam": "CPU Adam"}[max(
        ("pcie", "cpu_adam", "nvme"), key=lambda k: st.seconds[k])]
    assert (f"{st.overlapped_s:.1f} s (floor: GPU {st.seconds['gpu']:.1f} s + {tail} "
            f"{st.optimizer_tail_s:.1f} s; the GPU {100 * st.gpu_share_of_floor:.0f} % of it) to "
            f"{st.serial_s:.1f} s (ceiling") in text, (preset, st)
    if preset == "h200_20b_ram":
        lane = module.make_plan(module.load(str(path), gpu_step_fraction=0.5)).step_time
        assert (f"{st.tokens_per_s_overlapped / 1e3:.1f}k to {st.tokens_per_s_serial / 1e3:.1f}k "
                f"tokens/s ({lane.overlapped_s:.1f} s to {lane.serial_s:.1f} s with "
                f"--gpu-step-fraction 0.5)") in text
    if preset == "h200_20b_bf16":
        a, b = (module.make_plan(module.load(str(path), grad_accumulation_steps=g)).step_time
                for g in (16, 64))
        assert a.bound == "nvme" and b.bound == "gpu"
        assert (f"(predicted {a.overlapped_s:.1f}-{a.serial_s:.1f} s with NVMe the largest term, "
                f"and {b.overlapped_s:.1f}-{b.serial_s:.1f} s with the GPU's, floor to ceiling, "
                f"per step)") in text


def test_train_large_takes_the_accumulation_from_the_command_line(capsys):
    """--grad-accumulation-steps replaces train.grad_accumulation_steps (the plan's tokens per
    step follow); a bad count is refused with exit 2 and one line naming the field."""
    module = _train_large_module()
    cfg = str(ROOT / "examples" / "configs" / "large" / "h200_20b_bf16.yaml")
    assert module.main(["--config", cfg, "--dry-run", "--grad-accumulation-steps", "64"]) == 0
    assert "131,072 tokens = 1 x 2048 x 64 accumulated" in capsys.readouterr().out
    assert module.main(["--config", cfg, "--dry-run", "--grad-accumulation-steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "grad_accumulation_steps=0" in err, err


def test_the_20b_ram_preset_keeps_all_state_off_the_disk_and_the_gpu_bounds_it():
    """Issue 19, lever (a): with HybridAdam's GPU side in bf16 moments (8 B/param), the 20B
    preset h200_20b_ram.yaml holds 26 % of the state on the GPU and the rest in pinned RAM: its
    plan fits with nothing on NVMe, accumulates issue 19's 32k tokens (16 x 2048), at or above
    the least batch from which the plan predicts the GPU's time exceeds the optimizer's, with GPU
    room to spare beyond the plan's reserve when depth-first, which breadth_first_blocks auto
    fills with the most blocks that fit (Note [breadth-first blocks])."""
    module = _train_large_module()
    path = str(ROOT / "examples" / "configs" / "large" / "h200_20b_ram.yaml")
    cfg = module.load(path)
    assert cfg["optimizer"].state_tier == "cpu" and cfg["optimizer"].moments_dtype == "bfloat16"
    pl = module.make_plan(cfg)
    assert pl.fits and pl.step_time.bound == "gpu" and pl.step_time.tokens == 32768
    assert cfg["train"].grad_accumulation_steps >= pl.step_time.gpu_bound_grad_accumulation_steps
    assert pl.step_time.seconds.get("nvme", 0.0) == 0.0
    depth_first = module.make_plan(module.load(path, breadth_first_blocks=0))
    assert depth_first.capacity["gpu"] - depth_first.used["gpu"] >= 4 << 30
    k = pl.breadth_first_blocks
    assert cfg["train"].breadth_first_blocks == "auto" and k > 0
    assert not module.make_plan(module.load(path, breadth_first_blocks=k + 1)).fits
    assert pl.step_time.overlapped_s < depth_first.step_time.overlapped_s
    assert pl.step_time.serial_s == depth_first.step_time.serial_s
    # the same model with the older placement (85 % offloaded, split) streams state through NVMe
    old = module.make_plan(module.load(str(ROOT / "examples" / "configs" / "large" /
                                           "h200_20b_bf16.yaml"), grad_accumulation_steps=16))
    assert old.step_time.seconds["nvme"] > 0 and old.step_time.serial_s > pl.step_time.serial_s
    assert old.step_time.overlapped_s > pl.step_time.overlapped_s


def test_train_large_takes_the_gpu_step_fraction_from_the_command_line(capsys):
    """--gpu-step-fraction replaces optimizer.gpu_step_fraction; out of [0, 1] it exits 2 with
    one line naming the field."""
    module = _train_large_module()
    path = str(ROOT / "examples" / "configs" / "large" / "h200_20b_ram.yaml")
    assert module.load(path, gpu_step_fraction=0.5)["optimizer"].gpu_step_fraction == 0.5
    assert module.main(["--config", path, "--dry-run", "--gpu-step-fraction", "0.5"]) == 0
    capsys.readouterr()
    assert module.main(["--config", path, "--dry-run", "--gpu-step-fraction", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpu_step_fraction=1.5" in err, err


def test_train_large_tiny_with_the_gpu_lane_runs_on_cpu(tmp_path):
    """The RAM preset's tiny smoke run with half the offloaded chunks on the GPU lane (the CPU
    stands in for the device): it trains two steps and says how many chunks the lane stepped."""
    r = _run_example("--config", str(ROOT / "examples/configs/large/h200_20b_ram.yaml"), "--tiny",
                     "--nvme-dir", str(tmp_path), "--gpu-step-fraction", "0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2 and all("chunks 8 (4 on the GPU lane)" in ln for ln in steps), steps


def test_train_large_tiny_breadth_first_with_forward_sync_trains_as_depth_first(tmp_path):
    """Note [breadth-first blocks]: the RAM preset (param_sync forward, breadth_first_blocks
    auto: here both tiny blocks) prints the same loss at every step as the same preset run
    depth-first with param_sync step; a count above the model's blocks exits 2 naming it."""
    preset = ROOT / "examples/configs/large/h200_20b_ram.yaml"
    plain = tmp_path / "plain.yaml"
    plain.write_text(preset.read_text().replace("param_sync: forward", "param_sync: step")
                     .replace("breadth_first_blocks: auto", "breadth_first_blocks: 0"))
    losses = []
    for path in (preset, plain):
        r = _run_example("--config", str(path), "--tiny", "--nvme-dir", str(tmp_path),
                         "--steps", "4")
        assert r.returncode == 0, r.stderr[-3000:]
        steps = [ln.split(" | ")[0] for ln in r.stdout.splitlines() if ln.startswith("step ")]
        assert [ln.split()[1] for ln in steps] == ["0", "1", "2", "3"]
        losses.append(steps)
        assert ("train.breadth_first_blocks=2" in r.stdout) == (path == preset)
    assert losses[0] == losses[1] and len({ln.split()[-1] for ln in losses[0]}) == 4
    r = _run_example("--config", str(preset), "--tiny", "--breadth-first-blocks", "3")
    assert r.returncode == 2 and "train.breadth_first_blocks=3 exceeds model.n_layers=2" in r.stderr


def test_the_dry_run_names_breadth_first_where_a_preset_does_not_use_it():
    """The 13B NVMe preset clips and runs depth-first: its plan carries tiermem plan's
    'faster:' note (param_sync forward + breadth_first_blocks auto); the 20B RAM preset uses
    them, so its plan does not."""
    module = _train_large_module()
    large = ROOT / "examples" / "configs" / "large"
    path = str(large / "h200_13b_nvme.yaml")
    pl = module.make_plan(module.load(path))
    alt = module.make_plan(module.load(path, param_sync="forward", breadth_first_blocks="auto"))
    faster = [n for n in pl.notes if n.startswith("faster: --param-sync forward "
                                                  "--breadth-first-blocks auto")]
    assert len(faster) == 1, pl.notes
    assert (f"the first {alt.breadth_first_blocks} blocks" in faster[0]
            and f"predicted {alt.step_time.overlapped_s:.2f} s (floor) instead of "
                f"{pl.step_time.overlapped_s:.2f} s" in faster[0]), faster
    notes = module.make_plan(module.load(str(large / "h200_20b_ram.yaml"))).notes
    assert not any(n.startswith("faster:") for n in notes), notes
