"""The native CPU Adam's fused sum of the params it writes (``adam_step_unchecked(...,
sum_as=(whole, start))``, tm_adam_step_sum in native/adam.c; Note [streamed write-back
checksums]): bit-exact equal to ``piece_checksum(whole, start, numel)`` of the bytes written,
for every alignment of the piece in the whole (cuts inside an 8-byte word, in the whole's tail
of < 8 bytes summed bytewise), every output dtype the kernel writes (bf16, fp16, fp32), every
ISA path (forced as tests/optim/test_cpu_adam.py forces them; a level the CPU lacks falls back
to the best it has), one thread or several, and without the native library (torch fallback).

Independent reference: the pieces of a random partition of a weight, each stepped and summed by
the kernel, add up to ``checksum(whole)`` (torch's int64 sum of the whole's words).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem import _native
from tiermem.optim import cpu_adam
from tiermem.optim.cpu_adam import adam_step_unchecked, native_available
from tiermem.stream.checksums import checksum, piece_checksum

needs_native = pytest.mark.skipif(not native_available(),
                                  reason=f"native library unavailable: {_native.load_error()}")
MASK = (1 << 64) - 1
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ISAS = ["avx512", "avx2", "default"]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
             maximize=False)


@contextlib.contextmanager
def forced_isa(isa: str | None):
    saved = _native.adam_isa()
    try:
        _native.set_adam_isa(isa)
        yield
    finally:
        _native.set_adam_isa(saved)


def _state(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen),
            torch.zeros(n), torch.zeros(n))


def _step_piece(state, whole, start, numel, *, step=1, threads=1, sum_as=True, out=None):
    """Step elements [start, start + numel) of ``state`` writing ``out`` (default: the piece of
    ``whole`` itself, in place) and return the kernel's sum."""
    p, g, m, v = state
    sl = slice(start, start + numel)
    p_out = whole[sl] if out is None else out
    return adam_step_unchecked(p[sl], g[sl], m[sl], v[sl], step=step, param_out=p_out,
                               offset=0, numel=numel, num_threads=threads,
                               sum_as=(whole, start) if sum_as else None, **HYPER)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_fused_sum_is_piece_checksum_at_every_alignment(isa, dtype, data):
    n = data.draw(st.integers(1, 5000), label="whole numel")
    start = data.draw(st.integers(0, n - 1), label="start")
    numel = data.draw(st.integers(0, n - start), label="numel")
    whole = torch.randn(n).to(dtype)
    with forced_isa(isa):
        got = _step_piece(_state(n, n), whole, start, numel, step=data.draw(st.integers(1, 9)))
    assert got == piece_checksum(whole, start, numel), f"{isa} {dtype} {n} [{start}, +{numel})"


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_sums_of_a_partition_add_up_to_the_whole_checksum(isa, dtype, threads):
    """Large pieces (several 2048-element sum blocks, several threads' 32-element-aligned
    ranges) at odd offsets, 8 training steps each: the kernel's sums of the pieces add up to
    torch's checksum of the whole after every step, and the written bits are those of the
    step without the sum."""
    n = 200_003
    cuts = [0, 3, 70_001, 70_002, 140_005, n]
    state, twin = _state(n, 1), _state(n, 1)
    whole = torch.empty(n, dtype=dtype)
    plain = torch.empty(n, dtype=dtype)
    with forced_isa(isa):
        for step in range(1, 9):
            state[1].copy_(torch.randn(n, generator=torch.Generator().manual_seed(step)))
            twin[1].copy_(state[1])
            total = 0
            for a, b in zip(cuts, cuts[1:]):
                total += _step_piece(state, whole, a, b - a, step=step, threads=threads)
                _step_piece(twin, plain, a, b - a, step=step, threads=threads, sum_as=False)
            assert total & MASK == int(checksum(whole)) & MASK, f"step {step}"
            assert torch.equal(whole.view(torch.uint8), plain.view(torch.uint8))


@needs_native
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("start", [0, 1, 2, 3, 5, 7])
def test_the_sum_is_placed_in_the_whole_wherever_the_output_lies(dtype, start):
    """``param_out`` apart from ``whole`` (at another 8-byte phase): the sum is of the written
    bytes as ``whole``'s elements [start, start + numel)."""
    n, numel = 9001, 5003
    whole = torch.randn(n).to(dtype)
    out = torch.empty(numel + 1, dtype=dtype)[1:]  # one element off the allocation's alignment
    got = _step_piece(_state(n, 3), whole, start, numel, out=out)
    whole[start:start + numel] = out
    assert got == piece_checksum(whole, start, numel)


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_without_the_native_library_the_sum_is_the_same(monkeypatch, dtype):
    """The torch fallback sums the written bytes in torch: the same value (and no sum for a
    whole that is not 8-byte aligned, like piece_checksum)."""
    n = 4099
    whole = torch.randn(n).to(dtype)
    monkeypatch.setattr(cpu_adam, "_native_lib", lambda: None)
    monkeypatch.setattr(cpu_adam, "_fallback_warned", True)
    for start, numel in [(0, n), (1, 17), (5, 4000), (n - 3, 3), (7, 0)]:
        got = _step_piece(_state(n, start), whole, start, numel)
        assert got == piece_checksum(whole, start, numel), (start, numel)
    off = torch.randn(n + 1).to(dtype)[1:]
    assert _step_piece(_state(n, 0), off, 0, 10) is None


def test_a_sum_needs_param_out_of_the_wholes_element_size():
    n = 16
    p, g, m, v = _state(n, 0)
    with pytest.raises(ValueError, match="sum_as needs param_out"):
        adam_step_unchecked(p, g, m, v, step=1, param_out=None, offset=0, numel=n,
                            num_threads=1, sum_as=(torch.empty(n), 0), **HYPER)
    with pytest.raises(ValueError, match="2-byte elements but param_out 4-byte"):
        adam_step_unchecked(p, g, m, v, step=1, param_out=torch.empty(n), offset=0, numel=n,
                            num_threads=1, sum_as=(torch.empty(n, dtype=torch.bfloat16), 0),
                            **HYPER)
