"""The mixture-of-experts transformer (tiermem.models.MoE) on CUDA (issue 20, item 3): HybridAdam
(offload fraction 0.5 and 1.0, state in pinned RAM and on NVMe) and activation offload of every
block train it as torch's fused AdamW without any offload, with experts that receive no token in
some steps (Note [training parity] in tests/test_cuda_training_parity.py).

Note [MoE parity on CUDA]:
- Model: 4 blocks, d_model 1024, 16 heads, 8 experts of hidden width 2048 per block, top-2,
  vocab 32000 (218M parameters, 117M of them used per token), sequence 1024, micro-batch 4: 4096
  tokens, 8192 expert slots per block and step. bf16 (one row fp32); torch's default kernels
  (no SDPA backend pinned).
- Idle experts. A router drawn at random spreads 8192 slots evenly (about 1024 per expert), so
  at this shape no expert would ever go without tokens and the idle-expert path (``p.grad is
  None``: torch's AdamW skips the param, HybridAdam must too wherever its state lives) would not
  run. :func:`route_rare_experts` gives the router the imbalance of a partly collapsed one:
  experts 6 and 7 of every block (``RARE``) get a logit about ``OFFSET`` (16) below the others
  for every token except their own trigger token (ids 0 and 1), for which theirs is about
  ``MARGIN`` (6) above. Each step's batch is random tokens (ids >= 2) with a batch-dependent
  set of triggers written in (``TRIGGERS_AT``): an expert whose trigger is absent receives no
  token in any block, one whose trigger is present receives exactly the trigger positions. The
  first step has no trigger (the first backward, which HybridAdam's trace placement records,
  lacks both experts), and both come back later. Every run asserts that its idle experts are
  exactly the schedule's. How: the trigger embeddings are scaled by ``EMBED_SCALE`` (8) so the
  residual stream of a trigger position points along its embedding u in every block (cosine
  ~0.99); each block's ln2 bias is ``OFFSET``·v for a unit v orthogonal to the triggers'
  embeddings, every router row is made orthogonal to v (the bias moves no other expert's
  logit), and the rare expert's row gets ``-v + (OFFSET + MARGIN)/sqrt(d)·u``: logit
  ``-OFFSET + (OFFSET + MARGIN)·cos(u, x)`` plus the random row's ~0.6, i.e. ~+6 on its
  trigger and -16 ± 1.5 elsewhere. Measured at this shape in fp32 on the CPU through the 8
  reference steps and the batch after them: a rare expert's logit stayed >= 10.3 below the
  second-best other expert's for every non-trigger token and >= 2.8 above the best other's for
  every trigger token, every other expert got >= 463 of the 8192 slots, and the loss fell from
  10.55 to 9.96.
- Reference: the same model, checkpointing and dtype with ``torch.optim.AdamW(fused=True)`` and
  no offload at all: on fp32 master copies of the bf16 params (made once from the initial
  weights, params = masters rounded; what HybridAdam keeps), on the params themselves in fp32.
  Run ``REFERENCE_RUNS`` times: the run-to-run noise of the default kernels. HybridAdam steps
  part of the state with its CPU kernel, which may round a master one ulp away from torch's
  CUDA kernel (tests/optim/test_hybrid_adam_cuda.py's premise); when the references happen to
  agree exactly (the LoRA references did on the H200) that alone would fail a correct row, so
  one more reference run pushes every updated master one ulp in a random direction after every
  step (that test's measure of the drift such differences cause) and counts in the noise. At
  this shape in bf16 on the CPU (where the plain runs agree exactly) that run's loss moved by
  at most 5.1e-4 and its params by 0.57 (L2), while training moved them 14.8 and a stale
  update's 1e-3 relative loss shift is 1e-2. Nothing of a row's state is copied into its
  reference.
- A row passes :func:`assert_parity` (the loss at every step and one batch after the last,
  the first-step gradients and the final params within ``NOISE_MULTIPLE`` x that noise), and
  exactly: its idle experts per step are the schedule's, and every param's optimizer step count
  (``state_dict()["step"]``) equals torch's (0 for a param that never had a gradient), which is
  the number of steps its expert received tokens: a HybridAdam that stepped an idle expert, or
  skipped a returning one, fails here whatever the noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from test_cuda_training_parity import (NOISE_MULTIPLE, REFERENCE_RUNS, Reference, Run,
                                       assert_parity, first_step_noise, summarise)
from tiermem import StoreConfig, TierStore
from tiermem.models import MoE, MoEConfig
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam

STEPS = 8
HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

RARE = {6: 0, 7: 1}  # expert (in every block) -> its trigger token id
# the experts whose trigger is in each step's batch; the last entry: the batch after the last step
TRIGGERS_AT = [(), (6,), (6, 7), (), (7,), (6, 7), (6,), (), (6, 7)]
OFFSET = 16.0  # a rare expert's logit below the others' for tokens other than its trigger
MARGIN = 6.0  # its logit for its trigger token
EMBED_SCALE = 8.0  # trigger embeddings scaled: a trigger's residual stream points along it
TRIGGER_SHARE = 64  # one position in TRIGGER_SHARE holds each trigger present in a batch


@dataclasses.dataclass
class Shape:
    name: str
    cfg: MoEConfig
    batch: int
    device: str

    @property
    def triggers_per_batch(self) -> int:
        return max(1, self.batch * self.cfg.seq_len // TRIGGER_SHARE)


CUDA_SHAPE = Shape("cuda", MoEConfig(n_layers=4, d_model=1024, n_heads=16, seq_len=1024,
                                     vocab=32000, n_experts=8, top_k=2, d_expert=2048), 4, "cuda")
# the same machinery on the CPU at a toy shape: checks the test's own logic where CUDA is absent
CPU_SHAPE = Shape("cpu", MoEConfig(n_layers=2, d_model=128, n_heads=4, seq_len=64, vocab=512,
                                   n_experts=8, top_k=2, d_expert=128), 2, "cpu")

# rows: (dtype, checkpoint, activation offload of every block, HybridAdam keyword arguments)
ROWS = {
    "f0.5-cpu-bf16": ("bf16", False, False, dict(offload_fraction=0.5, state_tier="cpu")),
    "f1-nvme-bf16": ("bf16", False, False, dict(offload_fraction=1.0, state_tier="nvme")),
    "f0.5-act-checkpoint-bf16": ("bf16", True, True, dict(offload_fraction=0.5,
                                                          state_tier="cpu")),
    "f0.5-act-fp32": ("fp32", False, True, dict(offload_fraction=0.5, state_tier="cpu")),
}  # grouped by reference (dtype, checkpoint): one reference in host memory at a time


# ------------------------------------------------------------------------- model and data


@torch.no_grad()
def route_rare_experts(model: MoE) -> None:
    """Bias every block's router so that expert ``e`` of ``RARE`` gets a token only where the
    token is ``RARE[e]`` (Note [MoE parity on CUDA]); call it on the fp32 model."""
    d = model.cfg.d_model
    emb = model.tok.weight
    for token in RARE.values():
        emb[token] *= EMBED_SCALE
    u = torch.stack([emb[t] for t in RARE.values()]).float().cpu()
    basis, _ = torch.linalg.qr(u.T)  # (d, len(RARE)): the triggers' span, orthonormal
    v = torch.randn(d, generator=torch.Generator().manual_seed(7))
    v -= basis @ (basis.T @ v)
    v /= v.norm()
    u /= u.norm(dim=1, keepdim=True)
    v, u = v.to(emb.device), u.to(emb.device)
    for block in model.blocks:
        block.ln2.bias.copy_(OFFSET * v)
        router = block.moe.router.weight  # (n_experts, d)
        router -= (router @ v)[:, None] * v  # the bias adds nothing to the other experts' logits
        for row, expert in enumerate(RARE):
            router[expert] += (OFFSET + MARGIN) / math.sqrt(d) * u[row] - v


def build(shape: Shape, dtype: str, checkpoint: bool) -> MoE:
    torch.manual_seed(0)
    with torch.device(shape.device):
        model = MoE(shape.cfg, checkpoint=checkpoint)
    route_rare_experts(model)
    return model.to(DTYPES[dtype])


def make_batch(shape: Shape, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (never a trigger) with the triggers of ``TRIGGERS_AT[step]`` written at
    ``triggers_per_batch`` random positions each; the target of each token is a fixed
    function of it (learnable: the loss falls)."""
    cfg, n = shape.cfg, shape.triggers_per_batch
    gen = torch.Generator().manual_seed(3000 + step)
    idx = torch.randint(len(RARE), cfg.vocab, (shape.batch, cfg.seq_len), generator=gen)
    where = torch.randperm(idx.numel(), generator=gen)[:n * len(RARE)].view(len(RARE), n)
    flat = idx.view(-1)
    for (expert, token), pos in zip(RARE.items(), where):
        if expert in TRIGGERS_AT[step]:
            flat[pos] = token
    return idx.to(shape.device), ((idx * 7 + 3) % cfg.vocab).to(shape.device)


def expected_idle(shape: Shape, step: int) -> set[tuple[int, int]]:
    """(block, expert) pairs that receive no token in ``step`` by construction."""
    return {(b, e) for b in range(shape.cfg.n_layers) for e in RARE if e not in TRIGGERS_AT[step]}


def expected_steps(model: MoE) -> list[int]:
    """Per param: the optimizer steps it takes (one per step in which it has a gradient)."""
    active = {e: sum(e in TRIGGERS_AT[s] for s in range(STEPS)) for e in RARE}
    out = []
    for name, _ in model.named_parameters():
        parts = name.split(".")  # blocks.<b>.moe.experts.<e>.<fc|out>.<weight|bias>
        rare = parts[2:4] == ["moe", "experts"] and int(parts[4]) in RARE
        out.append(active[int(parts[4])] if rare else STEPS)
    return out


def flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """All gradients, flat, fp32; zeros where a param has none (an idle expert)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1)
                      for p in params])


# ------------------------------------------------------------------------- optimizers


class FusedAdamW:
    """The reference: ``torch.optim.AdamW(fused=True)``, no offload; on fp32 master copies of
    non-fp32 params (made here from the initial weights; params = masters rounded), on fp32
    params themselves. A param without a gradient is skipped, as torch skips it. ``jitter``:
    after every step push each updated master one ulp in a random direction."""

    def __init__(self, params: list[torch.Tensor], jitter: bool = False) -> None:
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone()
                        for p in params]
        self.opt = torch.optim.AdamW(self.masters, **HP, fused=True)
        self.gen = (torch.Generator(device=params[0].device).manual_seed(11) if jitter else None)

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for m, p in zip(self.masters, self.params):
            if p.grad is None:
                continue
            if self.gen is not None:
                up = torch.rand(m.shape, generator=self.gen, device=m.device) < 0.5
                m.copy_(torch.nextafter(m, torch.where(up, torch.inf, -torch.inf).to(m.dtype)))
            if m is not p:
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m, p in zip(self.masters, self.params):
            p.grad = m.grad = None

    def param_steps(self) -> list[int]:
        return [int(self.opt.state[m]["step"]) if m in self.opt.state else 0
                for m in self.masters]


def hybrid_steps(opt: HybridAdam, n: int) -> list[int]:
    state = opt.state_dict()["state"]
    return [int(state[i]["step"]) for i in range(n)]


# ------------------------------------------------------------------------- training


@dataclasses.dataclass
class Trained:
    run: Run
    idle: list[set[tuple[int, int]]]  # per step: (block, expert) pairs that got no token
    steps: list[int]  # per param: optimizer steps taken (0 where never stepped)
    offloaded_state: int = 0  # HybridAdam: param elements whose state is off the GPU


def train(shape: Shape, dtype: str, checkpoint: bool, act: bool = False,
          hybrid: dict | None = None, jitter: bool = False, nvme_dir=None) -> Trained:
    """``STEPS`` steps, a new batch each; ``hybrid`` None: the reference (:class:`FusedAdamW`)."""
    model = build(shape, dtype, checkpoint)
    params = list(model.parameters())
    if hybrid is None:
        opt = FusedAdamW(params, jitter)
    else:
        kw = dict(hybrid)
        if kw.get("state_tier") == "nvme":
            kw["nvme_dir"] = str(nvme_dir)
        opt = HybridAdam(params, **HP, **kw)
    off, store = contextlib.nullcontext(), None
    if act:  # on CUDA the private store a user gets; the toy's on the CPU (also on a GPU host)
        if shape.device == "cpu":
            store = TierStore(StoreConfig(device="cpu", gpu_bytes="64MiB", cpu_bytes="64MiB",
                                          nvme_bytes=0))
        off = offload_activations(model.blocks, store=store, layers=range(len(model.blocks)),
                                  min_offload_bytes=0)
    losses, counts = [], []
    for step in range(STEPS):
        idx, tgt = make_batch(shape, step)
        with off:
            _, loss = model(idx, tgt)
        counts.append(torch.stack([block.moe.tokens_per_expert for block in model.blocks]))
        loss.backward()
        if step == 0:  # before any update: differences here are the kernels' noise alone
            grads0 = flat_grads(params).cpu()
        opt.step()
        opt.zero_grad(set_to_none=True)  # an idle expert's grads stay None: skipped
        losses.append(loss.detach())
    if isinstance(opt, HybridAdam):
        opt.synchronize()
    with torch.no_grad():  # the final params, seen through the loss of one more batch
        losses.append(model(*make_batch(shape, STEPS))[1])
    if shape.device == "cuda":
        torch.cuda.synchronize()  # test only: read the results
    idle = [{(b, e) for b, e in (c == 0).nonzero().tolist()} for c in counts]
    run = Run(torch.stack(losses).double().cpu(),
              torch.cat([p.detach().float().reshape(-1).cpu() for p in params]), grads0,
              off.stats()["offloaded"] if act else 0)
    if isinstance(opt, HybridAdam):
        got = Trained(run, idle, hybrid_steps(opt, len(params)), opt.state_numel()["offloaded"])
        opt.close()
    else:
        got = Trained(run, idle, opt.param_steps())
    if act:
        assert off.stats()["live_keys"] == 0, "every offloaded record is freed by backward"
        off.close()
    if store is not None:
        store.close()
    del model, opt, params
    if shape.device == "cuda":
        torch.cuda.empty_cache()
    return got


def grad_noise(shape: Shape, dtype: str, checkpoint: bool) -> float:
    """:func:`first_step_noise` of the model on the first batch, before any optimizer."""
    model = build(shape, dtype, checkpoint)
    params = list(model.parameters())
    batch = make_batch(shape, 0)

    def step_grads(model: MoE = model, params: list = params) -> torch.Tensor:
        model(*batch)[1].backward()
        g = flat_grads(params)
        model.zero_grad(set_to_none=True)
        return g

    noise = first_step_noise(step_grads)
    del step_grads, model, params
    if shape.device == "cuda":
        torch.cuda.empty_cache()
    return noise


@dataclasses.dataclass
class MoEReference:
    ref: Reference  # for assert_parity: the first plain run and the noise
    idle: list[set[tuple[int, int]]]
    steps: list[int]


_REFERENCE: dict[tuple, MoEReference] = {}  # one configuration at a time (host memory)


def reference(shape: Shape, dtype: str, checkpoint: bool) -> MoEReference:
    """``REFERENCE_RUNS`` plain runs and one ulp-jittered run of :class:`FusedAdamW` without
    offload (cached per configuration); every run's idle experts must be the schedule's."""
    key = (shape.name, dtype, checkpoint)
    if key not in _REFERENCE:
        _REFERENCE.clear()
        runs = [train(shape, dtype, checkpoint) for _ in range(REFERENCE_RUNS)]
        runs.append(train(shape, dtype, checkpoint, jitter=True))
        want = [expected_idle(shape, s) for s in range(STEPS)]
        for r in runs:
            assert r.idle == want, f"idle experts per step {r.idle}, by construction {want}"
        _REFERENCE[key] = MoEReference(
            summarise([r.run for r in runs], grad_noise(shape, dtype, checkpoint)),
            runs[0].idle, runs[0].steps)
    return _REFERENCE[key]


def check_row(shape: Shape, row: str, tmp_path) -> Trained:
    """Train ``row`` and hold it to its reference: :func:`assert_parity`, the same idle experts
    in every step, the same step count per param."""
    dtype, checkpoint, act, hybrid = ROWS[row]
    ref = reference(shape, dtype, checkpoint)
    got = train(shape, dtype, checkpoint, act, hybrid, nvme_dir=tmp_path)
    assert got.idle == ref.idle, f"{row}: idle experts {got.idle}, reference {ref.idle}"
    assert got.steps == ref.steps, (
        f"{row}: optimizer steps per param {got.steps}, torch's AdamW {ref.steps}")
    assert got.offloaded_state > 0, f"{row}: no optimizer state was offloaded"
    if act:
        assert got.run.offloaded > 0, f"{row}: no activation was offloaded"
    assert_parity(got.run, ref.ref, f"moe/{row}")
    return got


def check_reference_trains(shape: Shape, stale_shift: float = 1e-3) -> MoEReference:
    """The comparison can fail: training moves the params more than 2 x NOISE_MULTIPLE x their
    noise (a row whose every update was halved would fail on its params), the loss falls, a
    loss off by ``stale_shift`` relative from step 4 on (the matrix's figure: far less than a
    stale update's) fails assert_parity, the step counts are the schedule's (idle experts
    skipped)."""
    ref = reference(shape, "bf16", False)
    a = ref.ref.run
    init = torch.cat([p.detach().float().reshape(-1).cpu()
                      for p in build(shape, "bf16", False).parameters()])
    moved = (a.params - init).norm().item()
    print(f"{shape.name}: training moved the params {moved:.3e} (L2), noise "
          f"{ref.ref.param_noise:.3e}; loss noise {ref.ref.loss_noise:.3e}")
    assert moved > 2 * NOISE_MULTIPLE * ref.ref.param_noise, (moved, ref.ref.param_noise)
    assert a.losses[-1] < a.losses[0], a.losses.tolist()
    assert ref.steps == expected_steps(build(shape, "bf16", False))
    stale = Run(a.losses.clone(), a.params.clone(), a.grads0.clone())
    stale.losses[4:] += stale_shift * a.losses[4:].abs()
    with pytest.raises(AssertionError, match="loss differs"):
        assert_parity(stale, ref.ref, "stale")
    return ref


# ------------------------------------------------------------------------- CUDA tests


@pytest.mark.cuda
def test_reference_trains_with_idle_and_returning_experts():
    ref = check_reference_trains(CUDA_SHAPE)
    assert ref.idle[0], "experts must go without tokens in the first step"
    assert any(be not in later for be in ref.idle[0] for later in ref.idle[1:])  # and return


@pytest.mark.cuda
@pytest.mark.parametrize("row", list(ROWS))
def test_moe_trains_as_torch_adamw_without_offload(row, tmp_path):
    check_row(CUDA_SHAPE, row, tmp_path)


# ------------------------------------------------------------------------- CPU checks


def test_router_bias_idles_exactly_the_scheduled_experts(one_thread):
    """At the toy shape on the CPU: each batch's trigger positions go to their expert (and only
    they), absent triggers leave their expert idle in every block, the other experts all get
    tokens."""
    model = build(CPU_SHAPE, "fp32", False)
    n = CPU_SHAPE.triggers_per_batch
    with torch.no_grad():
        for step in range(len(TRIGGERS_AT)):
            idx, _ = make_batch(CPU_SHAPE, step)
            for expert, token in RARE.items():
                assert int((idx == token).sum()) == (n if expert in TRIGGERS_AT[step] else 0)
            model(idx)
            for block in model.blocks:
                counts = block.moe.tokens_per_expert.tolist()
                for expert in RARE:
                    assert counts[expert] == (n if expert in TRIGGERS_AT[step] else 0), counts
                assert all(c > 0 for e, c in enumerate(counts) if e not in RARE), counts
    assert expected_idle(CPU_SHAPE, 0) == {(b, e) for b in range(2) for e in RARE}
    steps = expected_steps(model)
    assert set(steps) == {STEPS, 4, 3}  # experts 6 and 7 take 4 and 3 of the 8 steps


def test_parity_machinery_on_the_cpu(tmp_path, one_thread):
    """The CUDA test's machinery at the toy shape on the CPU, bf16: the reference trains and
    can fail; the activation-offload + checkpointing row and the f=1 NVMe row pass, here
    bit-identical to the reference; an optimizer that steps the idle experts with zero
    gradients (``zero_grad(set_to_none=False)``) fails on its step counts."""
    # bf16 routing of 128 tokens flips on a tie more often than of 4096: the jittered run's
    # loss moved by about 2e-3 (of 6.35) here, so a shift of 1e-3 relative hides in this noise
    check_reference_trains(CPU_SHAPE, stale_shift=1e-2)
    for row in ("f1-nvme-bf16", "f0.5-act-checkpoint-bf16"):
        got = check_row(CPU_SHAPE, row, tmp_path)
        # on the CPU HybridAdam's kernel rounds as torch's fused one: no noise to hide in
        want = reference(CPU_SHAPE, "bf16", ROWS[row][1]).ref.run
        assert torch.equal(got.run.losses, want.losses) and torch.equal(got.run.params,
                                                                        want.params), row
    ref = reference(CPU_SHAPE, "bf16", False)

    class StepsIdleExperts(FusedAdamW):
        def zero_grad(self, set_to_none: bool = True) -> None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()

    model = build(CPU_SHAPE, "bf16", False)
    opt = StepsIdleExperts(list(model.parameters()))
    for step in range(STEPS):
        model(*make_batch(CPU_SHAPE, step))[1].backward()
        opt.step()
        opt.zero_grad()
    got = opt.param_steps()
    assert got != ref.steps and all(g >= r for g, r in zip(got, ref.steps))

