"""The command-line flags of ``tiermem plan``, ``tiermem tune``, examples/train_large.py, every
``tiermem bench ...`` and ``tiermem demo``, each mapped to the configuration field it sets
(Note [one definition] in tiermem/options.py).

Note [which flags map]: a flag is in :data:`FLAGS` when its value is a value of one
configuration field: the command puts it in that field or passes it as that field's keyword
(``HybridAdam(cpu_threads=...)``, ``StoreConfig(nvme_dir=...)``), alone or as a
comma-separated grid of the field's values (``tiermem tune --offload-fraction 0,0.5``,
``tiermem bench optim --grad-accumulation-steps 1,4``). Every other flag stays local to its
command, in :data:`UNMAPPED` with the reason: the model's shape, a benchmark's or the grid's
own knobs (``--steps`` timed steps, ``--repeats``, ``--warmup``, ``--only``), a switch that
sets a field to one fixed value or inverts it (``tiermem demo --no-progress``), a choice of
rows, output options. The commands spell one field with one flag (``--gpu-bytes`` is
``budgets.gpu_bytes`` in every command); a flag spells one field, but for the few in
:data:`SHARED`, where the same user-facing value lands in sibling fields. The spellings the
commands used before stay as deprecated aliases (:data:`ALIASES`): they still work and log a
warning naming the flag to use.

A flag that sets a field takes its default (for its command's user, :data:`USER`) and its
check from the field's definition: ``tiermem plan`` and ``tiermem tune`` check it as they
parse, the others where the value reaches the field (the section's dataclass, HybridAdam,
offload_activations, StoreConfig). A benchmark's flag may give its own default (a CPU-sized or
an H200-sized run), beside the field's check. tests/test_options.py checks every flag of every
parser is in one of the tables, one spelling per field, that each mapped flag of ``plan`` and
``tune`` defaults to its field and that a bad value is refused with the field's own message.
"""

from __future__ import annotations

import argparse
import logging
import weakref
from typing import Any

from tiermem import options
from tiermem.names import format_bytes

logger = logging.getLogger("tiermem")

FLAGS: dict[str, dict[str, str]] = {
    "plan": {
        "--gpu-bytes": "budgets.gpu_bytes", "--host-bytes": "budgets.host_bytes",
        "--nvme-bytes": "budgets.nvme_bytes", "--gpu-reserve": "budgets.gpu_reserve_bytes",
        "--host-reserve": "budgets.host_reserve_bytes",
        "--moments-dtype": "optimizer.moments_dtype",
        "--offload-fraction": "optimizer.offload_fraction",
        "--state-tier": "optimizer.state_tier",
        "--gpu-step-fraction": "optimizer.gpu_step_fraction",
        "--max-grad-norm": "optimizer.max_grad_norm", "--param-sync": "optimizer.param_sync",
        "--rollback-bytes": "optimizer.rollback_bytes",
        "--offload-layers": "activations.num_layers", "--activation-tier": "activations.tier",
        "--prefetch-depth": "activations.prefetch_depth", "--checkpoint": "train.checkpoint",
        "--grad-accumulation-steps": "train.grad_accumulation_steps",
        "--breadth-first-blocks": "train.breadth_first_blocks",
        "--stream-weights": "streaming.enabled", "--stream-tier": "streaming.tier",
        "--prefetch-blocks": "streaming.prefetch_blocks",
        "--stream-schedule": "streaming.schedule",
    },
    "tune": {
        "--gpu-bytes": "budgets.gpu_bytes", "--host-bytes": "budgets.host_bytes",
        "--offload-layers": "activations.num_layers",
        "--prefetch-depth": "activations.prefetch_depth",
        "--offload-fraction": "optimizer.offload_fraction",
        "--state-tier": "optimizer.state_tier", "--cpu-threads": "optimizer.cpu_threads",
        "--policy": "store.policy", "--prefetch-lookahead": "store.prefetch_lookahead",
    },
    "train_large": {  # None: the preset's value (each checked by its section's class)
        "--gpu-bytes": "budgets.gpu_bytes", "--steps": "train.steps",
        "--grad-accumulation-steps": "train.grad_accumulation_steps",
        "--gpu-step-fraction": "optimizer.gpu_step_fraction",
        "--chunk-numel": "optimizer.chunk_numel",
        "--breadth-first-blocks": "train.breadth_first_blocks",
        "--param-sync": "optimizer.param_sync", "--nvme-dir": "store.nvme_dir",
    },
    # ---- the applications' own commands (Note [which flags map]); tiermem bench lora,
    # adam and transfer set no configuration field
    "bench activations": {
        "--offload-layers": "activations.num_layers",  # a grid: the extra rows' values
        "--prefetch-depth": "activations.prefetch_depth", "--nvme-dir": "store.nvme_dir",
        "--nvme-bytes": "store.nvme_bytes", "--cpu-bytes": "store.cpu_bytes",
    },
    "bench graphs": {"--offload-fraction": "optimizer.offload_fraction",
                     "--cpu-threads": "optimizer.cpu_threads"},
    "bench io": {"--io-chunk-bytes": "store.io_chunk_bytes",
                 "--io-threads": "store.io_threads"},  # a grid: the posix/kvikio rows'
    "bench lora": {},
    "bench optim": {
        "--grad-accumulation-steps": "train.grad_accumulation_steps",  # a grid
        "--max-grad-norm": "optimizer.max_grad_norm",  # a grid, "off" for None
        "--rollback-bytes": "optimizer.rollback_bytes", "--nvme-dir": "optimizer.nvme_dir",
        "--cpu-threads": "optimizer.cpu_threads",
    },
    "bench stream": {
        "--grad-accumulation-steps": "train.grad_accumulation_steps",
        "--stream-tier": "streaming.tier", "--prefetch-blocks": "streaming.prefetch_blocks",
        "--stream-schedule": "streaming.schedule", "--checkpoint": "train.checkpoint",
        "--nvme-dir": "store.nvme_dir", "--gpu-bytes": "budgets.gpu_bytes",
        "--max-grad-norm": "optimizer.max_grad_norm",  # a grid, "off" for None
        "--rollback-bytes": "optimizer.rollback_bytes",
    },
    "bench adam": {},
    "bench transfer": {},
    "demo": {
        "--steps": "train.steps", "--batch": "train.micro_batch", "--device": "train.device",
        "--tolerance": "train.tolerance", "--seed": "train.seed",
        "--log-every": "train.log_every", "--offload-fraction": "optimizer.offload_fraction",
        "--nvme-dir": "store.nvme_dir",
    },
}
"""Command -> flag -> the dotted configuration field it sets."""

SHARED: dict[str, str] = {
    "--nvme-dir": "the spill directory: store.nvme_dir, or optimizer.nvme_dir where the command "
                  "gives HybridAdam no store (tiermem bench optim)",
    "--nvme-bytes": "the NVMe bytes a run may use: the planner's budgets.nvme_bytes, or "
                    "store.nvme_bytes where the command builds the store (tiermem bench "
                    "activations)",
}
"""Flag -> why it spells more than one field (each command maps it to one of them)."""

ALIASES: dict[str, dict[str, str]] = {
    "plan": {"--gpu": "--gpu-bytes", "--host": "--host-bytes", "--nvme": "--nvme-bytes"},
    "tune": {"--gpu-budget": "--gpu-bytes", "--cpu-budget": "--host-bytes",
             "--num-layers": "--offload-layers"},
    "train_large": {"--gpu": "--gpu-bytes"},
    "bench activations": {"--num-layers": "--offload-layers"},
    "bench io": {"--chunk-bytes": "--io-chunk-bytes", "--threads": "--io-threads"},
    "bench optim": {"--accum": "--grad-accumulation-steps", "--clip": "--max-grad-norm"},
    "bench stream": {"--micro-batches": "--grad-accumulation-steps", "--tier": "--stream-tier",
                     "--schedule": "--stream-schedule", "--gpu": "--gpu-bytes"},
}
"""Command -> deprecated flag -> the flag that replaces it (the same field, the same value)."""

_BATCH = "sequences per micro-batch of the benchmark's own loop, which builds no train.micro_batch"
_SHAPE = dict.fromkeys(("--layers", "--d-model", "--heads", "--seq", "--vocab"),
                       "the benchmark model's shape, not a configuration field") | {
                           "--batch": _BATCH}
_TIMING = {"--steps": "timed steps per row (a benchmark's own, not train.steps)",
           "--warmup": "untimed steps per row", "--repeats": "runs of every row"}
_DTYPE = "bf16 or fp32 by device (None), not train.dtype's default"

UNMAPPED: dict[str, dict[str, str]] = {
    "plan": dict.fromkeys(
        ("--model-size", "--hf-config", "--params", "--layers", "--d-model", "--heads",
         "--vocab", "--seq", "--batch", "--experts", "--top-k", "--d-expert",
         "--eager-attention"), "the model's shape, not a configuration field")
    | {"--dtype": "the planner sizes any dtype, float16 too (train.dtype refuses it)",
       "--grad-scaler": "the training loop uses a torch.amp.GradScaler, which HybridAdam finds "
                        "at run time (no field says so)",
       "--json": "output format"}
    | dict.fromkeys(("--gpu-tflops", "--gpu-tflops-checkpointed", "--pcie-h2d", "--pcie-d2h",
                     "--pcie-both", "--cpu-adam", "--cpu-adam-bf16", "--nvme-read",
                     "--nvme-write"), "a machine rate (tiermem.rates.MachineRates)"),
    "tune": dict.fromkeys(("--layers", "--d-model", "--heads", "--seq", "--batch", "--vocab"),
                          "the demo GPT's shape, not a configuration field")
    | {"--act-gpu-budget": "a grid of the activation store's gpu budget in blocks' worth or "
                           "bytes (store.gpu_bytes of that store, sized per setting)",
       "--steps": "timed steps per setting", "--warmup": "untimed steps per setting",
       "--nvme-dir": "the tuner's scratch directory (a temporary one by default)",
       "--overlap": "how the cost model sums", "--no-model": "skips the cost model",
       "--dtype": "bf16 or fp32 by device (None), not train.dtype's default",
       "--telemetry-dir": "output directory"},
    "train_large": {"--config": "the preset file", "--dry-run": "only plans",
                    "--tiny": "a tiny model on the CPU"},
    "bench activations": _SHAPE | _TIMING | {
        "--only": "which rows run", "--dtype": _DTYPE,
        "--loss-chunk-tokens": "the model's loss chunking (GPT's loss_chunk_tokens)"},
    "bench graphs": _SHAPE | _TIMING | {"--dtype": _DTYPE},
    "bench io": {
        "--dir": "the disk to measure (the bench makes its scratch directory there)",
        "--nbytes": "bytes moved per row", "--extent-bytes": "bytes per spilled extent",
        "--block-bytes": "the raw row's bytes per system call",
        "--aiofiles-threads": "the aiofiles rows' thread counts (--io-threads is the "
                              "posix/kvikio rows': one field, one spelling)",
        "--repeat": "runs per row"},
    "bench lora": _TIMING | dict.fromkeys(
        ("--preset", "--layers", "--seqs", "--rank"),
        "the model's and the adapters' shape, not a configuration field")
    | {"--batch": _BATCH,
       "--optimizer": "the adapters' optimizer in every row (hybrid or torch's fused adamw), a "
                      "row choice: not streaming.optimizer, examples/train_large.py's"},
    "bench optim": _SHAPE | {k: v for k, v in _TIMING.items() if k != "--warmup"} | {
        "--setups": "the grid of setups, each several fields at once (fraction, tier, ...)",
        "--nvme-steps": "timed steps of the NVMe setups",
        "--world": "processes of the distributed table", "--timeout": "seconds the ranks get"},
    "bench stream": _SHAPE | _TIMING | {
        "--dtype": _DTYPE, "--optimizers": "which rows run (adamw, hybrid)",
        "--probe-bytes": "bytes of the copy that measures the PCIe rate"},
    "bench adam": {"--numel": "params per timed step", "--repeats": "timed steps per row",
                   "--threads": "threads of the timed kernels (torch.set_num_threads), no "
                                "HybridAdam's", "--json": "output format"},
    "bench transfer": {"--nbytes": "bytes per copy", "--repeats": "timed copies per row"},
    "demo": dict.fromkeys(("--layers", "--d-model", "--heads", "--seq", "--vocab"),
                          "the model's shape (the model section), not a configuration field")
    | {"--nvme-activations": "a switch: activations.tier=nvme (with --nvme-dir)",
       "--no-progress": "a switch: train.progress=false"},
}
"""Command -> flag -> why it sets no configuration field (Note [which flags map])."""

USER = {"plan": "plan-cli", "tune": "tune", "train_large": None, "demo": "loop"} | dict.fromkeys(
    ("bench activations", "bench graphs", "bench io", "bench lora", "bench optim",
     "bench stream", "bench adam", "bench transfer"), "api")
"""Command -> the :data:`tiermem.options.USERS` user whose defaults its flags take where they
give none (None: every flag defaults to None, the preset's value). ``tiermem demo`` builds the
training loop's sections; a benchmark calls the library's APIs."""


def field_of(command: str, flag: str) -> options.Option:
    """The configuration field ``flag`` of ``command`` sets."""
    return options.OPTIONS[FLAGS[command][flag]]


def default(command: str, flag: str) -> Any:
    """The default of ``flag`` of ``command``: its field's for the command's user."""
    user = USER[command]
    return None if user is None else field_of(command, flag).default_for(user)


def shown(value: Any) -> str:
    """A default as a help text shows it (byte counts in binary units, grids comma-joined)."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        return format_bytes(value).replace(" ", "")
    return str(value)


_WARNED: set[tuple[str, str]] = set()
"""(command, deprecated flag) already warned about in this process: once is enough."""

_GIVEN: dict[int, tuple[Any, dict[str, str]]] = {}
"""id(namespace) -> (a weak reference to it, dest -> the spelling given in that parse)."""


def _one_spelling(action: argparse.Action, namespace: Any, spelling: str) -> None:
    """Refuse a second spelling of ``action``'s field in one parse (Note [both spellings]).

    Note [both spellings]: a deprecated flag (:data:`ALIASES`) and its new spelling set one
    destination; given both, argparse would keep whichever came last, so ``--gpu 40GB
    --gpu-bytes 80GB`` and ``--gpu-bytes 80GB --gpu 40GB`` would plan for different GPUs with
    only a deprecation warning. Both spellings on one command line are refused (exit 2, naming
    both), whatever their values; one spelling given twice keeps argparse's rule (the last).
    Each parse has its own namespace, so what one parse gave is kept beside it (by id, dropped
    with it), never in the parser.

    Raises:
        argparse.ArgumentError: the field was given in another spelling in this parse.
    """
    key = id(namespace)
    entry = _GIVEN.get(key)
    if entry is None or entry[0]() is not namespace:
        def drop(ref: Any, key: int = key) -> None:
            if _GIVEN.get(key, (None,))[0] is ref:
                del _GIVEN[key]
        try:
            entry = (weakref.ref(namespace, drop), {})
        except TypeError:  # a caller's namespace without weak references: kept on it
            given = vars(namespace).setdefault("_tiermem_spellings", {})
            entry = (lambda: namespace, given)
        else:
            _GIVEN[key] = entry
    other = entry[1].setdefault(action.dest, spelling)
    if other != spelling:
        raise argparse.ArgumentError(action, f"{other} and {spelling} set the same field; "
                                             f"give one of them, not both")


class _Spelled(argparse.Action):
    """The spelling to use of a flag that has deprecated ones: stores its value (as argparse's
    ``store``) after :func:`_one_spelling`'s check."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _one_spelling(self, namespace, option_string)
        setattr(namespace, self.dest, values)


class _Deprecated(argparse.Action):
    """A deprecated spelling of a flag: sets the same destination and logs a warning (once a
    process per spelling); given with the new spelling it is refused (Note [both
    spellings])."""

    def __init__(self, option_strings, dest, *, command: str, new: str, **kwargs) -> None:
        self.command, self.new = command, new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _one_spelling(self, namespace, option_string)
        if (self.command, option_string) not in _WARNED:
            _WARNED.add((self.command, option_string))
            logger.warning("%s: %s is deprecated; use %s (%s)", self.command, option_string,
                           self.new, FLAGS[self.command][self.new])
        setattr(namespace, self.dest, values)


def add(parser: Any, command: str, flag: str, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(flag, **kwargs)`` with the default of its field (unless given) and
    its deprecated spellings (:data:`ALIASES`) beside it; ``%(default)s`` in ``help`` shows it.

    Raises:
        KeyError: ``flag`` is not in :data:`FLAGS` for ``command``.
    """
    field_of(command, flag)  # a flag added here must be in the table
    kwargs.setdefault("default", default(command, flag))
    if isinstance(kwargs["default"], tuple):  # a grid of values, as the flag parses one
        kwargs["default"] = list(kwargs["default"])
    if "help" in kwargs:
        kwargs["help"] = kwargs["help"].replace("%(default)s", shown(kwargs["default"]))
    olds = [old for old, new in ALIASES.get(command, {}).items() if new == flag]
    if olds and kwargs.get("action", "store") == "store":  # Note [both spellings]
        kwargs["action"] = _Spelled
    action = parser.add_argument(flag, **kwargs)
    for old, new in ALIASES.get(command, {}).items():
        if new == flag:
            parser.add_argument(old, dest=action.dest, type=action.type,
                                choices=action.choices, action=_Deprecated, command=command,
                                new=flag, metavar=action.metavar, help=argparse.SUPPRESS)
    return action
