"""``tiermem plan --rollback-bytes``: a budget of pre-step copies (HybridAdam's
``rollback_bytes``, Note [speculative step] in ``tiermem/optim/speculate.py``) that alone keeps
the plan from fitting is refused with the largest budget that fits (Note [rollback refusal]).

Note [rollback refusal]: :func:`tiermem.apps.plan.plan` counts the rollback slots (host RAM, the
GPU lane's share on the GPU) wherever a step can speculate (``--max-grad-norm`` or
``--grad-scaler``, streamed weights too), and a plan they overflow does not
fit, its reason naming ``optimizer.rollback_bytes``. On the command line the budget is the
user's explicit request: when the same plan fits with ``--rollback-bytes 0``, the budget is the
only problem, so the command refuses it as a bad argument (one line, exit 2) naming the flag,
its field and the fix: the largest budget, in whole slots, with which the plan still fits
(found by bisection: more slots never take less memory). A plan that does not fit even without
the budget is reported as any other (exit 1).
"""

from __future__ import annotations

import torch

from tiermem import options
from tiermem.apps.plan.memory import largest_chunk
from tiermem.apps.plan.placement import ROLLBACK_ITEM, plan, waits_for
from tiermem.apps.plan.result import Plan
from tiermem.optim.layout import chunk_state_bytes
from tiermem.shapes import GiB


def rollback_refusal(result: Plan, num_params: int, kw: dict) -> str | None:
    """The one-line refusal of a rollback budget that alone keeps ``result`` from fitting
    (Note [rollback refusal]), or None (it fits, holds no slots, or does not fit without them).

    Args:
        result: ``plan(num_params, **kw)``.
        num_params: the model's parameters.
        kw: :func:`tiermem.apps.plan.plan`'s keywords for ``result``.

    Raises:
        ValueError, TypeError: what :func:`tiermem.apps.plan.plan` raises for ``kw``.
    """
    item = next((i for i in result.items if i.name == ROLLBACK_ITEM), None)
    if result.fits or item is None:
        return None
    if not plan(num_params, **{**kw, "rollback_bytes": 0}).fits:
        return None  # the table says what else does not fit
    budget = result.inputs["rollback_bytes"]
    chunk_numel = kw.get("chunk_numel", options.default("optimizer.chunk_numel", "plan"))
    chunk = largest_chunk(round(result.offload_fraction * num_params), chunk_numel)
    slot = chunk_state_bytes(chunk, getattr(torch, result.inputs["moments_dtype"]))
    fits, fails = 0, budget // slot  # in slots: 0 fits (above), the budget's count does not
    while fails - fits > 1:
        mid = (fits + fails) // 2
        if plan(num_params, **{**kw, "rollback_bytes": mid * slot}).fits:
            fits = mid
        else:
            fails = mid
    over = "; ".join(r.split(";")[0] for r in result.reasons)
    best = fits * slot
    waits = waits_for(result.inputs["max_grad_norm"], result.inputs["grad_scaler"])
    return (f"--rollback-bytes {budget} (optimizer.rollback_bytes) does not fit: with its "
            f"{(item.host + item.gpu) / GiB:,.1f} GiB of pre-step copies ({item.note}) the "
            f"{over}, and the plan fits without them; fix: --rollback-bytes {best} or less "
            f"({fits} chunks of {slot / GiB:,.2f} GiB, {best / GiB:,.1f} GiB), or 0 (every "
            f"chunk waits for {waits})")
