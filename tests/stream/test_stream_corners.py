"""Corners a real training loop reaches with streamed weights (tiermem/stream/), with torch's
AdamW and with HybridAdam (Note [streamed write-back]): each run is compared bit for bit, losses
at every step and the final weights, with the same loop on an unstreamed model from the same
seed that does the same thing.

- An evaluation between steps (``model.eval()``, ``torch.no_grad()``, ``torch.inference_mode()``
  or grad enabled without a backward; between micro-batches too): its outputs are the resident
  model's at that point and training goes on as without it. Under ``inference_mode`` a store slab
  opened by the evaluation (``tier="nvme"``) was an inference tensor and the next training step
  failed (Note [slabs outside inference mode]); so did HybridAdam's next step after a
  ``param_sync="forward"`` step completed by such a forward (Note [completion in inference
  mode]).
- An evaluation loss kept alive into the next training forward, or over ``step()``: refused in
  one line, and training goes on exactly once it is dropped.
- A validation loss with autograd on and its graph dropped (``.item()``) before
  ``clip_grad_norm_`` / ``step()``, or before the textbook loop's ``zero_grad()``, and
  PyTorch's quickstart order (``zero_grad()`` between forward and backward): the streamed
  ``.grad`` read None in the open pass, so the clip left them out and a ``zero_grad()`` was
  undone (Note [gradients at backward]).
- ``model.state_dict()`` / ``torch.save`` / ``load_state_dict`` between steps and between an
  evaluation and training (``assign=True`` refused at the load); ``requires_grad_(False)`` on a
  streamed block (and back); ``model.to(dtype)``: refused at the next forward, nothing changed,
  and exact after converting back.
- A forward that raises: an ``Exception`` in a block, and a ``BaseException`` (an interrupt)
  thrown by a hook, which skips torch's always-called forward hooks and left the pass open for
  good (every later forward, ``state_dict()`` and ``close()`` refused: Note [interrupted
  forward]); a ``blocks[0]`` called from inside a running block is still refused.
- Other sequence lengths every step and micro-batches of one sample, depth-first and
  block-major.
"""

from __future__ import annotations

import io

import pytest
import torch

from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import CFG, batches, make_model

STEPS = 6

# name -> HybridAdam keywords, or torch AdamW (None, or "torch": True); "n_micro": micro-batches
# per step, "clip": HybridAdam's max_grad_norm, or torch's clip_grad_norm_ before AdamW's step
OPTS = {
    "adamw": None,
    "adamw-acc2-clip": {"torch": True, "n_micro": 2, "clip": 0.5},
    "ha-step": {},
    "ha-step-acc2-no-overlap": {"n_micro": 2, "overlap": False},
    "ha-forward": {"param_sync": "forward"},
    "ha-forward-acc2-clip-rollback": {"n_micro": 2, "clip": 0.5, "rollback_bytes": 1 << 30,
                                      "param_sync": "forward", "offload_fraction": 0.5},
}
# configurations only some tests take: a clip every step reaches
MORE_OPTS = {"adamw-tight-clip": {"torch": True, "clip": 0.05}}


class Interrupt(BaseException):
    """A KeyboardInterrupt-like exception: not an ``Exception``."""


class Loop:
    """One training loop: the test GPT (streamed or not), an optimizer per ``OPTS[name]``,
    ``hook(loop, step)`` called before each step's forward (it may return an evaluation's
    output to record), ``mid(loop, step)`` between a step's micro-batches and
    ``before_step(loop, step)`` after the step's last backward."""

    def __init__(self, name, streamed, store, tier="cpu"):
        cfg = OPTS[name] if name in OPTS else MORE_OPTS[name]
        self.cfg = cfg or {}
        self.n_micro = self.cfg.get("n_micro", 1)
        self.model = make_model()
        self.stream = stream_weights(self.model.blocks, store=store, tier=tier,
                                     prefetch_blocks=1) if streamed else None
        params = self.model.parameters()
        if cfg is None or cfg.get("torch"):
            self.opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
        else:
            kw = {k: v for k, v in cfg.items() if k not in ("n_micro", "clip")}
            self.opt = HybridAdam(params, lr=3e-3, weight_decay=0.1, chunk_numel=2048,
                                  max_grad_norm=cfg.get("clip"),
                                  grad_accumulation_steps=self.n_micro, **kw)

    def run(self, hook=None, mid=None, steps=STEPS, data=None, fb=None, before_step=None,
            zero_first=False):
        """Train; returns (losses per step, recorded evaluations, final weights);
        ``zero_first``: ``zero_grad()`` after ``hook``, before each step's forward (the
        textbook loop), instead of after ``step()``."""
        losses, evals = [], []
        data = data or (lambda step: batches(step, self.n_micro))
        try:
            for step in range(steps):
                if hook is not None and (out := hook(self, step)) is not None:
                    evals.append(out)
                if zero_first:
                    self.opt.zero_grad(set_to_none=True)
                if fb is not None:
                    got = fb(self.model, data(step))
                else:
                    got = []
                    for j, (idx, targets) in enumerate(data(step)):
                        if mid is not None and j == 1 and (out := mid(self, step)) is not None:
                            evals.append(out)
                        _, loss = self.model(idx, targets)
                        (loss / self.n_micro).backward()
                        got.append(loss.detach())
                if before_step is not None:
                    before_step(self, step)
                if isinstance(self.opt, torch.optim.AdamW) and self.cfg.get("clip"):
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["clip"])
                self.opt.step()
                if not zero_first:
                    self.opt.zero_grad(set_to_none=True)
                losses.append(torch.stack(got).detach())
            if isinstance(self.opt, HybridAdam):
                self.opt.synchronize()
            weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        finally:
            self.close()
        return losses, evals, weights

    def close(self):
        if isinstance(self.opt, HybridAdam):
            self.opt.close()
        if self.stream is not None:
            self.stream.close()


@pytest.fixture
def stores(make_stream_store):
    """``stores(nvme)``: a CPU store (no GPU budget, 8 MiB RAM in 256 KiB slabs); ``nvme``: a
    64 MiB NVMe tier and 1 MiB of RAM, so that a pass opens slabs."""
    def make(nvme=False):
        if nvme:
            return make_stream_store(gpu_bytes=0, cpu_bytes=1 << 20, pool_slab_bytes=1 << 18,
                                     nvme_bytes=64 << 20)
        return make_stream_store(gpu_bytes=0, cpu_bytes=8 << 20, pool_slab_bytes=1 << 18)
    return make


def evaluate(model, mode):
    """An evaluation forward (shorter sequences, 3 samples) under ``mode``; returns copies of
    the logits and loss."""
    gen = torch.Generator().manual_seed(77)
    idx = torch.randint(0, CFG.vocab, (3, CFG.seq_len - 5), generator=gen)
    model.eval()
    if mode == "no_grad":
        with torch.no_grad():
            logits, loss = model(idx, torch.roll(idx, -1, 1))
    elif mode == "inference":
        with torch.inference_mode():
            logits, loss = model(idx, torch.roll(idx, -1, 1))
    else:  # "grad": a validation loss computed with autograd on, no backward
        logits, loss = model(idx, torch.roll(idx, -1, 1))
    model.train()
    return logits.detach().clone(), loss.detach().clone()


def assert_same(got, want, what):
    """Losses at every step, recorded evaluations and final weights bit-identical."""
    assert len(got[0]) == len(want[0]) and len(got[1]) == len(want[1])
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert torch.equal(a, b), f"{what}: step {step} losses {a.tolist()} != {b.tolist()}"
    for k, (a, b) in enumerate(zip(got[1], want[1])):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"{what}: evaluation {k}"
    for key in want[2]:
        assert torch.equal(got[2][key], want[2][key]), f"{what}: final weight {key}"


def _eval_at(mode, steps=(0, 1, 3)):
    return lambda loop, step: evaluate(loop.model, mode) if step in steps else None


# ---------------------------------------------------------------- 1, 2: evaluations


@pytest.mark.parametrize("mode", ["no_grad", "inference", "grad"])
@pytest.mark.parametrize("name", list(OPTS))
def test_evaluation_between_steps(stores, one_thread, name, mode):
    """Evaluations before the first step, right after it (a pending forward-synced step, whose
    completion allocates the rollback slots) and later: the resident model's outputs, and the
    training losses and weights those of a loop without evaluations. Red before the fix for
    inference mode and the forward-synced clipping case (the next step failed)."""
    want_evals = Loop(name, False, stores()).run(_eval_at(mode))
    want = Loop(name, False, stores()).run()
    got = Loop(name, True, stores()).run(_eval_at(mode))
    assert_same(got, (want[0], want_evals[1], want[2]), f"{name} {mode}")
    assert not torch.equal(got[1][0][0], got[1][1][0])  # the weights moved between evaluations
    assert not torch.equal(got[1][1][0], got[1][2][0])


@pytest.mark.parametrize("name", ["adamw-acc2-clip", "ha-forward-acc2-clip-rollback"])
@pytest.mark.parametrize("mode", ["no_grad", "inference", "grad"])
def test_evaluation_between_micro_batches(stores, one_thread, name, mode):
    mid = _eval_at(mode, steps=(1, 3))
    want_evals = Loop(name, False, stores()).run(mid=mid)
    want = Loop(name, False, stores()).run()
    got = Loop(name, True, stores()).run(mid=mid)
    assert_same(got, (want[0], want_evals[1], want[2]), f"{name} {mode} between micro-batches")


@pytest.mark.parametrize("name", ["adamw", "ha-forward"])
@pytest.mark.parametrize("mode", ["inference", "no_grad"])
def test_evaluation_reading_weights_from_nvme(stores, one_thread, name, mode):
    """``tier="nvme"``: the evaluation's fills open the store's slabs. Under inference mode they
    were inference tensors and the next step's write into them raised; red before the fix."""
    want_evals = Loop(name, False, stores()).run(_eval_at(mode))
    want = Loop(name, False, stores()).run()
    got = Loop(name, True, stores(nvme=True), tier="nvme").run(_eval_at(mode))
    assert_same(got, (want[0], want_evals[1], want[2]), f"{name} {mode} nvme")


@pytest.mark.parametrize("name", ["adamw", "ha-forward-acc2-clip-rollback"])
def test_evaluation_loss_kept_into_the_next_forward(stores, one_thread, name):
    """A validation loss with its graph, still referenced when training resumes (``loss = ...``
    rebinds only after the call): refused in one line naming the fix; dropped, training goes on
    exactly."""
    kept = {}

    def hook(loop, step):
        if step == 2:
            logits, kept["loss"] = loop.model(*batches(50, 1)[0])
            idx, targets = batches(step, loop.n_micro)[0]
            with pytest.raises(RuntimeError, match=r"blocks\[0\] called again while the previous "
                                                   r"forward's graph is alive.*drop the previous "
                                                   r"outputs, or evaluate under torch.no_grad"):
                loop.model(idx, targets)
            kept.clear()
        return None

    want = Loop(name, False, stores()).run()
    got = Loop(name, True, stores()).run(hook)
    assert_same(got, want, name)


# ---------------------------------------------------------------- 3: state dicts, dtype, freezing


def _round_trip(loop, step):
    """torch.save / torch.load of the model's state dict and a load of it, at steps 2 and 4
    (after an evaluation at 4), a rewind to step 1's weights at step 3."""
    if step == 1:
        loop.saved = {k: v.clone() for k, v in loop.model.state_dict().items()}
    if step in (2, 4):
        out = evaluate(loop.model, "no_grad") if step == 4 else None
        buf = io.BytesIO()
        torch.save(loop.model.state_dict(), buf)
        buf.seek(0)
        loop.model.load_state_dict(torch.load(buf))
        return out
    if step == 3:
        loop.model.load_state_dict(loop.saved)
    return None


def _freeze(loop, step):
    """blocks[1] frozen from step 2, blocks[2] from step 3 to step 5 (a fine-tuning schedule)."""
    if step == 2:
        loop.model.blocks[1].requires_grad_(False)
    if step == 3:
        loop.model.blocks[2].requires_grad_(False)
    if step == 5:
        loop.model.blocks[2].requires_grad_(True)


def _to_bf16_and_back(loop, step):
    """``model.to(bfloat16)`` at step 2: a streamed model refuses the next forward in one line
    and changes nothing; ``model.float()`` then continues (the weights rounded, as resident)."""
    if step != 2:
        return
    if isinstance(loop.opt, HybridAdam):
        loop.opt.synchronize()  # before changing params after a forward-synced step()
    loop.model.to(torch.bfloat16)
    if loop.stream is not None:
        with pytest.raises(ValueError, match=r"blocks\[0\]\.ln1\.weight\.data was replaced by a "
                                             r"torch\.bfloat16 tensor.*change a dtype "
                                             r"\(module\.to\(dtype\)\) before stream_weights"):
            loop.model(*batches(step, 1)[0])
    loop.model.float()


@pytest.mark.parametrize("change", ["round_trip", "freeze", "to_bf16_and_back"])
@pytest.mark.parametrize("name", ["adamw", "ha-step", "ha-forward-acc2-clip-rollback"])
def test_model_changes_between_steps(stores, one_thread, name, change):
    hook = {"round_trip": _round_trip, "freeze": _freeze,
            "to_bf16_and_back": _to_bf16_and_back}[change]
    want = Loop(name, False, stores()).run(hook)
    got = Loop(name, True, stores()).run(hook)
    assert_same(got, want, f"{name} {change}")


def test_weight_made_trainable_is_refused(stores, one_thread):
    model = make_model()
    model.blocks[1].fc.weight.requires_grad_(False)
    with stream_weights(model.blocks, store=stores()):
        model.blocks[1].fc.weight.requires_grad_(True)
        with pytest.raises(ValueError, match=r"blocks\[1\]\.fc\.weight requires grad now but "
                                             r"was frozen.*close\(\) the stream"):
            model(*batches(0, 1)[0])
        model.blocks[1].fc.weight.requires_grad_(False)
        model(*batches(0, 1)[0])[1].backward()


# ---------------------------------------------------------------- 4: a forward that raises


def _raising(where, exc):
    """At steps 2 and 4, a forward whose ``where`` (a module of the model) raises ``exc`` from
    a forward pre-hook; the loop catches it and goes on."""
    def hook(loop, step):
        if step not in (2, 4):
            return None
        module = loop.model.get_submodule(where)
        handle = module.register_forward_pre_hook(lambda m, args: _throw(exc))
        try:
            _, loss = loop.model(*batches(60 + step, 1)[0])
            loss.backward()
        except (exc, RuntimeError) as e:
            assert "thrown" in str(e)
        finally:
            handle.remove()
        return None
    return hook


def _throw(exc):
    raise exc("thrown by a hook")


@pytest.mark.parametrize("where", ["blocks.0", "blocks.2", "blocks.2.fc", "blocks.3"])
@pytest.mark.parametrize("exc", [Interrupt, RuntimeError], ids=["interrupt", "exception"])
@pytest.mark.parametrize("name", ["adamw", "ha-forward-acc2-clip-rollback"])
def test_forward_that_raises(stores, one_thread, name, exc, where):
    """The stream stays usable and the next steps are exact. Red before the fix for the
    interrupt (not an ``Exception``: torch skips the always-called forward hook, the pass stayed
    open and the next forward was refused: Note [interrupted forward])."""
    want = Loop(name, False, stores()).run()
    got = Loop(name, True, stores()).run(_raising(where, exc))
    assert_same(got, want, f"{name} {exc.__name__} in {where}")


def test_interrupt_then_state_dict_and_close(stores, one_thread):
    """After an interrupt in blocks[2] the pass is ended by ``state_dict()`` (the host copies,
    unchanged) and ``close()`` succeeds without ``force``."""
    model = make_model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    stream = stream_weights(model.blocks, store=stores())
    handle = model.blocks[2].register_forward_pre_hook(lambda m, args: _throw(Interrupt))
    with pytest.raises(Interrupt):
        model(*batches(0, 1)[0])
    handle.remove()
    assert stream.in_pass
    got = model.state_dict()
    assert not stream.in_pass
    for k in want:
        assert torch.equal(got[k], want[k]), k
    stream.close()
    assert model.blocks[2].fc.weight.shape == want["blocks.2.fc.weight"].shape


def test_block_zero_called_inside_a_running_block_is_still_refused(stores, one_thread):
    """The must-fail twin of the interrupt fix: a pass whose running block is still on the
    stack (blocks[0] called from inside blocks[2]'s forward) is not ended, it is refused; then
    the stream goes on (the refusal is an Exception: the forward ends the pass)."""
    model = make_model()
    with stream_weights(model.blocks, store=stores()) as stream:
        x = torch.zeros(1, 4, CFG.d_model)
        handle = model.blocks[2].fc.register_forward_pre_hook(lambda m, args: model.blocks[0](x))
        with pytest.raises(RuntimeError, match=r"blocks\[0\] called again while the "
                                               r"previous forward's pass is open "
                                               r"\(it reached blocks\[2\]\)"):
            model(*batches(0, 1)[0])
        handle.remove()
        assert not stream.in_pass
        model(*batches(0, 1)[0])[1].backward()


# ---------------------------------------------------------------- 5: shapes


def _shapes(batch, n_micro):
    """Step ``step``'s micro-batches of ``batch`` samples, the sequence 16, 12 or 8 long."""
    def data(step):
        length = CFG.seq_len - (step % 3) * 4
        return [(idx[:, :length], targets[:, :length])
                for idx, targets in batches(step, n_micro, batch=batch)]
    return data


@pytest.mark.parametrize("block_major", [False, True], ids=["depth-first", "block-major"])
@pytest.mark.parametrize("name", ["adamw-acc2-clip", "ha-forward-acc2-clip-rollback",
                                  "ha-step-acc2-no-overlap"])
@pytest.mark.parametrize("batch", [1, 2])
def test_sequence_length_changes_and_batch_of_one(stores, one_thread, name, batch, block_major):
    fb = (lambda model, bs: forward_backward(model, bs, block_major=True)) if block_major \
        else None
    data = _shapes(batch, OPTS[name]["n_micro"])
    want = Loop(name, False, stores()).run(data=data, fb=fb)
    got = Loop(name, True, stores()).run(data=data, fb=fb)
    assert_same(got, want, f"{name} batch {batch}")
    assert [t.numel() for t in got[0]] == [OPTS[name]["n_micro"]] * STEPS


def test_store_slab_opened_under_inference_mode(stores):
    """Note [slabs outside inference mode]: a put under ``torch.inference_mode()`` that opens a
    slab, then a put beside it outside: the second raised "Inplace update to inference tensor"
    before the fix; both values are kept."""
    store = stores()
    with torch.inference_mode():
        store.put("a", torch.full((10,), 1.5), "cpu")
    store.put("b", torch.full((10,), 2.5), "cpu")  # into the slab "a" opened
    assert not store.get("b", "cpu").is_inference()
    assert torch.equal(store.get("a", "cpu"), torch.full((10,), 1.5))
    assert torch.equal(store.get("b", "cpu"), torch.full((10,), 2.5))


@pytest.mark.parametrize("name", ["adamw", "ha-forward-acc2-clip-rollback"])
def test_load_state_dict_assign_is_refused(stores, one_thread, name):
    """``load_state_dict(assign=True)`` would replace the streamed parameters: refused at the
    load, naming the fix (before: at the next forward, blaming FSDP); the default load then
    continues exactly as the resident loop's."""
    def hook(loop, step):
        if step != 2:
            return None
        sd = {k: v.clone() for k, v in loop.model.state_dict().items()}
        if loop.stream is not None:
            old = {m: loop.model.get_submodule(m).weight for m in ("tok", "pos")}
            with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\) reached "
                                                   r"streamed blocks\[0\].*assign=False"):
                loop.model.load_state_dict(sd, assign=True)
            for m, param in old.items():  # torch assigned these before blocks[0]: as unstreamed,
                setattr(loop.model.get_submodule(m), "weight", param)  # the optimizer's are lost
        loop.model.load_state_dict(sd)
        return None

    want = Loop(name, False, stores()).run(hook)
    got = Loop(name, True, stores()).run(hook)
    assert_same(got, want, f"{name} assign")



@pytest.mark.parametrize("name", ["adamw-acc2-clip", "ha-step", "ha-forward-acc2-clip-rollback"])
def test_evaluation_loss_kept_over_the_step(stores, one_thread, name):
    """A validation loss computed with autograd on after the last backward and still referenced
    at ``step()``: its pass is open, so the step is refused in one line naming the fix (drop
    the outputs, or evaluate under no_grad) and changes nothing; with the loss dropped the same
    step goes on exactly."""
    def before_step(loop, step):
        if step != 2 or loop.stream is None:
            return
        kept = loop.model(*batches(50, 1)[0])[1]
        with pytest.raises(RuntimeError, match=r"\.step\(\) during a weight-streaming pass.*"
                                               r"drop outputs no backward will use"):
            loop.opt.step()
        del kept

    want = Loop(name, False, stores()).run()
    got = Loop(name, True, stores()).run(before_step=before_step)
    assert_same(got, want, f"{name} loss kept over step()")


def _validation_loss(loop, step):
    """A validation loss with autograd on, read with ``.item()`` (its graph dropped at once)
    and no backward: the stream's pass stays open until the next forward or step."""
    if step in (1, 2, 4):
        loop.val = loop.model(*batches(50 + step, 1)[0])[1].item()


@pytest.mark.parametrize("name", ["adamw-tight-clip"] + list(OPTS))
def test_validation_loss_before_clip_and_step(stores, one_thread, name):
    """Between the last backward and ``clip_grad_norm_`` / ``step()``: the streamed ``.grad``
    read None there (Note [gradients at backward]), so AdamW's clip left them out of the norm
    and unclipped; silently different losses from step 2 on before the fix (``adamw-tight-clip``:
    a norm the clip reaches every step)."""
    want = Loop(name, False, stores()).run()
    got = Loop(name, True, stores()).run(before_step=_validation_loss)
    assert_same(got, want, f"{name} validation loss before clip")


@pytest.mark.parametrize("name", list(OPTS))
def test_validation_loss_before_zero_grad(stores, one_thread, name):
    """The textbook loop (``zero_grad()`` first) with a validation loss after ``step()``: the
    ``zero_grad()`` fell in the open pass and was undone at its end, so the next step added its
    gradients to the last step's; silently different losses before the fix."""
    def hook(loop, step):
        _validation_loss(loop, step)

    want = Loop(name, False, stores()).run(zero_first=True)
    got = Loop(name, True, stores()).run(hook, zero_first=True)
    assert_same(got, want, f"{name} validation loss before zero_grad")


class _ZeroAfterForward(Loop):
    """PyTorch's quickstart order: ``loss = model(x)``, ``zero_grad()``, ``loss.backward()``,
    ``step()``."""

    def run(self, steps=STEPS):
        losses = []
        try:
            for step in range(steps):
                got = []
                for idx, targets in batches(step, self.n_micro):
                    _, loss = self.model(idx, targets)
                    if not got:
                        self.opt.zero_grad(set_to_none=True)
                    (loss / self.n_micro).backward()
                    got.append(loss.detach())
                if isinstance(self.opt, torch.optim.AdamW) and self.cfg.get("clip"):
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["clip"])
                self.opt.step()
                losses.append(torch.stack(got))
            if isinstance(self.opt, HybridAdam):
                self.opt.synchronize()
            weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        finally:
            self.close()
        return losses, [], weights


@pytest.mark.parametrize("name", ["adamw", "adamw-acc2-clip", "ha-step", "ha-forward"])
def test_zero_grad_between_forward_and_backward(stores, one_thread, name):
    """``zero_grad()`` after the forward, before its backward: it fell in the open pass, whose
    backward then added to the gradients taken aside at the forward (Note [gradients at
    backward]); silently different losses before the fix."""
    want = _ZeroAfterForward(name, False, stores()).run()
    got = _ZeroAfterForward(name, True, stores()).run()
    assert_same(got, want, f"{name} zero_grad between forward and backward")
