"""Checkpoints of streamed models (issue 29 item 3: "state_dict / checkpoint resume keep working
and stay exact"), the way a PyTorch user takes them: ``torch.save(model.state_dict())`` and
``opt.state_dict()`` right after ``step()`` (with ``param_sync="forward"`` the worker may still
be writing host copies), between micro-batches, during an open pass, between ``backward()`` and
``step()``; ``model.load_state_dict`` between passes into cpu, nvme and NVMe-home streams; and
resume in a fresh model, stream and HybridAdam. Note [streamed state dicts] in
tiermem/stream/state_dicts.py, Note [state between steps] in tiermem/optim/step_state.py.

Every training run is 8 steps of different batches; the reference is an independent run of a
model built from the same seed, not streamed and never saved or interrupted; comparisons are bit
for bit (losses, weights, optimizer state, every step)."""

from __future__ import annotations

import io
import logging
import threading

import pytest
import torch

from tiermem.checkpoint import load_checkpoint, save_checkpoint
from tiermem.optim.chunk_worker import ChunkWorker
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import assert_same_steps, batches, frozen_gpt, make_model, train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster
STEPS = 8


@pytest.fixture
def stores(make_stream_store):
    """``stores(nvme)``: a CPU store, no GPU budget, 8 MiB RAM; ``nvme``: a 64 MiB NVMe tier."""
    return lambda nvme=False: make_stream_store(gpu_bytes=0, cpu_bytes=8 << 20,
                                                **({"nvme_bytes": 64 << 20} if nvme else {}))


def _cfg(tier="cpu", state_tier="cpu", fraction=1.0, n_micro=1, clip=None, major=False,
         spec=0, sync="step", lane=0.0, dtype=torch.float32):
    return dict(tier=tier, state_tier=state_tier, fraction=fraction, n_micro=n_micro,
                clip=clip, major=major, spec=spec, sync=sync, lane=lane, dtype=dtype)


class Run:
    """A GPT trained by HybridAdam; ``streamed``: its blocks streamed (before HybridAdam)."""

    def __init__(self, cfg, stores, streamed, seed=0):
        self.cfg = cfg
        self.model = make_model(cfg["dtype"], seed=seed)
        nvme = cfg["tier"] == "nvme" or cfg["state_tier"] != "cpu"
        self.stream = stream_weights(self.model.blocks, store=stores(nvme), tier=cfg["tier"],
                                     prefetch_blocks=1) if streamed else None
        self.opt = HybridAdam(self.model.parameters(), lr=3e-3, weight_decay=0.1,
                              offload_fraction=cfg["fraction"], chunk_numel=2048,
                              max_grad_norm=cfg["clip"], grad_accumulation_steps=cfg["n_micro"],
                              state_tier=cfg["state_tier"], rollback_bytes=cfg["spec"],
                              store=stores(True) if cfg["state_tier"] != "cpu" else None,
                              param_sync=cfg["sync"], gpu_step_fraction=cfg["lane"])

    def passes(self, step, micro=None):
        """Forward and backward of ``step``'s micro-batches; ``micro``: only those (depth-first,
        each loss divided by the step's micro-batches, as ``forward_backward`` does)."""
        n = self.cfg["n_micro"]
        mbs = batches(step, n)
        if micro is None:
            return forward_backward(self.model, mbs, block_major=self.cfg["major"])
        losses = []
        for idx, targets in (mbs[i] for i in micro):
            x = self.model.embed(idx)
            for i in range(len(self.model.blocks)):
                x = self.model.run_block(i, x)
            _, loss = self.model.output(x, targets)
            (loss / n).backward()
            losses.append(loss.detach())
        return losses

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def snapshot(self, losses):
        """``(losses, weights, optimizer state)`` after the step (completed first)."""
        self.opt.synchronize()
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        sd = self.opt.state_dict()
        state = {(i, k): t.clone() for i, st in sd["state"].items() for k, t in st.items()
                 if isinstance(t, torch.Tensor)}
        return torch.stack(losses).detach(), weights, state

    def close(self):
        self.opt.close()
        if self.stream is not None:
            self.stream.close()


def _reference(cfg, stores, saves=None):
    """The independent run: not streamed, never interrupted, 8 steps; ``saves``: a dict that
    gets ``{step k: (model bytes, optimizer bytes)}`` saved after every step (after the
    snapshot, which completes the step)."""
    run = Run(cfg, stores, streamed=False)
    try:
        out = []
        for s in range(STEPS):
            losses = run.passes(s)
            run.step()
            out.append(run.snapshot(losses))
            if saves is not None:
                saves[s + 1] = (_saved(run.model.state_dict()), _saved(run.opt.state_dict()))
        return out
    finally:
        run.close()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loaded(data: bytes):
    return torch.load(io.BytesIO(data))


# ---------------------------------------------------------------- resume after step k

RESUME = {
    # the last micro-batch summed on the device (Note [last pass sums on the device]),
    # clipping with speculation, half the state on the "GPU" side
    "cpu-f05-acc4-depth-clip-spec": _cfg(fraction=0.5, n_micro=4, clip=0.5, spec=1 << 30),
    "cpu-f05-acc4-major-clip-spec": _cfg(fraction=0.5, n_micro=4, clip=0.5, spec=1 << 30,
                                         major=True),
    "nvme-f05-acc2-split-clip-spec": _cfg("nvme", "split", 0.5, 2, 0.5, spec=1 << 30),
    "nvme-f1-acc2-nvmestate-major-overlap": _cfg("nvme", "nvme", 1.0, 2, major=True),
    "cpu-bf16-acc2-forward-lane": _cfg(n_micro=2, sync="forward", lane=0.5,
                                       dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_after_step_k_continues_bit_identically(stores, name):
    """``torch.save(model.state_dict())`` right after ``step()`` (no ``synchronize()``: with
    ``param_sync="forward"`` the model's state dict completes the step, Note [streamed state
    dicts]), then ``opt.state_dict()``, at step 3; the saving run goes on to step 8 and a fresh
    model (other seed), store, stream and HybridAdam resumed from the bytes does steps 3-7:
    both equal the reference at every step. So does a streamed resume from the unstreamed
    reference's checkpoint (streaming switched on at the resume), loading the optimizer
    first (its masters then come from the model loaded after it: Note [param changes])."""
    cfg = RESUME[name]
    saves = {}
    want = _reference(cfg, stores, saves)
    k = 3
    first = Run(cfg, stores, streamed=True)
    got = []
    try:
        for s in range(STEPS):
            losses = first.passes(s)
            first.step()
            if s == k - 1:
                model_bytes = _saved(first.model.state_dict())  # before the optimizer's
                opt_bytes = _saved(first.opt.state_dict())
            got.append(first.snapshot(losses))
    finally:
        first.close()
    assert_same_steps(got, want, name + " saving run")
    resumed, stats = _resume(cfg, stores, model_bytes, opt_bytes, k)
    assert_same_steps(resumed, want[k:], name + " resumed")
    if cfg["n_micro"] > 1 and not cfg["major"]:  # the device sums ran after the resume
        assert stats["device_sums"] > 0
    crossed, _ = _resume(cfg, stores, *saves[k], k, opt_first=True)
    assert_same_steps(crossed, want[k:], name + " resumed from the unstreamed run")
    assert not torch.equal(want[k][1]["blocks.0.qkv.weight"], want[-1][1]["blocks.0.qkv.weight"])


def _resume(cfg, stores, model_bytes, opt_bytes, k, stale_block=None, opt_first=False):
    """Steps ``k``-7 of a fresh model (other seed), store, stream and HybridAdam loaded from the
    bytes (``opt_first``: the optimizer's first); ``stale_block``: that block's first fill
    streams the fresh model's own weights (a stale copy: what a load that the stream missed
    would stream). Returns the snapshots and the stream's stats."""
    run = Run(cfg, stores, streamed=True, seed=1)  # other weights: the load matters
    if stale_block is not None:
        mine = {n: p.detach().clone() for n, p in run.model.blocks[stale_block].named_parameters()}
        fired = []

        def stale(block, p, src):
            if block.index != stale_block or len(fired) == len(mine):
                return src
            fired.append(p.name)
            return mine[p.name]
        run.stream._fetcher.fault = stale
    out = []
    try:
        if opt_first:
            run.opt.load_state_dict(_loaded(opt_bytes))
        run.model.load_state_dict(_loaded(model_bytes))
        if not opt_first:
            run.opt.load_state_dict(_loaded(opt_bytes))
        for s in range(k, STEPS):
            losses = run.passes(s)
            run.step()
            out.append(run.snapshot(losses))
        return out, run.stream.stats()
    finally:
        run.close()


def test_a_stale_weight_after_resume_is_caught(stores):
    """The twin of the resume test: one block streaming the fresh model's weights at the first
    fill after the load makes the comparison fail at the first resumed step."""
    cfg = RESUME["nvme-f05-acc2-split-clip-spec"]
    want = _reference(cfg, stores)
    first = Run(cfg, stores, streamed=True)
    try:
        for s in range(3):
            first.passes(s)
            first.step()
        model_bytes = _saved(first.model.state_dict())
        opt_bytes = _saved(first.opt.state_dict())
    finally:
        first.close()
    assert_same_steps(_resume(cfg, stores, model_bytes, opt_bytes, 3)[0], want[3:], "exact")
    got = _resume(cfg, stores, model_bytes, opt_bytes, 3, stale_block=1)[0]
    with pytest.raises(AssertionError, match="stale step 0: losses"):
        assert_same_steps(got, want[3:], "stale")


# ---------------------------------------------------------------- param_sync="forward"

@pytest.fixture
def gated_worker(monkeypatch):
    """HybridAdam's worker steps no chunk until ``synchronize()`` is called (or 30 s pass):
    a ``param_sync="forward"`` step is then deterministically still pending after ``step()``,
    and whatever reads the host copies before completing it reads stale ones.
    ``gate.clear()`` closes the gate again."""
    gate = threading.Event()
    step_chunk, sync = ChunkWorker._step_chunk, HybridAdam.synchronize

    def gated(self, *args):
        gate.wait(30)
        return step_chunk(self, *args)

    def opening(self):
        gate.set()
        return sync(self)

    monkeypatch.setattr(ChunkWorker, "_step_chunk", gated)
    monkeypatch.setattr(HybridAdam, "synchronize", opening)
    yield gate
    gate.set()


def test_model_state_dict_and_load_right_after_a_forward_synced_step(stores, gated_worker):
    """``param_sync="forward"``: ``torch.save(model.state_dict())`` right after ``step()``
    holds that step's weights, and ``model.blocks.load_state_dict(...)`` right after it is
    taken (the stream completes the step first: Note [streamed state dicts]). Before, the saved
    weights of every offloaded chunk were the step before's, and the load raced the worker's
    write-back (its completion raised "changed while the step was still updating it"; a load
    of the whole model still does for the resident embeddings, loaded before any block: with
    ``param_sync="forward"`` call ``opt.synchronize()`` before loading them)."""
    cfg = _cfg(clip=1e9, sync="forward")  # clipping: every chunk is stepped after step()
    other = make_model(seed=2).blocks.state_dict()

    def run(streamed):
        r = Run(cfg, stores, streamed=streamed)
        saved, out = [], []
        try:
            for s in range(STEPS):
                losses = r.passes(s)
                gated_worker.clear()
                r.step()
                if not streamed:
                    r.opt.synchronize()  # the reference completes the step first
                if s == 4:
                    r.model.blocks.load_state_dict(other)  # streamed: the step is pending
                saved.append(_loaded(_saved(r.model.state_dict())))  # (pending at the others)
                out.append(r.snapshot(losses))
        finally:
            r.close()
        return saved, out

    want_saved, want = run(False)
    got_saved, got = run(True)
    assert_same_steps(got, want, "load after step")
    for s, (a, b) in enumerate(zip(got_saved, want_saved)):
        for k in b:
            assert torch.equal(a[k], b[k]), f"saved after step {s}: {k}"


def test_a_stale_saved_weight_is_caught(stores, gated_worker, monkeypatch):
    """The twin: with ``Link.between_steps`` a no-op (the stream completes no step) and
    HybridAdam's own model hooks off (Note [model state dicts after a forward-synced step]),
    the weights saved right after ``step()`` are the step before's."""
    from tiermem.optim import streamed
    from tiermem.optim.forward_sync import ModelHooks

    monkeypatch.setattr(streamed.Link, "between_steps", lambda self, what: None)
    monkeypatch.setattr(ModelHooks, "see", lambda self, module: None)
    r = Run(_cfg(clip=1e9, sync="forward"), stores, streamed=True)
    try:
        r.passes(0)
        gated_worker.clear()
        before = {k: v.clone() for k, v in r.model.state_dict().items()}
        r.step()
        early = _loaded(_saved(r.model.state_dict()))
        r.opt.synchronize()
        late = r.model.state_dict()
        stale = [k for k in late if k.startswith("blocks.") and torch.equal(early[k], before[k])
                 and not torch.equal(late[k], before[k])]
    finally:
        r.close()
    assert stale, "the twin must save stale weights"


# ---------------------------------------------------------------- during a pass

def test_model_state_dict_during_an_open_pass_is_exact(stores, tmp_path):
    """After the forward, before the backward (a loss kept for logging): released blocks'
    ``.data`` is an empty placeholder, and ``model.state_dict()`` used to hold those empty
    tensors (a checkpoint that silently lost the weights), and ``opt.state_dict()`` failed on
    the placeholders' shape. Now the model's holds the host copies (the pass's weights) and the
    optimizer's is exact; ``keep_vars=True`` and ``model.load_state_dict`` are refused in one
    line; a ``tiermem.checkpoint`` saved there resumes exactly; the run is the reference's."""
    cfg = _cfg(fraction=0.5, n_micro=1)
    want = _reference(cfg, stores)
    r = Run(cfg, stores, streamed=True)
    got = []
    path = tmp_path / "ck.pt"
    try:
        for s in range(STEPS):
            if s == 3:
                before = {k: v.clone() for k, v in r.model.state_dict().items()}
                idx, targets = batches(s, 1)[0]
                _, loss = r.model(idx, targets)
                assert r.stream.in_pass
                during = r.model.state_dict()
                for k, v in before.items():
                    assert torch.equal(during[k], v), k
                with pytest.raises(RuntimeError, match=r"keep_vars=True\) during a weight-"):
                    r.model.state_dict(keep_vars=True)
                with pytest.raises(RuntimeError, match=r"load_state_dict\(\) during a weight-"):
                    r.model.load_state_dict(before)
                save_checkpoint(path, model=r.model, optimizer=r.opt)  # opt.state_dict() too
                r.opt.load_state_dict(r.opt.state_dict())  # a round trip changes nothing
                loss.backward()
                losses = [loss.detach()]
            else:
                losses = r.passes(s)
            r.step()
            got.append(r.snapshot(losses))
    finally:
        r.close()
    assert_same_steps(got, want, "open pass")
    second = Run(cfg, stores, streamed=True, seed=1)
    try:
        load_checkpoint(path, model=second.model, optimizer=second.opt)
        resumed = []
        for s in range(3, STEPS):
            losses = second.passes(s)
            second.step()
            resumed.append(second.snapshot(losses))
    finally:
        second.close()
    assert_same_steps(resumed, want[3:], "resumed from the open pass")


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_saving_between_backward_and_step_is_refused(stores, streamed, tmp_path):
    """``overlap=True`` without clipping: the CPU side steps each chunk during the step's last
    backward, before ``step()``. ``opt.state_dict()`` there returned half-updated moments with
    the old step counts (and, streamed, ``model.state_dict()`` half-updated host copies): a
    checkpoint that resumes differently. Both, and ``opt.load_state_dict``, are now refused in
    one line (Note [state between steps]); ``save_checkpoint`` there leaves the previous
    checkpoint as it was and its directory unchanged; nothing changed: the run is the
    reference's."""
    cfg = _cfg(fraction=0.5, n_micro=2)
    want = _reference(cfg, stores)
    r = Run(cfg, stores, streamed=streamed)
    path = tmp_path / "ck.pt"
    got = []
    try:
        for s in range(STEPS):
            if s == 3:
                state = r.opt.state_dict()
                save_checkpoint(path, model=r.model, optimizer=r.opt)
                before = (path.read_bytes(), sorted(tmp_path.iterdir()))
            losses = r.passes(s)
            if s == 3:
                assert r.opt._step.queued  # the premise: chunks were stepped in the backward
                with pytest.raises(RuntimeError, match=r"between backward\(\) and step\(\)"):
                    r.opt.state_dict()
                with pytest.raises(RuntimeError, match=r"between backward\(\) and step\(\)"):
                    r.opt.load_state_dict(state)
                if streamed:
                    with pytest.raises(RuntimeError, match=r"model\.state_dict\(\) .*between "
                                                           r"backward\(\) and step\(\)"):
                        r.model.state_dict()
                with pytest.raises(RuntimeError, match=r"between backward\(\) and step\(\)"):
                    save_checkpoint(path, model=r.model, optimizer=r.opt)
                assert (path.read_bytes(), sorted(tmp_path.iterdir())) == before
            r.step()
            got.append(r.snapshot(losses))
    finally:
        r.close()
    assert_same_steps(got, want, "refused saves")


# ---------------------------------------------------------------- mid-accumulation

@pytest.mark.parametrize("at,clip", [((0, 1), 0.5), ((3, 2), 0.5), ((3, 3), None)],
                         ids=["step0-mb1", "step3-mb2", "step3-mb3-overlap"])
def test_saving_mid_accumulation_resumes_exactly(stores, at, clip):
    """Depth-first over 4 micro-batches, clipping with speculation (or none: overlap steps
    chunks in the last backward, not before it): model and optimizer saved after micro-batch
    ``m`` of step ``k`` (at step 0 before HybridAdam has placed its state: Note [trace
    placement]). Gradients are not in a state dict (as with torch optimizers), so the
    checkpoint is the state before step ``k``: resumed from its start it equals the reference,
    and the saving run itself is unchanged by the save. The twin: a resume that skips the
    micro-batches already run (their gradients lost) differs."""
    k, m = at
    cfg = _cfg(fraction=0.5, n_micro=4, clip=clip, spec=1 << 30 if clip else 0)
    want = _reference(cfg, stores)
    r = Run(cfg, stores, streamed=True)
    got = []
    try:
        for s in range(STEPS):
            if s == k:
                losses = r.passes(s, range(m))
                model_bytes = _saved(r.model.state_dict())
                opt_bytes = _saved(r.opt.state_dict())
                losses += r.passes(s, range(m, 4))
            else:
                losses = r.passes(s)
            r.step()
            got.append(r.snapshot(losses))
    finally:
        r.close()
    assert_same_steps(got, want, "saving run")

    def resume(skip):
        r = Run(cfg, stores, streamed=True, seed=1)
        out = []
        try:
            r.model.load_state_dict(_loaded(model_bytes))
            r.opt.load_state_dict(_loaded(opt_bytes))
            for s in range(k, STEPS):
                mb = range(m, 4) if skip and s == k else None
                losses = r.passes(s, mb)
                if mb is not None:
                    losses = [want[k][0][i] for i in range(m)] + losses
                r.step()
                out.append(r.snapshot(losses))
        finally:
            r.close()
        return out

    assert_same_steps(resume(skip=False), want[k:], "resumed")
    with pytest.raises(AssertionError, match="resumed naively step 0"):
        assert_same_steps(resume(skip=True), want[k:], "resumed naively")


# ---------------------------------------------------------------- load_state_dict


def test_nvme_home_state_dict_and_load(make_stream_store, caplog):
    """Weights homed on NVMe (``staging_blocks``, Note [NVMe home]) have a NaN stand-in as
    ``.data``: ``model.state_dict()`` held those NaNs (a fresh model loaded from it trained on
    NaN weights) and ``model.load_state_dict`` failed on the stand-in. Now the state dict leaves
    them out (logged; a strict load names them missing), and a load writes the new weights to
    NVMe, which the next forward streams: 8 AdamW steps with a load of other weights at step 4
    equal the same loop unstreamed."""
    other = frozen_gpt(seed=2).state_dict()
    frozen = [k for k, v in other.items() if k.startswith("blocks.") and v.dim() == 2]

    def between(model, step):
        if step == 4:
            model.load_state_dict(other)

    want = train(frozen_gpt(), steps=STEPS, n_micro=2, between_steps=between)
    store = make_stream_store(cpu_bytes=4 << 20, nvme_bytes=16 << 20)
    model = frozen_gpt()
    handles = []

    def stream(m):
        handles.append(stream_weights(m.blocks, store=store, tier="nvme", prefetch_blocks=1,
                                      frozen_only=True, staging_blocks=2))
        return handles[0]

    with caplog.at_level(logging.WARNING, logger="tiermem"):
        got = train(model, steps=STEPS, n_micro=2, stream=stream, between_steps=between)
    for step, (x, y) in enumerate(zip(got[0], want[0])):
        assert torch.equal(x, y), f"step {step}"
    assert not any(k in got[1] for k in frozen)  # left out, not NaN
    assert all(not v.isnan().any() for v in got[1].values())
    assert sum("left out of model.state_dict()" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="Missing key"):
        frozen_gpt(seed=3).load_state_dict(got[1])
    handles[0].close()
    final = model.state_dict()  # read back from NVMe: the loaded weights
    for k in frozen:
        assert torch.equal(final[k], other[k]), k
