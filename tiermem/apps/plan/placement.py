"""The placement: :func:`plan` puts a training run's state on GPU / pinned host RAM / NVMe by the
memory model (:mod:`tiermem.apps.plan.memory`), says whether it fits, and predicts its step
(:mod:`tiermem.apps.plan.timing`); :func:`breadth_first_note` says when another schedule would be
faster.

Automatic placement (``offload_fraction=None``, ``state_tier="auto"``, ``offload_layers=None``):
keep activations on the GPU if possible, and find the smallest offload fraction (in steps of
0.01) with which the GPU fits; put the offloaded state in RAM, else split it (RAM first, the
rest on NVMe: HybridAdam's ``state_tier="split"``). Only when even ``f = 1`` does not fit the
GPU are the activations of all blocks but the last offloaded (to the host tier). When no
placement fits, the plan says which tier overflows, by how much, and whether RAM + NVMe
together could hold the offloaded state at all (with fp32 and with bf16 moments).

MoE models (``n_experts``, ``top_k``, ``d_expert``): parameters, gradients and optimizer state
count every parameter (the total, ``MoEConfig.num_params()``); the activations depend on
``top_k`` and ``d_expert`` only; the plan also reports the active parameters (those one token
uses, ``MoEConfig.active_params()``: what the compute per token scales with).
"""

from __future__ import annotations

import math

import torch

from tiermem import options
from tiermem.names import check_int, dtype_name
from tiermem.optim.layout import (GRAD_SLOTS, LANE_SLOTS, NVME_EXTRA_CHUNKS, OUT_SLOTS,
                                  gpu_side_state_bytes, lane_slot_bytes, state_numel)
from tiermem.apps.plan.memory import (PARAM_DTYPES, activation_bytes_per_block, head_bytes,
                                 host_buffer_bytes, largest_chunk, rollback_slot_bytes,
                                 rollback_slots,
                                 moe_activation_bytes_per_block, short_dtype)
from tiermem.rates import MachineRates
from tiermem.apps.plan.pinned import block_pinned_bytes
from tiermem.apps.plan.result import Item, Plan, add_notes, overflow
from tiermem.shapes import GiB
from tiermem.apps.plan.streaming import (block_numels, block_store_bytes, check_stream_args,
                                    gpu_breakdown, non_block_params, place_stream,
                                    schedule_for)
from tiermem.apps.plan.timing import step_time


FIELDS = {
    "moments_dtype": "optimizer.moments_dtype", "offload_fraction": "optimizer.offload_fraction",
    "state_tier": "optimizer.state_tier", "chunk_numel": "optimizer.chunk_numel",
    "nvme_lookahead_chunks": "optimizer.nvme_lookahead_chunks",
    "gpu_step_fraction": "optimizer.gpu_step_fraction",
    "max_grad_norm": "optimizer.max_grad_norm", "param_sync": "optimizer.param_sync",
    "rollback_bytes": "optimizer.rollback_bytes",
    "offload_layers": "activations.num_layers", "activation_tier": "activations.tier",
    "prefetch_depth": "activations.prefetch_depth",
    "gpu_bytes": "budgets.gpu_bytes", "host_bytes": "budgets.host_bytes",
    "nvme_bytes": "budgets.nvme_bytes", "gpu_reserve_bytes": "budgets.gpu_reserve_bytes",
    "host_reserve_bytes": "budgets.host_reserve_bytes",
    "checkpoint": "train.checkpoint", "grad_accumulation_steps": "train.grad_accumulation_steps",
    "breadth_first_blocks": "train.breadth_first_blocks",
    "stream_weights": "streaming.enabled", "stream_tier": "streaming.tier",
    "prefetch_blocks": "streaming.prefetch_blocks", "stream_schedule": "streaming.schedule",
}
"""Each :func:`plan` keyword that is a configuration field -> its dotted name: its default and
check come from there (Note [one definition] in tiermem/options.py; ``"auto"`` and None are
the planner's choice where its default says so). The other keywords describe the model
(``num_params``, ``model``, the shape, ``dtype``: the planner also sizes float16), the
machine (``rates``, ``eager_attention``) and the training loop (``grad_scaler``: HybridAdam
finds a GradScaler at run time, no field says one is used), no configuration field."""
NOT_FIELDS = ("num_params", "model", "n_layers", "d_model", "n_heads", "vocab", "seq", "batch",
              "mlp_ratio", "n_experts", "top_k", "d_expert", "dtype", "eager_attention", "rates",
              "grad_scaler")
"""The :func:`plan` keywords that are no configuration field (see :data:`FIELDS`)."""
_D = {kw: options.default(dotted, "plan") for kw, dotted in FIELDS.items()}
ROLLBACK_ITEM = "rollback copies (speculative step)"
"""The plan's item of HybridAdam's rollback slots (Note [speculative step]): with clipping or a
GradScaler (Note [grad scaler overlap] in tiermem/optim/amp_scaling.py)."""
_WHO = options.Who("plan: ")


def _field(keyword: str, value):
    """``plan(keyword=value)`` checked as its configuration field; the value normalized.

    Raises:
        ValueError, TypeError: a bad value, naming the keyword and the fix.
    """
    return options.check(FIELDS[keyword], _WHO, value, "plan", keyword)


def waits_for(max_grad_norm: float | None, grad_scaler: bool) -> str:
    """What HybridAdam's chunks that do not speculate wait for (Note [scaler verdict] in
    tiermem/apps/plan/timing.py): the norm, the GradScaler's verdict, or both.

    Raises:
        Nothing.
    """
    return " and ".join((["the norm"] if max_grad_norm is not None else [])
                        + (["the scaler's verdict"] if grad_scaler else [])) or "nothing"


def _moe_shape(n_experts, top_k, d_expert) -> bool:
    """Validate the MoE inputs; True for an MoE, False for a dense model (none given)."""
    given = {"n_experts": n_experts, "top_k": top_k, "d_expert": d_expert}
    if all(v is None for v in given.values()):
        return False
    missing = [name for name, v in given.items() if v is None]
    if missing:
        raise ValueError(f"plan: an MoE needs n_experts, top_k and d_expert; {', '.join(missing)} "
                         f"missing (command line: --experts, --top-k, --d-expert)")
    for name, value in given.items():
        check_int("plan: ", name, value)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} exceeds n_experts={n_experts}; route each token to at "
                         f"most n_experts experts")
    return True


def plan(num_params=None, *, model=None, n_layers: int | None = None,
         d_model: int | None = None, n_heads: int | None = None, vocab: int = 32000,
         seq: int = 2048, batch: int = 1, mlp_ratio: int = 4, n_experts: int | None = None,
         top_k: int | None = None, d_expert: int | None = None, dtype=None,
         moments_dtype=_D["moments_dtype"], gpu_bytes=_D["gpu_bytes"],
         host_bytes=_D["host_bytes"], nvme_bytes=_D["nvme_bytes"],
         offload_fraction: float | None = _D["offload_fraction"],
         state_tier: str = _D["state_tier"], offload_layers: int | None = _D["offload_layers"],
         activation_tier: str = _D["activation_tier"], checkpoint: bool = _D["checkpoint"],
         prefetch_depth: int = _D["prefetch_depth"], eager_attention: bool = False,
         gpu_reserve_bytes=_D["gpu_reserve_bytes"], host_reserve_bytes=_D["host_reserve_bytes"],
         chunk_numel: int | None = _D["chunk_numel"],
         nvme_lookahead_chunks: int = _D["nvme_lookahead_chunks"],
         grad_accumulation_steps: int = _D["grad_accumulation_steps"],
         gpu_step_fraction: float = _D["gpu_step_fraction"],
         max_grad_norm: float | None = _D["max_grad_norm"], param_sync: str = _D["param_sync"],
         rollback_bytes: int | str = _D["rollback_bytes"],
         breadth_first_blocks: int | str = _D["breadth_first_blocks"],
         stream_weights: bool | str = _D["stream_weights"], stream_tier: str = _D["stream_tier"],
         prefetch_blocks: int = _D["prefetch_blocks"],
         stream_schedule: str = _D["stream_schedule"], grad_scaler: bool = False,
         rates: MachineRates | None = None) -> Plan:
    """Place a training run's state on GPU / host RAM / NVMe and say whether it fits.

    Args:
        num_params: parameter count (for an MoE: all parameters, every expert's), or an
            ``nn.Module`` (its parameters are counted, its dtype taken, and its ``cfg`` read
            when it is a ``tiermem.models.GPT`` or ``tiermem.models.MoE``); None with an MoE
            shape: counted from the shape (``tiermem.models.MoEConfig.num_params``).
        model: an ``nn.Module`` (alternative to passing it as ``num_params``).
        n_layers, d_model, n_heads: the transformer's shape, for the activation estimate
            (required unless the model is a tiermem GPT; ``n_heads`` only matters with
            ``eager_attention``; default d_model/128).
        vocab: vocabulary size (tokens), for the head and loss.
        seq: tokens per sequence.
        batch: sequences per micro-batch.
        mlp_ratio: MLP width / d_model (dense models).
        n_experts, top_k, d_expert: an MoE block (``tiermem.models.moe``): experts per block,
            experts per token, expert hidden width; all three or none (dense). The
            activations depend on ``top_k`` and ``d_expert``; ``plan.active_params`` is the
            total less the ``n_experts - top_k`` experts per block a token skips.
        dtype: parameter (and activation) dtype: bfloat16 or float32 (float16: 2 bytes), in any
            spelling of :data:`tiermem.names.DTYPE_SPELLINGS` (``"bf16"``, ``"bfloat16"``,
            ``torch.bfloat16``, ...); None: the model's dtype when a model is given, else bf16.
        moments_dtype: dtype of the Adam moments, float32 or bfloat16, in any spelling
            (``"fp32"``, ``"float32"``, ``torch.float32``, ...): HybridAdam's, which stores them
            so on the GPU side and the offloaded side alike (bf16: 4 B/param less on each).
            ``plan.inputs`` keeps both dtypes by their canonical names (``"bfloat16"``).
        gpu_bytes, host_bytes, nvme_bytes: capacities in bytes (ints or strings like
            ``"141GB"``, ``"128GiB"``); defaults: the H200 machine.
        offload_fraction: fraction of the optimizer state off the GPU in [0, 1]; None: the
            smallest that fits.
        state_tier: ``"cpu"``, ``"nvme"``, ``"split"`` (RAM first, the rest on NVMe, like
            HybridAdam's ``state_tier="split"``) or ``"auto"`` (RAM if it fits, else split).
        offload_layers: blocks whose activations are offloaded, in [0, n_layers); None:
            0, or n_layers-1 when the GPU cannot fit otherwise.
        activation_tier: ``"cpu"`` or ``"nvme"``: where offloaded activations go.
        checkpoint: activation checkpointing of every block.
        prefetch_depth: blocks reloaded ahead in backward (offloaded activations).
        eager_attention: the attention saves its softmax (no flash/efficient SDPA kernel).
        gpu_reserve_bytes: GPU bytes kept free for the CUDA context, workspaces and
            fragmentation; None: 1 GiB + 5 % of ``gpu_bytes``.
        host_reserve_bytes: host bytes kept free for the OS, Python and torch.
        chunk_numel, nvme_lookahead_chunks: HybridAdam's, for the pinned staging and NVMe
            read-ahead buffers (``chunk_numel=None``: HybridAdam's default for the offloaded
            elements, see :func:`tiermem.optim.partition.auto_chunk_numel`).
        grad_accumulation_steps: micro-batches per optimizer step: the time per step depends
            on it (``batch x seq x grad_accumulation_steps`` tokens), the memory only with
            ``breadth_first_blocks``.
        gpu_step_fraction: HybridAdam's share of the offloaded chunks the GPU steps (Note [gpu
            lane] in ``tiermem/optim/gpu_lane.py``), in [0, 1]: only the time per step
            depends on it (that share crosses PCIe as state both ways instead of being stepped
            by the CPU; :func:`step_time`); the lane's device slots are not in the memory.
        max_grad_norm: HybridAdam's gradient clipping norm (a number > 0), or None (no
            clipping): the time per step depends on it (with it the optimizer phase
            overlaps no backward: Note [optimizer tail]), and with ``rollback_bytes`` the
            memory (the rollback slots).
        rollback_bytes: HybridAdam's budget of pre-step copies for speculative clipping
            (Note [speculative step] in ``tiermem/optim/speculate.py``), bytes or ``"4GiB"``: with
            ``max_grad_norm`` or ``grad_scaler`` (streamed weights too: Note [streamed
            rollback]) its slots are counted, in host RAM and, for the GPU lane's share, on
            the GPU (:func:`~tiermem.apps.plan.memory.rollback_slot_bytes`); a plan they
            overflow names the field.
        grad_scaler: a ``torch.amp.GradScaler`` drives the steps (fp16 training): from the
            second step every offloaded chunk waits for its verdict or, within
            ``rollback_bytes``, steps speculatively into a rollback slot, also without
            ``max_grad_norm`` (Note [grad scaler overlap] in ``tiermem/optim/amp_scaling.py``):
            the slots are counted and the step timed as with clipping (Note [scaler verdict]
            in ``tiermem/apps/plan/timing.py``). No configuration field: HybridAdam finds the
            scaler at run time.
        param_sync: HybridAdam's, ``"step"`` or ``"forward"``: only the time per step depends
            on it (Note [optimizer tail]).
        breadth_first_blocks: blocks run for every micro-batch before the rest of the first
            (Note [breadth-first blocks]), 0 to ``n_layers``: each of the other
            ``grad_accumulation_steps - 1`` micro-batches keeps what those blocks saved plus
            its hidden state on the GPU (an item of its own), and with ``param_sync="forward"``
            the step time counts that forward beside the optimizer tail. ``"auto"``: the most
            blocks that still fit, after the fraction and tier are chosen (so with
            ``offload_fraction=None``, usually none).
        stream_weights: stream the blocks' weights (issue 29; Note [streaming plan] in
            ``tiermem/apps/plan/streaming.py``): True, False, or ``"auto"``: only when the plan with
            every weight on the GPU overflows the GPU (and neither ``gpu_step_fraction`` nor
            ``breadth_first_blocks`` is given: they are not planned with streamed weights).
            Streaming keeps the last blocks resident as far as the GPU holds them
            (``plan.stream``), the optimizer state of all params off the GPU unless
            ``offload_fraction`` is given, and the activations on the GPU unless they do not
            fit (``offload_layers``).
        stream_tier: the streamed weights' home: ``"cpu"`` (pinned RAM), ``"nvme"``, or
            ``"auto"``: RAM if the run fits so (the optimizer state may split RAM + NVMe
            first: a byte of state on NVMe costs one read and one write per step, a weight
            two reads and a write), else NVMe (which keeps a RAM host copy of each trained
            weight too: Note [streamed RAM count] in tiermem/apps/plan/streaming.py).
        prefetch_blocks: the stream's blocks fetched ahead (GPU buffers: this + 2).
        stream_schedule: ``"block-major"``, ``"depth-first"`` or ``"auto"`` (block-major; with
            one micro-batch the same as depth-first): the PCIe traffic per step and,
            block-major over several micro-batches, every micro-batch's block inputs at once
            and the recomputation (counted as checkpointing: ``plan.checkpoint`` is True).
        rates: :class:`MachineRates` the time per step is predicted from; None: the H200
            machine's.

    Returns:
        a :class:`Plan` (``plan.fits``, ``plan.table()``, ``plan.step_time``).

    Raises:
        ValueError: a missing or non-positive size, an unknown dtype, tier or param_sync,
            ``breadth_first_blocks`` above ``n_layers``, a fraction
            (``offload_fraction``, ``gpu_step_fraction``) outside [0, 1], ``max_grad_norm``
            not above 0 or nan, ``offload_layers`` outside [0, n_layers), an MoE shape given
            in part, ``top_k`` > ``n_experts``, or ``num_params`` not above the parameters of
            the experts a token skips, naming the argument; an unknown ``stream_weights``,
            ``stream_tier`` or ``stream_schedule``, a negative ``prefetch_blocks``, streaming
            with ``gpu_step_fraction`` > 0 or ``breadth_first_blocks`` > 0, or with
            ``num_params`` not above the weights outside the blocks.
        TypeError: ``num_params``/``model`` neither a number nor an ``nn.Module``; a count
            that is not an int, or a fraction or ``max_grad_norm`` that is not a number
            (naming the argument); ``rates`` not a :class:`MachineRates`; ``grad_scaler`` not
            a bool.
    """
    if model is not None and num_params is not None:
        raise TypeError("plan: pass num_params or model, not both")
    model = model if model is not None else (None if num_params is None or
                                             isinstance(num_params, (int, float)) else num_params)
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"plan: num_params must be a number or an nn.Module, got "
                            f"{type(model).__name__}")
        params = list(model.parameters())
        num_params = sum(p.numel() for p in params)
        if params and dtype is None:
            dtype = params[0].dtype  # the model's own dtype when none is given
        cfg = getattr(model, "cfg", None)
        if cfg is not None:
            n_layers = n_layers or getattr(cfg, "n_layers", None)
            d_model = d_model or getattr(cfg, "d_model", None)
            n_heads = n_heads or getattr(cfg, "n_heads", None)
            vocab = getattr(cfg, "vocab", vocab)
            mlp_ratio = getattr(cfg, "mlp_ratio", mlp_ratio)
            n_experts = n_experts or getattr(cfg, "n_experts", None)
            top_k = top_k or getattr(cfg, "top_k", None)
            d_expert = d_expert or getattr(cfg, "d_expert", None)
    moe = _moe_shape(n_experts, top_k, d_expert)
    if num_params is None and not moe:
        raise ValueError("plan: give the model size: num_params (e.g. 13e9), a model, or an MoE "
                         "shape (n_experts, top_k, d_expert)")
    if num_params is not None and (isinstance(num_params, bool) or not isinstance(
            num_params, (int, float)) or not num_params >= 1 or not math.isfinite(num_params)):
        raise ValueError(f"plan: num_params={num_params!r} must be a positive number")
    if n_layers is None or d_model is None:
        raise ValueError("plan: the activation estimate needs the shape: n_layers and d_model "
                         "(command line: --layers and --d-model, or --model-size)")
    n_layers = check_int("plan: ", "n_layers", n_layers)
    d_model = check_int("plan: ", "d_model", d_model)
    n_heads = check_int("plan: ", "n_heads", n_heads or max(1, d_model // 128))
    for name, value in (("vocab", vocab), ("seq", seq), ("batch", batch),
                        ("mlp_ratio", mlp_ratio)):
        check_int("plan: ", name, value)
    prefetch_depth = _field("prefetch_depth", prefetch_depth)
    grad_accumulation_steps = _field("grad_accumulation_steps", grad_accumulation_steps)
    checkpoint = _field("checkpoint", checkpoint)
    if rates is not None and not isinstance(rates, MachineRates):
        raise TypeError(f"plan: rates must be a tiermem.apps.plan.MachineRates, got "
                        f"{type(rates).__name__}")
    n = active = None if num_params is None else int(num_params)
    if moe:
        from tiermem.models.moe import MoEConfig  # torch is loaded with tiermem already
        # n_heads=1: heads do not change the count (and need not divide d_model here)
        cfg = MoEConfig(n_layers=n_layers, d_model=d_model, n_heads=1, seq_len=seq,
                        vocab=vocab, n_experts=n_experts, top_k=top_k, d_expert=d_expert)
        n = cfg.num_params() if n is None else n
        skipped = cfg.num_params() - cfg.active_params()  # the experts a token does not run
        if n <= skipped:
            raise ValueError(f"plan: num_params={num_params!r} is not above the {skipped:,} "
                             f"parameters of the experts a token skips (n_layers x (n_experts - "
                             f"top_k) experts of d_expert={d_expert}); give the total count, "
                             f"or check n_experts and d_expert")
        active = n - skipped
    chunk_numel = _field("chunk_numel", chunk_numel)
    nvme_lookahead_chunks = _field("nvme_lookahead_chunks", nvme_lookahead_chunks)
    # one spelling from here on: the canonical name (inputs, notes) and the torch.dtype (sizes)
    dtype = dtype_name("plan: ", "dtype", "bfloat16" if dtype is None else dtype, PARAM_DTYPES)
    moments_dtype = _field("moments_dtype", moments_dtype)
    param_dt, moments_dt = getattr(torch, dtype), getattr(torch, moments_dtype)
    p = param_dt.itemsize
    cap = {"gpu": _field("gpu_bytes", gpu_bytes), "host": _field("host_bytes", host_bytes),
           "nvme": _field("nvme_bytes", nvme_bytes)}
    if cap["gpu"] == 0:
        raise ValueError("gpu_bytes=0: the plan needs a GPU capacity")
    gpu_reserve = (GiB + cap["gpu"] // 20) if gpu_reserve_bytes is None else \
        _field("gpu_reserve_bytes", gpu_reserve_bytes)
    host_reserve = _field("host_reserve_bytes", host_reserve_bytes)
    offload_fraction = _field("offload_fraction", offload_fraction)  # None: the least that fits
    gpu_step_fraction = _field("gpu_step_fraction", gpu_step_fraction)
    max_grad_norm = _field("max_grad_norm", max_grad_norm)
    rollback_bytes = _field("rollback_bytes", rollback_bytes)
    if not isinstance(grad_scaler, bool):
        raise TypeError(f"plan: grad_scaler={grad_scaler!r} must be True (a torch.amp."
                        f"GradScaler drives the steps: fp16) or False (command line: "
                        f"--grad-scaler)")
    # Note [scaler verdict]: under clipping or a scaler the chunks wait or speculate alike
    waits = max_grad_norm is not None or grad_scaler
    param_sync = _field("param_sync", param_sync)
    breadth_first_blocks = _field("breadth_first_blocks", breadth_first_blocks)
    auto_blocks = breadth_first_blocks == "auto"
    if auto_blocks:
        breadth_first_blocks = 0  # the placement is chosen without them, then the most that fit
    if breadth_first_blocks > n_layers:
        raise ValueError(f"plan: breadth_first_blocks={breadth_first_blocks} exceeds "
                         f"n_layers={n_layers}; give 0 (depth-first) to {n_layers}")
    check_stream_args(stream_weights, stream_tier, stream_schedule, prefetch_blocks,
                      gpu_step_fraction=gpu_step_fraction,
                      breadth_first_blocks="auto" if auto_blocks else breadth_first_blocks)
    schedule = schedule_for(stream_schedule, grad_accumulation_steps)
    outside = non_block_params(vocab=vocab, seq=seq, d_model=d_model)
    if stream_weights is not False and n - outside < n_layers:
        raise ValueError(f"plan: num_params={n:,} is not above the {outside:,} params outside "
                         f"the blocks (embeddings, head) plus one per block: nothing to stream; "
                         f"check num_params, vocab and d_model")
    block_params = (n - outside) // n_layers
    if state_tier != "auto":  # auto: RAM if it fits, else split
        state_tier = _field("state_tier", state_tier)
    activation_tier = _field("activation_tier", activation_tier)
    if offload_layers is not None and (isinstance(offload_layers, bool) or not isinstance(
            offload_layers, int) or not 0 <= offload_layers < n_layers):
        raise ValueError(f"offload_layers={offload_layers!r} must be an int in [0, {n_layers}) "
                         f"(the last block's activations stay on the GPU)")
    offload_layers = _field("offload_layers", offload_layers)  # and as the field says

    shape = dict(batch=batch, seq=seq, d_model=d_model, dtype_bytes=p)
    if moe:
        per_block = moe_activation_bytes_per_block(**shape, n_heads=n_heads, top_k=top_k,
                                                   d_expert=d_expert,
                                                   eager_attention=eager_attention)
    else:
        per_block = activation_bytes_per_block(**shape, n_heads=n_heads, mlp_ratio=mlp_ratio,
                                               eager_attention=eager_attention)
    block_input = batch * seq * d_model * p
    head = head_bytes(**shape, vocab=vocab)
    gpu_state_per_param = gpu_side_state_bytes(1, param_dt, moments_dt)  # 12 or 8 (bf16 params)
    off_state_per_param = 4 * state_numel(1, moments_dt)  # fp32 master + moments: 12 or 8
    inputs = dict(num_params=n, n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab=vocab,
                  seq=seq, batch=batch, grad_accumulation_steps=grad_accumulation_steps,
                  gpu_step_fraction=gpu_step_fraction, max_grad_norm=max_grad_norm,
                  param_sync=param_sync, rollback_bytes=rollback_bytes, grad_scaler=grad_scaler,
                  breadth_first_blocks="auto" if auto_blocks else breadth_first_blocks,
                  n_experts=n_experts, top_k=top_k, d_expert=d_expert,
                  dtype=dtype, moments_dtype=moments_dtype,
                  checkpoint=checkpoint, activation_tier=activation_tier,
                  prefetch_depth=prefetch_depth, gpu_reserve_bytes=gpu_reserve,
                  host_reserve_bytes=host_reserve, stream_weights=stream_weights,
                  stream_tier=stream_tier, prefetch_blocks=prefetch_blocks,
                  stream_schedule=stream_schedule)

    def build(f: float, tier: str, k: int, bf: int = breadth_first_blocks,
              home: str | None = None) -> Plan:
        # Note [streaming plan]: block-major keeps every micro-batch's block inputs at once and
        # recomputes each block in the backward (as checkpointing does)
        mb = grad_accumulation_steps if home and schedule == "block-major" else 1
        ck = checkpoint or mb > 1
        kept_per_block = block_input if ck else per_block
        off_n = round(f * n)
        gpu_n = n - off_n
        items = [Item("parameters", gpu=n * p, note=short_dtype(dtype)),
                 Item("gradients", gpu=n * p, note=short_dtype(dtype))]
        items.append(Item("optimizer state, GPU side",
                          gpu=gpu_side_state_bytes(gpu_n, param_dt, moments_dt),
                          note=f"{gpu_state_per_param} B/param ("
                               f"{'fp32 master + ' if param_dt != torch.float32 else ''}"
                               f"{short_dtype(moments_dtype)} moments)"))
        state = off_n * off_state_per_param
        state_item = Item("optimizer state, offloaded",
                          host=state if tier == "cpu" else 0, nvme=state if tier == "nvme" else 0,
                          note=f"{off_state_per_param} B/param (fp32 master + "
                               f"{short_dtype(moments_dtype)} moments)" if off_n else "")
        items.append(state_item)
        rings, staging = host_buffer_bytes(off_n, chunk_numel, param_dt, moments_dt,
                                           nvme_lookahead_chunks, tier)
        if rings:
            items.append(Item("pinned staging (grads + params)", host=rings,
                              note=f"{GRAD_SLOTS} + {OUT_SLOTS} chunks"))
        if staging:
            items.append(Item("NVMe read-ahead buffers", host=staging,
                              note=f"{nvme_lookahead_chunks}+{NVME_EXTRA_CHUNKS} chunks"))
        if off_n and gpu_step_fraction > 0:  # Note [gpu lane]: device slots, not the state
            items.append(Item("GPU lane slots",
                              gpu=lane_slot_bytes(largest_chunk(off_n, chunk_numel), moments_dt),
                              note=f"{LANE_SLOTS} chunks of state + fp32 grads"))
        # streamed weights' chunks speculate too (Note [streamed rollback]: "local+stream" is
        # a speculating and a scaler mode), from the same slots
        spec = (0, 0) if not waits else rollback_slot_bytes(
            off_n, chunk_numel, moments_dt, rollback_bytes, gpu_step_fraction)
        if any(spec):  # Note [speculative step]: the chunks' pre-step copies
            per = 4 * state_numel(largest_chunk(off_n, chunk_numel), moments_dt)
            items.append(Item(ROLLBACK_ITEM, host=spec[0], gpu=spec[1],
                              note=f"{sum(spec) // per} chunks' state (rollback_bytes)"
                                   + (f", {spec[1] // per} on the GPU lane" if spec[1] else "")))
        on_gpu_blocks = n_layers - k
        window = min(k, prefetch_depth + 1)
        act = Item("activations",
                   gpu=on_gpu_blocks * kept_per_block * mb + window * kept_per_block,
                   note=f"{kept_per_block / GiB:.2f} GiB/block"
                        f"{' (checkpointed)' if checkpoint else ''}"
                        f"{' (inputs: block-major recomputes)' if ck and not checkpoint else ''}"
                        f" x {on_gpu_blocks} blocks"
                        + (f" x {mb} micro-batches (block-major)" if mb > 1 else "")
                        + (f" + {window} reloading" if k else ""))
        if ck:
            act.gpu += per_block  # the block being recomputed in backward
            act.note += " + 1 recomputed"
        if mb > 1:  # the gradients flowing down between blocks, one per micro-batch
            act.gpu += mb * block_input
            act.note += f" + {mb} micro-batches' gradients"
        if k:
            setattr(act, "host" if activation_tier == "cpu" else "nvme", k * kept_per_block * mb)
            act.note += f"; {k} blocks offloaded to {activation_tier}"
        items.append(act)
        if bf and grad_accumulation_steps > 1:  # Note [breadth-first blocks]
            waiting = grad_accumulation_steps - 1
            items.append(Item("breadth-first block inputs",
                              gpu=waiting * (bf * kept_per_block + block_input),
                              note=f"{waiting} micro-batches x ({bf} blocks' saved + 1 hidden)"))
        items.append(Item("head + loss", gpu=head, note="logits, fp32 log-softmax, grads"))
        items.append(Item("reserve", gpu=gpu_reserve, host=host_reserve,
                          note="CUDA context/workspace/fragmentation; OS + Python"))
        stream = problem = None
        if home is not None:  # Note [streaming plan]
            # the store pages of a block, its gradients pinned: Note [pinned rounding]
            numels = block_numels(d_model=d_model, mlp_ratio=mlp_ratio,
                                  n_experts=n_experts if moe else None, d_expert=d_expert)
            stream, problem = place_stream(
                items, cap_gpu=cap["gpu"], n_layers=n_layers, block_params=block_params,
                param_bytes=p, prefetch_blocks=prefetch_blocks, tier=home, schedule=schedule,
                micro_batches=grad_accumulation_steps, gpu_state_params=gpu_n,
                block_pages=block_store_bytes(block_params, p, numels),
                block_grads_pinned=block_pinned_bytes(block_params, p, numels))
        if tier == "split":  # HybridAdam state_tier="split": RAM first, the rest on NVMe
            host_free = cap["host"] - sum(i.host for i in items)
            state_item.host = max(0, min(state, host_free))
            state_item.nvme = state - state_item.host
            state_item.note += f"; {state_item.host / max(state, 1):.0%} in RAM, rest on NVMe"
        used = {t: sum(getattr(i, t) for i in items) for t in ("gpu", "host", "nvme")}
        reasons = [f"{t} needs {used[t] / GiB:,.1f} GiB, has {cap[t] / GiB:,.1f} GiB "
                   f"(over by {(used[t] - cap[t]) / GiB:,.1f} GiB)"
                   for t in ("gpu", "host", "nvme") if used[t] > cap[t]]
        for t, held in (("gpu", spec[1]), ("host", spec[0])):  # name the field
            if held and used[t] > cap[t]:
                reasons = [r + (f"; optimizer.rollback_bytes={rollback_bytes} holds "
                                f"{held / GiB:,.1f} GiB of it (speculative step): lower it, or "
                                f"0 to wait for {waits_for(max_grad_norm, grad_scaler)}"
                                if r.startswith(t) else "")
                           for r in reasons]
        if stream is not None and used["gpu"] > cap["gpu"]:  # name what does not fit
            fixes = [("checkpointing (--checkpoint)", not checkpoint),
                     ("a smaller micro-batch (--batch) or shorter sequences", True),
                     ("--prefetch-blocks 0 (2 buffers)", prefetch_blocks > 0),
                     ("offloaded activations (--offload-layers)", not k),
                     ("a larger --gpu-bytes", True)]
            reasons[0] += (f": {gpu_breakdown(items)}; fix: "
                           + ", ".join(fix for fix, useful in fixes if useful))
        if problem:
            reasons.append(problem)
        return Plan(n, active, not reasons, f, tier, k, ck, items, dict(cap), used,
                    reasons, inputs=inputs, breadth_first_blocks=bf, stream=stream)

    def gpu_fixed(k: int) -> int:
        return build(1.0, "cpu", k).used["gpu"]

    def min_fraction(k: int) -> float:
        room = cap["gpu"] - gpu_fixed(k)
        if room >= n * gpu_state_per_param:
            return 0.0
        f = math.ceil((1.0 - room / (n * gpu_state_per_param)) * 100) / 100
        return f  # > 1 when even full offload does not fit

    layer_options = [offload_layers] if offload_layers is not None else \
        sorted({0, n_layers - 1})
    tiers = ["cpu", "split"] if state_tier == "auto" else [state_tier]  # split beats all-nvme
    best: Plan | None = None
    for k in layer_options:
        f = offload_fraction if offload_fraction is not None else min(1.0, min_fraction(k))
        for tier in tiers:
            candidate = build(f, tier, k)
            if candidate.fits:
                best = candidate
                break
            if best is None or overflow(candidate) < overflow(best):
                best = candidate  # the nearest miss: GPU fitting first, then least overflow
        if best is not None and best.fits:
            break
    assert best is not None
    if stream_weights is True or (stream_weights == "auto" and best.used["gpu"] > cap["gpu"]
                                  and not gpu_step_fraction and not breadth_first_blocks):
        best = _best_stream(build, offload_fraction, layer_options, tiers,
                            ["cpu", "nvme"] if stream_tier == "auto" else [stream_tier])
    if auto_blocks and best.fits and best.stream is None:  # the most blocks that still fit
        best = next((c for c in (build(best.offload_fraction, best.state_tier,
                                       best.offload_layers, bf)
                                 for bf in range(n_layers, 0, -1)) if c.fits), best)
    state_item = next(i for i in best.items if i.name == "optimizer state, offloaded")
    off_n = round(best.offload_fraction * n)
    chunk = largest_chunk(off_n, chunk_numel)
    st = best.stream
    if st is not None and st.streamed_params > off_n:  # no run steps these weights: no time
        add_notes(best, n, cap, host_reserve, param_dt, moments_dtype,
                  dict(chunk_numel=chunk_numel, nvme_lookahead_chunks=nvme_lookahead_chunks))
        return best
    best.step_time = step_time(
        active_params=active, offloaded_params=off_n, param_bytes=p,
        moments_dtype=moments_dtype, checkpoint=best.checkpoint, micro_batch_tokens=batch * seq,
        grad_accumulation_steps=grad_accumulation_steps, nvme_state_bytes=state_item.nvme,
        activation_offload_bytes=best.offload_layers * (block_input if best.checkpoint
                                                        else per_block),
        activation_tier=activation_tier, gpu_step_fraction=gpu_step_fraction,
        max_grad_norm=max_grad_norm, offloaded_chunks=-(-off_n // chunk) if chunk else 0,
        speculated_chunks=0 if not waits else rollback_slots(
            off_n, chunk_numel, moments_dt, rollback_bytes),  # as the memory counts them
        param_sync=param_sync, breadth_first_blocks=best.breadth_first_blocks,
        n_layers=n_layers, streamed_bytes=st.streamed_bytes if st else 0,
        stream_kept_bytes=st.kept_bytes if st else 0, stream_schedule=schedule,
        stream_tier=st.tier if st else "cpu", grad_scaler=grad_scaler, rates=rates)
    add_notes(best, n, cap, host_reserve, param_dt, moments_dtype,
               dict(chunk_numel=chunk_numel, nvme_lookahead_chunks=nvme_lookahead_chunks))
    return best


def _best_stream(build, offload_fraction, layer_options, tiers, homes) -> Plan:
    """The first streaming placement that fits (Note [streaming plan]), trying activations on
    the GPU before offloaded ones, the weights in RAM before on NVMe, and the state in RAM
    before split; else the nearest miss. All optimizer state is offloaded unless
    ``offload_fraction`` is given.

    Raises:
        nothing: ``build`` validated its inputs.
    """
    f = 1.0 if offload_fraction is None else offload_fraction
    best: Plan | None = None
    for k in layer_options:
        for home in homes:
            for tier in tiers:
                candidate = build(f, tier, k, 0, home)
                if candidate.fits:
                    return candidate
                if best is None or overflow(candidate) < overflow(best):
                    best = candidate
    assert best is not None
    return best


def breadth_first_note(result: Plan, num_params, kw: dict) -> str | None:
    """With ``max_grad_norm`` and micro-batches, when the run does not already use it: what
    ``param_sync="forward"`` with ``breadth_first_blocks="auto"`` would predict, as a note for
    :attr:`Plan.notes` (None: nothing to add, or it would not fit or not be faster).
    ``result`` is ``plan(num_params, **kw)``.

    Raises:
        ValueError, TypeError: what :func:`plan` raises for these inputs.
    """
    st = result.step_time
    if (not result.fits or st is None or st.max_grad_norm is None or result.offload_fraction == 0
            or kw["grad_accumulation_steps"] < 2
            or (st.param_sync == "forward" and st.breadth_first_blocks)):
        return None
    alt = plan(num_params, **{**kw, "param_sync": "forward", "breadth_first_blocks": "auto",
                              "offload_fraction": result.offload_fraction})
    ast = alt.step_time
    if not alt.fits or ast is None or not alt.breadth_first_blocks \
            or ast.overlapped_s >= st.overlapped_s:
        return None
    return (f"faster: --param-sync forward --breadth-first-blocks auto (one process): the first "
            f"{alt.breadth_first_blocks} blocks of every micro-batch run before the rest, so "
            f"{ast.forward_overlap_s:.2f} s of the next forward runs beside the optimizer's "
            f"tail: predicted {ast.overlapped_s:.2f} s (floor) instead of {st.overlapped_s:.2f}"
            f" s, the same gradients (Note [breadth-first blocks] in "
            f"tiermem/schedule/micro_batches.py)")
