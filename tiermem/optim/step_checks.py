"""What ``HybridAdam.step()`` refuses before it steps anything: more backward passes than
``grad_accumulation_steps``, gradients changed after backward copied them off the GPU
(Note [gradient checksums]), a GradScaler with gradients handed over in backward
(Note [grad scaler], ``take_scaler``), parameters changed after their gradient hook
handed them over (Note [param changes]), and hyper-parameters set after chunks were stepped
with the old ones (Note [late hyper-parameters]); and ``zero_grad()`` after a backward without
``step()`` (Note [skipped steps]).

Note [skipped steps]: a loop may skip a step after backward (a bad batch: ``zero_grad()`` and
no ``step()``); torch.optim.AdamW then applies nothing. With ``overlap=True`` HybridAdam's worker
may already have stepped offloaded chunks during that backward. The skip used to surface at the
next ``step()`` as "2 backward passes accumulated ... grad_accumulation_steps=1", and the skipped
backward's update stayed in every chunk the worker had stepped. Now ``HybridAdam.zero_grad()``
after a backward without ``step()`` abandons the step (``StepState.abandon``: chunks not yet
stepped never are, speculated ones go back) and starts the next one afresh. When every chunk
of that backward was held (clipping without speculation, a GradScaler's first step, Note [late
hyper-parameters]'s hold, ``overlap=False``, accumulation not yet at its last pass) or
speculated, the skip is exact, as AdamW's. When chunks could step during backward (their
gradients were handed over with nothing holding them), it raises in one line: part of the
update may be applied; decide the skip before backward (e.g. a non-finite loss is known before
``loss.backward()``), or build HybridAdam with ``max_grad_norm`` and ``rollback_bytes`` (chunks
speculate, and a skip puts them back) or ``overlap=False``. ``model.zero_grad()`` bypasses the
optimizer: the next ``step()`` refuses the extra backward pass and names this case.
tests/optim/test_skipped_steps.py."""

from __future__ import annotations

import logging

from tiermem.optim.amp_scaling import take_scaler  # noqa: F401 (for step())
from tiermem.optim.grad_sums import changed_since_ship, shipped_mark  # noqa: F401 (_ship)
from tiermem.optim.layout import Group
from tiermem.optim.param_watch import ParamWatch
from tiermem.optim.step_state import StepState

logger = logging.getLogger("tiermem")


def check_accumulation(step: StepState, grad_accumulation_steps: int, who: str) -> None:
    """Refuse a step after more backward passes than ``grad_accumulation_steps``: gradients
    were copied off the GPU after the last counted pass. The step is abandoned first
    (:meth:`StepState.abandon`), so that the message can say whether chunks stepped during
    backward (with the gradients of pass ``grad_accumulation_steps``, not put back by a
    speculative step's rollback) stay stepped: then only a checkpoint is exact.

    Raises:
        RuntimeError: a param accumulated more passes than ``grad_accumulation_steps``.
    """
    with step.lock:
        extra = [(k, n) for k, n in step.acc_count.items() if n > grad_accumulation_steps]
    if not extra:
        return
    step.abandon()  # chunks not yet stepped are not; speculated ones go back
    undone = getattr(step.speculation, "undone_items", frozenset())
    with step.lock:
        stayed = len([item for item in step.chunk_h2d if item not in undone])
    tail = (f" {stayed} offloaded chunks were already stepped during backward with the "
            f"gradients of pass {grad_accumulation_steps} and stay stepped: restart from a "
            f"checkpoint to stay exact" if stayed else " Nothing of this step was applied")
    raise RuntimeError(
        f"{who}: {extra[0][1]} backward passes accumulated into a "
        f"parameter before step(), but grad_accumulation_steps="
        f"{grad_accumulation_steps}: gradients were copied off the GPU after pass "
        f"{grad_accumulation_steps}; set grad_accumulation_steps to the number of "
        f"backward passes per step (or, to skip a step after backward, call "
        f"opt.zero_grad(), not model.zero_grad(): Note [skipped steps]).{tail}")


def check_grads_untouched(step: StepState, groups: list[Group], who: str) -> None:
    """Refuse a step whose gradients changed after backward copied them off the GPU.

    With overlap, an offloaded gradient is copied D2H (and may already be stepped on the
    CPU) the moment it is accumulated; ``torch.nn.utils.clip_grad_norm_`` or a GradScaler's
    ``unscale_`` after backward would then change only the copy left on the GPU and the
    step would silently mix clipped and unclipped gradients. The grads' version counters
    tell, and for writes that move none (``p.grad.data``, GradScaler's unscale kernel) their
    checksums taken at the hand-over (Note [gradient checksums] in ``grad_sums.py``).

    Raises:
        RuntimeError: a gradient was modified in place or replaced after it was shipped.
    """
    with step.lock:
        shipped = dict(step.shipped_versions)
    grads = {key: groups[key[0]].params[key[1]].grad for key in shipped}
    moved = [k for k, (version, ptr, _) in shipped.items() if grads[k] is None
             or grads[k]._version != version or grads[k].data_ptr() != ptr]
    if moved or changed_since_ship(shipped, grads):
        raise RuntimeError(
            f"{who}: a gradient was changed after backward had already copied it off the "
            f"GPU (overlap=True), e.g. by torch.nn.utils.clip_grad_norm_, "
            f"GradScaler.unscale_ or a write through p.grad.data; clip with "
            f"HybridAdam(max_grad_norm=...), which clips every gradient on and off the GPU, "
            f"train fp16 with a GradScaler with overlap=False (Note [grad scaler]) or bf16 "
            f"without a scaler, or build HybridAdam with overlap=False so gradients are "
            f"copied in step(). This step was not applied consistently: restart from a "
            f"checkpoint")


def check_params_before_step(watch: ParamWatch, groups: list[Group], who: str) -> None:
    """Note [param changes]: take the changes of parameters not yet handed over this step
    into their masters; refuse a parameter changed after its gradient hook handed it over
    (the CPU side may have stepped it from the old value).

    Raises:
        RuntimeError: a parameter changed between its gradient hook and ``step()``.
        ValueError: a parameter changed its shape, dtype or device.
    """
    for g in groups:
        for i in range(g.n_local):
            if not watch.checked(g.index, i):
                watch.sync(g.index, i)
            elif watch.changed(g.index, i):
                raise RuntimeError(
                    f"{who}: param {i} of param group {g.index} was changed after "
                    f"backward had handed it to the CPU step (overlap=True), which may "
                    f"have stepped it from the old value; change parameters before the "
                    f"forward or after step(), or build HybridAdam with overlap=False. "
                    f"This step was not applied")


def hold_for_late_hyperparams(who: str, stale: list[str], late: list[str], holding: bool) -> bool:
    """Note [late hyper-parameters] (in hyperparams.py): whether every offloaded chunk must wait
    for ``step()`` from the next step on, given :meth:`StepState.late_changes`' ``stale`` and
    ``late`` lists; logged once, when ``holding`` turns True.

    Raises:
        Nothing.
    """
    if (late or stale) and not holding:
        logger.warning(
            "%s: the training loop changes hyper-parameters after backward began (%s); every "
            "offloaded chunk now waits for step() (no CPU step during backward), so that "
            "step() applies them as torch.optim.AdamW does. To keep the overlap, set them "
            "before the forward (e.g. scheduler.step() after opt.step())",
            who, "; ".join((stale or late)[:3]))
    return holding or bool(late or stale)


def refuse_stale_hyperparams(who: str, stale: list[str]) -> None:
    """Note [late hyper-parameters]: refuse a step whose chunks stepped during backward used
    hyper-parameters ``step()`` does not have (``stale``, from :meth:`StepState.late_changes`).

    Raises:
        RuntimeError: ``stale`` is not empty.
    """
    if stale:
        raise RuntimeError(
            f"{who}: chunks stepped during backward (overlap=True) used other hyper-parameters "
            f"than step() has: {'; '.join(stale[:3])}; set them before the forward (e.g. "
            f"scheduler.step() after opt.step()), or build HybridAdam with overlap=False. "
            f"This step was refused; chunks stepped without a rollback copy keep the old "
            f"values: restart from a checkpoint (later steps hold the chunks until step())")


def refuse_skipped_step(who: str, could_step: bool) -> None:
    """Note [skipped steps]: after ``zero_grad()`` abandoned a step whose backward handed chunks
    over, refuse when some of them could have been stepped (``could_step``).

    Raises:
        RuntimeError: ``could_step``.
    """
    if could_step:
        raise RuntimeError(
            f"{who}: zero_grad() after backward without step(): with overlap=True offloaded "
            f"chunks are stepped during backward, so part of this skipped step may be applied; "
            f"decide the skip before loss.backward() (e.g. check the loss is finite), or build "
            f"HybridAdam with max_grad_norm and rollback_bytes (a skip puts speculated chunks "
            f"back) or overlap=False. The step was abandoned; restart from a checkpoint to "
            f"stay exact")
