"""tiermem plan: the memory model, verdicts on the H200 machine, and the command's exit codes."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from _examples import load_example
from tiermem import StoreConfig, TierStore
from tiermem.apps import cli
from tiermem.telemetry.saved import SavedBytesCounter
from tiermem.models import MoE, MoEConfig
from tiermem.models.gpt import GPT, Block, GPTConfig
from tiermem.models.moe import MoEBlock
from tiermem.optim import HybridAdam
from tiermem.optim.layout import chunk_state_bytes, nvme_staging_bytes, ring_bytes
from tiermem.apps.plan import (GB, GiB, PRESETS, activation_bytes_per_block, head_bytes,
                          host_buffer_bytes, main, moe_activation_bytes_per_block, plan)


def preset_plan(size, **kw):
    s = PRESETS[size]
    kw.setdefault("batch", s.micro_batch)
    return plan(s.num_params(), n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads,
                vocab=s.vocab, seq=s.seq_len, **kw)


def test_activation_formula_is_34_bytes_per_token_and_width_in_bf16():
    b, s, d = 8, 2048, 2048
    assert activation_bytes_per_block(batch=b, seq=s, d_model=d, n_heads=16, dtype_bytes=2) \
        == 34 * b * s * d
    eager = activation_bytes_per_block(batch=b, seq=s, d_model=d, n_heads=16, dtype_bytes=2,
                                       eager_attention=True)
    assert eager - 34 * b * s * d == 2 * b * 16 * s * s * 2
    assert head_bytes(batch=1, seq=1, d_model=1, vocab=10, dtype_bytes=2) == 2 * 2 + 10 * 12


def test_reference_gpt_matches_the_measured_peak_within_ten_percent():
    """The 1.34B reference, GPU-only fp32 masters + fused AdamW, one micro-batch of 8 x 2048
    tokens, peaked at 48.6 GiB on the H200 (docs/results/bench_optim.log, GPU-only row at 16384
    tokens/step; docs/benchmarks_archive.md)."""
    p = preset_plan("1b", gpu_reserve_bytes=0)
    assert p.fits and p.offload_fraction == 0.0
    assert p.used["gpu"] / GiB == pytest.approx(48.6, rel=0.10)


def test_presets_count_parameters_like_the_reference_gpt():
    s = PRESETS["1b"]
    cfg = GPTConfig(n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads, vocab=s.vocab,
                    seq_len=s.seq_len)
    assert s.num_params() == cfg.num_params()
    assert 1.3e9 < s.num_params() < 1.4e9
    for size, low, high in (("7b", 6e9, 7.5e9), ("13b", 12e9, 14e9), ("30b", 30e9, 34e9)):
        assert low < PRESETS[size].num_params() < high


@pytest.mark.parametrize("size", ["1b", "7b"])
def test_1b_and_7b_fit_on_the_h200_without_offload(size):
    p = preset_plan(size)
    assert p.fits and p.offload_fraction == 0.0 and p.offload_layers == 0
    assert p.used["gpu"] <= 141 * GB


def test_13b_fits_only_with_optimizer_offload_in_ram():
    p = preset_plan("13b")
    assert p.fits
    assert 0.3 < p.offload_fraction < 1.0 and p.state_tier == "cpu"
    assert p.used["host"] <= 128 * GiB
    no_offload = preset_plan("13b", offload_fraction=0.0)
    assert not no_offload.fits
    assert any(r.startswith("gpu needs") for r in no_offload.reasons)
    # all of it on NVMe does not fit the 64 GiB disk
    assert not preset_plan("13b", offload_fraction=1.0, state_tier="nvme").fits


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_30b_does_not_fit_even_with_everything_offloaded(moments):
    p = preset_plan("30b", moments_dtype=moments)
    assert not p.fits and p.offload_fraction == 1.0
    text = p.table()
    assert "DOES NOT FIT" in text
    per = 12 if moments == "fp32" else 8
    assert f"is {PRESETS['30b'].num_params() * per / GiB:,.0f} GiB ({per} B/param)" in text
    assert "more than RAM + NVMe together (192 GiB): no placement fits" in text


def test_plan_output_uses_one_unit_gib():
    """Issue 17 item 9: inputs in GB or GiB, every printed size in GiB (no "137.4 GB" for a
    128GiB host)."""
    text = preset_plan("13b", gpu_bytes="141GB", host_bytes="128GiB", nvme_bytes="64GiB").table()
    capacity = next(line for line in text.splitlines() if line.startswith("capacity"))
    assert capacity.split()[1:] == ["131.3", "GiB", "128.0", "GiB", "64.0", "GiB"]
    assert " GB" not in text and "GiB" in text


def test_placement_accounts_every_tier():
    p = preset_plan("13b", offload_fraction=0.5, state_tier="nvme", offload_layers=10,
                    checkpoint=True)
    rows = {i.name: i for i in p.items}
    n = p.num_params
    assert rows["optimizer state, offloaded"].nvme == round(0.5 * n) * 12
    assert rows["pinned staging (grads + params)"].host == 6 * (1 << 24) * 2  # 16M chunks
    assert rows["NVMe read-ahead buffers"].host == 5 * (1 << 24) * 12
    fixed = preset_plan("13b", offload_fraction=0.5, state_tier="nvme", offload_layers=10,
                        checkpoint=True, chunk_numel=1 << 22)
    assert {i.name: i for i in fixed.items}["pinned staging (grads + params)"].host == \
        6 * (1 << 22) * 2
    assert rows["activations"].host > 0
    assert p.used["nvme"] == sum(i.nvme for i in p.items)


@pytest.mark.parametrize("chunk_numel", [1500, 8192])
@pytest.mark.parametrize("moments_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_buffers_are_what_hybrid_adam_allocates(tmp_path, dtype, moments_dtype, chunk_numel):
    """Issue 18: the plan's pinned rings and NVMe staging are tiermem.optim.layout's ring_bytes
    and nvme_staging_bytes, and a real HybridAdam (offload_fraction=1, state_tier="split", all
    chunks fitting in RAM) allocates exactly that in its store: the cpu tier then holds the
    rings and the chunks' state blobs, and peaked with the staging room it reserved while it
    placed the chunks. chunk_numel 1500 is not a whole number of 4 KiB blocks (the store
    rounds each buffer up); 8192 is more than the model has (the buffers take one chunk of the
    4290 elements)."""
    lookahead = 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 30)).to(dtype)
    n = sum(q.numel() for q in model.parameters())
    assert n == 4290
    p = plan(model, n_layers=2, d_model=60, seq=8, batch=1, moments_dtype=moments_dtype,
             offload_fraction=1.0, state_tier="split", chunk_numel=chunk_numel,
             nvme_lookahead_chunks=lookahead, gpu_bytes="1GiB", host_bytes="1GiB",
             nvme_bytes="1GiB", gpu_reserve_bytes=0, host_reserve_bytes=0)
    rows = {i.name: i for i in p.items}
    rings = rows["pinned staging (grads + params)"].host
    staging = rows["NVMe read-ahead buffers"].host
    chunk = min(chunk_numel, n)
    assert rings == ring_bytes(chunk, dtype.itemsize)
    assert staging == nvme_staging_bytes(chunk, moments_dtype, lookahead)
    assert (rings, staging) == host_buffer_bytes(n, chunk_numel, dtype, moments_dtype, lookahead,
                                                 "split")

    store = TierStore(StoreConfig(cpu_bytes="4MiB", nvme_bytes="4MiB", nvme_dir=str(tmp_path),
                                  pool_slab_bytes="64KiB"))
    opt = HybridAdam(model.parameters(), store=store, chunk_numel=chunk_numel,
                     offload_fraction=1.0, state_tier="split", moments_dtype=moments_dtype,
                     nvme_lookahead_chunks=lookahead)
    assert opt.chunk_tiers() == {"cpu": -(-n // chunk), "nvme": 0}  # allocates the state
    state = sum(chunk_state_bytes(min(chunk, n - start), moments_dtype)
                for start in range(0, n, chunk))
    used = store.used_bytes("cpu")
    assert used - state == rings
    assert store.stats()["cpu"]["peak_bytes"] - used == staging
    opt.close()
    store.close()


@pytest.mark.parametrize("moments_dtype", [torch.float32, torch.bfloat16], ids=["m32", "m16"])
def test_gpu_lane_slots_are_what_hybrid_adam_allocates(moments_dtype):
    """With gpu_step_fraction > 0 the plan counts the GPU lane's device slots (Note [gpu lane]:
    3 chunks of fp32 state and fp32 gradients), the bytes a real HybridAdam allocates for them
    (its memory_bytes()["gpu"] at f = 1, where nothing else is on the GPU side); without the
    lane there is no such row."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 30))
    kw = dict(n_layers=2, d_model=60, seq=8, batch=1, moments_dtype=moments_dtype,
              offload_fraction=1.0, state_tier="cpu", gpu_bytes="1GiB", host_bytes="1GiB",
              nvme_bytes=0, gpu_reserve_bytes=0, host_reserve_bytes=0, chunk_numel=1024)
    rows = {i.name: i for i in plan(model, **kw, gpu_step_fraction=0.5).items}
    assert "GPU lane slots" not in {i.name for i in plan(model, **kw).items}
    opt = HybridAdam(model.parameters(), offload_fraction=1.0, moments_dtype=moments_dtype,
                     chunk_numel=1024, gpu_step_fraction=0.5)
    words = 3 if moments_dtype == torch.float32 else 2
    assert rows["GPU lane slots"].gpu == 3 * 4 * 1024 * (words + 1)
    assert opt.memory_bytes()["gpu"] == rows["GPU lane slots"].gpu
    opt.close()


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.6])
@pytest.mark.parametrize("moments_dtype", [torch.float32, torch.bfloat16], ids=["m32", "m16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["p32", "p16"])
def test_gpu_side_state_is_what_hybrid_adam_holds(dtype, moments_dtype, fraction):
    """Issue 19: the plan's "optimizer state, GPU side" is (1-f)·N·(2·m + 4·[p != 4]) (both
    moments in moments_dtype, an fp32 master unless the params are fp32), and a real HybridAdam
    with the same fraction holds exactly that: its memory_bytes()["gpu"] (no GPU lane) and the
    bytes of the moment and master tensors it allocated. The old 8 + 4·[p != 4] fails with bf16
    moments. Fractions whose f·N is a whole number of elements (N = 4290), so the plan's
    round(f·N) and HybridAdam's split by bytes keep the same elements on the GPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 30)).to(dtype)
    n = sum(q.numel() for q in model.parameters())
    assert n == 4290
    p = plan(model, n_layers=2, d_model=60, seq=8, batch=1, moments_dtype=moments_dtype,
             offload_fraction=fraction, state_tier="cpu", gpu_bytes="1GiB", host_bytes="1GiB",
             nvme_bytes=0, gpu_reserve_bytes=0, host_reserve_bytes=0)
    rows = {i.name: i for i in p.items}
    gpu_side = rows["optimizer state, GPU side"].gpu
    per_param = (8 if moments_dtype == torch.float32 else 4) + (4 if dtype != torch.float32 else 0)
    gpu_numel = n - round(fraction * n)
    assert gpu_side == gpu_numel * per_param
    assert rows["optimizer state, GPU side"].note.startswith(f"{per_param} B/param")

    opt = HybridAdam(model.parameters(), offload_fraction=fraction, moments_dtype=moments_dtype,
                     chunk_numel=1024)
    assert opt.memory_bytes()["gpu"] == gpu_side
    assert opt.state_numel()["gpu"] == gpu_numel
    groups = opt._layout.groups
    moments = sum(t.numel() * t.element_size() for g in groups
                  for t in g.gpu_exp_avg + g.gpu_exp_avg_sq)
    masters = sum(m.numel() * m.element_size() for g in groups
                  for m, v in zip(g.gpu_masters, g.gpu_views) if m is not v)
    assert moments + masters == gpu_side
    assert all(t.dtype == moments_dtype for g in groups for t in g.gpu_exp_avg + g.gpu_exp_avg_sq)
    opt.close()


def test_bf16_moments_keep_more_of_the_13b_state_on_the_gpu():
    """bf16 moments cut the GPU side's state from 12 to 8 B/param (bf16 params), so the least
    offload fraction that fits the GPU falls, and the offloaded state with it."""
    fp32, bf16 = preset_plan("13b"), preset_plan("13b", moments_dtype="bf16")
    assert fp32.fits and bf16.fits
    assert bf16.offload_fraction < fp32.offload_fraction
    for pl, per in ((fp32, 12), (bf16, 8)):
        row = {i.name: i for i in pl.items}["optimizer state, GPU side"]
        assert row.gpu == (pl.num_params - round(pl.offload_fraction * pl.num_params)) * per
    # the hints say so: a GPU overflow with fp32 moments points at bf16 moments, not with bf16
    over = preset_plan("13b", offload_fraction=0.0)
    assert not over.fits
    assert any("bf16 moments" in n and "GPU-side state falls from 12 to 8 B/param" in n
               for n in over.notes), over.notes
    assert not any("bf16 moments" in n
                   for n in preset_plan("13b", offload_fraction=0.0, moments_dtype="bf16").notes)


def test_plan_takes_a_model():
    model = GPT(GPTConfig(n_layers=2, d_model=64, n_heads=2, vocab=100, seq_len=32))
    p = plan(model, seq=32, batch=2, gpu_bytes="2GiB", host_bytes="1GiB", nvme_bytes=0,
             host_reserve_bytes=0)
    assert p.num_params == sum(q.numel() for q in model.parameters())
    assert p.inputs["dtype"] == "float32" and p.inputs["n_layers"] == 2  # the model's dtype
    assert p.fits
    # a dtype given wins over the model's, in any spelling
    for spelling in ("bf16", "bfloat16", torch.bfloat16):
        given = plan(model, seq=32, batch=2, gpu_bytes="2GiB", host_bytes="1GiB", nvme_bytes=0,
                     host_reserve_bytes=0, dtype=spelling)
        assert given.inputs["dtype"] == "bfloat16"
        assert {i.name: i for i in given.items}["parameters"].gpu == 2 * p.num_params


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give the model size"),
    ({"num_params": 1e9}, "needs the shape: n_layers and d_model"),
    ({"num_params": -5, "n_layers": 2, "d_model": 8}, "num_params=-5 must be a positive number"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "offload_fraction": 1.5},
     "offload_fraction=1.5 is outside [0.0, 1.0]"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "dtype": "int4"},
     "dtype='int4' is not a supported dtype"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "moments_dtype": "fp16"},
     "moments_dtype='fp16' is not a supported dtype; use one of float32, fp32"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "moments_dtype": torch.float16},
     "moments_dtype=torch.float16 is not a supported dtype"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "nvme_lookahead_chunks": -1},
     "nvme_lookahead_chunks=-1 must be an int >= 0"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "chunk_numel": 0},
     "chunk_numel=0 must be an int >= 1"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "offload_layers": 2},
     "offload_layers=2 must be an int in [0, 2)"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "state_tier": "disk"}, "state_tier='disk'"),
    ({"num_params": 1e9, "n_layers": 2, "d_model": 8, "gpu_bytes": "lots"}, "gpu_bytes='lots'"),
])
def test_plan_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError) as err:
        plan(**kwargs)
    assert message in str(err.value)


def test_command_exit_codes_and_table(capsys):
    assert main(["--model-size", "13b"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "optimizer state, offloaded" in out and "configure:" in out
    assert main(["--model-size", "30b"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--params", "13e9", "--layers", "40", "--d-model", "5120",
                 "--offload-fraction", "0"]) == 1


@pytest.mark.parametrize("argv, message", [
    ([], "give the model"),
    (["--params", "13e9"], "needs the shape"),
    (["--model-size", "13b", "--layers", "3"], "--model-size sets the shape"),
    (["--model-size", "2b"], "invalid choice: '2b'"),
    (["--params", "lots", "--layers", "2", "--d-model", "8"], "'lots' is not a number"),
    (["--model-size", "1b", "--offload-fraction", "1.5"], "offload_fraction=1.5"),
    (["--model-size", "1b", "--gpu", "huge"], "gpu_bytes='huge' is not a byte size"),
])
def test_command_bad_usage_exits_2_with_one_clear_error(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_json_output_and_the_tiermem_command(capsys):
    assert cli.main(["plan", "--model-size", "7b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["num_params"] == PRESETS["7b"].num_params()
    assert cli.main(["plan", "--help"]) == 0
    assert "--model-size" in capsys.readouterr().out


def test_split_state_fits_where_ram_or_nvme_alone_does_not():
    """13B with 80 GiB RAM and 64 GiB of disk: neither tier alone holds the offloaded state,
    RAM first + the rest on NVMe (HybridAdam's state_tier='split') does; auto picks it."""
    from tiermem.apps.plan import PRESETS, plan
    c = PRESETS["13b"]
    kw = dict(n_layers=c.n_layers, d_model=c.d_model, n_heads=c.n_heads, vocab=c.vocab,
              seq=c.seq_len, batch=c.micro_batch, host_bytes="80GiB", nvme_bytes="64GiB")
    n = c.num_params()
    assert not plan(n, **kw, state_tier="cpu").fits
    assert not plan(n, **kw, state_tier="nvme").fits
    split = plan(n, **kw, state_tier="split")
    assert split.fits and plan(n, **kw).state_tier == "split"
    state = next(i for i in split.items if i.name == "optimizer state, offloaded")
    assert state.host > 0 and state.nvme > 0
    assert split.used["host"] <= split.capacity["host"] and split.used["nvme"] <= split.capacity["nvme"]


# ---------------------------------------------------------------- mixture of experts

def measured_block_bytes(block: torch.nn.Module, batch: int, seq: int, dtype: torch.dtype) -> int:
    """Bytes autograd saves in one forward of ``block`` (each storage once, parameters not
    counted), with the fused (flash) SDPA kernel as on the GPU."""
    torch.manual_seed(0)
    block = block.to(dtype)
    x = torch.randn(batch, seq, block.ln1.normalized_shape[0], dtype=dtype, requires_grad=True)
    counter = SavedBytesCounter({p.untyped_storage().data_ptr() for p in block.parameters()})
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), counter.hooks():
        block(x)
    return counter.forward_bytes


def fused_attention_gap(tokens: int, d_model: int, n_heads: int, a: int) -> int:
    """Formula minus measurement on the CPU (Note [block activations, measured] in
    tiermem/apps/plan/memory.py): the fused kernel's output reshape is a view (the formula's copy,
    d·a per token, is not saved); LayerNorm's mean and rstd (2 LNs x 2, dtype a on the CPU) and
    SDPA's fp32 logsumexp (4·h) are saved, not counted."""
    return tokens * (d_model * a - 2 * 2 * a - 4 * n_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_block_formula_against_the_bytes_autograd_saves(dtype):
    b, s, d, h = 2, 16, 32, 4
    a = torch.finfo(dtype).bits // 8
    measured = measured_block_bytes(
        Block(GPTConfig(n_layers=1, d_model=d, n_heads=h, seq_len=s, vocab=64)), b, s, dtype)
    formula = activation_bytes_per_block(batch=b, seq=s, d_model=d, n_heads=h, dtype_bytes=a)
    assert formula - measured == fused_attention_gap(b * s, d, h, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k, d_expert, n_experts", [
    (1, 48, 4), (1, 48, 16), (2, 80, 4), (2, 80, 16), (2, 136, 8), (3, 24, 5)])
def test_moe_block_formula_against_the_bytes_autograd_saves(dtype, top_k, d_expert, n_experts):
    """One real MoEBlock forward: the formula is exact up to the attention part's gap, which
    the dense block has too; the number of experts (4 or 16 at the same top_k and d_expert)
    changes neither side, though the tokens spread over the experts differently."""
    b, s, d, h = 2, 16, 32, 4
    a = torch.finfo(dtype).bits // 8
    cfg = MoEConfig(n_layers=1, d_model=d, n_heads=h, seq_len=s, vocab=64, n_experts=n_experts,
                    top_k=top_k, d_expert=d_expert)
    block = MoEBlock(cfg)
    measured = measured_block_bytes(block, b, s, dtype)
    assert int(block.moe.tokens_per_expert.sum()) == b * s * top_k
    formula = moe_activation_bytes_per_block(batch=b, seq=s, d_model=d, n_heads=h, dtype_bytes=a,
                                             top_k=top_k, d_expert=d_expert)
    assert formula - measured == fused_attention_gap(b * s, d, h, a)
    assert formula == b * s * (d * a * (9 + 2 * top_k) + 2 * top_k * d_expert * a
                               + top_k * (28 + a))


MOE = dict(n_layers=28, d_model=2048, n_heads=16, n_experts=64, top_k=6, d_expert=1408)


def test_plan_sizes_an_moe_by_total_params_and_reports_the_active_ones():
    shape = {k: v for k, v in MOE.items() if k not in ("n_experts", "top_k", "d_expert")}
    experts = {k: MOE[k] for k in ("n_experts", "top_k", "d_expert")}
    cfg = MoEConfig(**MOE, seq_len=2048, vocab=32000)
    p = plan(**MOE, batch=4)
    assert p.num_params == cfg.num_params() and p.active_params == cfg.active_params()
    assert 10e9 < p.num_params < 11e9 and 1.5e9 < p.active_params < 1.7e9
    rows = {i.name: i for i in p.items}
    assert rows["parameters"].gpu == rows["gradients"].gpu == 2 * cfg.num_params()
    state = rows["optimizer state, GPU side"].gpu + rows["optimizer state, offloaded"].host
    assert state == 12 * cfg.num_params()  # fp32 master + moments of every expert
    # sized by the total: the GPU alone holds a dense model of the active size, not this one
    assert p.fits and p.offload_fraction > 0.3
    assert plan(p.active_params, **shape, batch=4).offload_fraction == 0.0
    # activations: top_k and d_expert count, the number of experts does not
    act = rows["activations"].gpu
    assert act == 28 * moe_activation_bytes_per_block(batch=4, seq=2048, d_model=2048,
                                                      n_heads=16, dtype_bytes=2, top_k=6,
                                                      d_expert=1408)
    assert {i.name: i for i in plan(**{**MOE, "n_experts": 8}, batch=4).items}[
        "activations"].gpu == act
    assert {i.name: i for i in plan(**{**MOE, "top_k": 2}, batch=4).items}[
        "activations"].gpu < act
    text = p.table()
    assert (f"parameters: {p.num_params / 1e9:.2f}B in total (weights, gradients, optimizer "
            f"state: all 64 experts), {p.active_params / 1e9:.2f}B active per token") in text
    # a given total: the active count is it less the experts a token skips
    given = plan(12e9, **shape, **experts, batch=4)
    assert given.num_params == 12 * 10**9
    assert given.num_params - given.active_params == cfg.num_params() - cfg.active_params()
    dense = preset_plan("1b")
    assert dense.active_params == dense.num_params and "in total" not in dense.table()


def test_plan_takes_an_moe_model():
    model = MoE(MoEConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab=64, n_experts=4,
                          top_k=2, d_expert=24))
    p = plan(model, seq=16, batch=2, gpu_bytes="2GiB", host_bytes="1GiB", nvme_bytes=0,
             host_reserve_bytes=0)
    assert p.num_params == sum(q.numel() for q in model.parameters()) == model.cfg.num_params()
    assert p.active_params == model.cfg.active_params()
    assert (p.inputs["n_experts"], p.inputs["top_k"], p.inputs["d_expert"]) == (4, 2, 24)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_experts": 8, "top_k": 2}, "an MoE needs n_experts, top_k and d_expert; d_expert missing"),
    ({"n_experts": 2, "top_k": 3, "d_expert": 64}, "top_k=3 exceeds n_experts=2"),
    ({"n_experts": 8, "top_k": 0, "d_expert": 64}, "top_k=0 must be an int >= 1"),
    ({"num_params": 5e4, "n_experts": 8, "top_k": 2, "d_expert": 64},  # 2 x 6 x 8320
     "num_params=50000.0 is not above the 99,840 parameters of the experts a token skips"),
])
def test_plan_rejects_bad_moe_input(kwargs, message):
    with pytest.raises(ValueError) as err:
        plan(**{"n_layers": 2, "d_model": 64, **kwargs})
    assert message in str(err.value)


def test_command_sizes_an_moe(capsys):
    argv = ["--layers", "28", "--d-model", "2048", "--heads", "16", "--experts", "64",
            "--top-k", "6", "--d-expert", "1408", "--batch", "4"]
    assert main(argv) == 0
    assert "1.58B active per token (top-6" in capsys.readouterr().out
    assert cli.main(["plan", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cfg = MoEConfig(**MOE, seq_len=2048, vocab=32000)
    assert data["num_params"] == cfg.num_params() and data["active_params"] == cfg.active_params()
    assert main(["--model-size", "1b", "--experts", "8", "--top-k", "2", "--d-expert", "64"]) == 2
    assert "--model-size is a dense GPT preset" in capsys.readouterr().err
    assert main(["--layers", "2", "--d-model", "64", "--experts", "8"]) == 2
    assert "top_k, d_expert missing" in capsys.readouterr().err


def test_sizing_doc_moe_example_is_what_the_command_prints(capsys):
    """docs/sizing.md pastes a ``tiermem plan`` run for an MoE: the command, run now, prints
    exactly the pasted output; the dense model of its active size it compares with fits the GPU
    alone."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "sizing.md").read_text()
    block = re.search(r"```\n\$ tiermem plan (.*?)\n(.*?)```", text, re.S)
    assert block, "docs/sizing.md lost its MoE `tiermem plan` example"
    argv = block.group(1).split()
    assert "--experts" in argv
    assert main(argv) == 0
    assert capsys.readouterr().out == block.group(2)
    dense = re.search(r"`tiermem plan (--params [^`]*)`: 0 % offloaded", text)
    assert dense and main(dense.group(1).split()) == 0
    assert "optimizer state 0% off the GPU" in capsys.readouterr().out


# ---------------------------------------------------------------- dtype spellings

def _spelled(moments_dtype, **kw):
    return preset_plan("13b", moments_dtype=moments_dtype, **kw)


@pytest.mark.parametrize("kw", [
    {},  # fits: the configure note
    {"host_bytes": "60GiB", "state_tier": "cpu"},  # the offloaded state overflows RAM
    {"offload_fraction": 1.0, "nvme_bytes": "20GiB"},  # f = 1 and no fit: the RAM + NVMe note
])
@pytest.mark.parametrize("spellings", [("fp32", "float32", "FP32", "torch.float32", torch.float32),
                                       ("bf16", "bfloat16", "torch.bfloat16", torch.bfloat16)])
def test_every_spelling_of_a_moments_dtype_gives_the_same_plan(spellings, kw):
    """Issue 18: the plan spells dtypes through tiermem.names.dtype_name, like the config and
    HybridAdam: every spelling of one dtype gives the same plan (its inputs keep the canonical
    name), and the table prints the short one."""
    plans = [_spelled(m, **kw) for m in spellings]
    canonical = "float32" if spellings[0] == "fp32" else "bfloat16"
    assert plans[0].inputs["moments_dtype"] == canonical
    for other in plans[1:]:
        assert other.to_dict() == plans[0].to_dict()
        assert other.table() == plans[0].table()
    assert f"(fp32 master + {spellings[0]} moments)" in plans[0].table()
    assert _spelled("fp32" if canonical == "bfloat16" else "bf16", **kw).to_dict() != \
        plans[0].to_dict()


def test_the_command_takes_every_spelling_of_a_dtype(capsys):
    outputs = []
    for spelling in ("fp32", "float32", "torch.float32"):
        assert main(["--model-size", "13b", "--moments-dtype", spelling,
                     "--dtype", "bfloat16"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2]
    assert main(["--model-size", "13b", "--moments-dtype", "fp16"]) == 2
    assert "moments_dtype='fp16' is not a supported dtype" in capsys.readouterr().err


@pytest.mark.parametrize("fp32", ["float32", torch.float32])
def test_fp32_moments_spelled_long_are_fp32_moments(fp32):
    """The bug: the notes compared moments_dtype with "fp32", so "float32" told the user to
    configure optimizer.moments_dtype=bfloat16 for a plan sized with fp32 moments and left out
    the hint that bf16 moments would cut the overflowing state; torch.float32 was refused."""
    fits = _spelled(fp32)
    assert fits.fits
    configure = next(n for n in fits.notes if n.startswith("configure:"))
    assert "moments_dtype" not in configure
    over = _spelled(fp32, host_bytes="60GiB", state_tier="cpu")
    assert not over.fits
    assert any("bf16 moments (--moments-dtype bf16, optimizer.moments_dtype=bfloat16) cut it "
               "from 12 to 8 B/param" in n for n in over.notes), over.notes
    bf16 = next(n for n in _spelled("bf16").notes if n.startswith("configure:"))
    assert "optimizer.moments_dtype=bfloat16" in bf16


def test_ram_plus_nvme_note_counts_the_pinned_buffers_hybrid_adam_allocates():
    """With all of the state offloaded and no fit, the note on RAM + NVMe together takes off the
    host reserve and the pinned rings and NVMe staging (layout's sizes), not 2 B/param."""
    p = _spelled("fp32", offload_fraction=1.0, nvme_bytes="20GiB")
    assert not p.fits
    n = p.num_params
    for dtype, per, verdict in ((torch.float32, 12, "no placement fits"),
                                (torch.bfloat16, 8, "split between them")):
        buffers = sum(host_buffer_bytes(n, None, torch.bfloat16, dtype, 2, "split"))
        assert buffers < 2 * GiB  # a few 16M-element chunks, not 2 B/param (24 GiB)
        both = 128 * GiB - 8 * GiB - buffers + 20 * GiB
        note = next(x for x in p.notes if x.startswith(f"with {'fp32' if per == 12 else 'bf16'}"))
        assert f"is {n * per / GiB:,.0f} GiB ({per} B/param)" in note
        assert f"{both / GiB:,.0f} GiB" in note and verdict in note, note


# ---------------------------------------------------------------- time per step (issue 19)

from tiermem.apps.plan import (H200_GPU_FLOPS, H200_GPU_FLOPS_CHECKPOINTED,  # noqa: E402
                          REFERENCE_CHECKPOINTED_S, REFERENCE_FWD_BWD_S, REFERENCE_TOKENS,
                          RESOURCES, MachineRates, step_time)

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results"


def _st(**kw):
    base = dict(active_params=10**10, offloaded_params=6 * 10**9, param_bytes=2,
                micro_batch_tokens=2048, grad_accumulation_steps=4,
                nvme_state_bytes=8 * 10**9, checkpoint=True)
    return step_time(**{**base, **kw})


def test_default_rates_are_the_figures_of_the_logs():
    """Each MachineRates default is the figure its comment names, read from the log now."""
    r = MachineRates()
    transfer = (RESULTS / "bench_transfer.log").read_text()
    for what, got in (("H2D (host -> device)", r.pcie_h2d_bytes_per_s),
                      ("D2H (device -> host)", r.pcie_d2h_bytes_per_s),
                      ("both directions at once", r.pcie_both_bytes_per_s)):
        raw = re.search(rf"{re.escape(what)}\s+([\d.]+)", transfer).group(1)
        assert got == float(raw) * 1e9, what
    adam = (RESULTS / "bench_adam.log").read_text()
    mixed = re.search(r"\| native mixed \| ([\d.]+)", adam)[1]
    assert r.cpu_adam_params_per_s == float(mixed) * 1e9
    assert r.cpu_adam_bf16_moments_params_per_s == float(
        re.search(r"\| native mixed, bf16 moments \| ([\d.]+)", adam)[1]) * 1e9
    io = re.search(r"SpillSpace posix threads=4: write ([\d.]+) GB/s, read ([\d.]+) GB/s",
                   (RESULTS / "bench_io.log").read_text())
    assert (r.nvme_write_bytes_per_s, r.nvme_read_bytes_per_s) == (float(io[1]) * 1e9,
                                                                   float(io[2]) * 1e9)
    large = (RESULTS / "large_20b_ram.log").read_text()
    wall = float(re.search(r"optimizer step wall\s+([\d.]+) s", large)[1])
    kernel = float(re.search(r"CPU Adam \(kernel, summed\)\s+([\d.]+) s", large)[1])
    chunks = int(re.search(r"chunks (\d+) \(0 on the GPU lane\)", large)[1])
    assert r.worker_s_per_chunk == (wall - kernel) / chunks == pytest.approx(0.48e-3, rel=0.01)
    act = (RESULTS / "bench_activations.log").read_text()
    assert "layers=24 d_model=2048 heads=16 seq=2048 batch=8 vocab=32000" in act
    assert REFERENCE_FWD_BWD_S * 1e3 == float(re.search(r"no offload: ([\d.]+) ms/step", act)[1])
    assert REFERENCE_TOKENS == 8 * 2048
    assert REFERENCE_CHECKPOINTED_S * 1e3 == float(
        re.search(r"checkpoint every block: ([\d.]+) ms/step", act)[1])
    assert r.gpu_flops_checkpointed == H200_GPU_FLOPS_CHECKPOINTED == pytest.approx(
        8 * 1343868928 * 16384 / 0.3095)
    ckpt = preset_plan("1b", checkpoint=True).step_time
    assert ckpt.seconds["gpu"] == pytest.approx(0.3095)  # the second calibration point
    assert r.gpu_flops == H200_GPU_FLOPS == pytest.approx(524.65e12, rel=1e-4)
    # the reference run's forward + backward is what the model predicts for it (the calibration)
    ref = preset_plan("1b").step_time
    assert ref.tokens == REFERENCE_TOKENS and ref.seconds["gpu"] == pytest.approx(0.2518)


def test_doubling_the_tokens_doubles_the_gpu_time_not_the_optimizer_side():
    one, two = _st(grad_accumulation_steps=4), _st(grad_accumulation_steps=8)
    assert two.tokens == 2 * one.tokens == 2 * 4 * 2048
    assert two.seconds["gpu"] == pytest.approx(2 * one.seconds["gpu"])
    for k in ("pcie", "cpu_adam", "nvme"):
        assert two.seconds[k] == one.seconds[k] > 0
    # the same through plan(): grad_accumulation_steps changes the time, not the placement
    a, b = (preset_plan("13b", checkpoint=True, grad_accumulation_steps=g) for g in (1, 2))
    assert a.items == b.items and a.offload_fraction == b.offload_fraction
    assert b.step_time.seconds["gpu"] == pytest.approx(2 * a.step_time.seconds["gpu"])
    assert b.step_time.seconds["cpu_adam"] == a.step_time.seconds["cpu_adam"] > 0


def test_each_resource_is_its_closed_form():
    r = MachineRates()
    st = _st()
    tokens = 4 * 2048
    assert st.seconds["gpu"] == pytest.approx(8 * 10**10 * tokens / r.gpu_flops_checkpointed)
    assert _st(checkpoint=False).seconds["gpu"] == pytest.approx(6 * 10**10 * tokens / r.gpu_flops)
    moved = 6 * 10**9 * 2  # gradients off and params back, once per optimizer step
    assert st.seconds["pcie"] == pytest.approx(max(moved / r.pcie_d2h_bytes_per_s,
                                                   moved / r.pcie_h2d_bytes_per_s,
                                                   2 * moved / r.pcie_both_bytes_per_s))
    assert st.seconds["cpu_adam"] == pytest.approx(6e9 / r.cpu_adam_params_per_s)
    assert _st(moments_dtype="bf16").seconds["cpu_adam"] == \
        pytest.approx(6e9 / r.cpu_adam_bf16_moments_params_per_s)
    assert st.seconds["nvme"] == pytest.approx(8e9 / r.nvme_read_bytes_per_s
                                               + 8e9 / r.nvme_write_bytes_per_s)
    assert st.bound == "nvme"
    assert st.serial_s == pytest.approx(sum(st.seconds.values()))
    assert st.tokens_per_s_overlapped == pytest.approx(tokens / st.overlapped_s)
    assert st.tokens_per_s_serial == pytest.approx(tokens / st.serial_s)


def test_each_offloaded_chunk_adds_the_workers_time_to_cpu_adam():
    """MachineRates.worker_s_per_chunk: the chunk worker's own time per chunk (lane chunks
    too) adds to the CPU Adam term; plan() counts ceil(offloaded / chunk_numel) chunks, so the
    20B RAM preset's 16M chunks cost a quarter of what 4M chunks would."""
    r = MachineRates()
    assert _st(offloaded_chunks=1000).seconds["cpu_adam"] == pytest.approx(
        6e9 / r.cpu_adam_params_per_s + 1000 * r.worker_s_per_chunk)
    assert _st(offloaded_chunks=1000, gpu_step_fraction=1.0).seconds["cpu_adam"] == \
        pytest.approx(1000 * r.worker_s_per_chunk)
    tl = _train_large()
    big, small = (tl.make_plan(tl.load(RAM_20B)),
                  tl.make_plan({**tl.load(RAM_20B), "optimizer": dataclasses.replace(
                      tl.load(RAM_20B)["optimizer"], chunk_numel=4194304)}))
    off = round(big.offload_fraction * big.num_params)
    assert big.step_time.moved["offloaded_chunks"] == -(-off // 16777216) == 899
    assert small.step_time.moved["offloaded_chunks"] == -(-off // 4194304) == 3593
    assert small.step_time.seconds["cpu_adam"] - big.step_time.seconds["cpu_adam"] == \
        pytest.approx((3593 - 899) * r.worker_s_per_chunk)


@pytest.mark.parametrize("checkpoint, share", [(True, 6 / 8), (False, 4 / 6)])
@pytest.mark.parametrize("accum", [1, 4])
def test_the_floor_is_forward_backward_then_the_optimizer_tail(checkpoint, share, accum):
    """Note [optimizer tail]: the optimizer phase (PCIe, CPU Adam, NVMe pipelined: their max;
    one after another: their sum) follows forward + backward, overlapping at most the last
    micro-batch's backward (its share of the 6·N·T / 8·N·T count), and none of it with
    max_grad_norm; the floor is the GPU plus what is left, the ceiling the sum of all four."""
    for kw in ({}, {"nvme_state_bytes": 0}, {"moments_dtype": "bf16", "gpu_step_fraction": 0.5},
               {"offloaded_params": 10**8, "nvme_state_bytes": 0}):
        free = _st(checkpoint=checkpoint, grad_accumulation_steps=accum, **kw)
        clip = _st(checkpoint=checkpoint, grad_accumulation_steps=accum, max_grad_norm=1.0, **kw)
        gpu = free.seconds["gpu"]
        opt = [free.seconds[k] for k in ("pcie", "cpu_adam", "nvme")]
        for st in (free, clip):
            assert st.seconds == free.seconds and st.bound == free.bound
            assert st.fwd_bwd_s == gpu  # no offloaded activations: forward + backward is the GPU's
            assert st.optimizer_overlapped_s == pytest.approx(max(opt))
            assert st.optimizer_serial_s == pytest.approx(sum(opt))
            assert st.serial_s == pytest.approx(gpu + sum(opt))
            assert st.overlapped_s == pytest.approx(gpu + st.optimizer_tail_s)
            assert max(st.seconds.values()) <= st.overlapped_s * (1 + 1e-12)
            assert st.overlapped_s <= st.serial_s * (1 + 1e-12)
            assert st.gpu_share_of_floor == pytest.approx(gpu / st.overlapped_s)
            assert st.tokens_per_s_overlapped == pytest.approx(st.tokens / st.overlapped_s)
        assert free.overlap_window_s == pytest.approx(gpu / accum * share)
        assert free.optimizer_tail_s == pytest.approx(max(0.0, max(opt) - gpu / accum * share))
        assert clip.overlap_window_s == 0 and clip.max_grad_norm == 1.0
        assert free.max_grad_norm is None
        assert clip.optimizer_tail_s == pytest.approx(max(opt))
        assert clip.overlapped_s == pytest.approx(gpu + max(opt))
    # a window longer than the optimizer phase hides it all: the floor is the GPU's time
    small = _st(offloaded_params=10**6, nvme_state_bytes=0, grad_accumulation_steps=1)
    assert small.optimizer_tail_s == 0 and small.overlapped_s == small.seconds["gpu"]
    assert small.gpu_share_of_floor == 1.0


@pytest.mark.parametrize("checkpoint, fwd_share", [(True, 2 / 8), (False, 2 / 6)])
def test_the_next_forward_runs_beside_the_tail_only_with_forward_sync_and_clipping(
        checkpoint, fwd_share):
    """Note [optimizer tail]: with max_grad_norm and param_sync="forward" the chunks go in
    forward order, so the next step's forward (its 2/6 or 2/8 share of the GPU's time) of the
    first K blocks of every micro-batch and of the rest of one runs beside the tail; without
    clipping (backward order) or with param_sync="step" nothing is taken off."""
    kw = dict(checkpoint=checkpoint, grad_accumulation_steps=8, max_grad_norm=1.0,
              nvme_state_bytes=0)
    base = _st(**kw)
    for k in (0, 6, 24):
        st = _st(**kw, param_sync="forward", breadth_first_blocks=k, n_layers=24)
        first = k / 24
        ahead = base.seconds["gpu"] * fwd_share * (first + (1 - first) / 8)
        assert st.forward_overlap_s == pytest.approx(ahead)
        assert st.optimizer_tail_s == pytest.approx(max(0.0, base.optimizer_tail_s - ahead))
        assert st.serial_s == base.serial_s and st.seconds == base.seconds
        assert (st.param_sync, st.breadth_first_blocks) == ("forward", k)
        assert _st(**kw, breadth_first_blocks=k, n_layers=24).overlapped_s == base.overlapped_s
        free = _st(**{**kw, "max_grad_norm": None}, param_sync="forward",
                   breadth_first_blocks=k, n_layers=24)
        assert free.forward_overlap_s == 0
    assert _st(**kw, param_sync="forward", breadth_first_blocks=24,
               n_layers=24).optimizer_tail_s < base.optimizer_tail_s
    with pytest.raises(ValueError, match="param_sync='later' is not one of 'step', 'forward'"):
        _st(param_sync="later")
    with pytest.raises(ValueError, match="breadth_first_blocks=25 exceeds n_layers=24"):
        _st(breadth_first_blocks=25, n_layers=24)
    with pytest.raises(TypeError, match="n_layers"):
        _st(breadth_first_blocks=2)


def test_breadth_first_blocks_count_on_the_gpu_and_auto_takes_the_most_that_fit():
    """Note [breadth-first blocks]: each of the other micro-batches keeps what its first K
    (checkpointed) blocks saved plus its hidden state on the GPU; "auto" takes the most blocks
    that fit the placement chosen without them; the command line takes both and refuses a
    count above the layers with exit 2."""
    kw = dict(n_layers=24, d_model=2048, seq=2048, batch=2, checkpoint=True,
              grad_accumulation_steps=8, offload_fraction=0.5, state_tier="cpu",
              gpu_reserve_bytes="1GiB", offload_layers=0)
    base = plan(1.3e9, **kw)
    block_input = 2 * 2048 * 2048 * 2
    for k in (1, 10):
        pl = plan(1.3e9, **kw, breadth_first_blocks=k)
        item = next(i for i in pl.items if i.name == "breadth-first block inputs")
        assert item.gpu == 7 * (k + 1) * block_input and item.host == 0
        assert pl.used["gpu"] == base.used["gpu"] + item.gpu and pl.breadth_first_blocks == k
    assert not any(i.name == "breadth-first block inputs" for i in base.items)
    assert not any(i.name == "breadth-first block inputs" for i in plan(
        1.3e9, **{**kw, "grad_accumulation_steps": 1}, breadth_first_blocks=5).items)
    tight = dict(kw, gpu_bytes=base.used["gpu"] + 5 * 7 * block_input + block_input // 2)
    auto = plan(1.3e9, **tight, breadth_first_blocks="auto")
    assert auto.fits and auto.breadth_first_blocks == 4  # 7 x (4 + 1) inputs fit, 7 x 6 do not
    assert not plan(1.3e9, **tight, breadth_first_blocks=5).fits
    assert auto.inputs["breadth_first_blocks"] == "auto"
    assert "train.breadth_first_blocks=4" in " ".join(auto.notes)
    with pytest.raises(ValueError, match="breadth_first_blocks=25 exceeds n_layers=24"):
        plan(1.3e9, **kw, breadth_first_blocks=25)
    with pytest.raises(TypeError, match="breadth_first_blocks must be an int"):
        plan(1.3e9, **kw, breadth_first_blocks="most")
    assert main(["--model-size", "1b", "--checkpoint", "--grad-accumulation-steps", "8",
                 "--param-sync", "forward", "--max-grad-norm", "1",
                 "--breadth-first-blocks", "auto"]) == 0
    assert main(["--model-size", "1b", "--breadth-first-blocks", "many"]) == 2
    assert main(["--model-size", "1b", "--breadth-first-blocks", "30"]) == 2


def test_offloaded_activations_cross_during_forward_and_backward():
    """Offloaded activations are forward + backward's traffic, not the optimizer's: alone, the
    floor is the larger of the GPU's time and theirs; sharing PCIe with the optimizer's
    traffic, the floor is never less than the link's whole time."""
    slow = MachineRates(pcie_h2d_bytes_per_s=4e9, pcie_d2h_bytes_per_s=4e9,
                        pcie_both_bytes_per_s=8e9)
    act = _st(offloaded_params=0, nvme_state_bytes=0, activation_offload_bytes=4 * 10**9,
              rates=slow)
    assert act.bound == "pcie" and act.optimizer_serial_s == 0 == act.optimizer_tail_s
    assert act.fwd_bwd_s == act.overlapped_s == act.seconds["pcie"] > act.seconds["gpu"]
    both = _st(nvme_state_bytes=0, activation_offload_bytes=4 * 10**9, rates=slow)
    opt_pcie = 6 * 10**9 * 2 / 4e9  # the gradients and params each way at 4 GB/s
    assert both.optimizer_overlapped_s == pytest.approx(max(opt_pcie, both.seconds["cpu_adam"]))
    assert both.seconds["pcie"] == pytest.approx(act.seconds["pcie"] + opt_pcie)
    assert both.overlapped_s == pytest.approx(both.seconds["pcie"])  # the link's whole time
    assert both.overlapped_s == pytest.approx(both.fwd_bwd_s + both.optimizer_tail_s)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1.0, ValueError),
                                          (float("nan"), ValueError), ("1", TypeError),
                                          (True, TypeError)])
def test_a_bad_max_grad_norm_is_a_one_line_error_naming_it(value, error, capsys):
    for call, who in ((lambda: preset_plan("13b", max_grad_norm=value), "plan: "),
                      (lambda: _st(max_grad_norm=value), "step_time: ")):
        with pytest.raises(error) as err:
            call()
        message = str(err.value)
        assert message.startswith(f"{who}max_grad_norm") and "\n" not in message, message
        assert "or None for no clipping" in message
    assert main(["--model-size", "13b", "--max-grad-norm", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max_grad_norm=0.0 must be > 0.0" in err, err
    assert main(["--model-size", "13b", "--max-grad-norm", "big"]) == 2
    assert "'big' is not a number" in capsys.readouterr().err


@pytest.mark.parametrize("kw, act_per_token", [
    ({}, 0), ({"nvme_state_bytes": 0}, 0), ({"moments_dtype": "bf16"}, 0),
    ({}, 500_000), ({"activation_tier": "nvme", "nvme_state_bytes": 0}, 50_000)])
def test_the_gpu_bound_batch_makes_the_gpu_time_the_largest_other(kw, act_per_token):
    """One token per micro-batch, so any token count is reachable: at the GPU-bound batch the
    GPU's time equals the largest other resource's (within one token) and is not below it;
    one token less and another resource bounds. Offloaded activations (bytes per token x
    tokens per micro-batch) grow with the tokens as the GPU's time does, more slowly."""
    def at(micro, **more):
        return _st(**kw, **more, micro_batch_tokens=micro,
                   activation_offload_bytes=act_per_token * micro)
    t_star = at(1).gpu_bound_tokens
    assert t_star > 1
    st = at(1, grad_accumulation_steps=t_star)
    others = max(v for k, v in st.seconds.items() if k != "gpu")
    assert st.seconds["gpu"] >= others * (1 - 1e-9) and st.bound == "gpu"
    assert st.seconds["gpu"] == pytest.approx(others, rel=1e-4)
    assert at(1, grad_accumulation_steps=t_star - 1).bound != "gpu"
    # with micro-batches of 2048 tokens: the least accumulation steps reaching it
    steps = at(2048).gpu_bound_grad_accumulation_steps
    assert at(2048).gpu_bound_tokens == t_star and steps == -(-t_star // 2048)
    assert at(2048, grad_accumulation_steps=steps).bound == "gpu"
    assert steps == 1 or at(2048, grad_accumulation_steps=steps - 1).bound != "gpu"


def test_the_gpu_bounds_at_any_batch_or_at_none():
    nothing = _st(offloaded_params=0, nvme_state_bytes=0)
    assert nothing.gpu_bound_tokens == 0 and nothing.bound == "gpu"
    assert {k: v for k, v in nothing.seconds.items() if k != "gpu"} == \
        {"pcie": 0, "cpu_adam": 0, "nvme": 0}
    # activations crossing a slow link faster per token than the GPU computes: never GPU-bound
    slow = MachineRates(pcie_h2d_bytes_per_s=1e6, pcie_d2h_bytes_per_s=1e6,
                        pcie_both_bytes_per_s=2e6)
    never = _st(activation_offload_bytes=10**9, rates=slow)
    assert never.gpu_bound_tokens is None and never.gpu_bound_grad_accumulation_steps is None
    assert never.bound == "pcie"


def test_zero_nvme_state_gives_zero_nvme_time():
    ram = preset_plan("13b", state_tier="cpu")
    assert ram.used["nvme"] == 0 and ram.step_time.seconds["nvme"] == 0
    split = preset_plan("13b", host_bytes="80GiB", state_tier="split")
    nvme = next(i for i in split.items if i.name == "optimizer state, offloaded").nvme
    r = MachineRates()
    assert nvme > 0 and split.step_time.seconds["nvme"] == pytest.approx(
        nvme / r.nvme_read_bytes_per_s + nvme / r.nvme_write_bytes_per_s)
    assert split.step_time.moved["nvme_read_bytes"] == split.step_time.moved[
        "nvme_write_bytes"] == nvme


def test_the_plan_times_its_own_placement():
    """offloaded params = round(f·N), gradients off and params back in the model dtype,
    offloaded activations both ways per micro-batch; an MoE computes with its active params."""
    p = preset_plan("13b", checkpoint=True, offload_layers=10, grad_accumulation_steps=3)
    st, n = p.step_time, p.num_params
    off = round(p.offload_fraction * n)
    act = next(i for i in p.items if i.name == "activations").host  # offloaded, per micro-batch
    assert st.moved["cpu_adam_params"] == off
    assert st.moved["pcie_d2h_bytes"] == st.moved["pcie_h2d_bytes"] == 2 * off + 3 * act
    assert st.tokens == 3 * 2048 and p.inputs["grad_accumulation_steps"] == 3
    moe = plan(**MOE, batch=4)
    assert moe.step_time.moved["gpu_flops"] == 6 * moe.active_params * 4 * 2048
    assert moe.step_time.seconds["gpu"] == pytest.approx(
        6 * moe.active_params * 4 * 2048 / H200_GPU_FLOPS)


@pytest.mark.parametrize("field", [f.name for f in __import__("dataclasses").fields(MachineRates)])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_a_bad_rate_is_a_one_line_value_error_naming_the_field(field, value):
    if field == "worker_s_per_chunk" and value == 0:
        assert MachineRates(worker_s_per_chunk=0).worker_s_per_chunk == 0  # a time: none
        return
    with pytest.raises(ValueError) as err:
        MachineRates(**{field: value})
    message = str(err.value)
    assert f"MachineRates: {field}=" in message and "\n" not in message
    with pytest.raises(TypeError, match=field):
        MachineRates(**{field: "fast"})


def test_plan_and_step_time_refuse_what_is_not_rates():
    with pytest.raises(TypeError, match="rates must be a tiermem.apps.plan.MachineRates"):
        preset_plan("1b", rates={"gpu_flops": 1e15})
    with pytest.raises(ValueError, match="grad_accumulation_steps=0"):
        preset_plan("1b", grad_accumulation_steps=0)


def test_given_rates_change_the_prediction():
    fast = MachineRates(gpu_flops=2 * H200_GPU_FLOPS)
    a, b = preset_plan("13b"), preset_plan("13b", rates=fast)
    assert b.step_time.seconds["gpu"] == pytest.approx(a.step_time.seconds["gpu"] / 2)
    assert "from the given rates" in b.table() and "from the H200 machine rates" in a.table()


def test_the_table_prints_the_time_per_step():
    p = preset_plan("13b", host_bytes="80GiB", offload_fraction=0.6, checkpoint=True,
                    grad_accumulation_steps=4)
    assert p.fits and p.state_tier == "split"
    st = p.step_time
    text = p.table()
    assert ("time per optimizer step, predicted from the H200 machine rates (docs/sizing.md): "
            "8,192 tokens = 1 x 2048 x 4 accumulated") in text
    for name, key in (("GPU fwd+bwd", "gpu"), ("PCIe", "pcie"), ("CPU Adam", "cpu_adam"),
                      ("NVMe", "nvme")):
        assert re.search(rf"^  {re.escape(name)}\s+{st.seconds[key]:.3f} s  ", text, re.M), name
    assert (f"optimizer phase after backward: {st.optimizer_overlapped_s:.3f} s (PCIe, CPU "
            f"Adam, NVMe pipelined per chunk) to {st.optimizer_serial_s:.3f} s (one after "
            f"another); it overlaps up to {st.overlap_window_s:.3f} s of backward (the last "
            f"micro-batch's, 6/8 of its GPU time") in text
    assert (f"bound: NVMe; step {st.overlapped_s:.3f} s (floor: GPU fwd+bwd "
            f"{st.seconds['gpu']:.3f} s + optimizer tail {st.optimizer_tail_s:.3f} s) to "
            f"{st.serial_s:.3f} s (ceiling: nothing overlapped): "
            f"{st.tokens_per_s_overlapped:,.0f} to {st.tokens_per_s_serial:,.0f} tokens/s") in text
    assert (f"the GPU's time exceeds the optimizer's from {st.gpu_bound_tokens:,} tokens per "
            f"optimizer step (grad_accumulation_steps >= {st.gpu_bound_grad_accumulation_steps} "
            f"at 2,048 tokens per micro-batch); at 8,192 tokens the GPU computes "
            f"{100 * st.gpu_share_of_floor:.0f} % of the floor step") in text
    # with max_grad_norm nothing overlaps backward; when the GPU bounds, the tail adds to it
    clip = preset_plan("13b", host_bytes="80GiB", offload_fraction=0.6, checkpoint=True,
                       grad_accumulation_steps=64, max_grad_norm=1.0)
    ct = clip.step_time
    assert ct.bound == "gpu" and ct.optimizer_tail_s == ct.seconds["nvme"]
    assert ("it overlaps no backward (max_grad_norm=1: the CPU step waits for the global norm)"
            in clip.table())
    assert (f"bound: GPU fwd+bwd + optimizer tail {ct.optimizer_tail_s:.3f} s; step "
            f"{ct.overlapped_s:.3f} s (floor) to {ct.serial_s:.3f} s (ceiling: nothing "
            f"overlapped)") in clip.table()
    alone = preset_plan("1b").table()
    assert "the GPU's time exceeds every other resource's at any batch" in alone
    assert "the GPU computes 100 % of the floor step" in alone
    assert "optimizer phase after backward: - (no optimizer state offloaded)" in alone
    assert "bound: GPU fwd+bwd; step 0.252 s (floor) to 0.252 s" in alone
    # a plan that does not fit keeps its prediction in to_dict, not in the table
    big = preset_plan("30b")
    assert not big.fits and big.step_time is not None and "time per optimizer step" not in \
        big.table()


def test_the_command_prints_the_time_per_step_and_takes_the_batch_and_rates(capsys):
    argv = ["--model-size", "13b", "--checkpoint", "--host", "80GiB", "--offload-fraction", "0.6"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    assert "2,048 tokens = 1 x 2048 x 1 accumulated" in one
    for row in ("GPU fwd+bwd", "PCIe", "CPU Adam", "NVMe", "optimizer phase after backward",
                "bound: NVMe", "the GPU's time exceeds the optimizer's from"):
        assert row in one, row
    assert main([*argv, "--grad-accumulation-steps", "8"]) == 0
    assert "16,384 tokens = 1 x 2048 x 8 accumulated" in capsys.readouterr().out
    assert main([*argv, "--json", "--grad-accumulation-steps", "8", "--nvme-read", "3.48",
                 "--nvme-write", "4.16", "--gpu-tflops", "1000"]) == 0
    data = json.loads(capsys.readouterr().out)
    st = data["step_time"]
    assert set(st["seconds"]) == set(RESOURCES) and st["tokens"] == 16384
    assert st["rates"]["nvme_read_bytes_per_s"] == 3.48e9 and st["rates"]["gpu_flops"] == 1e15
    want = preset_plan("13b", checkpoint=True, host_bytes="80GiB", offload_fraction=0.6,
                       grad_accumulation_steps=8,
                       rates=MachineRates(nvme_read_bytes_per_s=3.48e9,
                                          nvme_write_bytes_per_s=4.16e9, gpu_flops=1e15))
    assert st == json.loads(json.dumps(want.to_dict()))["step_time"]
    assert st["max_grad_norm"] is None and st["overlap_window_s"] > 0
    assert main([*argv, "--json", "--max-grad-norm", "1.0"]) == 0
    clip = json.loads(capsys.readouterr().out)
    assert clip["inputs"]["max_grad_norm"] == clip["step_time"]["max_grad_norm"] == 1.0
    assert clip["step_time"] == json.loads(json.dumps(preset_plan(
        "13b", checkpoint=True, host_bytes="80GiB", offload_fraction=0.6,
        max_grad_norm=1.0).to_dict()))["step_time"]
    assert clip["step_time"]["overlap_window_s"] == 0
    assert st["seconds"]["nvme"] == pytest.approx(
        preset_plan("13b", checkpoint=True, host_bytes="80GiB", offload_fraction=0.6)
        .step_time.seconds["nvme"] / 2)
    for bad in (["--nvme-read", "0"], ["--gpu-tflops", "fast"], ["--grad-accumulation-steps", "0"]):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err
        assert err.strip() and ("is not a positive number" in err or
                                "grad_accumulation_steps=0" in err), err


def test_sizing_doc_time_example_is_what_the_command_prints(capsys):
    """docs/sizing.md section 4 pastes the time block of a ``tiermem plan`` run: every pasted
    line is printed now, in order."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "sizing.md").read_text()
    block = re.search(r"```text\n\$ tiermem plan (.*?)\n(.*?)```", text, re.S)
    assert block, "docs/sizing.md lost its time-per-step example"
    assert main(block.group(1).split()) == 0
    printed = capsys.readouterr().out.splitlines()
    at = 0
    for line in block.group(2).splitlines():
        if line != "...":
            assert line in printed[at:], line
            at = printed.index(line, at) + 1


def test_sizing_doc_quotes_the_presets_predictions():
    """The comparison table of docs/sizing.md quotes what examples/train_large.py's plan
    predicts for the 13B and 20B presets at the 4 micro-batches their logged runs accumulated
    (their --dry-run then, max_grad_norm 1.0 as now), and the paragraph after it what it
    predicts at the presets' own accumulation now (the GPU's time the largest)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    train_large = _train_large()
    lines = (root / "docs" / "sizing.md").read_text().splitlines()
    text = " ".join(lines)
    for preset in ("h200_13b_nvme", "h200_20b_bf16"):
        path = str(root / "examples" / "configs" / "large" / f"{preset}.yaml")
        now = train_large.make_plan(train_large.load(path))
        accum = now.inputs["grad_accumulation_steps"]
        st = now.step_time
        assert st.bound == "gpu" and st.max_grad_norm == 1.0
        assert (f"`{preset}.yaml` {accum} ({st.tokens:,} tokens; predicted "
                f"{st.overlapped_s:.1f} s floor to {st.serial_s:.1f} s ceiling, the GPU "
                f"{100 * st.gpu_share_of_floor:.0f} % of the floor)") in text, (preset, st)
        cfg = train_large.load(path, grad_accumulation_steps=4)
        st = train_large.make_plan(cfg).step_time
        assert st.tokens == 8192 and st.bound == "nvme" and st.overlap_window_s == 0
        row = next(line for line in lines
                   if f"`{preset}.yaml` dry run when it accumulated 4 micro-batches" in line)
        assert (f"{st.overlapped_s:.2f} s (NVMe bound: GPU {st.seconds['gpu']:.2f} s + NVMe "
                f"{st.seconds['nvme']:.2f} s) to {st.serial_s:.2f} s; CPU Adam "
                f"{st.seconds['cpu_adam']:.2f} s") in row, \
            (preset, st.seconds, st.overlapped_s, st.serial_s)


# ------------------------------------------------- the GPU lane (HybridAdam gpu_step_fraction)


def _train_large():
    return load_example("train_large")


RAM_20B = str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "configs" / "large" /
              "h200_20b_ram.yaml")


# What step_time printed before it knew the GPU lane (commit 1fc67cc), to the last bit.
BEFORE_LANE = {
    "13b split": ({"gpu": 1.6143441188931187, "pcie": 0.3352464435797665,
                   "cpu_adam": 2.0246084177545693, "nvme": 17.889943970291775},
                  21.86414295051923, 90783,
                  {"pcie_d2h_bytes": 15508500480.0, "cpu_adam_params": 7754250240.0,
                   "nvme_read_bytes": 16949551104.0}),
    "13b activations": ({"gpu": 1.210758089169839, "pcie": 0.2873848031128405,
                         "cpu_adam": 1.6534302078328982, "nvme": 0.0},
                        3.151573100115578, 8391,
                        {"pcie_d2h_bytes": 13294420992.0, "cpu_adam_params": 6332637696.0,
                         "nvme_read_bytes": 0.0}),
    "20b ram": ({"gpu": 10.173741087029187, "pcie": 0.6514322011673152,
                 "cpu_adam": 3.0329361539855073, "nvme": 0.0},
                13.858109442182009, 9769,
                {"pcie_d2h_bytes": 30135253626.0, "cpu_adam_params": 15067626813.0,
                 "nvme_read_bytes": 0.0}),
    "step_time bf16": ({"gpu": 1.2491297564003703, "pcie": 0.2594033722438392,
                        "cpu_adam": 1.2077294685990339, "nvme": 8.443854995579132},
                       11.160117592822376, 55377,
                       {"pcie_d2h_bytes": 12e9, "cpu_adam_params": 6e9,
                        "nvme_read_bytes": 8e9}),
}


def _lane_cases(**kw):
    """The configurations of BEFORE_LANE, their StepTime with ``kw`` (gpu_step_fraction) and
    the rates of then: no worker time per chunk (MachineRates.worker_s_per_chunk) and the
    checkpointed forward + backward at the 6·N rate (gpu_flops_checkpointed), both added since."""
    kw = {"rates": MachineRates(worker_s_per_chunk=0.0, gpu_flops_checkpointed=H200_GPU_FLOPS),
          **kw}
    tl = _train_large()
    return {
        "13b split": preset_plan("13b", host_bytes="80GiB", offload_fraction=0.6,
                                 checkpoint=True, grad_accumulation_steps=4, **kw).step_time,
        "13b activations": preset_plan("13b", checkpoint=True, offload_layers=10,
                                       grad_accumulation_steps=3, **kw).step_time,
        "20b ram": tl.make_plan(tl.load(RAM_20B, **{k: v for k, v in kw.items()
                                                    if k != "rates"}),
                                rates=kw["rates"]).step_time,
        "step_time bf16": _st(moments_dtype="bf16", **kw),
    }


@pytest.mark.parametrize("kw", [{}, {"gpu_step_fraction": 0.0}, {"gpu_step_fraction": 0}])
def test_no_gpu_lane_leaves_the_step_time_as_it_was(kw):
    """gpu_step_fraction 0 (or not given) predicts what the plan predicted before it knew the
    lane: every second, the bound, the ceiling, the GPU-bound batch and the bytes, exactly
    (the floor has since become Note [optimizer tail]'s)."""
    for name, st in _lane_cases(**kw).items():
        seconds, serial, gpu_bound, moved = BEFORE_LANE[name]
        assert st.seconds == seconds and st.serial_s == serial, name
        assert st.overlapped_s == pytest.approx(st.fwd_bwd_s + st.optimizer_tail_s)
        assert st.gpu_bound_tokens == gpu_bound
        for key, value in moved.items():
            assert st.moved[key] == value, (name, key)
        assert st.moved["pcie_h2d_bytes"] == st.moved["pcie_d2h_bytes"]
        assert st.moved["gpu_lane_params"] == st.moved["pcie_gpu_lane_bytes"] == 0
        assert st.gpu_step_fraction == 0.0


def test_the_printed_plan_without_the_lane_does_not_mention_it():
    p = preset_plan("13b", host_bytes="80GiB", offload_fraction=0.6, checkpoint=True,
                    grad_accumulation_steps=4)
    assert p.table() == preset_plan("13b", host_bytes="80GiB", offload_fraction=0.6,
                                    checkpoint=True, grad_accumulation_steps=4,
                                    gpu_step_fraction=0.0).table()
    assert "lane" not in p.table() and "gpu_step_fraction" not in p.table()


@pytest.mark.parametrize("moments, w", [("fp32", 12), ("bf16", 8)])
def test_half_on_the_gpu_lane_halves_cpu_adam_and_sends_its_state_over_pcie(moments, w):
    """s = 0.5 of 6e9 offloaded params: the CPU steps 3e9 (half the time), and each way PCIe
    carries the CPU half's gradients / params (2 B) plus the lane half's state (w B: fp32
    master + moments); the GPU and NVMe terms do not change."""
    r = MachineRates()
    none, half = _st(moments_dtype=moments), _st(moments_dtype=moments, gpu_step_fraction=0.5)
    assert half.seconds["cpu_adam"] == pytest.approx(none.seconds["cpu_adam"] / 2)
    assert half.moved["cpu_adam_params"] == half.moved["gpu_lane_params"] == 3e9
    each_way = 3 * 10**9 * 2 + 3 * 10**9 * w
    assert half.moved["pcie_d2h_bytes"] == half.moved["pcie_h2d_bytes"] == each_way
    assert half.moved["pcie_gpu_lane_bytes"] == 3 * 10**9 * w
    assert half.seconds["pcie"] == pytest.approx(max(each_way / r.pcie_d2h_bytes_per_s,
                                                     each_way / r.pcie_h2d_bytes_per_s,
                                                     2 * each_way / r.pcie_both_bytes_per_s))
    for k in ("gpu", "nvme"):
        assert half.seconds[k] == none.seconds[k]
    assert half.moved["nvme_read_bytes"] == none.moved["nvme_read_bytes"]
    assert half.serial_s == pytest.approx(sum(half.seconds.values()))
    # all on the lane: no CPU Adam at all, the whole state both ways
    every = _st(moments_dtype=moments, gpu_step_fraction=1.0)
    assert every.seconds["cpu_adam"] == 0 and every.moved["pcie_d2h_bytes"] == 6 * 10**9 * w


def test_the_plan_times_the_lane_of_its_own_placement():
    """Through plan() and train_large's make_plan (which passes optimizer.gpu_step_fraction):
    the lane's params are round(s x round(f·N)), its state 4·state_numel(1, moments) B each
    way; offloaded activations still cross per micro-batch."""
    tl = _train_large()
    cfg = tl.load(RAM_20B, gpu_step_fraction=0.5, breadth_first_blocks=0)
    p = tl.make_plan(cfg)
    st, n = p.step_time, p.num_params
    off = round(p.offload_fraction * n)
    lane = round(0.5 * off)
    assert p.inputs["gpu_step_fraction"] == st.gpu_step_fraction == 0.5
    assert st.moved["gpu_lane_params"] == lane and st.moved["cpu_adam_params"] == off - lane
    assert st.moved["pcie_d2h_bytes"] == (off - lane) * 2 + lane * 8  # bf16 params, bf16 moments
    r = MachineRates()
    chunks = -(-off // 16777216)  # the preset's chunk_numel; lane chunks pass the worker too
    assert st.seconds["cpu_adam"] == pytest.approx(
        (off - lane) / r.cpu_adam_bf16_moments_params_per_s + chunks * r.worker_s_per_chunk)
    # the placement does not depend on it; the memory only by the lane's device slots (which
    # breadth_first_blocks auto then leaves out: fewer blocks fit)
    base = tl.make_plan(tl.load(RAM_20B, breadth_first_blocks=0))
    assert tl.make_plan(tl.load(RAM_20B, gpu_step_fraction=0.5)).breadth_first_blocks < \
        tl.make_plan(tl.load(RAM_20B)).breadth_first_blocks
    assert p.offload_fraction == base.offload_fraction
    lane_row = next(i for i in p.items if i.name == "GPU lane slots")
    assert [i for i in p.items if i is not lane_row] == base.items
    assert lane_row.gpu == 3 * 4 * 16777216 * (2 + 1)  # bf16 moments, the preset's chunk_numel
    act = preset_plan("13b", checkpoint=True, offload_layers=10, grad_accumulation_steps=3,
                      gpu_step_fraction=0.25)
    a_off = round(act.offload_fraction * act.num_params)
    a_lane = round(0.25 * a_off)
    kept = next(i for i in act.items if i.name == "activations").host
    assert act.step_time.moved["pcie_h2d_bytes"] == (a_off - a_lane) * 2 + a_lane * 12 + 3 * kept


def test_the_table_and_json_show_the_lane():
    p = preset_plan("13b", host_bytes="80GiB", offload_fraction=0.6, checkpoint=True,
                    grad_accumulation_steps=4, gpu_step_fraction=0.5)
    st, text = p.step_time, p.table()
    lane_gib = st.moved["pcie_gpu_lane_bytes"] / GiB
    assert re.search(rf"^  PCIe\s+{st.seconds['pcie']:.3f} s  .* GiB H2D \(of which "
                     rf"{lane_gib:,.1f} GiB each way: the state of the "
                     rf"{st.moved['gpu_lane_params'] / 1e9:,.2f}B params the GPU lane steps, "
                     rf"gpu_step_fraction=0.5\)$", text, re.M), text
    assert re.search(rf"^  CPU Adam\s+{st.seconds['cpu_adam']:.3f} s  "
                     rf"{st.moved['cpu_adam_params'] / 1e9:,.2f}B params \(the rest of the "
                     rf"offloaded: GPU lane\) \+ {st.moved['offloaded_chunks']:,.0f} chunks x "
                     rf"0.48 ms \(the worker's own time\)$", text, re.M), text
    assert "optimizer.gpu_step_fraction=0.5" in text
    data = json.loads(json.dumps(p.to_dict()))
    assert data["inputs"]["gpu_step_fraction"] == data["step_time"]["gpu_step_fraction"] == 0.5
    assert data["step_time"]["moved"]["pcie_gpu_lane_bytes"] == st.moved["pcie_gpu_lane_bytes"]
    # nothing offloaded: the lane has nothing to step, the note does not mention it
    alone = preset_plan("1b", gpu_step_fraction=0.5)
    assert alone.offload_fraction == 0 and "gpu_step_fraction" not in alone.table()
    assert alone.step_time.seconds["pcie"] == 0


@pytest.mark.parametrize("value, error", [(1.5, ValueError), (-0.1, ValueError),
                                          (float("nan"), ValueError), ("half", TypeError),
                                          (True, TypeError), (None, TypeError)])
def test_a_bad_gpu_step_fraction_is_a_one_line_error_naming_it(value, error):
    for call, who in ((lambda: preset_plan("13b", gpu_step_fraction=value), "plan: "),
                      (lambda: _st(gpu_step_fraction=value), "step_time: ")):
        with pytest.raises(error) as err:
            call()
        message = str(err.value)
        assert message.startswith(f"{who}gpu_step_fraction") and "\n" not in message, message
        assert "[0.0, 1.0]" in message and "share of the offloaded chunks" in message
        if error is ValueError:
            assert f"gpu_step_fraction={value!r}" in message


def test_the_command_takes_the_gpu_step_fraction(capsys):
    argv = ["--model-size", "13b", "--checkpoint", "--host", "80GiB", "--offload-fraction", "0.6",
            "--grad-accumulation-steps", "4"]
    assert main([*argv, "--gpu-step-fraction", "0.5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = preset_plan("13b", checkpoint=True, host_bytes="80GiB", offload_fraction=0.6,
                       grad_accumulation_steps=4, gpu_step_fraction=0.5)
    assert data["step_time"] == json.loads(json.dumps(want.to_dict()))["step_time"]
    assert data["step_time"]["gpu_step_fraction"] == 0.5
    assert main([*argv, "--gpu-step-fraction", "0.5"]) == 0
    assert "the GPU lane steps, gpu_step_fraction=0.5)" in capsys.readouterr().out
    assert main(argv) == 0  # default 0: as before
    assert "lane" not in capsys.readouterr().out
    assert main([*argv, "--gpu-step-fraction", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpu_step_fraction=1.5 is outside [0.0, 1.0]" in err, err
    assert main([*argv, "--gpu-step-fraction", "half"]) == 2
    assert "'half' is not a number in [0, 1]" in capsys.readouterr().err


def test_sizing_doc_quotes_the_lane_predictions():
    """docs/sizing.md section 4: the 20B RAM preset with and without --gpu-step-fraction 0.5,
    the 1.34B lane rows of the comparison table (predicted now, measured from the logs), and
    the GPU-only rows the lane's own Adam is sized by."""
    tl = _train_large()
    lines = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "sizing.md").read_text() \
        .splitlines()
    text = " ".join(lines)
    none = tl.make_plan(tl.load(RAM_20B)).step_time
    half = tl.make_plan(tl.load(RAM_20B, gpu_step_fraction=0.5)).step_time
    assert half.bound == none.bound == "gpu" and none.overlap_window_s == 0
    assert (f"predicted {none.overlapped_s:.1f} s (floor: GPU {none.seconds['gpu']:.1f} s, then "
            f"CPU Adam's {none.optimizer_tail_s:.1f} s) to {none.serial_s:.1f} s (ceiling), "
            f"{none.tokens_per_s_overlapped / 1e3:.1f}k to {none.tokens_per_s_serial / 1e3:.1f}k "
            f"tokens/s, the GPU {100 * none.gpu_share_of_floor:.0f} % of the floor") in text
    tail = {"pcie": "PCIe", "cpu_adam": "CPU Adam"}[max(("pcie", "cpu_adam"),
                                                        key=lambda k: half.seconds[k])]
    assert (f"`--gpu-step-fraction 0.5` half of the offloaded chunks go to the GPU lane (Note "
            f"[gpu lane]): predicted {half.overlapped_s:.1f} s (floor: GPU + {tail}'s "
            f"{half.optimizer_tail_s:.2f} s) to "
            f"{half.serial_s:.1f} s, {half.tokens_per_s_overlapped / 1e3:.1f}k to "
            f"{half.tokens_per_s_serial / 1e3:.1f}k tokens/s (PCIe {half.seconds['pcie']:.2f} s "
            f"for {half.moved['pcie_d2h_bytes'] / GiB:.1f} GiB each way, "
            f"{half.moved['pcie_gpu_lane_bytes'] / GiB:.1f} GiB of it lane state; CPU Adam "
            f"{half.seconds['cpu_adam']:.2f} s instead of {none.seconds['cpu_adam']:.2f} s)") \
        in text
    # the measured runs went depth-first with param_sync step: their comparison is planned so
    as_run = [tl.load(RAM_20B, breadth_first_blocks=0, **kw)
              for kw in ({}, {"gpu_step_fraction": 0.5})]
    none_run, half_run = (tl.make_plan({**c, "optimizer": dataclasses.replace(
        c["optimizer"], param_sync="step")}).step_time for c in as_run)
    assert (f"smaller than the {none_run.overlapped_s - half_run.overlapped_s:.2f} s the floor "
            f"drops (the ceiling {none_run.serial_s - half_run.serial_s:.2f} s)") in text
    names = {"gpu": "GPU", "pcie": "PCIe", "cpu_adam": "CPU Adam"}

    def measured(log, setup):
        row = re.search(rf"^{re.escape(setup)}\s+16384\s+([\d.]+)",
                        (RESULTS / log).read_text(), re.M)
        return f"{float(row[1]) / 1e3:.3f} s"

    for moments, cases in (("fp32", [(0, "bench_optim_s3_final.log", ""),
                                      (0.5, "bench_optim_s3_final.log", " gpu=0.5"),
                                      (1, "bench_optim_lane_share.log", " gpu=1")]),
                           ("bf16", [(0, "bench_optim_bf16_lane.log", " bf16m"),
                                     (1, "bench_optim_bf16_lane.log", " bf16m gpu=1")])):
        row = next(line for line in lines if line.startswith(
            "| 1.34B, 8 × 2048 tokens" if moments == "fp32" else
            "| the same with bf16 moments, `gpu_step_fraction`"))
        for s, log, suffix in cases:
            st = preset_plan("1b", offload_fraction=1.0, state_tier="cpu", moments_dtype=moments,
                             gpu_step_fraction=s).step_time
            assert st.max_grad_norm is None and st.tokens == 16384  # bench optim's setting
            assert (f"{s:g}: {st.overlapped_s:.3f} s ({names[st.bound]} bound) to "
                    f"{st.serial_s:.3f} s") in row, (moments, s, st.seconds)
            assert f"{s:g}: {measured(log, 'HybridAdam f=1 cpu' + suffix)}" in row, (moments, s)
            assert f"`{log}`" in row
    gpu_only = [float(m) for log in RESULTS.glob("bench_optim*.log") for m in re.findall(
        r"^GPU-only fused AdamW\s+16384\s+([\d.]+)", log.read_text(), re.M)]
    low, high = min(gpu_only), max(gpu_only)
    ref = REFERENCE_FWD_BWD_S * 1e3
    assert (f"roughly {low - ref:.0f}–{high - ref:.0f} ms (the GPU-only rows at 16,384 tokens "
            f"of the `bench_optim*.log` runs, {low:.1f}–{high:.1f} ms, less the {ref:.1f} ms") \
        in text
    lane_all = preset_plan("1b", offload_fraction=1.0, state_tier="cpu", gpu_step_fraction=1)
    assert f"fp32 state would take {lane_all.step_time.seconds['pcie']:.3f} s" in text


def _verdict(measured: float, st) -> str:
    """How docs/sizing.md words a measured step against the predicted [floor, ceiling]."""
    if measured < st.overlapped_s:
        return f"{abs(measured / st.overlapped_s - 1) * 100:.0f} % below the floor"
    if measured > st.serial_s:
        return f"{abs(measured / st.serial_s - 1) * 100:.0f} % above the ceiling"
    return "within"


def test_sizing_doc_says_which_measured_runs_fall_within_floor_and_ceiling():
    """The comparison table's last column, recomputed from the logs and the plan now: the 1.34B
    HybridAdam runs (bench optim: no max_grad_norm, one micro-batch, so the window is the
    backward's 4/6 of the GPU time) and the large presets' logged steps 1-4 (max_grad_norm 1.0)."""
    tl = _train_large()
    root = pathlib.Path(__file__).resolve().parents[1]
    lines = (root / "docs" / "sizing.md").read_text().splitlines()
    text = " ".join(lines)
    fp0 = preset_plan("1b", offload_fraction=1.0, state_tier="cpu").step_time
    assert fp0.overlap_window_s == pytest.approx(fp0.seconds["gpu"] * 4 / 6)
    assert (f"(window: {fp0.overlap_window_s:.3f} s, the backward's 4/6 of "
            f"{fp0.seconds['gpu']:.3f} s)") in text
    for moments, cases in (("fp32", [(0, "bench_optim_s3_final.log", ""),
                                      (0.5, "bench_optim_s3_final.log", " gpu=0.5"),
                                      (1, "bench_optim_lane_share.log", " gpu=1")]),
                           ("bf16", [(0, "bench_optim_bf16_lane.log", " bf16m"),
                                     (1, "bench_optim_bf16_lane.log", " bf16m gpu=1")])):
        row = next(line for line in lines if line.startswith(
            "| 1.34B, 8 × 2048 tokens" if moments == "fp32" else
            "| the same with bf16 moments, `gpu_step_fraction`"))
        verdicts = row.rstrip(" |").rsplit("|", 1)[1]
        for s, log, suffix in cases:
            st = preset_plan("1b", offload_fraction=1.0, state_tier="cpu", moments_dtype=moments,
                             gpu_step_fraction=s).step_time
            ms = re.search(rf"^HybridAdam f=1 cpu{re.escape(suffix)}\s+16384\s+([\d.]+)",
                           (RESULTS / log).read_text(), re.M)[1]
            assert f"{s:g}: {_verdict(float(ms) / 1e3, st)}" in verdicts, (moments, s, verdicts)
    large = root / "examples" / "configs" / "large"
    # each logged run as it ran: its chunk_numel, and depth-first with param_sync step but
    # the breadth-first preset runs of 5f5d61d
    depth_first = dict(breadth_first_blocks=0, param_sync="step")
    m4, m16 = 4194304, 16777216
    for preset, log, row_has, kw in (
            ("h200_13b_nvme", "large_13b.log", "dry run when it accumulated 4 micro-batches",
             dict(grad_accumulation_steps=4, **depth_first)),
            ("h200_20b_bf16", "large_20b.log", "dry run when it accumulated 4 micro-batches",
             dict(grad_accumulation_steps=4, **depth_first)),
            ("h200_13b_nvme", "large_13b_c0c5ed4.log", "at the 20 micro-batches it had then",
             dict(grad_accumulation_steps=20, **depth_first)),
            ("h200_20b_ram", "large_20b_ram.log", "with its 4M chunks then",
             dict(chunk_numel=m4, **depth_first)),
            ("h200_20b_ram", "large_20b_ram_lane.log", "--gpu-step-fraction 0.5",
             dict(gpu_step_fraction=0.5, chunk_numel=m4, **depth_first)),
            ("h200_20b_ram", "large_20b_ram_16m.log", "16M chunks (899), 16 micro-batches",
             dict(chunk_numel=m16, **depth_first)),
            ("h200_20b_ram", "large_20b_ram_128k.log", "64 micro-batches",
             dict(grad_accumulation_steps=64, chunk_numel=m16, **depth_first)),
            ("h200_20b_ram", "large_20b_ram_bf.log", "17 breadth-first blocks", {}),
            ("h200_20b_ram", "large_20b_ram_df.log", "in the same call", depth_first),
            ("h200_20b_ram", "large_20b_ram_128k_bf.log", "3 breadth-first blocks",
             dict(grad_accumulation_steps=64)),
            ("h200_20b_ram", "large_20b_ram_bf_4m.log", "4M chunks (3,593)",
             dict(chunk_numel=m4))):
        st = tl.make_plan(tl.load(str(large / f"{preset}.yaml"), **kw)).step_time
        steps = [float(m[2]) for m in re.finditer(r"^step (\d+) .*?, ([\d.]+) s \|",
                                                  (RESULTS / log).read_text(), re.M)
                 if int(m[1]) >= 1]
        assert len(steps) == 4
        row = next(line for line in lines if f"`{log}`" in line and row_has in line)
        assert f"{st.overlapped_s:.2f} s" in row and f"{st.serial_s:.2f} s" in row, (log, st)
        assert row.rstrip(" |").endswith(
            f"| {_verdict(min(steps), st)}; {_verdict(max(steps), st)}"), (log, row)


def test_checkpointed_runs_take_their_own_gpu_rate(capsys):
    """--gpu-tflops-checkpointed prices a checkpointed step (8·N·T); --gpu-tflops one without
    (6·N·T); each flag leaves the other kind of step alone."""
    argv = ["--model-size", "13b", "--host", "80GiB", "--offload-fraction", "0.6", "--json"]
    seconds = {}
    for ckpt in ([], ["--checkpoint"]):
        for flag in ("--gpu-tflops", "--gpu-tflops-checkpointed"):
            assert main([*argv, *ckpt, flag, "1000"]) == 0
            seconds[(bool(ckpt), flag)] = json.loads(capsys.readouterr().out)["step_time"]
    n = preset_plan("13b").active_params
    assert seconds[(False, "--gpu-tflops")]["seconds"]["gpu"] == pytest.approx(6 * n * 2048 / 1e15)
    assert seconds[(True, "--gpu-tflops-checkpointed")]["seconds"]["gpu"] == \
        pytest.approx(8 * n * 2048 / 1e15)
    assert seconds[(False, "--gpu-tflops-checkpointed")]["seconds"]["gpu"] == \
        pytest.approx(6 * n * 2048 / H200_GPU_FLOPS)
    assert seconds[(True, "--gpu-tflops")]["seconds"]["gpu"] == \
        pytest.approx(8 * n * 2048 / H200_GPU_FLOPS_CHECKPOINTED)


def test_plan_names_breadth_first_when_clipping_leaves_an_optimizer_tail(capsys):
    """With max_grad_norm and micro-batches, tiermem plan says what --param-sync forward
    --breadth-first-blocks auto would predict (the same plan() with those inputs, at the same
    offload fraction), and says nothing once the run uses it, or where it cannot help."""
    argv = ["--params", "20e9", "--layers", "48", "--d-model", "5888", "--checkpoint",
            "--moments-dtype", "bf16", "--offload-fraction", "0.74", "--state-tier", "cpu",
            "--grad-accumulation-steps", "16", "--json"]
    kw = dict(n_layers=48, d_model=5888, checkpoint=True, moments_dtype="bf16",
              offload_fraction=0.74, state_tier="cpu", grad_accumulation_steps=16,
              max_grad_norm=1.0)
    now = plan(20e9, **kw).step_time
    alt = plan(20e9, **kw, param_sync="forward", breadth_first_blocks="auto")
    assert main([*argv, "--max-grad-norm", "1"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    hint = [n for n in notes if n.startswith("faster: --param-sync forward")]
    assert hint == [
        f"faster: --param-sync forward --breadth-first-blocks auto (one process): the first "
        f"{alt.breadth_first_blocks} blocks of every micro-batch run before the rest, so "
        f"{alt.step_time.forward_overlap_s:.2f} s of the next forward runs beside the "
        f"optimizer's tail: predicted {alt.step_time.overlapped_s:.2f} s (floor) instead of "
        f"{now.overlapped_s:.2f} s, the same gradients (Note [breadth-first blocks] in "
        f"tiermem/schedule/micro_batches.py)"], notes
    assert alt.breadth_first_blocks > 0 and alt.step_time.overlapped_s < now.overlapped_s
    for extra in (["--max-grad-norm", "1", "--param-sync", "forward",
                   "--breadth-first-blocks", "auto"],  # already used
                  [],  # no clipping: the CPU step overlaps backward instead
                  ["--max-grad-norm", "1", "--grad-accumulation-steps", "1"]):  # one micro-batch
        assert main([*argv, *extra]) == 0
        notes = json.loads(capsys.readouterr().out)["notes"]
        assert not any(n.startswith("faster:") for n in notes), (extra, notes)
    assert main([*argv[:-1], "--max-grad-norm", "1"]) == 0  # the table prints it too
    assert "note: faster: --param-sync forward" in capsys.readouterr().out


# ------------------------------------------------------------------ --hf-config (issue 31 item 5)

def _llama_config_json(directory: pathlib.Path, **kw) -> pathlib.Path:
    from transformers import LlamaConfig
    base = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=4096)
    LlamaConfig(**(base | kw)).save_pretrained(directory)
    return directory / "config.json"


def test_plan_hf_config_maps_a_llama_config(tmp_path, capsys):
    """Note [hf config shape]: Llama-2-7B's config plans as the explicit shape: its exact
    parameter count (6,738,415,616, the published one), 32 x 4096, 32 heads, vocab 32000,
    seq 2048 (4096 capped), and the gated MLP's 4 x 11008 saved per token as mlp_ratio 6."""
    path = _llama_config_json(tmp_path / "llama")
    for spec in (path, path.parent):  # the file or its directory
        assert main(["--hf-config", str(spec), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        want = plan(6_738_415_616, n_layers=32, d_model=4096, n_heads=32, vocab=32000,
                    seq=2048, mlp_ratio=6, stream_weights="auto").to_dict()  # the CLI's
        assert got["num_params"] == 6_738_415_616
        assert got["notes"][-1].startswith("model from llama config")
        got["notes"] = got["notes"][:-1]
        assert got == want
    assert main(["--hf-config", str(path), "--seq", "4096", "--batch", "2"]) in (0, 1)
    assert "seq 4096" in capsys.readouterr().out


def test_plan_hf_config_counts_tied_embeddings_once(tmp_path, capsys):
    path = _llama_config_json(tmp_path / "tied", vocab_size=128, hidden_size=64,
                              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              tie_word_embeddings=True)
    assert main(["--hf-config", str(path), "--json", "--seq", "16"]) == 0
    # embedding 128x64 once, per layer 4 x 64x64 attention + 3 x 64x96 MLP + 2 norms, final norm
    assert json.loads(capsys.readouterr().out)["num_params"] == (
        128 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 96 + 2 * 64) + 64)


def test_plan_hf_config_refuses_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--hf-config", "some-org/not-cached-model"]) == 2
    err = capsys.readouterr().err
    assert "not in the local Hugging Face cache (tiermem plan does not download" in err
    (tmp_path / "empty").mkdir()
    assert main(["--hf-config", str(tmp_path / "empty")]) == 2
    assert "the directory has no config.json" in capsys.readouterr().err
    path = _llama_config_json(tmp_path / "llama")
    assert main(["--hf-config", str(path), "--layers", "4"]) == 2
    assert "--hf-config sets the shape; drop --layers" in capsys.readouterr().err
    assert main(["--hf-config", str(path), "--model-size", "7b"]) == 2  # argparse: one model


def test_configuration_doc_has_a_row_for_every_plan_flag():
    """docs/configuration.md's ``tiermem plan`` flag table names every flag the command
    documents (its deprecated spellings, hidden from --help, aside), and only those."""
    import argparse
    from tiermem.apps.plan import build_parser
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    table = text.split("## `tiermem plan` flags")[1].split("\n## ")[0]
    in_doc = {flag for line in table.splitlines() if line.startswith("| `")
              for flag in re.findall(r"`(--[a-z0-9-]+)`", line.split("|")[1])}
    parsed = {o for a in build_parser()._actions if a.help != argparse.SUPPRESS
              for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert in_doc == parsed
