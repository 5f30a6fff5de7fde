"""The memory model of :func:`tiermem.apps.plan.plan`: what each part of the training state takes,
in
bytes, and where it goes; the activation formulas; the pinned buffers HybridAdam adds.

Memory model (bytes; N parameters, L blocks, width d, heads h, vocabulary V, sequence s,
micro-batch b, parameter dtype size p (bf16: 2, fp32: 4), activation dtype size a = p, moments
dtype size m (fp32: 4, bf16: 2; HybridAdam's ``moments_dtype``, on the GPU side and the
offloaded side alike), offload fraction f, offloaded layers k, c elements in the largest
offloaded chunk, ``min(chunk_numel, f·N)``). The optimizer state is sized by
:mod:`tiermem.optim.layout`, the functions HybridAdam allocates and counts by
(``layout.gpu_side_state_bytes``; :func:`host_buffer_bytes` calls the others); its pinned
buffers are rounded up to the store's 4 KiB blocks as in the store:

==========================  ==============================================================
part                        bytes and place
==========================  ==============================================================
parameters                  N·p on the GPU
gradients                   N·p on the GPU (``param.grad`` in the model dtype)
GPU-side optimizer state    (1-f)·N·(2·m + 4·[p != 4]): both moments in the moments dtype,
                            plus an fp32 master copy unless the params are fp32 already (they
                            are their own master): ``layout.gpu_side_state_bytes``; 12 B/param
                            for bf16 params with fp32 moments, 8 with bf16 moments
offloaded optimizer state   f·N·(4 + 2·m): fp32 master + moments, in pinned RAM
                            (``state_tier="cpu"``), in spill files (``"nvme"``), or RAM first
                            and the rest in spill files (``"split"``); per param
                            ``4·state_numel(1, moments)``, not counting the store's rounding
                            of each chunk's blob to 4 KiB
staging buffers             ``layout.ring_bytes(c, p)`` ≈ 6·c·p pinned RAM: HybridAdam's
                            2-chunk gradient ring and 4-chunk param-out ring (gradients wait
                            on the GPU until copied)
NVMe read-ahead             ``layout.nvme_staging_bytes(c, moments, lookahead)`` ≈
                            (lookahead+3)·c·(4 + 2·m) pinned RAM (``chunk_state_bytes`` per
                            chunk), with ``state_tier`` ``"nvme"`` and ``"split"``
GPU lane slots              ``layout.lane_slot_bytes(c, moments)`` = 3·4·c·(3 or 2, +1) on the
                            GPU with ``gpu_step_fraction`` > 0: three chunks of fp32 state and
                            fp32 gradients (Note [gpu lane])
rollback copies             with ``max_grad_norm`` or a GradScaler and ``rollback_bytes`` R
                            (speculative step, streamed weights too): n = min(chunks,
                            R // chunk_state_bytes(c, m)) slots of 4·c·(3 or 2) bytes;
                            int(n·g) of them on the GPU for the GPU lane's
                            share g (Note [lane rollback on the GPU]), the rest in host RAM
                            (:func:`rollback_slot_bytes`)
activations, one block      A = b·s·d·a·(9 + 2·r) for the pre-LN GPT block with an MLP ratio
                            r (4: 17·b·s·d·a, 34·b·s·d in bf16 = Megatron's sbh·34 with
                            flash attention): block input, LN1 out, QKV (3), attention out,
                            its reshaped copy, residual, LN2 out, FC out (r), GELU out (r).
                            ``eager_attention`` adds the softmax probabilities 2·b·h·s²·a.
                            Measured: Note [block activations, measured].
MoE block                   A = b·s·[d·a·(9 + 2·K) + 2·K·e·a + K·(28 + a)] for
                            ``tiermem.models.moe``'s block, top_k K, expert width e: the
                            9 above, then per token K copies of the expert input and output
                            (d each) and of the hidden layer before and after the GELU (e
                            each), the gates (a each), the top-k indices, the argsort order
                            and the token index (int64: 8 each) and the fp32 router softmax
                            (4); not the number of experts, nor how the tokens spread over
                            them. Measured: Note [block activations, measured].
checkpointing               a block keeps only its input b·s·d·a; one block's A is rebuilt
                            at a time in backward
activation placement        L-k blocks on the GPU; k blocks in the host tier (pinned; or
                            NVMe), of which prefetch_depth+1 blocks are back on the GPU at
                            a time during backward
head and loss               b·s·(2·d·a + V·(2·a + 8)): final-LN in/out, logits, the fp32
                            log-softmax the loss saves, the logits' gradients in backward
GPU reserve                 CUDA context, cuBLAS workspace, allocator fragmentation:
                            ``gpu_reserve_bytes`` (default 1 GiB + 5 % of the GPU)
host reserve                OS, Python, torch, page cache: ``host_reserve_bytes`` (8 GiB)
==========================  ==============================================================

Checked against the reference 1.34B GPT (micro-batch 8 x 2048 tokens, bf16, fp32 masters and
fused AdamW all on the GPU): the model gives 51.5 GiB without the reserve; the H200 measured a
48.6 GiB peak (``docs/results/bench_optim.log``, the GPU-only row at 16384 tokens/step; one run,
docs/benchmarks_archive.md), so the plan errs on the safe side by 6 %.

Note [block activations, measured]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Both block formulas share their attention part, 9·d·a per token, and so share its known gaps,
which tests/test_plan.py measures exactly (autograd's saved tensors, each storage once, of one
real block forward on the CPU with its fused SDPA kernel): the fused kernels return the attention
output already laid out as (b, s, h, d/h), so the "reshaped copy" is a view and is not saved
(d·a per token fewer), while LayerNorm's mean and rstd (two per LN: fp32 on CUDA, dtype a on
the CPU) and SDPA's fp32 logsumexp (4·h) are saved but not counted. On CUDA the formulas thus
exceed what a block with fused attention saves by d·a - 16 - 4·h bytes per token (4016 for the
reference GPT: bf16, d = 2048, h = 16; 5.8 % of its block), on the safe side.
"""

from __future__ import annotations

from tiermem.names import DTYPE_SPELLINGS, MODEL_DTYPES
from tiermem.optim.layout import chunk_state_bytes, nvme_staging_bytes, ring_bytes, state_numel
from tiermem.optim.partition import auto_chunk_numel

PARAM_DTYPES = MODEL_DTYPES + ("float16",)
"""Parameter dtypes the plan sizes (canonical names): the training loops' and float16 (2 bytes,
sized like bfloat16). Any spelling of :data:`tiermem.names.DTYPE_SPELLINGS` is accepted."""


def short_dtype(name: str) -> str:
    """The short spelling the plan prints for a canonical dtype name (``"bfloat16"`` -> ``"bf16"``):
    the shortest of :data:`tiermem.names.DTYPE_SPELLINGS`."""
    return min((s for s, canon in DTYPE_SPELLINGS.items() if canon == name), key=len)


def largest_chunk(offloaded_numel: int, chunk_numel: int | None) -> int:
    """Elements of HybridAdam's largest offloaded chunk: ``min(chunk_numel, offloaded_numel)``,
    ``chunk_numel`` None meaning :func:`tiermem.optim.partition.auto_chunk_numel` (0: nothing
    offloaded)."""
    if not offloaded_numel:
        return 0
    return min(chunk_numel or auto_chunk_numel(offloaded_numel), offloaded_numel)


def rollback_slot_bytes(offloaded_numel: int, chunk_numel: int | None, moments_dtype,
                        rollback_bytes: int, gpu_step_fraction: float) -> tuple[int, int]:
    """``(host RAM, GPU)`` bytes of HybridAdam's rollback slots (Note [speculative step] and
    Note [lane rollback on the GPU] in ``tiermem/optim/speculate.py``) for ``offloaded_numel``
    elements in one param group: ``min(chunks, rollback_bytes // chunk_state_bytes)`` slots of
    one largest chunk's fp32 state blob each; ``int(slots x gpu_step_fraction)`` of them on the
    GPU (the lane's chunks are spread evenly over the speculating order, so that many are
    among the first ``slots`` chunks it admits), the rest in host RAM. (0, 0) without
    offloaded elements or budget; the caller counts them only where the step speculates (with
    ``max_grad_norm`` or under a GradScaler: ``Speculation._alloc`` sizes them alike either way,
    streamed weights included).

    Raises:
        Nothing: plain arithmetic on checked values.
    """
    n = rollback_slots(offloaded_numel, chunk_numel, moments_dtype, rollback_bytes)
    if not n:
        return 0, 0
    n_gpu = int(n * gpu_step_fraction)
    per = 4 * state_numel(largest_chunk(offloaded_numel, chunk_numel), moments_dtype)
    return (n - n_gpu) * per, n_gpu * per


def rollback_slots(offloaded_numel: int, chunk_numel: int | None, moments_dtype,
                   rollback_bytes: int) -> int:
    """HybridAdam's rollback slots for ``offloaded_numel`` elements in one param group: the
    chunks a step can speculate on (``min(chunks, rollback_bytes // chunk_state_bytes)``, the
    first that many in backward order; Note [speculative step]); 0 without either.

    Raises:
        Nothing: plain arithmetic on checked values.
    """
    if not offloaded_numel or not rollback_bytes:
        return 0
    chunk = largest_chunk(offloaded_numel, chunk_numel)
    return min(-(-offloaded_numel // chunk), rollback_bytes // chunk_state_bytes(chunk,
                                                                                  moments_dtype))


def host_buffer_bytes(offloaded_numel: int, chunk_numel: int | None, dtype, moments_dtype,
                      nvme_lookahead_chunks: int, state_tier: str) -> tuple[int, int]:
    """``(pinned rings, NVMe staging)``: the pinned host bytes HybridAdam allocates besides the
    offloaded state for ``offloaded_numel`` elements in one param group, by
    :func:`tiermem.optim.layout.ring_bytes` and :func:`~tiermem.optim.layout.nvme_staging_bytes`
    (staging with ``state_tier`` ``"nvme"`` or ``"split"`` only, else 0).

    Args:
        offloaded_numel: elements whose state is offloaded (0: no buffers).
        chunk_numel: HybridAdam's ``chunk_numel``; None: its default,
            :func:`tiermem.optim.partition.auto_chunk_numel`. The buffers are sized by the
            largest chunk, ``min(chunk_numel, offloaded_numel)``.
        dtype, moments_dtype: ``torch.dtype`` of the params and of the moments.
        nvme_lookahead_chunks: HybridAdam's.
        state_tier: ``"cpu"``, ``"nvme"`` or ``"split"``.

    Raises:
        Nothing: plain arithmetic on checked values.
    """
    if not offloaded_numel:
        return 0, 0
    chunk = largest_chunk(offloaded_numel, chunk_numel)
    rings = ring_bytes(chunk, dtype.itemsize)
    staging = nvme_staging_bytes(chunk, moments_dtype, nvme_lookahead_chunks) \
        if state_tier in ("nvme", "split") else 0
    return rings, staging


def _attention_bytes(*, batch: int, seq: int, d_model: int, n_heads: int, dtype_bytes: int,
                     eager_attention: bool) -> int:
    """Bytes a pre-LN block saves outside its MLP: ``9·b·s·d·a`` (+ the eager softmax)."""
    n = batch * seq * d_model * dtype_bytes * 9
    if eager_attention:
        n += 2 * batch * n_heads * seq * seq * dtype_bytes
    return n


def activation_bytes_per_block(*, batch: int, seq: int, d_model: int, n_heads: int,
                               dtype_bytes: int, mlp_ratio: int = 4,
                               eager_attention: bool = False) -> int:
    """Bytes autograd saves for one pre-LN GPT block (see the module's table).

    ``b·s·d·a·(9 + 2·mlp_ratio)``, plus ``2·b·h·s²·a`` for the softmax of eager attention
    (Note [block activations, measured] says how it compares with what a block saves).
    Arguments: sequences, tokens per sequence, width, heads, bytes per activation element,
    MLP width / d_model, whether attention saves its softmax.

    Raises:
        nothing: plain arithmetic on the given ints (:func:`plan` validates them).
    """
    mlp = batch * seq * d_model * dtype_bytes * 2 * mlp_ratio  # FC out, GELU out
    return _attention_bytes(batch=batch, seq=seq, d_model=d_model, n_heads=n_heads,
                            dtype_bytes=dtype_bytes, eager_attention=eager_attention) + mlp


def moe_activation_bytes_per_block(*, batch: int, seq: int, d_model: int, n_heads: int,
                                   dtype_bytes: int, top_k: int, d_expert: int,
                                   eager_attention: bool = False) -> int:
    """Bytes autograd saves for one block of :mod:`tiermem.models.moe` (see the module's table).

    ``b·s·[d·a·(9 + 2·K) + 2·K·e·a + K·(28 + a)]`` for ``K = top_k``, ``e = d_expert``, plus
    ``2·b·h·s²·a`` for the softmax of eager attention: the dense block's attention part, then
    per token and chosen expert the expert's input and output (``d`` each), its hidden layer
    before and after the GELU (``e`` each), the gate (``a``), the top-k index, the argsort
    order and the token index (int64) and the fp32 router probability. The number of experts
    does not enter: each token runs ``top_k`` of them.
    Measured: Note [block activations, measured].

    Raises:
        nothing: plain arithmetic on the given ints (:func:`plan` validates them).
    """
    tokens, a, k = batch * seq, dtype_bytes, top_k
    experts = tokens * (2 * k * d_model * a + 2 * k * d_expert * a + k * (8 + 8 + 8 + 4 + a))
    return _attention_bytes(batch=batch, seq=seq, d_model=d_model, n_heads=n_heads,
                            dtype_bytes=dtype_bytes, eager_attention=eager_attention) + experts


def head_bytes(*, batch: int, seq: int, d_model: int, vocab: int, dtype_bytes: int) -> int:
    """Bytes of the head and loss: ``b·s·(2·d·a + V·(2·a + 8))`` (see the module's table)."""
    return batch * seq * (2 * d_model * dtype_bytes + vocab * (2 * dtype_bytes + 8))
