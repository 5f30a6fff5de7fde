"""The command-line flags of ``tiermem plan``, ``tiermem tune`` and examples/train_large.py, each
mapped to the configuration field it sets (Note [one definition] in tiermem/options.py).

A flag that sets a field takes its default (for its command's user) and its check from the
field's definition; the commands spell one field with one flag (``--gpu-bytes`` is
``budgets.gpu_bytes`` in every command). The spellings they used before stay as deprecated
aliases (:data:`ALIASES`): they still work and log a warning naming the flag to use. Flags that
set no configuration field (the model's shape, the grid's own knobs, output options) are in
:data:`UNMAPPED` with the reason. tests/test_options.py checks every flag of the three parsers
is in one of the tables, that each mapped flag's default is its field's and that a bad value is
refused with the field's own message.
"""

from __future__ import annotations

import argparse
import logging
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
}
"""Command -> flag -> the dotted configuration field it sets."""

ALIASES: dict[str, dict[str, str]] = {
    "plan": {"--gpu": "--gpu-bytes", "--host": "--host-bytes", "--nvme": "--nvme-bytes"},
    "tune": {"--gpu-budget": "--gpu-bytes", "--cpu-budget": "--host-bytes",
             "--num-layers": "--offload-layers"},
    "train_large": {"--gpu": "--gpu-bytes"},
}
"""Command -> deprecated flag -> the flag that replaces it (the same field, the same value)."""

UNMAPPED: dict[str, dict[str, str]] = {
    "plan": dict.fromkeys(
        ("--model-size", "--hf-config", "--params", "--layers", "--d-model", "--heads",
         "--vocab", "--seq", "--batch", "--experts", "--top-k", "--d-expert",
         "--eager-attention"), "the model's shape, not a configuration field")
    | {"--dtype": "the planner sizes any dtype, float16 too (train.dtype refuses it)",
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
}
"""Command -> flag -> why it sets no configuration field."""

USER = {"plan": "plan-cli", "tune": "tune", "train_large": None}
"""Command -> the :data:`tiermem.options.USERS` user whose defaults its flags take (None: every
flag defaults to None, the preset's value)."""


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


class _Deprecated(argparse.Action):
    """A deprecated spelling of a flag: sets the same destination and logs a warning (once a
    process per spelling)."""

    def __init__(self, option_strings, dest, *, command: str, new: str, **kwargs) -> None:
        self.command, self.new = command, new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
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
    action = parser.add_argument(flag, **kwargs)
    for old, new in ALIASES.get(command, {}).items():
        if new == flag:
            parser.add_argument(old, dest=action.dest, type=action.type,
                                action=_Deprecated, command=command, new=flag,
                                metavar=action.metavar, help=argparse.SUPPRESS)
    return action
