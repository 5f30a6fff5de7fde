"""Train a GPT larger than GPU-only training allows on one machine (issue 10).

Plans first (``tiermem.apps.plan.plan``) and exits 1 with the planner's reasons if the run does not
fit the given budgets; then builds the model on the meta device, materialises it module by
module in ``train.dtype`` on the GPU (bf16 in the presets; never a dense fp32 copy), keeps fp32
masters and the moments (``optimizer.moments_dtype``, on the GPU side too) of the first
``1 - offload_fraction`` on the GPU and the rest in a TierStore (pinned RAM, NVMe, or split),
checkpoints every block (``train.checkpoint``), accumulates gradients over the micro-batches
with the first ``train.breadth_first_blocks`` blocks breadth-first
(:func:`tiermem.schedule.micro_batches.forward_backward`; ``auto``: the most the plan fits), and
prints per step: loss, tokens/s, model TFLOP/s (6·N·tokens/s), per-tier bytes and a breakdown:
GPU forward + backward (CUDA events from the first forward to the last backward; with
``param_sync: forward`` this includes the waits for the previous step's CPU-side params), PCIe
bytes, CPU Adam seconds, NVMe read/write bytes and the stall (``step()`` waiting for the CPU
side; ~0 with ``param_sync: forward``, whose waits fall in the next forward). A step's time runs
from its start to the next step's start (the last: to the end of its optimizer work), so a
step's line is printed after the next step's backward. After the last step it prints one block:
the measured time split of a step (median of the steps after the first) beside the plan's
predicted time per step (``tiermem.apps.plan.StepTime``; docs/sizing.md, "Time per step").

    python examples/train_large.py --config examples/configs/large/h200_13b_nvme.yaml [--dry-run]
    python examples/train_large.py --config examples/configs/large/h200_13b_nvme.yaml --tiny  # CPU smoke
    python examples/train_large.py --config examples/configs/large/h200_13b_nvme.yaml \\
        optimizer.offload_fraction=0.9 train.grad_accumulation_steps=8 --dry-run

The preset is read by the config classes (:data:`SECTIONS`; the YAML dialect of
docs/configuration.md, shared with ``tiermem demo``): ``model`` (GPTConfig), ``train``
(TrainConfig: the fields in :data:`LOOP_FIELDS`), ``budgets`` (BudgetConfig, the planner's
capacities), ``store`` (StoreConfig; its device follows ``train.device``), ``optimizer``
(OptimizerConfig: HybridAdam's arguments) and, optional, ``streaming`` (StreamingConfig: weight
streaming of the blocks, docs/streaming.md). Unknown sections and fields are refused. Dotted
``section.field=value`` overrides (YAML values, as examples/train_gpt.py takes them; also
spelled ``--section.field value``) apply last, after ``--tiny`` and the other flags.

Weight streaming (issue 29; ``streaming.enabled: true``): the plan sizes the stream
(``tiermem plan --stream-weights on``: the resident blocks, the buffers, the streamed bytes per
step); the streamed blocks are materialised on the host (initialised on the GPU, module by
module: the same values as without streaming), their weights go to the store's ``streaming.tier``
(``stream_weights(model.blocks, ...)``) and each step runs ``streaming.schedule`` (block-major:
each streamed block crosses PCIe once per pass). ``streaming.optimizer: torch`` steps with
torch.optim.AdamW (the host copies of streamed weights on the CPU), ``hybrid`` with HybridAdam
(built after the stream, it steps the streamed weights' host copies: Note [streamed
write-back] in tiermem/optim/streamed.py). ``--gpu-bytes SIZE`` (the
name and meaning of ``tiermem plan --gpu-bytes``; ``--gpu``, deprecated, still works) plans for
a GPU of SIZE bytes and caps this process there (``torch.cuda.set_per_process_memory_fraction``)
to stand for a smaller card.

Activations: every block is checkpointed, so only block inputs stay (seq·d_model·2 bytes a
block, 0.02 GB at 13B); offloading them (``tiermem.offload``) would save under 1 GB here.

Exit code: 0 trained (or, with ``--dry-run``, the plan fits), 1 the plan does not fit, 2 bad
usage: a config that cannot be read, lacks a section, has an unknown section or field or a bad
value, or a CUDA preset on a machine without CUDA (one line on stderr; ``--dry-run`` still
plans there, ``--tiny`` trains a tiny model on the CPU). A missing spill directory is created
with mode 0700.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiermem import StoreConfig, TierStore, flags  # noqa: E402
from tiermem._files import CONFIG_ERRORS, config_error, make_private_dir  # noqa: E402
from tiermem.gpu_cap import cap_gpu, uncap_gpu  # noqa: E402
from tiermem.config import (BudgetConfig, OptimizerConfig, StreamingConfig,  # noqa: E402
                            TrainConfig, apply_overrides, from_tree, load_config, parse_bytes)
from tiermem.models import materialize_  # noqa: E402
from tiermem.models.gpt import GPT, GPTConfig  # noqa: E402
from tiermem.names import short_repr  # noqa: E402
from tiermem.optim import HybridAdam  # noqa: E402
from tiermem.apps.plan import (H200_HOST_BYTES, RESOURCE_NAMES, blocks_or_auto,  # noqa: E402
                          breadth_first_note, plan)
from tiermem.schedule.micro_batches import forward_backward  # noqa: E402
from tiermem.stream import plan_residency, stream_weights  # noqa: E402

SECTIONS = {"model": GPTConfig, "train": TrainConfig, "budgets": BudgetConfig,
            "store": StoreConfig, "optimizer": OptimizerConfig, "streaming": StreamingConfig}
"""The preset's sections and the config classes they are read into (all required but
``streaming``)."""
REQUIRED = ("model", "train", "budgets", "store", "optimizer")
"""The sections a preset must have."""
LOOP_FIELDS = ("steps", "micro_batch", "grad_accumulation_steps", "dtype", "device", "seed",
               "checkpoint", "breadth_first_blocks")
"""The ``train`` fields this loop uses (the others belong to ``tiermem demo``'s loop)."""
TINY = {"model": dict(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab=128),
        "train": dict(steps=2, micro_batch=2, grad_accumulation_steps=2, device="cpu",
                      dtype="float32"),
        "budgets": dict(gpu_bytes="4GiB", host_bytes="16GiB", nvme_bytes="1GiB"),
        "store": dict(cpu_bytes="2.5MiB", nvme_bytes="64MiB", pool_slab_bytes="768KiB"),
        "optimizer": dict(chunk_numel=1 << 14, offload_fraction=1.0)}  # RAM + NVMe both used


def load(path: str, tiny: bool = False, nvme_dir: str | None = None,
         grad_accumulation_steps: int | None = None,
         gpu_step_fraction: float | None = None, chunk_numel: int | None = None,
         breadth_first_blocks: int | str | None = None, param_sync: str | None = None,
         overrides: list[str] = (), gpu: str | int | None = None,
         steps: int | None = None) -> dict:
    """Read the preset into its config classes (:data:`SECTIONS`), with ``--tiny``'s values,
    ``--gpu-bytes`` (budgets.gpu_bytes), ``--nvme-dir``, ``--grad-accumulation-steps``
    (micro-batches per optimizer step),
    ``--gpu-step-fraction`` (HybridAdam's share of offloaded chunks the GPU steps),
    ``--chunk-numel`` (elements per offloaded chunk), ``--breadth-first-blocks`` and
    ``--param-sync`` and ``--steps`` (train.steps) applied first, then the dotted
    ``section.field=value`` ``overrides``.

    Raises:
        OSError, UnicodeDecodeError, yaml.YAMLError: the file cannot be read or parsed.
        ValueError, TypeError: it is not a mapping, lacks a section, has an unknown section or
            field, a ``train`` field this loop does not use, a bad value (named in the
            message), or ``train.breadth_first_blocks`` above ``model.n_layers``.
    """
    where = f"--config={path!r}"
    tree = load_config(path)
    for section, values in (TINY if tiny else {}).items():
        if isinstance(tree.get(section), dict):
            tree[section].update(values)
    if nvme_dir is not None and isinstance(tree.get("store"), dict):
        tree["store"]["nvme_dir"] = nvme_dir
    if gpu is not None and isinstance(tree.get("budgets"), dict):
        tree["budgets"]["gpu_bytes"] = gpu
    if grad_accumulation_steps is not None and isinstance(tree.get("train"), dict):
        tree["train"]["grad_accumulation_steps"] = grad_accumulation_steps
    for section, name, value in (("optimizer", "gpu_step_fraction", gpu_step_fraction),
                                 ("optimizer", "chunk_numel", chunk_numel),
                                 ("optimizer", "param_sync", param_sync),
                                 ("train", "breadth_first_blocks", breadth_first_blocks),
                                 ("train", "steps", steps)):
        if value is not None and isinstance(tree.get(section), dict):
            tree[section][name] = value
    apply_overrides(tree, list(overrides))
    cfg = from_tree(tree, SECTIONS, required=REQUIRED, where=where)
    default = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg["train"], f.name)
        if f.name not in LOOP_FIELDS and value != getattr(default, f.name):
            raise ValueError(f"{where}: train.{f.name}={short_repr(value)} belongs to tiermem demo's loop "
                             f"and is not used here; fix: remove it (this loop reads train."
                             f"{', train.'.join(LOOP_FIELDS)})")
    k, n_layers = cfg["train"].breadth_first_blocks, cfg["model"].n_layers
    if k != "auto" and k > n_layers:
        raise ValueError(f"{where}: train.breadth_first_blocks={k} exceeds model.n_layers="
                         f"{n_layers}; fix: give 0 (depth-first) to {n_layers}")
    check_streaming(cfg, where)
    return cfg


def check_streaming(cfg: dict, where: str) -> None:
    """Refuse what the ``streaming`` section cannot run with (one line each).

    Raises:
        ValueError: ``staging_blocks`` set (an NVMe-only home holds frozen weights; this loop
            trains them: Note [NVMe home]); with streaming, breadth-first blocks (block-major
            is their streamed form)
            or a GPU lane (not planned with streamed weights), ``tier: nvme`` without a store
            nvme tier; ``optimizer: torch`` with bf16 moments (torch's AdamW keeps the
            parameters' dtype) or GPU-side state (``offload_fraction`` below 1 keeps none: the
            torch optimizer steps each parameter where it lives).
    """
    st, t, o, s = cfg["streaming"], cfg["train"], cfg["optimizer"], cfg["store"]
    if st.staging_blocks is not None:  # Note [NVMe home]: frozen weights only
        raise ValueError(f"{where}: streaming.staging_blocks={st.staging_blocks}: a home on "
                         f"NVMe only (no RAM copy) holds frozen weights only, and this loop "
                         f"trains every streamed weight (the optimizer writes each update into "
                         f"its RAM host copy); fix: streaming.staging_blocks=null "
                         f"(streaming.tier=nvme then keeps a RAM host copy beside the NVMe "
                         f"copy), or examples/train_lora.py --staging-blocks for a frozen base")
    if st.optimizer == "torch" and o.moments_dtype != "float32":
        raise ValueError(f"{where}: streaming.optimizer=torch keeps torch AdamW's moments in the "
                         f"parameters' dtype, not optimizer.moments_dtype={o.moments_dtype}; fix: "
                         f"optimizer.moments_dtype=float32 or streaming.optimizer=hybrid")
    if not st.enabled:
        return
    if t.breadth_first_blocks not in (0, "auto"):
        raise ValueError(f"{where}: train.breadth_first_blocks={t.breadth_first_blocks} with "
                         f"streaming.enabled: the streamed form of breadth-first is "
                         f"streaming.schedule=block-major; fix: train.breadth_first_blocks=0")
    if o.gpu_step_fraction:
        raise ValueError(f"{where}: optimizer.gpu_step_fraction={o.gpu_step_fraction} with "
                         f"streaming.enabled: the GPU lane is not planned with streamed weights; "
                         f"fix: optimizer.gpu_step_fraction=0")
    if st.tier == "nvme" and not s.nvme_bytes:
        raise ValueError(f"{where}: streaming.tier=nvme needs the store's nvme tier "
                         f"(store.nvme_bytes=0); fix: set store.nvme_bytes and store.nvme_dir, "
                         f"or streaming.tier=cpu")


def optimizer_kwargs(cfg: dict, store: TierStore | None) -> dict:
    """HybridAdam's keyword arguments for the preset ``cfg`` (see :func:`load`) and ``store``.

    Raises:
        ValueError: optimizer.grad_accumulation_steps set apart from train's, or
            optimizer.nvme_dir set (the store has store.nvme_dir).
    """
    return cfg["optimizer"].kwargs(store=store,
                                   grad_accumulation_steps=cfg["train"].grad_accumulation_steps)


def make_plan(cfg: dict, rates=None):
    """Plan the preset ``cfg`` (see :func:`load`) with :func:`tiermem.apps.plan.plan`, predicting
    the step from ``rates`` (a :class:`tiermem.apps.plan.MachineRates`; None: the H200 machine's).

    Raises:
        ValueError: store.cpu_bytes larger than budgets.host_bytes, or what the planner refuses.
    """
    m, t, b, s, o, st = (cfg[k] for k in SECTIONS)
    host = b.host_bytes if b.host_bytes is not None else H200_HOST_BYTES
    if s.cpu_bytes > host:
        raise ValueError(f"store.cpu_bytes={s.cpu_bytes} is more than budgets.host_bytes={host}: "
                         f"the pinned budget must leave RAM for the OS and Python; lower it")
    kw = dict(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
              vocab=m.vocab, seq=m.seq_len, batch=t.micro_batch, mlp_ratio=m.mlp_ratio,
              dtype=t.dtype, moments_dtype=o.moments_dtype, **b.kwargs(),
              offload_fraction=o.offload_fraction, state_tier=o.state_tier,
              checkpoint=t.checkpoint, offload_layers=0,  # this loop offloads no activations
              grad_accumulation_steps=t.grad_accumulation_steps,
              gpu_step_fraction=o.gpu_step_fraction, max_grad_norm=o.max_grad_norm,
              param_sync=o.param_sync, breadth_first_blocks=t.breadth_first_blocks,
              rollback_bytes=o.rollback_bytes,
              # RAM = the store's budget; streaming keeps the streamed weights' host gradients
              # outside the store, so there the plan counts all RAM but 8 GiB
              host_reserve_bytes=8 << 30 if st.enabled else max(8 << 30, host - s.cpu_bytes),
              chunk_numel=o.chunk_numel, nvme_lookahead_chunks=o.nvme_lookahead_chunks,
              stream_weights=st.enabled, stream_tier=st.tier, prefetch_blocks=st.prefetch_blocks,
              stream_schedule=st.schedule, rates=rates)
    pl = plan(m.num_params(), **kw)
    note = breadth_first_note(pl, m.num_params(), kw)
    if note:  # the same flags exist here
        pl.notes.append(note)
    return pl


class TorchAdamW:
    """``streaming.optimizer: torch``: torch.optim.AdamW (Adam with ``optimizer.adamw: false``)
    over every parameter where it lives (a streamed weight's host copy on the CPU), with the
    ``optimizer`` section's lr, betas, eps, weight_decay, maximize and ``max_grad_norm``
    (``clip_grad_norm_`` before the step), and the reporting calls of HybridAdam this loop
    makes (no chunk flow: zeros; ``cpu_adam_s`` is the step's wall time).

    Raises:
        ValueError: the errors of torch's optimizer constructor.
    """

    def __init__(self, params, o: OptimizerConfig) -> None:
        self.params = list(params)
        cls = torch.optim.AdamW if o.adamw else torch.optim.Adam
        self.opt = cls(self.params, lr=o.lr, betas=o.betas, eps=o.eps,
                       weight_decay=o.weight_decay, maximize=o.maximize)
        self.max_grad_norm = o.max_grad_norm
        self.step_s = 0.0

    def step(self) -> None:
        """Clip (``max_grad_norm``) and step every parameter."""
        t0 = time.perf_counter()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.opt.step()
        self.step_s = time.perf_counter() - t0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``."""
        self.opt.zero_grad(set_to_none=set_to_none)

    def step_stats(self) -> dict:
        """HybridAdam's step counters: zeros but the step's wall seconds."""
        return dict(stall_s=0.0, cpu_adam_s=self.step_s, d2h_bytes=0, h2d_bytes=0,
                    nvme_read_bytes=0, nvme_write_bytes=0, chunks=0, gpu_chunks=0)

    def memory_bytes(self) -> dict:
        """Bytes of optimizer state per tier (``gpu``: on a CUDA device, ``cpu``: host)."""
        out = {"gpu": 0, "cpu": 0, "nvme": 0}
        for state in self.opt.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    out["gpu" if t.is_cuda else "cpu"] += t.numel() * t.element_size()
        return out

    def chunk_tiers(self) -> dict:
        """No offloaded chunks."""
        return {}

    def synchronize(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        """Nothing to free."""


def speculation_text(st: dict) -> str:
    """The clip speculation's part of a step line from ``step_stats()`` ``st`` (Note
    [speculative step] in tiermem/optim/speculate.py): ``spec off`` where the step held no
    rollback copies (no budget, no clipping, or the first step, which records the gradient
    order), else the chunks speculated and rolled back and the bytes held (of them on the GPU
    for the GPU lane), ``paused`` when recent steps clipped (Note [speculation switch]).

    Raises:
        Nothing.
    """
    held = st.get("rollback_held_bytes", 0)
    if not held:
        return "spec off"
    gpu = st.get("rollback_gpu_bytes", 0)
    state = "spec" if st.get("speculating") else "spec paused (recent steps clipped):"
    return (f"{state} {st.get('speculated_chunks', 0)} chunks, "
            f"{st.get('rolled_back_chunks', 0)} rolled back, {held / 1e9:.2f} GB held"
            + (f" ({gpu / 1e9:.2f} on the GPU)" if gpu else ""))


def hybrid_steps_streams() -> bool:
    """Whether this build's HybridAdam steps streamed weights' host copies (issue 29 items
    2-3: ``tiermem.optim.streamed``, Note [streamed write-back]); it must be built after the
    stream, as :func:`main` does."""
    import importlib.util  # noqa: PLC0415
    return importlib.util.find_spec("tiermem.optim.streamed") is not None


def materialize_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                      host_blocks: set[int]) -> None:
    """Materialise ``model`` (a meta-device GPT) in ``dtype``, initialised on ``device`` module
    by module; the blocks in ``host_blocks`` (streamed) land on the CPU, the rest on
    ``device``. The modules are taken in ``named_modules`` order, so the values are those of
    ``materialize_(model, device, dtype, init_device=device)``."""
    if not host_blocks:
        materialize_(model, device, dtype, init_device=device)  # GPU RNG: ~100x the CPU's
        return
    for name, child in model.named_children():
        if name != "blocks":
            materialize_(child, device, dtype, init_device=device)
            continue
        for i, block in enumerate(child):
            materialize_(block, "cpu" if i in host_blocks else device, dtype, init_device=device)
    materialize_(model, device, dtype, init_device=device)  # anything outside the children


def streamed_residency(cfg: dict, pl, model: torch.nn.Module, dtype: torch.dtype):
    """The :class:`tiermem.stream.ResidencyPlan` of the ``streaming`` section for ``model``'s
    blocks (still on the meta device): under ``streaming.gpu_bytes``, or the plan's
    ``stream_gpu_bytes`` when that is null.

    Raises:
        ValueError: the budget cannot hold the streaming buffers (naming the field).
    """
    st = cfg["streaming"]
    sizes = [sum(p.numel() for p in b.parameters()) * dtype.itemsize for b in model.blocks]
    gpu = st.gpu_bytes
    if gpu is None and pl.stream is not None:
        gpu = pl.stream.stream_gpu_bytes
    try:
        return plan_residency(sizes, gpu_bytes=gpu, prefetch_blocks=st.prefetch_blocks)
    except ValueError as exc:
        which = "streaming.gpu_bytes" if st.gpu_bytes is not None else "the plan's gpu_bytes"
        raise ValueError(f"{which}={gpu}: {exc}") from None


def split_dotted_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """``--section.field value`` and ``--section.field=value`` (a section of :data:`SECTIONS`)
    taken out of ``argv`` as ``section.field=value`` overrides: (the rest, the overrides).

    Raises:
        ValueError: such a flag without a value.
    """
    rest, overrides = [], []
    it = iter(argv)
    for arg in it:
        key, eq, value = arg[2:].partition("=")
        if arg.startswith("--") and key.split(".")[0] in SECTIONS and "." in key:
            if not eq:
                value = next(it, None)
                if value is None:
                    raise ValueError(f"{arg} needs a value (e.g. {arg} nvme, or "
                                     f"{key}=VALUE)")
            overrides.append(f"{key}={value}")
        else:
            rest.append(arg)
    return rest, overrides


class _GpuTimer:
    """Seconds of GPU work between construction and ``seconds()`` on the current stream
    (CUDA events); wall seconds on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()  # marks where this step's GPU work begins
        else:
            self.t0 = time.perf_counter()

    def seconds(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()  # elapsed_time needs both events complete
        return self.start.elapsed_time(end) / 1e3


def time_split_block(measured: list[dict], pl, device: torch.device) -> str:
    """One block: the measured time split of a step (median over the steps after the first,
    which warms up; all of them with one step) beside the plan's prediction for it."""
    runs = measured[1:] or measured
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    st = pl.step_time
    pred, moved = st.seconds, st.moved
    forward = st.param_sync == "forward"  # the CPU step ends inside the next forward
    gib = 2 ** 30
    which = ("step 0" if len(measured) == 1 else "step 1" if len(measured) == 2 else
             f"steps 1-{len(measured) - 1}")
    rows = [
        ("", "measured", "predicted"),
        ("step", f"{med['step_s']:.3f} s", f"{st.overlapped_s:.3f}-{st.serial_s:.3f} s"),
        ("tokens/s", f"{med['tokens'] / med['step_s']:,.0f}",
         f"{st.tokens_per_s_serial:,.0f}-{st.tokens_per_s_overlapped:,.0f}"),
        ("GPU fwd+bwd" + (" (CUDA events)" if device.type == "cuda" else " (wall)")
         + (", waits included" if forward else ""),
         f"{med['gpu_s']:.3f} s", f"{pred['gpu']:.3f} s"),
        ("fwd+bwd wall", f"{med['fwd_bwd_wall_s']:.3f} s", ""),
        ("optimizer step wall" + (" (step() only)" if forward else ""),
         f"{med['opt_wall_s']:.3f} s", ""),
        ("  of which stall", f"{med['stall_s']:.3f} s", ""),
        ("CPU Adam (kernel, summed)", f"{med['cpu_adam_s']:.3f} s", f"{pred['cpu_adam']:.3f} s"),
        ("PCIe", "not timed", f"{pred['pcie']:.3f} s"),
        ("  D2H + H2D", f"{med['d2h_bytes'] / gib:.2f} + {med['h2d_bytes'] / gib:.2f} GiB",
         f"{moved['pcie_d2h_bytes'] / gib:.2f} + {moved['pcie_h2d_bytes'] / gib:.2f} GiB"),
        ("NVMe", "not timed", f"{pred['nvme']:.3f} s"),
        ("  read + write", f"{med['nvme_read_bytes'] / gib:.2f} + "
                           f"{med['nvme_write_bytes'] / gib:.2f} GiB",
         f"{moved['nvme_read_bytes'] / gib:.2f} + {moved['nvme_write_bytes'] / gib:.2f} GiB"),
    ]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"train_large: one optimizer step of {st.tokens:,} tokens, measured (median of "
             f"{which}) and predicted by the plan (bound: {RESOURCE_NAMES[st.bound]}; the "
             f"predicted step spans forward + backward plus the optimizer's tail, to every "
             f"resource one after another):"]
    lines += ["  " + r[0].ljust(w[0]) + "  " + r[1].rjust(w[1]) + "  " + r[2].rjust(w[2])
              for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None, record: list | None = None) -> int:
    """Plan, then train (see the module docstring); return the exit code. ``record`` (tests):
    a list that receives each step's micro-batch losses (floats)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE",
                    help="dotted overrides of the preset, applied last (YAML values), e.g. "
                         "optimizer.offload_fraction=0.9 budgets.host_bytes=256GiB")
    ap.add_argument("--config", required=True, help="YAML preset (examples/configs/large/...)")
    ap.add_argument("--dry-run", action="store_true", help="only plan; exit 0 fits, 1 does not")
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    add = functools.partial(flags.add, ap, "train_large")  # None: the preset's (flags.py)
    add("--steps", type=int, help="override train.steps")
    add("--grad-accumulation-steps", type=int,
        help="override train.grad_accumulation_steps (micro-batches per optimizer "
        "step; the plan prints from how many the GPU bounds the step)")
    add("--gpu-step-fraction", type=float,
        help="override optimizer.gpu_step_fraction (share of the offloaded chunks "
        "the GPU steps by streaming their state, 0..1; the plan's step "
        "time counts its PCIe traffic)")
    add("--chunk-numel", type=int,
        help="override optimizer.chunk_numel (elements per offloaded chunk)")
    add("--breadth-first-blocks", type=blocks_or_auto,
        help="override train.breadth_first_blocks (blocks run for every "
        "micro-batch first; 0: depth-first; auto: the most the plan fits)")
    add("--param-sync",
        help="override optimizer.param_sync (step or forward: the next forward "
        "waits per module for the CPU step)")
    add("--nvme-dir",
        help="spill directory (replaces store.nvme_dir; made 0700 if missing)")
    add("--gpu-bytes", dest="gpu", metavar="SIZE",
        help="GPU memory capacity (as tiermem plan --gpu-bytes; replaces "
        "budgets.gpu_bytes), and on CUDA this process is capped there "
        "(torch.cuda.set_per_process_memory_fraction) to stand for that card")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv, flagged = split_dotted_flags(argv)
    except ValueError as exc:
        print(f"train_large: error: {exc}", file=sys.stderr)
        return 2
    args = ap.parse_args(argv)
    try:
        cfg = load(args.config, args.tiny, args.nvme_dir, args.grad_accumulation_steps,
                   args.gpu_step_fraction, args.chunk_numel, args.breadth_first_blocks,
                   args.param_sync, args.overrides + flagged, gpu=args.gpu, steps=args.steps)
        pl = make_plan(cfg)
    except CONFIG_ERRORS as exc:
        print(f"train_large: error: {config_error('--config', args.config, exc)}",
              file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:
        print(f"train_large: error: {exc}", file=sys.stderr)
        return 2
    m, t, s, o, st = (cfg[k] for k in ("model", "train", "store", "optimizer", "streaming"))
    device_name = t.device if t.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if not args.dry_run and device_name.startswith("cuda") and not torch.cuda.is_available():
        print(f"train_large: error: train.device={device_name!r} in {args.config} but CUDA is "
              f"not available here; fix: run on a CUDA machine, or --dry-run to only plan, or "
              f"--tiny for a CPU smoke run", file=sys.stderr)
        return 2
    print(pl.table(), flush=True)
    if not pl.fits:
        print("train_large: this configuration does not fit the given budgets:\n  "
              + "\n  ".join(pl.reasons or ["(see the plan above)"]), file=sys.stderr)
        return 1
    if args.dry_run:
        print("train_large: the plan fits (dry run, nothing trained)")
        return 0
    device = torch.device(device_name)
    capped = args.gpu is not None and device.type == "cuda"
    if capped:
        cap, total = cap_gpu(device, cfg["budgets"].gpu_bytes)  # Note [GPU cap device index]
        print(f"train_large: GPU capped at {cap / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
              f"(--gpu-bytes)", flush=True)
    try:
        return _train(args, cfg, pl, device, record)
    finally:
        if capped:  # an in-process caller (a test, a notebook) gets its whole GPU back
            uncap_gpu(device)


def _train(args: argparse.Namespace, cfg: dict, pl, device: torch.device,
           record: list | None) -> int:
    """Build the model, stream, store and optimizer ``cfg`` and ``pl`` name on ``device``, train
    ``train.steps`` steps printing each step's line and the measured-vs-predicted table; return
    the exit code (2: a bad streaming or spill setting). ``record``: as :func:`main`'s."""
    m, t, s, o, st = (cfg[k] for k in ("model", "train", "store", "optimizer", "streaming"))
    dtype = getattr(torch, t.dtype)
    accum = t.grad_accumulation_steps
    steps = t.steps  # --steps is train.steps, checked by TrainConfig (load)
    torch.manual_seed(t.seed)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(m, checkpoint=t.checkpoint)
    residency = None
    if st.enabled:
        try:
            residency = streamed_residency(cfg, pl, model, dtype)
        except ValueError as exc:
            print(f"train_large: error: {exc}", file=sys.stderr)
            return 2
        if st.optimizer == "hybrid" and not hybrid_steps_streams():
            print("train_large: error: streaming.optimizer=hybrid needs HybridAdam to step the "
                  "streamed weights' host copies (issue 29 phase 2), which this build lacks; "
                  "fix: streaming.optimizer=torch", file=sys.stderr)
            return 2
    materialize_model(model, device, dtype, set(residency.streamed) if residency else set())
    n = sum(p.numel() for p in model.parameters())
    print(f"train_large: {n / 1e9:.3f}B params materialised on {device} in {dtype} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if s.nvme_bytes:
        try:
            make_private_dir(s.nvme_dir, "--nvme-dir" if args.nvme_dir else "store.nvme_dir",
                             log=print)
        except ValueError as exc:
            print(f"train_large: error: {exc}", file=sys.stderr)
            return 2
    store = TierStore(dataclasses.replace(s, device=str(device)))
    stream = None
    if residency is not None:
        t_stream = time.perf_counter()
        stream = stream_weights(model.blocks, store=store, tier=st.tier,
                                prefetch_blocks=st.prefetch_blocks, resident=residency.resident)
        print(f"train_large: weights of {len(residency.streamed)} of {m.n_layers} blocks "
              f"streamed from {st.tier} ({len(residency.resident)} resident, "
              f"{stream.plan.buffer_blocks} buffers, prefetch {st.prefetch_blocks}, "
              f"{st.schedule}) in {time.perf_counter() - t_stream:.1f} s", flush=True)
    t_opt = time.perf_counter()
    if st.optimizer == "torch":
        opt = TorchAdamW(model.parameters(), o)
        print(f"train_large: torch.optim.{type(opt.opt).__name__} built (streaming.optimizer="
              f"torch)", flush=True)
    else:
        opt = HybridAdam(model.parameters(), **optimizer_kwargs(cfg, store))
        print(f"train_large: HybridAdam built in {time.perf_counter() - t_opt:.1f} s; offloaded "
              f"chunks per tier {opt.chunk_tiers()}", flush=True)
    b, seq = t.micro_batch, m.seq_len
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, m.vocab, (4 * b, seq + 1), generator=gen)  # a few batches, learnable
    measured = []

    def report(rec: dict, dt: float) -> None:
        """Print step ``rec``'s line (its optimizer work is finished: step_stats is its own)."""
        st, mem = opt.step_stats(), opt.memory_bytes()
        streamed = "" if stream is None else (
            f" | stream h2d {rec['stream_h2d'] / 1e9:.2f} GB in {rec['stream_fills']} fills")
        streamed += f" | {speculation_text(st)}"
        tok_s = rec["tokens"] / dt
        print(f"step {rec['step']} loss {rec['loss']:.4f} | {tok_s:,.0f} tok/s, "
              f"{6 * n * tok_s / 1e12:.2f} model TFLOP/s, {dt:.2f} s | state GB gpu "
              f"{mem['gpu'] / 1e9:.2f} ram {mem['cpu'] / 1e9:.2f} nvme {mem['nvme'] / 1e9:.2f} | "
              f"gpu fwd+bwd {rec['gpu_s']:.2f} s, cpu_adam {st['cpu_adam_s']:.2f} s, pcie d2h "
              f"{st['d2h_bytes'] / 1e9:.2f} GB, h2d "
              f"{st['h2d_bytes'] / 1e9:.2f} GB, nvme r/w {st['nvme_read_bytes'] / 1e9:.2f}/"
              f"{st['nvme_write_bytes'] / 1e9:.2f} GB, stall {st['stall_s']:.2f} s, chunks "
              f"{st['chunks']} ({st['gpu_chunks']} on the GPU lane){streamed}", flush=True)
        measured.append(dict(step_s=dt, tokens=rec["tokens"], gpu_s=rec["gpu_s"],
                             fwd_bwd_wall_s=rec["fwd_bwd_wall_s"], opt_wall_s=rec["opt_wall_s"],
                             **{k: st[k] for k in ("stall_s", "cpu_adam_s", "d2h_bytes",
                                                   "h2d_bytes", "nvme_read_bytes",
                                                   "nvme_write_bytes")}))

    # A step's time runs from its start to the next step's start (the last: to the end of its
    # optimizer work): with param_sync="forward" its CPU step ends inside the next forward.
    # Its line is printed once that work is done: after the next step's backward.
    prev = None
    for step in range(steps):
        t_step = time.perf_counter()
        batches = []
        for micro in range(accum):
            rows = data[((step * accum + micro) % 4) * b:][:b].to(device)
            batches.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
        timer = _GpuTimer(device)
        before = stream.stats() if stream is not None else None
        if stream is not None:
            losses = forward_backward(model, batches, block_major=st.schedule == "block-major")
        else:
            losses = forward_backward(model, batches,
                                      breadth_first_blocks=pl.breadth_first_blocks)
        total = sum(loss.item() for loss in losses) / accum  # .item() syncs: the timer ran
        gpu_s = timer.seconds()
        if record is not None:
            record.append([loss.item() for loss in losses])
        moved = {} if stream is None else {
            "stream_h2d": stream.stats()["h2d_bytes"] - before["h2d_bytes"],
            "stream_fills": stream.stats()["fills"] - before["fills"]}
        if prev is not None:  # the previous step's CPU side finished in this backward at last
            report(prev, t_step - prev["t_step"])
        t_opt = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda" and o.param_sync == "step":
            torch.cuda.synchronize()
        prev = dict(step=step, loss=total, tokens=b * seq * accum, gpu_s=gpu_s, t_step=t_step,
                    fwd_bwd_wall_s=t_opt - t_step, opt_wall_s=time.perf_counter() - t_opt,
                    **moved)
    opt.synchronize()  # the last step's CPU side
    if device.type == "cuda":
        torch.cuda.synchronize()
    if prev is not None:
        report(prev, time.perf_counter() - prev["t_step"])
    if measured:
        print(time_split_block(measured, pl, device), flush=True)
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(f"train_large: done in {time.perf_counter() - t0:.0f} s; peak GPU {gpu_peak:.1f} GiB "
          f"allocated, peak host RSS {rss:.1f} GiB (pinned state included), store peak "
          + ", ".join(f"{t} {store.stats()[t]['peak_bytes'] / 2**30:.1f} GiB" for t in ("cpu", "nvme")),
          flush=True)
    opt.close()
    if stream is not None:  # the model is dropped: no copy of its streamed weights
        stream.close(restore=False)  # (Note [closing without a copy]: it OOM-killed the 13B)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
