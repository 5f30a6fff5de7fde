"""The mixture-of-experts model (tiermem.models.MoE) trained with HybridAdam and activation offload.

Top-2 of 8 experts on a few tokens per step: some experts receive no token in some steps, so
their params get no gradient (``p.grad is None``). torch's AdamW skips such params (their step
count and moments do not advance); HybridAdam must do exactly the same wherever their state
lives (GPU side, cpu or nvme chunks), with either param_sync, with the trace placement recording
a first backward in which they are missing, and with their block's activations offloaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import re

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.models import MoE, MoEConfig
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CFG = dict(n_layers=3, d_model=32, n_heads=2, seq_len=16, vocab=64, n_experts=8, top_k=2,
           d_expert=32)
STEPS = 8


def make_model(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(MoEConfig(**CFG))


def batch(step: int, size: int = 2, seq: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A different batch every step: 8 tokens, 16 expert slots over 8 experts per layer."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CFG["vocab"], (size, seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def idle_experts(model: MoE) -> set[tuple[int, int]]:
    """(block, expert) pairs that got no token in the last forward."""
    return {(b, e) for b, block in enumerate(model.blocks)
            for e, n in enumerate(block.moe.tokens_per_expert.tolist()) if n == 0}


def train(model, opt, steps=range(STEPS), offloader=None, set_to_none=True):
    """Train the given steps, one new batch each; return (losses, idle experts per step)."""
    losses, idle = [], []
    for step in steps:
        idx, tgt = batch(step)
        with offloader if offloader is not None else contextlib.nullcontext():
            _, loss = model(idx, tgt)
        loss.backward()
        idle.append(idle_experts(model))
        for b, e in idle[-1] if set_to_none else ():  # an expert without tokens did not run:
            assert all(p.grad is None for p in model.blocks[b].moe.experts[e].parameters())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())
    if isinstance(opt, HybridAdam):
        opt.synchronize()  # param_sync="forward": the last step's params are complete now
    return losses, idle


def reference(fused: bool = False, set_to_none: bool = True):
    """torch AdamW from the same init on the same batches: (model, optimizer, losses, idle)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **HP, fused=fused, foreach=not fused)
    losses, idle = train(model, opt, set_to_none=set_to_none)
    return model, opt, losses, idle


def assert_params(a, b, exact: bool) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(pa, pb), name
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-6, msg=name)


def assert_state_like_torch(opt: HybridAdam, model: MoE, ref_opt, ref: MoE) -> None:
    """Per param: HybridAdam's step count equals torch's (0 where torch has no state: the param
    never had a gradient) and its moments match torch's to rounding (1e-6 of the moment's
    largest element: the params differ by rounding, so the gradients do too)."""
    state = opt.state_dict()["state"]
    for i, ((name, _), p_ref) in enumerate(zip(model.named_parameters(), ref.parameters())):
        theirs = ref_opt.state.get(p_ref, {})
        assert int(state[i]["step"]) == int(theirs.get("step", 0)), name
        for moment in ("exp_avg", "exp_avg_sq"):
            want = theirs.get(moment, torch.zeros_like(p_ref))
            scale = float(want.abs().max())
            torch.testing.assert_close(state[i][moment], want, rtol=1e-6, atol=1e-6 * scale,
                                       msg=lambda m: f"{name} {moment}: {m}")


@pytest.fixture(scope="module", autouse=True)
def one_thread_module():
    """conftest's ``one_thread`` for the whole module: the module-scoped reference run must see
    the same thread count as the tests compared with it (tiny tensors: one intra-op thread, as
    OpenMP spinning against HybridAdam's worker and the store's I/O threads on 2 cores is slow)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ref_run():
    return reference()


def test_config_counts_and_errors():
    cfg = MoEConfig(**CFG)
    model = MoE(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.blocks[0].moe.experts[0].parameters())
    assert cfg.expert_params() == expert
    assert cfg.num_params() - cfg.active_params() == CFG["n_layers"] * 6 * expert
    idx, tgt = batch(0)
    model(idx, tgt)
    for block in model.blocks:  # every token took exactly top_k experts
        assert int(block.moe.tokens_per_expert.sum()) == idx.numel() * 2
    with pytest.raises(ValueError, match="MoEConfig.top_k=9 exceeds n_experts=8"):
        MoEConfig(top_k=9)
    with pytest.raises(ValueError, match="MoEConfig.n_experts=0 must be an int >= 1"):
        MoEConfig(n_experts=0)
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_heads=4"):
        MoEConfig(d_model=30)
    with pytest.raises(ValueError, match="sequence length 17 exceeds MoEConfig.seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_moe_layer_matches_a_naive_per_token_loop():
    """The grouped index_select/index_add computation equals routing each token on its own."""
    torch.manual_seed(0)
    layer = MoE(MoEConfig(**CFG)).blocks[0].moe
    x = torch.randn(2, 5, CFG["d_model"])
    got = layer(x)
    flat = x.reshape(-1, CFG["d_model"])
    probs = torch.softmax(layer.router(flat), dim=-1)
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        w, e = probs[t].topk(2)
        w = w / w.sum()
        for k in range(2):
            want[t] += w[k] * layer.experts[int(e[k])](flat[t:t + 1])[0]
    torch.testing.assert_close(got.reshape(-1, CFG["d_model"]), want, rtol=1e-5, atol=1e-6)


def test_reference_run_has_experts_without_tokens(ref_run):
    """The parity tests below are only meaningful if experts do go without tokens (and come
    back): assert it on the batches they use."""
    _, _, losses, idle = ref_run
    assert idle[0], "some expert must go without tokens in the first step on these batches"
    assert any(be not in later for be in idle[0] for later in idle[1:])  # and get tokens later
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_moe_parity_with_torch_adamw(tmp_path, ref_run, fraction, tier):
    """HybridAdam (param_sync step and forward) with and without activation offload of blocks
    0 and 1 (every saved tensor, int64 routing indices included) trains the MoE like torch's
    AdamW: the same loss at every step and the same params to rounding; activation offload and
    param_sync change nothing at all (bit-identical)."""
    ref, ref_opt, ref_losses, ref_idle = ref_run
    runs = {}
    for sync in ("step", "forward"):
        for act in (False, True):
            model = make_model()
            spill = tmp_path / f"{sync}-{act}"
            spill.mkdir()
            opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction,
                             state_tier=tier, nvme_dir=str(spill),
                             chunk_numel=1024, param_sync=sync)
            offloader, store = None, None
            if act:
                store = TierStore(StoreConfig(gpu_bytes="16MiB", cpu_bytes="16MiB",
                                              nvme_bytes=0))
                offloader = offload_activations(model.blocks, store=store, layers=[0, 1],
                                                min_offload_bytes=0)
            losses, idle = train(model, opt, offloader=offloader)
            assert idle == ref_idle  # the same routing in every step
            torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
            assert_params(model, ref, exact=False)
            assert_state_like_torch(opt, model, ref_opt, ref)
            if act:
                stats = offloader.stats()
                assert stats["offloaded"] > 0 and stats["reloads"] > 0
                assert stats["live_keys"] == 0  # every record freed by backward
                offloader.close()
                store.close()
            if fraction > 0:
                assert opt.state_numel()["offloaded"] > 0
            opt.close()
            runs[sync, act] = (losses, model)
    base_losses, base = runs["step", False]
    for key, (losses, model) in runs.items():
        assert losses == base_losses, key
        assert_params(model, base, exact=True)


def test_shared_store_with_the_trace_eviction_policy(tmp_path, ref_run):
    """One store for both offloaders with ``policy="trace"`` and lookahead prefetch, small
    enough that state chunks and activations move between RAM and NVMe every step. Routing
    changes the step's accesses (how many tensors each expert saves, which chunks complete only
    in step()), so the recording is not followed; the policy must still only choose victims,
    never change results."""
    ref, _, ref_losses, _ = ref_run
    store = TierStore(StoreConfig(gpu_bytes="1MiB", cpu_bytes="1MiB", nvme_bytes="64MiB",
                                  nvme_dir=str(tmp_path), device="cpu", pool_slab_bytes="64KiB",
                                  io_chunk_bytes="64KiB", io_backend="posix", policy="trace",
                                  prefetch_lookahead=4))
    model = make_model()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     state_tier="nvme", store=store, param_sync="forward")
    offloader = offload_activations(model.blocks, store=store, layers=[0, 1], min_offload_bytes=0)
    losses = []
    for step in range(STEPS):
        idx, tgt = batch(step)
        with offloader:
            _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        store.mark_step()
        losses.append(loss.item())
    opt.synchronize()
    moved = store.stats()["moved_bytes"]
    assert moved.get("nvme->cpu", 0) > 0 and moved.get("cpu->nvme", 0) > 0
    assert store._policy.counts["steps"] == STEPS
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    assert_params(model, ref, exact=False)
    offloader.close()
    opt.close()
    store.close()


def test_fraction_zero_is_bit_identical_to_torch_fused():
    """No offloaded state: HybridAdam runs torch's fused kernel on the same tensors, and skips
    the params without gradients just as torch does."""
    ref, _, ref_losses, _ = reference(fused=True)
    model = make_model()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.0)
    losses, _ = train(model, opt)
    opt.close()
    assert losses == ref_losses
    assert_params(model, ref, exact=True)


def test_accumulation_and_checkpointing_with_experts_idle_in_one_micro_batch():
    """Two micro-batches per step: an expert that gets tokens in one micro-batch only has its
    gradient accumulated once, so no gradient hook ships it early (it is shipped in step());
    with checkpointed blocks (routing recomputed in backward) and activation offload, HybridAdam
    still matches torch's AdamW step for step."""
    def run(make_opt, checkpoint, offload):
        torch.manual_seed(0)
        model = MoE(MoEConfig(**CFG), checkpoint=checkpoint)
        opt = make_opt(model)
        ctx = (offload_activations(model.blocks, layers=[0, 1], min_offload_bytes=0)
               if offload else contextlib.nullcontext())
        losses, partial = [], 0
        for step in range(STEPS):
            idle = []
            for micro in range(2):
                idx, tgt = batch(100 + 2 * step + micro)
                with ctx:
                    _, loss = model(idx, tgt)
                (loss / 2).backward()
                idle.append(idle_experts(model))
                losses.append(loss.item())
            partial += len(idle[0] ^ idle[1])  # idle in exactly one of the two micro-batches
            opt.step()
            opt.zero_grad(set_to_none=True)
        if offload:
            ctx.close()
        return losses, model, opt, partial

    ref_losses, ref, _, partial = run(
        lambda m: torch.optim.AdamW(m.parameters(), **HP, foreach=True), False, False)
    assert partial > 0
    losses, model, opt, _ = run(lambda m: HybridAdam(
        m.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024, grad_accumulation_steps=2,
        param_sync="forward"), True, True)
    opt.synchronize()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    assert_params(model, ref, exact=False)
    opt.close()


@pytest.mark.parametrize("sync", ["step", "forward"])
def test_zero_grad_in_place_steps_idle_experts_like_torch(sync):
    """``zero_grad(set_to_none=False)``: an expert that had a gradient once keeps a zero one
    when it later gets no token, and torch's AdamW steps it with that zero gradient (decaying
    its moments and its weights). HybridAdam does the same; with param_sync="forward" the
    zeroing must not overwrite gradients the CPU side has not read yet."""
    ref, ref_opt, ref_losses, ref_idle = reference(set_to_none=False)
    model = make_model()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     param_sync=sync)
    losses, idle = train(model, opt, set_to_none=False)
    assert idle == ref_idle
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    assert_params(model, ref, exact=False)
    assert_state_like_torch(opt, model, ref_opt, ref)
    opt.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_trace_placement_with_an_expert_missing_from_the_recorded_backward(tmp_path, ref_run,
                                                                           tier):
    """Note [trace placement]: the first backward records the gradient order, and experts that
    got no token then have no place in it (they are planned last, as given). Such an expert
    gets gradients in later steps: its state is allocated with everyone else's at the first
    step, stays untouched until its first gradient (step count 0, like torch, which has no
    state for it yet), and then steps exactly like torch's."""
    ref, ref_opt, ref_losses, ref_idle = ref_run
    comeback = {be for be in ref_idle[0] if any(be not in idle for idle in ref_idle[1:])}
    assert comeback, "an expert idle in step 0 must get tokens later on these batches"
    model = make_model()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, state_tier=tier,
                     nvme_dir=str(tmp_path), chunk_numel=1024)  # placement="trace" (default)
    assert opt._trace_placement
    names = [n for n, _ in model.named_parameters()]
    missing = {i for i, n in enumerate(names)
               for b, e in ref_idle[0] if n.startswith(f"blocks.{b}.moe.experts.{e}.")}
    losses, _ = train(model, opt, steps=[0])
    # the recorded order holds exactly the params that had a gradient in the first backward
    recorded = {i for (_, i) in opt._arrived}
    assert recorded == set(range(len(names))) - missing
    steps = opt.state_dict()["state"]
    assert all(int(steps[i]["step"]) == (0 if i in missing else 1) for i in range(len(names)))
    later, _ = train(model, opt, steps=range(1, STEPS))
    losses += later
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    assert_params(model, ref, exact=False)
    assert_state_like_torch(opt, model, ref_opt, ref)
    # the comeback experts did step (their step count advanced past 0) ...
    state = opt.state_dict()["state"]
    for b, e in comeback:
        idx = [i for i, n in enumerate(names) if n.startswith(f"blocks.{b}.moe.experts.{e}.")]
        assert all(int(state[i]["step"]) > 0 for i in idx)
    # ... and the partition put the params seen in the first backward's order first: the GPU
    # side holds the params whose gradients arrived last (the first layers), none of them missing
    on_gpu = {pc.param for pc in opt._groups[0].plan.gpu_pieces}
    assert on_gpu and on_gpu.isdisjoint(missing)
    opt.close()



def test_example_trains_with_offload_like_without(capsys):
    """examples/train_moe.py: HybridAdam + activation offload vs torch AdamW without offload,
    the same losses (exit 0), with experts left without tokens in some step."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
    spec = importlib.util.spec_from_file_location("train_moe_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--steps", "3", "--layers", "2", "--d-model", "32"]) == 0
    out = capsys.readouterr().out
    assert "matches the run without offload" in out
    idle = [int(n) for n in re.findall(r"experts without tokens: (\d+)", out)]
    assert len(idle) == 3 and max(idle) > 0
    assert module.main(["--steps", "2", "--layers", "2", "--d-model", "32",
                        "--tolerance", "-1"]) == 1  # a difference over the tolerance fails
