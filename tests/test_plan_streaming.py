"""``tiermem plan`` with weight streaming (issue 29 item 6; Note [streaming plan] in
tiermem/apps/plan/streaming.py): which blocks stay resident, the buffers, the GPU total under the
cap, the host side, the PCIe / NVMe terms of each schedule, the refusal, the command, and the
issue's 13B example. The references are written from the shapes here, not read from the plan."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.apps.plan import GiB, MachineRates, PRESETS, main, plan, step_time
from tiermem.apps.plan.streaming import non_block_params
from tiermem.stream import stream_weights

ISSUE_13B = ["--model-size", "13b", "--gpu-bytes", "24GiB", "--host-bytes", "125GiB",
             "--nvme-bytes", "60GiB", "--moments-dtype", "bf16", "--checkpoint"]


def preset(size, **kw):
    s = PRESETS[size]
    kw.setdefault("batch", s.micro_batch)
    return plan(s.num_params(), n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads,
                vocab=s.vocab, seq=s.seq_len, **kw)


def issue_13b(**kw):
    kw = {"gpu_bytes": "24GiB", "host_bytes": "125GiB", "nvme_bytes": "60GiB",
          "moments_dtype": "bf16", "checkpoint": True, "stream_weights": "auto", **kw}
    return preset("13b", **kw)


def block_weight_bytes(d: int) -> int:
    """A pre-LN GPT block's bf16 weights: LN1, QKV (+bias), proj, LN2, fc, out = 12d^2 + 13d."""
    return 2 * (12 * d * d + 13 * d)


def block_page_bytes(d: int) -> int:
    """The same block in the store: each of its 12 bf16 tensors in whole 4096-byte pages."""
    numels = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return sum(-(-2 * n // 4096) * 4096 for n in numels)


def test_block_params_are_the_real_blocks():
    """The plan's split of a GPT into blocks and the rest is the model's own."""
    cfg = GPTConfig(n_layers=3, d_model=64, n_heads=4, vocab=100, seq_len=32)
    model = GPT(cfg)
    outside = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    assert outside == non_block_params(vocab=100, seq=32, d_model=64)
    assert sum(p.numel() for p in model.blocks[0].parameters()) * 2 == block_weight_bytes(64)


def test_issue_13b_example_fits_with_the_last_blocks_resident():
    """The GPU holds everything that is not a block, then the longest suffix of blocks
    (weights + gradients each) next to 3 buffers of weights + gradients (prefetch 1 + 2)."""
    s, cap = PRESETS["13b"], 24 * GiB
    p = issue_13b()
    assert p.fits and p.stream is not None and p.offload_fraction == 1.0
    b, seq, d, L, V = 1, s.seq_len, s.d_model, s.n_layers, s.vocab
    w = block_weight_bytes(d)
    outside = 2 * 2 * (2 * V * d + seq * d + 2 * d)            # weights + gradients, bf16
    activations = L * b * seq * d * 2 + 34 * b * seq * d        # checkpointed + 1 recomputed
    head = b * seq * (2 * d * 2 + V * (2 * 2 + 8))
    reserve = GiB + cap // 20
    room = cap - outside - activations - head - reserve
    resident = max(r for r in range(L + 1) if (r + min(3, L - r)) * 2 * w <= room)
    assert resident == 12
    assert p.stream.resident == tuple(range(L - resident, L))
    assert p.stream.streamed == tuple(range(L - resident))
    assert p.stream.buffer_blocks == 3
    assert p.used["gpu"] == cap - room + (resident + 3) * 2 * w <= cap
    assert p.used["gpu"] + 2 * w > cap  # one more resident block would not fit
    rows = {i.name: i for i in p.items}
    assert rows["streaming buffers"].gpu == 3 * 2 * w
    streamed = (L - resident) * w
    # the pool gives each of a block's 12 weight tensors whole 4096-byte pages
    assert rows["parameters"].host == (L - resident) * block_page_bytes(d)
    # each host gradient pinned on its own, rounded up to a power of two:
    # Note [pinned rounding] (qkv 150 MiB -> 256 MiB, fc and out 200 MiB -> 256 MiB)
    numels = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    pinned = sum(1 << (2 * n - 1).bit_length() for n in numels)
    assert rows["gradients"].host == (L - resident) * pinned > streamed
    assert rows["parameters"].gpu == rows["gradients"].gpu == s.num_params() * 2 - streamed
    state = rows["optimizer state, offloaded"]
    assert state.host + state.nvme == s.num_params() * 8   # fp32 master + bf16 moments
    assert p.used["host"] <= 125 * GiB and p.used["nvme"] <= 60 * GiB
    assert p.stream.tier == "cpu" and p.state_tier == "split"


def test_the_stream_takes_the_planned_resident_blocks():
    """``stream_weights(gpu_bytes=plan.stream.stream_gpu_bytes)`` (weights only) keeps exactly
    the blocks the plan (weights + gradients) made resident, on a real model."""
    cfg = GPTConfig(n_layers=6, d_model=32, n_heads=2, vocab=50, seq_len=16)
    model = GPT(cfg).to(torch.bfloat16)
    n = cfg.num_params()
    w = block_weight_bytes(32)
    for keep in (0, 1, 2):  # more than 3 streamed: 3 buffers (prefetch 1 + 2) cost less
        others = plan(n, n_layers=6, d_model=32, vocab=50, seq=16, gpu_bytes=1 << 30,
                      stream_weights=True, gpu_reserve_bytes=0).used["gpu"]  # all resident
        cap = others - (6 - keep) * 2 * w + min(3, 6 - keep) * 2 * w
        p = plan(n, n_layers=6, d_model=32, vocab=50, seq=16, gpu_bytes=cap,
                 stream_weights=True, gpu_reserve_bytes=0)
        assert p.fits and p.stream.resident == tuple(range(6 - keep, 6)), keep
        store = TierStore(StoreConfig(cpu_bytes="16MiB"))
        with stream_weights(model.blocks, store=store, gpu_bytes=p.stream.stream_gpu_bytes,
                            prefetch_blocks=1) as stream:
            assert stream.plan.resident == p.stream.resident
        store.close()


@pytest.mark.parametrize("prefetch, buffers", [(0, 2), (1, 3), (2, 4)])
def test_buffers_are_prefetch_plus_two_blocks_of_weights_and_gradients(prefetch, buffers):
    p = issue_13b(prefetch_blocks=prefetch)
    w = block_weight_bytes(PRESETS["13b"].d_model)
    assert p.stream.buffer_blocks == buffers
    assert {i.name: i for i in p.items}["streaming buffers"].gpu == buffers * 2 * w
    assert p.stream.stream_gpu_bytes == (len(p.stream.resident) + buffers) * w
    assert p.used["gpu"] <= 24 * GiB


def test_auto_streams_only_when_the_gpu_cannot_hold_every_weight():
    assert preset("7b", stream_weights="auto").stream is None            # fits resident
    assert not issue_13b(stream_weights=False).fits                      # 51.5 GiB of GPU
    assert issue_13b(stream_weights=False).used["gpu"] / GiB == pytest.approx(51.5, abs=0.05)
    assert issue_13b().stream is not None
    # on: streams even where every block fits (then every block stays resident)
    on = preset("7b", stream_weights=True)
    assert on.fits and on.stream.streamed == () and len(on.stream.resident) == 32


def _split(p):
    """(streamed bytes, the rest's bytes) of a plan's bf16 params."""
    s = p.stream.streamed_bytes
    return s, p.num_params * 2 - s


@pytest.mark.parametrize("accum", [1, 4])
def test_block_major_moves_each_streamed_block_once_per_pass(accum):
    """Block-major: 2·S - K H2D + S D2H per step whatever the micro-batches (K: the last 3
    streamed blocks, kept into the backward: Note [kept into backward]); depth-first M times
    that; the optimizer phase ships only the resident params (a streamed weight's update is
    not sent back). PCIe: the largest of D2H, H2D and both at once (Note [streaming plan])."""
    r = MachineRates()
    bm = issue_13b(grad_accumulation_steps=accum, stream_schedule="block-major")
    df = issue_13b(grad_accumulation_steps=accum, stream_schedule="depth-first")
    for p, passes in ((bm, 1), (df, accum)):
        S, rest = _split(p)
        n_streamed = S // block_weight_bytes(PRESETS["13b"].d_model)
        K = 3 * block_weight_bytes(PRESETS["13b"].d_model)  # prefetch 1 + 2 blocks
        assert n_streamed > 3 and p.stream.kept == tuple(range(n_streamed - 3, n_streamed))
        fetched = passes * (2 * S - K)
        m = p.step_time.moved
        assert m["stream_h2d_bytes"] == fetched and m["stream_d2h_bytes"] == passes * S
        assert (p.stream.passes, p.stream.h2d_bytes, p.stream.d2h_bytes) == \
            (passes, fetched, passes * S)
        d2h, h2d = rest + passes * S, rest + fetched
        assert m["pcie_d2h_bytes"] == d2h and m["pcie_h2d_bytes"] == h2d
        assert p.step_time.seconds["pcie"] == pytest.approx(max(
            d2h / r.pcie_d2h_bytes_per_s, h2d / r.pcie_h2d_bytes_per_s,
            (d2h + h2d) / r.pcie_both_bytes_per_s))
        traffic = max(passes * S / r.pcie_d2h_bytes_per_s, fetched /
                      r.pcie_h2d_bytes_per_s, (passes * S + fetched) / r.pcie_both_bytes_per_s)
        assert p.step_time.fwd_bwd_s == pytest.approx(max(p.step_time.seconds["gpu"], traffic))
    assert bm.step_time.stream_schedule == "block-major"
    if accum > 1:  # block-major keeps every micro-batch's block inputs: fewer stay resident
        assert len(bm.stream.resident) < len(df.stream.resident)


@pytest.mark.parametrize("schedule, prefetch", [("block-major", 1), ("depth-first", 1),
                                                ("block-major", 0), ("depth-first", 0)])
def test_planned_streamed_bytes_are_what_a_real_stream_fetches(schedule, prefetch, one_thread):
    """The plan's streamed H2D bytes per step (``StreamPlan.h2d_bytes`` and the step time's)
    are what ``stream_weights`` fetches, counted per step, training the planned model: 8 AdamW
    steps of 2 different micro-batches, every block streamed. The forward keeps the last
    blocks for the backward (Note [kept into backward]), so this is less than 2 fetches per
    streamed block per pass; and the stream never holds more streamed blocks than the
    buffers the plan counts on the GPU."""
    from stream._stream_train import CFG, make_model, train
    from tiermem.schedule.micro_batches import forward_backward
    n, L, micro = CFG.num_params(), CFG.n_layers, 2
    kw = dict(n_layers=L, d_model=CFG.d_model, n_heads=CFG.n_heads, vocab=CFG.vocab,
              seq=CFG.seq_len, batch=2, dtype="float32", grad_accumulation_steps=micro,
              stream_weights=True, stream_schedule=schedule, prefetch_blocks=prefetch,
              gpu_reserve_bytes=0)
    w = sum(p.numel() for p in make_model().blocks[0].parameters()) * 4  # fp32 block weights
    buffers = prefetch + 2
    others = plan(n, **kw, gpu_bytes=1 << 30).used["gpu"] - L * 2 * w  # every block resident
    p = plan(n, **kw, gpu_bytes=others + buffers * 2 * w)  # room for the buffers alone
    # depth-first over 2 micro-batches also needs the last pass's gradient sums (Note
    # [streaming plan]): not in this room, so the plan streams every block and overflows
    assert p.fits == (schedule == "block-major")
    assert p.stream.streamed == tuple(range(L)) and p.stream.block_bytes == w
    passes = 1 if schedule == "block-major" else micro
    fetched = passes * (2 * L - buffers) * w  # written from the rule, not read from the plan
    assert p.stream.h2d_bytes == p.step_time.moved["stream_h2d_bytes"] == fetched
    store = TierStore(StoreConfig(device="cpu", cpu_bytes="16MiB"))
    held, per_step = {}, []

    def start(model):
        held["h"] = stream_weights(model.blocks, store=store, tier="cpu",
                                   prefetch_blocks=prefetch, gpu_bytes=p.stream.stream_gpu_bytes)
        return held["h"]

    def count(model, step):
        per_step.append(held["h"].stats()["h2d_bytes"] - sum(per_step))

    fb = functools.partial(forward_backward, block_major=schedule == "block-major")
    _, _, h = train(make_model(), steps=8, n_micro=micro, stream=start, before_step=count, fb=fb)
    try:
        assert h.plan.streamed == p.stream.streamed and h.plan.kept == p.stream.kept
        assert per_step == [p.stream.h2d_bytes] * 8
        assert 0 < h.stats()["peak_blocks"] <= p.stream.buffer_blocks == buffers
    finally:
        h.close()
        store.close()


def test_block_major_activations_grow_with_the_micro_batches():
    s = PRESETS["13b"]
    one = {i.name: i for i in issue_13b(stream_schedule="depth-first",
                                         grad_accumulation_steps=4).items}["activations"]
    four = {i.name: i for i in issue_13b(grad_accumulation_steps=4).items}["activations"]
    block_input = s.seq_len * s.d_model * 2
    assert four.gpu - one.gpu == 3 * s.n_layers * block_input + 4 * block_input


def test_block_major_recomputes_so_it_counts_as_checkpointing():
    """tiermem/schedule/block_major.py saves each block's input per micro-batch and recomputes
    the block in the backward: without --checkpoint a block-major plan over 4 micro-batches
    keeps 4 inputs per block (not 4 blocks' activations) plus one recomputed block, and its GPU
    time is the checkpointed 8·N·T; depth-first keeps what each block saves."""
    s = PRESETS["13b"]
    r = MachineRates()
    kw = dict(checkpoint=False, grad_accumulation_steps=4, gpu_bytes="48GiB")
    bm, df = issue_13b(**kw), issue_13b(**kw, stream_schedule="depth-first")
    block_input = s.seq_len * s.d_model * 2
    act = {i.name: i for i in bm.items}["activations"]
    assert act.gpu == (4 * s.n_layers + 4 + 17) * block_input  # 17 inputs: 34·b·s·d bytes
    assert bm.checkpoint and not df.checkpoint
    tokens = 4 * s.seq_len
    assert bm.step_time.seconds["gpu"] == pytest.approx(
        8 * s.num_params() * tokens / r.gpu_flops_checkpointed)
    assert df.step_time.seconds["gpu"] == pytest.approx(6 * s.num_params() * tokens / r.gpu_flops)
    assert {i.name: i for i in df.items}["activations"].gpu == 40 * 17 * block_input


def test_nvme_home_reads_the_weights_at_every_fetch_and_writes_them_once():
    """An NVMe home (asked for): the trained weights' RAM host copy and their NVMe copy, RAM
    staging for prefetch + 3 blocks (Note [streamed RAM count]); NVMe time: 2·S - K read per
    pass (the 3 blocks kept into the backward read once) + S written per step."""
    r = MachineRates()
    p = issue_13b(host_bytes="200GiB", nvme_bytes="400GiB", state_tier="cpu",
                  stream_tier="nvme")
    assert p.fits and p.stream.tier == "nvme"
    rows = {i.name: i for i in p.items}
    S = p.stream.streamed_bytes
    n = len(p.stream.streamed)
    assert rows["parameters"].host == S  # the host copy HybridAdam writes, outside the store
    assert rows["parameters"].nvme == n * block_page_bytes(5120)  # in whole pages
    assert rows["streaming RAM staging"].host == 4 * block_page_bytes(5120)
    reads = 2 * S - 3 * block_weight_bytes(5120)
    assert p.step_time.moved["stream_nvme_read_bytes"] == reads
    assert p.step_time.seconds["nvme"] == pytest.approx(reads / r.nvme_read_bytes_per_s
                                                        + S / r.nvme_write_bytes_per_s)
    assert "streamed from NVMe" in p.table()
    # 130 GiB of RAM cannot hold the weights in RAM; an NVMe home of trained weights holds them
    # there too (the host copy) plus the staging, so it does not fit either (before Note
    # [streamed RAM count] the plan left the host copy out and said it fit)
    for home in ("cpu", "nvme", "auto"):
        tight = issue_13b(host_bytes="130GiB", nvme_bytes="400GiB", stream_tier=home,
                          state_tier="cpu")
        assert not tight.fits and any(r.startswith("host needs") for r in tight.reasons), home
    pinned = issue_13b(host_bytes="200GiB", nvme_bytes="400GiB", state_tier="cpu",
                       stream_tier="cpu")
    assert pinned.fits and pinned.used["host"] < p.used["host"]  # RAM home: no staging


def test_step_time_streaming_terms_by_closed_form():
    """step_time alone: block-major traffic is fixed per step, depth-first per micro-batch."""
    r = MachineRates()
    kw = dict(active_params=10**9, offloaded_params=10**9, param_bytes=2,
              micro_batch_tokens=2048, streamed_bytes=10**9)
    for accum in (1, 3):
        bm = step_time(**kw, grad_accumulation_steps=accum, stream_schedule="block-major")
        df = step_time(**kw, grad_accumulation_steps=accum, stream_schedule="depth-first")
        rest = (10**9 - 5 * 10**8) * 2  # the params not streamed: their bytes, shipped in the
        # optimizer phase
        assert bm.moved["pcie_h2d_bytes"] == rest + 2 * 10**9
        assert df.moved["pcie_h2d_bytes"] == rest + 2 * accum * 10**9
        assert df.moved["stream_d2h_bytes"] == accum * bm.moved["stream_d2h_bytes"]
    nvme = step_time(**kw, stream_tier="nvme")
    assert nvme.seconds["nvme"] == pytest.approx(2e9 / r.nvme_read_bytes_per_s
                                                 + 1e9 / r.nvme_write_bytes_per_s)
    # K kept into the backward: fetched (and read from NVMe) once per pass, not twice
    for accum, sched in ((1, "block-major"), (3, "depth-first")):
        k = step_time(**kw, stream_kept_bytes=4 * 10**8, stream_tier="nvme",
                      grad_accumulation_steps=accum, stream_schedule=sched)
        passes = accum if sched == "depth-first" else 1
        assert k.moved["stream_h2d_bytes"] == k.moved["stream_nvme_read_bytes"] == \
            passes * (2 * 10**9 - 4 * 10**8)
        assert k.moved["pcie_h2d_bytes"] == 10**9 + passes * 16 * 10**8
        assert k.moved["stream_d2h_bytes"] == passes * 10**9
    with pytest.raises(ValueError, match="stream_kept_bytes=3 must be whole params"):
        step_time(**kw, stream_kept_bytes=3)
    with pytest.raises(ValueError, match="at most streamed_bytes=1000000000"):
        step_time(**kw, stream_kept_bytes=2 * 10**9)
    with pytest.raises(ValueError, match="streamed_bytes=3 must be whole params"):
        step_time(**{**kw, "streamed_bytes": 3})
    with pytest.raises(ValueError, match="among the offloaded_params=0"):
        step_time(**{**kw, "offloaded_params": 0})


def test_a_gpu_too_small_is_refused_naming_every_gpu_row():
    p = preset("13b", gpu_bytes="6GiB", stream_weights=True, checkpoint=True, batch=4)
    assert not p.fits
    gpu = p.reasons[0]
    w = block_weight_bytes(5120)
    assert gpu.startswith("gpu needs ") and "has 6.0 GiB" in gpu
    assert f"streaming buffers {3 * 2 * w / GiB:.1f} GiB" in gpu
    assert "head + loss" in gpu and "reserve" in gpu
    assert "fix: " in gpu and "--prefetch-blocks 0" in gpu and "--checkpoint" not in gpu
    assert p.stream.resident == ()


def test_gpu_side_state_needs_resident_params():
    p = issue_13b(offload_fraction=0.5)
    assert not p.fits and p.step_time is None
    assert any("stay resident" in r and "raise offload_fraction to at least" in r
               for r in p.reasons)


@pytest.mark.parametrize("kwargs, message", [
    ({"stream_weights": "yes"}, "stream_weights='yes' is not one of False, True, 'auto'"),
    ({"stream_tier": "disk"}, "stream_tier='disk'"),
    ({"stream_schedule": "breadth"}, "stream_schedule='breadth'"),
    ({"prefetch_blocks": -1}, "prefetch_blocks=-1"),
    ({"stream_weights": True, "gpu_step_fraction": 0.5}, "the GPU lane is not planned"),
    ({"stream_weights": True, "grad_accumulation_steps": 2, "breadth_first_blocks": 3},
     "streaming plans the block-major schedule instead"),
])
def test_bad_streaming_input_is_a_one_line_error(kwargs, message):
    with pytest.raises(ValueError) as err:
        preset("13b", **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_command_plans_the_issue_example(capsys):
    assert main(ISSUE_13B) == 0
    out = capsys.readouterr().out
    assert out.startswith("12.92B params: FITS")
    assert "weights of 28 of 40 blocks streamed from pinned RAM (12 resident, 3 GPU buffers" in out
    assert "a prediction (the 8B preset's H200 run took 4-13 % longer than its plan" in out
    assert "weights streamed, block-major" in out and "stream_weights(model.blocks" in out
    assert main(ISSUE_13B + ["--stream-weights", "off"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: gpu needs 51.5 GiB, has 24.0 GiB" in out


def test_command_refuses_in_one_line_and_rejects_bad_flags(capsys):
    assert main(ISSUE_13B + ["--gpu-bytes", "6GiB", "--batch", "4", "--stream-weights", "on"]) == 1
    out = capsys.readouterr().out
    refusal = [line for line in out.splitlines() if line.startswith("does not fit: gpu")]
    assert len(refusal) == 1 and "streaming buffers" in refusal[0] and "fix:" in refusal[0]
    assert main(ISSUE_13B + ["--stream-weights", "maybe"]) == 2
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
    assert main(ISSUE_13B + ["--prefetch-blocks", "-1"]) == 2
    err = capsys.readouterr().err
    assert "prefetch_blocks=-1" in err and len(err.strip().splitlines()) == 1


def test_plan_json_carries_the_stream(capsys):
    import json
    assert main(ISSUE_13B + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stream"]["resident"] == list(range(28, 40))
    assert data["stream"]["schedule"] == "block-major"
    assert data["inputs"]["stream_weights"] == "auto"


def test_default_plan_call_does_not_stream():
    """``plan()``'s default stays off (examples/train_large.py runs what it plans, without a
    stream), the command's is auto."""
    p = issue_13b(stream_weights=False)
    assert p.stream is None and not p.fits
    assert dataclasses.fields(type(p))  # a dataclass: to_dict works with stream None
    assert p.to_dict()["stream"] is None


# ---------------------------------------------------------------- docs/sizing.md, section 6

def _sizing_rows() -> list[list[str]]:
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "sizing.md").read_text()
    lines = text.split("## 6. Weight streaming")[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `--gpu` |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _doc_preset(size, gpu, host, nvme, stream):
    return preset(size, gpu_bytes=gpu, host_bytes=host, nvme_bytes=nvme, moments_dtype="bf16",
                  checkpoint=True, stream_weights=stream)


def test_sizing_table_is_what_the_planner_says():
    """Every row of docs/sizing.md's streaming table, recomputed with plan(): the largest
    preset that fits with every weight on the GPU and with streaming (every larger one does
    not), the streamed plan's resident blocks, weights' home and state in RAM, and its
    predicted floor and bound."""
    rows = _sizing_rows()
    assert len(rows) == 12
    sizes = list(PRESETS)
    seen = set()
    for gpu, machine, resident_size, streamed_size, how, step in rows:
        host, nvme = (part.strip() for part in machine.split("+"))
        seen.add((gpu, host, nvme))
        for stream, want in ((False, resident_size), ("auto", streamed_size)):
            fits = [size for size in sizes if _doc_preset(size, gpu, host, nvme, stream).fits]
            assert (fits[-1] if fits else "-") == want, (gpu, machine, stream)
        p = _doc_preset(streamed_size, gpu, host, nvme, "auto")
        st = p.stream
        if st is None:
            assert how == "- (every weight on the GPU)"
        else:
            state = next(i for i in p.items if i.name == "optimizer state, offloaded")
            ram = 100 * state.host / (state.host + state.nvme)
            home = {"cpu": "RAM", "nvme": "NVMe"}[st.tier]
            assert how == f"{len(st.resident)} of {st.n_blocks}, {home}, {ram:.0f} %"
        t = p.step_time
        bound = {"gpu": "GPU fwd+bwd", "pcie": "PCIe", "cpu_adam": "CPU Adam",
                 "nvme": "NVMe"}[t.bound]
        assert step == f"{t.overlapped_s:.1f} s ({bound})"
    assert {g for g, _, _ in seen} == {"24GiB", "48GiB", "80GiB", "141GB"}
    assert len({(h, n) for _, h, n in seen}) == 3


def test_sizing_prose_quotes_the_70b_plans():
    """The figures the text beside the table quotes: CPU Adam's seconds and the state on NVMe
    of the 70b rows at their two ends."""
    text = " ".join((pathlib.Path(__file__).resolve().parents[1] / "docs" / "sizing.md")
                    .read_text().split("## 6. Weight streaming")[1].split())
    low = _doc_preset("70b", "141GB", "512GiB", "2TB", "auto")
    high = _doc_preset("70b", "24GiB", "256GiB", "1TB", "auto")
    nvme = [next(i for i in p.items if i.name == "optimizer state, offloaded").nvme / GiB
            for p in (low, high)]
    assert (f"CPU Adam ({high.step_time.seconds['cpu_adam']:.0f} s a step at 70b)") in text
    assert (f"the 70b rows put {nvme[0]:.0f} GiB (512 GiB of RAM, 141 GB card) to "
            f"{nvme[1]:.0f} GiB (256 GiB, 24 GiB card) of it on NVMe") in text
    assert f"{PRESETS['30b'].num_params() * 8 / GiB:.0f} GiB of optimizer state" in text


def test_streaming_doc_example_is_what_the_command_prints(capsys):
    """docs/streaming.md, "The plan", pastes the issue's example: the command, run now, prints
    exactly that, and the prose quotes its figures."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "streaming.md").read_text()
    section = text.split("## The plan (`tiermem plan`)")[1]
    block = re.search(r"```text\n\$ tiermem plan (.*?)\n(.*?)```", section, re.S)
    assert block, "docs/streaming.md lost its `tiermem plan` example"
    argv = block.group(1).split()
    assert argv == ISSUE_13B
    assert main(argv) == 0
    assert capsys.readouterr().out == block.group(2)
    p = issue_13b()
    state = {i.name: i for i in p.items}["optimizer state, offloaded"]
    prose = " ".join(section[block.end():].split())
    off = issue_13b(stream_weights=False).used["gpu"] / GiB
    assert f"needs {off:.1f} GiB of GPU" in prose
    assert (f"{len(p.stream.streamed)} of the {p.stream.n_blocks} blocks stream from pinned RAM "
            f"and the last {len(p.stream.resident)} stay resident") in prose
    assert f"the {(state.host + state.nvme) / GiB:.1f} GiB of optimizer state" in prose
    assert f"{state.nvme / GiB:.1f} GiB of it goes to NVMe, which bounds the step" in prose
    assert p.step_time.bound == "nvme"
