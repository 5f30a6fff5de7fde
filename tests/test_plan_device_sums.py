"""``tiermem plan`` counts the GPU bytes of the last pass's gradient sums (Note [last pass sums
on the device] in tiermem/stream/grads.py; Note [streaming plan] in
tiermem/apps/plan/streaming.py): with weights streamed depth-first over M > 1 micro-batches
(HybridAdam connected, as the plan assumes), ``prefetch_blocks + 2`` blocks of sums, each a
block's weights' bytes, beside the streaming buffers; block-major passes and a single
micro-batch upload none.

- The 13B issue example: the row, and the resident set chosen with it, from the shapes.
- The row is what a real CPU run of the planned tiny GPT holds on the "device" at once (8
  HybridAdam steps over 2 different micro-batches, every block streamed), counted through the
  stream's own uploads.
- A budget that held the old plan (buffers without sums) no longer fits, and says so naming
  the row, on the command line too."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.apps.plan import GiB, PRESETS, main, plan
from tiermem.models.gpt import GPT
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights
from tiermem.stream.grads import HostGrads

ROW = "last-pass gradient sums"


def issue_13b(**kw):
    s = PRESETS["13b"]
    kw = {"gpu_bytes": "24GiB", "host_bytes": "125GiB", "nvme_bytes": "60GiB",
          "moments_dtype": "bf16", "checkpoint": True, "stream_weights": "auto",
          "batch": s.micro_batch, **kw}
    return plan(s.num_params(), n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads,
                vocab=s.vocab, seq=s.seq_len, **kw)


def test_depth_first_accumulation_counts_the_sums_and_keeps_fewer_blocks_resident():
    """13B, 24 GiB, depth-first over 4 micro-batches: 3 blocks of bf16 sums (prefetch 1 + 2);
    the resident suffix is the longest whose blocks (weights + gradients), buffers (weights +
    gradients) and sums fit the room; written from the shapes (as tests/test_plan_streaming.py's
    issue example), not read from the plan. Block-major over 4 and depth-first over 1 have no
    sums row."""
    s, cap = PRESETS["13b"], 24 * GiB
    b, seq, d, L, V = 1, s.seq_len, s.d_model, s.n_layers, s.vocab
    w = 2 * (12 * d * d + 13 * d)                                # one block's bf16 weights
    outside = 2 * 2 * (2 * V * d + seq * d + 2 * d)            # weights + gradients, bf16
    activations = L * b * seq * d * 2 + 34 * b * seq * d        # checkpointed + 1 recomputed
    head = b * seq * (2 * d * 2 + V * (2 * 2 + 8))
    room = cap - outside - activations - head - (GiB + cap // 20)

    def cost(r, sums):
        n_buf = min(3, L - r)
        return r * 2 * w + n_buf * 2 * w + (n_buf * w if sums else 0)
    p = issue_13b(stream_schedule="depth-first", grad_accumulation_steps=4)
    resident = max(r for r in range(L + 1) if cost(r, True) <= room)
    assert resident == 11 < max(r for r in range(L + 1) if cost(r, False) <= room) == 12
    assert p.fits and p.stream.resident == tuple(range(L - resident, L))
    rows = {i.name: i for i in p.items}
    assert rows[ROW].gpu == p.stream.sum_bytes == 3 * w
    assert (rows[ROW].host, rows[ROW].nvme) == (0, 0)
    assert rows["streaming buffers"].gpu == 3 * 2 * w
    assert p.used["gpu"] == cap - room + cost(resident, True) <= cap
    names = [i.name for i in p.items]
    assert names.index(ROW) == names.index("streaming buffers") + 1
    for other in (issue_13b(stream_schedule="block-major", grad_accumulation_steps=4),
                  issue_13b(stream_schedule="depth-first", grad_accumulation_steps=1)):
        assert ROW not in {i.name for i in other.items} and other.stream.sum_bytes == 0


def _tiny_plan_kw(prefetch, schedule="depth-first", micro=2):
    """tests/stream's tiny GPT with 8 blocks (with 4, keeping every block resident would cost
    less than 3 buffers with their sums), and the plan's keywords for it."""
    from stream._stream_train import CFG
    cfg = dataclasses.replace(CFG, n_layers=8)
    return cfg, dict(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                     vocab=cfg.vocab, seq=cfg.seq_len, batch=2, dtype="float32",
                     grad_accumulation_steps=micro, stream_weights=True,
                     stream_schedule=schedule, prefetch_blocks=prefetch, gpu_reserve_bytes=0,
                     offload_layers=0)


def _held_sums(monkeypatch):
    """Count, at every block's backward start in a last pass (each ``HostGrads.upload``), the
    bytes of the sums on the device then (the Note's rule): those uploaded and not yet taken
    (alive: ``Param.dev_sum``'s tensors, held by weak references), and those taken since the
    previous block's backward began, whose copies back (on CUDA: the D2H stream, which
    ``record_stream`` makes the allocator wait for) may still read them. Returns the list of
    counts, one per upload call."""
    alive, taken, counts = [], [], []
    real_upload, real_sum = HostGrads.upload, HostGrads._sum_on_device

    def upload(self, entries):
        before = {id(e) for e in self._uploaded}
        real_upload(self, entries)
        alive.extend(weakref.ref(e.dev_sum) for e in self._uploaded if id(e) not in before)
        live = [r() for r in alive if r() is not None]
        if live or taken:
            counts.append(sum(t.numel() * t.element_size() for t in live) + sum(taken))
        taken.clear()

    def sum_on_device(self, entry, grad, tell):
        taken.append(entry.dev_sum.numel() * entry.dev_sum.element_size())
        real_sum(self, entry, grad, tell)

    def flush(self):
        real_flush(self)
        taken.clear()  # the pass end waited for every copy back (copies.landed)
    real_flush = HostGrads.flush
    monkeypatch.setattr(HostGrads, "upload", upload)
    monkeypatch.setattr(HostGrads, "_sum_on_device", sum_on_device)
    monkeypatch.setattr(HostGrads, "flush", flush)
    return counts


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_planned_sums_are_what_a_real_run_holds(prefetch, monkeypatch, one_thread):
    """The planned tiny GPT with every block streamed (a budget of the buffers and their sums
    alone), trained 8 HybridAdam steps depth-first over 2 different micro-batches: the stream
    sums every block weight's last micro-batch on the device (``device_sums``), and the most
    sum bytes on the device at once is the plan's row."""
    from stream._stream_train import batches
    cfg, kw = _tiny_plan_kw(prefetch)
    L = cfg.n_layers
    torch.manual_seed(0)
    model = GPT(cfg)
    w = sum(p.numel() for p in model.blocks[0].parameters()) * 4  # fp32 block weights
    buffers = prefetch + 2
    others = plan(cfg.num_params(), **kw, gpu_bytes=1 << 30).used["gpu"] - L * 2 * w
    p = plan(cfg.num_params(), **kw, gpu_bytes=others + buffers * 3 * w)
    assert p.fits and p.stream.streamed == tuple(range(L)) and p.stream.sum_bytes == buffers * w
    counts = _held_sums(monkeypatch)
    store = TierStore(StoreConfig(device="cpu", cpu_bytes="16MiB"))
    stream = stream_weights(model.blocks, store=store, prefetch_blocks=prefetch,
                            gpu_bytes=p.stream.stream_gpu_bytes)
    opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, chunk_numel=2048,
                     grad_accumulation_steps=2)
    first = model.blocks[0].qkv.weight.detach().clone()
    try:
        assert stream.plan.streamed == p.stream.streamed
        for step in range(8):
            forward_backward(model, batches(step, 2))
            opt.step()
            opt.zero_grad()
        n_params = sum(1 for _ in model.blocks.parameters())
        assert stream.stats()["device_sums"] == 8 * n_params
    finally:
        opt.close()
        stream.close()
        store.close()
    assert not torch.equal(model.blocks[0].qkv.weight, first)  # trained
    assert len(counts) == 8 * L  # every streamed block's backward in every last pass
    assert max(counts) == p.stream.sum_bytes


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_budget_without_the_sums_no_longer_fits(prefetch, capsys):
    """The budget of the buffers alone (what fit before the sums were counted) does not fit a
    depth-first plan over 2 micro-batches: the refusal names the sums' row; the same budget
    fits one micro-batch, and the command says the same (exit 1, one line naming the row)."""
    cfg, kw = _tiny_plan_kw(prefetch)
    L = cfg.n_layers
    w = (12 * cfg.d_model ** 2 + 13 * cfg.d_model) * 4
    buffers = prefetch + 2
    others = plan(cfg.num_params(), **kw, gpu_bytes=1 << 30).used["gpu"] - L * 2 * w
    tight = others + buffers * 2 * w
    p = plan(cfg.num_params(), **kw, gpu_bytes=tight)
    assert not p.fits and p.stream.sum_bytes == buffers * w
    assert f"{ROW} " in p.reasons[0] and p.reasons[0].startswith("gpu needs ")
    one = plan(cfg.num_params(), **{**kw, "grad_accumulation_steps": 1}, gpu_bytes=tight)
    assert one.fits and one.stream.streamed == tuple(range(L)) and one.stream.sum_bytes == 0
    argv = ["--params", str(cfg.num_params()), "--layers", str(L), "--d-model",
            str(cfg.d_model), "--heads", str(cfg.n_heads), "--vocab", str(cfg.vocab), "--seq",
            str(cfg.seq_len), "--batch", "2", "--dtype", "fp32", "--gpu-reserve", "0",
            "--offload-layers", "0", "--gpu-bytes", str(tight), "--stream-weights", "on",
            "--stream-schedule", "depth-first", "--prefetch-blocks", str(prefetch)]
    assert main(argv + ["--grad-accumulation-steps", "1"]) == 0
    capsys.readouterr()
    assert main(argv + ["--grad-accumulation-steps", "2"]) == 1
    out = capsys.readouterr().out
    refusal = [line for line in out.splitlines() if line.startswith("does not fit: gpu")]
    assert len(refusal) == 1 and ROW in refusal[0], out
    assert main(argv + ["--grad-accumulation-steps", "2", "--gpu-bytes",
                        str(tight + buffers * w)]) == 0
    assert f"{ROW}  " in capsys.readouterr().out
