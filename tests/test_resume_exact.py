"""Resume exactness (reliability audit, session 18): train N steps, ``save_checkpoint``, build
everything fresh (a model of other weights, a new optimizer, LR scheduler and GradScaler),
``load_checkpoint``, train M more; the losses of every step, the final params and both moments
must be those of one uninterrupted N+M-step run, bit for bit.

Covered: HybridAdam's state tiers (cpu, nvme, split), the GPU lane (on the CPU), bf16 moments,
clipping with rollback slots (the speculation switch is not saved: a resumed run may speculate
where the uninterrupted one did not, and the bits are the same), gradient accumulation,
``param_sync="forward"`` saved with a step still in flight, two param groups, LambdaLR and
OneCycleLR (which moves ``betas`` every step), a CPU GradScaler (scale and growth tracker);
resuming into another offload_fraction / state_tier / chunk_numel / gpu_step_fraction /
rollback_bytes (the saved state is per param, layout-free: exact); HybridAdam <-> AdamW in both
directions; weight streaming on at the save and off at the load, and the reverse; saving twice
to one path and a save that fails halfway over a good checkpoint (the good one resumes exactly).
"""

from __future__ import annotations

import time

import pytest
import torch

import tiermem.checkpoint as ckpt
from models import TinyGPT, make_batch
from tiermem.checkpoint import CheckpointCorruption, load_checkpoint, save_checkpoint
from tiermem.optim import HybridAdam
from tiermem.optim.chunk_worker import ChunkWorker
from tiermem.store.store import TierStore
from tiermem.config import StoreConfig

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BASE = dict(chunk_numel=1024, offload_fraction=0.5)
N, M = 4, 4  # steps before the save, after the load


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ the harness


class Run:
    """A model, its optimizer and what the loop carries: built from a configuration dict.

    cfg keys: ``opt`` (HybridAdam keyword arguments, or the string ``"adamw"``), ``groups``
    (two param groups of other lr / weight_decay), ``sched`` (None, ``"lambda"``,
    ``"onecycle"``), ``scaler`` (a CPU GradScaler under fp16 autocast, infs on step 2),
    ``accum`` (backward passes per step), ``clip`` (loss factors that make a max_grad_norm of
    1.0 clip on odd steps), ``stream`` (weight streaming of the blocks), ``tmp`` (for NVMe).
    """

    def __init__(self, cfg: dict, seed: int, tmp_path, tag: str) -> None:
        self.cfg = cfg
        torch.manual_seed(seed)
        self.model = TinyGPT(n_layers=2)
        if cfg.get("bf16"):  # bf16 params: HybridAdam keeps fp32 masters (saved as "master")
            self.model = self.model.to(torch.bfloat16)
        self.stores, self.stream = [], None
        if cfg.get("stream"):
            from tiermem.stream import stream_weights
            store = TierStore(StoreConfig(device="cpu", gpu_bytes=0, cpu_bytes=8 << 20,
                                          pool_slab_bytes=1 << 20))
            self.stores.append(store)
            self.stream = stream_weights(self.model.blocks, store=store)
        params = list(self.model.parameters())
        if cfg.get("groups"):
            half = len(params) // 2
            groups = [{"params": params[:half]},
                      {"params": params[half:], "lr": 1e-3, "weight_decay": 0.0}]
        else:
            groups = params
        kind = cfg.get("opt", {})
        if kind in ("adamw", "adam"):
            cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
            self.opt = cls(groups, **HP, fused=True)
        else:
            kw = dict(kind)
            tier = kw.get("state_tier")
            if tier in ("nvme", "split"):
                d = tmp_path / f"{tag}-{seed}-{time.monotonic_ns()}"
                d.mkdir()
                if tier == "nvme":
                    kw["nvme_dir"] = str(d)
                else:
                    store = TierStore(StoreConfig(cpu_bytes="96KiB", nvme_dir=str(d),
                                                  nvme_bytes="4MiB", pool_slab_bytes="32KiB"))
                    self.stores.append(store)
                    kw["store"] = store
            self.opt = HybridAdam(groups, **HP, **kw)
        self.sched = None
        if cfg.get("sched") == "lambda":
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        elif cfg.get("sched") == "onecycle":
            self.sched = torch.optim.lr_scheduler.OneCycleLR(
                self.opt, max_lr=[3e-3, 1e-3][:len(self.opt.param_groups)],
                total_steps=N + M + 2)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3) \
            if cfg.get("scaler") else None
        self.losses: list[float] = []
        self.step = 0

    def train(self, steps: int) -> None:
        accum = self.cfg.get("accum", 1)
        for _ in range(steps):
            s = self.step
            factor = (8.0 if s % 2 else 0.01) if self.cfg.get("clip") else 1.0
            for micro in range(accum):
                idx, tgt = make_batch(s * accum + micro, batch=2)
                with torch.autocast("cpu", dtype=torch.float16,
                                    enabled=self.scaler is not None):
                    _, loss = self.model(idx, tgt)
                if self.scaler is not None and s == 2 and micro == accum - 1:
                    loss = loss * float("inf")  # a skipped step: the scale backs off
                self.losses.append(float(loss.detach()))
                loss = loss * factor / accum
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
            if self.sched is not None:
                self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1

    def save(self, path) -> None:
        save_checkpoint(path, model=self.model, optimizer=self.opt, extra=self.extra())

    def extra(self) -> dict:
        return {"step": self.step, "losses": list(self.losses),
                "sched": self.sched.state_dict() if self.sched is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load(self, path) -> None:
        extra = load_checkpoint(path, model=self.model, optimizer=self.opt)["extra"]
        self.step, self.losses = extra["step"], list(extra["losses"])
        if not isinstance(self.opt, HybridAdam):
            # torch's load_state_dict takes every key of the saved groups, and HybridAdam's
            # have no "fused": without this, AdamW(fused=True) runs its default kernel on
            for group in self.opt.param_groups:
                group["fused"] = True
        if self.sched is not None and extra["sched"] is not None:  # (None: a twin's)
            self.sched.load_state_dict(extra["sched"])
        if self.scaler is not None and extra["scaler"] is not None:
            self.scaler.load_state_dict(extra["scaler"])

    def result(self) -> dict:
        """Losses, params and the optimizer's per-param state, all on the CPU."""
        if isinstance(self.opt, HybridAdam):
            self.opt.synchronize()
        state = self.opt.state_dict()
        moments = [{k: v.detach().clone().cpu() for k, v in st.items()
                    if k in ("exp_avg", "exp_avg_sq", "step", "master")}
                   for _, st in sorted(state["state"].items())]
        return {"losses": list(self.losses),
                "params": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "moments": moments, "lr": [g["lr"] for g in self.opt.param_groups],
                "scale": self.scaler.get_scale() if self.scaler is not None else None}

    def close(self) -> None:
        if isinstance(self.opt, HybridAdam):
            self.opt.close()
        if self.stream is not None:
            self.stream.close()
        for store in self.stores:
            store.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1).float()
    return t.view(torch.int32)


def assert_same(got: dict, want: dict, what: str) -> None:
    """Bit for bit: every step's loss, the final params, step counts and both moments."""
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert a == b or (a != a and b != b), f"{what}: loss of pass {i}: {a!r} != {b!r}"
    assert len(got["losses"]) == len(want["losses"]), what
    for k, v in want["params"].items():
        assert torch.equal(_bits(got["params"][k]), _bits(v)), f"{what}: param {k} differs"
    assert len(got["moments"]) == len(want["moments"]), what
    for i, (a, b) in enumerate(zip(got["moments"], want["moments"])):
        assert a.keys() == b.keys(), f"{what}: state of param {i}: {a.keys()} != {b.keys()}"
        for name in a:
            assert torch.equal(_bits(a[name]), _bits(b[name])), \
                f"{what}: {name} of param {i} differs"
    assert got["lr"] == want["lr"] and got["scale"] == want["scale"], what


def reference(cfg: dict, tmp_path, steps: int = N + M) -> dict:
    run = Run(cfg, 0, tmp_path, "ref")
    try:
        run.train(steps)
        return run.result()
    finally:
        run.close()


def resumed(cfg: dict, tmp_path, into: dict | None = None, before_save=None) -> dict:
    """N steps of ``cfg``, saved; a fresh run of ``into`` (default ``cfg``) with other
    initial weights loads it and trains M steps."""
    path = tmp_path / "resume.pt"
    first = Run(cfg, 0, tmp_path, "a")
    try:
        first.train(N)
        if before_save is not None:
            before_save(first)
        first.save(path)
    finally:
        first.close()
    second = Run(into if into is not None else cfg, 1, tmp_path, "b")
    try:
        second.load(path)
        second.train(M)
        return second.result()
    finally:
        second.close()


# ------------------------------------------------------------------ 1. one configuration


LANE = dict(offload_fraction=1.0, gpu_step_fraction=1.0)
CLIP = dict(max_grad_norm=1.0, rollback_bytes=1 << 30)
CONFIGS = {
    "cpu": dict(opt=BASE),
    "all_offloaded": dict(opt=dict(BASE, offload_fraction=1.0)),
    "nvme": dict(opt=dict(BASE, state_tier="nvme")),
    "split": dict(opt=dict(BASE, offload_fraction=1.0, state_tier="split")),
    "lane": dict(opt=dict(BASE, **LANE)),
    "lane_half": dict(opt=dict(BASE, offload_fraction=1.0, gpu_step_fraction=0.5)),
    "bf16_moments": dict(opt=dict(BASE, moments_dtype=torch.bfloat16)),
    "clip_rollback": dict(opt=dict(BASE, **CLIP), clip=True),
    "clip_rollback_lane": dict(opt=dict(BASE, **LANE, **CLIP), clip=True),
    "clip_no_rollback": dict(opt=dict(BASE, max_grad_norm=1.0, rollback_bytes=0), clip=True),
    "accumulation": dict(opt=dict(BASE, grad_accumulation_steps=2), accum=2),
    "forward_sync": dict(opt=dict(BASE, param_sync="forward")),
    "bf16_params": dict(opt=BASE, bf16=True),
    "bf16_params_lane_bf16_moments": dict(opt=dict(BASE, **LANE, moments_dtype=torch.bfloat16),
                                          bf16=True),
    "groups": dict(opt=BASE, groups=True),
    "lambda_lr": dict(opt=BASE, groups=True, sched="lambda"),
    "onecycle": dict(opt=BASE, groups=True, sched="onecycle"),
    "scaler": dict(opt=BASE, scaler=True),
    "scaler_clip_lane": dict(opt=dict(BASE, **LANE, **CLIP), scaler=True, clip=True),
    "scaler_onecycle_accum": dict(opt=dict(BASE, grad_accumulation_steps=2), scaler=True,
                                  sched="onecycle", accum=2),
    "adamw": dict(opt="adamw", groups=True, sched="onecycle", scaler=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bit_exact(tmp_path, name):
    cfg = CONFIGS[name]
    assert_same(resumed(cfg, tmp_path), reference(cfg, tmp_path), name)


def test_the_twins_go_red(tmp_path):
    """Must fail: the comparison sees a resume that drops the optimizer state, the scheduler's
    or the scaler's (each alone), and a clipped run resumed into one that never clips."""
    cfg = CONFIGS["scaler_onecycle_accum"]
    want = reference(cfg, tmp_path)

    def without(part):
        def drop(run):
            setattr(run, part, None)
        return drop

    for part in ("sched", "scaler"):
        got = resumed(cfg, tmp_path, before_save=without(part))
        with pytest.raises(AssertionError, match=f"{part}: (loss of pass|param)"):
            assert_same(got, want, part)
    path = tmp_path / "model_only.pt"
    run = Run(cfg, 0, tmp_path, "m")
    run.train(N)
    save_checkpoint(path, model=run.model, extra=run.extra())
    run.close()
    fresh = Run(cfg, 1, tmp_path, "m2")
    extra = load_checkpoint(path, model=fresh.model)["extra"]
    fresh.step, fresh.losses = extra["step"], list(extra["losses"])
    fresh.sched.load_state_dict(extra["sched"])
    fresh.scaler.load_state_dict(extra["scaler"])
    fresh.train(M)
    with pytest.raises(AssertionError, match="no optimizer state: loss of pass"):
        assert_same(fresh.result(), want, "no optimizer state")
    fresh.close()


# ------------------------------------------------------------------ 2. another configuration

CHANGES = {
    "offload_fraction 0.5 -> 1.0": (dict(opt=BASE), dict(opt=dict(BASE, offload_fraction=1.0))),
    "offload_fraction 1.0 -> 0.25": (dict(opt=dict(BASE, offload_fraction=1.0)),
                                     dict(opt=dict(BASE, offload_fraction=0.25))),
    "state_tier cpu -> nvme": (dict(opt=BASE), dict(opt=dict(BASE, state_tier="nvme"))),
    "state_tier nvme -> split": (dict(opt=dict(BASE, state_tier="nvme")),
                                 dict(opt=dict(BASE, offload_fraction=1.0, state_tier="split"))),
    "chunk_numel 1024 -> 4096": (dict(opt=BASE), dict(opt=dict(BASE, chunk_numel=4096))),
    "gpu_step_fraction 0 -> 1": (dict(opt=dict(BASE, offload_fraction=1.0)),
                                 dict(opt=dict(BASE, **LANE))),
    "rollback_bytes on -> 0": (dict(opt=dict(BASE, **CLIP), clip=True),
                               dict(opt=dict(BASE, max_grad_norm=1.0, rollback_bytes=0),
                                    clip=True)),
    "rollback_bytes 0 -> on": (dict(opt=dict(BASE, max_grad_norm=1.0, rollback_bytes=0),
                                    clip=True), dict(opt=dict(BASE, **CLIP), clip=True)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_resume_into_another_layout_is_exact(tmp_path, change):
    """The saved state is per param (torch's format), whatever chunks, tiers and lanes held it:
    a resume into another layout is the uninterrupted run of the first one, bit for bit."""
    before, after = CHANGES[change]
    assert_same(resumed(before, tmp_path, into=after), reference(before, tmp_path), change)


# ------------------------------------------------------------------ 3. HybridAdam <-> AdamW

@pytest.mark.parametrize("direction", ["hybrid->adamw", "adamw->hybrid"])
def test_resume_across_hybrid_adam_and_adamw_is_exact(tmp_path, direction):
    """HybridAdam on the CPU is torch's AdamW(fused=True) bit for bit, so a switch at the
    resume, either way, is the run that never switched (two groups, LambdaLR)."""
    hybrid = dict(opt=dict(BASE, offload_fraction=1.0), groups=True, sched="lambda")
    adamw = dict(opt="adamw", groups=True, sched="lambda")
    first, second = (hybrid, adamw) if direction == "hybrid->adamw" else (adamw, hybrid)
    want = reference(first, tmp_path)
    assert_same(reference(second, tmp_path), want, "the two are the same math")
    assert_same(resumed(first, tmp_path, into=second), want, direction)


# ------------------------------------------------------------------ 4. weight streaming

@pytest.mark.parametrize("direction", ["streamed->resident", "resident->streamed"])
def test_resume_across_weight_streaming_is_exact(tmp_path, direction):
    """Saved while the blocks' weights stream, resumed into a model that keeps them resident,
    and the reverse: the checkpoint holds the real weights and per-param state either way."""
    streamed = dict(opt=dict(BASE, offload_fraction=1.0), stream=True)
    resident = dict(opt=dict(BASE, offload_fraction=1.0))
    first, second = (streamed, resident) if direction == "streamed->resident" else \
        (resident, streamed)
    want = reference(first, tmp_path)
    assert_same(reference(second, tmp_path), want, "streaming changes no bit")
    assert_same(resumed(first, tmp_path, into=second), want, direction)


# ------------------------------------------------------------------ 5. saves over saves

class _FailingFile:
    """The checkpoint's file: its writes raise ``exc`` once 20 kB were written."""

    def __init__(self, f, exc):
        self.f, self.exc, self.written = f, exc, 0

    def write(self, data):
        self.written += memoryview(data).nbytes
        if self.written > 20_000:
            raise self.exc
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


@pytest.mark.parametrize("exc", [RuntimeError("interrupted halfway"), KeyboardInterrupt()],
                         ids=["RuntimeError", "KeyboardInterrupt"])
def test_saving_twice_and_a_save_failing_halfway_keep_an_exact_resume(tmp_path, monkeypatch,
                                                                      exc):
    """Two saves to one path (the second wins), then a third save whose file write raises
    halfway through the payload: the save raises that error (torch's zip writer turned it into
    "RuntimeError: [enforce fail at inline_container.cc] unexpected pos", so a Ctrl-C during a
    save surfaced as a RuntimeError: red on the old code), the second checkpoint is still
    there, loads, and resumes exactly; the run that saw the failure trains on exactly too; a
    checkpoint cut short never loads."""
    cfg = CONFIGS["scaler_clip_lane"]
    want = reference(cfg, tmp_path)
    path = tmp_path / "c.pt"
    run = Run(cfg, 0, tmp_path, "a")
    run.train(N - 1)
    run.save(path)
    run.train(1)
    run.save(path)  # over the first: step N
    good = path.read_bytes()
    run.train(1)
    real = ckpt.os.fdopen

    def fdopen(*args, **kwargs):
        f = real(*args, **kwargs)
        return _FailingFile(f, exc) if args[1:2] == ("w+b",) else f  # the data file

    monkeypatch.setattr(ckpt.os, "fdopen", fdopen)
    with pytest.raises(type(exc)) as info:
        run.save(path)
    monkeypatch.undo()
    assert info.value is exc, f"{type(info.value).__name__}: {info.value}"
    assert path.read_bytes() == good
    assert not [n for n in (p.name for p in tmp_path.iterdir()) if ".tiermem-tmp-" in n]
    run.train(M - 1)
    assert_same(run.result(), want, "trained on after the failed save")
    run.close()
    second = Run(cfg, 1, tmp_path, "b")
    second.load(path)
    assert second.step == N
    second.train(M)
    assert_same(second.result(), want, "resumed from the checkpoint kept")
    second.close()
    (tmp_path / "cut.pt").write_bytes(good[:len(good) // 2])
    with pytest.raises(CheckpointCorruption, match="cut.pt"):
        load_checkpoint(tmp_path / "cut.pt", model=Run(cfg, 2, tmp_path, "c").model)


# ------------------------------------------------------------------ 3b. which weight decay

ADAM = dict(opt="adam", groups=True)
HYBRID_L2 = dict(opt=dict(BASE, offload_fraction=1.0, adamw=False), groups=True)
HYBRID = dict(opt=dict(BASE, offload_fraction=1.0), groups=True)
ADAMW = dict(opt="adamw", groups=True)


@pytest.mark.parametrize("first,second", [(ADAM, HYBRID), (ADAMW, HYBRID_L2),
                                          (HYBRID_L2, ADAM), (HYBRID, ADAMW)],
                         ids=["Adam->HybridAdam(adamw=True)", "AdamW->HybridAdam(adamw=False)",
                              "HybridAdam(adamw=False)->Adam", "HybridAdam->AdamW"])
def test_the_saved_weight_decay_style_is_the_one_resumed(tmp_path, first, second):
    """torch's Adam and AdamW save ``decoupled_weight_decay``; HybridAdam's load takes the
    saved group's hyper-parameters, that one as ``adamw`` (as torch.optim.Adam takes it): a
    torch Adam run (L2 decay) resumed into HybridAdam(adamw=True) went on with decoupled decay,
    silently (red on the old code: 'loss of pass 5'), and AdamW's into adamw=False with L2."""
    want = reference(first, tmp_path)
    assert_same(resumed(first, tmp_path, into=second), want, "resumed")


@pytest.mark.parametrize("saved,into,fix", [
    (HYBRID_L2, ADAMW, "torch.optim.Adam"), (HYBRID, ADAM, "torch.optim.AdamW")])
def test_a_torch_optimizer_that_would_decay_another_way_is_refused(tmp_path, saved, into, fix):
    """torch.optim.AdamW always decays decoupled (its __setstate__ says so) and torch.optim.Adam
    takes L2 when the saved group does not say: HybridAdam's ``adamw`` is not read by either,
    so such a load went on with the other decay, silently (red on the old code: DID NOT RAISE).
    Refused before the model is touched, naming the group, the field and the fix; the twin
    (the matching class) is exact above."""
    path = tmp_path / "c.pt"
    run = Run(saved, 0, tmp_path, "a")
    run.train(N)
    run.save(path)
    run.close()
    other = Run(into, 1, tmp_path, "b")
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointMismatch,
                       match=rf"param group 0 .*adamw=.*fix: load it into {fix}\b") as info:
        load_checkpoint(path, model=other.model, optimizer=other.opt)
    assert "\n" not in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in other.model.state_dict().items())


# ------------------------------------------------------------------ placement after a resume


class _Reversed(torch.nn.Module):
    """Params registered in the reverse of their execution order: the traced placement (Note
    [trace placement]) and the given one differ."""

    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(64, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.inp = torch.nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def _placed_run(seed: int, steps: int, load=None):
    """(GPU-side param indices, params, state) of a HybridAdam run on :class:`_Reversed`."""
    torch.manual_seed(seed)
    model = _Reversed()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024)
    try:
        start = 0
        if load is not None:
            start = load_checkpoint(load, model=model, optimizer=opt)["extra"]["step"]
        for s in range(start, start + steps):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        gpu = sorted({pc.param for g in opt._groups for pc in g.plan.gpu_pieces})
        return gpu, opt, model
    except BaseException:
        opt.close()
        raise


@pytest.mark.parametrize("drop_order", [False, True], ids=["saved order", "twin: order dropped"])
def test_a_resumed_hybrid_adam_places_its_state_as_the_traced_run_did(tmp_path, drop_order):
    """placement="trace" splits GPU side / offloaded by the first backward's gradient order.
    A HybridAdam that loads a state before its first step had no order yet and fixed the split
    from the given order: a resumed run kept the last layer's state on the GPU and offloaded
    the first layers' (on a GPU: another split, so other last bits than the uninterrupted run,
    and no overlap for the first layers under param_sync="forward"). The state dict now holds
    the traced order (Note [saved gradient order]); the twin drops it and must differ."""
    want_gpu, ref_opt, ref_model = _placed_run(0, N + M)
    ref = {k: v.clone() for k, v in ref_model.state_dict().items()}
    ref_opt.close()
    gpu, opt, model = _placed_run(0, N)
    payload = opt.state_dict()
    assert gpu == want_gpu
    if drop_order:
        for group in payload["param_groups"]:
            group.pop("tiermem_grad_order", None)
    ckpt.atomic_save({"format": "tiermem.checkpoint", "version": ckpt.FORMAT_VERSION,
                      "time": 0.0, "model": model.state_dict(), "optimizer": payload,
                      "extra": {"step": N}}, tmp_path / "c.pt")
    opt.close()
    got_gpu, opt, model = _placed_run(1, M, load=tmp_path / "c.pt")
    try:
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())  # the CPU
        if drop_order:
            assert got_gpu != want_gpu, "the twin placed as traced: the test tests nothing"
        else:
            assert got_gpu == want_gpu, f"resumed GPU side {got_gpu}, traced {want_gpu}"
    finally:
        opt.close()


def test_a_resumed_run_speculates_where_the_uninterrupted_one_did_not_and_is_exact(
        tmp_path, monkeypatch):
    """Note [speculation switch]'s history is not saved: after two clipped steps in four the
    uninterrupted run stops speculating, the resumed one starts afresh and speculates (and rolls
    back the clipped steps). A speculated step is exact, so the bits agree; this pins that the
    exactness test above covers steps speculated by one run and not the other."""
    cfg = CONFIGS["clip_rollback"]
    decisions: list[bool] = []
    real = HybridAdam._begin_step

    def record(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        decisions.append(bool(self._spec.active))  # the next step speculates
        return out

    monkeypatch.setattr(HybridAdam, "_begin_step", record)
    want = reference(cfg, tmp_path)
    straight = decisions[N:N + M]  # steps N..N+M-1 (the first entry is the constructor's)
    decisions.clear()
    got = resumed(cfg, tmp_path)
    again = decisions[N + 1:N + 1 + M]  # the first run's N+1 entries, then the second's
    assert len(straight) == len(again) == M
    assert any(a and not s for a, s in zip(again, straight)), (straight, again)
    assert_same(got, want, "resumed with other speculation decisions")


def test_a_save_while_a_forward_synced_step_is_in_flight_resumes_exactly(tmp_path, monkeypatch):
    """param_sync="forward": the save comes right after a step() whose CPU side is still
    running (asserted: the worker is slowed); the checkpoint holds that step whole and the
    resume is the uninterrupted run."""
    cfg = CONFIGS["forward_sync"]
    want = reference(cfg, tmp_path)
    real = ChunkWorker._step_chunk

    def slow(self, *args):
        time.sleep(0.005)
        return real(self, *args)

    def in_flight(run):
        assert run.opt._pending, "the step is not in flight: the test tests nothing"

    monkeypatch.setattr(ChunkWorker, "_step_chunk", slow)
    got = resumed(cfg, tmp_path, before_save=in_flight)
    assert_same(got, want, "saved with the step in flight")
