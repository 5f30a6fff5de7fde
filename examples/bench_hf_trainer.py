"""Throughput of ``transformers.Trainer`` with torch AdamW against ``TiermemTrainer`` (issue 31).

Rows (every run trains the same seeded model on the same batches, in the same order):

- ``Trainer + AdamW``: the stock Trainer, torch's fused AdamW (state on the GPU);
- ``Trainer + HybridAdam f=1.0``: ``TiermemTrainer``, the whole optimizer state in pinned RAM;
- ``Trainer + HybridAdam f=1.0 + act. offload``: the same and ``activation_offload=True``
  (``offload_activations`` over the decoder layers, layers ``"auto"``: it measures on the
  first two forwards, so ``--warmup`` must be >= 2);
- ``plain loop + ...``: the same three setups in a hand-written loop (autocast, backward,
  Trainer's clip (``clip_grad_norm_`` for AdamW, ``max_grad_norm`` inside HybridAdam), step, the
  same LR schedule), to show what Trainer itself costs; the line under the table gives each
  Trainer row's step time over its plain-loop row's;
- ``Trainer + DeepSpeed ZeRO-2 (offload_optimizer cpu)``: the stock Trainer with
  ``TrainingArguments(deepspeed=...)``: ZeRO stage 2, ``offload_optimizer`` on pinned cpu, its
  ``"auto"`` values filled from the same arguments (batch, clip 1.0, ...), Trainer's own AdamW
  and weight decay groups, which Accelerate turns into ``DeepSpeedCPUAdam`` in AdamW mode
  (Note [bench hf ZeRO-2 optimizer]), bf16 as DeepSpeed's ``torch_autocast`` over fp32 weights
  (Note [bench hf ZeRO-2 precision]); a world of one process (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` set for the run, the environment put back after it).
  Run only when ``import deepspeed`` works and its ``cpu_adam`` op builds (before the timed
  rounds: the build does not count); else the row says ``(not run: ...)`` and why, and the
  exit status does not count it. On the CPU it runs through DeepSpeed's CPU accelerator.

Model: a Llama from a config, TinyLlama-1.1B's shape by default (22 layers, width 2048, MLP 5632,
32 heads, 4 KV heads, vocabulary 32000), fp32 weights with bf16 autocast (Trainer's
``bf16=True``) on CUDA, fp32 on the CPU; batches of ``--batch`` x ``--seq`` tokens whose labels
are a fixed function of the previous token (learnable: the loss falls). Each run is
``--warmup`` + ``--steps`` optimizer steps, ``--repeats`` runs per row, repeat-major (every row's
first run, then every row's second, ...), so that a time budget cut leaves whole rounds.

Columns: ``ms/step`` is the median over runs of each run's median step time, a step being the
interval between two consecutive optimizer step ends after a device sync (all that Trainer or
the loop does per step: data, forward, backward, clip, optimizer, schedule, logging);
``spread`` the min-max of those run medians; ``tok/s`` = tokens per step / median step time;
``peak GiB`` is ``torch.cuda.max_memory_allocated`` over the timed steps (2^30 bytes; ``-`` on
the CPU), the largest over runs; ``x`` the step time over ``Trainer + AdamW``'s;
``max |dloss|`` the largest difference, over steps and runs, between a run's per-step losses and
the first ``Trainer + AdamW`` run's; ``equal loss`` says ``yes`` when that is within
``max(4 x AdamW's own run-to-run difference, 1e-4 x loss)`` (HybridAdam steps offloaded
chunks with the CPU kernel, an ulp from the CUDA one, so the losses are equal to that, not bit
for bit; the exactness is shown on the CPU by tests/integrations).

    python examples/bench_hf_trainer.py                       # H200: about 5 minutes
    python examples/bench_hf_trainer.py --layers 2 --hidden 64 --intermediate 128 --heads 4 \\
        --kv-heads 2 --vocab 128 --seq 32 --batch 2 --steps 2 --repeats 1   # CPU smoke run

Exit status: 0 when every row that ran has equal loss (a row not run for want of DeepSpeed does
not count), 1 if not, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from tiermem.apps.bench.deepspeed_env import build_cpu_adam, import_deepspeed, single_process_env

ZERO2 = "Trainer + DeepSpeed ZeRO-2 (offload_optimizer cpu)"
ROWS = ("Trainer + AdamW", "Trainer + HybridAdam f=1.0",
        "Trainer + HybridAdam f=1.0 + act. offload", "plain loop + HybridAdam f=1.0",
        "plain loop + AdamW", "plain loop + HybridAdam f=1.0 + act. offload", ZERO2)
NAME_W = 52  # the setup column's width


@dataclass
class Run:
    """One run's per-step times (s), per-step losses and peak GPU bytes (None on the CPU)."""
    step_s: list[float]
    losses: list[float]
    peak_bytes: int | None


@dataclass
class Row:
    """A row's runs, or why it is not run (``missing``: the ZeRO-2 row without DeepSpeed)."""
    name: str
    runs: list[Run] = field(default_factory=list)
    missing: str = ""


def device() -> torch.device:
    """The current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (timing only; a no-op on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # a step's time must include its GPU work


def build_model(args: argparse.Namespace, dev: torch.device):
    """The seeded Llama, built on ``dev`` (fast on a GPU), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.seq)
    torch.manual_seed(0)
    with dev:
        return LlamaForCausalLM(config)


def batches(args: argparse.Namespace) -> list[dict]:
    """``(warmup + steps) * batch`` samples of ``seq`` tokens (CPU tensors); label ``t`` is
    ``(7 * token[t-1] + 3) % vocab``, so the loss can fall."""
    n = (args.warmup + args.steps) * args.batch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (n, args.seq), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 1:] = (ids[:, :-1] * 7 + 3) % args.vocab
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]


def zero2_config(dev: torch.device) -> dict:
    """The ZeRO-2 row's DeepSpeed config: stage 2, the optimizer state on pinned cpu, Trainer's
    values where DeepSpeed takes ``"auto"`` (micro-batch, accumulation, clip), bf16 autocast over
    fp32 weights on CUDA (Note [bench hf ZeRO-2 precision]); no ``optimizer`` or ``scheduler``
    section: Trainer's own (Note [bench hf ZeRO-2 optimizer])."""
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 1 << 30,
        "zero_optimization": {"stage": 2,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "torch_autocast": {"enabled": dev.type == "cuda", "dtype": "bfloat16",
                           "lower_precision_safe_modules": []},
    }


def training_args(args: argparse.Namespace, out: str, dev: torch.device, zero2: bool = False):
    """Trainer's arguments: linear schedule, clip 1.0, a log every step, the samples in order
    where this transformers has ``train_sampling_strategy`` (else see :func:`in_order`);
    ``zero2``: the same through DeepSpeed (:func:`zero2_config`: bf16 from its config, the
    device from its accelerator)."""
    from transformers import TrainingArguments
    order = ({"train_sampling_strategy": "sequential"}
             if "train_sampling_strategy" in TrainingArguments.__dataclass_fields__ else {})
    if zero2:
        where = dict(bf16=False, use_cpu=False, deepspeed=zero2_config(dev))
    else:
        where = dict(bf16=dev.type == "cuda", use_cpu=dev.type != "cuda")
    return TrainingArguments(
        **order, **where, output_dir=out, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=args.warmup + args.steps, learning_rate=args.lr, weight_decay=0.1,
        warmup_steps=1, lr_scheduler_type="linear", max_grad_norm=1.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, logging_steps=1, save_strategy="no", report_to=[],
        optim="adamw_torch_fused", disable_tqdm=True, seed=0, dataloader_num_workers=0)


def in_order(trainer) -> None:
    """Samples in order (as the plain loop takes them) on a transformers without
    ``train_sampling_strategy``: its sampler method replaced on this trainer."""
    if getattr(trainer.args, "train_sampling_strategy", None) != "sequential":
        data = trainer.train_dataset
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(data)


class StepClock:
    """Trainer callback: a timestamp at every optimizer step's end (after a device sync); the
    peak memory counter reset at the end of the last warmup step."""

    def __init__(self, dev: torch.device, warmup: int):
        self.dev, self.warmup, self.stamps = dev, warmup, []

    def stamp(self, step: int) -> None:
        sync(self.dev)
        self.stamps.append(time.perf_counter())
        if step == self.warmup and self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)

    def result(self, losses: list[float]) -> Run:
        """The timed steps' intervals (after the warmup steps), the losses, the peak."""
        times = [b - a for a, b in zip(self.stamps[self.warmup - 1:], self.stamps[self.warmup:])]
        peak = torch.cuda.max_memory_allocated(self.dev) if self.dev.type == "cuda" else None
        return Run(times, losses, peak)


def run_trainer(args: argparse.Namespace, row: str, dev: torch.device) -> Run:
    """One Trainer run of ``row``."""
    from transformers import PrinterCallback, Trainer, TrainerCallback

    from tiermem.integrations.hf import TiermemTrainer

    clock = StepClock(dev, args.warmup)

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            clock.stamp(state.global_step)

    model = build_model(args, dev)
    # ZeRO-2: a world of one for the run. The process group DeepSpeed initialises stays (its
    # cached groups outlive a destroyed one and fail the next engine); the environment is put
    # back, so the other rows' Trainer is neither DeepSpeed nor DDP (checked below).
    with tempfile.TemporaryDirectory() as out, \
            single_process_env() if row == ZERO2 else contextlib.nullcontext():
        kw = dict(model=model, args=training_args(args, out, dev, zero2=row == ZERO2),
                  train_dataset=batches(args), callbacks=[Clock()])
        if row in ("Trainer + AdamW", ZERO2):
            trainer = Trainer(**kw)
        else:
            trainer = TiermemTrainer(**kw, hybrid_adam={"offload_fraction": 1.0},
                                     activation_offload=row.endswith("act. offload"))
        in_order(trainer)
        trainer.remove_callback(PrinterCallback)  # the table says it all
        trainer.train()
        kind = str(trainer.accelerator.distributed_type).rsplit(".", 1)[-1]
        if kind != ("DEEPSPEED" if row == ZERO2 else "NO"):
            raise RuntimeError(f"{row}: Trainer ran as {kind}, not as the row means")
        if row == ZERO2:  # its pinned buffers and hooks go now, not at some later collection
            trainer.model_wrapped.destroy()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = clock.result(losses)
    if getattr(trainer, "hybrid_adam", None) is not None:
        trainer.hybrid_adam.close()
    del trainer, model
    return result


def run_loop(args: argparse.Namespace, row: str, dev: torch.device) -> Run:
    """One plain-loop run of ``row``: Trainer's groups (no decay for the norms), its schedule
    and clip, bf16 autocast on CUDA, a loss read every step as Trainer logs it."""
    from transformers import get_linear_schedule_with_warmup

    from tiermem.integrations.layers import find_decoder_layers
    from tiermem.offload import offload_activations
    from tiermem.optim import HybridAdam

    model = build_model(args, dev)
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    hybrid = "HybridAdam" in row
    if hybrid:
        opt = HybridAdam(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=1.0,
                         offload_fraction=1.0)
    else:  # Trainer's optim="adamw_torch_fused" (the fused kernel needs the params' device)
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                fused=dev.type == "cuda")
    offloader = (offload_activations(find_decoder_layers(model))
                 if row.endswith("act. offload") else None)
    sched = get_linear_schedule_with_warmup(opt, 1, args.warmup + args.steps)
    data = batches(args)
    clock, losses = StepClock(dev, args.warmup), []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    for step in range(1, args.warmup + args.steps + 1):
        chunk = data[(step - 1) * args.batch: step * args.batch]
        batch = {k: torch.stack([s[k] for s in chunk]).to(dev, non_blocking=True)
                 for k in ("input_ids", "labels")}
        with offloader if offloader is not None else contextlib.nullcontext():
            with autocast:  # forward and backward in the offload context, as Trainer's step
                loss = model(**batch).loss
            loss.backward()
        if not hybrid:  # HybridAdam clips inside its step (max_grad_norm)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        clock.stamp(step)
    if offloader is not None:
        offloader.close()
    if hybrid:
        opt.close()
    del opt, model
    return clock.result(losses)


def _median_ms(row: Row) -> float:
    """The median over ``row``'s runs of each run's median step time, in ms."""
    return statistics.median(statistics.median(r.step_s) for r in row.runs) * 1e3


def table(rows: list[Row], tokens: int) -> list[str]:
    """The table's lines (see the module docstring for the columns)."""
    base = rows[0]
    ref = base.runs[0].losses
    noise = max((abs(a - b) for r in base.runs[1:] for a, b in zip(r.losses, ref)), default=0.0)
    base_ms = statistics.median(statistics.median(r.step_s) for r in base.runs) * 1e3
    lines = [f"{'setup':<{NAME_W}}{'tok/step':>9}{'ms/step':>9}{'spread':>15}{'tok/s':>9}"
             f"{'peak GiB':>9}{'x':>7}{'max |dloss|':>13}  equal loss"]
    for row in rows:
        if not row.runs:
            lines.append(f"{row.name:<{NAME_W}}  ({row.missing or 'no run: time budget'})")
            continue
        meds = [statistics.median(r.step_s) * 1e3 for r in row.runs]
        ms = statistics.median(meds)
        peaks = [r.peak_bytes for r in row.runs if r.peak_bytes is not None]
        peak = f"{max(peaks) / 2**30:.1f}" if peaks else "-"
        dloss = max(abs(a - b) for r in row.runs for a, b in zip(r.losses, ref))
        tol = max(4 * noise, 1e-4 * max(abs(x) for x in ref))
        same = all(len(r.losses) == len(ref) for r in row.runs) and dloss <= tol
        lines.append(f"{row.name:<{NAME_W}}{tokens:>9}{ms:>9.1f}"
                     f"{f'{min(meds):.1f}-{max(meds):.1f}':>15}{tokens / ms * 1e3:>9.0f}"
                     f"{peak:>9}{ms / base_ms:>6.2f}x{dloss:>13.2e}  "
                     f"{'yes' if same else 'NO'} (tol {tol:.1e})")
    plain = {r.name.removeprefix("plain loop + "): r for r in rows
             if r.runs and r.name.startswith("plain loop + ")}
    ratios = [f"{r.name.removeprefix('Trainer + ')} {_median_ms(r) / _median_ms(plain[k]):.2f}x"
              for r in rows if r.runs and (k := r.name.removeprefix("Trainer + ")) in plain
              and r.name.startswith("Trainer + ")]
    if ratios:
        lines.append(f"Trainer's step time over the plain loop's: {', '.join(ratios)}")
    lines.append(f"runs per row: {[len(r.runs) for r in rows]}; AdamW's run-to-run max |dloss|: "
                 f"{noise:.2e}; losses of the first AdamW run: "
                 f"{', '.join(f'{x:.4f}' for x in ref)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the rows and print the table; the exit status as the module docstring says."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step (no accumulation)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (>= 2: auto offload)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=",".join(str(i) for i in range(len(ROWS))),
                   help="row numbers to run, 0 first (0 = Trainer + AdamW, always run)")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="start no round of runs that would end past this many seconds (as "
                        "long as the last round took)")
    args = p.parse_args(argv)
    try:
        wanted = sorted({0} | {int(i) for i in args.rows.split(",") if i.strip()})
    except ValueError:
        print(f"bench_hf_trainer: error: --rows={args.rows!r} must be row numbers like 0,1,3",
              file=sys.stderr)
        return 2
    if args.warmup < 2 or args.steps < 1 or args.repeats < 1 or wanted[-1] >= len(ROWS):
        print(f"bench_hf_trainer: error: need --warmup >= 2 (got {args.warmup}), --steps >= 1 "
              f"(got {args.steps}), --repeats >= 1 (got {args.repeats}) and rows < {len(ROWS)} "
              f"(got {args.rows})", file=sys.stderr)
        return 2
    dev = device()
    rows = [Row(ROWS[i]) for i in wanted]
    n_params = sum(p.numel() for p in build_model(args, torch.device("meta")).parameters())
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"bench_hf_trainer: Llama {n_params / 1e9:.2f}B params, {args.layers} layers x "
          f"{args.hidden}, batch {args.batch} x {args.seq} tokens, "
          f"{'fp32 weights + bf16 autocast' if dev.type == 'cuda' else 'fp32'}, on {name}; "
          f"{args.warmup} warmup + {args.steps} timed steps, {args.repeats} runs a row",
          flush=True)
    for row in rows:
        if row.name == ZERO2:  # before the budget's clock starts
            row.missing = zero2_missing()
    start = last = time.perf_counter()
    for rep in range(args.repeats):
        now = time.perf_counter()
        if rep and now - start + (now - last) > args.budget_s:  # another round would not fit
            print(f"time budget {args.budget_s:.0f} s: {rep} round(s) run, another would end "
                  f"past it", flush=True)
            break
        last = now
        for row in rows:
            if row.missing:
                continue
            t0 = time.perf_counter()
            run = run_loop(args, row.name, dev) if row.name.startswith("plain") else \
                run_trainer(args, row.name, dev)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            row.runs.append(run)
            print(f"  run {rep + 1} {row.name}: {statistics.median(run.step_s) * 1e3:.1f} "
                  f"ms/step, losses {', '.join(f'{x:.4f}' for x in run.losses)} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    lines = table(rows, args.batch * args.seq)
    print("\n".join(lines), flush=True)
    return 0 if all(" yes " in line for row, line in zip(rows, lines[1:]) if not row.missing) \
        else 1


def zero2_missing() -> str:
    """Why the ZeRO-2 row cannot run (``"not run: ..."``), or ``""`` with DeepSpeed imported
    and its ``cpu_adam`` op built (printed: the seconds the build took, outside every run)."""
    deepspeed, why = import_deepspeed()
    if deepspeed is None:
        return f"not run: deepspeed not importable: {why}"
    try:
        seconds = build_cpu_adam()
    except Exception as exc:  # noqa: BLE001  (no compiler, no ninja, no CUDA_HOME: the row says)
        first = (str(exc).splitlines() or [""])[0]  # a build log can be long
        return f"not run: DeepSpeed's cpu_adam op did not build: {type(exc).__name__}: {first}"
    print(f"deepspeed {deepspeed.__version__}: DeepSpeedCPUAdam's op ready in {seconds:.0f} s "
          f"(before the timed rounds)", flush=True)
    return ""


if __name__ == "__main__":
    sys.exit(main())
