"""DeepSpeed in one process, for the benches that put a DeepSpeed row beside tiermem's
(examples/bench_zero3.py, examples/bench_hf_trainer.py): the import and why it failed, the
environment a world of one needs, and the JIT build of ``DeepSpeedCPUAdam`` before the timed runs.

DeepSpeed is optional: nothing here imports it at module level, and every caller turns a failed
import or build into a row that says why it did not run.

Note [bench hf ZeRO-2 optimizer]: with ``offload_optimizer`` on cpu (and DeepSpeed's default
``zero_force_ds_cpu_optimizer``), Accelerate's ``prepare`` replaces whatever optimizer Trainer
built by ``DeepSpeedCPUAdam(optimizer.param_groups, lr=, weight_decay=, adamw_mode=...)``
(``map_pytorch_optim_to_deepspeed``), ``adamw_mode=True`` only when the optimizer it replaces is
a ``torch.optim.AdamW``. So the ZeRO-2 row leaves Trainer's own AdamW (``optim=
"adamw_torch_fused"``, as the AdamW row): its weight decay groups, betas and eps reach
DeepSpeedCPUAdam through the groups, in AdamW mode. A ``DeepSpeedCPUAdam`` handed to Trainer
(``optimizer_cls_and_kwargs``, ``adamw_mode=True``) is rebuilt in Adam mode (L2 decay through
the moments): on a tiny Llama its losses leave AdamW's by 1e-3 from the first step with a
non-zero learning rate (tests/integrations/test_bench_hf_zero2.py shows the bench's parity
column catches that).

Note [bench hf ZeRO-2 precision]: the other Trainer rows keep fp32 weights and run forward and
loss under bf16 autocast (``bf16=True``). With DeepSpeed, ``bf16=True`` makes Accelerate write
``bf16.enabled`` into the DeepSpeed config: bf16 weights and gradients, another arithmetic. The
ZeRO-2 row therefore sets ``bf16=False`` and asks DeepSpeed's ``torch_autocast`` section for
bf16 (its engine runs the forward, the loss included, under ``torch.autocast``) over fp32
weights, with ``lower_precision_safe_modules`` empty so that no gradient is reduced in bf16:
the same arithmetic as the other rows. On the CPU the rows run in fp32 and so does this one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from types import ModuleType
from typing import Iterator

#: the variables a one-process ``torch.distributed`` / DeepSpeed launch reads (``env://``)
_ONE_PROCESS = (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                ("WORLD_SIZE", "1"))


def import_deepspeed() -> tuple[ModuleType | None, str]:
    """``(deepspeed, "")``, or ``(None, "<exception type>: <message>")`` when the import fails
    (any exception: a missing dependency or a broken build is as much a reason as a missing
    package).

    Raises:
        Nothing.
    """
    try:
        import deepspeed  # noqa: PLC0415  (optional)
    except Exception as exc:  # noqa: BLE001  (the caller's row says why)
        return None, f"{type(exc).__name__}: {exc}"
    return deepspeed, ""


def set_single_process_env() -> dict[str, str | None]:
    """Set what a world of one process needs and is not set yet: ``MASTER_ADDR`` 127.0.0.1, a
    free ``MASTER_PORT``, ``RANK`` / ``LOCAL_RANK`` 0, ``WORLD_SIZE`` 1 (DeepSpeed's engine also
    asserts that ``LOCAL_RANK`` is set). Returns the previous values of the variables it set
    (None: was unset).

    Raises:
        OSError: no free local port could be bound.
    """
    before: dict[str, str | None] = {}
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            before["MASTER_PORT"] = None
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in _ONE_PROCESS:
        if key not in os.environ:
            before[key] = None
            os.environ[key] = value
    return before


@contextlib.contextmanager
def single_process_env() -> Iterator[None]:
    """:func:`set_single_process_env` for the block; at its end the environment is put back as
    it was before, every variable the block set or changed included (Accelerate sets
    ``ACCELERATE_USE_DEEPSPEED`` and ``LOCAL_WORLD_SIZE`` for good when it prepares DeepSpeed:
    left set, the next plain Trainer would take the DeepSpeed or the DDP path).

    Raises:
        OSError: as :func:`set_single_process_env`.
    """
    saved = dict(os.environ)
    set_single_process_env()
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def build_cpu_adam() -> float:
    """JIT-build (or load from the torch extensions cache) DeepSpeed's ``cpu_adam`` op, the
    kernel of ``DeepSpeedCPUAdam``, so that no timed run pays for it (~1 min the first time on
    a 16-core host, ~3 min on 2 cores). Returns the seconds it took.

    Raises:
        ImportError: deepspeed is not importable.
        Exception: the build failed (no compiler, no ninja, no CUDA_HOME for a CUDA torch):
            whatever DeepSpeed's op builder raises.
    """
    from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: PLC0415  (optional)
    t0 = time.perf_counter()
    CPUAdamBuilder().load()
    return time.perf_counter() - t0
