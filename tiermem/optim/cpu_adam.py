"""Fused CPU Adam/AdamW step on raw chunks of optimizer state (the native kernel's binding).

One call updates elements ``[offset, offset + numel)`` of the fp32 master params, both moments
and optionally a low-precision copy of the params, in a single pass over memory:

* ``param``: fp32 master params (updated in place);
* ``grad``: fp32, bf16 or fp16 (read only; converted to fp32 in registers);
* ``exp_avg`` / ``exp_avg_sq``: fp32, or bf16 (computed in fp32, stored rounded to nearest even);
* ``param_out``: optional fp32/bf16/fp16 buffer (e.g. the pinned staging buffer of the H2D copy)
  receiving the updated params rounded to nearest even -- bit-equal to ``param.to(dtype)``.

The math and its operation order are those of torch's fused CPU AdamW/Adam
(``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``) in its vectorised body: with fp32
everything, results are bit-identical to ``torch.optim.AdamW(fused=True)`` /
``torch.optim.Adam(fused=True)`` on CPU for tensors whose element count is a multiple of 16.
torch steps the last ``numel % 16`` elements of a tensor in a scalar loop that rounds the second
moment differently (up to 2 ulp), so there the two differ within the bound README.md states
(checked by tests/test_claims.py). Results never depend on the thread count or on how a caller
splits the range into chunks.

Without the native library (no compiler at install time) the step falls back, with one warning,
to torch's own fused CPU kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``) or, where
that op is missing, to a plain torch implementation in the same operation order.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import warnings

import torch
from torch import Tensor

from tiermem import _native
from tiermem.stream.checksums import placed_checksum

__all__ = ["adam_step_", "adam_step_unchecked", "native_available"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_fallback_warned = False


def native_available() -> bool:
    """Whether :func:`adam_step_` runs the native kernel (else it falls back to torch).

    Returns:
        ``True`` when ``tiermem/_tiermem_native.so`` is built and loadable.
    """
    return _native_lib() is not None


def _native_lib():
    # Indirection so tests can pretend the library is missing (monkeypatch this function).
    return _native.lib()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on device '{t.device}', but adam_step_ runs on CPU "
                         f"tensors: pass {name}.cpu() (HybridAdam keeps the CPU copies in "
                         "pinned host memory)")
    if t.dtype not in dtypes:
        allowed = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}, which adam_step_ does not "
                        f"support; use one of: {allowed} (convert with {name}.to(dtype))")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, stride "
                         f"{tuple(t.stride())}); pass {name}.contiguous() or a flat buffer")
    return t


def _check_no_overlap(named: list[tuple[str, Tensor]]) -> None:
    # The kernel reads and writes through restrict pointers: buffers must be disjoint.
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for name, t in named if t.numel()]
    for i, (a, a0, a1) in enumerate(spans):
        for b, b0, b1 in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{a} and {b} share memory; adam_step_ needs separate buffers "
                                 f"for every argument (pass a clone of {b})")


def _check_hyper(step: object, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int (the 1-based step count after incrementing), "
                        f"got {type(step).__name__} {step!r}")
    if step < 1:
        raise ValueError(f"Invalid step: {step}; step counts from 1 (increment the step count "
                         "before calling adam_step_, as torch.optim.Adam does)")
    # Messages follow torch.optim.Adam's; NaN fails every comparison, so it is rejected too.
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr} (lr must be >= 0)")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps} (eps must be >= 0)")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1} (beta1 must be in [0, 1))")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2} (beta2 must be in [0, 1))")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not math.isfinite(value):
            raise ValueError(f"Invalid {name}: {value} (must be finite)")
    return int(step)


def adam_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    maximize: bool = False,
    param_out: Tensor | None = None,
    offset: int = 0,
    numel: int | None = None,
    num_threads: int | None = None,
) -> None:
    """One fused Adam/AdamW step, in place, on elements ``[offset, offset + numel)``.

    All tensors are contiguous CPU tensors of the same number of elements (any shape; they are
    addressed as flat arrays). The update, per element, in torch's fused-kernel order::

        g = -grad if maximize else grad
        Adam:  g = g + weight_decay * param          AdamW: param *= 1 - lr * weight_decay
        exp_avg.lerp_(g, 1 - beta1);  exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        param -= lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)

    Args:
        param: fp32 master params, updated in place.
        grad: gradients, fp32, bf16 or fp16 (not modified).
        exp_avg: first moment, fp32 or bf16, updated in place.
        exp_avg_sq: second moment, same dtype as ``exp_avg``, updated in place.
        step: 1-based step count of this update (already incremented).
        lr: learning rate (>= 0).
        beta1: first-moment decay, in [0, 1).
        beta2: second-moment decay, in [0, 1).
        eps: term added to the denominator (>= 0).
        weight_decay: decay coefficient (>= 0); decoupled (AdamW) or L2 (Adam), see ``adamw``.
        adamw: ``True`` for decoupled weight decay (torch.optim.AdamW), ``False`` for the L2
            penalty added to the gradient (torch.optim.Adam).
        maximize: maximize the objective (negates the gradient).
        param_out: optional fp32/bf16/fp16 tensor receiving the updated params, rounded to
            nearest even (bit-equal to ``param.to(param_out.dtype)``), in the same pass.
        offset: first element of the chunk to update (elements, not bytes).
        numel: number of elements of the chunk; ``None`` means up to the end.
        num_threads: OpenMP threads for this call; ``None`` uses ``torch.get_num_threads()``.
            Chunks under ~32k elements per thread use fewer threads.

    Raises:
        TypeError: if an argument is not a tensor, has an unsupported dtype, or ``step`` is not
            an int.
        ValueError: if a tensor is not on the CPU or not contiguous, the element counts differ,
            two tensors share memory,
            ``offset``/``numel`` fall outside the tensors, ``step < 1``, or a hyperparameter is
            out of range (messages as torch.optim's).
        RuntimeError: if the native kernel reports an error (an internal bug).
    """
    _check_tensor("param", param, (torch.float32,))
    _check_tensor("grad", grad, _GRAD_DTYPES)
    _check_tensor("exp_avg", exp_avg, _STATE_DTYPES)
    _check_tensor("exp_avg_sq", exp_avg_sq, _STATE_DTYPES)
    if exp_avg_sq.dtype != exp_avg.dtype:
        raise TypeError(f"exp_avg_sq has dtype {_dtype_name(exp_avg_sq.dtype)} but exp_avg has "
                        f"{_dtype_name(exp_avg.dtype)}; keep both moments in the same dtype")
    if param_out is not None:
        _check_tensor("param_out", param_out, _OUT_DTYPES)
    step = _check_hyper(step, lr, beta1, beta2, eps, weight_decay)

    total = param.numel()
    named = [("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if param_out is not None:
        named.append(("param_out", param_out))
    for name, t in named:
        if t.numel() != total:
            raise ValueError(f"{name} has {t.numel()} elements but param has {total}; all "
                             "tensors of one adam_step_ call must have the same length")
    _check_no_overlap([("param", param)] + named)
    for name, value in (("offset", offset), ("numel", numel), ("num_threads", num_threads)):
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= offset <= total:
        raise ValueError(f"offset={offset} is out of range for tensors of {total} elements "
                         f"(must be in [0, {total}])")
    if numel is None:
        numel = total - offset
    if numel < 0 or offset + numel > total:
        raise ValueError(f"numel={numel} at offset={offset} is out of range for tensors of "
                         f"{total} elements (offset + numel must be <= {total}, numel >= 0)")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads={num_threads} must be >= 1 (or None for "
                         "torch.get_num_threads())")
    adam_step_unchecked(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
                        maximize=maximize, param_out=param_out, offset=offset, numel=numel,
                        num_threads=num_threads)


def adam_step_unchecked(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                        step: int, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, adamw: bool, maximize: bool,
                        param_out: Tensor | None, offset: int, numel: int,
                        num_threads: int | None,
                        sum_as: tuple[Tensor, int] | None = None) -> int | None:
    """:func:`adam_step_` without its argument checks, for callers whose buffers are valid by
    construction (HybridAdam's chunks, once per chunk and step): the same kernel and results.

    With ``sum_as=(whole, start)`` it also returns what the ``numel`` params it wrote to
    ``param_out`` add to :func:`~tiermem.stream.checksums.checksum` of ``whole`` as its
    elements ``[start, start + numel)``: ``piece_checksum(whole, start, numel)`` once they are
    there (None, like it, when ``whole`` does not start on an 8-byte boundary). The native
    kernel sums each block of its output right after writing it, from L1 (Note [streamed
    write-back checksums]); without it the written bytes are summed in torch after the step.

    Raises:
        ValueError: ``sum_as`` without ``param_out``, or ``whole`` of another element size.
        RuntimeError: if the native kernel reports an error (an internal bug).
    """
    place = None
    if sum_as is not None:
        place = _sum_place(sum_as, param_out)
    if numel == 0:
        return None if place is None else 0
    native = _native_lib()
    if native is None:
        _warn_fallback()
        _torch_step(param, grad, exp_avg, exp_avg_sq, param_out, offset, numel, step=step,
                    lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    adamw=adamw, maximize=maximize)
        if place is None:
            return None
        written = param_out.detach().reshape(-1)[offset:offset + numel].view(torch.uint8)
        return placed_checksum(written, *place)

    def ptr(t: Tensor) -> int:
        return t.data_ptr() + offset * t.element_size()

    codes = _native.DTYPE_CODES
    total = ctypes.c_uint64(0)
    lo, whole_bytes = place if place is not None else (0, 0)
    rc = native.tm_adam_step_sum(
        ptr(param), ptr(grad), codes[_dtype_name(grad.dtype)], ptr(exp_avg), ptr(exp_avg_sq),
        codes[_dtype_name(exp_avg.dtype)],
        None if param_out is None else ptr(param_out),
        _native.DTYPE_NONE if param_out is None else codes[_dtype_name(param_out.dtype)],
        int(numel), step, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), int(bool(adamw)), int(bool(maximize)),
        int(num_threads) if num_threads is not None else _native.num_threads(),
        lo % 8, whole_bytes // 8 * 8 - lo, None if place is None else ctypes.byref(total))
    if rc != 0:
        raise RuntimeError(f"tm_adam_step failed: {_native.ERRORS.get(rc, rc)} (arguments "
                           "passed Python validation, so this is a tiermem bug)")
    return None if place is None else total.value


def _sum_place(sum_as: tuple[Tensor, int], param_out: Tensor | None) -> tuple[int, int] | None:
    """``(byte offset of the piece in the whole, the whole's bytes)`` for ``sum_as=(whole,
    start)``, or None when ``whole`` does not start on an 8-byte boundary (no sum)."""
    whole, start = sum_as
    if param_out is None:
        raise ValueError("sum_as needs param_out: the sum is of the params written there; pass "
                         "param_out or drop sum_as")
    if whole.element_size() != param_out.element_size():
        raise ValueError(f"sum_as's whole has {whole.element_size()}-byte elements but "
                         f"param_out {param_out.element_size()}-byte ones; pass the tensor "
                         "param_out's params belong to")
    if whole.data_ptr() % 8:
        return None
    return start * whole.element_size(), whole.numel() * whole.element_size()


def _warn_fallback() -> None:
    global _fallback_warned
    if _fallback_warned:
        return
    _fallback_warned = True
    warnings.warn(
        "tiermem's native CPU Adam kernel is unavailable "
        f"({_native.load_error() or 'loader disabled'}); adam_step_ falls back to torch's "
        "fused CPU AdamW with separate dtype casts, which is about 3x slower with bf16 "
        "gradients/params. Install a C compiler and rerun `pip install --no-build-isolation "
        "-e .` to build it.",
        RuntimeWarning,
        stacklevel=3,
    )


def _torch_fused_op(adamw: bool):
    """torch's fused CPU Adam op if this torch has it (feature check, not a version check)."""
    return getattr(torch, "_fused_adamw_" if adamw else "_fused_adam_", None)


@torch.no_grad()
def _torch_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                param_out: Tensor | None, offset: int, numel: int, *, step: int, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
                maximize: bool) -> None:
    """Fallback in torch ops: fp32 copies of low-precision inputs, one fused step, casts back."""
    sl = slice(offset, offset + numel)
    p = param.detach().view(-1)[sl]
    g = grad.detach().view(-1)[sl].float()  # a copy only for bf16/fp16 grads; never written
    m_lp = exp_avg.detach().view(-1)[sl]
    v_lp = exp_avg_sq.detach().view(-1)[sl]
    m = m_lp.float()
    v = v_lp.float()
    fused = _torch_fused_op(adamw)
    if fused is not None:
        fused([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=beta1,
              beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
              maximize=maximize)
    else:
        _reference_step(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, adamw=adamw, maximize=maximize)
    if m_lp.dtype != torch.float32:
        m_lp.copy_(m)
        v_lp.copy_(v)
    if param_out is not None:
        param_out.detach().view(-1)[sl].copy_(p)


def _reference_step(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
                    maximize: bool) -> None:
    """Plain torch ops in the fused kernel's order (fp32 tensors, updated in place)."""
    if maximize:
        g = -g
    if weight_decay != 0:
        if adamw:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g + p * weight_decay
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p.add_((-(lr / bias_correction1)) * m / denom)
