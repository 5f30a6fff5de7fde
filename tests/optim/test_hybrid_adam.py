"""HybridAdam against torch.optim.AdamW/Adam: parity, clipping, accumulation, state dicts."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import re

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem import StoreConfig, TierStore
from tiermem.config import OptimizerConfig
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_models(seed=0, dtype=torch.float32, device="cpu", **kw):
    torch.manual_seed(seed)
    model = TinyGPT(**kw).to(device=device, dtype=dtype)
    return model


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]


def train(model, opt, steps, accum=2, device="cpu", clip=None, freeze_at=None):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    losses = []
    for step in range(steps):
        if freeze_at is not None:
            model.blocks[-1].fc.weight.requires_grad_(step % freeze_at != 0)
        total = 0.0
        for micro in range(accum):
            idx, tgt = make_batch(step * accum + micro)
            _, loss = model(idx.to(device), tgt.to(device))
            (loss / accum).backward()
            total += loss.item() / accum
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(total)
    return losses


def assert_params_close(a, b, exact):
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(pa, pb), n
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_parity_with_torch_adamw_scheduler_and_accumulation(tmp_path, tier, fraction):
    ref = make_models()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(param_groups(ref), **HP, fused=True)
    opt = HybridAdam(param_groups(model), **HP, offload_fraction=fraction, state_tier=tier,
                     nvme_dir=str(tmp_path), chunk_numel=1024, grad_accumulation_steps=2)
    ref_losses = train(ref, ref_opt, 50)
    losses = train(model, opt, 50)
    opt.close()
    # fraction 0 runs torch's own fused kernel on the same tensors: bit-identical
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    assert_params_close(model, ref, exact=fraction == 0.0)


def test_overlap_off_gives_the_same_result_as_overlap_on():
    a, b = make_models(), make_models()
    opt_a = HybridAdam(a.parameters(), **HP, offload_fraction=0.7, chunk_numel=2048, overlap=True)
    opt_b = HybridAdam(b.parameters(), **HP, offload_fraction=0.7, chunk_numel=2048, overlap=False)
    assert train(a, opt_a, 10, accum=1) == train(b, opt_b, 10, accum=1)
    assert_params_close(a, b, exact=True)
    opt_a.close(), opt_b.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_param_sync_forward_matches_step_and_torch(tmp_path, tier, fraction):
    """Note [forward sync]: step() returns before the CPU side is done and each module's
    forward waits for its own params; the arithmetic is the same, so the result is bit-identical
    to param_sync="step" (and within 1e-6 of torch's AdamW), with accumulation, a scheduler and
    frozen params (whose chunks complete the step from the first gradient hook)."""
    ref, a, b = make_models(), make_models(), make_models()
    ref_opt = torch.optim.AdamW(param_groups(ref), **HP, fused=True)
    kw = dict(**HP, offload_fraction=fraction, state_tier=tier, nvme_dir=str(tmp_path),
              chunk_numel=1024, grad_accumulation_steps=2)
    opt_a = HybridAdam(param_groups(a), **kw, param_sync="step")
    opt_b = HybridAdam(param_groups(b), **kw, param_sync="forward")
    ref_losses = train(ref, ref_opt, 12, freeze_at=4)
    losses_a = train(a, opt_a, 12, freeze_at=4)
    losses_b = train(b, opt_b, 12, freeze_at=4)
    assert opt_b._pending  # the last step is still open...
    opt_b.synchronize()  # ...until someone needs the params
    assert not opt_b._pending
    assert losses_b == losses_a
    assert_params_close(b, a, exact=True)
    assert losses_b == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    assert_params_close(b, ref, exact=False)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    for i in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][i][name], sb["state"][i][name]), (i, name)
    opt_a.close(), opt_b.close()


def test_param_sync_forward_waits_per_module_and_completes_on_state_dict():
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     param_sync="forward")
    idx, tgt = make_batch(0)
    model(idx, tgt)[1].backward()  # the first step records the gradient order (no overlap)
    opt.step()
    opt.synchronize()
    model(idx, tgt)[1].backward()
    opt.step()
    assert opt._pending
    # the embedding's chunks are stepped last (its gradient comes last): once its forward may
    # run, every chunk is done and the step is completed
    model.tok(idx)
    assert not opt._pending
    model(idx, tgt)[1].backward()
    opt.step()
    assert opt._pending
    opt.state_dict()  # reads the state: completes the step first
    assert not opt._pending
    with pytest.raises(ValueError, match="param_sync='sideways' is not one of 'step', 'forward'"):
        HybridAdam(model.parameters(), param_sync="sideways")
    opt.close()


class _ReversedMLP(torch.nn.Module):
    """Layers registered in the reverse of the order they run in."""

    def __init__(self, width=64, depth=6):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.square().mean()


def _reversed_mlp_and_adamw(**kw):
    """A _ReversedMLP with HybridAdam (1024-element chunks, ``kw``) and a copy with torch's
    fused AdamW."""
    torch.manual_seed(0)
    model = _ReversedMLP()
    ref = copy.deepcopy(model)
    opt = HybridAdam(model.parameters(), **HP, chunk_numel=1024, **kw)
    return model, ref, opt, torch.optim.AdamW(ref.parameters(), **HP, fused=True)


@pytest.mark.parametrize("placement", ["trace", "given"])
def test_trace_placement_keeps_the_first_executed_layers_on_the_gpu(placement):
    """Note [trace placement]: the first backward records the gradient order; the first step
    plans from it, so the GPU keeps the layers that run first (registered last here), whatever
    the order of model.parameters(); results match torch's AdamW either way."""
    model, ref, opt, ref_opt = _reversed_mlp_and_adamw(offload_fraction=0.5, placement=placement)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(8, 64, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    on_gpu = {pc.param for pc in opt._groups[0].plan.gpu_pieces}
    names = [n for n, _ in model.named_parameters()]
    first_run = {i for i, n in enumerate(names) if n.startswith(("layers.5.", "layers.4.", "layers.3."))}
    if placement == "trace":
        assert on_gpu <= first_run  # the last registered run first: they stay on the GPU
    else:
        assert on_gpu.isdisjoint({i for i, n in enumerate(names) if n.startswith("layers.5.")})
    assert_params_close(model, ref, exact=False)
    opt.close()
    with pytest.raises(ValueError, match="placement='everywhere' is not one of 'trace', 'given'"):
        HybridAdam(model.parameters(), placement="everywhere")


@pytest.mark.parametrize("clip", [None, 1.0])
def test_clipping_steps_the_chunks_in_forward_order(clip, monkeypatch):
    """Note [stepping order]: without clipping the worker steps chunks as their gradients
    complete (the last layers first); with ``max_grad_norm`` nothing can start before step(),
    which ships in execution order, so the first layers' chunks are stepped first. The chunk
    numbers follow execution order (trace placement), and the results match AdamW either way."""
    from tiermem.optim.chunk_worker import ChunkWorker
    stepped = []
    original = ChunkWorker._step_chunk

    def record(self, g, c, copies):
        stepped.append((g, c))
        return original(self, g, c, copies)

    monkeypatch.setattr(ChunkWorker, "_step_chunk", record)
    model, ref, opt, ref_opt = _reversed_mlp_and_adamw(offload_fraction=0.8, max_grad_norm=clip)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 64, generator=gen)
        stepped.clear()
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).backward()
            if clip is not None and o is ref_opt:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()
            o.zero_grad(set_to_none=True)
    chunks = [(0, c) for c in range(len(opt._groups[0].plan.chunks))]
    assert len(chunks) > 4
    if clip is not None:
        assert stepped == chunks
        assert opt._layout.expected_order() == stepped
    else:  # a param's chunks complete together (ascending), the params in backward order
        assert sorted(stepped) == chunks and stepped[0][1] > stepped[-1][1]
        assert stepped[:4] == chunks[-4:] and stepped[-4:] == chunks[:4]
    assert_params_close(model, ref, exact=False)
    opt.close()


@pytest.mark.parametrize("adamw", [True, False])
def test_adam_l2_and_maximize_parity(adamw):
    ref, model = make_models(), make_models()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = cls(ref.parameters(), **HP, maximize=True, fused=True)
    opt = HybridAdam(model.parameters(), **HP, maximize=True, adamw=adamw, offload_fraction=0.6,
                     chunk_numel=1024)
    assert train(model, opt, 8, accum=1) == pytest.approx(train(ref, ref_opt, 8, accum=1), rel=1e-6)
    assert_params_close(model, ref, exact=False)
    opt.close()


def test_clipping_is_correct_for_grads_already_off_the_gpu():
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024,
                     max_grad_norm=0.05)
    ref_losses = train(ref, ref_opt, 10, accum=1, clip=0.05)
    losses = train(model, opt, 10, accum=1)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_params_close(model, ref, exact=False)
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        opt.clip_grad_norm_(1.0)
    opt.close()


@pytest.mark.parametrize("tier, share, sync", [("cpu", 0.5, "step"), ("cpu", 1.0, "forward"),
                                                ("nvme", 0.5, "forward"), ("nvme", 1.0, "step")])
def test_gpu_lane_parity_with_torch_adamw(tmp_path, tier, share, sync):
    """Note [gpu lane]: chunks stepped by streaming their state through the device (here the
    CPU: the same code, synchronous copies, torch's fused kernel) match torch's AdamW like the
    CPU kernel does, with accumulation, a scheduler, frozen params and both param syncs."""
    ref, model, cpu_only = make_models(), make_models(), make_models()
    ref_opt = torch.optim.AdamW(param_groups(ref), **HP, fused=True)
    kw = dict(**HP, offload_fraction=1.0, state_tier=tier, nvme_dir=str(tmp_path),
              chunk_numel=1024, grad_accumulation_steps=2, param_sync=sync)
    opt = HybridAdam(param_groups(model), **kw, gpu_step_fraction=share)
    opt_cpu = HybridAdam(param_groups(cpu_only), **kw)
    ref_losses = train(ref, ref_opt, 12, freeze_at=4)
    losses = train(model, opt, 12, freeze_at=4)
    train(cpu_only, opt_cpu, 12, freeze_at=4)
    opt.synchronize()
    stats = opt.step_stats()
    chunks = sum(len(g.plan.chunks) for g in opt._groups)
    assert stats["chunks"] == chunks and stats["gpu_chunks"] == int(share * chunks)
    assert opt.memory_bytes()["gpu"] > 0  # the lane's device slots
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    assert_params_close(model, ref, exact=False)
    sa, sb = opt.state_dict(), opt_cpu.state_dict()
    for i in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa["state"][i][name], sb["state"][i][name], rtol=1e-6,
                                       atol=1e-9)
        assert torch.equal(sa["state"][i]["step"], sb["state"][i]["step"])
    opt.close(), opt_cpu.close()


def test_gpu_lane_with_clipping_and_bf16_moments_tracks_the_cpu_kernel():
    a, b = make_models(), make_models()
    kw = dict(**HP, offload_fraction=1.0, chunk_numel=1024, max_grad_norm=0.05,
              moments_dtype=torch.bfloat16)
    opt_a = HybridAdam(a.parameters(), **kw, gpu_step_fraction=0.5)
    opt_b = HybridAdam(b.parameters(), **kw)
    assert train(a, opt_a, 10, accum=1) == pytest.approx(train(b, opt_b, 10, accum=1), rel=1e-6)
    assert_params_close(a, b, exact=False)
    opt_a.close(), opt_b.close()


def test_a_failing_gpu_lane_chunk_fails_the_step_and_releases_its_state(monkeypatch):
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     gpu_step_fraction=0.5)
    train(model, opt, 1, accum=1)  # allocates the state (trace placement)
    state = opt.state_dict()
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise OSError("lane kernel failed")

    monkeypatch.setattr(opt._lane, "_fused_runs", broken)
    with pytest.raises(RuntimeError, match="lane kernel failed"):
        train(model, opt, 1, accum=1)
    assert calls
    # every state blob was released (held keys can never leave their tier): only the
    # group's two pinned rings stay held
    held = [k for k, e in opt._store._entries.items() if e.holds]
    assert sorted(k[-1] for k in held) == ["grad", "out"], held
    monkeypatch.undo()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"step\(\) refused"):  # Note [failed steps]
        train(model, opt, 1, accum=1)
    opt.zero_grad(set_to_none=True)
    opt.load_state_dict(state)
    train(model, opt, 1, accum=1)  # a loaded state: the optimizer takes the next step
    opt.close()


def test_params_without_grad_are_skipped_like_torch():
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024)
    ref_losses = train(ref, ref_opt, 9, accum=1, freeze_at=3)
    assert train(model, opt, 9, accum=1, freeze_at=3) == pytest.approx(ref_losses, rel=1e-6)
    assert_params_close(model, ref, exact=False)
    opt.close()


def test_too_many_backward_passes_are_reported():
    model = make_models()
    # with overlap=False the check is deterministic; with overlap the offloaded params are
    # already updated during the first backward, so autograd may object first
    opt = HybridAdam(model.parameters(), **HP, grad_accumulation_steps=1, chunk_numel=1024,
                     overlap=False)
    for seed in range(2):
        idx, tgt = make_batch(seed)
        model(idx, tgt)[1].backward()
    with pytest.raises(RuntimeError, match="grad_accumulation_steps=1"):
        opt.step()
    opt.close()


def run_steps(model, opt, sched, start, steps):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(step)
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def decay(s):
    return 1.0 / (1 + 0.1 * s)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_state_dict_round_trip_resumes_the_same_trajectory(tmp_path, tier):
    model = make_models()
    opt = HybridAdam(param_groups(model), **HP, offload_fraction=0.5, state_tier=tier,
                     nvme_dir=str(tmp_path), chunk_numel=1024)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    run_steps(model, opt, sched, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, buf)
    cont = run_steps(model, opt, sched, 3, 3)
    opt.close()

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # no arbitrary unpickling
    model2 = make_models(seed=1)
    model2.load_state_dict(saved["model"])
    opt2 = HybridAdam(param_groups(model2), **HP, offload_fraction=0.5, state_tier=tier,
                      nvme_dir=str(tmp_path), chunk_numel=1024)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, decay)  # before the loads, as in torch
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert run_steps(model2, opt2, sched2, 3, 3) == cont
    assert_params_close(model2, model, exact=True)
    opt2.close()


def test_state_dict_matches_torch_format_and_rejects_another_model():
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024)
    train(ref, ref_opt, 2, accum=1)
    train(model, opt, 2, accum=1)
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for i in theirs["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine["state"][i][name], theirs["state"][i][name],
                                       rtol=1e-6, atol=1e-7)
        assert float(mine["state"][i]["step"]) == float(theirs["state"][i]["step"])
    other = HybridAdam(make_models(d_model=16).parameters(), **HP, chunk_numel=1024)
    with pytest.raises(ValueError, match="has shape .* but the param has"):
        other.load_state_dict(mine)
    opt.close()  # its params are free for another HybridAdam (Note [one optimizer per param])
    fewer = HybridAdam(list(model.parameters())[:-1], **HP, chunk_numel=1024)
    with pytest.raises(ValueError, match="params in the state"):
        fewer.load_state_dict(mine)
    for o in (other, fewer):
        o.close()


def test_gpu_state_falls_in_proportion_to_the_fraction():
    sizes = {}
    for fraction in (0.0, 0.25, 0.5, 1.0):
        opt = HybridAdam(make_models().parameters(), **HP, offload_fraction=fraction,
                         chunk_numel=1024)
        sizes[fraction] = opt.memory_bytes()["gpu"]
        opt.close()
    total = sizes[0.0]
    for fraction, nbytes in sizes.items():
        assert abs(nbytes - (1 - fraction) * total) <= 8 * 4  # split within one element
    assert sizes[1.0] == 0


@pytest.mark.parametrize("kw,err,message", [
    # one bad value per argument; the checks are tiermem.names' (as OptimizerConfig's)
    (dict(lr=-1.0), ValueError, "HybridAdam: lr=-1.0 must be >= 0.0"),
    (dict(lr="fast"), TypeError, "HybridAdam: lr must be a number, got str 'fast'"),
    (dict(lr=float("nan")), ValueError, "HybridAdam: lr=nan is not a number"),
    (dict(betas=(0.9, 1.0)), ValueError, "HybridAdam: betas[1]=1.0 must be < 1.0"),
    (dict(betas=(-0.1, 0.9)), ValueError, "HybridAdam: betas[0]=-0.1 must be >= 0.0"),
    (dict(betas=(0.9,)), ValueError, "HybridAdam: betas=(0.9,) must be two numbers"),
    (dict(eps=-1e-8), ValueError, "HybridAdam: eps=-1e-08 must be >= 0.0"),
    (dict(weight_decay=-0.1), ValueError, "HybridAdam: weight_decay=-0.1 must be >= 0.0"),
    (dict(adamw="yes"), ValueError, "HybridAdam: adamw='yes' is not one of True, False"),
    (dict(maximize=None), ValueError, "HybridAdam: maximize=None is not one of True, False"),
    (dict(overlap=1), ValueError, "HybridAdam: overlap=1 is not one of True, False"),
    (dict(offload_fraction=1.5), ValueError,
     "HybridAdam: offload_fraction=1.5 is outside [0.0, 1.0]; it is the fraction of parameter "
     "bytes whose optimizer state leaves the GPU (0.0 = none, 1.0 = all)"),
    (dict(offload_fraction=True), TypeError,
     "HybridAdam: offload_fraction must be a number in [0.0, 1.0], got bool True"),
    (dict(gpu_step_fraction=1.2), ValueError,
     "HybridAdam: gpu_step_fraction=1.2 is outside [0.0, 1.0]; it is the share of the "
     "offloaded chunks the GPU steps"),
    (dict(state_tier="tape"), ValueError,
     "HybridAdam: state_tier='tape' is not one of 'cpu', 'nvme', 'split'; cpu is pinned RAM, "
     "nvme spill files, split RAM up to the store's cpu budget and the rest on NVMe"),
    (dict(state_tier="nvme"), ValueError, "HybridAdam: state_tier='nvme' needs a spill directory"),
    (dict(chunk_numel=1000), ValueError,
     "HybridAdam: chunk_numel=1000 must be an int >= 1024 (elements); or None to size it from "
     "the model"),
    (dict(chunk_numel=4096.0), TypeError,
     "HybridAdam: chunk_numel must be an int >= 1024 (elements), got float 4096.0"),
    (dict(max_grad_norm=0.0), ValueError,
     "HybridAdam: max_grad_norm=0.0 must be > 0.0; or None for no clipping"),
    (dict(grad_accumulation_steps=0), ValueError,
     "HybridAdam: grad_accumulation_steps=0 must be an int >= 1; the backward passes per step()"),
    (dict(grad_accumulation_steps=2.0), TypeError,
     "HybridAdam: grad_accumulation_steps must be an int >= 1, got float 2.0"),
    (dict(bucket_numel=0), ValueError,
     "HybridAdam: bucket_numel=0 must be an int >= 1 (elements); the elements per "
     "gradient-reduce bucket"),
    (dict(moments_dtype="fp16"), ValueError,
     "HybridAdam: moments_dtype='fp16' is not a supported dtype; use one of float32, fp32, "
     "torch.float32, bfloat16, bf16, torch.bfloat16 (or the torch.dtype)"),
    (dict(moments_dtype=torch.float16), ValueError,
     "HybridAdam: moments_dtype=torch.float16 is not a supported dtype"),
    (dict(placement="random"), ValueError,
     "HybridAdam: placement='random' is not one of 'trace', 'given'; trace: the split follows "
     "the gradient order of the first backward, given: the order the params were given in"),
    (dict(param_sync="later"), ValueError,
     "HybridAdam: param_sync='later' is not one of 'step', 'forward'; step: the updated params "
     "are ready when step() returns, forward: the next forward waits per module"),
    (dict(cpu_threads=0), ValueError,
     "HybridAdam: cpu_threads=0 must be an int >= 1 (threads); or None for torch's thread count"),
    (dict(nvme_lookahead_chunks=-1), ValueError,
     "HybridAdam: nvme_lookahead_chunks=-1 must be an int >= 0 (chunks)"),
    (dict(data_parallel="on"), ValueError,
     "HybridAdam: data_parallel='on' is not one of True, False"),
])
def test_bad_arguments_are_rejected(kw, err, message):
    with pytest.raises(err, match=re.escape(message)) as info:
        HybridAdam(make_models().parameters(), **kw)
    assert "\n" not in str(info.value)  # one line, naming the field, the value and the fix


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_moments_dtype_takes_every_spelling(spelling):
    """``moments_dtype`` as tiermem.names spells dtypes: "bf16" is torch.bfloat16, stored as the
    torch.dtype, and steps exactly as an optimizer given torch.bfloat16."""
    a, b = make_models(), make_models()
    kw = dict(**HP, offload_fraction=1.0, chunk_numel=1024, placement="given")
    opt_a = HybridAdam(a.parameters(), **kw, moments_dtype=spelling)
    opt_b = HybridAdam(b.parameters(), **kw, moments_dtype=torch.bfloat16)
    fp32 = HybridAdam(make_models().parameters(), **kw, moments_dtype="fp32")
    assert opt_a.moments_dtype is torch.bfloat16 and opt_a._layout.moments_dtype is torch.bfloat16
    assert fp32.moments_dtype is torch.float32
    # bf16 moments: 8 bytes of offloaded state per param instead of 12
    assert opt_a.memory_bytes()["cpu"] == opt_b.memory_bytes()["cpu"]
    assert opt_a.memory_bytes()["cpu"] < fp32.memory_bytes()["cpu"]
    assert train(a, opt_a, 3, accum=1) == train(b, opt_b, 3, accum=1)
    assert_params_close(a, b, exact=True)
    for st in opt_a.state_dict()["state"].values():  # the moments were held in bf16
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[name], st[name].bfloat16().float())
    for o in (opt_a, opt_b, fp32):
        o.close()


# OptimizerConfig field -> (values the config accepts, a value it rejects, the field named in
# the rejection). Every field of the config is listed (the test checks it), so a new field
# must be added here and checked alike by both.
_CONFIG_CASES = {
    "lr": ([0.0, 1e-3, 1], -1.0, "lr"),
    "betas": ([(0.9, 0.999), [0.8, 0.95], (0, 0.5)], [0.9, 1.0], "betas[1]"),
    "eps": ([0.0, 1e-8], -1e-8, "eps"),
    "weight_decay": ([0.0, 0.1], -0.1, "weight_decay"),
    "adamw": ([True, False], "yes", "adamw"),
    "maximize": ([True, False], 1, "maximize"),
    "offload_fraction": ([0.0, 0.5, 1, 1.0], 1.5, "offload_fraction"),
    "state_tier": (["cpu", "nvme", "split"], "disk", "state_tier"),
    "nvme_dir": ([None, "<tmp>"], None, None),  # any path; refused only where it is unused
    "overlap": ([True, False], 1, "overlap"),
    "chunk_numel": ([None, 1024, 4096], 1000, "chunk_numel"),
    "max_grad_norm": ([None, 1.0, 5], 0, "max_grad_norm"),
    "grad_accumulation_steps": ([None, 1, 4], 0, "grad_accumulation_steps"),
    "moments_dtype": (["float32", "fp32", "bf16", "bfloat16", "torch.bfloat16", torch.bfloat16,
                       torch.float32], "fp16", "moments_dtype"),
    "cpu_threads": ([None, 1, 2], 0, "cpu_threads"),
    "nvme_lookahead_chunks": ([0, 2], -1, "nvme_lookahead_chunks"),
    "data_parallel": ([None, False], "on", "data_parallel"),
    "bucket_numel": ([1, 1 << 20], 0, "bucket_numel"),
    "param_sync": (["step", "forward"], "later", "param_sync"),
    "placement": (["trace", "given"], "random", "placement"),
    "gpu_step_fraction": ([0.0, 0.5, 1], 2, "gpu_step_fraction"),
    "rollback_bytes": ([0, 4096, "1MiB"], -1, "rollback_bytes"),
}


def test_optimizer_config_and_hybrid_adam_accept_and_reject_alike(tmp_path):
    """OptimizerConfig and HybridAdam check each shared field with the same tiermem.names helper:
    every value the config accepts builds a HybridAdam, from the config's kwargs() and given
    as is, and a bad one is refused by both with the same exception, naming the same field
    with the same words (what follows the prefix, up to the fix after ';')."""
    assert set(_CONFIG_CASES) == {f.name for f in dataclasses.fields(OptimizerConfig)}
    store = TierStore(StoreConfig(cpu_bytes="4MiB", nvme_bytes="16MiB", nvme_dir=str(tmp_path),
                                  pool_slab_bytes="256KiB"))

    def context(field, value):  # what a value needs around it (not part of the check)
        if field == "state_tier" and value == "nvme":
            return {"nvme_dir": str(tmp_path)}, None
        if field == "state_tier" and value == "split":
            return {}, store
        return {}, None

    for field, (good, bad, named) in _CONFIG_CASES.items():
        for value in good:
            value = str(tmp_path) if value == "<tmp>" else value
            extra, st = context(field, value)
            cfg = OptimizerConfig(**{field: value}, **extra)
            kws = [cfg.kwargs(store=st)]
            if not (field == "grad_accumulation_steps" and value is None):
                # (null there means "the training loop's count": kwargs() leaves it out)
                kws.append({**OptimizerConfig().kwargs(store=st), **extra, field: value})
            for kw in kws:
                HybridAdam(make_models().parameters(), **kw).close()
        if named is None:
            continue
        with pytest.raises((ValueError, TypeError)) as by_config:
            OptimizerConfig(**{field: bad})
        with pytest.raises((ValueError, TypeError)) as by_optimizer:
            HybridAdam(make_models().parameters(), **{**OptimizerConfig().kwargs(), field: bad})
        assert by_config.type is by_optimizer.type, field
        c, o = str(by_config.value), str(by_optimizer.value)
        assert c.startswith(f"optimizer.{named}") and o.startswith(f"HybridAdam: {named}"), (c, o)
        assert (c.removeprefix("optimizer.").split(";")[0]
                == o.removeprefix("HybridAdam: ").split(";")[0]), (c, o)
    # betas that are not a pair: both name betas
    with pytest.raises(ValueError, match=re.escape("optimizer.betas=[0.9] must be two numbers")):
        OptimizerConfig(betas=[0.9])
    with pytest.raises(ValueError, match=re.escape("HybridAdam: betas=[0.9] must be two numbers")):
        HybridAdam(make_models().parameters(), betas=[0.9])
    store.close()


def test_store_checks(tmp_path):
    store = TierStore(StoreConfig(cpu_bytes="16MiB", nvme_bytes=0))
    with pytest.raises(ValueError, match="no nvme tier"):
        HybridAdam(make_models().parameters(), state_tier="nvme", store=store)
    meta = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="params are on meta but the store's device is cpu"):
        HybridAdam(meta.parameters(), store=store)
    opt = HybridAdam(make_models().parameters(), store=store, chunk_numel=1024)
    assert store.used_bytes("cpu") == 0  # Note [trace placement]: allocated once planned...
    opt.chunk_tiers()  # ...at the first step, or when asked about before it
    assert store.used_bytes("cpu") > 0
    opt.close()
    small = TierStore(StoreConfig(cpu_bytes="64KiB", nvme_bytes=0))
    with pytest.raises(ValueError, match="store.s cpu tier has .* free; the offloaded state needs"):
        HybridAdam(make_models().parameters(), store=small, chunk_numel=1024)
    small.close()
    store.close()


@pytest.mark.parametrize("state_tier", ["cpu", "split"])
@pytest.mark.parametrize("ending", ["close", "drop"])
def test_optimizers_one_after_another_on_a_callers_store(tmp_path, state_tier, ending):
    """Note [lifetime]: an optimizer on a caller's store frees every key it made when closed or
    dropped (the store's budget is the caller's again, its other keys stay), and the next
    optimizer, which may get the dead one's ``id``, trains from a clean slate (H200: the next
    one's first step hit a still-held ring key of a dead one)."""
    cpu_bytes = "1MiB" if state_tier == "cpu" else "448KiB"  # split: part of it spills
    store = TierStore(StoreConfig(cpu_bytes=cpu_bytes, nvme_dir=str(tmp_path), nvme_bytes="4MiB",
                                  pool_slab_bytes="64KiB"))
    store.put("mine", torch.ones(8))
    losses = []
    for _ in range(4):
        model = make_models()
        opt = HybridAdam(model.parameters(), lr=1e-2, store=store, chunk_numel=1024,
                         state_tier=state_tier)
        losses.append(train(model, opt, 3, accum=1))
        tiers = opt.chunk_tiers()
        assert any(isinstance(k, tuple) and k[0] == "hybrid_adam" for k in store.keys())
        assert state_tier == "cpu" or "nvme" in str(tiers), tiers
        if ending == "close":
            opt.close()
        del opt
        gc.collect()
        assert store.keys() == ["mine"]
        assert sum(store.used_bytes(t) for t in ("gpu", "cpu", "nvme")) == 32  # "mine" alone
    assert all(losses_i == losses[0] for losses_i in losses), losses
    store.close()


@pytest.mark.cuda
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_param_sync_forward_is_bit_identical_to_step(tmp_path, fraction):
    """Note [forward sync] on the GPU: each module's forward waits (host, then stream) for the
    H2D copies of its own chunks; a slow H2D stream must not let a forward read a stale param."""
    def run(param_sync):
        torch.manual_seed(0)
        model = TinyGPT(d_model=64, n_layers=4).cuda().to(torch.bfloat16)
        opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=4096,
                         param_sync=param_sync)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        losses = []
        for step in range(10):
            idx, tgt = make_batch(step)
            _, loss = model(idx.cuda(), tgt.cuda())
            loss.backward()
            opt.step()
            with torch.cuda.stream(opt._copier.h2d_stream):
                torch.cuda._sleep(2_000_000)  # H2D copies queue behind ~1 ms of spinning
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
        opt.synchronize()
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return losses, params

    losses_step, params_step = run("step")
    losses_fwd, params_fwd = run("forward")
    assert losses_fwd == losses_step
    for a, b in zip(params_fwd, params_step):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("sync", ["step", "forward"])
def test_cuda_gpu_lane_is_bit_identical_to_torch_cuda_fused(tmp_path, sync):
    """Note [gpu lane] with every chunk on the lane: the same torch CUDA kernel on the same fp32
    masters and gradients as fp32 masters + torch.optim.AdamW(fused=True), so bf16 params,
    masters and moments are bit-identical for every step (no teacher forcing), with
    accumulation and a slow H2D stream."""
    torch.manual_seed(0)
    model = TinyGPT(d_model=64, n_layers=4).cuda().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(masters, **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=4096,
                     gpu_step_fraction=1.0, grad_accumulation_steps=2, param_sync=sync)
    for step in range(8):
        for micro in range(2):
            idx, tgt = make_batch(2 * step + micro)
            (model(idx.cuda(), tgt.cuda())[1] / 2).backward()
            (ref_model(idx.cuda(), tgt.cuda())[1] / 2).backward()
        opt.step()
        with torch.cuda.stream(opt._copier.h2d_stream):
            torch.cuda._sleep(2_000_000)  # state loads queue behind ~1 ms of spinning
        opt.zero_grad()
        for m, p in zip(masters, ref_model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters()):
                p.copy_(m)
    opt.synchronize()
    assert opt.step_stats()["gpu_chunks"] == opt.step_stats()["chunks"] > 0
    state = opt.state_dict()
    for i, (m, p, q) in enumerate(zip(masters, ref_model.parameters(), model.parameters())):
        assert torch.equal(q, p), i
        assert torch.equal(state["state"][i]["master"], m.detach().cpu()), i
        assert torch.equal(state["state"][i]["exp_avg"], ref_opt.state[m]["exp_avg"].cpu()), i
    opt.close()


@pytest.mark.cuda
def test_cuda_native_step_matches_torch_cuda_fused_on_same_inputs():
    """Isolates the kernel: identical inputs to the native CPU step and torch's CUDA kernel."""
    from tiermem.optim.cpu_adam import adam_step_

    gen = torch.Generator().manual_seed(0)
    n = 100_003
    master = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    ref = master.cuda().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], **HP, fused=True)
    for step in range(1, 11):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        out = torch.empty(n, dtype=torch.bfloat16)
        adam_step_(master, grad, m, v, step=step, lr=HP["lr"], beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.1, param_out=out, offset=0, numel=n)
        ref.grad = grad.float().cuda()
        ref_opt.step()
        torch.testing.assert_close(master, ref.detach().cpu(), rtol=1e-6, atol=1e-7)


def test_bf16_moments_halve_the_state_and_track_a_bf16_moment_reference():
    """bf16 moments: a deliberate precision trade. Reference: the same update with moments
    rounded to bf16 after each step (pure torch); state bytes fall from 12 to 8 per param."""
    model = make_models()
    ref = copy.deepcopy(model)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     moments_dtype=torch.bfloat16)
    fp32 = HybridAdam(make_models().parameters(), **HP, offload_fraction=1.0, chunk_numel=1024)
    numel = sum(p.numel() for p in model.parameters())
    saved = fp32.memory_bytes()["cpu"] - opt.memory_bytes()["cpu"]
    assert abs(saved - 4 * numel) <= 2 * 4096  # 12 -> 8 B/param (the last chunk rounds to 4 KiB)
    fp32.close()
    params = list(ref.parameters())
    lr, (b1, b2), eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
    # One step at a time from HybridAdam's state (teacher forcing): the kernel fuses the moment
    # update (fma) before rounding it to bf16 and torch's ops round in between, so a stored moment
    # may land one bf16 ulp away; compounded over steps that is drift, not error.
    for step in range(1, 6):
        before = opt.state_dict()["state"]
        idx, tgt = make_batch(step)
        model(idx, tgt)[1].backward()
        ref(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad()
        after = opt.state_dict()["state"]
        with torch.no_grad():
            for i, (p, q) in enumerate(zip(params, model.parameters())):
                g = p.grad
                m32 = before[i]["exp_avg"].clone().lerp_(g, 1 - b1)
                v32 = before[i]["exp_avg_sq"].clone().mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - lr * wd)
                denom = (v32.sqrt() / (1 - b2 ** step) ** 0.5).add_(eps)
                p.addcdiv_(m32, denom, value=-lr / (1 - b1 ** step))
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
                for name, ref_m in (("exp_avg", m32), ("exp_avg_sq", v32)):
                    torch.testing.assert_close(after[i][name], ref_m.bfloat16().float(),
                                               rtol=2 ** -7, atol=1e-30)
                p.copy_(q)  # the next step starts from HybridAdam's params
                p.grad = None
    state = opt.state_dict()["state"]
    assert state[0]["exp_avg"].dtype == torch.float32  # reported in torch's format
    opt.close()


def test_clipping_after_backward_is_refused_with_overlap_and_exact_without():
    """torch's clip_grad_norm_ after backward: with overlap the grads were already copied off the
    GPU, so HybridAdam refuses the step; with overlap=False grads are copied in step() and
    torch's own clipping is exact."""
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024)
    idx, tgt = make_batch(0)
    model(idx, tgt)[1].backward()  # the first step only records the gradient order, it copies
    opt.step()                     # in step() (Note [trace placement]); the second overlaps
    opt.zero_grad()
    model(idx, tgt)[1].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with pytest.raises(RuntimeError, match="changed after backward had already copied it"):
        opt.step()
    opt.close()

    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024,
                     overlap=False)
    assert train(model, opt, 4, accum=1, clip=0.05) == pytest.approx(
        train(ref, ref_opt, 4, accum=1, clip=0.05), rel=1e-6)
    assert_params_close(model, ref, exact=False)
    opt.close()


@pytest.mark.parametrize("fraction", [0.74, 1.0])
def test_the_chunk_size_changes_no_bit(fraction):
    """chunk_numel decides how the offloaded elements are cut into chunks (the unit of the CPU
    step and its copies), not what they compute: 8 steps of bf16 training with bf16 moments,
    clipping and 2 micro-batches (the 20B RAM preset's settings, which took 16M chunks instead
    of 4M) give the same losses and params with chunks of 1024, 4096 and 16384 elements."""
    runs = []
    for chunk in (1024, 4096, 16384):
        model = make_models(dtype=torch.bfloat16)
        opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, state_tier="cpu",
                         moments_dtype=torch.bfloat16, max_grad_norm=1.0, chunk_numel=chunk,
                         grad_accumulation_steps=2)
        losses = train(model, opt, 8)
        opt.close()
        runs.append((losses, model))
    start = make_models(dtype=torch.bfloat16)
    assert not all(torch.equal(a, b) for a, b in zip(start.parameters(),
                                                     runs[0][1].parameters()))  # it trained
    for losses, model in runs[1:]:
        assert losses == runs[0][0]
        assert_params_close(runs[0][1], model, exact=True)
