"""The native CPU Adam/AdamW kernel against torch, and the CRC-32C checksum.

References:
* ``torch.optim.AdamW`` / ``torch.optim.Adam`` (for-loop and fused) over many steps: the fp32
  path is compared within 1e-6 relative, and bit for bit against the fused optimizer on the
  elements torch's fused kernel computes in its vector loop.
* ``FusedReference``: torch's own fused CPU kernel (``torch._fused_adamw_``) on fp32 copies,
  with the low-precision moments rounded by ``Tensor.to(torch.bfloat16)`` and ``param_out`` by
  ``Tensor.to(dtype)``, padded to a multiple of 64 elements and run on one torch thread so that
  torch computes every element in its vector loop (its scalar remainder loop contracts one
  multiply-add differently, see native/adam.c). Every dtype combination must match it exactly.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import zlib

import numpy as np
import pytest
import torch

from tiermem import _native
from tiermem.optim import cpu_adam
from tiermem.optim.cpu_adam import adam_step_, native_available

needs_native = pytest.mark.skipif(not native_available(),
                                  reason=f"native library unavailable: {_native.load_error()}")

# (adamw, weight_decay, maximize): decoupled and L2 decay, with and without decay / maximize
MODES = [(True, 0.01, False), (True, 0.0, True), (False, 0.1, False), (False, 0.0, True)]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def random_grad(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 gradients of varied magnitude (1e-6 makes fp16 subnormals), a few exact zeros."""
    scale = [1e-6, 1e-2, 1.0, 30.0][int(torch.randint(4, (1,), generator=gen))]
    g = torch.randn(n, generator=gen) * scale
    g[:: 97] = 0.0
    return g


class FusedReference:
    """torch's fused kernel on padded fp32 copies (one thread): exact for every element.

    The low-precision moments are rounded after each step by ``Tensor.to(torch.bfloat16)``;
    the params of the last step are rounded for ``param_out`` by ``Tensor.to(dtype)``.
    """

    def __init__(self, p, m, v, *, lr, beta1, beta2, eps, weight_decay, adamw, maximize):
        self.n = n = p.numel()
        pad = -n % 64 + 64  # a multiple of 16: torch's vector loop covers every element
        self.state_dtype = m.dtype
        self.p, self.g, self.m, self.v = (torch.cat([t.float(), torch.zeros(pad)])
                                          for t in (p, torch.zeros(n), m, v))
        self.op = torch._fused_adamw_ if adamw else torch._fused_adam_
        self.hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          maximize=maximize, amsgrad=False)

    def step(self, g, step):
        n = self.n
        self.g[:n].copy_(g)
        with torch_threads(1):
            self.op([self.p], [self.g], [self.m], [self.v], [], [torch.tensor(float(step))],
                    **self.hyper)
        if self.state_dtype != torch.float32:
            for t in (self.m, self.v):
                t[:n].copy_(t[:n].to(self.state_dtype))

    def state(self, out_dtype=None):
        n = self.n
        p = self.p[:n]
        out = None if out_dtype is None else p.to(out_dtype)
        return p, self.m[:n].to(self.state_dtype), self.v[:n].to(self.state_dtype), out


def _state(n, gen, grad_dtype, state_dtype, out_dtype):
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n, dtype=state_dtype)
    v = torch.zeros(n, dtype=state_dtype)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    return p, m, v, out


# ---------------------------------------------------------------------------------------------
# against torch.optim


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (normwise relative difference)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _max_elementwise_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|, 1e-3): elementwise, params near 0 compared absolutely."""
    return ((a - b).abs() / b.abs().clamp_min(1e-3)).max().item()


@needs_native
@pytest.mark.parametrize("n,steps", [(1, 100), (7, 100), (1000003, 20)])
@pytest.mark.parametrize("adamw,weight_decay,maximize", MODES)
def test_fp32_matches_torch_optim(n, steps, adamw, weight_decay, maximize):
    gen = torch.Generator().manual_seed(n * 10 + steps)
    p0 = torch.randn(n, generator=gen)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    refs = {}
    for fused in (False, True):
        ref = torch.nn.Parameter(p0.clone())
        opt = cls([ref], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                  eps=HYPER["eps"], weight_decay=weight_decay, maximize=maximize, fused=fused)
        refs[fused] = (ref, opt)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    with torch_threads(1):  # torch's fused kernel then runs its vector loop on [0, n - n % 16)
        for step in range(1, steps + 1):
            g = random_grad(n, gen)
            for ref, opt in refs.values():
                ref.grad = g.clone()
                opt.step()
            adam_step_(p, g, m, v, step=step, weight_decay=weight_decay, adamw=adamw,
                       maximize=maximize, **HYPER)
    loop_ref, loop_opt = refs[False]
    # Measured (2 cores, AVX2, torch 2.13): normwise <= 5.6e-8 vs the for-loop optimizer,
    # elementwise <= 2.3e-6 -- exactly torch's own fused-vs-for-loop difference.
    assert _max_rel_diff(p, loop_ref.detach()) <= 1e-6
    assert _max_rel_diff(m, loop_opt.state[loop_ref]["exp_avg"]) <= 1e-6
    assert _max_elementwise_rel_diff(p, loop_ref.detach()) <= 1e-5
    ref, opt = refs[True]
    assert _max_rel_diff(p, ref.detach()) <= 1e-6
    k = n - n % 16  # the rest went through torch's scalar loop: within 1e-6 above
    assert torch.equal(p[:k], ref.detach()[:k])
    assert torch.equal(m, opt.state[ref]["exp_avg"])
    assert torch.equal(v[:k], opt.state[ref]["exp_avg_sq"][:k])


@needs_native
@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.9])
def test_fp32_bit_identical_to_fused_reference(beta1):
    """Both lerp branches (1 - beta1 below and above 0.5) and beta1 = 0."""
    n = 4099
    gen = torch.Generator().manual_seed(1)
    p, m, v, _ = _state(n, gen, torch.float32, torch.float32, None)
    hyper = dict(HYPER, beta1=beta1)
    ref = FusedReference(p, m, v, weight_decay=0.05, adamw=True, maximize=False, **hyper)
    for step in range(1, 31):
        g = random_grad(n, gen)
        adam_step_(p, g, m, v, step=step, weight_decay=0.05, **hyper)
        ref.step(g, step)
    rp, rm, rv, _ = ref.state()
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)


# ---------------------------------------------------------------------------------------------
# every dtype combination, exact


GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STATE_DTYPES = [torch.float32, torch.bfloat16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]
COMBOS = list(itertools.product(GRAD_DTYPES, STATE_DTYPES, OUT_DTYPES))


def _run_combo(n, steps, grad_dtype, state_dtype, out_dtype, adamw, weight_decay, maximize,
               seed):
    gen = torch.Generator().manual_seed(seed)
    p, m, v, out = _state(n, gen, grad_dtype, state_dtype, out_dtype)
    ref = FusedReference(p, m, v, weight_decay=weight_decay, adamw=adamw, maximize=maximize,
                         **HYPER)
    for step in range(1, steps + 1):
        g = random_grad(n, gen).to(grad_dtype)
        adam_step_(p, g, m, v, step=step, weight_decay=weight_decay, adamw=adamw,
                   maximize=maximize, param_out=out, **HYPER)
        ref.step(g, step)
        if out is not None and step <= 2:
            assert torch.equal(out, p.to(out_dtype)), f"param_out != master.to() at step {step}"
    rp, rm, rv, rout = ref.state(out_dtype)
    assert m.dtype == state_dtype and v.dtype == state_dtype
    assert torch.equal(p, rp)
    assert torch.equal(m, rm)
    assert torch.equal(v, rv)
    if out is not None:
        assert torch.equal(out, rout)


@needs_native
@pytest.mark.parametrize("grad_dtype,state_dtype,out_dtype", COMBOS)
@pytest.mark.parametrize("n", [1, 7])
def test_dtype_combinations_small(n, grad_dtype, state_dtype, out_dtype):
    for i, (adamw, weight_decay, maximize) in enumerate(MODES):
        _run_combo(n, 100, grad_dtype, state_dtype, out_dtype, adamw, weight_decay, maximize,
                   seed=n * 100 + i)


@needs_native
@pytest.mark.parametrize("grad_dtype,state_dtype,out_dtype", COMBOS)
def test_dtype_combinations_large(grad_dtype, state_dtype, out_dtype):
    mode = MODES[(GRAD_DTYPES.index(grad_dtype) + OUT_DTYPES.index(out_dtype)) % len(MODES)]
    _run_combo(1000003, 20, grad_dtype, state_dtype, out_dtype, *mode, seed=3)


@needs_native
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_param_out_rounding_edge_cases(out_dtype):
    """lr = 0 keeps params as they are: param_out is then exactly param.to(out_dtype)."""
    # bf16 ties (to even, both ways), just below/above ties, FLT_MAX, the smallest subnormal,
    # -0, fp16 subnormal/normal boundaries and ties, the largest fp16 and the next tie
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0x00000001,
                     0x80000000, 0x33800000, 0x33000001, 0x387FE000, 0x477FF000, 0x477FEFFF],
                    dtype=np.uint32)
    specials = torch.tensor([65504.0, 65520.0, -65520.0, 1e-8, -1e-8, 6e-5, 1e38, -3.4e38,
                             float("inf"), float("-inf"), 0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    p = torch.cat([torch.from_numpy(bits.view(np.float32)), specials, torch.randn(1000) * 1e4])
    n = p.numel()
    out = torch.empty(n, dtype=out_dtype)
    adam_step_(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
               beta2=0.999, eps=1e-8, weight_decay=0.0, param_out=out)
    assert torch.equal(out, p.to(out_dtype))


@needs_native
def test_fp16_grads_convert_exactly():
    """Every finite fp16 value (subnormals included) converts exactly: compare with fp32 grads."""
    g16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    g16 = g16[torch.isfinite(g16)].contiguous()
    n = g16.numel()
    p0 = torch.randn(n)
    a = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    b = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    adam_step_(a[0], g16, a[1], a[2], step=1, weight_decay=0.0, **HYPER)
    adam_step_(b[0], g16.float(), b[1], b[2], step=1, weight_decay=0.0, **HYPER)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# chunks, threads, instruction sets


@needs_native
def test_chunked_equals_full_call():
    n = 100_003
    gen = torch.Generator().manual_seed(5)
    full = _state(n, gen, None, torch.bfloat16, torch.bfloat16)
    chunked = tuple(t.clone() for t in full)
    bounds = [0, 1, 33_333, 70_001, n]  # 4 uneven chunks, one of one element
    for step in range(1, 6):
        g = random_grad(n, gen).to(torch.bfloat16)
        p, m, v, out = full
        adam_step_(p, g, m, v, step=step, weight_decay=0.01, param_out=out, **HYPER)
        p, m, v, out = chunked
        for lo, hi in zip(bounds, bounds[1:]):
            adam_step_(p, g, m, v, step=step, weight_decay=0.01, param_out=out, offset=lo,
                       numel=hi - lo, **HYPER)
    for x, y in zip(full, chunked):
        assert torch.equal(x, y)


@needs_native
def test_chunk_leaves_other_elements_untouched():
    n = 1000
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.zeros(n, dtype=torch.bfloat16)
    before = p.clone()
    adam_step_(p, torch.ones(n), m, v, step=1, weight_decay=0.0, param_out=out, offset=100,
               numel=50, **HYPER)
    changed = (p != before).nonzero().flatten()
    assert changed.min().item() >= 100 and changed.max().item() < 150
    assert (m[:100] == 0).all() and (m[150:] == 0).all() and (m[100:150] != 0).all()
    assert (out[:100] == 0).all() and (out[150:] == 0).all()


@needs_native
def test_thread_count_and_isa_do_not_change_results():
    n = 300_001
    gen = torch.Generator().manual_seed(7)
    g = random_grad(n, gen).to(torch.float16)
    p0 = torch.randn(n, generator=gen)
    results = []
    saved = _native.adam_isa()
    try:
        for isa, threads in [(None, 1), (None, 2), (None, 5), ("avx2", 2), ("default", 2)]:
            _native.set_adam_isa(isa)
            p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)
            v = v.to(torch.bfloat16)
            out = torch.empty(n, dtype=torch.bfloat16)
            for step in (1, 2):
                adam_step_(p, g, m, v, step=step, weight_decay=0.02, adamw=False,
                           param_out=out, num_threads=threads, **HYPER)
            results.append((p, m, v, out))
    finally:
        _native.set_adam_isa(saved)
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x, y)


@needs_native
def test_zero_numel_chunk_is_a_no_op():
    p = torch.randn(10)
    before = p.clone()
    adam_step_(p, torch.ones(10), torch.zeros(10), torch.zeros(10), step=1, weight_decay=0.0,
               offset=10, numel=0, **HYPER)
    assert torch.equal(p, before)


# ---------------------------------------------------------------------------------------------
# validation


def _args(n=8, **dtypes):
    return dict(param=torch.zeros(n, dtype=dtypes.get("param", torch.float32)),
                grad=torch.zeros(n, dtype=dtypes.get("grad", torch.float32)),
                exp_avg=torch.zeros(n, dtype=dtypes.get("state", torch.float32)),
                exp_avg_sq=torch.zeros(n, dtype=dtypes.get("state", torch.float32)))


def _call(tensors, **kw):
    hyper = dict(step=1, weight_decay=0.0, **HYPER)
    hyper.update(kw)
    adam_step_(tensors["param"], tensors["grad"], tensors["exp_avg"], tensors["exp_avg_sq"],
               **hyper)


@pytest.mark.parametrize("name", ["param", "grad", "exp_avg", "exp_avg_sq"])
def test_rejects_non_cpu_tensor(name):
    t = _args()
    t[name] = torch.empty(8, device="meta", dtype=t[name].dtype)
    with pytest.raises(ValueError, match=rf"{name} is on device 'meta'.*CPU tensors.*\.cpu\(\)"):
        _call(t)


def test_rejects_non_cpu_param_out():
    with pytest.raises(ValueError, match=r"param_out is on device 'meta'"):
        _call(_args(), param_out=torch.empty(8, device="meta", dtype=torch.bfloat16))


def test_rejects_non_contiguous():
    t = _args()
    t["grad"] = torch.zeros(16)[::2]
    with pytest.raises(ValueError, match=r"grad is not contiguous.*stride \(2,\)"):
        _call(t)


@pytest.mark.parametrize("name,dtype", [("grad", torch.int32), ("grad", torch.float64),
                                        ("param", torch.bfloat16), ("exp_avg", torch.float16),
                                        ("param_out", torch.int8)])
def test_rejects_unsupported_dtype(name, dtype):
    t = _args()
    kw = {}
    if name == "param_out":
        kw["param_out"] = torch.zeros(8, dtype=dtype)
    else:
        t[name] = torch.zeros(8, dtype=dtype)
    with pytest.raises(TypeError, match=rf"{name} has dtype {str(dtype)[6:]}.*use one of"):
        _call(t, **kw)


def test_rejects_mixed_moment_dtypes():
    t = _args()
    t["exp_avg_sq"] = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="exp_avg_sq has dtype bfloat16 but exp_avg has float32"):
        _call(t)


def test_rejects_non_tensor():
    t = _args()
    t["grad"] = [0.0] * 8
    with pytest.raises(TypeError, match="grad must be a torch.Tensor, got list"):
        _call(t)


@pytest.mark.parametrize("name", ["grad", "exp_avg", "exp_avg_sq", "param_out"])
def test_rejects_length_mismatch(name):
    t = _args()
    kw = {}
    if name == "param_out":
        kw["param_out"] = torch.zeros(9, dtype=torch.bfloat16)
    else:
        t[name] = torch.zeros(9)
    with pytest.raises(ValueError, match=rf"{name} has 9 elements but param has 8"):
        _call(t, **kw)


def test_rejects_aliased_buffers():
    t = _args()
    t["exp_avg_sq"] = t["exp_avg"]
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        _call(t)
    t = _args()
    with pytest.raises(ValueError, match="param and param_out share memory"):
        _call(t, param_out=t["param"].view(-1)[2:6].view(torch.bfloat16))


@pytest.mark.parametrize("offset,numel,match", [
    (-1, None, r"offset=-1 is out of range for tensors of 8 elements"),
    (9, None, r"offset=9 is out of range"),
    (4, 5, r"numel=5 at offset=4 is out of range.*offset \+ numel must be <= 8"),
    (0, -1, r"numel=-1 at offset=0 is out of range"),
])
def test_rejects_chunk_out_of_range(offset, numel, match):
    with pytest.raises(ValueError, match=match):
        _call(_args(), offset=offset, numel=numel)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(step=0), ValueError, r"Invalid step: 0; step counts from 1"),
    (dict(step=1.0), TypeError, r"step must be an int"),
    (dict(lr=-1e-3), ValueError, r"Invalid learning rate: -0.001"),
    (dict(lr=float("nan")), ValueError, r"Invalid learning rate: nan"),
    (dict(beta1=1.0), ValueError, r"Invalid beta parameter at index 0: 1.0"),
    (dict(beta2=-0.1), ValueError, r"Invalid beta parameter at index 1: -0.1"),
    (dict(eps=-1e-8), ValueError, r"Invalid epsilon value: -1e-08"),
    (dict(weight_decay=-0.1), ValueError, r"Invalid weight_decay value: -0.1"),
    (dict(offset=1.5), TypeError, r"offset must be an int"),
    (dict(num_threads=0), ValueError, r"num_threads=0 must be >= 1"),
])
def test_rejects_bad_hyperparameters(kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(_args(), **kw)


# ---------------------------------------------------------------------------------------------
# fallback without the native library


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(cpu_adam, "_native_lib", lambda: None)
    monkeypatch.setattr(cpu_adam, "_fallback_warned", False)


@pytest.mark.parametrize("use_fused_op", [True, False])
def test_fallback_warns_once_and_matches_torch(no_native, monkeypatch, use_fused_op):
    if not use_fused_op:
        monkeypatch.setattr(cpu_adam, "_torch_fused_op", lambda adamw: None)
    assert not cpu_adam.native_available()
    n = 4096
    gen = torch.Generator().manual_seed(11)
    p, m, v, out = _state(n, gen, None, torch.bfloat16, torch.bfloat16)
    ref = FusedReference(p, m, v, weight_decay=0.01, adamw=True, maximize=False, **HYPER)
    g = random_grad(n, gen).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="native CPU Adam kernel is unavailable"):
        adam_step_(p, g, m, v, step=1, weight_decay=0.01, param_out=out, **HYPER)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        for step in (2, 3):
            adam_step_(p, g, m, v, step=step, weight_decay=0.01, param_out=out, **HYPER)
    for step in (1, 2, 3):
        ref.step(g, step)
    rp, rm, rv, _ = ref.state()
    if use_fused_op:  # torch's fused kernel on fp32 copies: the same arithmetic, exactly
        assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)
    else:  # plain torch ops: within rounding
        assert _max_rel_diff(p, rp) <= 1e-6
    assert torch.equal(out, p.to(torch.bfloat16))


def test_fallback_chunk(no_native):
    n = 64
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    before = p.clone()
    with pytest.warns(RuntimeWarning):
        adam_step_(p, torch.ones(n), m, v, step=1, weight_decay=0.0, offset=16, numel=16,
                   **HYPER)
    assert torch.equal(p[:16], before[:16]) and torch.equal(p[32:], before[32:])
    assert (p[16:32] != before[16:32]).all()


# ---------------------------------------------------------------------------------------------
# CRC-32C


def crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@needs_native
def test_crc32c_known_values():
    assert _native.checksum_algorithm() == "crc32c"
    assert _native.crc32c(b"123456789") == 0xE3069283
    assert _native.crc32c(b"") == 0
    assert _native.crc32c(b"", crc=0x12345678) == 0x12345678
    assert _native.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert _native.crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of 0xFF
    assert _native.crc32c(bytes(range(32))) == 0x46DD794E  # RFC 3720 B.4: incrementing


@needs_native
def test_crc32c_matches_bitwise_reference():
    rng = random.Random(3)
    for size in [1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 255, 767, 768, 769, 1000, 4095, 4100]:
        data = rng.randbytes(size)
        assert _native.crc32c(data) == crc32c_bitwise(data), size


@needs_native
def test_crc32c_hardware_and_table_paths_agree():
    lib = _native.lib()
    rng = np.random.default_rng(4)
    buf = rng.integers(0, 256, 3 * 3 * 8192 + 3 * 3 * 256 + 37, dtype=np.uint8)
    for size in [0, 5, 24, 767, 768, 3 * 256 + 5, 3 * 8192, 3 * 8192 + 3 * 256 + 9, buf.size]:
        for start in (0, 3):  # unaligned start too
            part = buf[start:start + size]
            assert lib.tm_crc32c(0, part.ctypes.data, part.size) == \
                lib.tm_crc32c_sw(0, part.ctypes.data, part.size), (size, start)


@needs_native
def test_crc32c_chains_and_accepts_buffers():
    rng = np.random.default_rng(5)
    arr = rng.integers(0, 256, 100_000, dtype=np.uint8)
    whole = _native.crc32c(arr)
    for cut in (0, 1, 4097, 99_999, 100_000):
        assert _native.crc32c(arr[cut:], crc=_native.crc32c(arr[:cut])) == whole
    assert _native.crc32c(arr.tobytes()) == whole
    assert _native.crc32c(bytearray(arr.tobytes())) == whole
    assert _native.crc32c(memoryview(arr.tobytes())) == whole
    t = torch.from_numpy(arr.copy()).view(torch.int32)  # 25 000 int32: same bytes
    assert _native.crc32c(t) == whole
    with pytest.raises(ValueError, match="non-contiguous tensor"):
        _native.crc32c(torch.zeros(8)[::2])
    with pytest.raises(ValueError, match="on device meta"):
        _native.crc32c(torch.empty(8, device="meta"))
    with pytest.raises(TypeError, match="neither a torch tensor nor a buffer"):
        _native.crc32c(12)


def test_crc32_fallback_without_native(monkeypatch):
    monkeypatch.setattr(_native, "_load", lambda: None)
    assert _native.checksum_algorithm() == "crc32"
    data = b"123456789" * 100
    assert _native.crc32c(data) == zlib.crc32(data)
    assert _native.crc32c(data[500:], crc=_native.crc32c(data[:500])) == zlib.crc32(data)
