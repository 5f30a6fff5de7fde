"""tiermem weight streaming + HybridAdam against DeepSpeed ZeRO-3 offload, side by side (issue 29).

Rows (same model, initial weights, batches, tokens per step, Adam hyper-parameters
:data:`tiermem.apps.bench.optim_base.HP`, gradient clipping ``--grad-clip``, GPU cap):

- ``resident, AdamW``: the reference GPT on the GPU, fp32 masters + torch AdamW (fused on CUDA)
  stepping them, the bf16 weights cast from the masters (the parity baseline: the arithmetic of
  the two offloaded rows, which both keep fp32 masters); then once more, its run-to-run noise;
- ``tiermem: streamed + HybridAdam f=1``: every block's weights streamed from pinned RAM and
  HybridAdam with ``offload_fraction=1``: ``tiermem bench stream``'s ``streamed, HybridAdam`` row
  (its stream, its schedule and its timed loop, imported from :mod:`tiermem.apps.bench.stream`),
  with ``max_grad_norm`` = ``--grad-clip`` and ``rollback_bytes`` = ``--rollback-bytes`` (the
  meaning of ``tiermem bench optim --rollback-bytes``, Note [speculative step]: chunks step
  during backward and are rolled back when the norm clips; 0: every chunk waits for the norm
  after backward), by default every chunk's state (fp32 master and moments: 15 GiB of host
  RAM at the reference GPT), what a user with that RAM would set; each run's line gives
  HybridAdam's last ``step_stats`` (its worker's phases, speculated and rolled-back chunks)
  and the speculated / rolled-back chunks over the timed steps;
- ``DeepSpeed ZeRO-3 offload``: ``deepspeed.initialize`` with ZeRO stage 3, ``offload_param``
  and ``offload_optimizer`` on cpu (pinned), bf16 on CUDA, its AdamW (``DeepSpeedCPUAdam``,
  ``adamw_mode``), ``gradient_clipping`` = ``--grad-clip``, micro-batch = ``--batch`` and
  ``gradient_accumulation_steps`` = ``--grad-accumulation-steps`` (so the same tokens per step),
  in a one-process ``torch.distributed`` group (nccl). Without deepspeed or CUDA the row says
  "not available" and the others run.

Columns: ``ms/step`` the median over runs of each run's median timed step (forward + backward +
optimizer step, the device synchronised), ``spread`` their min-max, ``tokens/s`` tokens per step
over that median, ``peak GiB`` ``torch.cuda.max_memory_allocated`` over a run (warm-up
included; the largest over runs; ``-`` on the CPU), ``x`` the step time over the baseline's,
``parity`` every step's loss (and one more batch after the last step) against the first
baseline run within 4x the baseline's own run-to-run difference
(:class:`tiermem.apps.bench.parity.BaselineParity`). The last line gives tiermem's tokens/s
over ZeRO-3's. Runs go repeat-major (every row's first run, then every row's second, ...), a
round started only if it ends within ``--budget-s`` (as long as the last round took).

The cap: ``--gpu-bytes`` caps the two rows it compares (tiermem and ZeRO-3) with
``torch.cuda.set_per_process_memory_fraction``, set again before each run; the resident baseline
runs uncapped, because it cannot fit a small card (fp32 masters + Adam state + bf16 weights and
gradients are 18 bytes a parameter: 24 GiB for the reference GPT's 1.34B before activations).
It is the parity reference and the ``x`` column's, not a contender under the cap; its ``peak
GiB`` says what it used. Each run ends with ``torch.cuda.empty_cache()`` so the next run's cap
is measured against its own reservations.

Exit status: 0 when every row that ran is ``exact`` or ``equal`` to the baseline, 1 if not,
2 for bad arguments (one line).

    python examples/bench_zero3.py --gpu-bytes 24GiB          # H200: reference GPT, 16k tokens
    python examples/bench_zero3.py --layers 2 --d-model 32 --heads 2 --seq 16 --batch 2 \\
        --vocab 64 --steps 2 --repeats 1                       # CPU smoke run (no ZeRO-3 row)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from tiermem.apps import table
from tiermem.apps.bench import stream as bench_stream
from tiermem.apps.bench.common import bench_device, learnable_batches, sync
from tiermem.apps.bench.deepspeed_env import build_cpu_adam, set_single_process_env
from tiermem.apps.bench.deepspeed_env import import_deepspeed as _import_deepspeed
from tiermem.apps.bench.optim_base import HP, _GpuMasters
from tiermem.apps.bench.parity import BaselineParity
from tiermem.config import StoreConfig
from tiermem.gpu_cap import cap_gpu, uncap_gpu
from tiermem.models.gpt import GPT
from tiermem.names import gib, parse_bytes
from tiermem.optim.layout import chunk_state_bytes
from tiermem.optim.partition import auto_chunk_numel
from tiermem.store import TierStore

BASELINE = "resident, AdamW"
AGAIN = "resident, AdamW (again: its noise)"
TIERMEM = "tiermem: streamed + HybridAdam f=1"
ZERO3 = "DeepSpeed ZeRO-3 offload"
ROWS = (BASELINE, AGAIN, TIERMEM, ZERO3)
ALL_CHUNKS = "all"
"""``--rollback-bytes`` for a rollback slot per chunk (:func:`every_chunk_rollback_bytes`)."""


@dataclass
class Run:
    """One run: its timed steps' seconds, its losses (every step, then one more batch) and its
    peak GPU bytes (None on the CPU)."""
    step_s: list[float]
    losses: list[float]
    peak_bytes: int | None = None


@dataclass
class Row:
    """A setup's runs, or why it did not run (``missing``)."""
    name: str
    runs: list[Run] = field(default_factory=list)
    missing: str = ""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (main turns the ValueError into it)
        raise ValueError(message)


def parse_args(argv):
    """This script's flags, then ``tiermem bench stream``'s parser on the shared ones (its
    defaults, checks and ``--gpu-bytes``).

    Raises:
        ValueError: a bad or unknown flag (the message names it).
    """
    p = _Parser(prog="bench_zero3.py", description=__doc__.splitlines()[0])
    for flag in ("--layers", "--d-model", "--heads", "--seq", "--vocab", "--batch",
                 "--grad-accumulation-steps", "--steps", "--warmup", "--repeats"):
        p.add_argument(flag, type=int, default=None, help="as tiermem bench stream")
    p.add_argument("--gpu-bytes", default=None, metavar="SIZE",
                   help="cap CUDA memory at SIZE (set_per_process_memory_fraction) for the "
                        "tiermem and ZeRO-3 rows (the docstring: The cap)")
    p.add_argument("--checkpoint", action="store_true",
                   help="checkpoint every block (all rows; 16k tokens in 24 GiB need it)")
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="max global gradient norm of every row (0: no clipping)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no round of runs that would end past this many seconds")
    p.add_argument("--rollback-bytes", default=ALL_CHUNKS,
                   help="HybridAdam rollback_bytes of the tiermem row, as tiermem bench optim's "
                        "(bytes or '4GiB'; 0: the CPU step waits for the norm); "
                        f"'{ALL_CHUNKS}' (default): every chunk's state, what a user with the "
                        "RAM would set (15 GiB of host RAM at the reference GPT)")
    args = p.parse_args(argv)
    rollback = (None if args.rollback_bytes == ALL_CHUNKS
                else parse_bytes(args.rollback_bytes, "--rollback-bytes"))
    if args.grad_clip < 0:
        raise ValueError(f"--grad-clip={args.grad_clip} must be >= 0 (0: no clipping)")
    if args.budget_s <= 0:
        raise ValueError(f"--budget-s={args.budget_s} must be > 0 (seconds)")
    shared = ["--checkpoint"] if args.checkpoint else []
    for name, value in vars(args).items():
        if value is not None and name not in ("grad_clip", "budget_s", "checkpoint",
                                              "rollback_bytes"):
            shared += [f"--{name.replace('_', '-')}", str(value)]
    sargs = bench_stream._parse_args(shared)
    sargs.grad_clip, sargs.budget_s = args.grad_clip, args.budget_s
    sargs.rollback_bytes, sargs.rollback = args.rollback_bytes, rollback  # None: every chunk's
    return sargs


def every_chunk_rollback_bytes(n_params: int) -> int:
    """HybridAdam's ``rollback_bytes`` that gives every chunk of ``n_params`` fp32-moment
    parameters, in one param group at ``offload_fraction=1`` and the default ``chunk_numel``,
    a rollback slot (Note [speculative step]: slots of the largest chunk's state blob).

    Raises:
        Nothing.
    """
    chunk = auto_chunk_numel(n_params)
    return -(-n_params // chunk) * chunk_state_bytes(chunk, torch.float32)


class ClippedMasters(_GpuMasters):
    """The baseline optimizer: bench optim's fp32 masters + torch AdamW, the fp32 gradients
    clipped to ``max_norm`` (0: not) before the step, as HybridAdam and DeepSpeed clip."""

    def __init__(self, params, max_norm: float) -> None:
        super().__init__(params)
        self.max_norm = max_norm

    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.masters, self.max_norm)
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.copy_(m)
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad()


def import_deepspeed():
    """``(deepspeed, "")`` or ``(None, why the ZeRO-3 row cannot run)``."""
    if not torch.cuda.is_available():
        return None, "needs CUDA (ZeRO-3 offload with nccl)"
    deepspeed, why = _import_deepspeed()
    return deepspeed, (f"deepspeed not importable ({why})" if deepspeed is None else "")


def zero3_config(args, dtype: torch.dtype) -> dict:
    """The DeepSpeed config of the ZeRO-3 row (both offloads on pinned cpu, DeepSpeedCPUAdam)."""
    m = args.micro_batches
    return {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": m,
        "train_batch_size": args.batch * m, "gradient_clipping": float(args.grad_clip),
        "bf16": {"enabled": dtype == torch.bfloat16}, "steps_per_print": 1 << 30,
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {
            "lr": HP["lr"], "betas": list(HP["betas"]), "eps": HP["eps"],
            "weight_decay": HP["weight_decay"], "adam_w_mode": True, "torch_adam": False}},
    }


def _init_distributed(deepspeed) -> None:
    """A one-process group (world size 1, nccl) for DeepSpeed."""
    if torch.distributed.is_initialized():
        return
    set_single_process_env()
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False, verbose=False)


def train_zero3(deepspeed, args, build, init, batches, device, dtype, log):
    """One ZeRO-3 run: ``(timed step seconds, losses)``."""
    model = build()
    with torch.no_grad():
        model.load_state_dict(init)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=zero3_config(args, dtype))
    inner = getattr(opt, "optimizer", opt)  # ZeRO-3's wrapper holds DeepSpeedCPUAdam
    log(f"    ZeRO-3 optimizer: {type(opt).__name__} over {type(inner).__name__}")
    step_s, losses = [], []
    try:
        for step, micro in enumerate(batches[:-1]):
            sync(device)
            t0 = time.perf_counter()
            out = []
            for idx, tgt in micro:  # engine.backward divides by gradient_accumulation_steps
                loss = engine(idx, tgt)[1]
                engine.backward(loss)
                engine.step()  # a no-op but at the accumulation boundary
                out.append(loss.detach())
            sync(device)
            if step >= args.warmup:
                step_s.append(time.perf_counter() - t0)
            losses.append(sum(float(x) for x in out) / len(out))
        with torch.no_grad():  # the final weights, seen through one more batch
            losses.append(float(engine(*batches[-1][0])[1]))
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, opt, model
    return step_s, losses


def _store(model: GPT, device: torch.device) -> TierStore:
    """The stream's store, sized as ``tiermem bench stream`` sizes it (cpu tier)."""
    n_params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    return TierStore(StoreConfig(
        device=str(device), gpu_bytes=0,
        pool_slab_bytes="256MiB" if device.type == "cuda" else "1MiB",
        cpu_bytes=(weights + 16 * n_params + (1 << 20)) // 4096 * 4096 + (2 << 20)))


def run(args, log=print) -> list[Row]:
    """Every row, repeat-major within ``args.budget_s``."""
    device = bench_device()
    cap = args.gpu_bytes is not None and device.type == "cuda"  # the docstring: The cap
    if cap:  # as tiermem bench stream caps: tiermem.gpu_cap
        total = torch.cuda.get_device_properties(device).total_memory
        log(f"GPU capped at {gib(args.gpu_bytes)} GiB of {gib(total)} GiB (--gpu-bytes) for "
            f"{TIERMEM!r} and {ZERO3!r}; the resident baseline runs uncapped")
    cfg, dtype, build, model, init = bench_stream.seeded_model(args, device)
    store = _store(model, device)
    rollback = args.rollback
    if rollback is None:  # --rollback-bytes all
        rollback = every_chunk_rollback_bytes(sum(p.numel() for p in model.parameters()))
    del model
    log(f"{TIERMEM}: rollback_bytes={rollback} ({gib(rollback)} GiB, --rollback-bytes "
        f"{args.rollback_bytes})")
    m = args.micro_batches
    flat = learnable_batches(cfg.vocab, args.batch, args.seq,
                             (args.warmup + args.steps + 1) * m, device)
    batches = [flat[i * m:(i + 1) * m] for i in range(args.warmup + args.steps + 1)]

    def hybrid(model):
        from tiermem.optim import HybridAdam  # noqa: PLC0415
        return HybridAdam(model.parameters(), **HP, offload_fraction=1.0, store=store,
                          grad_accumulation_steps=m, max_grad_norm=args.grad_clip or None,
                          rollback_bytes=rollback)

    def masters(model):
        return ClippedMasters(model.parameters(), args.grad_clip)

    setups = {BASELINE: bench_stream.Setup(BASELINE, False, masters, None),
              AGAIN: bench_stream.Setup(AGAIN, False, masters, BASELINE),
              TIERMEM: bench_stream.Setup(TIERMEM, True, hybrid, BASELINE,
                                          clip=args.grad_clip or None, clips_itself=True)}
    deepspeed, why = import_deepspeed()
    rows = [Row(name) for name in ROWS]
    if deepspeed is None:
        rows[-1].missing = f"not available: {why}"
        log(f"{ZERO3}: not available: {why}; the other rows run")
    else:
        _init_distributed(deepspeed)
        # the JIT build of DeepSpeedCPUAdam, outside the budget
        log(f"DeepSpeedCPUAdam op ready in {build_cpu_adam():.0f} s")
    try:
        start = last = time.perf_counter()
        for rep in range(args.repeats):
            now = time.perf_counter()
            if rep and now - start + (now - last) > args.budget_s:
                log(f"time budget {args.budget_s:.0f} s: {rep} round(s) run, another would "
                    f"end past it")
                break
            last = now
            for row in rows:
                if row.missing:
                    continue
                if device.type == "cuda":
                    if cap and row.name in (BASELINE, AGAIN):  # the docstring: The cap
                        uncap_gpu(device)
                    elif cap:
                        cap_gpu(device, args.gpu_bytes)  # Note [GPU cap device index]
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                diag, spec = "", None
                if row.name == ZERO3:
                    step_s, losses = train_zero3(deepspeed, args, build, init, batches,
                                                 device, dtype, log)
                else:
                    _, step_s, losses, _, diag, spec = bench_stream._train(
                        setups[row.name], build, init, batches, store, args, device)
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
                row.runs.append(Run(step_s, losses, peak))
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if spec is not None:  # HybridAdam's speculation over the timed steps
                    diag += f"; timed steps: spec/rb {spec[0]}/{spec[1]}"
                log(f"  run {rep + 1} {row.name}: {statistics.median(step_s) * 1e3:.1f} ms/step,"
                    f" losses {', '.join(f'{x:.4f}' for x in losses)} "
                    f"({time.perf_counter() - t0:.0f} s)" + (f" (last step: {diag})" if diag
                                                             else ""))
    finally:
        store.close()
    return rows


def verdicts(rows: list[Row]) -> dict[str, str]:
    """Each row's parity against the baseline (``BaselineParity``); a row without runs: why."""
    parity = BaselineParity(BASELINE, AGAIN)
    out = {}
    for row in rows:
        if not row.runs:
            out[row.name] = row.missing or "(no run: time budget)"
        else:
            out[row.name] = parity.of(row.name, [r.losses for r in row.runs])
    return out


def _ms(row: Row) -> float:
    return statistics.median(statistics.median(r.step_s) for r in row.runs) * 1e3


def format_table(rows: list[Row], tokens: int, parity: dict[str, str]) -> str:
    """The table and the last line (tiermem's tokens/s over ZeRO-3's)."""
    ran = {r.name: r for r in rows if r.runs}
    base = _ms(ran[BASELINE]) if BASELINE in ran else None
    cells = []
    for row in rows:
        if not row.runs:
            cells.append((row.name, "-", "-", "-", "-", "-", "0", parity[row.name]))
            continue
        meds = [statistics.median(r.step_s) * 1e3 for r in row.runs]
        ms = _ms(row)
        peaks = [r.peak_bytes for r in row.runs if r.peak_bytes is not None]
        cells.append((row.name, f"{ms:.1f}", table.spread((min(meds), max(meds))),
                      f"{tokens / ms * 1e3:,.0f}", gib(max(peaks)) if peaks else "-",
                      table.ratio(ms, base), str(len(row.runs)), parity[row.name]))
    text = table.render(
        [table.Column("setup", align="<"), table.Column("ms/step"), table.Column("spread"),
         table.Column("tokens/s"), table.Column("peak GiB"), table.Column("x"),
         table.Column("runs"), table.PARITY], cells)
    if TIERMEM in ran and ZERO3 in ran:
        last = f"tiermem over ZeRO-3: {_ms(ran[ZERO3]) / _ms(ran[TIERMEM]):.2f}x tokens/s"
    else:
        why = next((r.missing for r in rows if r.name == ZERO3 and r.missing), "a row did not run")
        last = f"tiermem over ZeRO-3: n/a ({why})"
    return f"{text}\n{last}"


def exit_code(rows: list[Row], parity: dict[str, str]) -> int:
    """0 when every row that ran is the baseline, ``exact`` or ``equal``; else 1."""
    ok = all(parity[r.name].split(" ")[0] in ("baseline", "exact", "equal")
             for r in rows if r.runs)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the rows, print the table; the exit status (module docstring)."""
    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"bench_zero3: error: {exc}", file=sys.stderr)
        return 2
    tokens = args.batch * args.seq * args.micro_batches
    print(f"bench_zero3: layers={args.layers} d_model={args.d_model} heads={args.heads} "
          f"seq={args.seq} batch={args.batch} micro_batches={args.micro_batches} "
          f"vocab={args.vocab} ({tokens:,} tokens per step) gpu={args.gpu or 'uncapped'} "
          f"grad_clip={args.grad_clip} checkpoint={args.checkpoint} schedule={args.schedule} "
          f"steps={args.steps} warmup={args.warmup} repeats={args.repeats} "
          f"budget_s={args.budget_s:.0f} rollback_bytes={args.rollback_bytes}", flush=True)
    rows = run(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    parity = verdicts(rows)
    print(format_table(rows, tokens, parity), flush=True)
    return exit_code(rows, parity)


if __name__ == "__main__":
    sys.exit(main())
