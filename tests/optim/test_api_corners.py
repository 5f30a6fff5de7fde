"""HybridAdam's optimizer API in the corners real training code reaches, against
torch.optim.AdamW (fused) bit for bit on the CPU, 8+ steps on changing batches, at
offload_fraction 0.5 and 1.0, with overlap and with ``param_sync="forward"``:
params that get no gradient in some steps (unrouted MoE experts, skipped branches, frozen for
a while), tied weights, params sharing one storage, ``add_param_group``, hyper-parameters
changed per group between steps, reading ``optimizer.state``, and mixed dtypes, 0-element and
non-contiguous params in one group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from optim.test_hybrid_adam import HP
from optim.test_param_changes import MasterAdamW
from tiermem.optim import HybridAdam

STEPS = 9
V, D = 64, 32
MODES = [pytest.param(f, s, id=f"f{f}-{s}") for f in (0.5, 1.0) for s in ("step", "forward")]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (4, 16), generator=gen), torch.randint(0, V, (4, 16), generator=gen)


class RoutedNet(torch.nn.Module):
    """A tied embedding/head, three experts of which each step routes to one or two, and a
    branch the control flow skips in some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(3))
        self.branch = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter used twice

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor, step: int) -> torch.Tensor:
        h = self.emb(idx)
        for e in ({0, 1} if step % 2 else {0, 2} if step % 3 == 0 else {1}):
            h = h + torch.tanh(self.experts[e](h))  # expert 2: steps 0 and 6 only
        if step % 3 != 1:
            h = h + self.branch(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt.flatten())


def _train(model, opt, steps=STEPS, before_forward=None, after_step=None):
    losses = []
    for step in range(steps):
        if before_forward is not None:
            before_forward(model, opt, step)
        loss = model(*_batch(step), step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model, opt, step)
        losses.append(loss.item())
    return losses


def _hybrid(params, fraction, sync, **kw):
    return HybridAdam(params, **{**HP, **kw}, offload_fraction=fraction, chunk_numel=1024,
                      param_sync=sync)


def _assert_equal(model, ref):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("fraction,sync", MODES)
def test_unrouted_skipped_and_frozen_params_and_tied_weights_train_as_adamw(fraction, sync):
    """Experts not routed and a branch skipped get no gradient in some steps, the branch is
    also frozen (``requires_grad_(False)``) for steps 3-5, the head is tied to the embedding:
    AdamW leaves a param without a gradient and its state untouched that step."""
    torch.manual_seed(0)
    ref = RoutedNet()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = _hybrid(model.parameters(), fraction, sync)

    def freeze(m, o, step):
        m.branch.weight.requires_grad_(not 3 <= step <= 5)

    assert _train(model, opt, before_forward=freeze) == _train(ref, ref_opt, before_forward=freeze)
    _assert_equal(model, ref)
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][k], want[i][k]), (i, k)
    opt.close()


class SharedStorageNet(torch.nn.Module):
    """Two distinct Parameters viewing one storage (``overlap``: the same elements, else the
    two halves of one buffer)."""

    def __init__(self, overlap: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        base = torch.randn(2 * D, D) * 0.1
        self.a = torch.nn.Parameter(base[:D])
        self.b = torch.nn.Parameter(base[:D] if overlap else base[D:])

    def forward(self, idx, tgt, step):
        h = self.emb(idx)
        h = torch.tanh(h @ self.a) + h @ self.b
        return F.cross_entropy((h @ self.emb.weight.t()).flatten(0, 1), tgt.flatten())


@pytest.mark.parametrize("overlap", [False, True], ids=["halves", "same"])
def test_distinct_params_sharing_one_storage_are_refused_at_construction(overlap):
    """Note [shared storage]: refused in one line at construction (before: the first step()
    raised a misleading "changed while the step was still updating it", after stepping)."""
    torch.manual_seed(0)
    model = SharedStorageNet(overlap)
    with pytest.raises(ValueError, match=r"params 0 and 1 \(shapes \(32, 32\) and \(32, 32\)\) "
                                         r"share one storage.*nn.Parameter\(t.clone\(\)\)"):
        _hybrid(model.parameters(), 0.5, "step")
    model.b = torch.nn.Parameter(model.b.detach().clone())  # the fix the message names
    ref = copy.deepcopy(model)
    opt = _hybrid(model.parameters(), 0.5, "step")
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    assert _train(model, opt) == _train(ref, ref_opt)
    _assert_equal(model, ref)
    opt.close()


def _two_groups(model):
    experts = [p for e in model.experts for p in e.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in experts)]
    return [{"params": experts}, {"params": rest, "lr": 1e-3, "weight_decay": 0.0}]


def test_add_param_group_after_construction_is_refused_and_the_optimizer_stays_exact():
    """A head added during fine-tuning: refused in one line naming the fix (docs/compatibility
    .md); nothing of the new group is taken and the steps after it are still AdamW's."""
    torch.manual_seed(0)
    ref = RoutedNet()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(_two_groups(ref), **HP, fused=True)
    opt = _hybrid(_two_groups(model), 0.5, "forward")
    assert _train(model, opt, 4) == _train(ref, ref_opt, 4)
    head = torch.nn.Linear(D, V)
    with pytest.raises(RuntimeError, match=r"^HybridAdam: param groups are fixed at construction; "
                                           r"create a new HybridAdam with all groups$"):
        opt.add_param_group({"params": list(head.parameters()), "lr": 1e-2})
    assert len(opt.param_groups) == 2
    for step in range(4, STEPS):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(*_batch(step), step).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    opt.synchronize()
    _assert_equal(model, ref)
    opt.close()


def _change_hyperparams(model, opt, step):
    """Between step() and the next forward: every hyper-parameter of one group at a time."""
    g = opt.param_groups[step % 2]
    if step == 2:
        g["lr"] *= 0.5
        g["weight_decay"] = 0.05
    elif step == 3:
        g["betas"] = (0.8, 0.99)
        g["eps"] = 1e-6
    elif step == 4:
        g["maximize"] = True
    elif step == 6:
        g["maximize"] = False
        g["weight_decay"] = 0.2


@pytest.mark.parametrize("fraction,sync", MODES)
def test_hyperparameters_changed_per_group_between_steps_are_exact_from_the_next_step(
        fraction, sync):
    """lr, weight_decay, betas, eps and maximize set per group after step() (with
    param_sync="forward": while its CPU side may still run, Note [frozen hyper-parameters]) and
    a scheduler: bit-identical to AdamW at every step."""
    torch.manual_seed(0)
    ref = RoutedNet()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(_two_groups(ref), **HP, fused=True)
    opt = _hybrid(_two_groups(model), fraction, sync)
    for m, o in ((model, opt), (ref, ref_opt)):
        sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.3 * s))

        def after(m, o, step, sched=sched):
            sched.step()
            _change_hyperparams(m, o, step)
        o.losses = _train(m, o, after_step=after)
    assert opt.losses == ref_opt.losses
    _assert_equal(model, ref)
    assert opt.param_groups[1]["betas"] == (0.8, 0.99)
    opt.close()


@pytest.mark.parametrize("fraction,sync", MODES)
def test_optimizer_state_is_empty_and_state_dict_is_adamws_at_every_step(fraction, sync):
    """Loops that log ``optimizer.state[p]`` between steps: HybridAdam keeps its moments in
    chunks, so ``optimizer.state`` holds nothing (no stale copies can be read; documented in
    docs/compatibility.md); ``state_dict()`` is AdamW's after every step, also read while a
    forward-synced step is still pending (it completes the step first)."""
    torch.manual_seed(0)
    ref = RoutedNet()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = _hybrid(model.parameters(), fraction, sync)
    pending = []

    def read(m, o, step):
        if o is opt:
            pending.append(opt._pending)
            assert all(opt.state[p] == {} for p in m.parameters())  # a logging loop's read
            o.read = opt.state_dict()["state"]
        else:
            o.read = ref_opt.state_dict()["state"]

    for step in range(STEPS):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(*_batch(step), step).backward()
            o.step()
            o.zero_grad(set_to_none=True)
            read(m, o, step)
        assert opt.read.keys() >= ref_opt.read.keys(), step
        for i, got in opt.read.items():  # a param AdamW has not stepped yet: step 0, zeros
            want = ref_opt.read.get(i) or {k: torch.zeros_like(v) for k, v in got.items()}
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[k], want[k]), (step, i, k)
    assert any(pending) == (sync == "forward")  # the reads did meet pending steps
    _assert_equal(model, ref)
    opt.close()


class MixedNet(torch.nn.Module):
    """One group with bf16 and fp32 params, a 0-element param and a non-contiguous one (a
    transposed view made a Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.up = torch.nn.Parameter(torch.randn(D, 2 * D).mul(0.1))
        self.down = torch.nn.Parameter(torch.randn(2 * D, D, dtype=torch.bfloat16) * 0.1)
        self.empty = torch.nn.Parameter(torch.zeros(0, D))
        self.gain = torch.nn.Parameter(torch.ones(D, dtype=torch.bfloat16))

    def forward(self, idx, tgt, step):
        h = self.emb(idx)
        h = h + torch.tanh(h @ self.up) @ self.down.float() + self.empty.sum()
        h = h * self.gain.float()
        return F.cross_entropy((h @ self.emb.weight.t()).flatten(0, 1), tgt.flatten())


def _by_dtype(model):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dtype == dt]}
            for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("fraction,sync", MODES)
def test_mixed_dtypes_in_one_group_are_refused_and_split_groups_are_exact(fraction, sync):
    """bf16 and fp32 params in one group: refused at the first step, before anything is
    stepped, in one line naming the dtypes (docs/compatibility.md); one group per dtype, with a
    0-element param among them, is bit-identical to AdamW on fp32 masters (MasterAdamW: the
    bf16 params get the rounded masters)."""
    torch.manual_seed(0)
    model = MixedNet()
    opt = _hybrid(model.parameters(), fraction, sync)
    with pytest.raises(ValueError, match=r"param group 0 mixes dtypes \['torch.bfloat16', "
                                         r"'torch.float32'\]; put params of different dtypes"):
        _train(model, opt, 2)
    opt.close()
    torch.manual_seed(0)
    ref = MixedNet()
    model = copy.deepcopy(ref)
    ref_opt = MasterAdamW(ref)
    opt = _hybrid(_by_dtype(model), fraction, sync)
    assert _train(model, opt) == _train(ref, ref_opt)
    opt.synchronize()
    _assert_equal(model, ref)
    state = opt.state_dict()["state"]
    assert state[1]["exp_avg"].shape == (0, D) and "master" in state[3]
    opt.close()


def test_a_non_contiguous_param_is_refused_at_construction():
    """A transposed view made a Parameter: refused in one line (before: the first step crashed
    with "view size is not compatible"); the fix the message names trains as AdamW."""
    torch.manual_seed(0)
    model = MixedNet()
    model.down = torch.nn.Parameter(torch.randn(D, 2 * D).mul(0.1).t())  # (2D, D), strided
    with pytest.raises(ValueError, match=r"param 1 \(shape \(64, 32\), stride \(1, 64\)\) is "
                                         r"not contiguous.*nn.Parameter\(t.contiguous\(\)\)"):
        _hybrid(model.parameters(), 1.0, "step")
    model.down = torch.nn.Parameter(model.down.detach().contiguous())
    ref = copy.deepcopy(model)
    opt = _hybrid(_by_dtype(model), 1.0, "step")
    ref_opt = MasterAdamW(ref)
    assert _train(model, opt) == _train(ref, ref_opt)
    _assert_equal(model, ref)
    opt.close()


def test_the_twin_that_changes_only_adamws_hyperparameters_differs():
    """The comparison above sees every change: HybridAdam left at the old values (a stale
    copy) ends off AdamW."""
    torch.manual_seed(0)
    ref = RoutedNet()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(_two_groups(ref), **HP, fused=True)
    opt = _hybrid(_two_groups(model), 1.0, "forward")
    _train(model, opt)
    _train(ref, ref_opt, after_step=_change_hyperparams)
    opt.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    opt.close()
