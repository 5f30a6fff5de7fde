"""What :func:`tiermem.apps.plan.plan` returns: a :class:`Plan` (rows of bytes per tier, the
verdict,
the predicted step) with its table, and the notes it adds: how to configure a placement that
fits, or what would make one fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tiermem.names import MOMENTS_DTYPES
from tiermem.optim.layout import gpu_side_state_bytes, state_numel
from tiermem.apps.plan.memory import host_buffer_bytes, short_dtype
from tiermem.shapes import GiB
from tiermem.apps.plan.timing import StepTime, step_time_lines


@dataclass
class Item:
    """One row of the plan: bytes of one part of the training state per tier."""

    name: str
    gpu: int = 0
    host: int = 0
    nvme: int = 0
    note: str = ""


@dataclass
class Plan:
    """The placement and the verdict. All sizes in bytes.

    Attributes:
        num_params: all parameters (what weights, gradients and optimizer state are sized by).
        active_params: parameters one token uses (what compute per token scales with): fewer
            than ``num_params`` for an MoE (``top_k`` of ``n_experts`` experts), equal for a
            dense model.
        fits: every tier within its capacity.
        offload_fraction: chosen (or given) fraction of optimizer state off the GPU.
        state_tier: ``"cpu"``, ``"nvme"`` or ``"split"``: where the offloaded state lives.
        offload_layers: blocks whose activations go to the host tier.
        items: the rows (what goes where).
        capacity, used: per tier (``"gpu"``, ``"host"``, ``"nvme"``).
        reasons: why it does not fit (empty when it fits).
        notes: hints (how to configure it, what else would fit).
        inputs: the arguments the plan was made from (canonical spellings).
        step_time: the predicted time per optimizer step of this placement
            (:class:`StepTime`; also when it does not fit, though the table then omits it).
        breadth_first_blocks: blocks run for every micro-batch first (given, or chosen for
            ``"auto"``; Note [breadth-first blocks]).
        stream: the weight stream (:class:`tiermem.apps.plan.streaming.StreamPlan`: resident and
            streamed blocks, buffers, home, schedule; Note [streaming plan]), or None: every
            weight on the GPU.
    """

    num_params: int
    active_params: int
    fits: bool
    offload_fraction: float
    state_tier: str
    offload_layers: int
    checkpoint: bool
    items: list[Item]
    capacity: dict[str, int]
    used: dict[str, int]
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)
    step_time: StepTime | None = None
    breadth_first_blocks: int = 0
    stream: object | None = None

    def to_dict(self) -> dict:
        """Plain-data form (for ``--json``)."""
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The human-readable plan: a table of parts per tier, totals, verdict and notes."""
        def gb(n: int) -> str:  # one unit everywhere in the output: GiB (2^30 bytes)
            return f"{n / GiB:,.1f} GiB" if n else "-"
        rows = [("part", "GPU", "host RAM", "NVMe", "")]
        rows += [(i.name, gb(i.gpu), gb(i.host), gb(i.nvme), i.note) for i in self.items]
        rows.append(("total", gb(self.used["gpu"]), gb(self.used["host"]),
                     gb(self.used["nvme"]), ""))
        rows.append(("capacity", gb(self.capacity["gpu"]), gb(self.capacity["host"]),
                     gb(self.capacity["nvme"]), ""))
        free = {t: self.capacity[t] - self.used[t] for t in self.capacity}
        rows.append(("free", *(f"{free[t] / GiB:,.1f} GiB" for t in ("gpu", "host", "nvme")), ""))
        width = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for n, r in enumerate(rows):
            cells = [r[0].ljust(width[0])] + [r[i].rjust(width[i]) for i in (1, 2, 3)]
            lines.append("  ".join(cells) + (f"  {r[4]}" if r[4] else ""))
            if n == 0 or n == len(self.items):
                lines.append("-" * len(lines[-1]))
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        where = f" (state_tier={self.state_tier})" if self.offload_fraction else ""
        head = (f"{self.num_params / 1e9:.2f}B params: {verdict} with optimizer state "
                f"{self.offload_fraction:.0%} off the GPU{where}, "
                f"activations of {self.offload_layers} blocks offloaded"
                f"{', checkpointing' if self.checkpoint else ''}")
        out = [head]
        if self.stream is not None:
            out.append(stream_summary(self.stream))
        moe = self.inputs.get("n_experts")
        if moe:
            out.append(f"parameters: {self.num_params / 1e9:.2f}B in total (weights, gradients, "
                       f"optimizer state: all {moe} experts), {self.active_params / 1e9:.2f}B "
                       f"active per token (top-{self.inputs['top_k']}: the compute per token)")
        out += [""] + lines
        if self.fits and self.step_time is not None:
            out += [""] + step_time_lines(self.step_time, batch=self.inputs.get("batch"),
                                          seq=self.inputs.get("seq"), checkpoint=self.checkpoint)
        out += [""] + [f"does not fit: {r}" for r in self.reasons]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out).rstrip() + "\n"


def overflow(p: Plan) -> tuple[int, int]:
    over = {t: max(0, p.used[t] - p.capacity[t]) for t in p.capacity}
    return over["gpu"], sum(over.values())


def add_notes(pl: Plan, n: int, cap: dict, host_reserve: int, param_dt: torch.dtype,
               moments_dtype: str, optimizer: dict) -> None:
    """Add the configuration (fits) or the hints (does not fit) to ``pl.notes``;
    ``moments_dtype`` is a canonical name, ``optimizer`` HybridAdam's ``chunk_numel`` and
    ``nvme_lookahead_chunks``."""
    f = pl.offload_fraction
    p = param_dt.itemsize
    if pl.fits:
        cfg = [f"optimizer.offload_fraction={f:g}"]
        if f > 0:
            cfg.append(f"optimizer.state_tier={pl.state_tier}")
        if moments_dtype != "float32":
            cfg.append(f"optimizer.moments_dtype={moments_dtype}")
        if f > 0 and pl.inputs.get("gpu_step_fraction"):
            cfg.append(f"optimizer.gpu_step_fraction={pl.inputs['gpu_step_fraction']:g}")
        cfg.append(f"activations.enabled={'true' if pl.offload_layers else 'false'}")
        if pl.offload_layers:
            cfg.append(f"activations.num_layers={pl.offload_layers}")
        if pl.state_tier == "nvme" and f > 0:
            cfg.append("store.nvme_dir=/path/on/ssd")
        if pl.breadth_first_blocks:
            cfg.append(f"train.breadth_first_blocks={pl.breadth_first_blocks}")
        pl.notes.append("configure: " + " ".join(cfg))
        if pl.stream is not None:
            pl.notes.append(stream_configure(pl.stream))
        if f == 0 and not pl.offload_layers:
            pl.notes.append("fits on the GPU alone: tiermem is not needed for memory "
                            "(offload only costs time here)")
        return
    over = {t: pl.used[t] > cap[t] for t in cap}
    if pl.stream is not None:
        if over["host"] or over["nvme"]:
            pl.notes.append(stream_host_hint(pl, moments_dtype))
        return
    if over["gpu"]:
        if f < 1.0:
            bf16 = "" if moments_dtype != "float32" else (
                f", or use bf16 moments (--moments-dtype bf16, optimizer.moments_dtype=bfloat16: "
                f"the GPU-side state falls from {gpu_side_state_bytes(1, param_dt, torch.float32)}"
                f" to {gpu_side_state_bytes(1, param_dt, torch.bfloat16)} B/param)")
            pl.notes.append(f"the GPU overflows: raise the offload fraction (now {f:g}; "
                            f"--offload-fraction auto finds the least that fits) or offload "
                            f"activations{bf16}")
        else:
            pl.notes.append("the GPU overflows even with all optimizer state off it: offload "
                            "activations (activations.num_layers), use checkpointing, a smaller "
                            "micro-batch or shorter sequences; parameters and gradients "
                            f"themselves take {2 * p * n / GiB:,.0f} GiB")
    if (over["host"] or over["nvme"]) and f > 0:
        if f == 1.0:  # could the offloaded state fit anywhere at all? (RAM + NVMe together)
            total = cap["host"] + cap["nvme"]
            for name in MOMENTS_DTYPES:
                moments = getattr(torch, name)
                per = 4 * state_numel(1, moments)
                need = n * per
                # state_tier="split": the pinned rings and the NVMe staging stay in RAM
                buffers = sum(host_buffer_bytes(n, optimizer["chunk_numel"], param_dt, moments,
                                                optimizer["nvme_lookahead_chunks"], "split"))
                both = max(0, cap["host"] - host_reserve - buffers) + cap["nvme"]
                if need > total:
                    verdict = f"more than RAM + NVMe together ({total / GiB:,.0f} GiB): no " \
                              f"placement fits"
                elif need > both:
                    verdict = f"RAM + NVMe hold {both / GiB:,.0f} GiB after the pinned " \
                              f"staging ({buffers / GiB:,.1f} GiB) and the host reserve: no " \
                              f"placement fits"
                else:
                    verdict = f"RAM + NVMe hold it ({both / GiB:,.0f} GiB after staging) split " \
                              f"between them: optimizer.state_tier=split"
                pl.notes.append(f"with {short_dtype(name)} moments the optimizer state of all "
                                f"{n / 1e9:.1f}B params is {need / GiB:,.0f} GiB ({per} B/param): "
                                f"{verdict}")
        elif moments_dtype == "float32":
            pl.notes.append(f"the offloaded state overflows its tier: bf16 moments "
                            f"(--moments-dtype bf16, optimizer.moments_dtype=bfloat16) cut it "
                            f"from 12 to 8 B/param, and the GPU side's from "
                            f"{gpu_side_state_bytes(1, param_dt, torch.float32)} to "
                            f"{gpu_side_state_bytes(1, param_dt, torch.bfloat16)} B/param, so "
                            f"the GPU may keep more of it (--offload-fraction auto finds the "
                            f"least that fits); or lower the offload fraction if the GPU has "
                            f"room")


def stream_summary(stream) -> str:
    """One line under the plan's head for a :class:`tiermem.apps.plan.streaming.StreamPlan`: how
    many blocks stream, from where, with how many buffers, on which schedule.

    Raises:
        nothing: formatting.
    """
    home = "pinned RAM" if stream.tier == "cpu" else "NVMe"
    many = "es" if stream.micro_batches > 1 else ""
    default = " (the default; with one micro-batch the same as depth-first)" \
        if stream.schedule == "block-major" else ""
    return (f"weights of {len(stream.streamed)} of {stream.n_blocks} blocks streamed from "
            f"{home} ({len(stream.resident)} resident, {stream.buffer_blocks} GPU buffers, "
            f"prefetch {stream.prefetch_blocks}), {stream.schedule} over "
            f"{stream.micro_batches} micro-batch{many}{default}; a prediction (the 8B "
            f"preset's H200 run took 4-13 % longer than its plan: docs/benchmarks.md)")


def stream_configure(stream) -> str:
    """The note that says how to run a streaming plan that fits: ``stream_weights``' arguments
    (its ``gpu_bytes`` counts the resident blocks' and the buffers' weights) and the store's
    RAM for the streamed weights.

    Raises:
        nothing: formatting.
    """
    store = (f"the store's cpu_bytes at least {stream.streamed_bytes / GiB:,.1f} GiB (the "
             f"streamed weights)" if stream.tier == "cpu" else
             "the store's nvme_dir on the NVMe and cpu_bytes at least the staging row")
    return (f"stream: stream_weights(model.blocks, store=..., tier={stream.tier!r}, "
            f"prefetch_blocks={stream.prefetch_blocks}, gpu_bytes={stream.stream_gpu_bytes}) "
            f"({stream.stream_gpu_bytes / GiB:,.1f} GiB: the last {len(stream.resident)} "
            f"blocks resident + {stream.buffer_blocks} buffers), {store}; the plan assumes "
            f"HybridAdam steps the streamed weights on the host (tested exact on the CPU and "
            f"within noise on an H200) and the "
            f"{stream.schedule} schedule (docs/streaming.md)")


def stream_host_hint(pl: Plan, moments_dtype: str) -> str:
    """What the host side of a streaming plan holds and what would make it fit.

    Raises:
        nothing: formatting.
    """
    rows = {i.name: i for i in pl.items}
    held = " + ".join(f"{name} {(rows[name].host + rows[name].nvme) / GiB:,.1f} GiB"
                      for name in ("parameters", "gradients", "optimizer state, offloaded")
                      if name in rows)
    bf16 = ", bf16 moments (--moments-dtype bf16: 8 B/param of state instead of 12)" \
        if moments_dtype == "float32" else ""
    return (f"with streamed weights the host side holds {held} (the streamed blocks' weights "
            f"and gradients, every offloaded parameter's state): more RAM or NVMe (the state "
            f"splits RAM + NVMe; trained weights keep a RAM host copy even on an NVMe home: "
            f"Note [streamed RAM count]){bf16}, or a "
            f"larger --gpu-bytes (more blocks stay resident)")
