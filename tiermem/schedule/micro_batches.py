"""One optimizer step's forward and backward over its micro-batches, the first blocks
breadth-first (Note [breadth-first blocks]).

Note [breadth-first blocks]: with HybridAdam and ``max_grad_norm`` the CPU step of the offloaded
chunks cannot start before ``step()`` (the global norm comes first), so it runs after the last
backward, and with ``param_sync="step"`` the next forward waits for all of it (Note [optimizer
tail] in tiermem/apps/plan/timing.py). With ``param_sync="forward"`` each module waits only for its
own
chunks, and the worker steps them in forward order (Note [stepping order] in
tiermem/optim/hybrid_adam.py): the first layers are ready first. Depth-first, only one
micro-batch's forward can use that: the next step's micro-batch 0 runs block after block as the
worker releases them, and its backward needs every block. :func:`forward_backward` runs the
first ``breadth_first_blocks`` blocks for *every* micro-batch before the rest of micro-batch 0:
that is ``breadth_first_blocks / n_layers`` of the step's whole forward which can run while the
optimizer's tail is still stepping the later blocks. Then each micro-batch in turn runs the
remaining blocks, its loss and its backward, exactly as depth-first.

What each micro-batch computes is unchanged (the same blocks on the same inputs, the same
kernels), and the backward passes run in the same micro-batch order, so gradients are
accumulated in the same order: the gradients are the same bits as depth-first (tested on the
CPU, with and without checkpointing; on CUDA 8 training steps stay within depth-first's own
run-to-run noise). On the H200 the 20B RAM preset's step went from 13.40 s to 11.48 s with it
(docs/benchmarks.md). The price is memory: until its own backward, each
micro-batch keeps what its first ``K`` blocks saved for backward, plus its hidden state: with
every block checkpointed, ``(K + 1)`` block inputs of ``batch x seq x d_model`` elements for
each of the other ``n - 1`` micro-batches (tiermem.apps.plan counts it). ``block_major=True`` runs
every block breadth-first, and the backward block by block too (Note [block-major schedule] in
tiermem/schedule/block_major.py): what a weight stream needs to fetch each block once per pass.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tiermem.names import check_bool, check_int
from tiermem.schedule.block_major import block_major_forward_backward, check_saved


def forward_backward(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     *, breadth_first_blocks: int = 0, block_major: bool = False,
                     saved_store: Any = None, saved_tier: str = "cpu") -> list[torch.Tensor]:
    """Forward and backward of one optimizer step's micro-batches, the first
    ``breadth_first_blocks`` blocks breadth-first (Note [breadth-first blocks]), or every block
    for every micro-batch in turn in the forward and in the backward (``block_major=True``,
    Note [block-major schedule]: with weight streaming, each streamed block crosses PCIe once
    per pass whatever the number of micro-batches).

    Each micro-batch's loss is divided by ``len(batches)`` before its backward, so the
    accumulated gradients are those of the mean loss over the micro-batches.

    Args:
        model: a :class:`tiermem.models.gpt.DecoderLM` (GPT, MoE), or any module with its
            ``embed(idx)``, ``blocks``, ``run_block(i, x)`` and ``output(x, targets) ->
            (logits, loss)``.
        batches: ``(idx, targets)`` per micro-batch, token ids ``(batch, seq)``.
        breadth_first_blocks: blocks run for every micro-batch before the rest of the first
            one, 0 to ``len(model.blocks)`` (0: depth-first, as ``model(idx, targets)`` in a
            loop).
        block_major: run the block-major schedule
            (:func:`tiermem.schedule.block_major.block_major_forward_backward`).
        saved_store: with ``block_major``: None (each block's inputs stay on the device) or a
            :class:`tiermem.TierStore` that keeps them in ``saved_tier`` until the backward.
        saved_tier: ``"gpu"``, ``"cpu"`` or ``"nvme"``: the store tier of the saved inputs.

    Returns:
        The loss of each micro-batch (detached, not divided).

    Raises:
        ValueError: no micro-batches, ``breadth_first_blocks`` outside 0 to the number of
            blocks, ``block_major`` not a bool or given with ``breadth_first_blocks``,
            ``saved_store`` without ``block_major``, a bad ``saved_tier``; the model's own
            errors (a too-long sequence).
        TypeError: ``breadth_first_blocks`` not an int, a
            ``saved_store`` that is not a TierStore, or a model without ``embed``,
            ``run_block`` and ``output``.
        RuntimeError: (block-major) called under ``torch.no_grad()``; the weight stream's or
            the store's errors.
    """
    who = "forward_backward: "
    missing = [name for name in ("embed", "blocks", "run_block", "output")
               if not hasattr(model, name)]
    if missing:
        raise TypeError(f"{who}model ({type(model).__name__}) has no {', '.join(missing)}; "
                        f"pass a tiermem.models.gpt.DecoderLM (GPT, MoE) or a module with "
                        f"embed(idx), blocks, run_block(i, x) and output(x, targets)")
    n_blocks = len(model.blocks)
    fix = f"give 0 (depth-first) to {n_blocks} (the model's blocks)"
    check_int(who, "breadth_first_blocks", breadth_first_blocks, low=0, unit="blocks", fix=fix)
    if breadth_first_blocks > n_blocks:
        raise ValueError(f"{who}breadth_first_blocks={breadth_first_blocks} exceeds the "
                         f"model's {n_blocks} blocks; {fix}")
    if not batches:
        raise ValueError(f"{who}batches is empty; give one (idx, targets) per micro-batch")
    check_bool(who, "block_major", block_major)
    if block_major:
        if breadth_first_blocks:
            raise ValueError(f"{who}block_major=True runs every block breadth-first already; "
                             f"give breadth_first_blocks=0 (got {breadth_first_blocks})")
        check_saved(saved_store, saved_tier)
        return block_major_forward_backward(model, batches, saved_store=saved_store,
                                            saved_tier=saved_tier)
    if saved_store is not None:
        raise ValueError(f"{who}saved_store keeps the block-major schedule's saved inputs; "
                         f"give block_major=True, or saved_store=None")
    k, n = breadth_first_blocks, len(batches)
    hidden: list[torch.Tensor | None] = [None] * n
    if k:  # every micro-batch through the first k blocks, block by block
        hidden = [model.embed(idx) for idx, _ in batches]
        for i in range(k):
            hidden = [model.run_block(i, x) for x in hidden]
    losses = []
    for m, (idx, targets) in enumerate(batches):
        x = hidden[m] if k else model.embed(idx)
        hidden[m] = None  # the step keeps only what this micro-batch's graph saved
        for i in range(k, n_blocks):
            x = model.run_block(i, x)
        _, loss = model.output(x, targets)
        (loss / n).backward()
        losses.append(loss.detach())
    return losses
